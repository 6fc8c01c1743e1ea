"""A long prompt's chunk attention in two parts (runtime/kv_cache.py `_cudnn_chunk`): the chunk over
its own keys (causal) and over the cached prefix (no mask), merged by their log-sum-exps, equals one
causal attention over all of them. The merge (float32 inside) is checked on the CPU against float64; the cuDNN path itself
(planned shapes only) on CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from voxpipe.services.runtime import kv_cache


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


def test_plan_chunks_is_a_no_op_off_cuda():
    assert kv_cache.plan_chunks(64, 256, 4, 2, 16, torch.bfloat16, torch.device("cpu")) == 0
    assert kv_cache.plan_chunks(64, 256, 4, 2, 16, torch.float32, torch.device("cpu")) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cudnn_chunks_equal_flash_on_cuda():
    """Planned shapes take the two-part cuDNN path; its output is within bf16 rounding of flash
    attention with the lower-right causal mask; an unplanned shape stays on flash."""
    dev = torch.device("cuda")
    hq, hkv, d, c = 8, 2, 128, 1024
    assert kv_cache.plan_chunks(c, 4 * c, hq, hkv, d, torch.bfloat16, dev) == 4
    g = torch.Generator(device=dev).manual_seed(0)
    for p in (0, c, 3 * c):
        q = torch.randn(1, hq, c, d, generator=g, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, hkv, p + c, d, generator=g, device=dev, dtype=torch.bfloat16)
        v = torch.randn(1, hkv, p + c, d, generator=g, device=dev, dtype=torch.bfloat16)
        assert kv_cache._plan_key(q, k) in kv_cache._PLANNED
        got = kv_cache._causal_flash(q, k, v, d ** -0.5)
        mask = torch.arange(p + c, device=dev)[None, :] <= (p + torch.arange(c, device=dev))[:, None]
        want = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(hq // hkv, 1),
                                              v.float().repeat_interleave(hq // hkv, 1), attn_mask=mask,
                                              scale=d ** -0.5)
        assert (got.float() - want).abs().max().item() < 2e-2
    q = torch.randn(1, hq, c - 1, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, hkv, 2 * c - 1, d, device=dev, dtype=torch.bfloat16)
    assert kv_cache._plan_key(q, k) not in kv_cache._PLANNED
