"""A long prompt's chunk attention in two parts (runtime/kv_cache.py `_cudnn_chunk`): the chunk over
its own keys (causal) and over the cached prefix (no mask), merged by their log-sum-exps, equals one
causal attention over all of them -- the merge against float64, the two-part path through its CPU
reference, the cuDNN path itself on CUDA (planned shapes only).

Which chunks take it: the scheduler cuts a cold prompt into `prefill_chunk`-token chunks at
multiples of it (the default flags' 32,805-token prompt: 8 x 4,096 + 37), a chunk after a cached
prefix or a share of a packed step ends on the next multiple (unless it ends the prefill), and the thinker plans those shapes on
its engine thread (cuDNN keeps its plans per thread). The served path is checked end to end on the
CPU: a real engine (tiny checkpoint, its graph plans emulated) with the fused-attention predicate
forced on, its engine thread planning and serving, each chunk's path recorded (job.chunks)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

from voxpipe.cli import build_parser
from voxpipe.services.runtime import cuda_graphs, kv_cache
from voxpipe.services.runtime.engine import Outbox, StageEngine
from voxpipe.services.runtime.flags import PREFILL_CHUNK
from voxpipe.services.runtime.paged_kv import PagedKVCache
from voxpipe.services.thinker.job import ThinkerJob
from voxpipe.services.thinker.scheduler import ThinkerScheduler


def _attend(q, k, v, mask):
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def test_merged_parts_equal_one_causal_attention():
    g = torch.Generator().manual_seed(3)
    s, p, d = 7, 12, 16
    q = torch.randn(2, 3, s, d, generator=g, dtype=torch.float64)
    k = torch.randn(2, 3, p + s, d, generator=g, dtype=torch.float64)
    v = torch.randn(2, 3, p + s, d, generator=g, dtype=torch.float64)
    causal = torch.arange(p + s)[None, :] <= (p + torch.arange(s))[:, None]
    want, _ = _attend(q, k, v, causal)
    own, own_lse = _attend(q, k[:, :, p:], v[:, :, p:], torch.ones(s, s, dtype=torch.bool).tril())
    pre, pre_lse = _attend(q, k[:, :, :p], v[:, :, :p], torch.ones(s, p, dtype=torch.bool))
    got = kv_cache.merge_parts(own, own_lse, pre, pre_lse)
    assert got.dtype == torch.float64 and torch.allclose(got, want, atol=1e-6, rtol=1e-6)   # float32 inside


@pytest.mark.parametrize("cached", [0, 24])
def test_the_two_part_path_equals_one_causal_attention(cached):
    """`_cudnn_chunk` (its cuDNN calls through their CPU reference) with grouped key heads and q as the
    layers pass it (a transposed view of the fused projection) against `_causal_sdpa`."""
    g = torch.Generator().manual_seed(5)
    hq, hkv, s, d = 4, 2, 9, 16
    qkv = torch.randn(1, s, (hq + 2 * hkv) * d, generator=g)
    q = qkv[..., :hq * d].view(1, s, hq, d).transpose(1, 2)            # [1, Hq, S, D], not contiguous
    k = torch.randn(1, hkv, cached + s, d, generator=g)
    v = torch.randn(1, hkv, cached + s, d, generator=g)
    got = kv_cache._cudnn_chunk(q, k, v, d ** -0.5)
    assert torch.allclose(got, kv_cache._causal_sdpa(q, k, v, d ** -0.5), atol=1e-5)


def test_nothing_is_planned_off_cuda():
    cache = PagedKVCache(2, 64, 16, 2, 16, torch.bfloat16, "cpu")
    assert cache.plan_chunks(640, 4096, 4) == 0 and not kv_cache.planned_here()
    q = torch.zeros(1, 4, 640, 16, dtype=torch.bfloat16)
    k = torch.zeros(1, 2, 1280, 16, dtype=torch.bfloat16)
    assert kv_cache.chunk_path(q, k, k) == "sdpa"


# ------------------------------------------------------------------------------------- the scheduler's cuts


@dataclass
class _Reader:
    saturated: bool = False


@dataclass
class _Prompt:
    """What the scheduler reads of a request (scheduler.Request)."""
    prompt: list[int]
    prefilled: int = 0
    prefill_target: int = 0
    generated: list[int] = field(default_factory=list)
    pending: bool = False
    outbox: _Reader = field(default_factory=_Reader)

    def __post_init__(self) -> None:
        self.prefill_target = len(self.prompt)


def _cuts(scheduler: ThinkerScheduler, waiting: list[_Prompt]) -> dict[int, list[tuple[int, int]]]:
    """Each prompt's chunks (start, length), stepping the scheduler until every prefill ended."""
    running: list[_Prompt] = []
    cuts: dict[int, list[tuple[int, int]]] = {id(r): [] for r in waiting}
    while waiting or any(r.prefilled < r.prefill_target for r in running):
        plan = scheduler.schedule(waiting, running, free_slots=8)
        for r in plan.admitted:
            waiting.remove(r)
            running.append(r)
        assert plan.chunks and not plan.prefill
        for c in plan.chunks:
            assert c.start == c.request.prefilled
            cuts[id(c.request)].append((c.start, c.length))
            c.request.prefilled += c.length
    return cuts


