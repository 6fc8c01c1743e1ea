"""A stage's KV pool size and context from its flags (--kv-cache-tokens, --kv-block-size,
--prefix-cache, --gpu-memory-fraction, --max-len): the thinker and the talker size theirs the same
way, each with its own activation reserve and bound."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from voxpipe.errors import ConfigError

from .config import DecoderConfig
from .flags import KV_BLOCK_SIZE
from .paged_kv import PagedKVCache

log = logging.getLogger(__name__)

DEFAULT_GPU_MEMORY_FRACTION = 0.9     # alone on its GPU; `voxpipe up` and the manifests set shares


@dataclass(frozen=True)
class KVPlan:
    """A stage's KV pool: `blocks` blocks of `block_size` positions; `prefix_cache`: publish full
    blocks and find cached prefixes."""

    blocks: int
    block_size: int = KV_BLOCK_SIZE
    prefix_cache: bool = True

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size


def kv_plan(args, stage: str, text: DecoderConfig, device: torch.device, dtype: torch.dtype, *,
            activation_reserve: int, max_tokens: int | None = None) -> tuple[KVPlan, int]:
    """The KV pool (--kv-cache-tokens, else on CUDA what --gpu-memory-fraction of the GPU leaves beside
    the memory reserved so far (by this stage alone when colocated: `args.colocation`) and
    `activation_reserve` bytes, at most `max_tokens` positions, else on
    the CPU twice the model's context) and the context (--max-len, default the model's
    max_position_embeddings, at most the pool). ConfigError with the numbers when they do not fit."""
    bs = args.kv_block_size
    if bs < 1 or bs & (bs - 1):
        raise ConfigError(f"--kv-block-size must be a power of two, got {bs}")
    model_len = text.max_position_embeddings or 32768
    per_block = PagedKVCache.bytes_per_block(text.num_layers, bs, text.num_kv_heads, text.head_dim, dtype)
    if args.kv_cache_tokens:
        blocks = -(-args.kv_cache_tokens // bs)
        how = "--kv-cache-tokens"
    elif device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        fraction = args.gpu_memory_fraction or DEFAULT_GPU_MEMORY_FRACTION
        # colocated with other stages in one process (services/runtime/colocate.py): what the stages
        # built before this one reserved is theirs, out of their own shares, not counted again here
        colocation = getattr(args, "colocation", None)
        baseline = colocation.memory_baseline if colocation is not None else 0
        in_use = torch.cuda.memory_reserved(index) - baseline
        left = fraction * total - in_use - activation_reserve
        blocks = max(int(left // per_block), 0)
        how = (f"{fraction:.2f} of {total / 2**30:.1f} GiB, less {in_use / 2**30:.1f} GiB in use"
               f"{' by this stage' if colocation is not None else ''} and "
               f"{activation_reserve / 2**30:.1f} GiB for activations")
        if max_tokens is not None and blocks * bs > max_tokens:
            blocks = -(-max_tokens // bs)
            how += f", at most {max_tokens} tokens"
    else:
        blocks = -(-2 * min(args.max_len or model_len, model_len) // bs)
        how = "twice the context, on the CPU"
    max_len = args.max_len or min(model_len, blocks * bs)
    if max_len > model_len:
        log.warning("%s: --max-len %d is past the model's max_position_embeddings %d", stage, max_len, model_len)
    if blocks * bs < max_len:
        raise ConfigError(f"the {stage}'s KV pool holds {blocks * bs} tokens ({how}), less than --max-len "
                          f"{max_len}: raise --gpu-memory-fraction or --kv-cache-tokens, or lower --max-len")
    plan = KVPlan(blocks=blocks, block_size=bs, prefix_cache=args.prefix_cache)
    log.info("%s KV pool: %d blocks of %d tokens = %d tokens, %.2f GiB (%s); context %d tokens; prefix cache %s",
             stage, blocks, bs, plan.tokens, blocks * per_block / 2**30, how, max_len,
             "on" if plan.prefix_cache else "off")
    return plan, max_len
