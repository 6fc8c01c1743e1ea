"""One realtime response: render the conversation, stream it through the pipeline, send the
response events, and finish it as completed, incomplete (max_output_tokens), cancelled
(client_cancelled / turn_detected) or failed.

A cancelled spoken reply keeps what reached the client: its queued audio is dropped, and after
`response.done` (whose transcript is all the text made, as the deltas said) its item is truncated
to the audio delivered (`conversation.item.truncated`): the item's transcript then keeps only
the text spoken in that audio (ItemContent.align: the same audio time per text token).

What a run uses of its session is all in the ResponseContext it is given (the connection makes
it): these values and callbacks, never the connection, its outbox or its conversation themselves:

- `generation`: the gateway's rendering and pipeline (generation.Generation);
- `conversation_id`: the session's, for the `response` objects of in-conversation runs;
- `emit(event, response_id=, audio_samples=, on_sent=)`: send a server event (server_events.Emit);
  each audio delta names the response and its samples, and `on_sent(samples)` is called once it is
  written to the socket;
- `insert_item(item)`: append the reply's item to the conversation (not for out-of-band runs);
  returns the id of the item before it;
- `has_item(item_id)`: whether an item is still in the conversation (a cancelled reply whose item
  is gone sends no `conversation.item.truncated`);
- `withdraw_audio(response_id)`: drop the response's audio deltas still queued; returns the samples
  of its delta being written at that moment, which still reach the client;
- `room`: what the session has learned of the thinker's context (truncation.ContextRoom), which a
  run reads and adds to;
- `take_turn(prompt)`: the user's last turn, streamed to a thinker while it was spoken (heard.py),
  when it is exactly this prompt's (None otherwise: the prompt goes whole);
  `prefilled_before_commit(share)` reports how much of such a turn was prefilled before its commit.

A run reads its prompt from the PromptWindow it is given and fits it to the context as the
session's truncation says (truncation.py); a prompt that does not fit is a failed response with a
`context_length_exceeded` `error` event before its response.done.

The reply's output items come in the order the model writes them: its message (text, or audio
with its transcript) is opened at its first text or audio, and each function call is its own
item; a reply that is only calls has no message item (as OpenAI's), and one with nothing at all
(cancelled or failed before its first word, or empty) ends with its empty message.

The connection, in turn, uses of a run only `id`, `generating(item_id)`, `active`, `task`,
`start()` and `cancel(reason)`."""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Literal

import grpc

import numpy as np

from voxpipe.audio import resample
from voxpipe.client import AudioEvent, AudioTurn, DoneEvent, PipelineError, TextEvent
from voxpipe.services.runtime.logs import REQUEST_ID
from voxpipe.services.thinker.prompt import RenderedPrompt
from voxpipe.v1 import stages_pb2 as pb

from ..errors import APIError, bad_request, from_pipeline_error
from ..generation import Generation, speech_request
from ..params import GenerationParams
from .events import INPUT_SAMPLE_RATE, Dialect, ProtocolError
from .session import tools_wire
from ..tool_params import tool_call_constraint
from ..tools import ArgumentsDelta, CallPiece, CallStart, ContentPiece, ReplyPiece
from .server_events import (AudioDelta, AudioDone, ContentPart, ContentPartAdded, ContentPartDone, Emit, Error,
                            FunctionCallArgumentsDelta, FunctionCallArgumentsDone, ItemAdded, ItemDone, ItemTruncated,
                            OutputItemAdded, OutputItemDone, ResponseCreated, ResponseDone, TextDelta, TextDone,
                            TranscriptDelta, TranscriptDone, new_id)
from .session import ConversationItem, FunctionCall, ItemContent, ResponseSettings, samples_to_ms
from .truncation import ContextRoom, ContextTooLong, PromptWindow, fit

log = logging.getLogger(__name__)
OUTPUT_SAMPLE_RATE = INPUT_SAMPLE_RATE        # OpenAI's realtime audio: pcm16 24 kHz both ways
CancelReason = Literal["client_cancelled", "turn_detected"]


