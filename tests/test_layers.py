"""Every layer and every stage model equals transformers' own Qwen3-Omni modules on the tiny checkpoint.

Our modules are built by the real loader (`services.runtime.weights.load_module`) from the tiny checkpoint;
the reference is transformers' `Qwen3OmniMoeForConditionalGeneration` loaded from the same folder. Both run
in float32 on CPU. Tolerances (float32):
  - RMSNorm, rotary cos/sin: atol 1e-6
  - attention, MoE blocks, decoder logits and hidden states, audio encoder: atol 1e-5 (rtol 1e-5)
  - code predictor codes: exact
  - code2wav streaming vs full forward: atol 1e-5 on the waveform, exact sample counts
"""

from __future__ import annotations

import pytest
import torch

from oracle import load_reference_model
from voxpipe.services.code2wav.model import Code2WavModel, StreamStore
from voxpipe.services.runtime.config import OmniConfig
from voxpipe.services.runtime.kv_cache import GrowingCache, ShortCache, SlotKVCache, SlotStep
from voxpipe.services.runtime.layers import RMSNorm, RotaryEmbedding
from voxpipe.services.runtime.weights import load_module
from voxpipe.services.talker.model import TalkerModel
from voxpipe.services.thinker.model import ThinkerModel, audio_output_length

ATOL = 1e-5
RTOL = 1e-5
CPU = torch.device("cpu")


def close(ours: torch.Tensor, ref: torch.Tensor, atol: float = ATOL, rtol: float = RTOL) -> None:
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    err = float((ours - ref).abs().max()) if ours.numel() else 0.0
    assert torch.allclose(ours, ref, atol=atol, rtol=rtol), f"max abs error {err:.3g} > atol {atol}"


@pytest.fixture(scope="module")
def cfg(tiny_model_dir) -> OmniConfig:
    return OmniConfig.load(tiny_model_dir)


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    return load_reference_model(tiny_model_dir)


@pytest.fixture(scope="module")
def thinker(tiny_model_dir, cfg) -> ThinkerModel:
    return load_module(lambda: ThinkerModel(cfg.thinker), tiny_model_dir, "thinker.", device=CPU,
                       dtype=torch.float32, ignore=("visual.",))


@pytest.fixture(scope="module")
def talker(tiny_model_dir, cfg) -> TalkerModel:
    return load_module(lambda: TalkerModel(cfg.talker), tiny_model_dir, "talker.", device=CPU, dtype=torch.float32)


@pytest.fixture(scope="module")
def code2wav(tiny_model_dir, cfg) -> Code2WavModel:
    return load_module(lambda: Code2WavModel(cfg.code2wav), tiny_model_dir, "code2wav.", device=CPU,
                       dtype=torch.float32)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------- norm, rotary


def test_rms_norm(ref, thinker):
    ours = thinker.model.layers[1].input_layernorm
    theirs = ref.thinker.model.language_model.layers[1].input_layernorm
    assert torch.equal(ours.weight, theirs.weight)
    x = torch.randn(3, 5, ours.weight.shape[0], generator=gen(1)) * 4
    with torch.no_grad():
        close(ours(x), theirs(x), atol=1e-6)
        # bfloat16 input: normalised in float32, cast back before the weight, as the reference
        xb = x.to(torch.bfloat16)
        nb, tb = RMSNorm(ours.weight.shape[0], ours.eps), type(theirs)(theirs.weight.shape[0], theirs.variance_epsilon)
        nb.weight.data.copy_(ours.weight)
        tb.weight.data.copy_(theirs.weight)
        assert torch.equal(nb.to(torch.bfloat16)(xb), tb.to(torch.bfloat16)(xb))


def _mrope_positions(batch: int, seq: int) -> torch.Tensor:
    """[3, B, S] with different t / h / w ids (as an image grid inside a text prompt would give)."""
    g = gen(2)
    t = torch.arange(seq).expand(batch, seq) + torch.arange(batch)[:, None] * 3
    h = torch.randint(0, 50, (batch, seq), generator=g)
    w = torch.randint(0, 50, (batch, seq), generator=g) + 100
    return torch.stack((t, h, w))


