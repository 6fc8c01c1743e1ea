"""POST /v1/chat/completions, as OpenAI's: text or text + audio out, streamed (SSE) or not.

Audio replies: `message.audio = {id, data, expires_at, transcript}` with `content` null; in a
stream, `delta.audio` pieces carry the transcript and pcm16 24 kHz data as soon as each exists
(id and expires_at in the first). The id names the reply's transcript in later turns.

With `tools` (tool_params.py), the prompt lists them and the reply's calls (tools.py) come as
`message.tool_calls` / `delta.tool_calls` (index, id, type and name with empty arguments as soon as
a block's JSON names a tool, then the arguments as they are written) with `finish_reason:
"tool_calls"` ("length" when max_tokens cut the reply); only the text outside the calls is
`content` (and the transcript of an audio reply). The SDK's accumulation of a stream is the
completion of the same reply, but for a block the model opened as a call in tool_choice 'auto'
and then wrote as invalid JSON (or max_tokens cut): the stream has sent its head and arguments, so
it stays a call there; the completion returns it as content, as written, with the finish_reason of
text ("stop" / "length"), as vLLM does (tools.py). A reply that is only calls asks nothing of the
talker: no audio.

`stop` ends the text and the speech (matched in the thinker, services/thinker/output.py);
`logprobs` / `top_logprobs` fill `choices[].logprobs.content` in the completion and in each
chunk (a token without text of its own rides with the next text); every other parameter is
served, accepted as a no-op or refused naming it (chat_parameters.py)."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, replace

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from voxpipe.client import AudioEvent, DoneEvent, PipelineError, SpeechRequest, TextEvent, TokenLogprob
from voxpipe.v1 import stages_pb2 as pb

from voxpipe.services.runtime.echo import quoted

from . import audio_formats
from .state import GatewayState, gateway_state
from .chat_messages import parse_messages
from .chat_parameters import cache_key_session, check_parameters, stop_strings, stream_options, top_logprobs
from .errors import bad_request, from_pipeline_error
from .generation import PipelineEvent, read_until_admitted, render_prompt, run_pipeline, speech_request
from .response_format import check_response_format, reply_constraint, response_format
from .params import GenerationParams, check_model, generation_params, optional, read_json, resolve_voice
from .streaming import CancellableStream, prepended, read_ahead, sse, until_disconnect
from .tool_params import ToolOptions, check_tool_constraint, tool_options
from .tools import ArgumentsDelta, CallPiece, CallStart, ContentPiece, ReplyPiece

router = APIRouter()
CHAT_AUDIO_FORMATS = ("wav", "mp3", "flac", "opus", "aac", "pcm16")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class ChatOptions:
    audio_out: bool
    voice: str
    audio_format: str
    stream: bool
    include_usage: bool
    params: GenerationParams
    tools: ToolOptions = ToolOptions()
    calls_constrained: bool = False     # params.constraint is the tools' (tool_params.tool_call_constraint)
    session: str | None = None          # the routing session of its prompt_cache_key (None: by prefix)


def chat_options(body: dict, st: GatewayState) -> ChatOptions:
    check_model(body, st.config.model_id)
    check_parameters(body)
    modalities = optional(body, "modalities", list, ["text"])
    if not modalities or any(m not in ("text", "audio") for m in modalities):
        raise bad_request(f"'modalities' must be ['text'] or ['text', 'audio'], got {quoted(modalities)}", param="modalities",
                          code="invalid_value")
    audio_out = "audio" in modalities
    stream = optional(body, "stream", bool, False)
    voice, fmt = "", "pcm16"
    if audio_out:
        audio = body.get("audio")
        if not isinstance(audio, dict):
            raise bad_request("audio output needs 'audio': {'voice': ..., 'format': ...}", param="audio",
                              code="missing_required_parameter")
        voice = resolve_voice(audio.get("voice"), st.speakers, "audio.voice")
        fmt = audio.get("format")
        if fmt not in CHAT_AUDIO_FORMATS:
            raise bad_request(f"'audio.format' must be one of {', '.join(CHAT_AUDIO_FORMATS)}, got {quoted(fmt)}",
                              param="audio.format", code="invalid_value")
        if stream and fmt != "pcm16":
            raise bad_request(f"streaming audio supports only the 'pcm16' format, got {quoted(fmt)}",
                              param="audio.format", code="unsupported_value")
    include_usage = stream_options(body, stream)
    tools = tool_options(body)
    structured = response_format(body)
    constraint = reply_constraint(structured, tools, st.config.constrain_tool_calls)
    calls = constraint if structured is None else None
    params = replace(generation_params(body), stop=stop_strings(body), top_logprobs=top_logprobs(body),
                     constraint=constraint)
    if params.constraint is not None and params.min_tokens:
        what = "response_format" if structured is not None else "tool_choice" if tools.calls_only else "tools"
        why = "" if structured is not None or tools.calls_only else \
            " (this server constrains the calls of tool_choice 'auto': --constrain-tool-calls)"
        raise bad_request(f"'{what}' excludes 'min_tokens' / 'ignore_eos': a constrained reply ends when "
                          f"it is complete{why}", param=what, code="invalid_value")
    return ChatOptions(audio_out=audio_out, voice=voice, audio_format=fmt, stream=stream,
                       include_usage=include_usage, params=params, tools=tools, calls_constrained=calls is not None,
                       session=cache_key_session(body))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    arrived = time.perf_counter()
    st = gateway_state(request)
    body = await read_json(request, st.config.max_body_bytes)
    opts = chat_options(body, st)
    if opts.calls_constrained:
        await check_tool_constraint(opts.tools, opts.params.constraint)
    else:
        await check_response_format(opts.params.constraint)
    session, handed_over = st.sessions.acquire("http"), False
    try:
        messages = await asyncio.to_thread(parse_messages, body.get("messages"), st.transcripts, st.clips)
        prompt = await render_prompt(st, messages, tools=opts.tools.prompt_tools)
        req = speech_request(prompt, opts.params, opts.voice, opts.audio_out, tool_calls=opts.tools.parses_calls,
                             calls_only=opts.tools.calls_only, session=opts.session)
        reply = Reply(st, opts, req, arrived, count_audio_tokens(st, prompt.token_ids))
        if opts.stream:  # the response releases the session when it closes
            events = run_pipeline(st, req, arrived)
            try:  # every stage's checks first: a refusal is still an HTTP error status, as without stream
                head = await read_ahead(request.receive, events, read_until_admitted(events, req.audio))
            except ClientDisconnect:
                return Response(status_code=499)
            handed_over = True
            return CancellableStream(reply.sse(prepended(head, events)), on_close=session.release,
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        try:
            return JSONResponse(await until_disconnect(request.receive, reply.completion()))
        except ClientDisconnect:
            return Response(status_code=499)
    finally:
        if not handed_over:
            session.release()


def openai_logprob(e: TokenLogprob) -> dict:
    """One `logprobs.content[]` entry: the token's text (a part of a character shows as U+FFFD;
    `bytes` has it exactly), its log probability and the top alternatives."""
    return {"token": e.token.decode("utf-8", errors="replace"), "logprob": e.logprob, "bytes": list(e.token),
            "top_logprobs": [{"token": t.token.decode("utf-8", errors="replace"), "logprob": t.logprob,
                              "bytes": list(t.token)} for t in e.top]}


def count_audio_tokens(st: GatewayState, token_ids: list[int]) -> int:
    pad = st.omni.thinker.tokens.audio_token
    return sum(1 for t in token_ids if t == pad)


class Reply:
    """One assistant reply to a chat request, as a whole completion or as chunks."""

    def __init__(self, st: GatewayState, opts: ChatOptions, req: SpeechRequest, arrived: float,
                 prompt_audio_tokens: int) -> None:
        self.st, self.opts, self.req, self.arrived = st, opts, req, arrived
        self.prompt_audio_tokens = prompt_audio_tokens
        self.id = f"chatcmpl-{req.request_id}"
        self.created = int(time.time())
        self.audio_id, self.expires_at = st.transcripts.new_id()
        # a reply read for calls goes through the parser; otherwise all of it is content. A whole
        # reply (not streamed) judges a free block by all of its JSON: not a call -> content
        self.parser = opts.tools.parser(whole=not opts.stream, constrained_blocks=opts.calls_constrained)

    def envelope(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.st.config.model_id,
                "system_fingerprint": None}

    def finish_reason(self, done: DoneEvent, called: bool = False) -> str:
        length = done.text_finish == pb.LENGTH or (self.req.audio and done.audio_finish == pb.LENGTH)
        return "length" if length else "tool_calls" if called else "stop"

    def usage(self, done: DoneEvent) -> dict:
        audio_tokens = done.frames if self.opts.audio_out else 0
        completion = done.completion_tokens + audio_tokens
        return {"prompt_tokens": done.prompt_tokens, "completion_tokens": completion,
                "total_tokens": done.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": done.cached_tokens,
                                          "audio_tokens": self.prompt_audio_tokens},
                "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": audio_tokens,
                                              "text_tokens": done.completion_tokens,
                                              "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}}

    def logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        """OpenAI's `choices[].logprobs` for these tokens (None when the request did not ask)."""
        if self.opts.params.top_logprobs is None:
            return None
        return {"content": [openai_logprob(e) for e in entries], "refusal": None}

    async def completion(self) -> dict:
        text, pcm, done, logprobs = [], bytearray(), None, []
        async with aclosing(run_pipeline(self.st, self.req, self.arrived)) as events:
            async for ev in events:
                if isinstance(ev, TextEvent):
                    text.append(ev.text)
                    logprobs += ev.logprobs
                elif isinstance(ev, AudioEvent):
                    pcm += ev.data
                elif isinstance(ev, DoneEvent):
                    done = ev
        pieces = self.pieces("".join(text), last=True)
        transcript = "".join(p.text for p in pieces if isinstance(p, ContentPiece))
        calls = [{k: v for k, v in openai_call(p).items() if k != "index"} for p in pieces if isinstance(p, CallPiece)]
        message = {"role": "assistant", "content": transcript if transcript or not calls else None, "refusal": None,
                   "annotations": []}
        if calls:
            message["tool_calls"] = calls
        if self.opts.audio_out and not self.req.audio:     # only calls: nothing was spoken
            message["content"] = None
        elif self.opts.audio_out:
            rate = self.st.omni.code2wav.sample_rate
            data = await asyncio.to_thread(audio_formats.encode, bytes(pcm), rate, self.opts.audio_format)
            self.st.transcripts.put(self.audio_id, transcript, self.expires_at)
            message["content"] = None
            message["audio"] = {"id": self.audio_id, "data": base64.b64encode(data).decode(),
                                "expires_at": self.expires_at, "transcript": transcript}
        return {**self.envelope("chat.completion"),
                "choices": [{"index": 0, "message": message, "logprobs": self.logprobs(logprobs),
                             "finish_reason": self.finish_reason(done, bool(calls))}],
                "usage": self.usage(done)}

    def chunk(self, delta: dict, finish_reason: str | None = None, logprobs: list[TokenLogprob] | None = None) -> str:
        return sse({**self.envelope("chat.completion.chunk"),
                    "choices": [{"index": 0, "delta": delta, "logprobs": self.logprobs(logprobs) if logprobs else None,
                                 "finish_reason": finish_reason}]})

    def pieces(self, text: str, last: bool = False) -> list[ReplyPiece]:
        if self.parser is None:
            return [ContentPiece(text)] if text else []
        return self.parser.push(text) + (self.parser.finish() if last else [])

    def piece_deltas(self, piece: ReplyPiece, first_audio: dict) -> list[dict]:
        """The deltas of one piece: content (or an audio transcript), a call's head (index, id,
        type and name with empty arguments) or a piece of its arguments, or a whole call in two."""
        if isinstance(piece, CallStart):
            return [{"tool_calls": [{"index": piece.index, "id": piece.id, "type": "function",
                                     "function": {"name": piece.name, "arguments": ""}}]}]
        if isinstance(piece, ArgumentsDelta):
            return [{"tool_calls": [{"index": piece.index, "function": {"arguments": piece.text}}]}]
        if isinstance(piece, CallPiece) and piece.streamed:
            return []
        if isinstance(piece, CallPiece):
            call = openai_call(piece)
            head = {**call, "function": {"name": call["function"]["name"], "arguments": ""}}
            return [{"tool_calls": [head]},
                    {"tool_calls": [{"index": piece.index, "function": {"arguments": call["function"]["arguments"]}}]}]
        if not self.opts.audio_out:
            return [{"content": piece.text}]
        return [{"audio": {**first_audio, "transcript": piece.text}}]

    async def sse(self, run: AsyncIterator[PipelineEvent]):
        """The chunks of `run`, the pipeline run of this reply."""
        yield self.chunk({"role": "assistant", "content": None if self.opts.audio_out else "", "refusal": None})
        first_audio = {"id": self.audio_id, "expires_at": self.expires_at}
        transcript, done, called = [], None, False
        logprobs: list[TokenLogprob] = []     # of tokens not sent yet (those without text wait for text)
        try:
            async with aclosing(run) as events:
                async for ev in events:
                    pieces: list[ReplyPiece] = []
                    deltas: list[dict] = []
                    if isinstance(ev, DoneEvent):       # the last event: what the parser held back
                        done, pieces = ev, self.pieces("", last=True)
                    elif isinstance(ev, TextEvent):
                        logprobs += ev.logprobs
                        pieces = self.pieces(ev.text)
                    elif isinstance(ev, AudioEvent) and ev.data:
                        deltas.append({"audio": {**first_audio, "data": base64.b64encode(ev.data).decode()}})
                    for piece in pieces:
                        deltas += self.piece_deltas(piece, first_audio)
                        if isinstance(piece, ContentPiece):
                            transcript.append(piece.text)
                        else:
                            called = True
                    for delta in deltas:
                        sent, logprobs = logprobs, []
                        yield self.chunk(delta, logprobs=sent)
                        if "audio" in delta:
                            first_audio = {}
        except PipelineError as e:
            yield sse(from_pipeline_error(e).body())
            return
        if self.opts.audio_out:
            self.st.transcripts.put(self.audio_id, "".join(transcript), self.expires_at)
        yield self.chunk({}, self.finish_reason(done, called), logprobs=logprobs)
        if self.opts.include_usage:
            yield sse({**self.envelope("chat.completion.chunk"), "choices": [], "usage": self.usage(done)})
        yield sse("[DONE]")


def openai_call(piece: CallPiece) -> dict:
    """A call as OpenAI's `tool_calls[]` entry (with its index, as in a stream's delta)."""
    c = piece.call
    return {"index": piece.index, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
