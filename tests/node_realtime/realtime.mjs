// One text turn with a spoken reply through the OpenAI Node SDK's realtime client (OpenAIRealtimeWS,
// which always dials wss://), unchanged: the gateway's certificate is trusted through the
// NODE_EXTRA_CA_CERTS environment variable, as for any private CA.
//
//   node realtime.mjs https://127.0.0.1:8443/v1 MODEL "Hello there" [max_output_tokens] [max_audio_frames]
//
// Prints one JSON line: {url, events, transcript, audio_bytes, status}; exits 1 on an error event,
// a failed connection or a timeout.
import OpenAI from 'openai';
import { OpenAIRealtimeWS } from 'openai/realtime/ws';

const [baseURL, model, text, maxTokens = '6', maxFrames = '8'] = process.argv.slice(2);
const client = new OpenAI({ apiKey: process.env.OPENAI_API_KEY || 'unused', baseURL });
const rt = new OpenAIRealtimeWS({ model }, client);
const seen = [];
let transcript = '';
let audioBytes = 0;

const fail = (why) => {
  console.error(`realtime client failed: ${why}`);
  process.exit(1);
};
setTimeout(() => fail(`no response.done within 60 s; events: ${seen.join(' ')}`), 60_000).unref();

rt.on('event', (event) => seen.push(event.type));
rt.on('error', (err) => fail(err?.message ?? JSON.stringify(err)));
rt.socket.on('error', (err) => fail(`${err.code ?? ''} ${err.message}`));
rt.socket.on('open', () => {
  rt.send({ type: 'session.update',
            session: { type: 'realtime', temperature: 0,
                       audio: { input: { turn_detection: null }, output: { voice: 'aiden' } } } });
  rt.send({ type: 'conversation.item.create',
            item: { type: 'message', role: 'user', content: [{ type: 'input_text', text }] } });
  // max_audio_frames: voxpipe's cap on the spoken reply (the tiny test model rarely stops by itself)
  rt.send({ type: 'response.create',
            response: { max_output_tokens: Number(maxTokens), max_audio_frames: Number(maxFrames) } });
});
rt.on('response.output_audio.delta', (e) => { audioBytes += Buffer.from(e.delta, 'base64').length; });
rt.on('response.output_audio_transcript.delta', (e) => { transcript += e.delta; });
rt.on('response.done', (e) => {
  console.log(JSON.stringify({ url: rt.url.toString(), events: seen, transcript, audio_bytes: audioBytes,
                               status: e.response.status }));
  rt.close();
  process.exit(0);
});
