"""A spoken reply's way on from the thinker: its talker inputs go to a talker replica this
thinker picks; the caller gets the text, where the talker and code2wav run, and the talker's end.

    engine outputs -> TalkerRelay.forward -> caller: TextOut (no rows), Finished,
                                             Routed (talker, code2wav), FirstOutput, StageFinished (talker)
                                          -> talker: TalkerStart (prompt), [AudioRows], TextRows, TextEnd

It reads the request's outbox items as they are (TalkerPromptOut, TextOut, Finished, and the
reports it put there itself) and returns typed outputs for the caller, which the servicer's
`to_proto` turns into messages; the talker's messages are built here. They are written, in order,
by a writer task of their own (`_write`): the caller's text does not wait for the talker stream --
its opening, its admission headers (a voice prompt's start, sent after the prefill, takes the
talker ~20 ms to read at full size) -- unless SENDS_LIMIT messages wait for it.

A reply that may call a function (the job's unspoken markers, ThinkerStart.unspoken_tool_calls)
opens no talker stream until it has something to speak: its prompt and the rows of text with
nothing but whitespace wait here, and the talker starts with the first row of other text. A
reply whose talker text ends (a call begins) or whose text ends with nothing spoken costs the
talker nothing: no stream is opened, and the caller gets the talker's end (StageFinished, STOP,
0 frames) with no code2wav route, at once -- so it expects no audio.

An audio prompt's start goes at admission without its audio rows (audio_rows_follow); the talker
answers with the user rows it holds (Held, from its prefix cache), and once the prefill made the
rows (TalkerAudioRowsOut) the writer sends those past the held prefix (AudioRows): a talker that holds
the conversation gets only the new clip's rows, a replica that never saw it gets all of them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import grpc
import torch

from voxpipe.v1 import stages_pb2 as pb

from ..runtime.affinity import RouteKey
from ..runtime.downstream import Downstream, DownstreamFailed, NextStage
from ..runtime.engine import StageError
from ..runtime.outputs import (Finished, FinishReason, FirstOutput, Routed, StageFinished, TalkerAudioRowsOut,
                               TalkerPromptOut, TextOut)
from ..runtime.server import finished_from_proto, talker_prompt_proto
from ..runtime.tensors import to_proto
from .job import ThinkerJob

Output = TalkerPromptOut | TalkerAudioRowsOut | TextOut | Finished | Routed | FirstOutput | StageFinished

SENDS_LIMIT = 64    # talker messages queued for the writer task (as many as a request's outbox holds)

log = logging.getLogger(__name__)


def audio_rows_request(rows: torch.Tensor, first: int) -> pb.TalkerRequest:
    """The AudioRows message of `rows` [M, H] (on the host, in the thinker's dtype) from index `first`
    on, built in place: the rows' bytes are copied once, into the message, and serialized once."""
    msg = pb.TalkerRequest()
    msg.audio_rows.first = first
    to_proto(rows[first:], msg.audio_rows.rows)
    return msg


class TalkerRelay:
    def __init__(self, talker: NextStage, job: ThinkerJob, speech: pb.SpeechParams, rows_as_ids: bool = True) -> None:
        """`rows_as_ids`: text rows go as their token ids (TextRows without rows: the talker looks them up)."""
        self.talker, self.job, self.speech = talker, job, speech
        self.rows_as_ids = rows_as_ids
        self.down: Downstream | None = None
        # to the writer task; None: half-close. Bounded: a talker that stops taking rows holds this
        # handler, and the request's outbox then holds the engine, as when forward wrote itself
        self._sends: asyncio.Queue[pb.TalkerRequest | TalkerAudioRowsOut | None] | None = None
        self._held: asyncio.Future[pb.Held] | None = None     # the talker's Held (audio_rows_follow)
        self._writer: asyncio.Task | None = None
        self._reader: asyncio.Task | None = None
        self.text_done = False
        self.talker_done = False
        self.talker_text_ended = False      # TextEnd sent (at the Finished, or where a tool call began)
        # the talker starts with the first spoken text (a reply that may call); until then its
        # prompt and the rows of whitespace-only text wait here
        self.lazy = bool(job.unspoken)
        self._prompt: pb.TalkerPrompt | None = None
        self._waiting: list[TextOut] = []
        self._rows_later: TalkerAudioRowsOut | None = None    # an audio prompt's rows, for a lazy start

    @property
    def done(self) -> bool:
        return self.text_done and self.talker_done

    async def forward(self, item: Output) -> list[Output]:
        if isinstance(item, TalkerPromptOut):
            if self.lazy:
                self._prompt = talker_prompt_proto(item)
            else:
                self._start(talker_prompt_proto(item))
            return []
        if isinstance(item, TalkerAudioRowsOut):
            if self._sends is not None:
                await self._send(item)          # the writer sends them once the talker's Held is in
            elif self._prompt is not None:      # lazy, not started yet: they follow its start
                self._rows_later = item
            return []
        if isinstance(item, TextOut):
            if item.rows is None and not item.talker_end:
                return [item]
            caller = [dataclasses.replace(item, rows=None)]
            if self._prompt is not None:        # lazy, not started yet
                if not self._speaks(item):
                    self._waiting.append(item)
                    if item.talker_end:         # nothing spoken before the call: no talker
                        return caller + self._unused()
                    return caller
                self._start(self._prompt)
                if self._rows_later is not None:
                    rows, self._rows_later = self._rows_later, None
                    await self._send(rows)
                waiting, self._waiting = self._waiting + [item], []
                for out in waiting:
                    await self._relay(out)
                return caller
            await self._relay(item)
            return caller
        if isinstance(item, Finished):
            self.text_done = True
            if self._prompt is not None:        # lazy and nothing spoken: no talker
                return [item] + self._unused()
            if self._sends is None:         # ended before its prompt (cancelled), or no talker used
                self.talker_done = True
            elif not self.talker_text_ended:
                await self._end_talker_text()
            return [item]
        if isinstance(item, StageFinished):
            self.talker_done = True
        return [item]                       # Routed / FirstOutput / StageFinished, put by _read

    @staticmethod
    def _speaks(item: TextOut) -> bool:
        """Whether `item` gives the talker something to say: text other than whitespace, in rows
        that are not all its last, unspoken one (a talker_end output's last row)."""
        spoken_rows = 0 if item.rows is None else item.rows.shape[0] - (1 if item.talker_end else 0)
        return spoken_rows > 0 and bool((item.text or "").strip())

    def _start(self, prompt: pb.TalkerPrompt) -> None:
        self._prompt = None
        self._held = asyncio.get_running_loop().create_future()
        self._sends = asyncio.Queue(SENDS_LIMIT)
        self._writer = asyncio.ensure_future(self._write(prompt, self._sends))

    def _unused(self) -> list[Output]:
        """The talker's end for a reply it never had to speak (no stream was opened)."""
        self._prompt, self._waiting, self._rows_later = None, [], None
        self.talker_text_ended = True
        if self.talker_done:
            return []
        self.talker_done = True
        return [StageFinished("talker", Finished(FinishReason.STOP))]

    async def _relay(self, item: TextOut) -> None:
        """`item`'s rows (and the end of the talker's text, at talker_end) to the talker."""
        if self._sends is None or self.talker_text_ended:
            return
        if item.rows is not None:
            msg = pb.TalkerRequest()
            msg.rows.token_ids.extend(item.token_ids)   # the rows are these tokens' input embeddings
            msg.rows.more = item.more
            if not self.rows_as_ids:
                to_proto(item.rows, msg.rows.rows)      # in place: the bytes are copied into the message once
            await self._send(msg)
        if item.talker_end:        # the talker's text ends here; the caller's goes on
            await self._end_talker_text()

    async def _end_talker_text(self) -> None:
        self.talker_text_ended = True
        await self._send(pb.TalkerRequest(text_end=pb.TextEnd()))
        await self._send(None)

    async def _send(self, msg: pb.TalkerRequest | None) -> None:
        """Queue `msg` for the writer task; waits only while the queue is full, and drops it once
        the writer has stopped (its reason is in the outbox already)."""
        sends, writer = self._sends, self._writer
        if writer.done():
            return
        if not sends.full():
            sends.put_nowait(msg)
            return
        put = asyncio.ensure_future(sends.put(msg))
        try:
            await asyncio.wait((put, writer), return_when=asyncio.FIRST_COMPLETED)
        finally:
            put.cancel()        # a no-op once it is done

    async def _write(self, prompt: pb.TalkerPrompt, sends: asyncio.Queue) -> None:
        """Open the talker stream, write its start, then the queued messages in order until the
        half-close. A failure to open reaches the outbox as a StageError (the request fails), and
        so does anything else that stops this task (never a silent task: the handler would wait
        for the talker forever); the stream's own failures come out of `_read`, and `Downstream`
        drops writes after them."""
        job, speech = self.job, self.speech
        try:
            down = await self.talker.open("Generate", job.request_id, awaits_admission=True,
                                          key=None if job.session is None else RouteKey(session=job.session))
        except DownstreamFailed as e:
            job.outbox.put(StageError(e.code or grpc.StatusCode.UNAVAILABLE, e.details, e.stage))
            return
        except Exception as e:
            log.exception("request %s: opening the talker stream failed", job.request_id)
            job.outbox.put(StageError(grpc.StatusCode.INTERNAL, f"opening the talker stream failed: {e!r}", "talker"))
            return
        self.down = down
        self._reader = asyncio.ensure_future(self._read(down))
        try:
            start = pb.TalkerStart(request_id=job.request_id, prompt=prompt, speaker=speech.speaker,
                                   sampling=speech.sampling, max_frames=speech.max_frames,
                                   min_frames=speech.min_frames, code2wav=speech.code2wav,
                                   text_cap=speech.text_cap if speech.HasField("text_cap") else None)
            await down.write_start(start, lambda m: pb.TalkerRequest(start=m),
                                   lambda d: pb.TalkerRequest(chunk=pb.PayloadChunk(data=d)))
            while (msg := await sends.get()) is not None:
                if isinstance(msg, TalkerAudioRowsOut):
                    msg = await self._audio_rows(msg)
                    if msg is None:             # the talker stream failed first: its reason is in the outbox
                        return
                await down.write(msg)
            await down.done_writing()
        except Exception as e:
            log.exception("request %s: writing to the talker failed", job.request_id)
            job.outbox.put(StageError(grpc.StatusCode.INTERNAL, f"writing to the talker failed: {e!r}", "talker"))

    async def _audio_rows(self, rows: TalkerAudioRowsOut) -> pb.TalkerRequest | None:
        """The AudioRows message of the rows past what the talker holds (its Held, awaited); None when
        the talker's responses ended without one."""
        await asyncio.wait((self._held, self._reader), return_when=asyncio.FIRST_COMPLETED)
        if not self._held.done():
            return None
        return audio_rows_request(rows.rows, self._held.result().audio_rows)

    async def _read(self, down: Downstream) -> None:
        """The talker's responses, into the request's outbox (the handler forwards them)."""
        outbox = self.job.outbox
        try:
            async for resp in down.responses():
                kind = resp.WhichOneof("kind")
                if kind == "held":
                    if self._held is not None and not self._held.done():
                        self._held.set_result(resp.held)
                elif kind == "routed":
                    # the talker's first response: it holds the request (a retry can no longer move it)
                    outbox.put(Routed("talker", down.address))
                    r = resp.routed
                    outbox.put(Routed(r.stage, r.address, r.listen_token))
                elif kind == "first_output":
                    outbox.put(FirstOutput(resp.first_output.stage))
                elif kind == "finished":
                    down.ended = True
                    outbox.put(StageFinished("talker", finished_from_proto(resp.finished)))
                    return
                else:
                    raise DownstreamFailed("talker", grpc.StatusCode.INTERNAL,
                                           f"unexpected {kind} from a routed talker", down.address)
            raise DownstreamFailed("talker", grpc.StatusCode.INTERNAL, "the talker ended without finishing",
                                   down.address)
        except DownstreamFailed as e:
            log.info("request %s: %s", self.job.request_id, e)
            outbox.put(StageError(e.code or grpc.StatusCode.UNKNOWN, e.details, e.stage))

    def close(self) -> None:
        for task in (self._writer, self._reader):
            if task is not None and not task.done():
                task.cancel()
        if self.down is not None:
            self.down.close()