def _default_scheduler() -> ThinkerScheduler:
    """As ThinkerEngine makes it with default flags."""
    return ThinkerScheduler(prefill_batch=8, prefill_tokens=4096, prefill_chunk=PREFILL_CHUNK,
                            long_prompt=min(PREFILL_CHUNK, 512))


def test_a_cold_32k_prompt_is_cut_on_the_planned_boundaries():
    """Default flags: the bench's 32,805-token prompt takes 8 chunks of 4,096 after 0, 1, ... 7 chunks
    (the planned shapes), then its last 37 tokens (an extend graph's rows)."""
    cold = _Prompt(list(range(32805)))
    assert _cuts(_default_scheduler(), [cold])[id(cold)] == [(i * 4096, 4096) for i in range(8)] + [(32768, 37)]


def test_chunks_that_begin_off_a_boundary_return_to_it():
    """A cached prefix (48 tokens) and a share of a packed step (what another prompt left of the
    step's 4,096 tokens) shift a prompt's first chunk; its next ends on a multiple of 4,096."""
    hit = _Prompt(list(range(20000)))
    hit.prefilled = 48
    assert _cuts(_default_scheduler(), [hit])[id(hit)] == [(48, 4048)] + [(i * 4096, 4096) for i in range(1, 4)] + \
        [(16384, 3616)]
    first, second = _Prompt(list(range(5000))), _Prompt(list(range(9000)))
    cuts = _cuts(_default_scheduler(), [first, second])
    assert cuts[id(first)] == [(0, 4096), (4096, 904)]
    assert cuts[id(second)] == [(0, 3192), (3192, 904), (4096, 4096), (8192, 808)]
    # a prefill that ends within the step is one chunk across a boundary (a conversation's next turn)
    turn = _Prompt(list(range(4348)))
    turn.prefilled = 4090
    assert _cuts(_default_scheduler(), [turn])[id(turn)] == [(4090, 258)]


# --------------------------------------------------------------------------------- the served chunks' path


class _Preparing(StageEngine):
    """A stage engine whose `prepare` notes its thread, or fails."""

    def __init__(self, fail: bool) -> None:
        super().__init__(max_active=1)
        self.fail, self.prepared_on = fail, None

    def prepare(self) -> None:
        self.prepared_on = threading.current_thread()
        if self.fail:
            raise RuntimeError("no plan here")

    def has_work(self) -> bool:
        return False


def test_prepare_runs_on_the_engine_thread_before_start_returns_and_its_failure_fails_start():
    ok = _Preparing(fail=False)
    ok.start()
    try:
        assert ok.prepared_on is ok._thread and ok.prepared_on is not threading.current_thread()
        assert ok._thread.is_alive()
    finally:
        ok.stop()
    bad = _Preparing(fail=True)
    with pytest.raises(RuntimeError, match="no plan here"):
        bad.start()
    assert not bad._thread.is_alive()


CHUNK = 640            # > PACKED_KERNEL_MAX: packed segments this long attend through _causal_flash, as 4,096 do


def _engine(model_dir):
    from voxpipe.services.thinker import server as thinker_server

    ns = build_parser().parse_args(["thinker", "--model", str(model_dir), "--device", "cpu", "--port", "0",
                                    "--max-batch", "4", "--max-len", "4096", "--prefill-chunk", str(CHUNK)])
    return thinker_server.build(ns)[0].engine


LOOP = asyncio.new_event_loop()     # the outboxes queue their callbacks on it; the tests read the jobs


def _job(rid: str, prompt: list[int]) -> ThinkerJob:
    return ThinkerJob(request_id=rid, outbox=Outbox(LOOP, limit=10_000), prompt=prompt, max_tokens=3, min_tokens=3)


def _served(engine, job: ThinkerJob) -> ThinkerJob:
    """Submit to the running engine thread and wait for the job to end."""
    engine.submit(job)
    deadline = time.monotonic() + 120
    while not job.done:
        assert time.monotonic() < deadline, "the engine did not finish the job"
        time.sleep(0.01)
    return job


