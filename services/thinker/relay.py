"""A spoken reply's way on from the thinker: its talker inputs go to a talker replica this
thinker picks; the caller gets the text, where the talker and code2wav run, and the talker's end.

    engine outputs -> TalkerRelay.forward -> caller: TextOut (no rows), Finished,
                                             Routed (talker, code2wav), FirstOutput, StageFinished (talker)
                                          -> talker: TalkerStart (prompt), TextRows, TextEnd

It reads the request's outbox items as they are (TalkerPromptOut, TextOut, Finished, and the
reports it put there itself) and returns typed outputs for the caller, which the servicer's
`to_proto` turns into messages; the talker's messages are built here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import grpc

from voxpipe.v1 import stages_pb2 as pb

from ..runtime.downstream import Downstream, DownstreamFailed, NextStage
from ..runtime.engine import StageError
from ..runtime.outputs import Finished, FirstOutput, Routed, StageFinished, TalkerPromptOut, TextOut
from ..runtime.server import finished_from_proto, talker_prompt_proto
from ..runtime.tensors import to_proto
from .job import ThinkerJob

Output = TalkerPromptOut | TextOut | Finished | Routed | FirstOutput | StageFinished

log = logging.getLogger(__name__)


class TalkerRelay:
    def __init__(self, talker: NextStage, job: ThinkerJob, speech: pb.SpeechParams) -> None:
        self.talker, self.job, self.speech = talker, job, speech
        self.down: Downstream | None = None
        self._reader: asyncio.Task | None = None
        self.text_done = False
        self.talker_done = False

    @property
    def done(self) -> bool:
        return self.text_done and self.talker_done

    async def forward(self, item: Output) -> list[Output]:
        if isinstance(item, TalkerPromptOut):
            await self._open(talker_prompt_proto(item))
            return []
        if isinstance(item, TextOut):
            if item.rows is None:
                return [item]
            if self.down is not None:
                await self.down.write(pb.TalkerRequest(rows=pb.TextRows(token_ids=item.token_ids,
                                                                         rows=to_proto(item.rows), more=item.more)))
            return [dataclasses.replace(item, rows=None)]
        if isinstance(item, Finished):
            self.text_done = True
            if self.down is None:           # ended before its prompt (cancelled): no talker to wait for
                self.talker_done = True
            else:
                await self.down.write(pb.TalkerRequest(text_end=pb.TextEnd()))
                await self.down.done_writing()
            return [item]
        if isinstance(item, StageFinished):
            self.talker_done = True
        return [item]                       # Routed / FirstOutput / StageFinished, put by _read

    async def _open(self, prompt: pb.TalkerPrompt) -> None:
        job, speech = self.job, self.speech
        try:
            self.down = await self.talker.open("Generate", job.request_id, awaits_admission=True)
        except DownstreamFailed as e:
            job.outbox.put(StageError(e.code or grpc.StatusCode.UNAVAILABLE, e.details, e.stage))
            return
        start = pb.TalkerStart(request_id=job.request_id, prompt=prompt, speaker=speech.speaker,
                               sampling=speech.sampling, max_frames=speech.max_frames, min_frames=speech.min_frames,
                               code2wav=speech.code2wav, text_cap=speech.text_cap if speech.HasField("text_cap") else None)
        await self.down.write_start(start, lambda m: pb.TalkerRequest(start=m),
                                    lambda d: pb.TalkerRequest(chunk=pb.PayloadChunk(data=d)))
        self._reader = asyncio.ensure_future(self._read(self.down))

    async def _read(self, down: Downstream) -> None:
        """The talker's responses, into the request's outbox (the handler forwards them)."""
        outbox = self.job.outbox
        try:
            async for resp in down.responses():
                kind = resp.WhichOneof("kind")
                if kind == "routed":
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
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
        if self.down is not None:
            self.down.close()
