"""The gateway's gRPC pipeline API: `voxpipe.v1.Gateway/Converse` (proto/voxpipe/v1/gateway.proto).

One call is one conversation turn: ConverseStart (text and/or audio in, voice, output modalities,
sampling, lengths, tools, a response format) -> text deltas and 24 kHz audio chunks as the
pipeline makes them -> Done. Tools and a JSON response format become the thinker's constraint by
chat completions' code (tool_params.py, response_format.py): the same checks, the same reply.
A Cancel message, or the client cancelling the call, stops the turn and frees it in every stage.
With --api-key, a call needs `authorization: Bearer KEY` metadata (UNAUTHENTICATED otherwise).
Served with grpc.health.v1 and (with --reflection) server reflection on the gateway's
--grpc-port, on --host; request messages that do not parse are INVALID_ARGUMENT (rpc_guard). The
health status follows /ready: SERVING while every thinker and code2wav replica is, NOT_SERVING
otherwise (re-checked every READY_POLL_S). A turn cancelled by the client still ends with a Done
whose usage is complete: prompt tokens as rendered, text tokens and audio samples sent, and the
codec frames of that audio.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2
from opentelemetry import context as otel_context

from voxpipe.audio import resample
from voxpipe.client import AudioEvent, DoneEvent, PipelineError, SpeechRequest, TextEvent
from voxpipe.services.runtime import tracing
from voxpipe.services.runtime.calls import ClientGone, abort
from voxpipe.services.runtime.echo import quoted
from voxpipe.services.runtime.logs import REQUEST_ID, AccessRecord, log_access
from voxpipe.services.runtime.config import OmniConfig
from voxpipe.services.runtime.rpc_guard import Abort, RequestGuard
from voxpipe.services.runtime.listen import GRPC_SERVER_OPTIONS
from voxpipe.services.runtime.server import add_health_and_reflection, bind_grpc
from voxpipe.services.thinker.constraint import MAX_CONSTRAINT_BYTES, Constraint, ConstraintKind
from voxpipe.services.thinker.output import stop_strings_problem, top_logprobs_problem
from voxpipe.services.thinker.prompt import (FEATURE_SAMPLE_RATE, ChatMessage, ChatPart, ToolCall, user_turn,
                                             with_instructions)
from voxpipe.v1 import gateway_pb2 as gw
from voxpipe.v1 import gateway_pb2_grpc as gw_grpc
from voxpipe.v1 import stages_pb2 as pb

from .audio_formats import decode_clip
from .admission import AtCapacity
from .errors import APIError
from .generation import render_now, run_pipeline
from .health import readiness
from .limits import AUDIO_RATES, audio_problem
from .response_format import check_response_format, reply_constraint, schema_constraint
from .state import authorized
from .tool_params import ToolOptions, check_schema, check_tool_constraint, function_tool
from .tools import ArgumentsDelta, CallPiece, CallStart, ContentPiece

log = logging.getLogger(__name__)

SERVICE_NAME = "voxpipe.v1.Gateway"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_VOICE = "ethan"


class InvalidInput(ValueError):
    """The client's ConverseStart is unusable; becomes INVALID_ARGUMENT."""


@dataclass
class ConverseTurn:
    messages: list[ChatMessage]
    speech: SpeechRequest                         # token_ids filled in by render()
    tools: ToolOptions = ToolOptions()
    response_format: Constraint | None = None     # ConverseStart.response_format's (None: free text)


RESPONSE_FORMATS = (gw.RESPONSE_FORMAT_TEXT, gw.RESPONSE_FORMAT_JSON_OBJECT, gw.RESPONSE_FORMAT_JSON_SCHEMA)