def _prompt(cfg, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    t = cfg.tokens
    body = torch.randint(0, min(t.im_start, cfg.text.vocab_size) - 1, (n - 6,), generator=g).tolist()
    return [t.im_start, t.user, 10] + body + [t.im_start, t.assistant, 10]


def test_served_chunks_take_the_planned_two_part_path(tiny_model_dir, monkeypatch):
    """The fused-attention predicate forced on (the CPU runs the two-part path's reference): the engine
    thread plans at start, a cold prompt's full chunks take the two-part path and its last 37 tokens
    an extend graph; a prompt with a cached prefix takes flash for its first (shifted) chunk only; the
    greedy tokens equal the same engine's without the fused paths. The plan belongs to the engine
    thread alone (cuDNN's plans are per thread): stepped on another thread, the same chunks go to flash."""
    monkeypatch.setattr(cuda_graphs, "EMULATE", True)                # the graph plans, as on CUDA
    plain = _engine(tiny_model_dir)                                  # the fused paths off: sdpa
    monkeypatch.setattr(kv_cache, "fast_attention", lambda device, dtype: True)
    engine = _engine(tiny_model_dir)
    assert engine.planned_chunks == 0                                # nothing planned at build (main thread)
    cold_prompt = _prompt(engine.cfg, 6 * CHUNK + 37, seed=1)
    hit_prompt = cold_prompt[:1300] + _prompt(engine.cfg, 2000, seed=2)[3:]
    engine.start()
    try:
        assert engine.planned_chunks == 4096 // CHUNK == 6 and not kv_cache.planned_here()
        cold = _served(engine, _job("cold", cold_prompt))
        hit = _served(engine, _job("hit", hit_prompt))
    finally:
        engine.stop()
    assert [(c.start, c.length, c.path) for c in cold.chunks] == \
        [(i * CHUNK, CHUNK, "cudnn") for i in range(6)] + [(6 * CHUNK, 37, "extend graph")]
    assert hit.cached_tokens == 1296
    assert [(c.start, c.length, c.path) for c in hit.chunks] == \
        [(1296, 624, "flash"), (1920, CHUNK, "cudnn"), (2560, CHUNK, "cudnn"), (3200, 97, "extend graph")]
    monkeypatch.setattr(kv_cache, "fast_attention", lambda device, dtype: False)
    for done in (cold, hit):
        again = _job("plain-" + done.request_id, done.prompt)
        plain.submit(again)
        while plain.has_work():
            plain.step()
        assert again.generated == done.generated and {c.path for c in again.chunks} <= {"sdpa", "extend graph"}
    monkeypatch.setattr(kv_cache, "fast_attention", lambda device, dtype: True)
    other = _engine(tiny_model_dir)                                  # not started: steps on this thread
    other.submit(elsewhere := _job("elsewhere", cold_prompt))
    while other.has_work():
        other.step()
    assert [c.path for c in elsewhere.chunks] == ["flash"] * 6 + ["extend graph"]
    assert elsewhere.generated == cold.generated


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cudnn_chunks_equal_flash_on_cuda():
    """Planned shapes (keys as the packed view gathers them) take the two-part cuDNN path on the thread
    that planned them; its output is within bf16 rounding of flash attention with the lower-right
    causal mask; an unplanned shape, and a planned one on another thread, stay on flash."""
    dev = torch.device("cuda")
    hq, hkv, d, c = 8, 2, 128, 1024
    cache = PagedKVCache(1, 4 * c // 16 + 8, 16, hkv, d, torch.bfloat16, dev)
    assert cache.plan_chunks(c, 4 * c, hq) == 4
    g = torch.Generator(device=dev).manual_seed(0)
    null = torch.full((1, 4 * c // 16), cache.null, dtype=torch.long, device=dev)
    for p in (0, c, 3 * c):
        q = torch.randn(1, hq, c, d, generator=g, device=dev, dtype=torch.bfloat16)
        k, v = cache.gather(0, null, p + c)
        k.normal_(generator=g), v.normal_(generator=g)
        assert kv_cache.chunk_path(q, k, v) == "cudnn"
        got = kv_cache._causal_flash(q, k, v, d ** -0.5)
        mask = torch.arange(p + c, device=dev)[None, :] <= (p + torch.arange(c, device=dev))[:, None]
        want = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(hq // hkv, 1),
                                              v.float().repeat_interleave(hq // hkv, 1), attn_mask=mask,
                                              scale=d ** -0.5)
        assert (got.float() - want).abs().max().item() < 2e-2
        seen = []
        t = threading.Thread(target=lambda: seen.append(kv_cache.chunk_path(q, k, v)))
        t.start()
        t.join()
        assert seen == ["flash"]
    q = torch.randn(1, hq, c - 1, d, device=dev, dtype=torch.bfloat16)
    k, v = cache.gather(0, null, 2 * c - 1)
    assert kv_cache.chunk_path(q, k, v) == "flash"
    kv_cache.forget_plans()
