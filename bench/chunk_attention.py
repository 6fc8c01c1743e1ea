"""A long prompt's chunk attention split into (square causal part) + (unmasked part over the cached
prefix), merged by log-sum-exp, each part through cuDNN / flash / memory-efficient SDPA, against
flash attention with the lower-right causal mask (what `_causal_flash` does for unplanned shapes).
One layer of the thinker's shape (Hq 32, Hkv 4, D 128, bf16, random data), a 32,768-token prompt
in chunks of 4k / 8k / 16k / 32k: the summed time of its chunks, us; then the pieces of its last
8k chunk. CUDA only; prints JSON lines. bench/RESULTS.md ("a long prompt's attention in two parts").

    python -m voxpipe.bench.chunk_attention
"""
import json

import torch

from voxpipe.services.runtime.kv_cache import _causal_flash

dev = "cuda"
HQ, HKV, D = 32, 4, 128
REP = HQ // HKV
scale = D ** -0.5
aten = torch.ops.aten


def timeit(fn, iters=5):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters * 1000  # us


def cudnn_lse(q, k, v, causal):
    o, lse = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
    return o, lse.reshape(q.shape[0], q.shape[1], q.shape[2])


def flash_lse(q, k, v, causal):
    o, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    return o, lse.reshape(q.shape[0], q.shape[1], q.shape[2])


def eff_lse(q, k, v, causal):
    o, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
    return o, lse[..., : q.shape[2]].reshape(q.shape[0], q.shape[1], q.shape[2])


def fold(q):   # [1, HQ, C, D] -> [1, HKV, REP*C, D]
    return q.reshape(1, HKV, REP * q.shape[2], D)


def unfold(o, c):
    return o.reshape(1, HQ, c, o.shape[-1]) if o.dim() == 4 else o.reshape(1, HQ, c)


def rep(k):
    return k.repeat_interleave(REP, dim=1)


def merge(o1, l1, o2, l2):
    lse = torch.logaddexp(l1, l2)
    return (o1.float() * torch.exp(l1 - lse)[..., None] + o2.float() * torch.exp(l2 - lse)[..., None]).to(o1.dtype)


def split_chunk(q, k, v, p, sq, pre):
    """q [1, HQ, C, D] at positions p..p+C-1; k, v [1, HKV, p+C, D]."""
    c = q.shape[2]
    o2, l2 = sq(q, rep(k[:, :, p:]), rep(v[:, :, p:]), True)
    if p == 0:
        return o2
    o1, l1 = pre(fold(q), k[:, :, :p], v[:, :, :p], False)
    return merge(unfold(o1, c), unfold(l1, c), o2, l2)


def split_chunk_gqa(q, k, v, p, sq, pre):
    c = q.shape[2]
    o2, l2 = sq(q, k[:, :, p:], v[:, :, p:], True)
    if p == 0:
        return o2
    o1, l1 = pre(fold(q), k[:, :, :p], v[:, :, :p], False)
    return merge(unfold(o1, c), unfold(l1, c), o2, l2)



def main() -> None:
    out = []
    torch.manual_seed(0)
    T = 32768
    qa = torch.randn(1, HQ, T, D, device=dev, dtype=torch.bfloat16)
    ka = torch.randn(1, HKV, T, D, device=dev, dtype=torch.bfloat16)
    va = torch.randn(1, HKV, T, D, device=dev, dtype=torch.bfloat16)

    # correctness of the split against today's path on one chunk
    p, c = 24576, 8192
    q = qa[:, :, p:p + c]
    ref = _causal_flash(q, ka[:, :, :p + c], va[:, :, :p + c], scale)
    for name, sq, pre in (("cudnn+cudnn", cudnn_lse, cudnn_lse), ("cudnn+flash", cudnn_lse, flash_lse),
                          ("flash+flash", flash_lse, flash_lse)):
        try:
            got = split_chunk(q, ka[:, :, :p + c], va[:, :, :p + c], p, sq, pre)
            err = (got.float() - ref.float()).abs().max().item()
            out.append({"check": name, "max_abs": err})
        except Exception as e:
            out.append({"check": name, "error": repr(e)[:300]})
    print(json.dumps(out[-3:]), flush=True)

    for c in (4096, 8192, 16384, 32768):
        row = {"chunk": c}
        chunks = list(range(0, T, c))

        def today():
            for p in chunks:
                _causal_flash(qa[:, :, p:p + c], ka[:, :, :p + c], va[:, :, :p + c], scale)
        row["today_flash_lower_right"] = timeit(today, 3)
        for name, sq, pre, fn in (("cudnn_sq+cudnn_pre", cudnn_lse, cudnn_lse, split_chunk),
                                  ("cudnn_sq+flash_pre", cudnn_lse, flash_lse, split_chunk),
                                  ("flash_sq_gqa+flash_pre", flash_lse, flash_lse, split_chunk_gqa),
                                  ("cudnn_sq_gqa+cudnn_pre", cudnn_lse, cudnn_lse, split_chunk_gqa)):
            def split():
                for p in chunks:
                    fn(qa[:, :, p:p + c], ka[:, :, :p + c], va[:, :, :p + c], p, sq, pre)
            try:
                row[name] = timeit(split, 3)
            except Exception as e:
                row[name] = repr(e)[:200]
        out.append(row)
        print(json.dumps(row), flush=True)

    # the pieces alone at the last 8k chunk of 32k
    p, c = 24576, 8192
    q = qa[:, :, p:p + c]
    pieces = {}
    for name, fn in (("sq_cudnn_rep", lambda: cudnn_lse(q, rep(ka[:, :, p:]), rep(va[:, :, p:]), True)),
                     ("sq_flash_gqa", lambda: flash_lse(q, ka[:, :, p:], va[:, :, p:], True)),
                     ("pre_cudnn_fold", lambda: cudnn_lse(fold(q), ka[:, :, :p], va[:, :, :p], False)),
                     ("pre_flash_fold", lambda: flash_lse(fold(q), ka[:, :, :p], va[:, :, :p], False)),
                     ("pre_eff_fold", lambda: eff_lse(fold(q), ka[:, :, :p], va[:, :, :p], False)),
                     ("rep_kv_8k", lambda: (rep(ka[:, :, p:]), rep(va[:, :, p:]))),
                     ("today", lambda: _causal_flash(q, ka, va, scale))):
        try:
            pieces[name] = timeit(fn)
        except Exception as e:
            pieces[name] = repr(e)[:200]
    print(json.dumps({"pieces_8k_at_24k_us": pieces}), flush=True)


if __name__ == "__main__":
    main()
