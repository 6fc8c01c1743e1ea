"""The realtime voice API: `GET /v1/realtime?model=...` upgraded to a WebSocket speaking OpenAI's
Realtime protocol (GA event names; the beta names with the `OpenAI-Beta: realtime=v1` header).

One connection is one session: its settings, its conversation, its input audio buffer with
server VAD, the utterance being heard (streamed to a thinker while it is spoken: heard.py), at most
one response at a time, and a bounded send queue drained by its own task.
Each concurrent session holds a slot of the gateway's SessionLimiter while it is open. A response
run (response.py) and the transcriber (transcription.py) are given what they may use of the
session, a ResponseContext / TranscriptionContext, not the connection."""

from __future__ import annotations

import asyncio
import json
import logging
import time

from fastapi import APIRouter, WebSocket
from fastapi.responses import JSONResponse
from starlette.websockets import WebSocketDisconnect

from voxpipe.audio import resample_clip
from voxpipe.services.runtime.echo import quoted
from voxpipe.client import AudioTurn
from voxpipe.services.thinker.prompt import (FEATURE_SAMPLE_RATE, RenderedPrompt, special_token_strings,
                                              with_instructions)

from ..errors import APIError
from ..generation import Generation
from ..state import GatewayState, authorized
from .events import (INPUT_SAMPLE_RATE, ClientEvent, Dialect, InputAudioAppend, InputAudioClear, InputAudioCommit,
                     ItemCreate, ItemDelete, ItemRetrieve, ItemTruncate, ProtocolError, ResponseCancel, ResponseCreate,
                     ResponseOverrides, SessionUpdate, parse_client_event)
from .heard import HeardTurn, TurnPrefix, render_prefix, same_prefix
from .outbox import Outbox, Outgoing
from .response import ResponseContext, ResponseRun
from .server_events import (Error, InputAudioCleared, InputAudioCommitted, ItemAdded, ItemDeleted, ItemDone,
                            ItemRetrieved, ItemTruncated, ServerEvent, SessionCreated, SessionUpdated,
                            SpeechStartedEvent, SpeechStoppedEvent, new_id)
from .session import (MIN_COMMIT_MS, Conversation, ConversationItem, InputAudioBuffer, ItemContent, ResponseSettings,
                      FunctionCall, SessionConfig, default_voice, ms_to_samples, new_item_content, prompt_messages,
                      samples_to_ms)
from .transcription import Transcriber, TranscriptionContext, TranscriptionJob
from .truncation import ContextRoom, PromptWindow
from .vad import FRAME_MS, ServerVad, SpeechStarted, SpeechStopped

log = logging.getLogger(__name__)
router = APIRouter()

SEND_TIMEOUT_S = 30.0          # a client that takes no event for this long is disconnected
API_KEY_SUBPROTOCOL = "openai-insecure-api-key."
BETA_SUBPROTOCOL = "openai-beta.realtime-v1"


def _dialect(ws: WebSocket) -> Dialect:
    beta = "realtime=v1" in ws.headers.get("openai-beta", "") or BETA_SUBPROTOCOL in ws.scope.get("subprotocols", [])
    return Dialect.BETA if beta else Dialect.GA


def _authorization(ws: WebSocket) -> str | None:
    """`Authorization: Bearer KEY`, or the browser form: subprotocol `openai-insecure-api-key.KEY`."""
    for proto in ws.scope.get("subprotocols", []):
        if proto.startswith(API_KEY_SUBPROTOCOL):
            return f"Bearer {proto[len(API_KEY_SUBPROTOCOL):]}"
    return ws.headers.get("authorization")


async def _refuse(ws: WebSocket, dialect: Dialect, error: ProtocolError, close_code: int) -> None:
    await ws.send_text(json.dumps(Error.of(error).wire(dialect)))
    await ws.close(close_code, error.message[:120])


