"""The talker start's transfer for a voice-in turn: the clip's audio rows [M, H] from the thinker's
device to the talker's, over a real gRPC stream between two processes on this host (loopback TCP).

    python -m voxpipe.bench.row_transfer --device cuda            # full size (the shipped released config)
    python -m voxpipe.bench.row_transfer --device cpu --quick     # the CPU, fewer iterations

M is the audio encoder's token count for a `--seconds` clip (5.7 s: the voice-in clip), H the talker's
thinker_hidden_size (2048), the rows in the thinker's dtype (bfloat16 on CUDA, float32 on the CPU, as
the stages' --dtype auto). One transfer: the rows' device-to-host copy, the AudioRows message built and
written (the thinker's relay), read and checked by the talker's process, copied to its device
(synchronized), then a Held answer back; the time is the writer's, from the rows on its device to that
answer. Two paths, one stream each, alternating:
- `head`: HEAD db5fe2b's (the message built around a finished Tensor, copied once per nesting level; the
  talker's decode reading the bytes field twice and copying it with numpy; the held-prefix copy of
  `add_audio_rows` even when nothing is held);
- `now`: this tree's (`thinker.relay.audio_rows_request`: the bytes copied once into the message;
  `talker.server._rows`: a view of the received bytes, checked, whose device copy is its only copy).
`floor` is the same round trip with zero rows (the stream's own latency). `host_costs`: each path's
writer and reader parts alone, in this process (no transport). The report is one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

import grpc
import numpy as np
import torch

from voxpipe.services.runtime.config import OmniConfig, released_config_path
from voxpipe.services.runtime.downstream import channel_options
from voxpipe.services.runtime.listen import GRPC_SERVER_OPTIONS
from voxpipe.services.runtime.sampling import MAX_ROW_VALUE, check_features
from voxpipe.services.runtime.server import ServerOptions
from voxpipe.services.runtime.tensors import TensorError, nbytes, to_proto
from voxpipe.services.runtime.weights import resolve_device, resolve_dtype
from voxpipe.services.talker.engine import all_audio_rows
from voxpipe.services.talker.server import _rows as talker_rows
from voxpipe.services.thinker.log_mel import frames_of
from voxpipe.services.thinker.model import audio_output_length
from voxpipe.services.thinker.relay import audio_rows_request
from voxpipe.v1 import stages_pb2 as pb
from voxpipe.v1 import stages_pb2_grpc as pb_grpc

SAMPLE_RATE = 16000          # the audio encoder's input rate
PATHS = ("head", "now", "floor")
MAX_MESSAGE = ServerOptions().max_message_bytes


def head_request(rows: torch.Tensor) -> pb.TalkerRequest:
    """HEAD db5fe2b's AudioRows message: nested constructors, each copying the rows' bytes again."""
    return pb.TalkerRequest(audio_rows=pb.AudioRows(first=0, rows=to_proto(rows)))


def head_rows(t: pb.Tensor, hidden: int, count: int) -> torch.Tensor:
    """HEAD db5fe2b's talker decode of AudioRows.rows (from_proto + _rows + add_audio_rows)."""
    if len(t.data) != nbytes(t) or list(t.shape) != [count, hidden]:
        raise TensorError("audio_rows.rows: malformed")
    dtype = {pb.FLOAT32: torch.float32, pb.BFLOAT16: torch.bfloat16, pb.FLOAT16: torch.float16}[t.dtype]
    x = torch.from_numpy(np.frombuffer(t.data, dtype=np.uint8).copy()).view(dtype).reshape(count, hidden)
    check_features(x, "audio_rows.rows", MAX_ROW_VALUE)
    full = x.new_zeros(x.shape[0], x.shape[1])
    full[0:] = x
    return full


class RowSink(pb_grpc.TalkerServicer):
    """The talker's side: a stream's start names its path (request_id) and the rows' width; each
    AudioRows is decoded that way, copied to `device` and answered with Held(audio_rows=M)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    async def Generate(self, request_iterator, context):
        it = request_iterator.__aiter__()
        start = (await it.__anext__()).start
        path, hidden = start.request_id, start.max_frames
        async for msg in it:
            t = msg.audio_rows.rows
            count = t.shape[0] if len(t.shape) else 0
            if path == "head":
                x = head_rows(t, hidden, count)
            else:
                x = all_audio_rows(msg.audio_rows.first, talker_rows(t, hidden, "audio_rows.rows", count))
            x = x.to(self.device)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            yield pb.TalkerResponse(held=pb.Held(audio_rows=x.shape[0]))


async def serve(device: torch.device) -> None:
    server = grpc.aio.server(options=[*channel_options(MAX_MESSAGE), *GRPC_SERVER_OPTIONS])
    pb_grpc.add_TalkerServicer_to_server(RowSink(device), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


async def transfers(port: int, device: torch.device, dtype: torch.dtype, rows: int, hidden: int,
                    iters: int, warmup: int) -> dict[str, list[float]]:
    """Per path, `iters` transfer times (ms), the paths interleaved so that each sees the same host."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden, generator=gen).to(dtype).to(device)
    empty = x[:0]
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options(MAX_MESSAGE)) as channel:
        stub = pb_grpc.TalkerStub(channel)
        streams = {}
        for p in PATHS:
            streams[p] = stub.Generate()
            await streams[p].write(pb.TalkerRequest(start=pb.TalkerStart(request_id=p, max_frames=hidden)))
        for i in range(warmup + iters):
            for p in PATHS:
                t0 = time.perf_counter()
                src = empty if p == "floor" else x
                host = src.cpu()            # the thinker's device-to-host copy of the prefill's rows
                msg = head_request(host) if p == "head" else audio_rows_request(host, 0)
                await streams[p].write(msg)
                held = await streams[p].read()
                dt = (time.perf_counter() - t0) * 1e3
                if held.held.audio_rows != src.shape[0]:
                    raise RuntimeError(f"{p}: the talker side decoded {held.held.audio_rows} rows of {src.shape[0]}")
                if i >= warmup:
                    times[p].append(dt)
        for s in streams.values():
            await s.done_writing()
    return times


