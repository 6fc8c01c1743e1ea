"""Code2Wav gRPC service: `voxpipe code2wav --model DIR --port N`."""

from __future__ import annotations

import argparse
import asyncio
import uuid

import grpc
import torch

from voxpipe.v1 import stages_pb2 as pb
from voxpipe.v1 import stages_pb2_grpc as pb_grpc

from ..runtime.config import OmniConfig
from ..runtime.engine import Outbox
from ..runtime.layers import serving_layout
from ..runtime.server import Abort, StageServicer, add_stage_arguments, run_async, run_server, server_options
from ..runtime.tensors import from_proto
from ..runtime.tracing import setup_tracing, traced_rpc
from ..runtime.weights import load_module, resolve_device, resolve_dtype
from .engine import Code2WavEngine, Code2WavJob
from .model import Code2WavModel

CODE_DTYPES = (torch.uint16, torch.int32, torch.int64)


class Code2WavServicer(StageServicer, pb_grpc.Code2WavServicer):
    def __init__(self, engine: Code2WavEngine, opts, cfg: OmniConfig, first_chunk_frames: int, chunk_frames: int) -> None:
        super().__init__(engine, opts)
        self.cfg = cfg
        self.first_chunk_frames, self.chunk_frames = first_chunk_frames, chunk_frames

    def merge(self, first: pb.Code2WavResponse, then: pb.Code2WavResponse) -> pb.Code2WavResponse | None:
        """Consecutive audio chunks of one request (same encoding, contiguous samples) travel as one."""
        if first.WhichOneof("kind") != "audio" or then.WhichOneof("kind") != "audio":
            return None
        a, b = first.audio, then.audio
        if (b.encoding, b.sample_rate) != (a.encoding, a.sample_rate) or b.sample_offset != a.sample_offset + a.num_samples:
            return None
        return pb.Code2WavResponse(audio=pb.AudioChunk(sample_offset=a.sample_offset, sample_rate=a.sample_rate,
                                                       encoding=a.encoding, data=a.data + b.data,
                                                       num_samples=a.num_samples + b.num_samples))

    def make_job(self, start: pb.Code2WavStart) -> Code2WavJob:
        if start.encoding not in (pb.AUDIO_ENCODING_UNSPECIFIED, pb.AUDIO_PCM16, pb.AUDIO_FLOAT32):
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown audio encoding {start.encoding}")
        return Code2WavJob(request_id=start.request_id or uuid.uuid4().hex, outbox=Outbox(asyncio.get_running_loop()),
                           encoding=start.encoding or pb.AUDIO_PCM16,
                           first_chunk_frames=start.first_chunk_frames or self.first_chunk_frames,
                           chunk_frames=start.chunk_frames or self.chunk_frames)

    @traced_rpc("voxpipe.v1.Code2Wav", "Decode")
    async def Decode(self, request_iterator, context: grpc.aio.ServicerContext):
        it = request_iterator.__aiter__()
        job = await self.open_stream(it, context)
        if job is None:
            return
        cw = self.cfg.code2wav

        async def reader() -> None:
            async for msg in it:
                kind = msg.WhichOneof("kind")
                if kind == "frames":
                    if job.frames_end:
                        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "frames after frames_end")
                    codes = from_proto(msg.frames.codes, shape=(None, cw.num_quantizers), name="frames.codes")
                    if codes.dtype not in CODE_DTYPES:
                        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "frames.codes must be uint16, int32 or int64")
                    codes = codes.to(torch.int64)
                    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= cw.codebook_size):
                        raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"codec codes must be in [0, {cw.codebook_size}), got {int(codes.min())}..{int(codes.max())}")
                    self.engine.add_frames(job, codes)
                elif kind == "frames_end":
                    self.engine.end_frames(job)
                elif kind == "cancel":
                    self.engine.cancel(job)
                    job.outbox.put(pb.Code2WavResponse(finished=self.cancelled()))
                    return
                else:
                    raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected {kind} after start")
            if not job.frames_end:
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "request stream ended before frames_end")

        async for item in self.serve_request(job, context, reader):
            yield item


def build(args) -> Code2WavServicer:
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.gpu_memory_fraction and device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(args.gpu_memory_fraction, device)
    cfg = OmniConfig.load(args.model)
    model = load_module(lambda: Code2WavModel(cfg.code2wav), args.model, "code2wav.", device=device,
                        dtype=torch.float32 if args.dtype == "auto" else dtype, load_format=args.load_format)
    serving_layout(model, device)
    engine = Code2WavEngine(model, cfg.code2wav, device=device, max_active=args.max_batch,
                            cuda_graphs=args.cuda_graphs)
    return Code2WavServicer(engine, server_options(args), cfg, args.first_chunk_frames, args.chunk_frames)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_stage_arguments(parser, default_port=50053)
    parser.add_argument("--first-chunk-frames", type=int, default=1, help="frames gathered before the first audio")
    parser.add_argument("--chunk-frames", type=int, default=1, help="frames gathered before each later chunk")


def run(args) -> None:
    setup_tracing("voxpipe-code2wav")
    servicer = build(args)
    run_async(run_server(servicer, pb_grpc.add_Code2WavServicer_to_server, "voxpipe.v1.Code2Wav", servicer.opts,
                         ready=lambda port: print(f"code2wav ready on port {port}", flush=True)))