def _response_format(start: gw.ConverseStart) -> Constraint | None:
    """ConverseStart.response_format as the reply's constraint (None: free text), checked as chat
    completions' `response_format` (response_format.schema_constraint); whether the schema
    compiles is checked with the turn's other constraints (ConverseServicer)."""
    if not start.HasField("response_format"):
        return None
    f = start.response_format
    if f.type not in RESPONSE_FORMATS:
        raise InvalidInput(f"response_format.type {f.type} is not RESPONSE_FORMAT_TEXT (0), _JSON_OBJECT (1) or "
                           "_JSON_SCHEMA (2)")
    if f.type != gw.RESPONSE_FORMAT_JSON_SCHEMA:
        if f.name or f.schema_json or f.strict:
            raise InvalidInput("response_format.name / schema_json / strict go with type RESPONSE_FORMAT_JSON_SCHEMA")
        return None if f.type == gw.RESPONSE_FORMAT_TEXT else Constraint(ConstraintKind.JSON_OBJECT)
    size = len(f.schema_json.encode())
    if size > MAX_CONSTRAINT_BYTES:     # before parsing it
        raise InvalidInput(f"'response_format.schema_json' exceeds {MAX_CONSTRAINT_BYTES // 1024} KiB ({size} bytes)")
    schema: Any = {}                    # empty: any JSON (chat: json_schema without `schema`)
    if f.schema_json:
        try:
            schema = json.loads(f.schema_json)
        except (ValueError, RecursionError) as e:
            raise InvalidInput(f"'response_format.schema_json' is not valid JSON: {str(e)[:120]}") from None
    try:
        return schema_constraint(f.name, schema, "response_format.name", "response_format.schema_json")
    except APIError as e:
        raise InvalidInput(e.message) from None


def _tool_options(start: gw.ConverseStart) -> ToolOptions:
    """ConverseStart.tools / tool_choice / single_tool_call, checked as chat completions' tools."""
    tools = []
    try:
        for i, t in enumerate(start.tools):
            spec: dict[str, Any] = {"name": t.name}
            if t.description:
                spec["description"] = t.description
            if t.parameters_json:
                try:
                    spec["parameters"] = json.loads(t.parameters_json)
                except ValueError:
                    raise InvalidInput(f"tools[{i}].parameters_json is not valid JSON") from None
                check_schema(spec["parameters"], f"tools[{i}].parameters_json")
            tool = function_tool(spec, f"tools[{i}]")
            if any(x.name == tool.name for x in tools):
                raise InvalidInput(f"tools[{i}]: the function name {tool.name!r} is used twice")
            tools.append(tool)
        if start.tool_choice not in (gw.TOOL_CHOICE_AUTO, gw.TOOL_CHOICE_NONE, gw.TOOL_CHOICE_REQUIRED):
            raise InvalidInput(f"tool_choice {start.tool_choice} is not TOOL_CHOICE_AUTO, _NONE or _REQUIRED")
        if start.tool_choice == gw.TOOL_CHOICE_REQUIRED and not tools:
            raise InvalidInput("tool_choice TOOL_CHOICE_REQUIRED needs tools")
        choice = {gw.TOOL_CHOICE_AUTO: "auto", gw.TOOL_CHOICE_NONE: "none"}.get(start.tool_choice, "required")
        function = start.tool_function or None
        if function is not None:
            if choice == "none":
                raise InvalidInput("tool_function excludes tool_choice TOOL_CHOICE_NONE")
            if function not in {t.name for t in tools}:
                raise InvalidInput(f"tool_function {quoted(function)} is not one of tools")
            choice = "function"
        opts = ToolOptions(tools=tuple(tools), choice=choice, function=function, parallel=not start.single_tool_call)
    except APIError as e:
        raise InvalidInput(e.message) from None
    return opts