@router.websocket("/v1/realtime")
async def realtime(ws: WebSocket, model: str | None = None) -> None:
    state: GatewayState = ws.app.state.gateway
    dialect = _dialect(ws)
    if not authorized(state.config, _authorization(ws)):
        body = {"error": {"message": "missing or incorrect API key; send it as 'Authorization: Bearer <key>'",
                          "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
        try:
            await ws.send_denial_response(JSONResponse(body, status_code=401))
        except RuntimeError:       # the server cannot answer the handshake with a response
            await ws.close(1008, "invalid_api_key")
        return
    offered = ws.scope.get("subprotocols", [])
    await ws.accept(subprotocol="realtime" if "realtime" in offered else None)
    if model is not None and model != state.config.model_id:
        await _refuse(ws, dialect, ProtocolError(f"the model {quoted(model)} does not exist; this server serves "
                                                 f"{state.config.model_id!r}", code="model_not_found", param="model"),
                      1008)
        return
    slot = state.sessions.try_acquire("realtime")
    if slot is None:
        await _refuse(ws, dialect, ProtocolError(f"too many concurrent sessions (the limit is {state.sessions.limit}); "
                                                 "retry later", code="session_limit_reached", type="rate_limit_error"),
                      1013)
        return
    with slot:
        await RealtimeConnection(ws, state, dialect).serve()


class RealtimeConnection:
    def __init__(self, ws: WebSocket, state: GatewayState, dialect: Dialect) -> None:
        self.ws, self.state, self.dialect = ws, state, dialect
        self.session = SessionConfig(id=new_id("sess"), model=state.config.model_id,
                                     voice=default_voice(state.speakers))
        self.conversation = Conversation()
        self.conversation_id = new_id("conv")
        self.buffer = InputAudioBuffer()
        self.vad: ServerVad | None = None          # made in serve() (the first one loads the model)
        self.speech_item_id: str | None = None     # announced at speech_started, committed at speech_stopped
        self.speech_start = 0                       # timeline sample where that utterance begins (with padding)
        self.response: ResponseRun | None = None
        self.outbox = Outbox()
        generation = Generation.of(state)
        self.response_context = ResponseContext(
            generation=generation, conversation_id=self.conversation_id, emit=self.emit,
            insert_item=self.conversation.insert, has_item=self.conversation.has,
            withdraw_audio=self.outbox.withdraw_audio, room=ContextRoom(),
            heard_to_audio=lambda since, s: state.metrics.speech_end_ttfp.labels(since).observe(s),
            take_turn=self._take_turn, prefilled_before_commit=state.metrics.prefilled_before_commit.observe)
        self.heard: HeardTurn | None = None        # the utterance streamed to a thinker while it is spoken
        self.checks: set[asyncio.Task] = set()     # committed turns' streams being checked against the conversation
        self.speech_end: tuple[str, float] | None = None    # the last end of speech, until a response answers it
        self.transcriber = Transcriber(TranscriptionContext(
            generation=generation, emit=self.emit, set_transcript=self.conversation.set_transcript,
            count=lambda outcome: state.metrics.transcriptions.labels(outcome).inc()))

    # ------------------------------------------------------------------------- plumbing

    async def emit(self, event: ServerEvent, *, response_id: str | None = None, audio_samples: int = 0,
                   on_sent=None) -> None:
        body = event.wire(self.dialect)
        if body is not None:
            text = json.dumps(body, separators=(",", ":"))
            await self.outbox.put(Outgoing(text, response_id, audio_samples, on_sent))

    async def _send_loop(self) -> None:
        try:
            while (item := await self.outbox.get()) is not None:
                await asyncio.wait_for(self.ws.send_text(item.text), SEND_TIMEOUT_S)
                self.outbox.sent(item)
        except asyncio.TimeoutError:
            log.warning("realtime session %s: the client took no event for %.0f s; closing", self.session.id,
                        SEND_TIMEOUT_S)
        except (OSError, RuntimeError, WebSocketDisconnect):      # the client went away
            pass
        finally:
            await self.outbox.close()

    async def serve(self) -> None:
        sender = asyncio.ensure_future(self._send_loop())
        try:
            self.vad = await asyncio.to_thread(self._new_vad)
            await self.emit(SessionCreated(self.session))
            while not self.outbox.closed:
                receive = asyncio.ensure_future(self.ws.receive())
                await asyncio.wait({receive, sender}, return_when=asyncio.FIRST_COMPLETED)
                if not receive.done():
                    receive.cancel()
                    break
                message = receive.result()
                if message["type"] == "websocket.disconnect":
                    break
                if message.get("text") is not None:
                    await self.handle(message["text"])
                else:
                    await self.emit(Error.of(ProtocolError("binary messages are not supported; send JSON text",
                                                           code="invalid_json")))
        finally:
            if self.response is not None and self.response.active:
                self.response.task.cancel()                 # frees the request in all three stages
                await asyncio.gather(self.response.task, return_exceptions=True)
            await self._drop_turn()
            if self.state.pipeline is not None:
                self.state.pipeline.end_session(self.conversation_id)     # its thinker replica no longer counts it
            for task in self.checks:
                task.cancel()
            await asyncio.gather(*self.checks, return_exceptions=True)
            await self.transcriber.close()
            await self.outbox.close()
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)

    async def handle(self, text: str) -> None:
        try:
            event = parse_client_event(text)
        except ProtocolError as e:
            await self.emit(Error.of(e))
            return
        except Exception:  # a bug in reading an event must not end the session either
            log.exception("realtime session %s: reading a client event failed", self.session.id)
            await self.emit(Error.of(ProtocolError("the server failed to read this event", code="server_error",
                                                   type="server_error")))
            return
        try:
            await self.dispatch(event)
        except ProtocolError as e:
            e.event_id = e.event_id or event.event_id
            await self.emit(Error.of(e))
        except Exception:  # a bug here must not end the session: say so and go on
            log.exception("realtime session %s: handling %s failed", self.session.id, type(event).__name__)
            await self.emit(Error.of(ProtocolError("the server failed to handle this event", code="server_error",
                                                   type="server_error", event_id=event.event_id)))

    async def dispatch(self, event: ClientEvent) -> None:
        if isinstance(event, InputAudioAppend):
            await self.append_audio(event)
        elif isinstance(event, SessionUpdate):
            await self.update_session(event)
        elif isinstance(event, InputAudioCommit):
            await self.commit_audio()
        elif isinstance(event, InputAudioClear):
            self.buffer.clear()
            self._forget_speech()
            await self._drop_turn()
            await self.emit(InputAudioCleared())
        elif isinstance(event, ItemCreate):
            await self.create_item(event)
            self._conversation_changed()
        elif isinstance(event, ItemTruncate):
            await self.truncate_item(event)
            self._conversation_changed()
        elif isinstance(event, ItemDelete):
            self._check_not_generating(event.item_id)
            self.conversation.delete(event.item_id)
            self._conversation_changed()
            await self.emit(ItemDeleted(event.item_id))
        elif isinstance(event, ItemRetrieve):
            await self.emit(ItemRetrieved(self.conversation.find(event.item_id)))
        elif isinstance(event, ResponseCreate):
            await self.create_response(event.overrides)
        elif isinstance(event, ResponseCancel):
            await self.cancel_response(event)

    # ------------------------------------------------------------------------- session and audio

    def _new_vad(self) -> ServerVad | None:
        params = self.session.turn_detection
        return None if params is None else ServerVad(params, INPUT_SAMPLE_RATE, origin_ms=self.buffer.end_ms)

    def _forget_speech(self) -> None:
        self.speech_item_id = None
        if self.vad is not None:
            self.vad = self._new_vad()

    async def update_session(self, event: SessionUpdate) -> None:
        """All or nothing: a field that is refused leaves the session as it was."""
        old = self.session.turn_detection
        session = self.session.updated(event.patch, self.state.speakers)
        if event.patch.instructions:    # render them now: every later response would fail otherwise
            try:
                await self.response_context.generation.render(with_instructions(event.patch.instructions, []))
            except APIError as e:
                raise ProtocolError(f"'session.instructions': {e.message}", param="session.instructions") from None
        self.session = session
        self._conversation_changed()                # the instructions or tools may be others
        if self.session.turn_detection != old:
            self.speech_item_id = None
            await self._drop_turn()
            self.vad = await asyncio.to_thread(self._new_vad)
        await self.emit(SessionUpdated(self.session))

    async def append_audio(self, event: InputAudioAppend) -> None:
        self.buffer.append(event.audio)
        if self.vad is None:            # no VAD: the turn is all the buffer holds, until the commit
            if self.heard is None or self.heard.features is not None:
                await self._begin_turn(self.buffer.start)
            await self._hear(self.buffer.end)
            return
        for vad_event in await asyncio.to_thread(self.vad.feed, event.audio):
            if isinstance(vad_event, SpeechStarted):
                await self._speech_started(vad_event)
            elif isinstance(vad_event, SpeechStopped):
                await self._speech_stopped(vad_event)
        if self.speech_item_id is None and self.vad is not None:      # idle: keep only the prefix padding
            keep_ms = self.vad.params.prefix_padding_ms + 2 * FRAME_MS
            self.buffer.drop_before(self.buffer.end - ms_to_samples(keep_ms))
        elif self.vad is not None:
            # a later speech_stopped ends its utterance at the end of a frame the VAD has not finished
            # (SpeechStopped.end_ms), so the audio before the VAD's next frame is the utterance's
            vad = self.vad
            await self._hear(ms_to_samples(vad.origin_ms + vad.frames * FRAME_MS))

    # ------------------------------------------------------------------------- the utterance, streamed

    async def _turn_prefix(self, turns=None) -> TurnPrefix:
        """The conversation before a new user turn (`turns`; default: the conversation's), rendered as
        a response with the session's settings renders it (a ProtocolError or APIError when it cannot be)."""
        gen = self.response_context.generation
        settings = ResponseSettings.resolve(self.session, ResponseOverrides(), self.state.speakers)
        tools = settings.tools.prompt_tools
        turns = self.conversation.turns() if turns is None else turns
        return await render_prefix(lambda m: gen.render(m, tools=tools, tools_param="session.tools"),
                                   lambda user: prompt_messages(settings.instructions, [*turns, ("", user)]),
                                   gen.audio_token, self.state.features.num_mel_bins)

    async def _open_turn(self, heard: HeardTurn) -> None:
        try:
            prefix = await self._turn_prefix()
        except (APIError, ProtocolError) as e:       # not streamed: the response says what is wrong
            log.debug("realtime session %s: the turn is not streamed (%s)", self.session.id, e)
            heard.prefix, heard.stale = None, False
            await heard.close()
            return
        if heard is self.heard and not same_prefix(heard.prefix, prefix):
            await heard.close()
            heard.open(self.response_context.generation.open_turn, prefix, self.conversation_id)
        heard.stale = False

    async def _begin_turn(self, start: int) -> None:
        """A new utterance from timeline sample `start`: streamed to a thinker as it comes."""
        await self._drop_turn()
        if self.response_context.generation.open_turn is None:
            return
        self.heard = HeardTurn(start, self.state.features.fe.mel_filters)
        await self._open_turn(self.heard)

    async def _hear(self, upto: int, last: bool = False) -> None:
        """The buffered audio up to timeline sample `upto` into the utterance being heard (`last`: it
        ends there); a conversation changed since it began is rendered again first."""
        heard = self.heard
        if heard is None or heard.features is not None:
            return
        if heard.stale and not last:
            await self._open_turn(heard)
        if upto > heard.fed or last:
            try:
                await heard.feed(self.buffer.peek(heard.fed, upto), last)
            except Exception:     # a bug here must not fail the turn: it is featurized whole at the commit
                log.exception("realtime session %s: hearing the utterance failed; it goes whole", self.session.id)
                await self._drop_turn()

    def _conversation_changed(self) -> None:
        heard = self.heard
        if heard is None:
            return
        if heard.features is None:
            heard.stale = True
        elif heard.turn is not None:         # committed, waiting for its response: still the turn it would answer?
            self._later(self._check_committed(heard))

    def _later(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self.checks.add(task)
        task.add_done_callback(self.checks.discard)

    def _hold(self, heard: HeardTurn, item_id: str) -> None:
        """The committed `heard` (item `item_id`) keeps its stream for its response until the hold ends."""
        heard.item_id = item_id
        hold = self.state.config.realtime_turn_hold_s
        heard.hold = asyncio.get_running_loop().call_later(hold, lambda: self._later(self._release(heard, "held")))

    async def _release(self, heard: HeardTurn, why: str) -> None:
        """Cancel the committed `heard`'s stream if it is still the turn waiting for a response."""
        if heard is self.heard and heard.features is not None:
            log.debug("realtime session %s: the committed turn's stream is released (%s)", self.session.id, why)
            await self._drop_turn()

    async def _check_committed(self, heard: HeardTurn) -> None:
        """Release a committed turn's stream unless its item is still the conversation's last and what
        comes before it renders as the stream's prefix (a response would take it)."""
        turns = self.conversation.turns()
        if turns and turns[-1][0] == heard.item_id:
            try:
                if same_prefix(heard.prefix, await self._turn_prefix(turns[:-1])):
                    return
            except (APIError, ProtocolError):
                pass
        await self._release(heard, "the conversation changed")

    async def _drop_turn(self) -> None:
        """Cancel the utterance being heard (or heard and not yet answered): the thinker frees it."""
        heard, self.heard = self.heard, None
        if heard is not None:
            if heard.turn is not None:
                self.state.metrics.streamed_turns.labels("cancelled").inc()
            await heard.close()

    async def _take_turn(self, prompt: RenderedPrompt) -> AudioTurn | None:
        """The response's: the committed utterance's stream when `prompt` is what it was opened for."""
        heard = self.heard
        if heard is None or heard.features is None or heard.turn is None:
            return None
        self.heard = None
        turn = heard.take(prompt, self.response_context.generation.audio_token)
        self.state.metrics.streamed_turns.labels("redone" if turn is None else "streamed").inc()
        await heard.close()
        return turn

    async def _finish_turn(self, start: int, end: int):
        """The utterance heard, completed, when it is the clip [start, end) of the buffer being
        committed: its features (its stream waits for the response); else None (it is dropped)."""
        heard = self.heard
        if heard is None or heard.features is not None or heard.start != start or heard.fed > end:
            await self._drop_turn()
            return None
        await self._hear(end, last=True)
        return heard.features if heard is self.heard else None

    async def _speech_started(self, ev: SpeechStarted) -> None:
        params = self.vad.params
        self.speech_start = max(self.buffer.start, ms_to_samples(max(0, ev.onset_ms - params.prefix_padding_ms)))
        self.speech_item_id = new_id("item")
        await self.emit(SpeechStartedEvent(samples_to_ms(self.speech_start), self.speech_item_id))
        if params.interrupt_response and self.response is not None and self.response.active:
            await self.response.cancel("turn_detected")
        await self._begin_turn(self.speech_start)       # after the cancel: its reply is final

    async def _speech_stopped(self, ev: SpeechStopped) -> None:
        params = self.vad.params
        item_id = self.speech_item_id or new_id("item")
        self.speech_item_id = None
        stopped_at = time.perf_counter()
        await self.emit(SpeechStoppedEvent(ev.end_ms, item_id))
        end = min(ms_to_samples(ev.end_ms), self.buffer.end)
        if end - max(self.speech_start, self.buffer.start) < ms_to_samples(MIN_COMMIT_MS):
            await self._drop_turn()
            return
        self.speech_end = ("speech_stopped", stopped_at)
        features = await self._finish_turn(max(self.speech_start, self.buffer.start), end)
        item = await self._commit(self.buffer.take(self.speech_start, end), item_id, features)
        try:
            if not params.create_response:
                return
            if self.response is not None and self.response.active:
                await self.emit(Error.of(ProtocolError(
                    "the speech ended while a response is in progress (interrupt_response is off); no new response "
                    "was created", code="conversation_already_has_active_response")))
                return
            await self.create_response(ResponseOverrides())
        finally:
            self._transcribe(item)          # after the response has started: it never waits for this

    async def commit_audio(self) -> None:
        have_ms = samples_to_ms(self.buffer.size)
        if have_ms < MIN_COMMIT_MS:
            raise ProtocolError(f"buffer too small: expected at least {MIN_COMMIT_MS} ms of audio, but the buffer "
                                f"has {have_ms} ms", code="input_audio_buffer_commit_empty")
        item_id = self.speech_item_id or new_id("item")
        self.speech_item_id = None
        self.speech_end = ("committed", time.perf_counter())
        features = await self._finish_turn(self.buffer.start, self.buffer.end)
        self._transcribe(await self._commit(self.buffer.take(), item_id, features))

    def _features(self, audio_24k):
        """A clip's features (the resampling a streamed utterance gets: heard.py)."""
        return self.state.features(resample_clip(audio_24k, INPUT_SAMPLE_RATE, FEATURE_SAMPLE_RATE))

    async def _commit(self, clip, item_id: str, features=None) -> ConversationItem:
        """The whole utterance becomes a user item: `features` those of the utterance heard while it
        was spoken (`_finish_turn`), or made now."""
        if features is None:
            features = await asyncio.to_thread(self._features, clip)
        item = ConversationItem(item_id, "user", [ItemContent("input_audio", features=features,
                                                              audio_samples=len(clip))])
        previous = self.conversation.insert(item)
        if self.heard is not None and self.heard.features is features and self.heard.turn is not None:
            self._hold(self.heard, item_id)
        await self.emit(InputAudioCommitted(previous, item_id))
        await self.emit(ItemAdded(previous, item))
        await self.emit(ItemDone(previous, item))
        return item

    def _transcribe(self, item: ConversationItem) -> None:
        """Transcribe a committed user audio item when the session asks for it (in the background)."""
        settings = self.session.transcription
        if settings is None:
            return
        content = item.content[0]
        self.transcriber.submit(TranscriptionJob(item.id, 0, content.features, content.audio_samples, settings))

    # ------------------------------------------------------------------------- conversation

    async def create_item(self, event: ItemCreate) -> None:
        if event.previous_item_id not in (None, "root"):
            self.conversation.find(event.previous_item_id, "previous_item_id")
        new = event.item
        if new.type == "function_call_output" and not self.conversation.has_call(new.call_id):
            raise ProtocolError(f"'item.call_id' {new.call_id!r} answers no function_call item of the conversation",
                                param="item.call_id")
        if new.type == "function_call":
            # the template writes a call's name and arguments among its own markup: a control token in them
            # would fail every later response's rendering (the item stays), so it is refused here, as chat does
            with self.state.tokenizer_lock:
                specials = special_token_strings(self.state.tokenizer)
            for name, text in (("name", new.name), ("arguments", new.arguments)):
                found = sorted(t for t in specials if t in text)
                if found:
                    raise ProtocolError(f"'item.{name}' contains the model's control token {found[0]!r}, which "
                                        "function calls may not hold", param=f"item.{name}")
        content = await asyncio.to_thread(new_item_content, new, self._features)
        item = ConversationItem(new.id or new_id("item"), new.role, content,
                                call=FunctionCall(new.call_id, new.name, new.arguments) if new.type == "function_call"
                                else None,
                                call_id=new.call_id if new.type == "function_call_output" else None, output=new.output)
        previous = self.conversation.insert(item, event.previous_item_id)
        await self.emit(ItemAdded(previous, item))
        await self.emit(ItemDone(previous, item))

    def _check_not_generating(self, item_id: str) -> None:
        if self.response is not None and self.response.generating(item_id):
            raise ProtocolError(f"item {quoted(item_id)} is being generated; cancel the response first",
                                code="item_in_progress", param="item_id")

    async def truncate_item(self, event: ItemTruncate) -> None:
        self._check_not_generating(event.item_id)
        item = self.conversation.find(event.item_id)
        if item.role != "assistant":
            raise ProtocolError("only assistant messages can be truncated", param="item_id")
        if not 0 <= event.content_index < len(item.content) or item.content[event.content_index].kind != "output_audio":
            raise ProtocolError(f"content_index {event.content_index} is not an audio part of item {quoted(item.id)}",
                                param="content_index")
        content = item.content[event.content_index]
        have_ms = samples_to_ms(content.audio_samples)
        if event.audio_end_ms > have_ms:
            raise ProtocolError(f"audio_end_ms {event.audio_end_ms} is beyond the item's audio ({have_ms} ms)",
                                param="audio_end_ms")
        content.truncate_audio(ms_to_samples(event.audio_end_ms))
        await self.emit(ItemTruncated(item.id, event.content_index, event.audio_end_ms))

    # ------------------------------------------------------------------------- responses

    async def create_response(self, overrides: ResponseOverrides) -> None:
        if self.response is not None and self.response.active:
            raise ProtocolError(f"the conversation already has an active response ({self.response.id}); cancel it "
                                "or wait for response.done", code="conversation_already_has_active_response")
        settings = ResponseSettings.resolve(self.session, overrides, self.state.speakers)
        window = PromptWindow(settings.instructions, self.conversation.turns(), drop=self.conversation.drop)
        self.response = ResponseRun(self.response_context, settings, window, speech_end=self.speech_end)
        self.speech_end = None
        self.response.start()
        self.response.task.add_done_callback(lambda _: self._conversation_changed())    # its items are in

    async def cancel_response(self, event: ResponseCancel) -> None:
        run = self.response
        if run is None or not run.active:
            raise ProtocolError("there is no response in progress to cancel", code="response_cancel_not_active")
        if event.response_id is not None and event.response_id != run.id:
            raise ProtocolError(f"response {quoted(event.response_id)} is not in progress (the active one is {run.id})",
                                code="response_cancel_not_active", param="response_id")
        await run.cancel("client_cancelled")
