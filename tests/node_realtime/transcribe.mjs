// Input audio transcription through the OpenAI Node SDK's realtime client (OpenAIRealtimeWS, which
// always dials wss://; the gateway's certificate is trusted through NODE_EXTRA_CA_CERTS): the
// session asks for transcription by the served model, the client appends a pcm16 clip, commits it
// and waits for the transcription.
//
//   node transcribe.mjs https://127.0.0.1:8443/v1 MODEL CLIP.pcm16
//
// Prints one JSON line: {events, item_id, deltas, transcript, usage}; exits 1 on an error event,
// a failed transcription, a failed connection or a timeout.
import { readFileSync } from 'node:fs';
import OpenAI from 'openai';
import { OpenAIRealtimeWS } from 'openai/realtime/ws';

const [baseURL, model, clipPath] = process.argv.slice(2);
const clip = readFileSync(clipPath);
const client = new OpenAI({ apiKey: process.env.OPENAI_API_KEY || 'unused', baseURL });
const rt = new OpenAIRealtimeWS({ model }, client);
const seen = [];
let deltas = '';

const fail = (why) => {
  console.error(`realtime client failed: ${why}`);
  process.exit(1);
};
setTimeout(() => fail(`no transcription within 60 s; events: ${seen.join(' ')}`), 60_000).unref();

rt.on('event', (event) => seen.push(event.type));
rt.on('error', (err) => fail(err?.message ?? JSON.stringify(err)));
rt.socket.on('error', (err) => fail(`${err.code ?? ''} ${err.message}`));
rt.socket.on('open', () => {
  rt.send({ type: 'session.update',
            session: { type: 'realtime', output_modalities: ['text'],
                       audio: { input: { turn_detection: null, transcription: { model } } } } });
});
rt.on('session.updated', () => {
  for (let i = 0; i < clip.length; i += 9600) {
    rt.send({ type: 'input_audio_buffer.append', audio: clip.subarray(i, i + 9600).toString('base64') });
  }
  rt.send({ type: 'input_audio_buffer.commit' });
});
rt.on('conversation.item.input_audio_transcription.delta', (e) => { deltas += e.delta; });
rt.on('conversation.item.input_audio_transcription.failed', (e) => fail(JSON.stringify(e.error)));
rt.on('conversation.item.input_audio_transcription.completed', (e) => {
  console.log(JSON.stringify({ events: seen, item_id: e.item_id, deltas, transcript: e.transcript,
                               usage: e.usage }));
  rt.close();
  process.exit(0);
});