def exact(rows: int, hidden: int, dtype: torch.dtype) -> bool:
    """Both paths give the talker the same bits (serialized and parsed as on the wire)."""
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    bits = x.view(torch.int16 if x.element_size() == 2 else torch.int32)
    got = []
    for msg in (head_request(x), audio_rows_request(x, 0)):
        wire = pb.TalkerRequest.FromString(msg.SerializeToString()).audio_rows.rows
        got.append(head_rows(wire, hidden, rows) if not got else talker_rows(wire, hidden, "audio_rows.rows", rows))
    return all(torch.equal(g.view(bits.dtype), bits) for g in got)


def host_costs(rows: int, hidden: int, dtype: torch.dtype, device: torch.device, iters: int) -> dict[str, dict]:
    """Per path, in one process (no transport): the writer's part (device-to-host copy, the message
    built and serialized) and the reader's (parsed, decoded, checked, copied to the device), median us."""
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(2)).to(dtype).to(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    out = {}
    for path in ("head", "now"):
        write_us, read_us = [], []
        for _ in range(iters):
            t0 = time.perf_counter()
            host = x.cpu()
            wire = (head_request(host) if path == "head" else audio_rows_request(host, 0)).SerializeToString()
            t1 = time.perf_counter()
            t = pb.TalkerRequest.FromString(wire).audio_rows.rows
            got = head_rows(t, hidden, rows) if path == "head" else all_audio_rows(0, talker_rows(t, hidden, "r", rows))
            got.to(device)
            sync()
            t2 = time.perf_counter()
            write_us.append((t1 - t0) * 1e6)
            read_us.append((t2 - t1) * 1e6)
        out[path] = {"write_us": round(statistics.median(write_us), 1), "read_us": round(statistics.median(read_us), 1)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (both processes)")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16 or float16 (auto: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--config", default=None, help="a checkpoint folder or config .json (default: the shipped released config)")
    p.add_argument("--seconds", type=float, default=5.7, help="the clip's length (5.7: the voice-in clip)")
    p.add_argument("--rows", type=int, default=0, help="rows to send instead of the clip's (0: from --seconds)")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20, help="transfers a path makes before the timed ones")
    p.add_argument("--quick", action="store_true", help="30 iterations after 5 warm-ups")
    p.add_argument("--out", default=None, help="also write the JSON report here")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)    # the talker side's process
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    if args.serve:
        asyncio.run(serve(device))
        return 0
    dtype = resolve_dtype(args.dtype, device)
    cfg = OmniConfig.load(args.config or released_config_path())
    hidden = cfg.talker.thinker_hidden_size
    rows = args.rows or audio_output_length(frames_of(round(args.seconds * SAMPLE_RATE)), cfg.thinker.audio.n_window)
    iters, warmup = (30, 5) if args.quick else (args.iters, args.warmup)
    sink = subprocess.Popen([sys.executable, "-m", "voxpipe.bench.row_transfer", "--serve", "--device", str(device)],
                            stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        port = int(sink.stdout.readline())
        times = asyncio.run(transfers(port, device, dtype, rows, hidden, iters, warmup))
    finally:
        sink.terminate()
        sink.wait(timeout=30)
    size = rows * hidden * torch.tensor([], dtype=dtype).element_size()
    report = {"device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
              "dtype": str(dtype).removeprefix("torch."), "seconds": args.seconds, "rows": rows, "hidden": hidden,
              "bytes": size, "iters": iters, "bits_equal": exact(rows, hidden, dtype),
              "host_costs": host_costs(rows, hidden, dtype, device, iters)}
    for path, ts in times.items():
        report[path] = {"p50_ms": round(statistics.median(ts), 3), "p90_ms": round(percentile(ts, 90), 3),
                        "min_ms": round(min(ts), 3)}
    print(json.dumps(report), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["bits_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
