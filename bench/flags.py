"""`voxpipe bench`'s flags, light on purpose (no torch, grpc or client imports: `voxpipe bench --help`
answers at once); the harness (harness.py) runs them."""

from __future__ import annotations

import argparse

from voxpipe.layout import COLOCATE_HELP, COLOCATE_PRIORITY_HELP, MPS_PRIORITY_HELP, MPS_SM_HELP

from . import conversation, live
from .workload import WORKLOADS

MODES = ("gateway", "split", "inprocess")


def workload_names(spec: str) -> list[str]:
    """--workload: a comma list of bench/BENCHMARK.md workloads."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown workload {', '.join(map(repr, unknown)) or repr(spec)}; "
                                         f"choose from {', '.join(WORKLOADS)} (comma-separated)")
    return list(dict.fromkeys(names))


def temperature_value(spec: str) -> float:
    """--temperature: 0 (greedy) or a sampling temperature the services accept."""
    from voxpipe.services.runtime.sampling import MAX_TEMPERATURE

    try:
        t = float(spec)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {spec!r}") from None
    if not 0.0 <= t <= MAX_TEMPERATURE:
        raise argparse.ArgumentTypeError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {spec}")
    return t


def concurrency_levels(spec: str) -> list[int]:
    """--concurrency: a comma list of positive integers ('' : each workload's own levels)."""
    try:
        levels = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        levels = [0]
    if any(c < 1 for c in levels):
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {spec!r}")
    return levels


def mode_names(spec: str) -> list[str]:
    names = [m.strip() for m in spec.split(",") if m.strip()]
    if not names or any(m not in MODES for m in names):
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(MODES)}, got {spec!r}")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint folder or config.json (default: the released config, dummy weights)")
    p.add_argument("--load-format", default="dummy", choices=["auto", "dummy"],
                   help="dummy (default): full-size random weights built on the device; auto: --model's weights")
    p.add_argument("--device", default="cuda", help="cpu, cuda, cuda:N for every stage (default cuda)")
    p.add_argument("--modes", default="gateway,split,inprocess", type=mode_names,
                   help="comma list of gateway (OpenAI SDK or realtime WebSocket -> gateway -> services), split "
                        "(gRPC pipeline client -> services), inprocess (engines in one process)")
    p.add_argument("--concurrency", default="", type=concurrency_levels,
                   help="comma list of levels for every workload (default: each workload's own, bench/BENCHMARK.md: "
                        + "; ".join(f"{n} {','.join(map(str, w.levels))}" for n, w in WORKLOADS.items()) + ")")
    p.add_argument("--requests", type=int, default=0, help="per level (default max(20, 5 x c); --quick: max(8, 2 x c))")
    p.add_argument("--warmup", type=int, default=5, help="untimed requests before each level (at most c of them; --quick: at most 2)")
    p.add_argument("--quick", action="store_true", help="fewer requests, fits one 10-minute device call")
    p.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                   help="also time transformers' generate at c=1 in a separate process, once per workload")
    p.add_argument("--max-batch", type=int, default=64, help="every stage's --max-batch")
    p.add_argument("--extra", default="", help="extra flags for every stage service (split and in-process)")
    p.add_argument("--deterministic", action="store_true",
                   help="every stage in batch-invariant mode (--deterministic: added to --extra)")
    p.add_argument("--out", default="bench/out", help="folder for the run's JSON and reports")
    p.add_argument("--base-port", type=int, default=52051,
                   help="the started services' thinker port; talker +1, code2wav +2, their metrics +10.., the "
                        "gateway +20")
    p.add_argument("--mps", action="store_true",
                   help="split mode: run the three services under a CUDA MPS daemon started (and quit) by the bench")
    p.add_argument("--mps-sm-percent", default="", metavar="SHARES", help=MPS_SM_HELP + " (with --mps)")
    p.add_argument("--mps-priority", default="", metavar="PRIORITIES", help=MPS_PRIORITY_HELP + " (with --mps)")
    p.add_argument("--colocate", action="store_true",
                   help="modes split and gateway: " + COLOCATE_HELP + " (`voxpipe up --colocate`; not with --mps)")
    p.add_argument("--colocate-priority", default="", metavar="PRIORITIES", help=COLOCATE_PRIORITY_HELP)
    p.add_argument("--ablation", action="store_true",
                   help="split mode at the first concurrency level once per optimization layer, adding one at a time")
    p.add_argument("--devices", default="", metavar="LAYOUT",
                   help="replicas and devices per stage (voxpipe.layout), e.g. thinker=cuda:0,talker=cuda:1,code2wav=cuda:1 "
                        "(two GPUs) or thinker=cuda:0,talker=cuda:1+cuda:2,code2wav=cuda:1+cuda:2 (vLLM-Omni's three-GPU "
                        "row); DEV*N: N replicas sharing DEV; stages not named: one replica on --device. Replicas "
                        "run in modes split and gateway only")
    p.add_argument("--thinker-replicas", default="", type=concurrency_levels, metavar="COUNTS",
                   help="a comma list of thinker replica counts, e.g. 1,2: everything runs once per count, each on a "
                        "fresh start of the services with that many thinkers on --devices' thinker devices, cycled "
                        "(thinker=cuda:0 with 2: cuda:0*2; thinker=cuda:0+cuda:1 with 1: cuda:0); the report sets each "
                        "conversation workload's prefix hit rate beside the first count's and gives the load spread "
                        "over the replicas (modes split and gateway)")
    p.add_argument("--workload", default=["seedtts-like"], type=workload_names,
                   help="comma list of bench/BENCHMARK.md workloads, run one after the other against one start of the "
                        "services: seedtts-like (100-token prompt, 48 tokens, 125 frames), long-prompt (2,500-token "
                        "prompt, 900 tokens, proportional audio: 2,344 frames), voice-in (a 5.7 s speech clip + a "
                        "short text; 48 tokens, 125 frames), realtime (seedtts-like through the realtime WebSocket, "
                        "gateway mode only; TTFP from response.create), live (sessions playing 10 s replies at 1x "
                        "real time, a think time apart: the live-stream capacity, searched over the number of "
                        "sessions; gateway mode only, through --live-clients; --concurrency: the levels tried first), "
                        "conversation / voice-conversation (sessions re-sending their history as token ids, --turns "
                        "turns; split mode only), realtime-conversation (realtime voice sessions of --turns turns, a "
                        "clip appended at --realtime-pace and committed each turn, TTFP from the commit; gateway mode "
                        "only; --concurrency: sessions)")
    p.add_argument("--audio", help="the voice clip of voice-in (and --realtime-audio): a wav file "
                                   "(default: bench/data/voice-in.wav, 5.7 s of espeak-ng speech at 16 kHz)")
    p.add_argument("--realtime-audio", action="store_true",
                   help="realtime: the user turn is the voice clip (input_audio_buffer.append + commit) instead "
                        "of the text prompt; TTFP is then timed from the commit (the end of speech)")
    p.add_argument("--realtime-pace", type=live._non_negative, default=1.0,
                   help="--realtime-audio: append the clip at this many times real time, as it is spoken "
                        "(default 1; 0: all at once)")
    p.add_argument("--prompt-tokens", type=int, default=0, help="override the workloads' text prompt length")
    p.add_argument("--text-tokens", type=int, default=0, help="override the workloads' forced text tokens")
    p.add_argument("--frames", type=int, default=0, help="override the workloads' forced codec frames")
    p.add_argument("--trace", action="store_true",
                   help="gateway mode: the services export their OpenTelemetry spans to a receiver in the bench, "
                        "and each level's report gets the median path of a request through them (bench/trace_path.py; "
                        "tracing costs some CPU, so the level's own numbers read slightly high)")
    p.add_argument("--temperature", type=temperature_value, default=0.0,
                   help="thinker and talker sample at this temperature (in (0, 100]), each request seeded by its "
                        "index, as /v1/audio/speech and chat without temperature=0 do; default 0: greedy, as the "
                        "transformers reference")
    p.add_argument("--thinker-arg", action="append", default=[], metavar="FLAG",
                   help="one more flag for the thinker alone, as written (repeatable; e.g. --thinker-arg=--no-prefix-cache, "
                        "--thinker-arg=--audio-cache-mb=0); --extra goes to every stage")
    p.add_argument("--talker-arg", action="append", default=[], metavar="FLAG",
                   help="one more flag for the talker alone, as written (repeatable; e.g. --talker-arg=--kv-cache-tokens=65536 "
                        "to leave the talker's share of a shared GPU to its graphs)")
    p.add_argument("--code2wav-arg", action="append", default=[], metavar="FLAG",
                   help="one more flag for code2wav alone, as written (repeatable)")
    p.add_argument("--gateway-arg", action="append", default=[], metavar="FLAG",
                   help="one more flag for the gateway the bench starts, as written (repeatable; e.g. "
                        "--gateway-arg=--max-sessions=512)")
    live.add_arguments(p)
    conversation.add_arguments(p)
