// voxpipe voice console: microphone -> /v1/realtime (OpenAI Realtime GA events, server VAD) -> speakers.
// The server finds the turns (speech_started / speech_stopped), answers each and cancels its answer
// when the user speaks over it; the page plays the audio deltas, stops playback on barge-in, and
// shows both transcripts and, per turn, the time from speech_stopped to the first reply audio heard.
"use strict";

const RATE = 24000;                    // audio/pcm both ways: 16-bit little-endian mono at 24 kHz
const SEND_SAMPLES = RATE / 25;        // 40 ms of microphone audio per input_audio_buffer.append
const API_KEY_PROTOCOL = "openai-insecure-api-key.";   // how browser clients pass the key (no headers)
const TRANSCRIPTION_UPDATE = "console-transcription";  // event_id of the session.update asking for it

const $ = (id) => document.getElementById(id);

// ------------------------------------------------------------------------------------------ audio

/** Linear interpolation from one rate to another, over a stream that arrives in blocks. */
class Resampler {
  constructor(from, to) {
    this.step = from / to;
    this.pos = 0;      // where the next output sample falls, in input samples from the block's start
    this.last = 0;     // the previous block's last sample (position -1)
  }

  push(input) {
    const n = input.length;
    const count = this.pos <= n - 1 ? Math.floor((n - 1 - this.pos) / this.step) + 1 : 0;
    const out = new Float32Array(count);
    for (let k = 0; k < count; k++, this.pos += this.step) {
      const i = Math.floor(this.pos);
      const a = i < 0 ? this.last : input[i];
      const b = i + 1 < n ? input[i + 1] : a;
      out[k] = a + (b - a) * (this.pos - i);
    }
    this.pos -= n;
    if (n) this.last = input[n - 1];
    return out;
  }
}

function pcm16Base64(samples) {
  const view = new DataView(new ArrayBuffer(samples.length * 2));
  samples.forEach((x, i) => view.setInt16(i * 2, Math.round(Math.max(-1, Math.min(1, x)) * 32767), true));
  const bytes = new Uint8Array(view.buffer);
  let text = "";
  for (let i = 0; i < bytes.length; i += 0x8000) text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(text);
}

function pcm16Samples(base64) {
  const bytes = Uint8Array.from(atob(base64), (c) => c.charCodeAt(0));
  const view = new DataView(bytes.buffer);
  const out = new Float32Array(bytes.length >> 1);
  for (let i = 0; i < out.length; i++) out[i] = view.getInt16(i * 2, true) / 32768;
  return out;
}

/** Plays 24 kHz chunks back to back; stop() silences everything scheduled (barge-in). */
class Player {
  constructor(ctx, onPlayed) {
    this.ctx = ctx;
    this.onPlayed = onPlayed;   // called with the number of samples heard, as each chunk ends
    this.next = 0;              // context time where the next chunk starts
    this.chunks = new Set();    // scheduled and not yet ended
    this.reply = [];            // the chunks of the reply playing now: what barge-in truncates
  }

  /** Schedules `samples`; returns the context time at which they start. */
  play(samples) {
    const buffer = this.ctx.createBuffer(1, samples.length, RATE);
    buffer.copyToChannel(samples, 0);
    const source = this.ctx.createBufferSource();
    source.buffer = buffer;
    source.connect(this.ctx.destination);
    const chunk = { source, start: Math.max(this.next, this.ctx.currentTime), duration: buffer.duration };
    source.onended = () => {
      this.chunks.delete(chunk);
      this.onPlayed(Math.round(this.heard(chunk) * RATE));
    };
    source.start(chunk.start);
    this.next = chunk.start + chunk.duration;
    this.chunks.add(chunk);
    this.reply.push(chunk);
    return chunk.start;
  }

  heard(chunk) {
    const now = chunk.stoppedAt === undefined ? this.ctx.currentTime : chunk.stoppedAt;
    return Math.max(0, Math.min(chunk.duration, now - chunk.start));
  }

  get playing() {
    return this.chunks.size > 0;
  }

  newReply() {
    this.reply = [];
  }