@pytest.mark.parametrize("stage", ["thinker", "talker"])
def test_rotary_mrope_interleaved_with_distinct_thw_positions(ref, cfg, stage):
    if stage == "thinker":
        dec, theirs = cfg.thinker.text, ref.thinker.model.language_model.rotary_emb
    else:
        dec, theirs = cfg.talker.text, ref.talker.model.rotary_emb
    assert dec.rope.mrope_section is not None and sum(dec.rope.mrope_section) == dec.head_dim // 2
    ours = RotaryEmbedding(dec.head_dim, dec.rope)
    pos = _mrope_positions(2, 11)
    x = torch.zeros(2, 11, dec.hidden_size)
    cos, sin = ours(pos, torch.float32)
    rcos, rsin = theirs(x, pos.clone())
    close(cos, rcos, atol=1e-6)
    close(sin, rsin, atol=1e-6)
    # the h and w sections really differ from t (so the test would see a wrong interleave)
    plain_cos, _ = ours(pos[0], torch.float32)
    assert not torch.allclose(plain_cos, cos)
    # 1-D positions mean t = h = w
    rcos1, rsin1 = theirs(x, pos[0][None].expand(3, -1, -1).clone())
    close(plain_cos, rcos1, atol=1e-6)


def test_rotary_plain_code_predictor_and_code2wav(ref, cfg):
    for dec, theirs in ((cfg.talker.code_predictor, ref.talker.code_predictor.model.rotary_emb),
                        (cfg.code2wav.transformer, ref.code2wav.pre_transformer.rotary_emb)):
        assert dec.rope.mrope_section is None
        ours = RotaryEmbedding(dec.head_dim, dec.rope)
        pos = torch.arange(40).expand(2, 40) + torch.tensor([[0], [7]])
        cos, sin = ours(pos, torch.float32)
        rcos, rsin = theirs(torch.zeros(2, 40, dec.hidden_size), pos)
        close(cos, rcos, atol=1e-6)
        close(sin, rsin, atol=1e-6)


# ---------------------------------------------------------------------------------------------- attention


def _ref_attention(ref_layer, rotary, x: torch.Tensor) -> torch.Tensor:
    """transformers' attention over the whole sequence, causal (sdpa with no mask)."""
    s = x.shape[1]
    pos = torch.arange(s).expand(x.shape[0], s)
    emb = rotary(x, pos[None].expand(3, -1, -1))
    out, _ = ref_layer.self_attn(x, emb, None)
    return out


def test_attention_causal_prefill_growing_cache(ref, thinker, cfg):
    ours = thinker.model.layers[2].self_attn
    theirs = ref.thinker.model.language_model.layers[2]
    assert ours.num_kv_heads < ours.num_heads  # GQA
    x = torch.randn(2, 13, cfg.thinker.text.hidden_size, generator=gen(3))
    rope = thinker.model.rotary(torch.arange(13).expand(2, 13), torch.float32)
    with torch.no_grad():
        want = _ref_attention(theirs, ref.thinker.model.language_model.rotary_emb, x)
        close(ours(x, rope, GrowingCache()), want)
        # prefill 9, then 4 single-token steps into the same growing cache
        cache = GrowingCache()
        outs = [ours(x[:, :9], thinker.model.rotary(torch.arange(9).expand(2, 9), torch.float32), cache)]
        for p in range(9, 13):
            outs.append(ours(x[:, p:p + 1], thinker.model.rotary(torch.full((2, 1), p), torch.float32), cache))
        close(torch.cat(outs, dim=1), want)


def test_short_cache_equals_growing_cache_and_refuses_overflow(thinker, cfg):
    """ShortCache (preallocated, the code predictor's) attends as GrowingCache does, prefill then
    single steps, and says so when asked for more positions than it holds."""
    attn = thinker.model.layers[2].self_attn
    x = torch.randn(2, 6, cfg.thinker.text.hidden_size, generator=gen(5))
    t = cfg.thinker.text
    short = ShortCache(len(thinker.model.layers), 2, 6, t.num_kv_heads, t.head_dim, torch.float32, "cpu")
    growing = GrowingCache()
    with torch.no_grad():
        for start, n in ((0, 3), (3, 1), (4, 2)):
            rope = thinker.model.rotary(torch.arange(start, start + n).expand(2, n), torch.float32)
            got = attn(x[:, start:start + n], rope, short)
            close(got, attn(x[:, start:start + n], rope, growing))
        with pytest.raises(ValueError, match="holds 6 positions; 6 \\+ 1 asked"):
            attn(x[:, :1], thinker.model.rotary(torch.full((2, 1), 6), torch.float32), short)


