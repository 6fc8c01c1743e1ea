"""The flags every stage service takes (`add_stage_arguments`) and each stage's own: light on
purpose (no torch, no grpc), so that `voxpipe STAGE --help` answers at once."""

from __future__ import annotations

import argparse
import os

from .listen import HOST_HELP, default_host, port_number
from .tls import add_client_tls_arguments, add_server_tls_arguments

PREFILL_CHUNK = 4096   # long prompts' tokens a thinker step prefills, packed (--prefill-chunk; bench/RESULTS.md)
DEFAULT_LISTEN_TIMEOUT_S = 30.0   # a code2wav request routed to it waits this long for its Listen stream
KV_BLOCK_SIZE = 16                # positions per KV block (--kv-block-size)
# the talker's default pool on CUDA: at most this many positions per stream (--max-batch), as its
# slots held before the pool was paged; the rest of its share is left to activations and graphs
TALKER_TOKENS_PER_STREAM = 8192
DEFAULT_AUDIO_CACHE_MB = 256.0    # --audio-cache-mb: ~850 clips of 5.7 s at full size (74 rows x 2048 x bf16)


def add_stage_arguments(parser, default_port: int, default_max_len: int = 4096) -> None:
    parser.add_argument("--model", help="checkpoint folder (config.json + safetensors) or Hugging Face repo id "
                                        "(Org/Name[@REV], from the hub cache; HF_HUB_OFFLINE=1: the cache only); "
                                        "default: the tiny checkpoint")
    parser.add_argument("--host", default=default_host(), help=HOST_HELP + " -- the gRPC, --health-port and "
                                                                    "--metrics-port listeners")
    parser.add_argument("--port", type=port_number, default=default_port, help=f"the gRPC port (default {default_port})")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: cuda if available)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights and activations (auto: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                        help="dummy: full-size random weights built on the device from config.json")
    parser.add_argument("--max-batch", type=at_least(1), default=16, help="concurrent streams in the engine")
    parser.add_argument("--max-len", type=at_least(1), default=default_max_len,
                        help="the context: positions a stream may reach, prompt and reply"
                             + (f" (default {default_max_len})" if default_max_len else
                                " (default: the model's max_position_embeddings, at most what the KV pool holds)"))
    parser.add_argument("--max-queue", type=at_least(0), default=256, help="waiting streams before RESOURCE_EXHAUSTED")
    parser.add_argument("--max-message-mb", type=above(0.0), default=64.0, help="largest gRPC message")
    parser.add_argument("--grace", type=at_least(0.0), default=30.0, help="seconds to drain streams on SIGTERM")
    parser.add_argument("--metrics-port", type=port_number, default=0, help="serve Prometheus /metrics here, on --host "
                                                                      "(0: off)")
    parser.add_argument("--max-connection-age", type=float, default=300.0,
                        help="seconds after which a client connection is asked to reconnect (rebalancing); a "
                             "connection carrying a stream is never closed for its age (0: no limit)")
    parser.add_argument("--max-pending-upload-mb", type=above(0.0), default=1024.0,
                        help="bytes of incomplete chunked start messages held at once, over all streams "
                             "(RESOURCE_EXHAUSTED above)")
    parser.add_argument("--reflection", action=argparse.BooleanOptionalAction, default=False,
                        help="serve gRPC server reflection (off unless asked for; `voxpipe up` turns it on)")
    parser.add_argument("--health-port", type=port_number, default=0,
                        help="also serve grpc.health.v1 alone, plaintext, on this port (for probes that cannot "
                             "speak TLS, like Kubernetes' grpc probes; 0: off)")
    add_server_tls_arguments(parser)
    add_client_tls_arguments(parser)
    parser.add_argument("--deterministic", action="store_true",
                        help="batch-invariant mode: a request's output bits do not depend on the other requests in "
                             "its batch (their number, lengths, order) -- fixed-shape matmuls, attention and MoE sums "
                             "in a fixed order; costs some speed (bench/determinism_check.py)")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="capture decode steps as CUDA graphs (CUDA devices only)")
    parser.add_argument("--eager-fallback", action="store_true",
                        help="run a step eagerly when its CUDA graphs cannot be captured (default: refuse to start)")
    parser.add_argument("--gpu-memory-fraction", type=fraction, default=None,
                        help="cap this process's share of the GPU memory (CUDA caching allocator)")


def at_least(low: int | float):
    """argparse type: a number (int if `low` is one) no smaller than `low`."""
    kind = type(low)

    def parse(value: str):
        try:
            number = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a{'n integer' if kind is int else ' number'}") from None
        if number < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}")
        return number
    return parse