  /** Stops playback; returns the milliseconds of the current reply that were heard. */
  stop() {
    const heardMs = Math.floor(this.reply.reduce((sum, c) => sum + this.heard(c), 0) * 1000);
    for (const chunk of this.chunks) {
      chunk.stoppedAt = this.ctx.currentTime;
      chunk.source.stop();
    }
    this.next = 0;
    return heardMs;
  }
}

// ------------------------------------------------------------------------------------------ page

/** One exchange in the conversation list: what the user said, the reply, the latency. */
class Turn {
  constructor(list, withUser) {
    this.element = document.createElement("li");
    this.element.className = "turn";
    this.element.dataset.state = withUser ? "listening" : "replying";
    this.user = withUser ? this.line("You", "speaking…") : null;
    this.assistant = null;
    this.userText = "";
    this.replied = false;        // a response was created for this turn
    this.speechStopped = null;   // performance.now() at speech_stopped
    list.append(this.element);
    this.element.scrollIntoView({ block: "nearest" });
  }

  line(who, pending) {
    const p = document.createElement("p");
    const name = document.createElement("span");
    name.className = "who";
    name.textContent = `${who}:`;
    const text = document.createElement("span");
    text.className = "pending";
    text.textContent = pending;
    p.append(name, text);
    this.element.append(p);
    return text;
  }

  get state() {
    return this.element.dataset.state;
  }

  set state(value) {
    this.element.dataset.state = value;
  }

  setUser(text, final) {
    if (!this.user) return;
    this.user.textContent = text || (final ? "(nothing recognised)" : "(spoken)");
    this.user.className = final ? "" : "pending";
  }

  /** The reply ended: one that spoke with no transcript text still gets its line. */
  endReply(spoke) {
    if (spoke && !this.assistant) this.line("Model", "(audio without a transcript)");
  }

  appendReply(delta) {
    if (!this.assistant) this.assistant = this.line("Model", "");
    this.assistant.className = "";
    this.assistant.textContent += delta;
  }

  /** The user spoke over the reply: `heardMs` of it had played when playback stopped. */
  interrupt(heardMs) {
    this.state = "interrupted";
    this.element.dataset.heardMs = String(heardMs);
    const p = document.createElement("p");
    p.className = "latency";
    p.textContent = `Interrupted after ${(heardMs / 1000).toFixed(1)} s of audio`;
    this.element.append(p);
  }

  addUserDelta(delta) {
    this.userText += delta;
    this.setUser(this.userText, false);
  }

  setLatency(ms) {
    this.element.dataset.latencyMs = String(Math.round(ms));
    const p = document.createElement("p");
    p.className = "latency";
    p.textContent = `First audio ${Math.round(ms)} ms after the end of your speech`;
    this.element.append(p);
  }
}

class Console {
  constructor() {
    this.form = $("session");
    this.startButton = $("start");
    this.stopButton = $("stop");
    this.status = $("status");
    this.turns = $("turns");
    this.played = $("played");
    this.ws = null;
    this.form.addEventListener("submit", (e) => {
      e.preventDefault();
      this.start();
    });
    this.stopButton.addEventListener("click", () => this.stop("Stopped."));
  }

  say(text, error = false) {
    this.status.textContent = text;
    this.status.classList.toggle("error", error);
  }

  /** The reply settings of the form (the form only submits when they are in range). */
  limits() {
    const out = {};
    for (const [id, field] of [["max-tokens", "max_output_tokens"], ["max-frames", "max_audio_frames"]]) {
      const value = $(id).valueAsNumber;
      if (Number.isInteger(value) && value > 0) out[field] = value;
    }
    const temperature = $("temperature").valueAsNumber;
    if (Number.isFinite(temperature)) out.temperature = temperature;
    return out;
  }