def test_attention_slot_cache_prefill_then_batched_decode(ref, thinker, cfg):
    """Two sequences of different lengths: each prefilled on its own into its slot; a batched one-token
    step (SlotStep); the slot before them released (the cache compacts: the last slot's keys move);
    a dense one-token decode over slots 0..n-1 (decode_view, the engine's decode path); a batched
    three-token step. Everything equals the full causal forward."""
    ours = thinker.model.layers[1].self_attn
    theirs = ref.thinker.model.language_model.layers[1]
    rotary = thinker.model.rotary
    h = cfg.thinker.text
    lengths = (5, 11)
    xs = [torch.randn(1, n + 5, h.hidden_size, generator=gen(10 + n)) for n in lengths]
    cache = SlotKVCache(h.num_layers, 4, 32, h.num_kv_heads, h.head_dim, torch.float32, CPU)
    placeholder, seq_a, seq_b = "placeholder", "a", "b"
    slot_of = {who: cache.allocate(who) for who in (placeholder, seq_a, seq_b)}
    slots = [slot_of[seq_a], slot_of[seq_b]]
    assert slots == [1, 2]
    got: list[list[torch.Tensor]] = [[], []]
    with torch.no_grad():
        for b, (n, x) in enumerate(zip(lengths, xs)):
            step = SlotStep.build([slots[b]], [0], n, CPU)
            got[b].append(ours(x[:, :n], rotary(torch.arange(n)[None], torch.float32), cache.bind(step)))
        # batched step: one token each, at their own positions
        start = list(lengths)
        x1 = torch.cat([x[:, n:n + 1] for n, x in zip(lengths, xs)])
        out = ours(x1, rotary(torch.tensor(start)[:, None], torch.float32), cache.bind(SlotStep.build(slots, start, 1, CPU)))
        for b in range(2):
            got[b].append(out[b:b + 1])
        # free slot 0: the last slot (seq b) moves into it
        assert cache.release(slot_of[placeholder]) == seq_b
        slots = [1, 0]
        order = [seq_b, seq_a]                      # slot 0, slot 1
        assert cache.owners[:2] == order and cache.used == 2
        # dense decode of slots 0..1 (seq b, seq a), one token each
        start_by_slot = torch.tensor([lengths[1] + 1, lengths[0] + 1])
        x_by_slot = torch.cat([xs[1][:, lengths[1] + 1:lengths[1] + 2], xs[0][:, lengths[0] + 1:lengths[0] + 2]])
        view = cache.decode_view(2, int(start_by_slot.max()) + 1, start_by_slot)
        out = ours(x_by_slot, rotary(start_by_slot[:, None], torch.float32), view)
        got[1].append(out[0:1])
        got[0].append(out[1:2])
        # batched step of three tokens each
        start = [n + 2 for n in lengths]
        x3 = torch.cat([x[:, n + 2:n + 5] for n, x in zip(lengths, xs)])
        pos = torch.tensor(start)[:, None] + torch.arange(3)
        out = ours(x3, rotary(pos, torch.float32), cache.bind(SlotStep.build(slots, start, 3, CPU)))
        for b in range(2):
            got[b].append(out[b:b + 1])
        for b, x in enumerate(xs):
            close(torch.cat(got[b], dim=1), _ref_attention(theirs, ref.thinker.model.language_model.rotary_emb, x))


# ---------------------------------------------------------------------------------------------- MoE


def test_moe_thinker_no_shared_expert(ref, thinker, cfg):
    ours = thinker.model.layers[0].mlp
    theirs = ref.thinker.model.language_model.layers[0].mlp
    assert ours.shared_expert is None
    x = torch.randn(2, 17, cfg.thinker.text.hidden_size, generator=gen(4))
    with torch.no_grad():
        idx, w = ours.route(x.reshape(-1, x.shape[-1]))
        _, rw, ridx = theirs.gate(x.reshape(-1, x.shape[-1]))
        assert torch.equal(idx, ridx)
        close(w, rw, atol=1e-6)
        assert idx.unique().numel() == cfg.thinker.text.num_experts  # every expert is exercised
        close(ours(x), theirs(x))


def test_moe_talker_with_gated_shared_expert(ref, talker, cfg):
    ours = talker.model.layers[1].mlp
    theirs = ref.talker.model.layers[1].mlp
    assert ours.shared_expert is not None
    x = torch.randn(3, 9, cfg.talker.text.hidden_size, generator=gen(5))
    with torch.no_grad():
        close(ours(x), theirs(x))
        # one token alone (the decode shape)
        close(ours(x[:1, :1]), theirs(x[:1, :1]))