def above(low: float):
    """argparse type: a number greater than `low`."""
    def parse(value: str) -> float:
        number = at_least(low)(value)
        if number == low:
            raise argparse.ArgumentTypeError(f"{value} must be above {low}")
        return number
    return parse


def fraction(value: str) -> float:
    """argparse type: a share in (0, 1]."""
    number = above(0.0)(value)
    if number > 1.0:
        raise argparse.ArgumentTypeError(f"{value} is above 1 (a share of the GPU's memory)")
    return number


def add_kv_arguments(parser: argparse.ArgumentParser, gpu_sizing: str) -> None:
    """The paged KV pool's flags (runtime/kv_plan.py), the same for the thinker and the talker."""
    parser.add_argument("--kv-cache-tokens", type=at_least(0), default=0,
                        help=f"positions the KV pool holds, shared by all sequences (0: sized from {gpu_sizing}; "
                             "on the CPU twice the context)")
    parser.add_argument("--kv-block-size", type=at_least(1), default=KV_BLOCK_SIZE,
                        help="positions per KV block (a power of two; the prefix cache's unit)")
    parser.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                        help="keep computed KV blocks by their prefix hash and skip the prefill of a cached prefix")


def add_thinker_arguments(parser: argparse.ArgumentParser) -> None:
    add_stage_arguments(parser, default_port=50051, default_max_len=0)
    add_kv_arguments(parser, "the GPU memory --gpu-memory-fraction leaves beside the weights")
    parser.add_argument("--audio-cache-mb", type=float, default=DEFAULT_AUDIO_CACHE_MB,
                        help="audio encoder outputs kept on the device by clip content (the features' SHA-256), "
                             "least recently used dropped first: a clip a conversation sends again is not encoded "
                             f"again (0: off)")
    parser.add_argument("--talker", default=os.environ.get("VOXPIPE_TALKER", ""),
                        help="the talker replicas spoken replies go to: host:port and/or dns:///name:port, "
                             "comma-separated (env VOXPIPE_TALKER); unset: text only")
    parser.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK,
                        help="long prompts (over 512 tokens, or over this) are prefilled in chunks: an engine step "
                             "packs at most this many of their tokens into one forward, so running requests keep "
                             "decoding between steps")
    parser.add_argument("--draft-forced", action=argparse.BooleanOptionalAction, default=True,
                        help="where a constrained reply's grammar forces a text that more than one spelling can "
                             "write (a call's '<tool_call>\\n{\"name\": \"'), draft the tokenizer's own spelling and "
                             "verify it in the next forward, accepting the tokens the model itself chooses: the "
                             "same reply in fewer forwards (--no-draft-forced: one forward a token)")
    parser.add_argument("--draft-prefill", action=argparse.BooleanOptionalAction, default=True,
                        help="with --draft-forced: the text a constrained reply's grammar forces before any choice "
                             "(a call's '<tool_call>\\n{\"name\": \"') is drafted in the prompt's prefill, whose last "
                             "positions verify it, so the call's name comes from the prefill's logits "
                             "(--no-draft-prefill: drafted after the prefill's first token, as later forced text)")
    parser.add_argument("--talker-prompt-rows", action="store_true",
                        help="send a text prompt's user turns and the reply's text rows to the talker as embedding "
                             "rows (a 2,500-token conversation: 10 MB), as before talkers looked them up from their "
                             "token ids; for talkers of an older voxpipe during a rolling upgrade")


def add_talker_arguments(parser: argparse.ArgumentParser) -> None:
    add_stage_arguments(parser, default_port=50052, default_max_len=0)
    add_kv_arguments(parser, "the GPU memory --gpu-memory-fraction leaves beside the weights, at most "
                             f"--max-batch x {TALKER_TOKENS_PER_STREAM} positions")
    parser.add_argument("--code2wav", default=os.environ.get("VOXPIPE_CODE2WAV", ""),
                        help="the code2wav replicas routed frames go to: host:port and/or dns:///name:port, "
                             "comma-separated (env VOXPIPE_CODE2WAV); unset: frames only back to the caller")


def add_code2wav_arguments(parser: argparse.ArgumentParser) -> None:
    add_stage_arguments(parser, default_port=50053)
    parser.add_argument("--first-chunk-frames", type=int, default=1, help="frames gathered before the first audio")
    parser.add_argument("--chunk-frames", type=int, default=1, help="frames gathered before each later chunk")
    parser.add_argument("--listen-timeout", type=float, default=DEFAULT_LISTEN_TIMEOUT_S,
                        help="seconds a routed request waits for its Listen stream before it fails")


STAGE_ARGUMENTS = {"thinker": add_thinker_arguments, "talker": add_talker_arguments,
                   "code2wav": add_code2wav_arguments}
