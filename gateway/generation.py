"""Shared by the HTTP (and realtime) APIs: rendering a conversation into a prompt off the event
loop, and running one pipeline request with the gateway's metrics. `Generation` is the two bound
to one GatewayState, for runs that are given them rather than the state (the realtime responses
and transcriptions)."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass

from voxpipe.client import AudioEvent, AudioTurn, DoneEvent, SpeechRequest, StageEvent, TextEvent
from voxpipe.services.runtime import tracing
from voxpipe.services.thinker.prompt import ChatMessage, RenderedPrompt, Tool, render, with_features
from voxpipe.services.thinker.tool_template import TemplateToolError
from voxpipe.v1 import stages_pb2 as pb

from .errors import bad_request
from .params import GenerationParams

PipelineEvent = TextEvent | StageEvent | AudioEvent | DoneEvent


def first_output_stage(ev: object) -> str | None:
    """The stage whose output `ev` is: text (thinker), the talker's own first-frame report, audio (code2wav)."""
    if isinstance(ev, TextEvent):
        return "thinker"
    if isinstance(ev, AudioEvent):
        return "code2wav"
    if isinstance(ev, StageEvent) and ev.kind == "first_output":
        return ev.stage
    return None


def prompt_chars(messages: list[ChatMessage]) -> int:
    return sum(len(m.role) + sum(len(p.text or "") for p in m.parts) for m in messages)


def render_now(state, messages: list[ChatMessage], tools: tuple[Tool, ...] = ()) -> RenderedPrompt:
    """Run in a worker thread. Raises ValueError for a conversation over the text limit before
    any work: the tokenizer, shared under the state's lock, is held for a bounded time."""
    chars, limit = prompt_chars(messages), state.config.max_prompt_chars
    if chars > limit:
        raise ValueError(f"the conversation has {chars} characters of text; the limit is {limit}")
    # features in this worker thread; the tokenizer (not thread-safe) under the state's lock
    # (a part that already carries features, e.g. a realtime user turn, is kept as it is)
    messages = with_features(messages, state.features)
    with state.tokenizer_lock:
        return render(state.tokenizer, state.omni.thinker, messages, tools=tools)


async def render_prompt(state, messages: list[ChatMessage], param: str = "messages",
                        tools: tuple[Tool, ...] = (), tools_param: str = "tools") -> RenderedPrompt:
    """`param`: the request parameter a refusal names (`tools_param` for one about the tools)."""
    try:
        return await asyncio.to_thread(render_now, state, messages, tools)
    except TemplateToolError as e:
        raise bad_request(f"could not render the conversation: {e}", param=tools_param if e.param == "tools" else param,
                          code="invalid_value") from None
    except ValueError as e:
        raise bad_request(f"could not render the conversation: {e}", param=param) from None


def speech_request(prompt: RenderedPrompt, params: GenerationParams, voice: str, audio: bool,
                   assistant_text: str | None = None, tool_calls: bool = False,
                   calls_only: bool = False, session: str | None = None) -> SpeechRequest:
    """`assistant_text`: the reply, given (text to speech; the sampling values are then the talker's).
    `tool_calls`: the reply is read for function calls, which the talker must not speak.
    `calls_only`: the reply is only calls (its constraint says so): nothing to speak, so no audio is
    asked for (neither the talker nor code2wav takes part). `session`: its routing session (SpeechRequest)."""
    audio = audio and not calls_only
    return SpeechRequest(token_ids=prompt.token_ids, audio_features=prompt.audio_features, speaker=voice, audio=audio,
                         max_tokens=params.max_tokens, min_tokens=params.min_tokens, max_frames=params.max_frames,
                         min_frames=params.min_frames, temperature=params.temperature, top_k=params.top_k,
                         top_p=params.top_p, seed=params.seed, stop=params.stop, top_logprobs=params.top_logprobs,
                         constraint=params.constraint, encoding=pb.AUDIO_PCM16, assistant_text=assistant_text,
                         unspoken_tool_calls=tool_calls and audio, session=session)