  async start() {
    if (!window.isSecureContext || !navigator.mediaDevices) {
      this.say("Browsers give the microphone only to https:// pages and http://localhost: open the console " +
               "that way (the gateway's --ssl-certfile, or an SSH tunnel to localhost).", true);
      return;
    }
    this.startButton.disabled = true;
    this.stopButton.disabled = false;
    this.opened = false;
    this.turn = null;          // the latest turn
    this.turnsByItem = new Map();
    this.reply = null;         // the response in progress: {turn, itemId, samples, interrupted}
    this.playingItem = null;   // {itemId, samples, turn} of the last reply whose audio was scheduled
    this.truncateAfter = null; // {itemId, ms}: truncate once that reply's response is done
    this.playedSamples = 0;
    this.ctx = new AudioContext();     // in the click: allowed to play
    try {
      await this.ctx.resume();
      await this.ctx.audioWorklet.addModule("console/capture-worklet.js");
    } catch (e) {
      this.stop(`This browser cannot capture audio here: ${e.message}`, true);
      return;
    }
    this.player = new Player(this.ctx, (n) => this.countPlayed(n));
    this.connect($("api-key").value.trim());
  }

  connect(key) {
    const url = new URL("v1/realtime", location.href);
    url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
    const protocols = ["realtime"];
    if (key) protocols.push(API_KEY_PROTOCOL + key);
    try {
      this.ws = new WebSocket(url, protocols);
    } catch (e) {          // a key a WebSocket subprotocol cannot carry
      this.stop(`Cannot send this API key: ${e.message}`, true);
      return;
    }
    this.say("Connecting…");
    this.ws.onmessage = (m) => this.onEvent(JSON.parse(m.data));
    this.ws.onclose = (e) => {
      if (this.ws === null) return;
      if (!this.opened) {
        this.stop("The gateway refused the connection" + (key ? " (is the API key right?)" :
                  " (does it need an API key?)") + ".", true);
      } else {
        this.stop(`Disconnected (${e.code}${e.reason ? `: ${e.reason}` : ""}).`, e.code !== 1000);
      }
    };
  }

  stop(message, error = false) {
    const ws = this.ws;
    this.ws = null;
    if (ws) ws.close(1000);
    if (this.player) this.player.stop();
    if (this.mic) this.mic.getTracks().forEach((t) => t.stop());
    if (this.ctx) this.ctx.close();
    this.mic = this.ctx = this.player = null;
    this.startButton.disabled = false;
    this.stopButton.disabled = true;
    this.say(message, error);
  }