@dataclass(frozen=True)
class ResponseContext:
    """What a response run uses of its session (see the module's docstring)."""

    generation: Generation
    conversation_id: str
    emit: Emit
    insert_item: Callable[[ConversationItem], str | None]
    has_item: Callable[[str], bool]
    withdraw_audio: Callable[[str], Awaitable[int]]
    room: ContextRoom = field(default_factory=ContextRoom)
    # the reply's first audio after the end of the user's speech: (since which event, seconds)
    heard_to_audio: Callable[[str, float], None] = lambda since, seconds: None
    # the session's streamed user turn for this prompt, handed over (heard.HeardTurn.take), or None
    take_turn: Callable[[RenderedPrompt], Awaitable[AudioTurn | None]] = field(default=lambda prompt: _no_turn())
    # a streamed turn's share of the prompt prefilled before its commit
    prefilled_before_commit: Callable[[float], None] = lambda share: None


async def _no_turn() -> None:
    return None


class ResponseRun:
    def __init__(self, ctx: ResponseContext, settings: ResponseSettings, window: PromptWindow,
                 speech_end: tuple[str, float] | None = None) -> None:
        """`speech_end`: the event that ended the user's speech this run answers and its perf_counter
        time (its first audio is timed from there)."""
        self.ctx, self.settings, self.window = ctx, settings, window
        self.speech_end = speech_end
        self.id = new_id("resp")
        self.arrived = time.perf_counter()
        self.item: ConversationItem | None = None      # the message, opened at its first text or audio
        self.message_index = 0                          # its output_index
        self.outputs: list[ConversationItem] = []       # the output items, in output_index order
        self._pending_tokens = 0                        # text tokens made before the message opened
        self.status, self.status_details = "in_progress", None
        self.usage: dict[str, int] | None = None
        self.prompt: RenderedPrompt | None = None
        self.text_tokens = self.frames = self.cached_tokens = 0
        self.audio_finish: int | None = None    # the talker's finish reason (STOP: it ended the speech itself)
        self.produced_samples = self.sent_samples = 0
        self.cancel_reason: CancelReason | None = None
        self.previous_item_id: str | None = None
        self.in_conversation = False
        self.started = self.finishing = False
        self.task: asyncio.Task | None = None
        # with tools offered, the reply's text is read for calls: each becomes a function_call item
        # (output_index in the order written), its text never reaches the message
        self.parser = settings.tools.parser()
        self.calls: list[ConversationItem] = []
        self._call_index: list[int] = []               # each call's output_index
        self._previous: dict[str, str | None] = {}     # a call item's id -> the item before it

    @property
    def content(self) -> ItemContent:
        """The message's content (once the message is open)."""
        return self.item.content[0]

    def generating(self, item_id: str) -> bool:
        """Whether `item_id` is an item of this run still being written."""
        return self.active and any(i.id == item_id and i.status == "in_progress" for i in self.outputs)

    @property
    def active(self) -> bool:
        return self.task is not None and not self.task.done()

    def start(self) -> None:
        self.task = asyncio.ensure_future(self._run())

    async def cancel(self, reason: CancelReason) -> bool:
        """Stop generating (the three stage calls are cancelled) and finish as cancelled."""
        if not self.active:
            return False
        if not self.finishing:
            self.cancel_reason = reason
            if self.started:          # (not started yet: it sees cancel_reason and stops before generating)
                self.task.cancel()
        try:
            await self.task
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise
        return True

    # ------------------------------------------------------------------------- wire

    def wire(self, dialect: Dialect) -> dict[str, Any]:
        s = self.settings
        body: dict[str, Any] = {
            "object": "realtime.response", "id": self.id, "status": self.status, "status_details": self.status_details,
            "output": [i.wire(dialect) for i in self.outputs] if self.status != "in_progress" else [],
            "conversation_id": None if s.out_of_band else self.ctx.conversation_id,
            "max_output_tokens": s.max_output_tokens or "inf", "metadata": s.metadata, "usage": self.usage}
        body.update(tools_wire(s.tools))
        if dialect is Dialect.BETA:
            body.update(modalities=["audio", "text"] if s.audio_out else ["text"], voice=s.voice,
                        output_audio_format="pcm16", temperature=s.temperature)
        else:
            body.update(output_modalities=["audio"] if s.audio_out else ["text"],
                        audio={"output": {"format": {"type": "audio/pcm", "rate": OUTPUT_SAMPLE_RATE},
                                          "voice": s.voice}})
        return body

    def _part_ids(self) -> dict[str, Any]:
        return {"response_id": self.id, "item_id": self.item.id, "output_index": self.message_index,
                "content_index": 0}

    # ------------------------------------------------------------------------- running

    async def _run(self) -> None:
        emit = self.ctx.emit
        self.started = True
        REQUEST_ID.set(self.id)           # this task's logs (and the stages') name the response
        try:
            await emit(ResponseCreated(self))
            if self.cancel_reason is not None:
                raise asyncio.CancelledError
            outcome = await self._generate()
        except asyncio.CancelledError:
            if self.cancel_reason is None:        # the connection is going away: no more events
                raise
            asyncio.current_task().uncancel()
            outcome = ("cancelled", {"type": "cancelled", "reason": self.cancel_reason})
        self.finishing = True
        await self._finish(*outcome)

    async def _message(self) -> ItemContent:
        """The message's content, the message opened first if it is not yet: its item (output_index
        after the items before it), in the conversation, and its content part."""
        if self.item is None:
            kind = "output_audio" if self.settings.audio_out else "output_text"
            item = ConversationItem(new_id("item"), "assistant", [ItemContent(kind)], status="in_progress")
            self.item, self.message_index = item, len(self.outputs)
            self.outputs.append(item)
            emit = self.ctx.emit
            await emit(OutputItemAdded(self.id, self.message_index, item))
            if not self.settings.out_of_band:
                self.previous_item_id = self.ctx.insert_item(item)
                self.in_conversation = True
                await emit(ItemAdded(self.previous_item_id, item))
            await emit(ContentPartAdded(**self._part_ids(), part=ContentPart(self.settings.audio_out)))
        return self.item.content[0]

    async def _generate(self) -> tuple[str, dict[str, Any] | None]:
        try:
            for attempt in (1, 2):     # a refusal for the context is learned from, and the prompt fitted again
                await self._fit()
                try:
                    finish = await self._stream()
                    break
                except PipelineError as e:
                    if attempt == 2 or not self._learn(e):
                        raise
        except ContextTooLong as e:
            return await self._failed(e.error)
        except PipelineError as e:
            return await self._failed(from_pipeline_error(e))
        except APIError as e:
            return await self._failed(e)
        except Exception:
            log.exception("realtime response %s failed", self.id)
            return await self._failed(APIError(500, "the server failed while generating this response",
                                               type="server_error", code="server_error"))
        if finish == pb.LENGTH:
            return "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}
        return "completed", None

    async def _fit(self) -> None:
        """self.prompt: the window's prompt, fitted to what is known of the context (truncation.fit);
        the items it leaves out leave the session's context."""
        s, gen = self.settings, self.ctx.generation
        tools = s.tools.prompt_tools

        def render(messages):
            return gen.render(messages, tools=tools, tools_param="session.tools")

        fitted = await fit(render, self.window, s.truncation, self.ctx.room.prompt_limit(s.max_output_tokens),
                           has_system=bool(self.window.instructions or tools), turn_start=gen.turn_start)
        if fitted.cut:
            log.info("realtime response %s: truncation leaves the %d oldest turns out (%d prompt tokens)", self.id,
                     fitted.cut, len(fitted.prompt.token_ids))
            self.window.drop([item_id for item_id, _ in self.window.turns[:fitted.cut]])
        self.prompt = fitted.prompt

    def _learn(self, e: PipelineError) -> bool:
        """Whether `e` is the thinker's refusal for its context before any output (then learned)."""
        if e.stage != "thinker" or e.code != grpc.StatusCode.OUT_OF_RANGE or e.context is None \
                or self.text_tokens or self.produced_samples:
            return False
        self.ctx.room.learn(e.context, self.settings.max_output_tokens)
        return True

    async def _stream(self) -> int | None:
        """Run self.prompt through the pipeline, sending the reply's events; the text's finish reason."""
        gen, s = self.ctx.generation, self.settings
        forced = s.ignore_eos
        constraint = tool_call_constraint(s.tools, gen.constrain_tool_calls)
        if forced and constraint is not None:
            why = "a tool_choice that requires a call" if s.tools.calls_only else \
                "tools on this server, which constrains the calls of tool_choice 'auto' (--constrain-tool-calls)"
            raise bad_request(f"ignore_eos excludes {why}: a constrained reply ends when it is complete",
                              param="tool_choice" if s.tools.calls_only else "tools", code="invalid_value")
        params = GenerationParams(max_tokens=s.max_output_tokens, min_tokens=s.max_output_tokens if forced else 0,
                                  max_frames=s.max_audio_frames, min_frames=s.max_audio_frames if forced else 0,
                                  temperature=s.temperature, constraint=constraint)
        req = speech_request(self.prompt, params, s.voice, s.audio_out, tool_calls=s.tools.parses_calls,
                             calls_only=s.tools.calls_only)
        req.request_id = self.id
        req.session = self.ctx.conversation_id     # the session's turns prefer one thinker replica
        finish = None
        turn = await self.ctx.take_turn(self.prompt)
        run = gen.run(req, self.arrived) if turn is None else gen.run(req, self.arrived, turn)
        try:
            async with aclosing(run) as events:
                finish = await self._read(events, turn)
        finally:
            if turn is not None:
                await turn.close()
        return finish

    async def _read(self, events, turn: AudioTurn | None) -> int | None:
        finish = None
        async for ev in events:
            if isinstance(ev, TextEvent):
                await self._on_text(ev)
            elif isinstance(ev, AudioEvent):
                await self._on_audio(ev)
            elif isinstance(ev, DoneEvent):
                await self._on_pieces(0, self.parser.finish() if self.parser is not None else [])
                finish = ev.text_finish
                self.frames = ev.frames     # the talker's own count
                self.cached_tokens = ev.cached_tokens
                self.audio_finish = ev.audio_finish
                if turn is not None and ev.prompt_tokens:
                    self.ctx.prefilled_before_commit(ev.streamed_tokens / ev.prompt_tokens)
        return finish

    async def _failed(self, e: APIError) -> tuple[str, dict[str, Any]]:
        """A failed outcome; a prompt past the context is also an `error` event (the session goes on)."""
        log.info("realtime response %s failed: %s", self.id, e.message)
        if e.code == "context_length_exceeded":
            await self.ctx.emit(Error.of(ProtocolError(e.message, code=e.code)))
        return "failed", {"type": "failed", "error": {"type": e.type, "code": e.code, "message": e.message}}

    async def _on_text(self, ev: TextEvent) -> None:
        self.text_tokens += len(ev.token_ids)
        if self.parser is None:
            await self._on_pieces(len(ev.token_ids), [ContentPiece(ev.text)] if ev.text else [])
        else:
            await self._on_pieces(len(ev.token_ids), self.parser.push(ev.text))

    async def _on_pieces(self, tokens: int, pieces: list[ReplyPiece]) -> None:
        """The reply's pieces in the order written: the message's text (each run of it one delta; the
        `tokens` counted with its first), each call as its own item."""
        self._pending_tokens += tokens
        run: list[str] = []
        for p in [*pieces, None]:
            if isinstance(p, ContentPiece):
                run.append(p.text)
                continue
            if run:
                await self._text("".join(run))
                run = []
            if isinstance(p, CallStart):
                await self._call_started(p.id, p.name)
            elif isinstance(p, ArgumentsDelta):
                await self._arguments(p.index, p.text)
            elif isinstance(p, CallPiece):
                if not p.streamed:
                    await self._call_started(p.call.id, p.call.name)
                    await self._arguments(p.index, p.call.arguments)
                await self._call_done(p)
        if self._pending_tokens and self.item is not None:
            self.content.add_text(self._pending_tokens, "")
            self._pending_tokens = 0

    async def _text(self, text: str) -> None:
        """A delta of the message's text, the message opened at its first; the text tokens made since
        the last text (before the message opened too: as they always counted) count with it."""
        if not text:
            return
        content = await self._message()
        content.add_text(self._pending_tokens, text)
        self._pending_tokens = 0
        delta = TranscriptDelta if self.settings.audio_out else TextDelta
        await self.ctx.emit(delta(**self._part_ids(), delta=text))

    async def _call_started(self, call_id: str, name: str) -> None:
        """A call's function_call item (output_index after the items before it), its arguments to come."""
        item = ConversationItem(new_id("item"), "assistant", [], status="in_progress",
                                call=FunctionCall(call_id, name, ""))
        index = len(self.outputs)
        self.calls.append(item)
        self._call_index.append(index)
        self.outputs.append(item)
        emit = self.ctx.emit
        await emit(OutputItemAdded(self.id, index, item))
        if not self.settings.out_of_band:
            self._previous[item.id] = self.ctx.insert_item(item)
            await emit(ItemAdded(self._previous[item.id], item))

    async def _arguments(self, index: int, text: str) -> None:
        item = self.calls[index]
        item.call = FunctionCall(item.call.call_id, item.call.name, item.call.arguments + text)
        await self.ctx.emit(FunctionCallArgumentsDelta(self.id, item.id, self._call_index[index], item.call.call_id,
                                                       text))

    async def _call_done(self, piece: CallPiece) -> None:
        c, item, index = piece.call, self.calls[piece.index], self._call_index[piece.index]
        item.call, item.status = FunctionCall(c.id, c.name, c.arguments), "completed"
        emit = self.ctx.emit
        await emit(FunctionCallArgumentsDone(self.id, item.id, index, c.id, c.name, c.arguments))
        await emit(OutputItemDone(self.id, index, item))
        if not self.settings.out_of_band:
            await emit(ItemDone(self._previous[item.id], item))

    async def _on_audio(self, ev: AudioEvent) -> None:
        pcm = ev.data
        if ev.sample_rate and ev.sample_rate != OUTPUT_SAMPLE_RATE:
            x = resample(ev.samples, ev.sample_rate, OUTPUT_SAMPLE_RATE)
            pcm = (np.clip(x, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()
        n = len(pcm) // 2
        if not n:
            return
        if not self.produced_samples and self.speech_end is not None:
            since, at = self.speech_end
            self.ctx.heard_to_audio(since, time.perf_counter() - at)
        await self._message()
        self.produced_samples += n
        await self.ctx.emit(AudioDelta(**self._part_ids(), delta=base64.b64encode(pcm).decode("ascii")),
                            response_id=self.id, audio_samples=n, on_sent=self._on_sent)

    def _on_sent(self, samples: int) -> None:
        if not self.finishing:
            self.sent_samples += samples

    # ------------------------------------------------------------------------- finishing

    async def _finish(self, status: str, details: dict[str, Any] | None) -> None:
        emit = self.ctx.emit
        if self.item is None and not self.calls:     # a reply of nothing: its message, empty
            await self._message()
        delivered = None
        if status == "cancelled":
            in_flight = await self.ctx.withdraw_audio(self.id)
            delivered = self.sent_samples + in_flight
        self.status, self.status_details = status, details
        if self.item is not None:
            # the speech is whole only when the talker ended it itself (not at max_audio_frames, not cut off)
            self.content.align(self.produced_samples, complete=self.audio_finish == pb.STOP)
            self.item.status = "completed" if status == "completed" else "incomplete"
        self.usage = self._usage()
        if self.item is not None:
            await self._message_done()
        for item, index in zip(self.calls, self._call_index):
            if item.status == "in_progress":      # cut off (cancelled, failed) while its arguments were written
                item.status = "incomplete"
                await emit(OutputItemDone(self.id, index, item))
                if not self.settings.out_of_band:
                    await emit(ItemDone(self._previous[item.id], item))
        await emit(ResponseDone(self))
        if self.item is not None and delivered is not None and self.settings.audio_out:
            self.content.truncate_audio(delivered)       # what the client has not got is not in the conversation
            if self.in_conversation and self.ctx.has_item(self.item.id):
                await emit(ItemTruncated(self.item.id, 0, samples_to_ms(delivered)))

    async def _message_done(self) -> None:
        emit, content, ids = self.ctx.emit, self.content, self._part_ids()
        if self.settings.audio_out:
            await emit(AudioDone(**ids))
            await emit(TranscriptDone(**ids, transcript=content.text))
        else:
            await emit(TextDone(**ids, text=content.text))
        await emit(ContentPartDone(**ids, part=ContentPart(self.settings.audio_out, content.text)))
        await emit(OutputItemDone(self.id, self.message_index, self.item))
        if self.in_conversation:
            await emit(ItemDone(self.previous_item_id, self.item))

    def _usage(self) -> dict[str, Any]:
        ids = self.prompt.token_ids if self.prompt is not None else []
        audio_in = ids.count(self.ctx.generation.audio_token)
        out = self.text_tokens + self.frames
        return {"total_tokens": len(ids) + out, "input_tokens": len(ids), "output_tokens": out,
                "input_token_details": {"text_tokens": len(ids) - audio_in, "audio_tokens": audio_in,
                                        "cached_tokens": self.cached_tokens},
                "output_token_details": {"text_tokens": self.text_tokens, "audio_tokens": self.frames}}