def _history(items) -> list[ChatMessage]:
    """ConverseStart.history as chat turns: a function call joins the assistant turn before it; a
    function output must answer a call earlier in the history."""
    out: list[ChatMessage] = []
    calls: set[str] = set()
    for i, h in enumerate(items):
        kind = h.WhichOneof("kind")
        if kind == "user_text":
            out.append(ChatMessage.text("user", h.user_text))
        elif kind == "assistant_text":
            out.append(ChatMessage.text("assistant", h.assistant_text))
        elif kind == "function_call":
            c = h.function_call
            if not c.call_id or not c.name or len(c.call_id) > 256 or len(c.name) > 64:
                raise InvalidInput(f"history[{i}].function_call needs a call_id (up to 256 characters) and a name "
                                   "(up to 64)")
            call = ToolCall(c.call_id, c.name, c.arguments_json or "{}")
            calls.add(c.call_id)
            if out and out[-1].role == "assistant":
                out[-1].tool_calls.append(call)
            else:
                out.append(ChatMessage("assistant", [ChatPart(text="")], tool_calls=[call]))
        elif kind == "function_output":
            if h.function_output.call_id not in calls:
                raise InvalidInput(f"history[{i}].function_output.call_id {h.function_output.call_id[:64]!r} answers "
                                   "no function_call earlier in the history")
            out.append(ChatMessage("tool", [ChatPart(text=h.function_output.output)],
                                   tool_call_id=h.function_output.call_id))
        else:
            raise InvalidInput(f"history[{i}] is empty")
    return out


# ----------------------------------------------------------------------------- input checking

