"""All three stage engines in one process, chained without gRPC: the baseline that tells what the
three-service split costs. Same engines, same servicer validation; the engines' typed outputs are
passed on as they are, but audio, which goes out in its wire encoding as the code2wav servicer sends it."""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import torch

from voxpipe.client import AudioEvent, DoneEvent, FramesEvent, SpeechRequest, TextEvent, _decode_audio
from voxpipe.services.code2wav import server as code2wav_server
from voxpipe.services.runtime import metrics
from voxpipe.services.runtime.engine import StageError
from voxpipe.services.runtime.outputs import AudioOut, Finished, FramesOut, TalkerPromptOut, TextOut
from voxpipe.services.runtime.server import talker_prompt_proto
from voxpipe.services.runtime.tensors import ids_proto, to_proto
from voxpipe.services.talker import server as talker_server
from voxpipe.services.thinker import server as thinker_server
from voxpipe.v1 import stages_pb2 as pb


class InProcessPipeline:
    def __init__(self, stage_args: dict[str, argparse.Namespace]) -> None:
        """`stage_args`: each stage's parsed service arguments (`voxpipe <stage> ...`)."""
        self.thinker, self.cfg = thinker_server.build(stage_args["thinker"])
        self.talker = talker_server.build(stage_args["talker"])
        self.code2wav = code2wav_server.build(stage_args["code2wav"])
        for s in (self.thinker, self.talker, self.code2wav):
            s.engine.start()

    @classmethod
    def from_argv(cls, argv: list[str], devices: dict[str, str] | None = None,
                  stage_argv: dict[str, list[str]] | None = None) -> "InProcessPipeline":
        """Each stage parsed as its service would be: `voxpipe <stage> *argv *stage_argv[stage]`
        (so each keeps its own defaults, e.g. the talker's longer --max-len), on devices[stage]
        when given. Code2wav sends a chunk per frame, as the split services do."""
        from voxpipe.cli import build_parser

        parser = build_parser()
        args = {}
        for stage in ("thinker", "talker", "code2wav"):
            extra = list((stage_argv or {}).get(stage, []))
            if devices and stage in devices:
                extra += ["--device", devices[stage]]
            # it serves nothing: port 0, so no default port is checked (a host's other voxpipe keeps it)
            args[stage] = parser.parse_args([stage, "--port", "0", *argv, *extra])
        return cls(args)

    def close(self) -> None:
        for s in (self.thinker, self.talker, self.code2wav):
            s.engine.stop()

    async def stream(self, req: SpeechRequest) -> AsyncIterator:
        start = pb.ThinkerStart(request_id=req.request_id, max_tokens=req.max_tokens, min_tokens=req.min_tokens,
                                talker_rows=True, audio_features=[to_proto(f.float()) for f in req.audio_features])
        if req.assistant_text is None:
            start.sampling.CopyFrom(req.sampling())
        else:       # as the pipeline client: the reply is given, the sampling values are the talker's
            start.assistant_text = req.assistant_text
        ids_proto(req.token_ids, start.token_ids)
        tj = self.thinker.make_job(start)
        self.thinker.engine.submit(tj)
        ta_job = cw_job = None
        text_done = audio_done = False
        frames = samples = 0
        reason_text = reason_audio = None
        import asyncio

        merged: asyncio.Queue = asyncio.Queue()

        async def pump(job, tag):
            while True:
                item, waited = await job.outbox.get_timed()
                metrics.OUTBOX_WAIT.labels(tag).observe(waited)   # as the stage servers do
                await merged.put((tag, item))
                if isinstance(item, (Finished, StageError)):
                    return

        tasks = [asyncio.ensure_future(pump(tj, "thinker"))]
        try:
            while not (text_done and audio_done):
                tag, item = await merged.get()
                if isinstance(item, StageError):
                    raise RuntimeError(f"{tag}: {item}")
                if tag == "thinker":
                    if isinstance(item, TalkerPromptOut):      # the talker's start message, as the relay sends it
                        ts = pb.TalkerStart(request_id=req.request_id, prompt=talker_prompt_proto(item),
                                            speaker=req.speaker, sampling=req.sampling(), max_frames=req.max_frames,
                                            min_frames=req.min_frames)
                        ta_job = self.talker.make_job(ts)
                        self.talker.engine.submit(ta_job)
                        tasks.append(asyncio.ensure_future(pump(ta_job, "talker")))
                        cw_job = code2wav_server.Code2WavJob(request_id=req.request_id, outbox=_outbox(),
                                                             encoding=req.encoding)
                        self.code2wav.engine.submit(cw_job)
                        tasks.append(asyncio.ensure_future(pump(cw_job, "code2wav")))
                    elif isinstance(item, TextOut):
                        yield TextEvent(item.index, list(item.token_ids), self.thinker.text(tj, item))
                        if item.rows is not None:
                            self.talker.engine.add_rows(ta_job, item.rows, more=item.more)
                    elif isinstance(item, Finished):
                        text_done, reason_text = True, int(item.reason)
                        self.talker.engine.end_text(ta_job)
                elif tag == "talker":
                    if isinstance(item, FramesOut):
                        codes = item.codes.to(torch.int64)
                        frames += codes.shape[0]
                        self.code2wav.engine.add_frames(cw_job, codes)
                        yield FramesEvent(item.index, codes)
                    elif isinstance(item, Finished):
                        reason_audio = int(item.reason)
                        self.code2wav.engine.end_frames(cw_job)
                elif tag == "code2wav":
                    if isinstance(item, AudioOut):
                        chunk = self.code2wav.to_proto(cw_job, item).audio   # the wire encoding, as served
                        samples += chunk.num_samples
                        yield AudioEvent(chunk.sample_offset, chunk.sample_rate, _decode_audio(chunk), chunk.data)
                    elif isinstance(item, Finished):
                        audio_done = True
            yield DoneEvent(reason_text, reason_audio, len(req.token_ids), req.max_tokens, frames, samples)
        finally:
            for job, engine in ((tj, self.thinker.engine), (ta_job, self.talker.engine), (cw_job, self.code2wav.engine)):
                if job is not None and not job.done:
                    engine.cancel(job)
            for t in tasks:
                t.cancel()


def _outbox():
    import asyncio

    from voxpipe.services.runtime.engine import Outbox

    return Outbox(asyncio.get_running_loop())
