// Text to speech through the OpenAI Node SDK's client.audio.speech.create, unchanged: the body is
// read as a stream (raw audio, or server-sent events with stream_format "sse").
//
//   node speech.mjs http://127.0.0.1:8000/v1 MODEL "Text to say" FORMAT audio|sse [max_audio_frames]
//
// Prints one JSON line: {content_type, chunks, body (base64 of the audio file: the raw body, or the
// sse deltas' audio joined), events (sse: each event, its audio left out)}; exits 1 on an error.
import OpenAI from 'openai';

const [baseURL, model, input, format, streamFormat, maxFrames = '10'] = process.argv.slice(2);
const client = new OpenAI({ apiKey: process.env.OPENAI_API_KEY || 'unused', baseURL, maxRetries: 0 });

try {
  // max_audio_frames / ignore_eos / temperature: voxpipe's extensions (a fixed length on the tiny test model)
  const response = await client.audio.speech.create({
    model, input, voice: 'aiden', response_format: format, stream_format: streamFormat,
    max_audio_frames: Number(maxFrames), ignore_eos: true, temperature: 0,
  });
  const parts = [];
  let chunks = 0;
  for await (const chunk of response.body) {
    parts.push(Buffer.from(chunk));
    chunks += 1;
  }
  const raw = Buffer.concat(parts);
  const out = { content_type: response.headers.get('content-type'), chunks, events: [] };
  if (streamFormat === 'sse') {
    const audio = [];
    for (const line of raw.toString('utf8').split('\n')) {
      if (!line.startsWith('data: ')) continue;
      const event = JSON.parse(line.slice(6));
      if (event.type === 'speech.audio.delta') {
        audio.push(Buffer.from(event.audio, 'base64'));
        delete event.audio;
      }
      out.events.push(event);
    }
    out.body = Buffer.concat(audio).toString('base64');
  } else {
    out.body = raw.toString('base64');
  }
  console.log(JSON.stringify(out));
} catch (err) {
  console.error(`speech failed: ${err?.status ?? ''} ${err?.message ?? err}`);
  process.exit(1);
}