def _pcm16(audio: gw.Pcm16Audio, name: str) -> np.ndarray:
    if not audio.data:
        raise InvalidInput(f"{name}.data is empty")
    if len(audio.data) % 2:
        raise InvalidInput(f"{name}.data has an odd number of bytes ({len(audio.data)}); pcm16 is 2 bytes a sample")
    lo, hi = AUDIO_RATES
    if not lo <= audio.sample_rate <= hi:
        raise InvalidInput(f"{name}.sample_rate must be in [{lo}, {hi}] Hz, got {audio.sample_rate}")
    if (problem := audio_problem(len(audio.data) // 2, audio.sample_rate)) is not None:   # before resampling
        raise InvalidInput(f"{name}: {problem}")
    x = np.frombuffer(audio.data, dtype="<i2").astype(np.float32) / 32768.0
    return resample(x, audio.sample_rate, FEATURE_SAMPLE_RATE)


def _audio_part(a: gw.AudioInput, name: str) -> np.ndarray:
    fmt = a.WhichOneof("format")
    if fmt == "pcm16":
        wav = _pcm16(a.pcm16, f"{name}.pcm16")
    elif fmt == "wav":
        if not a.wav:
            raise InvalidInput(f"{name}.wav is empty")
        try:
            wav = decode_clip(a.wav)
        except ValueError as e:
            raise InvalidInput(f"{name}.wav: {e}") from None
    else:
        raise InvalidInput(f"{name} needs pcm16 or wav")
    return wav


def parse_start(start: gw.ConverseStart, cfg: OmniConfig, constrain_tool_calls: bool = False) -> ConverseTurn:
    """Check a ConverseStart and turn it into chat messages and a SpeechRequest (not yet rendered).
    `constrain_tool_calls`: the gateway's --constrain-tool-calls (tool_params.tool_call_constraint)."""
    modalities = set(start.output_modalities) or {gw.MODALITY_TEXT, gw.MODALITY_AUDIO}
    unknown = modalities - {gw.MODALITY_TEXT, gw.MODALITY_AUDIO}
    if unknown:
        raise InvalidInput(f"output_modalities: {sorted(unknown)} are not MODALITY_TEXT (1) or MODALITY_AUDIO (2)")
    want_audio = gw.MODALITY_AUDIO in modalities
    if start.audio_encoding not in (pb.AUDIO_ENCODING_UNSPECIFIED, pb.AUDIO_PCM16, pb.AUDIO_FLOAT32):
        raise InvalidInput(f"audio_encoding {start.audio_encoding} is not AUDIO_PCM16 (1) or AUDIO_FLOAT32 (2)")
    voice = (start.voice or DEFAULT_VOICE).lower()
    speakers = {s.lower() for s in cfg.talker.speakers}
    if want_audio and voice not in speakers:
        raise InvalidInput(f"unknown voice {quoted(start.voice)}; valid voices: {', '.join(sorted(speakers))}")
    history = _history(start.history)
    if not start.text and not start.audio and not (history and history[-1].role == "tool"):
        raise InvalidInput("the turn is empty: give text and/or audio (or a history ending in a function output)")
    if start.ignore_eos and not start.max_tokens:
        raise InvalidInput("ignore_eos needs max_tokens")
    if start.ignore_eos and want_audio and not start.max_frames:
        raise InvalidInput("ignore_eos with audio output needs max_frames")
    if start.max_tokens and start.min_tokens > start.max_tokens:
        raise InvalidInput(f"min_tokens {start.min_tokens} > max_tokens {start.max_tokens}")
    if start.max_frames and start.min_frames > start.max_frames:
        raise InvalidInput(f"min_frames {start.min_frames} > max_frames {start.max_frames}")
    s = start.sampling
    if s.HasField("temperature") and not 0.0 <= s.temperature <= 2.0:
        raise InvalidInput(f"sampling.temperature must be between 0 and 2, got {s.temperature:g}")
    if s.HasField("top_p") and not 0.0 < s.top_p <= 1.0:
        raise InvalidInput(f"sampling.top_p must be in (0, 1], got {s.top_p:g}")
    if s.HasField("top_k") and s.top_k < 0:
        raise InvalidInput(f"sampling.top_k must be >= 0, got {s.top_k}")
    problem = stop_strings_problem(start.stop)
    if problem is not None:
        raise InvalidInput(f"stop: {problem}")
    problem = top_logprobs_problem(start.logprobs, start.top_logprobs)
    if problem is not None:
        raise InvalidInput(problem)

    tools = _tool_options(start)
    turn = user_turn(start.text or None, [_audio_part(a, f"audio[{i}]") for i, a in enumerate(start.audio)]) \
        if start.text or start.audio else []
    messages = with_instructions(start.instructions, history + turn)
    speech = SpeechRequest(
        speaker=voice, audio=want_audio, max_tokens=start.max_tokens,
        min_tokens=start.max_tokens if start.ignore_eos else start.min_tokens,
        max_frames=start.max_frames, min_frames=start.max_frames if start.ignore_eos else start.min_frames,
        temperature=s.temperature if s.HasField("temperature") else 0.0,
        top_k=s.top_k if s.HasField("top_k") else 0, top_p=s.top_p if s.HasField("top_p") else 1.0,
        seed=s.seed if s.HasField("seed") else None, encoding=start.audio_encoding or pb.AUDIO_PCM16,
        stop=tuple(dict.fromkeys(start.stop)), top_logprobs=start.top_logprobs if start.logprobs else None,
        request_id=start.request_id or uuid.uuid4().hex)
    speech.unspoken_tool_calls = tools.parses_calls and want_audio
    structured = _response_format(start)
    try:        # a JSON response format, else the tools' constraint, as on chat
        speech.constraint = reply_constraint(structured, tools, constrain_tool_calls)
    except APIError as e:
        raise InvalidInput(e.message) from None
    if speech.constraint is not None and (start.min_tokens or start.ignore_eos):
        if structured is not None:
            why = "response_format"
        elif tools.calls_only:
            why = "a tool_choice that requires a call"
        else:
            why = "tools on this server, which constrains the calls of TOOL_CHOICE_AUTO (--constrain-tool-calls)"
        raise InvalidInput(f"{why} excludes min_tokens / ignore_eos: a constrained reply ends when it is complete")
    if tools.calls_only:        # only calls: nothing to speak (no talker, no code2wav)
        speech.audio = speech.unspoken_tool_calls = False
    # with audio, a JSON reply is spoken as written (as chat's)
    return ConverseTurn(messages, speech, tools, structured)


async def check_constraint(turn: ConverseTurn) -> None:
    """InvalidInput naming the field when the grammar library cannot enforce the turn's constraint:
    the response format's schema, or the parameters of a tool whose calls are constrained (the
    checks of chat completions, gateway/response_format.py and tool_params.py, remembered by content)."""
    constraint = turn.speech.constraint
    try:
        if turn.response_format is not None:
            await check_response_format(constraint, "response_format.schema_json")
        elif constraint is not None:
            await check_tool_constraint(turn.tools, constraint, "tools", "parameters_json")
    except APIError as e:
        raise InvalidInput(e.message) from None


def cancelled_usage(usage: gw.Usage, prompt_tokens: int, samples_per_frame: int) -> None:
    """Complete a cancelled turn's usage, which no stage reported: the prompt's tokens as rendered,
    the text tokens and audio samples sent, and the codec frames of that audio (each frame is
    `samples_per_frame` samples, the first a little less: ceil)."""
    usage.prompt_tokens = usage.prompt_tokens or prompt_tokens
    usage.audio_frames = usage.audio_frames or -(-usage.audio_samples // samples_per_frame)


def tool_call_messages(pieces) -> list[gw.ConverseResponse]:
    """A call as it is written (ToolCallDelta: its head, then pieces of its arguments), and each
    call whole once it is complete (ToolCallOutput)."""
    out = []
    for p in pieces:
        if isinstance(p, CallStart):
            out.append(gw.ConverseResponse(tool_call_delta=gw.ToolCallDelta(index=p.index, call_id=p.id, name=p.name)))
        elif isinstance(p, ArgumentsDelta):
            out.append(gw.ConverseResponse(tool_call_delta=gw.ToolCallDelta(index=p.index, arguments_delta=p.text)))
        elif isinstance(p, CallPiece):
            out.append(gw.ConverseResponse(tool_call=gw.ToolCallOutput(index=p.index, call=gw.FunctionCall(
                call_id=p.call.id, name=p.call.name, arguments_json=p.call.arguments))))
    return out


# ----------------------------------------------------------------------------- the servicer

_END = object()
_CANCEL = object()


def access_logged(handler):
    """An access line (services.runtime.logs) for every Converse call once it has ended: its gRPC
    status name (CANCELLED when the client cancelled the call; OK for a turn it ended with Cancel)."""

    @functools.wraps(handler)
    async def logged(self, request_iterator, context: grpc.aio.ServicerContext):
        # read while the call is live: grpc-Python may crash (SIGSEGV) on peer() of a cancelled call
        started, status, peer = time.perf_counter(), "OK", context.peer()
        try:
            async with aclosing(handler(self, request_iterator, context)) as inner:
                async for item in inner:
                    yield item
        except grpc.aio.AbortError:
            code = context.code()
            status = code.name if isinstance(code, grpc.StatusCode) else "ABORTED"
            raise
        except (ClientGone, GeneratorExit, asyncio.CancelledError):
            status = "CANCELLED"
            raise
        except Exception:
            status = "UNKNOWN"
            raise
        finally:
            log_access(AccessRecord("GRPC", f"/{SERVICE_NAME}/Converse", status, time.perf_counter() - started, peer))

    return logged


class ConverseServicer(gw_grpc.GatewayServicer):
    """Serves Converse from the gateway's GatewayState (gateway/state.py): its pipeline client,
    tokenizer and feature extractor, session limit (shared with HTTP and realtime) and metrics."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def _render(self, turn: ConverseTurn) -> None:
        try:
            prompt = render_now(self.state, turn.messages, turn.tools.prompt_tools)
        except ValueError as e:
            raise InvalidInput(f"could not render the turn: {e}") from None
        turn.speech.token_ids = prompt.token_ids
        turn.speech.audio_features = prompt.audio_features

    @tracing.traced_rpc(SERVICE_NAME, "Converse")
    @access_logged
    async def Converse(self, request_iterator, context: grpc.aio.ServicerContext):
        metadata = dict(context.invocation_metadata() or ())
        if not authorized(self.state.config, metadata.get("authorization")):
            await abort(context, grpc.StatusCode.UNAUTHENTICATED,
                        "missing or incorrect API key; send it as 'authorization: Bearer <key>' metadata")
            return
        it = request_iterator.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                                "empty request stream: the first message must be start")
            return
        except Abort as e:          # an undecodable message (rpc_guard)
            await abort(context, e.code, e.message)
            return
        if first.WhichOneof("kind") != "start":
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                                f"the first message must be start, got {first.WhichOneof('kind')}")
            return
        arrived = time.perf_counter()
        try:
            turn = parse_start(first.start, self.state.omni, self.state.config.constrain_tool_calls)
            await check_constraint(turn)
            await asyncio.to_thread(self._render, turn)
        except InvalidInput as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return
        speech = turn.speech
        REQUEST_ID.set(speech.request_id)          # this call's logs (and its access line) carry it
        tracing.annotate(request_id=speech.request_id, voice=speech.speaker if speech.audio else None)
        # the trace to join: this call's span, or (tracing off here) the caller's traceparent as is
        trace_context = (otel_context.get_current() if tracing.enabled()
                         else tracing.extract_metadata(context.invocation_metadata()))

        session = self.state.sessions.try_acquire("converse")
        if session is None:
            await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"too many concurrent sessions (the limit is {self.state.sessions.limit}); retry later")
            return
        events: asyncio.Queue = asyncio.Queue()

        async def pump() -> None:
            otel_context.attach(trace_context)      # this task's own context: the pipeline calls join the trace
            try:
                async with aclosing(run_pipeline(self.state, speech, arrived)) as stream:
                    async for ev in stream:
                        await events.put(ev)
                await events.put(_END)
            except PipelineError as e:
                await events.put(e)
            except AtCapacity as e:
                await events.put(PipelineError("gateway", grpc.StatusCode.RESOURCE_EXHAUSTED, e.message))

        async def read_rest() -> None:
            try:
                async for msg in it:
                    kind = msg.WhichOneof("kind")
                    if kind == "cancel":
                        await events.put(_CANCEL)
                        return
                    await events.put(InvalidInput(f"unexpected {kind} after start (only cancel may follow)"))
                    return
            except Abort as e:          # an undecodable message (rpc_guard)
                await events.put(InvalidInput(e.message))
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                return

        pump_task = asyncio.ensure_future(pump())
        read_task = asyncio.ensure_future(read_rest())

        def call_ended(_context) -> None:
            # grpc-Python cancels a handler suspended at a `yield` (its write) without closing this
            # generator, whose `finally` then waits for the garbage collector: the slot and the
            # pipeline are freed here, when the call ends, whatever state the handler is in
            for task in (pump_task, read_task):
                task.cancel()
            session.release()

        context.add_done_callback(call_ended)
        usage = gw.Usage()
        text_finish = audio_finish = pb.FINISH_REASON_UNSPECIFIED
        sent_output = False
        # with tools, the text is read for calls: content stays `text`, each call is a `tool_call`
        parser = turn.tools.parser()
        try:
            while True:
                ev = await events.get()
                if isinstance(ev, TextEvent):
                    sent_output = True
                    usage.completion_tokens += len(ev.token_ids)
                    pieces = [ContentPiece(ev.text)] if parser is None else parser.push(ev.text)
                    text = "".join(p.text for p in pieces if isinstance(p, ContentPiece))
                    yield gw.ConverseResponse(text=gw.TextOutput(index=ev.index, token_ids=ev.token_ids, text=text,
                                                                 logprobs=[e.to_proto() for e in ev.logprobs]))
                    for out in tool_call_messages(pieces):
                        yield out
                elif isinstance(ev, AudioEvent):
                    sent_output = True
                    n = int(ev.samples.shape[0])
                    usage.audio_samples += n
                    yield gw.ConverseResponse(audio=pb.AudioChunk(
                        sample_offset=ev.sample_offset, sample_rate=ev.sample_rate, encoding=speech.encoding,
                        data=ev.data, num_samples=n))
                elif isinstance(ev, DoneEvent):
                    text_finish, audio_finish = ev.text_finish or 0, ev.audio_finish or 0
                    usage.prompt_tokens, usage.completion_tokens = ev.prompt_tokens, ev.completion_tokens
                    usage.audio_frames, usage.audio_samples = ev.frames, ev.samples
                    usage.cached_prompt_tokens = ev.cached_tokens
                elif ev is _END:
                    rest = parser.finish() if parser is not None else []
                    text = "".join(p.text for p in rest if isinstance(p, ContentPiece))
                    if text:
                        yield gw.ConverseResponse(text=gw.TextOutput(index=usage.completion_tokens, text=text))
                    for out in tool_call_messages(rest):
                        yield out
                    break
                elif ev is _CANCEL:
                    pump_task.cancel()          # closes the pipeline stream: every stage frees the request
                    cancelled_usage(usage, len(speech.token_ids or ()), self.state.omni.code2wav.samples_per_frame)
                    text_finish = text_finish or pb.CANCELLED
                    audio_finish = (audio_finish or pb.CANCELLED) if speech.audio else audio_finish
                    tracing.annotate(cancelled=True)
                    break
                elif isinstance(ev, InvalidInput):
                    await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(ev))
                elif isinstance(ev, PipelineError):
                    code = ev.code or grpc.StatusCode.INTERNAL
                    message = f"{ev.stage}: {ev.details}"
                    if sent_output:
                        yield gw.ConverseResponse(error=gw.ConverseError(code=code.name, message=message,
                                                                         stage=ev.stage))
                    await abort(context, code, message)
            yield gw.ConverseResponse(done=gw.ConverseDone(request_id=speech.request_id, text_finish=text_finish,
                                                           audio_finish=audio_finish, usage=usage))
        finally:
            try:
                for task in (pump_task, read_task):
                    task.cancel()
                await asyncio.gather(pump_task, read_task, return_exceptions=True)
            finally:        # also when the call is cancelled while the tasks wind down
                session.release()


# ----------------------------------------------------------------------------- serving

READY_POLL_S = 2.0      # how often the Converse port's health status is brought in line with /ready


class HealthFollowsReadiness:
    """The Converse port's health status (overall and voxpipe.v1.Gateway): SERVING while /ready
    would answer 200 (every thinker and code2wav replica SERVING), NOT_SERVING otherwise."""

    def __init__(self, health_servicer: health.aio.HealthServicer, config: Any) -> None:
        self.health, self.config = health_servicer, config
        self.status: int | None = None

    async def check(self) -> None:
        try:
            ok, _ = await readiness(self.config)
        except Exception:       # a check that fails in an unexpected way says "not ready"
            log.exception("checking the stages' readiness failed")
            ok = False
        now = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        if now != self.status:
            for name in ("", SERVICE_NAME):
                await self.health.set(name, now)
            log.info("Converse health: %s", health_pb2.HealthCheckResponse.ServingStatus.Name(now))
            self.status = now

    async def follow(self, interval: float = READY_POLL_S) -> None:
        """Until cancelled: check every `interval` seconds."""
        while True:
            await asyncio.sleep(interval)
            await self.check()


@dataclass
class ConverseServer:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    readiness: asyncio.Task

    async def stop(self, grace: float | None = None) -> None:
        self.readiness.cancel()
        await asyncio.gather(self.readiness, return_exceptions=True)
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


async def serve_converse(app_state: Any, port: int, host: str = "[::]") -> ConverseServer:
    """Start Converse (+ health, and reflection when the config turns it on) on host:port (0: any
    free port) on the running event loop (the one serving the HTTP app: they share the pipeline
    client) and return at once; `await server.stop(grace)` on shutdown. `app_state`: the
    gateway's GatewayState."""
    server = grpc.aio.server(options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), *GRPC_SERVER_OPTIONS],
                             interceptors=[RequestGuard()])
    gw_grpc.add_GatewayServicer_to_server(ConverseServicer(app_state), server)
    health_servicer = add_health_and_reflection(server, SERVICE_NAME, app_state.config.reflection)
    # TLS with the gateway's --ssl-certfile/--ssl-keyfile; PortInUse (--grpc-port) when taken
    bound = bind_grpc(server, host, port, app_state.config.tls, "gateway Converse gRPC", "--grpc-port")
    for name in ("", SERVICE_NAME):        # until the first check says otherwise
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    follower = HealthFollowsReadiness(health_servicer, app_state.config)
    await follower.check()
    following = asyncio.ensure_future(follower.follow())
    log.info("Converse gRPC API on port %d%s", bound, " (TLS)" if app_state.config.tls else "")
    return ConverseServer(server, bound, health_servicer, following)