# ---------------------------------------------------------------------------------------------- thinker


def test_thinker_decoder_logits_and_accept_hidden_layer(ref, thinker, cfg):
    ids = torch.randint(0, cfg.thinker.text.vocab_size, (1, 21), generator=gen(6))
    keep = cfg.thinker.accept_hidden_layer
    with torch.no_grad():
        out = ref.thinker.model.language_model(input_ids=ids, output_hidden_states=True, use_cache=False)
        want_logits = ref.thinker.lm_head(out.last_hidden_state)
        embeds = thinker.model.embed_tokens(ids)
        pos = torch.arange(21)[None]
        h, kept = thinker.model(embeds, pos, GrowingCache(), keep_hidden=keep)
        close(thinker.lm_head(h), want_logits)
        close(kept, out.hidden_states[keep])
        last, kept2 = thinker(embeds, pos, GrowingCache(), keep_hidden=keep)
        close(last, want_logits[:, -1])
        close(kept2, out.hidden_states[keep])
        # every other index too (0 = embeddings, num_layers = final normed output)
        for k in range(cfg.thinker.text.num_layers + 1):
            _, kk = thinker.model(embeds, pos, GrowingCache(), keep_hidden=k)
            close(kk, out.hidden_states[k])


def test_thinker_prefill_then_decode_in_slot_cache(ref, thinker, cfg):
    """Two prompts of different lengths: prefill each, two dense decode steps, one batched two-token step."""
    t = cfg.thinker.text
    seqs = [torch.randint(0, t.vocab_size, (n,), generator=gen(7 + n)) for n in (8, 12)]
    cache = SlotKVCache(t.num_layers, 2, 16, t.num_kv_heads, t.head_dim, torch.float32, CPU)
    slots = [cache.allocate("a"), cache.allocate("b")]
    with torch.no_grad():
        want = [ref.thinker.lm_head(ref.thinker.model.language_model(input_ids=s[None], use_cache=False)
                                    .last_hidden_state)[0] for s in seqs]
        prompt = [4, 8]
        for b, s in enumerate(seqs):
            n = prompt[b]
            step = SlotStep.build([slots[b]], [0], n, CPU)
            logits, _ = thinker(thinker.model.embed_tokens(s[None, :n]), torch.arange(n)[None], cache.bind(step))
            close(logits[0], want[b][n - 1])
        for i in range(2):  # the engine's dense decode over slots 0..n-1
            start = torch.tensor([p + i for p in prompt])
            tok = torch.stack([s[p:p + 1] for s, p in zip(seqs, start.tolist())])
            view = cache.decode_view(2, int(start.max()) + 1, start)
            logits, _ = thinker(thinker.model.embed_tokens(tok), start[:, None], view)
            for b in range(2):
                close(logits[b], want[b][int(start[b])])
        start = [p + 2 for p in prompt]  # and a batched two-token step
        tok = torch.stack([s[p:p + 2] for s, p in zip(seqs, start)])
        step = SlotStep.build(slots, start, 2, CPU)
        h, _ = thinker.model(thinker.model.embed_tokens(tok), torch.tensor(start)[:, None] + torch.arange(2),
                             cache.bind(step))
        logits = thinker.lm_head(h)
        for b in range(2):
            close(logits[b], want[b][start[b]:start[b] + 2])


@pytest.mark.parametrize("frames", [37, 100, 230, 1000])
def test_audio_encoder(ref, thinker, cfg, frames):
    feats = torch.randn(cfg.thinker.audio.num_mel_bins, frames, generator=gen(frames))
    with torch.no_grad():
        want = ref.thinker.model.audio_tower(feats, feature_lens=torch.tensor([frames])).last_hidden_state
        got = thinker.audio_tower(feats)
    assert got.shape[0] == audio_output_length(frames, cfg.thinker.audio.n_window)
    close(got, want)


