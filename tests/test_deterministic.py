"""Batch-invariant mode (--deterministic, services/runtime/determinism.py) on the CPU: its ops give a
row the same bits whatever else is in the call (row count, position, padded keys, other tokens'
experts), the flag reaches every stage from `voxpipe up` and the bench, and the bench's probe
(bench/determinism_check.py) finds a request's audio equal alone and inside a batch. The engines'
own alone-vs-batched equality with poisoned neighbours is tests/test_isolation.py (which runs in
this mode); the Triton kernels' is tests/test_kernels.py (`invariant`)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from voxpipe.services.runtime import determinism


def test_linear_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(70, 96, generator=g), torch.randn(80, 96, generator=g), torch.randn(80, generator=g)
    full = determinism.linear(x, w, b)
    assert torch.allclose(full, F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    for m in (1, 2, 3, 5, 16, 17, 33):
        assert torch.equal(determinism.linear(x[:m], w, b), full[:m]), m
    perm = torch.randperm(70, generator=g)
    assert torch.equal(determinism.linear(x[perm], w, b), full[perm])
    assert torch.equal(determinism.linear(x.view(7, 10, 96), w, b), full.view(7, 10, 80))


def test_rows_linear_is_the_linear_in_fixed_calls():
    """`rows_linear` (the mode's CUDA nn.Linear): F.linear's values for any row count (padded to whole
    GPU_ROWS-row calls and cut back), 3-D and strided inputs, with and without a bias. (Its bits per
    row are the GEMM's at one shape; that they do not depend on the row's position is checked on the
    GPU: tests/test_kernels.py `test_invariant_rows_on_cuda`, and by `apply` itself.)"""
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    x = torch.randn(3 * determinism.GPU_ROWS + 5, 24, generator=g)
    for m in (0, 1, determinism.GPU_ROWS - 1, determinism.GPU_ROWS, determinism.GPU_ROWS + 1, x.shape[0]):
        for bias in (b, None):
            got = determinism.rows_linear(x[:m], w, bias)
            assert got.shape == (m, 40) and got.is_contiguous()
            assert torch.allclose(got, F.linear(x[:m], w, bias), atol=1e-5, rtol=1e-5), m
    strided = torch.randn(24, 70, generator=g).t()                      # rows not contiguous
    assert torch.allclose(determinism.rows_linear(strided, w, b), F.linear(strided, w, b), atol=1e-5, rtol=1e-5)
    assert determinism.rows_linear(x[:70].view(7, 10, 24), w, b).shape == (7, 10, 40)


def test_padded_rows_copy_the_rows_then_exact_zeros():
    """`padded_rows` (rows_linear's padding to whole GPU_ROWS-row calls): the rows, then zero rows, in a
    new contiguous buffer, the same bits through the persistent zero rows (one cat) as through the
    two-launch fill (the path inside a CUDA graph capture before the zeros exist: here reached by
    more padding than the zero block holds); the zero block is never written; strided rows and
    bfloat16 too; rows_linear's outputs equal F.linear's on the zero-padded rows."""
    g = torch.Generator().manual_seed(10)
    rows_n = determinism.GPU_ROWS
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2 * rows_n + 5, 24, generator=g).to(dtype)
        for m, padded in ((1, rows_n), (rows_n - 1, rows_n), (rows_n + 5, 2 * rows_n), (3, 3)):
            got = determinism.padded_rows(x[:m], padded)
            want = torch.zeros(padded, 24, dtype=dtype)
            want[:m] = x[:m]
            assert got.is_contiguous() and got.dtype == dtype and torch.equal(got, want), (m, padded)
        zeros = determinism._ZERO_ROWS[((24,), dtype, torch.device("cpu"), rows_n)]
        assert zeros.shape == (rows_n, 24) and not zeros.any()
        far = determinism.padded_rows(x[:2], rows_n + 10)                  # past the zero block: the fill
        assert torch.equal(far[:2], x[:2]) and not far[2:].any() and far.shape == (rows_n + 10, 24)
        strided = torch.randn(24, 9, generator=g).to(dtype).t()
        got = determinism.padded_rows(strided, rows_n)
        assert got.is_contiguous() and torch.equal(got[:9], strided) and not got[9:].any()
        assert not zeros.any()
    s = determinism.GPU_SAMPLES                                              # sample_blocks' padding
    samples = torch.randn(s + 2, 3, 7, generator=g)
    got = determinism.padded_rows(samples[:, :, ::2], 2 * s, s)
    assert got.is_contiguous() and torch.equal(got[:s + 2], samples[:, :, ::2]) and not got[s + 2:].any()
    w = torch.randn(40, 24, generator=g)
    x = torch.randn(rows_n + 3, 24, generator=g)
    block = torch.zeros(2 * rows_n, 24)
    block[:rows_n + 3] = x
    want = torch.cat([torch.mm(b, w.t()) for b in block.split(rows_n)])[:rows_n + 3]
    assert torch.equal(determinism.rows_linear(x, w), want)


def test_rows_check_finds_a_row_that_depends_on_its_position(monkeypatch):
    """`rows_invariant` (what `apply` runs per CUDA layer shape before it lets cuBLAS row calls serve)
    tells a row-wise computation from one whose row bits move with the row's position or with the
    other rows (here made so on purpose), at every position of two calls."""
    g = torch.Generator().manual_seed(4)
    w, b = torch.randn(16, 8, generator=g), torch.randn(16, generator=g)

    def exact(x, weight, bias=None):            # float64 products and sums: each row alone, exactly
        return F.linear(x.double(), weight.double(), None if bias is None else bias.double()).float()

    monkeypatch.setattr(determinism, "rows_linear", exact)
    assert determinism.rows_invariant(w, b, graph=False)
    late = determinism.GPU_ROWS + 7
    def moved(x, weight, bias=None):
        return exact(x, weight, bias) + (torch.arange(x.shape[0]) == late)[:, None]

    monkeypatch.setattr(determinism, "rows_linear", moved)
    assert not determinism.rows_invariant(w, b, graph=False)       # one position of the second call
    monkeypatch.setattr(determinism, "rows_linear",
                        lambda x, weight, bias=None: exact(x, weight, bias) + x.shape[0] * 1e-3)
    assert not determinism.rows_invariant(w, b, graph=False)       # the batch's size


def test_rows_linear_batches_blocks_into_launches(monkeypatch):
    """`rows_linear` with a batched plan (a prefill's GPU_ROWS-row blocks several to a launch, where
    `batches_invariant` held): F.linear's values for any row count, with and without a bias, through
    strided-batched ("bmm") and whole-GEMM ("mm") launches; the blocks go largest launch first while
    that many are left, the rest one call each."""
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    rows = determinism.GPU_ROWS
    x = torch.randn(11 * rows + 3, 24, generator=g)
    launches = []
    real = determinism._row_batch

    def counted(r, wt, bias, out, blocks, how):
        launches.append((blocks, how))
        real(r, wt, bias, out, blocks, how)

    monkeypatch.setattr(determinism, "_row_batch", counted)
    plan = ((4, "bmm"), (2, "mm"))
    for m, want in ((0, []), (1, []), (rows + 1, [(2, "mm")]), (7 * rows, [(4, "bmm"), (2, "mm")]),
                    (10 * rows + 3, [(4, "bmm"), (4, "bmm"), (2, "mm")]), (x.shape[0], [(4, "bmm")] * 3)):
        for bias in (b, None):
            launches.clear()
            got = determinism.rows_linear(x[:m], w, bias, plan)
            assert got.shape == (m, 40) and launches == want, (m, launches)
            assert torch.allclose(got, F.linear(x[:m], w, bias), atol=1e-5, rtol=1e-5), m


def test_batches_check_keeps_only_launches_that_keep_a_rows_bits(monkeypatch):
    """`batches_invariant` (what `apply` runs per CUDA layer shape after `rows_invariant`): every block
    count of ROW_BATCHES whose launch gives each row its GPU_ROWS-row call's bits, the first such
    launch kind per count; a count whose first kind moves one position's bits takes the second, one
    where both do is left out (its blocks keep one call each)."""
    g = torch.Generator().manual_seed(6)
    w, b = torch.randn(16, 8, generator=g), torch.randn(16, generator=g)

    def exact(x, weight, bias=None, batches=()):      # float64 products and sums: each row alone, exactly
        return F.linear(x.double(), weight.double(), None if bias is None else bias.double()).float()

    monkeypatch.setattr(determinism, "rows_linear", exact)
    monkeypatch.setattr(determinism, "_row_batch", lambda r, wt, bias, out, blocks, how:
                        out.copy_(exact(r, wt.t(), bias)))
    first, second = determinism.ROW_BATCH_HOWS
    assert determinism.batches_invariant(w, b) == tuple((n, first) for n in determinism.ROW_BATCHES)

    def moved(r, wt, bias, out, blocks, how):
        out.copy_(exact(r, wt.t(), bias))
        if (blocks, how) in ((8, first), (16, first), (16, second)):
            out[3 * determinism.GPU_ROWS + 5] += 1        # one position of the fourth block

    monkeypatch.setattr(determinism, "_row_batch", moved)
    plan = dict(determinism.batches_invariant(w, None))
    assert plan[8] == second and 16 not in plan and plan[4] == first
    assert len(plan) == len(determinism.ROW_BATCHES) - 1


def test_sample_blocks_are_the_convolution_in_fixed_calls():
    """`sample_blocks` (the mode's CUDA convolutions through cuDNN): the convolution's values for any
    batch (padded to whole GPU_SAMPLES-sample calls and cut back) and a strided input; and
    `samples_invariant` (what the mode runs per (layer, input) shape before cuDNN serves it) tells a
    per-sample computation from one whose bits move with the sample's place or with the batch."""
    g = torch.Generator().manual_seed(8)
    conv = torch.nn.Conv1d(6, 5, 3, dilation=2).requires_grad_(False)
    s = determinism.GPU_SAMPLES
    x = torch.randn(2 * s + 3, 6, 30, generator=g)
    with torch.no_grad():
        for b in (1, s - 1, s, s + 1, x.shape[0]):
            got = determinism.sample_blocks(x[:b], conv)
            assert got.shape == (b, 5, 26) and torch.allclose(got, conv(x[:b]), atol=1e-5, rtol=1e-5), b
        strided = x[:5, :, ::2]
        assert torch.allclose(determinism.sample_blocks(strided, conv), conv(strided), atol=1e-5, rtol=1e-5)

        def exact(block):       # each sample alone, in float64
            return torch.cat([F.conv1d(v[None].double(), conv.weight.double(), conv.bias.double(), dilation=2)
                              for v in block]).float()

        assert determinism.samples_invariant(exact, (6, 30), torch.float32, torch.device("cpu"))
        late = s + 3
        assert not determinism.samples_invariant(
            lambda block: exact(block) + (torch.arange(s) == late % s)[:, None, None] * (late >= s), (6, 30),
            torch.float32, torch.device("cpu"))      # the same place of every call moves: seen at it
        assert not determinism.samples_invariant(lambda block: exact(block) + block.mean(), (6, 30), torch.float32,
                                                 torch.device("cpu"))


def _exact_conv(conv):
    def exact(block):       # each sample alone, in float64
        return torch.cat([F.conv1d(v[None].double(), conv.weight.double(), conv.bias.double(),
                                   dilation=conv.dilation) for v in block]).float()
    return exact


def test_sample_blocks_take_proven_spans_in_one_call():
    """`sample_blocks` with spans (sample counts `samples_spans` proved): the padded samples go
    largest span first while that many are left, the rest GPU_SAMPLES at a time; the convolution's
    values for any batch."""
    g = torch.Generator().manual_seed(9)
    conv = torch.nn.Conv1d(4, 3, 3, dilation=2).requires_grad_(False)
    s = determinism.GPU_SAMPLES
    x = torch.randn(7 * s + 2, 4, 20, generator=g)
    calls = []

    def counted(block):
        calls.append(block.shape[0])
        return conv(block)

    with torch.no_grad():
        for b, want in ((1, [s]), (s, [s]), (2 * s, [2 * s]), (3 * s - 1, [2 * s, s]), (4 * s, [4 * s]),
                        (5 * s + 1, [4 * s, 2 * s]), (7 * s + 2, [4 * s, 4 * s])):
            calls.clear()
            got = determinism.sample_blocks(x[:b], counted, (4 * s, 2 * s))
            assert calls == want, (b, calls)
            assert torch.allclose(got, conv(x[:b]), atol=1e-5, rtol=1e-5), b


def test_spans_check_keeps_only_calls_that_keep_a_samples_bits():
    """`samples_spans` (what the mode runs per convolution shape after `samples_invariant`): every count
    of SAMPLE_SPANS whose one call gives each sample its GPU_SAMPLES-sample call's bits; a count whose
    call moves one position's bits, or that raises, is left out (its samples keep GPU_SAMPLES-sample
    calls); and `conv_plan` (the decision `_cudnn_samples` remembers per shape): None (the Triton path)
    where the GPU_SAMPLES-sample calls themselves fail, the proven spans otherwise."""
    conv = torch.nn.Conv1d(6, 5, 3, dilation=2).requires_grad_(False)
    exact = _exact_conv(conv)
    cpu, shape = torch.device("cpu"), (6, 30)
    spans = tuple(n for n in determinism.SAMPLE_SPANS if n > determinism.GPU_SAMPLES)
    assert spans == (64, 32)
    with torch.no_grad():
        assert determinism.samples_spans(exact, shape, torch.float32, cpu) == spans
        assert determinism.conv_plan(exact, shape, torch.float32, cpu) == spans

        def moved(block):           # the 64-sample call: its place 37 (odd) moves
            out = exact(block)
            if block.shape[0] == 64:
                out[37] += 1e-3
            return out

        assert determinism.samples_spans(moved, shape, torch.float32, cpu) == (32,)
        assert determinism.conv_plan(moved, shape, torch.float32, cpu) == (32,)

        def refused(block):         # a larger call that does not run at all
            if block.shape[0] > determinism.GPU_SAMPLES:
                raise RuntimeError("no such call")
            return exact(block)

        assert determinism.samples_spans(refused, shape, torch.float32, cpu) == ()
        assert determinism.conv_plan(refused, shape, torch.float32, cpu) == ()
        # the 16-sample calls move with the batch: no cuDNN at all, whatever the larger calls do
        assert determinism.conv_plan(lambda block: exact(block) + block.mean(), shape, torch.float32, cpu) is None


def test_graph_batches_are_cuda_only_and_a_subset():
    """`batches_graphed` (the captured launches' proof) is a CUDA check: off CUDA nothing is kept, so a
    captured `rows_linear` (CUDA only) never takes a launch that was not proven in a graph."""
    w = torch.randn(16, 8)
    assert determinism.batches_graphed(w, None, ((4, "mm"), (2, "bmm"))) == ()
    assert determinism.batches_graphed(w, None, ()) == ()


def test_an_unknown_gpu_path_is_refused(monkeypatch):
    """VOXPIPE_INVARIANT_MATMUL / VOXPIPE_INVARIANT_CONV (read at import into determinism.GPU_MATMUL /
    GPU_CONV) other than their values: apply refuses, naming the variable and the values."""
    monkeypatch.setattr(determinism, "GPU_MATMUL", "cuBLAS ")
    with pytest.raises(ValueError, match="VOXPIPE_INVARIANT_MATMUL.*cublas, triton"):
        determinism.apply(torch.nn.Linear(4, 4))
    monkeypatch.undo()
    monkeypatch.setattr(determinism, "GPU_CONV", "")
    with pytest.raises(ValueError, match="VOXPIPE_INVARIANT_CONV.*cudnn, triton"):
        determinism.apply(torch.nn.Conv1d(4, 4, 3))


def test_attention_rows_do_not_depend_on_padding_or_batch():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 5, 16, generator=g)
    k, v = torch.randn(2, 2, 40, 16, generator=g), torch.randn(2, 2, 40, 16, generator=g)
    lengths = torch.tensor([23, 40])
    pos = torch.arange(40)[None, None, :]
    mask = (pos < (lengths[:, None, None] - 4 + torch.arange(5)[None, :, None]))[:, None]    # [2, 1, 5, 40]
    got = determinism.attention(q, k, v, mask, 0.25)
    rep = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    assert torch.allclose(got, F.scaled_dot_product_attention(q, *rep, attn_mask=mask, scale=0.25), atol=1e-5)
    alone = determinism.attention(q[:1, :, 2:3], k[:1, :, :23], v[:1, :, :23], mask[:1, :, 2:3, :23], 0.25)
    assert torch.equal(alone, got[:1, :, 2:3])
    pad = torch.randn(2, 2, 50, 16, generator=g)
    padded = determinism.attention(torch.cat((q, q), 2), torch.cat((k, pad), 2), torch.cat((v, pad), 2),
                                   F.pad(torch.cat((mask, mask), 2), (0, 50), value=False), 0.25)
    assert torch.equal(padded[:, :, :5], got)
    none = determinism.attention(q, k, v, torch.zeros_like(mask), 0.25)
    assert torch.equal(none, torch.zeros_like(none))     # a row with no key: zeros, not NaN


def test_experts_tokens_do_not_depend_on_the_others():
    from voxpipe.services.runtime.layers import Experts

    g = torch.Generator().manual_seed(2)
    ex = Experts(8, 64, 32)
    with torch.no_grad():
        ex.gate_up.copy_(torch.randn(8, 64, 64, generator=g) / 8)
        ex.down.copy_(torch.randn(8, 64, 32, generator=g) / 6)
    determinism.apply(ex)
    x = torch.randn(40, 64, generator=g)
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(40)])
    w = torch.softmax(torch.randn(40, 2, generator=g), -1)
    with torch.no_grad():
        full = ex(x, idx, w)
        assert torch.allclose(full, ex.looped(x, idx, w), atol=1e-5)
        assert torch.equal(ex(x[:1], idx[:1], w[:1]), full[:1])
        assert torch.equal(ex(x.flip(0), idx.flip(0), w.flip(0)), full.flip(0))
        # with a shared expert's rows and gate logits: its gated add, per token
        shared, logit = torch.randn(40, 64, generator=g), torch.randn(40, 1, generator=g)
        both = ex(x, idx, w, shared, logit)
        assert torch.equal(both, full + determinism.sigmoid(logit) * shared)
        assert torch.allclose(both, ex.looped(x, idx, w) + torch.sigmoid(logit) * shared, atol=1e-5)
        assert torch.equal(ex(x[5:6], idx[5:6], w[5:6], shared[5:6], logit[5:6]), both[5:6])
        assert torch.equal(ex(x.flip(0), idx.flip(0), w.flip(0), shared.flip(0), logit.flip(0)), both.flip(0))


