#!/usr/bin/env node
// A Node.js client of voxpipe.v1.Gateway/Converse: one text turn in, text and audio out.
//
//   node converse.js HOST:PORT [--text "Hello"] [--voice ethan] [--max-tokens 6] [--max-frames 8]
//                              [--encoding pcm16|float32] [--proto-root DIR]
//
// Loads proto/voxpipe/v1/gateway.proto (which imports stages.proto) at run time and prints one
// JSON line: {"text", "token_count", "audio_samples", "sample_rate", "chunks", "first_offsets_ok",
// "text_finish", "audio_finish", "usage", "request_id"}. Exits 1 with the gRPC status on error.
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

function parseArgs(argv) {
  const opts = {
    address: null, text: "Hello from Node.", voice: "ethan", maxTokens: 6, maxFrames: 8,
    encoding: "pcm16", protoRoot: path.resolve(__dirname, "..", "..", "proto"), timeoutS: 120,
  };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    const next = () => {
      if (i + 1 >= argv.length) throw new Error(`${a} needs a value`);
      return argv[++i];
    };
    if (a === "--text") opts.text = next();
    else if (a === "--voice") opts.voice = next();
    else if (a === "--max-tokens") opts.maxTokens = parseInt(next(), 10);
    else if (a === "--max-frames") opts.maxFrames = parseInt(next(), 10);
    else if (a === "--encoding") opts.encoding = next();
    else if (a === "--proto-root") opts.protoRoot = path.resolve(next());
    else if (a === "--timeout") opts.timeoutS = parseFloat(next());
    else if (!opts.address && !a.startsWith("--")) opts.address = a;
    else throw new Error(`unknown argument ${a}`);
  }
  if (!opts.address) throw new Error("usage: node converse.js HOST:PORT [--text TEXT] ...");
  if (!["pcm16", "float32"].includes(opts.encoding)) throw new Error("--encoding must be pcm16 or float32");
  return opts;
}

function loadGateway(protoRoot) {
  const definition = protoLoader.loadSync("voxpipe/v1/gateway.proto", {
    includeDirs: [protoRoot],
    keepCase: true,      // field names as in the .proto (sample_rate, not sampleRate)
    longs: Number,       // uint64 sample offsets fit in a double for any realistic utterance
    enums: String,
    defaults: true,
    oneofs: true,        // the oneof name says which field is set ("kind": "text" | "audio" | ...)
  });
  return grpc.loadPackageDefinition(definition).voxpipe.v1;
}

function samplesIn(chunk) {
  const bytesPerSample = chunk.encoding === "AUDIO_FLOAT32" ? 4 : 2;
  return chunk.data.length / bytesPerSample;
}

function converse(opts) {
  const v1 = loadGateway(opts.protoRoot);
  const client = new v1.Gateway(opts.address, grpc.credentials.createInsecure());
  const deadline = new Date(Date.now() + opts.timeoutS * 1000);
  return new Promise((resolve, reject) => {
    const call = client.Converse({ deadline });
    const summary = {
      text: "", token_count: 0, audio_samples: 0, sample_rate: 0, chunks: 0, first_offsets_ok: true,
      text_finish: null, audio_finish: null, usage: null, request_id: null,
    };
    let expectedOffset = 0;
    call.on("data", (resp) => {
      switch (resp.kind) {
        case "text":
          summary.text += resp.text.text;
          summary.token_count += resp.text.token_ids.length;
          break;
        case "audio": {
          const chunk = resp.audio;
          const n = samplesIn(chunk);
          if (n !== chunk.num_samples || chunk.sample_offset !== expectedOffset) summary.first_offsets_ok = false;
          expectedOffset += n;
          summary.audio_samples += n;
          summary.sample_rate = chunk.sample_rate;
          summary.chunks += 1;
          break;
        }
        case "done":
          summary.text_finish = resp.done.text_finish;
          summary.audio_finish = resp.done.audio_finish;
          summary.usage = resp.done.usage;
          summary.request_id = resp.done.request_id;
          break;
        case "error":
          summary.error = resp.error;
          break;
        default:
          break;
      }
    });
    call.on("error", (err) => { client.close(); reject(err); });
    call.on("end", () => { client.close(); resolve(summary); });
    call.write({
      start: {
        text: opts.text,
        voice: opts.voice,
        output_modalities: ["MODALITY_TEXT", "MODALITY_AUDIO"],
        sampling: { temperature: 0 },
        max_tokens: opts.maxTokens,
        max_frames: opts.maxFrames,
        audio_encoding: opts.encoding === "float32" ? "AUDIO_FLOAT32" : "AUDIO_PCM16",
      },
    });
    call.end();   // half-close: nothing more to send (a { cancel: {} } message would stop the turn)
  });
}

async function main() {
  let opts;
  try {
    opts = parseArgs(process.argv.slice(2));
  } catch (e) {
    console.error(e.message);
    process.exit(2);
  }
  try {
    const summary = await converse(opts);
    console.log(JSON.stringify(summary));
  } catch (err) {
    const code = err.code !== undefined ? grpc.status[err.code] || err.code : "ERROR";
    console.error(`Converse failed: ${code}: ${err.details || err.message}`);
    process.exit(1);
  }
}

main();