@pytest.mark.parametrize("lens", [(230, 61), (130, 90)])
def test_audio_embeddings_of_two_clips_in_one_prompt(ref, thinker, cfg, lens):
    """ThinkerModel.embed places each clip's tokens on its placeholders, as transformers does for a batch
    of clips given with a feature attention mask: a clip shorter than a chunk is padded to the longest
    chunk of the prompt (90 frames: its last convolution windows read that padding)."""
    a = cfg.thinker.audio
    feats = [torch.randn(a.num_mel_bins, n, generator=gen(20 + n)) for n in lens]
    counts = [audio_output_length(n, a.n_window) for n in lens]
    tok = cfg.thinker.tokens
    ids = torch.tensor([5, tok.audio_start] + [tok.audio_token] * counts[0] + [tok.audio_end, 7, tok.audio_start]
                       + [tok.audio_token] * counts[1] + [tok.audio_end, 9])
    padded = torch.zeros(2, a.num_mel_bins, max(lens))
    mask = torch.zeros(2, max(lens), dtype=torch.long)
    for i, f in enumerate(feats):
        padded[i, :, :f.shape[1]] = f
        mask[i, :f.shape[1]] = 1
    with torch.no_grad():
        want_audio = ref.thinker.model.get_audio_features(padded, feature_attention_mask=mask).last_hidden_state
        got = thinker.embed(ids, feats)
        plain = thinker.model.embed_tokens(ids)
    is_audio = ids == tok.audio_token
    close(got[is_audio], want_audio)
    assert torch.equal(got[~is_audio], plain[~is_audio])


# ---------------------------------------------------------------------------------------------- talker


def test_talker_decoder_logits_on_random_embeddings(ref, talker, cfg):
    t = cfg.talker.text
    x = torch.randn(2, 15, t.hidden_size, generator=gen(8))
    pos = torch.arange(15).expand(2, 15)
    with torch.no_grad():
        out = ref.talker.model(inputs_embeds=x, position_ids=pos, use_cache=False)
        want = ref.talker.codec_head(out.last_hidden_state)
        h, _ = talker.model(x, pos, GrowingCache())
        close(talker.codec_head(h), want)
        logits, last = talker(x, pos, GrowingCache())
        close(logits, want[:, -1])
        close(last, out.last_hidden_state[:, -1])


def test_talker_resize_projections(ref, talker, cfg):
    x = torch.randn(4, cfg.talker.thinker_hidden_size, generator=gen(9))
    with torch.no_grad():
        close(talker.text_projection(x), ref.talker.text_projection(x))
        close(talker.hidden_projection(x), ref.talker.hidden_projection(x))


def test_code_predictor_greedy_equals_generate(ref, talker, cfg):
    h = cfg.talker.text.hidden_size
    g = gen(11)
    hidden = torch.randn(3, h, generator=g)
    code0 = torch.randint(0, 2048, (3,), generator=g)
    with torch.no_grad():
        code0_embed = talker.model.codec_embedding(code0)
        close(code0_embed, ref.talker.model.codec_embedding(code0), atol=0)
        codes, embeds = talker.code_predictor.predict(hidden, code0_embed, lambda logits, group: logits.argmax(-1))
        want = []
        for b in range(3):  # one at a time, as transformers' talker calls it
            res = ref.talker.code_predictor.generate(
                inputs_embeds=torch.stack((hidden[b], code0_embed[b]))[None], max_new_tokens=cfg.talker.num_code_groups - 1,
                do_sample=False, top_k=None, top_p=None)
            want.append(res[0])
    want = torch.stack(want)
    assert codes.shape == (3, cfg.talker.num_code_groups - 1)
    assert torch.equal(codes, want)
    for g_i, emb in enumerate(embeds):
        assert torch.equal(emb, talker.code_predictor.model.codec_embedding[g_i](codes[:, g_i]))


# ---------------------------------------------------------------------------------------------- code2wav