  send(type, fields = {}) {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) this.ws.send(JSON.stringify({ type, ...fields }));
  }

  /** The microphone, from the moment the session is open: every sample reaches the server. */
  async listen() {
    try {
      this.mic = await navigator.mediaDevices.getUserMedia(
        { audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true } });
    } catch (e) {
      this.stop(`No microphone: ${e.message}`, true);
      return;
    }
    if (!this.ctx) {                      // stopped meanwhile
      this.mic.getTracks().forEach((t) => t.stop());
      this.mic = null;
      return;
    }
    const source = this.ctx.createMediaStreamSource(this.mic);
    const tap = new AudioWorkletNode(this.ctx, "voxpipe-capture");
    const resampler = new Resampler(this.ctx.sampleRate, RATE);
    let pending = new Float32Array(0);
    tap.port.onmessage = (e) => {
      const more = resampler.push(e.data);
      const joined = new Float32Array(pending.length + more.length);
      joined.set(pending);
      joined.set(more, pending.length);
      let at = 0;
      for (; joined.length - at >= SEND_SAMPLES; at += SEND_SAMPLES) {
        this.send("input_audio_buffer.append", { audio: pcm16Base64(joined.subarray(at, at + SEND_SAMPLES)) });
      }
      pending = joined.slice(at);
    };
    source.connect(tap);
    tap.connect(this.ctx.destination);   // pulls the tap; it outputs silence
    this.say("Listening — speak when you are ready.");
  }

  countPlayed(n) {
    this.playedSamples += n;
    this.played.dataset.samples = String(this.playedSamples);
    this.played.textContent = `${(this.playedSamples / RATE).toFixed(1)} s`;
  }

  turnFor(itemId) {
    return this.turnsByItem.get(itemId) || null;
  }

  onEvent(ev) {
    switch (ev.type) {
      case "session.created":
        this.opened = true;
        this.send("session.update", { session: { type: "realtime", ...this.limits(),
          audio: { input: { turn_detection: { type: "server_vad" } } } } });
        this.send("session.update", { event_id: TRANSCRIPTION_UPDATE, session: { type: "realtime",
          audio: { input: { transcription: { model: ev.session.model } } } } });
        this.listen();
        break;
      case "input_audio_buffer.speech_started":
        this.bargeIn();
        this.turn = new Turn(this.turns, true);
        this.turnsByItem.set(ev.item_id, this.turn);
        break;
      case "input_audio_buffer.speech_stopped": {
        const turn = this.turnFor(ev.item_id);
        if (turn) {
          turn.speechStopped = performance.now();
          turn.state = "waiting";
          turn.setUser("(spoken)", false);     // until its transcript comes, if the server makes one
        }
        break;
      }
      case "conversation.item.input_audio_transcription.delta": {
        const turn = this.turnFor(ev.item_id);
        if (turn) turn.addUserDelta(ev.delta);
        break;
      }
      case "conversation.item.input_audio_transcription.completed": {
        const turn = this.turnFor(ev.item_id);
        if (turn) turn.setUser(ev.transcript, true);
        break;
      }
      case "response.created":
        if (!this.turn || this.turn.replied) this.turn = new Turn(this.turns, false);
        this.turn.replied = true;
        this.turn.state = "replying";
        this.reply = { turn: this.turn, itemId: null, samples: 0, interrupted: false };
        break;
      case "response.output_item.added":
        if (this.reply && ev.item.type === "message") this.reply.itemId = ev.item.id;   // its spoken item (not a call)
        break;
      case "response.output_audio.delta":
        if (this.reply && !this.reply.interrupted) this.playDelta(this.reply, pcm16Samples(ev.delta));
        break;
      case "response.output_audio_transcript.delta":
      case "response.output_text.delta":
        if (this.reply) this.reply.turn.appendReply(ev.delta);
        break;
      case "response.done":
        this.finishReply(ev.response);
        break;
      case "error":
        if (ev.event_id === TRANSCRIPTION_UPDATE) {
          this.say(`Listening (no transcript of your side: ${ev.error.message})`);
        } else {
          this.say(`Error from the gateway: ${ev.error.message}`, true);
        }
        break;
    }
  }

  playDelta(reply, samples) {
    if (reply.samples === 0) this.player.newReply();
    const start = this.player.play(samples);
    if (reply.samples === 0 && reply.turn.speechStopped !== null) {
      const wait = (start - this.ctx.currentTime + (this.ctx.outputLatency || 0)) * 1000;
      reply.turn.setLatency(performance.now() - reply.turn.speechStopped + wait);
    }
    reply.samples += samples.length;
    reply.turn.element.dataset.audioMs = String(Math.floor((reply.samples * 1000) / RATE));
    this.playingItem = { itemId: reply.itemId, samples: reply.samples, turn: reply.turn };
  }

  /** The user speaks: silence the reply and, once its response is over, cut its item to what was heard. */
  bargeIn() {
    const audible = this.player && (this.player.playing || (this.reply && this.reply.samples > 0));
    if (!audible || !this.playingItem) return;
    const { itemId, samples, turn } = this.playingItem;
    const ms = Math.min(this.player.stop(), Math.floor((samples * 1000) / RATE));
    turn.interrupt(ms);
    if (this.reply && this.reply.itemId === itemId) {   // the server cancels it; what still comes is not played
      this.reply.interrupted = true;
      this.truncateAfter = { itemId, ms };
    } else if (itemId) {
      this.send("conversation.item.truncate", { item_id: itemId, content_index: 0, audio_end_ms: ms });
    }
    this.playingItem = null;
  }

  finishReply(response) {
    const reply = this.reply;
    this.reply = null;
    if (!reply) return;
    if (reply.turn.state !== "interrupted") {     // cancelled by the server: the user spoke before any audio
      reply.turn.state = { cancelled: "interrupted", failed: "failed" }[response.status] || "done";
    }
    reply.turn.endReply(reply.samples > 0);
    const cut = this.truncateAfter;
    if (cut && cut.itemId === reply.itemId) {
      this.truncateAfter = null;
      this.send("conversation.item.truncate", { item_id: cut.itemId, content_index: 0, audio_end_ms: cut.ms });
    }
    if (response.status === "failed" && response.status_details && response.status_details.error) {
      this.say(`The reply failed: ${response.status_details.error.message}`, true);
    }
  }
}

window.addEventListener("DOMContentLoaded", () => new Console());
