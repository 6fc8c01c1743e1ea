"""A spoken reply's way on from the talker: its codec frames go to a code2wav replica this talker
picks; the thinker (its caller) gets where code2wav runs and, once code2wav has decoded the last
frame, the talker's Finished.

    engine outputs -> Code2WavRelay.forward -> code2wav: Code2WavStart (to_listener), CodecFrames, FramesEnd
                                            -> caller:   Routed (code2wav, listen token), FirstOutput, Finished
    code2wav's Playback reports (where the listener is) -> `on_playback` (the engine's playback clock)

It reads the request's outbox items as they are (FramesOut, Finished, and the Routed it put there
itself) and returns typed outputs for the caller, which the servicer's `to_proto` turns into messages.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from voxpipe.v1 import stages_pb2 as pb

from ..runtime.downstream import Downstream, DownstreamFailed, NextStage
from ..runtime.engine import StageError
from ..runtime.outputs import Finished, FinishReason, FirstOutput, FramesOut, HeldOut, Routed
from ..runtime.server import frames_proto
from .job import TalkerJob

log = logging.getLogger(__name__)


class Code2WavRelay:
    def __init__(self, code2wav: NextStage, job: TalkerJob, params: pb.Code2WavParams,
                 on_playback: Callable[[float, float], None]) -> None:
        """`on_playback(played_seconds, delivered_seconds)`: each of code2wav's Playback reports."""
        self.code2wav, self.job, self.params = code2wav, job, params
        self.on_playback = on_playback
        self.done = False
        loop = asyncio.get_running_loop()
        self._down: asyncio.Future[Downstream | None] = loop.create_future()
        self._finished: Finished | None = None   # the engine's Finished, held until code2wav ends
        self._closed = False
        self._task = asyncio.ensure_future(self._run())

    async def forward(self, item: FramesOut | Finished | Routed | HeldOut) -> list[Finished | Routed | FirstOutput | HeldOut]:
        if isinstance(item, (Routed, HeldOut)):
            return [item]
        down = await asyncio.shield(self._down)     # a cancelled handler must not cancel the future _run resolves
        if down is None:                    # code2wav could not be reached: the StageError is on its way
            return []
        if isinstance(item, FramesOut):
            await down.write(pb.Code2WavRequest(frames=frames_proto(item)))
            return [FirstOutput("talker")] if item.index == 0 else []
        if isinstance(item, Finished):
            if item.reason == FinishReason.CANCELLED or self._finished is not None:
                # cancelled (close() cancels code2wav's side), or _run put the held Finished back
                # once code2wav decoded every frame (the audio is the listener's)
                self.done = True
                return [item]
            # hold it without blocking this loop: the Routed (listen token) may still be behind it,
            # and code2wav only ends once the caller's listener has read the audio
            self._finished = item
            await down.write(pb.Code2WavRequest(frames_end=pb.FramesEnd()))
            await down.done_writing()
        return []

    async def _run(self) -> None:
        """Open the code2wav stream, then read it: Accepted -> Routed for the caller; Finished ->
        the held Finished back into the outbox (the handler ends with it); a failure -> a StageError
        naming code2wav."""
        job, p = self.job, self.params
        outbox = job.outbox
        down = None
        try:
            down = await self.code2wav.open("Decode", job.request_id, awaits_admission=True)
            await down.write_start(pb.Code2WavStart(
                request_id=job.request_id, encoding=p.encoding, first_chunk_frames=p.first_chunk_frames,
                chunk_frames=p.chunk_frames, to_listener=True, echo_frames=p.echo_frames, playback_reports=True),
                lambda m: pb.Code2WavRequest(start=m))
            self._down.set_result(down)         # frames are written after the start
            async for resp in down.responses():
                kind = resp.WhichOneof("kind")
                if kind == "accepted":
                    outbox.put(Routed("code2wav", down.address, resp.accepted.listen_token))
                elif kind == "playback":
                    self.on_playback(resp.playback.played_seconds, resp.playback.delivered_seconds)
                elif kind == "finished":
                    down.ended = True
                    if self._finished is None:   # code2wav cannot end before the frames did
                        raise DownstreamFailed("code2wav", grpc.StatusCode.INTERNAL,
                                               "code2wav finished before the frames ended", down.address)
                    outbox.put(self._finished)
                    return
                else:
                    raise DownstreamFailed("code2wav", grpc.StatusCode.INTERNAL,
                                           f"unexpected {kind} on a to_listener stream", down.address)
            raise DownstreamFailed("code2wav", grpc.StatusCode.INTERNAL, "code2wav ended without finishing",
                                   down.address)
        except DownstreamFailed as e:
            log.info("request %s: %s", job.request_id, e)
            outbox.put(StageError(e.code or grpc.StatusCode.UNKNOWN, e.details, e.stage))
        finally:
            if not self._down.done():
                self._down.set_result(down)
            if self._closed and down is not None:   # close() came while the stream was opening
                down.close()

    def close(self) -> None:
        self._closed = True
        if not self._task.done():
            self._task.cancel()
        if self._down.done() and not self._down.cancelled() and self._down.result() is not None:
            self._down.result().close()