def test_flag_reaches_every_stage_from_up_and_the_bench():
    from voxpipe.cli import _up_stage_flags, build_parser

    parser = build_parser()
    for stage in ("thinker", "talker", "code2wav"):
        assert parser.parse_args([stage, "--deterministic"]).deterministic
        assert not parser.parse_args([stage]).deterministic
    assert "--deterministic" in _up_stage_flags(parser.parse_args(["up", "--deterministic"]))
    assert "--deterministic" not in _up_stage_flags(parser.parse_args(["up"]))
    assert parser.parse_args(["bench", "--deterministic"]).deterministic


def test_probe_finds_talker_codes_and_audio_equal_alone_and_batched(capsys):
    """The bench's probe at its smallest: a greedy talker target and a code2wav target, alone and
    beside another request of another length (the thinker's and the sampled runs: test_isolation)."""
    from voxpipe.bench import determinism_check

    assert determinism_check.main(["--stages", "talker,code2wav", "--modes", "deterministic", "--concurrency", "2",
                                   "--frames", "2", "--targets", "greedy", "--no-warm"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines() if x.startswith("{")]
    assert [(r["stage"], r["greedy"]["equal"], r["greedy"]["repeatable"]) for r in lines] == [
        ("talker", True, True), ("code2wav", True, True)]


def test_probe_refuses_an_unknown_mode(capsys):
    from voxpipe.bench import determinism_check

    with pytest.raises(SystemExit) as exc:
        determinism_check.main(["--modes", "default,deterministic-cublas"])
    assert exc.value.code == 2 and "unknown deterministic-cublas" in capsys.readouterr().err


def test_code2wav_locate_compares_every_module_row(capsys):
    """bench/code2wav_locate at its smallest (2 utterances, 3 frames): both passes find the target's
    rows equal in the mode; in the default mode the eager pass names the first frame and module
    whose row moved."""
    from voxpipe.bench import code2wav_locate
    from voxpipe.bench.determinism_check import build_engine
    from voxpipe.cli import default_model_dir

    assert code2wav_locate.main(["--concurrency", "2", "--frames", "3"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines() if x.startswith("{")]
    assert [(r["pass"], r["equal"]) for r in lines] == [("eager", True), ("graphs", True)]
    engine = build_engine("code2wav", ["--model", str(default_model_dir()), "--device", "cpu", "--max-batch", "4"])
    target = code2wav_locate._codes(engine, 0, 2)
    batch = [code2wav_locate._codes(engine, k, 2) for k in (1, 2, 3)]
    batch.insert(2, target)
    diff = code2wav_locate.first_module_difference(code2wav_locate.eager_rows(engine, [target], 0),
                                                   code2wav_locate.eager_rows(engine, batch, 2))
    assert diff is not None and diff["frame"] == 0 and diff["module"].startswith("pre_transformer.")


def test_paged_views_give_a_query_row_one_computation():
    """The CPU's path of every paged view in the mode (determinism.attention over the blocks): a
    row's bits alike in a whole prefill, packed segments from a cached prefix, an extend and decode
    steps (the kernel's path: tests/test_kernels.py `paged_views`)."""
    from test_kernels import paged_views_rows

    for dt in (torch.float32, torch.bfloat16):
        rows = paged_views_rows("cpu", dt)
        want = rows.pop("whole prefill")
        for name, got in rows.items():
            assert torch.equal(got, want), (dt, name)


def _thinker(model_dir, *extra: str, graphs: bool):
    """A deterministic thinker engine as its service builds it; `graphs`: its CUDA-graph step plans
    (whole-prompt prefill, extend, decode views) emulated on the CPU."""
    from voxpipe.bench import determinism_check
    from voxpipe.services.runtime import cuda_graphs

    emulate, cuda_graphs.EMULATE = cuda_graphs.EMULATE, graphs
    try:
        return determinism_check.build_engine("thinker", ["--model", str(model_dir), "--device", "cpu", "--max-batch",
                                                          "3", "--deterministic", *extra])
    finally:
        cuda_graphs.EMULATE = emulate


def test_thinker_bits_alike_on_a_miss_a_hit_in_a_batch_and_after_preemption(tiny_model_dir):
    """A request's token ids, log probabilities and talker rows: the same on a prefix-cache miss, a
    hit, inside a batch (graph plans), and when a pool too small for the batch preempts and recomputes."""
    import asyncio

    from voxpipe.bench import determinism_check as dc
    from voxpipe.services.runtime import metrics
    from voxpipe.services.runtime.engine import Outbox
    from voxpipe.services.runtime.sampling import SamplingParams
    from voxpipe.services.thinker.job import ThinkerJob
    from voxpipe.services.thinker.prompt import ChatMessage, render

    roomy = _thinker(tiny_model_dir, graphs=True)
    probe = dc.thinker_probe(roomy, 4)
    result = asyncio.run(dc.check_stage(roomy, probe, 3, ("greedy",), warm=False))   # sampled: p1 below
    assert all(r["hit_miss"] and r["repeatable"] and r["equal"] for r in result.values()), result

    tight = _thinker(tiny_model_dir, "--kv-cache-tokens", "96", "--max-len", "96", graphs=True)
    texts = ("Count to twenty.", "Name the planets.", "Sing a song.")
    params = (dc.GREEDY, SamplingParams(temperature=0.9, top_k=50, seed=5), dc.GREEDY)

    async def bits(engine, picks: list[int]) -> dict[int, dict]:
        loop = asyncio.get_running_loop()
        jobs = [ThinkerJob(request_id=f"p{i}", outbox=Outbox(loop, limit=100000), params=params[i],
                           prompt=render(engine.tokenizer, engine.cfg, [ChatMessage.text("user", texts[i])]).token_ids,
                           max_tokens=20, min_tokens=20, talker_rows=True, top_logprobs=3) for i in picks]
        dc.forget_prefixes(engine)
        dc.run_together(engine, jobs)
        await asyncio.sleep(0)
        return {i: probe.bits(j, dc.drained(j)) for i, j in zip(picks, jobs)}

    before = metrics.REGISTRY.get_sample_value("voxpipe_preemptions_total", {"stage": "thinker"}) or 0
    together = asyncio.run(bits(tight, [0, 1, 2]))
    assert metrics.REGISTRY.get_sample_value("voxpipe_preemptions_total", {"stage": "thinker"}) > before
    for i in range(3):
        assert dc.differs(together[i], asyncio.run(bits(roomy, [i]))[i]) == {}, texts[i]
