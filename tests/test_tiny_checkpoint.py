"""The tiny Qwen3-Omni checkpoint generator (voxpipe.tiny) and the transformers reference oracle."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors import safe_open

try:
    from oracle import audio_features, num_audio_tokens, reference_generate
except ImportError:  # tests/ imported as a package
    from tests.oracle import audio_features, num_audio_tokens, reference_generate

SAMPLES_PER_FRAME = 1920
DECODE_TAIL = 555  # samples a causal code2wav forward of F frames gives less than 1920 * F


def _files(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def _tensor_shapes(model_dir):
    shapes = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def config(tiny_model_dir):
    return json.loads((tiny_model_dir / "config.json").read_text())


def _prompt_ids(tokenizer, messages):
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return [int(i) for i in ids]


# (a) determinism ------------------------------------------------------------------------------------


def test_same_seed_gives_identical_files(tmp_path, tiny_model_dir):
    from voxpipe.tiny import make_tiny

    first = _files(make_tiny(tmp_path / "a", seed=0))
    second = _files(make_tiny(tmp_path / "b", seed=0))
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
            "preprocessor_config.json"} <= set(first)
    assert first.keys() == second.keys()
    for name in first:
        assert first[name] == second[name], name
    # the session fixture (same seed, built earlier in this process) too
    assert _files(tiny_model_dir) == first
    # a small checkpoint
    assert len(first["model.safetensors"]) < 50 * 1024 * 1024


def test_same_seed_across_processes(tmp_path, tiny_model_dir):
    # the BPE trainer and the weights must not depend on the process (hash seeds, allocator state)
    out = tmp_path / "sub"
    subprocess.run(
        [sys.executable, "-c", "import sys; from voxpipe.tiny import main; sys.exit(main(sys.argv[1:]))",
         str(out), "--seed", "0"],
        check=True,
        capture_output=True,
    )
    assert _files(out) == _files(tiny_model_dir)


# (b) on-disk layout ---------------------------------------------------------------------------------


def test_per_expert_tensor_names(tiny_model_dir, config):
    shapes = _tensor_shapes(tiny_model_dir)
    names = set(shapes)
    assert all(n.startswith(("thinker.", "talker.", "code2wav.")) for n in names)
    assert not [n for n in names if "gate_up_proj" in n]
    assert not [n for n in names if n.endswith(("experts.down_proj", "experts.gate_proj", "experts.up_proj"))]
    assert not [n for n in names if "language_model" in n]

    expected = {
        # thinker
        "thinker.model.embed_tokens.weight": (448, 64),
        "thinker.lm_head.weight": (448, 64),
        "thinker.model.norm.weight": (64,),
        "thinker.model.layers.0.self_attn.q_proj.weight": (64, 64),
        "thinker.model.layers.0.self_attn.k_proj.weight": (32, 64),
        "thinker.model.layers.0.self_attn.q_norm.weight": (16,),
        "thinker.model.layers.0.mlp.gate.weight": (8, 64),
        "thinker.model.layers.0.mlp.experts.3.gate_proj.weight": (32, 64),
        "thinker.model.layers.3.mlp.experts.7.up_proj.weight": (32, 64),
        "thinker.model.layers.3.mlp.experts.7.down_proj.weight": (64, 32),
        "thinker.audio_tower.conv2d1.weight": (8, 1, 3, 3),
        "thinker.audio_tower.conv_out.weight": (32, 128),
        "thinker.audio_tower.layers.1.fc1.weight": (64, 32),
        "thinker.audio_tower.proj2.weight": (64, 32),
        "thinker.visual.patch_embed.proj.weight": (32, 3, 2, 16, 16),
        "thinker.visual.merger_list.2.mlp.0.weight": (128, 128),
        # talker
        "talker.model.codec_embedding.weight": (3072, 32),
        "talker.codec_head.weight": (3072, 32),
        "talker.model.layers.0.self_attn.q_proj.weight": (32, 32),
        "talker.model.layers.0.self_attn.k_proj.weight": (16, 32),
        "talker.model.layers.0.mlp.gate.weight": (4, 32),
        "talker.model.layers.0.mlp.experts.0.down_proj.weight": (32, 16),
        "talker.model.layers.1.mlp.experts.3.gate_proj.weight": (16, 32),
        "talker.model.layers.0.mlp.shared_expert.up_proj.weight": (32, 32),
        "talker.model.layers.0.mlp.shared_expert_gate.weight": (1, 32),
        "talker.text_projection.linear_fc1.weight": (64, 64),
        "talker.hidden_projection.linear_fc2.bias": (32,),
        "talker.code_predictor.model.codec_embedding.14.weight": (2048, 32),
        "talker.code_predictor.lm_head.14.weight": (2048, 32),
        "talker.code_predictor.model.layers.1.mlp.down_proj.weight": (32, 64),
        # code2wav
        "code2wav.code_embedding.weight": (16 * 2048, 32),
        "code2wav.pre_transformer.layers.1.self_attn_layer_scale.scale": (32,),
        "code2wav.upsample.1.1.gamma": (32,),
        "code2wav.decoder.6.conv.weight": (1, 2, 7),
    }
    for name, shape in expected.items():
        assert shapes.get(name) == shape, (name, shapes.get(name))

    experts = [n for n in names if ".mlp.experts." in n]
    assert len([n for n in experts if n.startswith("thinker.")]) == 4 * 8 * 3
    assert len([n for n in experts if n.startswith("talker.")]) == 2 * 4 * 3
    assert "talker.code_predictor.model.codec_embedding.15.weight" not in names  # 15 tables for 16 groups


def test_config_structure(config):
    text = config["thinker_config"]["text_config"]
    assert text["head_dim"] == 16 and text["num_experts"] == 8 and text["num_experts_per_tok"] == 2
    assert text["rope_parameters"]["mrope_section"] == [4, 2, 2]
    assert text["rope_parameters"]["interleaved"] is True
    assert text["vocab_size"] % 64 == 0
    talker = config["talker_config"]
    assert talker["accept_hidden_layer"] < text["num_hidden_layers"]
    assert talker["num_code_groups"] == 16
    assert talker["text_config"]["shared_expert_intermediate_size"] == 32
    assert (talker["codec_pad_id"], talker["codec_bos_id"], talker["codec_eos_token_id"]) == (2148, 2149, 2150)
    assert talker["speaker_id"] == {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
    c2w = config["code2wav_config"]
    assert int(np.prod(c2w["upsample_rates"] + c2w["upsampling_ratios"])) == SAMPLES_PER_FRAME
    assert config["enable_audio_output"] is True


# (c) tokenizer ---------------------------------------------------------------------------------------


def test_tokenizer_and_chat_template(tokenizer, config):
    assert 300 <= len(tokenizer) <= 450
    assert config["thinker_config"]["text_config"]["vocab_size"] == -(-len(tokenizer) // 64) * 64
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello there"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    text = tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "audio", "audio": "x.wav"}, {"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": ""}}]},
        ],
        add_generation_prompt=False,
        tokenize=False,
    )
    assert text == (
        "<|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\n<|audio_start|><|audio_pad|><|audio_end|>hi<|im_end|>\n"
        "<|im_start|>assistant\nok<|im_end|>\n"
        "<|im_start|>user\n<|audio_start|><|audio_pad|><|audio_end|><|im_end|>\n"
    )

    for role, key in (("user", "user_token_id"), ("assistant", "assistant_token_id"), ("system", "system_token_id")):
        ids = tokenizer.encode(f"<|im_start|>{role}\n", add_special_tokens=False)
        assert len(ids) == 3, (role, ids)
        assert ids[0] == config["im_start_token_id"]
        assert ids[1] == config[key]
        assert tokenizer.decode([ids[2]]) == "\n"
    assert config["thinker_config"]["user_token_id"] == config["user_token_id"]

    special = {
        "<|im_end|>": config["im_end_token_id"],
        "<|tts_pad|>": config["tts_pad_token_id"],
        "<|tts_bos|>": config["tts_bos_token_id"],
        "<|tts_eos|>": config["tts_eos_token_id"],
        "<|audio_start|>": config["thinker_config"]["audio_start_token_id"],
        "<|audio_end|>": config["thinker_config"]["audio_end_token_id"],
        "<|audio_pad|>": config["thinker_config"]["audio_token_id"],
        "<|image_pad|>": config["thinker_config"]["image_token_id"],
        "<|video_pad|>": config["thinker_config"]["video_token_id"],
        "<|vision_start|>": config["thinker_config"]["vision_start_token_id"],
    }
    for token, token_id in special.items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id, token
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id]
    assert config["talker_config"]["audio_token_id"] == config["thinker_config"]["audio_token_id"]


def test_feature_extractor_config(tiny_model_dir):
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor.from_pretrained(str(tiny_model_dir))
    assert (fe.feature_size, fe.sampling_rate, fe.hop_length, fe.n_fft, fe.chunk_length) == (128, 16000, 160, 400, 30)
    assert fe.return_attention_mask is True


# (d), (e) reference generation --------------------------------------------------------------------------


def _check_reference(ref, max_tokens, frames):
    assert 1 <= len(ref.text_ids) <= max_tokens
    assert all(isinstance(t, int) for t in ref.text_ids)
    assert ref.codes.dtype == torch.int64
    assert tuple(ref.codes.shape) == (frames, 16)
    assert int(ref.codes.min()) >= 0 and int(ref.codes.max()) < 2048
    assert ref.wav.dtype == torch.float32 and ref.wav.dim() == 1
    assert ref.wav.numel() == SAMPLES_PER_FRAME * frames - DECODE_TAIL
    peak = float(ref.wav.abs().max())
    assert 0.01 < peak <= 1.0


def test_reference_generate_text_prompt(tiny_model_dir, tokenizer):
    ids = _prompt_ids(tokenizer, [{"role": "user", "content": "hello there"}])
    ref = reference_generate(tiny_model_dir, ids, max_tokens=6, max_frames=8, min_frames=8)
    if len(ref.text_ids) < 6:
        assert ref.text_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    _check_reference(ref, max_tokens=6, frames=7)

    # deterministic (greedy) and cached
    again = reference_generate(tiny_model_dir, ids, max_tokens=6, max_frames=8, min_frames=8)
    assert again.text_ids == ref.text_ids
    assert torch.equal(again.codes, ref.codes)
    assert torch.equal(again.wav, ref.wav)


def test_reference_generate_audio_prompt(tiny_model_dir, tokenizer):
    sr = 16000
    wav = np.sin(2 * np.pi * 440.0 * np.arange(sr) / sr).astype(np.float32)
    feats = audio_features(wav)
    assert feats.dtype == torch.float32 and tuple(feats.shape) == (128, 100)
    n_pad = num_audio_tokens(feats.shape[1])
    assert n_pad == 13

    ids = _prompt_ids(tokenizer, [{"role": "user", "content": [{"type": "audio", "audio": "sine.wav"}]}])
    audio_pad = tokenizer.convert_tokens_to_ids("<|audio_pad|>")
    assert ids.count(audio_pad) == 1
    at = ids.index(audio_pad)
    ids = ids[:at] + [audio_pad] * n_pad + ids[at + 1 :]

    ref = reference_generate(
        tiny_model_dir, ids, input_features=feats.unsqueeze(0), max_tokens=6, max_frames=8, min_frames=8
    )
    _check_reference(ref, max_tokens=6, frames=7)

    # the audio content matters (the tiny model is not blind to its input)
    other = audio_features(np.sin(2 * np.pi * 880.0 * np.arange(sr) / sr).astype(np.float32))
    ref2 = reference_generate(
        tiny_model_dir, ids, input_features=other.unsqueeze(0), max_tokens=6, max_frames=8, min_frames=8
    )
    assert ref2.text_ids != ref.text_ids or not torch.equal(ref2.codes, ref.codes)