def _stream(model: Code2WavModel, store: StreamStore, codes: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Decode codes [B, Q, F] chunk by chunk (all B utterances together); returns [B, samples]."""
    slots = [store.allocate() for _ in range(codes.shape[0])]
    slot_t = torch.tensor(slots)
    out, at = [], 0
    for n in sizes:
        start = torch.full((codes.shape[0],), at, dtype=torch.long)
        out.append(model.decode(codes[:, :, at:at + n], slot_t, start, store, first=at == 0))
        at += n
    assert at == codes.shape[2]
    for s in slots:
        store.release(s)
    return torch.cat(out, dim=1)


def _codes(cfg, batch: int, frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, cfg.code2wav.codebook_size, (batch, cfg.code2wav.num_quantizers, frames), generator=gen(seed))


def _window_cache(model: Code2WavModel, slots: int) -> StreamStore:
    return StreamStore(model, slots, torch.float32, CPU)


def test_code2wav_full_forward_shape(ref, code2wav, cfg):
    codes = _codes(cfg, 1, 9, 30)
    with torch.no_grad():
        want = ref.code2wav(codes)[:, 0]
        got = _stream(code2wav, _window_cache(code2wav, 1), codes, [9])
    assert got.shape[1] == cfg.code2wav.samples_per_frame * 9 - 555
    close(got, want)


@pytest.mark.parametrize("sizes", [
    [1] * 80,                                  # past the 72-frame window, one frame at a time
    [3] * 27,                                  # 81 frames in threes
    [1, 2, 5, 75, 3, 1, 4],                    # mixed, one chunk larger than the window
], ids=["ones", "threes", "mixed"])
def test_code2wav_streaming_equals_full_forward(ref, code2wav, cfg, sizes):
    assert cfg.code2wav.transformer.sliding_window == 72
    frames = sum(sizes)
    codes = _codes(cfg, 1, frames, 31 + len(sizes))
    with torch.no_grad():
        want = ref.code2wav(codes)[:, 0]
        got = _stream(code2wav, _window_cache(code2wav, 2), codes, sizes)
    assert got.shape[1] == cfg.code2wav.samples_per_frame * frames - 555
    close(got, want)


def test_code2wav_two_utterances_batched(ref, code2wav, cfg):
    sizes = [2, 1, 7, 70, 4]  # 84 frames
    codes = _codes(cfg, 2, sum(sizes), 40)
    cache = _window_cache(code2wav, 3)
    cache.allocate()  # slot 0 taken: the utterances live in slots 1 and 2
    with torch.no_grad():
        got = _stream(code2wav, cache, codes, sizes)
        for b in range(2):
            close(got[b:b + 1], ref.code2wav(codes[b:b + 1])[:, 0])


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
def test_grouped_gemm_experts_equal_per_expert_loop():
    """The serving MoE path (sorted pairs, offsets by searchsorted, two grouped GEMMs; graph-safe) against
    the per-expert loop, in bfloat16 on the CPU: empty experts, one expert taking every pair, one token."""
    from voxpipe.services.runtime.layers import Experts

    torch.manual_seed(7)
    experts = Experts(16, 64, 32).to(torch.bfloat16)
    for p in experts.parameters():
        p.data.normal_(0, 0.1)
    cases = {"random": torch.randint(0, 16, (9, 4)), "one token": torch.tensor([[3, 15, 0, 7]]),
             "all pairs on expert 5": torch.full((6, 1), 5), "high experts only": torch.randint(12, 16, (7, 3))}
    with torch.inference_mode():
        for name, idx in cases.items():
            x = torch.randn(idx.shape[0], 64, dtype=torch.bfloat16)
            w = torch.rand(idx.shape, dtype=torch.bfloat16)
            got, want = experts.grouped(x, idx, w), experts.looped(x, idx, w)
            err = (got.float() - want.float()).abs().max()
            assert err <= 0.02 * want.float().abs().max() + 1e-3, (name, float(err))


def test_fused_projections_equal_separate():
    """fuse_projections (one GEMM for q/k/v and for gate/up, as the servers run on CUDA) computes the
    same decoder output as the checkpoint's separate projections."""
    import copy

    from voxpipe.services.runtime.config import DecoderConfig, RopeConfig
    from voxpipe.services.runtime.layers import DecoderStack, fuse_projections

    cfg = DecoderConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                        vocab_size=100, rms_norm_eps=1e-6, rope=RopeConfig(theta=10000.0), qk_norm=True,
                        num_experts=8, experts_per_token=2, moe_intermediate_size=32, shared_expert_size=48,
                        norm_topk_prob=True)
    torch.manual_seed(8)
    stack = DecoderStack(cfg).eval()
    for p in stack.parameters():
        p.data.normal_(0, 0.1)
    fused = copy.deepcopy(stack)
    assert fuse_projections(fused) == 4          # 2 attentions + 2 shared experts
    x = torch.randn(2, 5, 64)
    pos = torch.arange(5)[None].expand(2, 5)
    with torch.inference_mode():
        want, _ = stack(x, pos, GrowingCache())
        got, _ = fused(x, pos, GrowingCache())
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)
    assert all(getattr(m, "q_proj", 0) is None for m in fused.modules() if hasattr(m, "qkv_proj"))