def admitted(ev: PipelineEvent, audio: bool) -> bool:
    """Whether every stage has taken the request once `ev` has come: each refuses before it does
    anything else, and the thinker's first output (text, or the end) follows its checks, the
    code2wav's route follows the talker's and the code2wav's (the talker opens the code2wav
    stream after its own checks and reports the route once the code2wav has accepted)."""
    if isinstance(ev, DoneEvent):
        return True
    if audio:   # (or the talker's word that nothing is spoken: no code2wav stream comes)
        return isinstance(ev, StageEvent) and (ev.kind == "routed" and ev.stage == "code2wav" or ev.kind == "silent")
    return isinstance(ev, (TextEvent, AudioEvent))


async def read_until_admitted(events: AsyncIterator[PipelineEvent], audio: bool) -> list[PipelineEvent]:
    """The events of a run up to the one that shows every stage has taken it (`admitted`); a
    refusal before raises (PipelineError), so that a stream can still answer with an error status."""
    head: list[PipelineEvent] = []
    async for ev in events:
        head.append(ev)
        if admitted(ev, audio):
            break
    return head


async def run_pipeline(state, req: SpeechRequest, arrived: float,
                       turn: AudioTurn | None = None) -> AsyncIterator[PipelineEvent]:
    """`state.pipeline.stream(req, turn=turn)` with the active-streams gauge, each stage's first-output
    latency, time to first audio and the real-time factor recorded (`arrived`: perf_counter at
    the request's arrival). A spoken one first waits for capacity (admission.py: AtCapacity, a 429,
    when it does not come in time) and is then tracked by its listener's playback clock. Raises
    PipelineError as the client does."""
    m = state.metrics
    seen: set[str] = set()
    samples, rate = 0, state.omni.code2wav.sample_rate
    stream = await state.capacity.admit() if req.audio else None
    m.active_streams.inc()
    try:
        async with aclosing(state.pipeline.stream(req, turn=turn)) as events:
            async for ev in events:
                stage = first_output_stage(ev)
                if stage is not None and stage not in seen:
                    seen.add(stage)
                    tracing.event(f"{stage} first output")
                    elapsed = time.perf_counter() - arrived
                    m.stage_first_output.labels(stage).observe(elapsed)
                    if stage == "code2wav":
                        m.ttfp.observe(elapsed)
                if isinstance(ev, AudioEvent):
                    samples += ev.samples.shape[0]
                    rate = ev.sample_rate or rate
                    if stream is not None:
                        stream.received(ev.samples.shape[0] / rate, ev.received or time.monotonic())
                yield ev
                if stream is not None and isinstance(ev, AudioEvent):   # the API layer took it for its client
                    stream.taken(ev.samples.shape[0] / rate, time.monotonic())
        if samples:
            m.rtf.observe((time.perf_counter() - arrived) / (samples / rate))
    finally:
        m.active_streams.dec()
        if stream is not None:
            state.capacity.done(stream)


@dataclass(frozen=True)
class Generation:
    """`render_prompt` and `run_pipeline` bound to one GatewayState: `render(messages, tools=...,
    tools_param=...)` (a refusal is a 400 APIError naming `messages`, or `tools_param` for the
    tools), `run(req, arrived, turn=None)`, the prompt's audio placeholder id (`audio_token`: usage
    counts the prompt's audio tokens), the id that begins each turn (`turn_start`, <|im_start|>)
    and `open_turn(token_ids, audio_features, session)`: a streamed turn (PipelineClient.open_turn)."""

    render: Callable[..., Awaitable[RenderedPrompt]]
    run: Callable[..., AsyncIterator[PipelineEvent]]
    audio_token: int
    turn_start: int
    open_turn: Callable[..., AudioTurn] | None = None     # None: turns are not streamed
    constrain_tool_calls: bool = False     # GatewayConfig.constrain_tool_calls (tool_params.tool_call_constraint)

    @classmethod
    def of(cls, state, param: str = "messages") -> "Generation":
        """`param`: the request parameter a refusal to render names."""
        return cls(render=functools.partial(render_prompt, state, param=param),
                   run=functools.partial(run_pipeline, state), audio_token=state.omni.thinker.tokens.audio_token,
                   turn_start=state.omni.thinker.tokens.im_start,
                   open_turn=lambda *a, **kw: state.pipeline.open_turn(*a, **kw),
                   constrain_tool_calls=state.config.constrain_tool_calls)
