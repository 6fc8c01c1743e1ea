"""Tiny random-weight Qwen3-Omni checkpoint generator.

``make_tiny(out_dir, seed)`` writes a checkpoint folder in the released on-disk format of
Qwen3-Omni-30B-A3B-Instruct (``config.json``, ``generation_config.json``, ``model.safetensors`` with
one tensor per expert, ``tokenizer.json`` / ``tokenizer_config.json`` with a ChatML template and
``preprocessor_config.json`` for the Whisper feature extractor), but with every width shrunk so that
the whole thing is a few MB and runs in seconds on a CPU.  The structure of the real model is kept:
16 code groups, 1920 samples per codec frame at 24 kHz, MoE thinker and talker (with a gated shared
expert), 3-D interleaved MRoPE, the released codec special ids and speaker ids.

Everything is built offline (no downloads): the tokenizer is a small byte-level BPE trained with the
``tokenizers`` library on a built-in corpus.  The same seed gives byte-identical safetensors.

Weights: transformers' own init (N(0, 0.02) matrices) plus four deliberate changes, all deterministic:
the tensors transformers leaves uninitialised (talker experts; also the all-zero talker router) get
N(0, 0.02); the matrices of the audio encoder, thinker LM and talker are rescaled to LeCun normal so
that every stage actually depends on its inputs (see ``_fan_in_scale``); code2wav's last conv is
scaled by a power of two so decoded audio peaks around 0.3-0.5; the thinker lm_head rows of the
padding ids (beyond the tokenizer) are zeroed so greedy decoding only emits real tokens.

CLI: ``voxpipe make-tiny DIR [--seed N]`` (see :func:`add_arguments` / :func:`run`).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Sequence

__all__ = [
    "SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "build_tokenizer",
    "build_config",
    "make_tiny",
    "add_arguments",
    "run",
    "main",
]

# Special tokens, in the order they are appended after the BPE vocabulary (the released Qwen
# tokenizer also keeps its special tokens after the ordinary ones).
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|tts_pad|>",
    "<|tts_bos|>",
    "<|tts_eos|>",
)

# Number of ordinary (BPE) tokens: 256 byte tokens + merges.  Plus the 13 special tokens this gives
# a 400-token tokenizer and a 448-row embedding table (rounded up to a multiple of 64).
_BPE_VOCAB_SIZE = 387

# Qwen2-style pre-tokenisation split (the released Qwen tokenizer uses this regex, then byte-level).
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML.  Each message renders as `<|im_start|>{role}\n{content}<|im_end|>\n`; content is a string or
# a list of parts.  An audio part renders ONE `<|audio_pad|>` (the caller expands it to N pads).
# Tools render as the released Qwen3-Omni template renders them (Hermes style): with `tools`, a
# system turn (the first system message's text and a blank line, then) the functions between
# <tools> and </tools>, one JSON a line; an assistant turn's `tool_calls` as
# `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>` after its text (a newline between);
# consecutive `tool` turns as `<tool_response>` blocks in one user turn.
CHAT_TEMPLATE = (
    "{%- macro content_text(content) -%}"
    "{%- if content is string -%}"
    "{{- content -}}"
    "{%- elif content -%}"
    "{%- for part in content -%}"
    "{%- if part['type'] == 'text' -%}"
    "{{- part['text'] -}}"
    "{%- elif part['type'] == 'audio' or part['type'] == 'input_audio' -%}"
    "{{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}"
    "{%- elif part['type'] == 'image' or part['type'] == 'image_url' -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{- content_text(messages[0]['content']) + '\\n\\n' -}}"
    "{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}"
    "{{- '\\n' + (tool | tojson) -}}"
    "{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if tools and loop.first and message['role'] == 'system' -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}"
    "{{- '<|im_start|>user' -}}"
    "{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + content_text(message['content']) + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content_text(message['content']) -}}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- if not loop.first or message['content'] -%}"
    "{{- '\\n' -}}"
    "{%- endif -%}"
    "{%- set f = call['function'] if call['function'] is defined else call -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' -}}"
    "{%- if f['arguments'] is string -%}"
    "{{- f['arguments'] -}}"
    "{%- else -%}"
    "{{- f['arguments'] | tojson -}}"
    "{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# Built-in training corpus for the BPE (deterministic; the role names and "\n" dominate so that they
# become single tokens).
_CORPUS_LINES: tuple[str, ...] = (
    "system\nYou are a helpful voice assistant. Answer briefly and speak clearly.",
    "user\nhello there, how are you today?",
    "assistant\nHello! I am fine, thank you. How can I help you today?",
    "user\nWhat is the weather like in the city this morning?",
    "assistant\nIt is sunny and warm, with a light wind from the west.",
    "user\nCan you tell me a short story about a cat and a dog?",
    "assistant\nOnce upon a time there was a cat who lived with a dog in a small house.",
    "user\nPlease read the numbers 1 2 3 4 5 6 7 8 9 0 out loud.",
    "assistant\nSure: one, two, three, four, five, six, seven, eight, nine, zero.",
    "system\nThe user is speaking; listen to the audio and reply with speech.",
    "user\nThanks, that was great. Good night!",
    "assistant\nYou are welcome. Good night and sleep well!",
)


def _corpus() -> list[str]:
    lines: list[str] = []
    for rep in range(40):
        for line in _CORPUS_LINES:
            lines.append(line)
        # Extra weight on the role headers as they appear after <|im_start|>.
        lines.extend(["user\n", "assistant\n", "system\n"] * 4)
    return lines


def build_tokenizer():
    """Return a ``PreTrainedTokenizerFast`` (byte-level BPE, ~400 tokens, ChatML template)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("<|im_end|>", "<|endoftext|>")],
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    # Sanity: role names and "\n" are single tokens after <|im_start|>.
    for role in ("user", "assistant", "system"):
        ids = fast.encode(f"<|im_start|>{role}\n", add_special_tokens=False)
        if len(ids) != 3:
            raise RuntimeError(f"tiny tokenizer: {role!r} header encodes to {ids}, expected 3 tokens")
    return fast


def _token_id(tokenizer, token: str) -> int:
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        raise RuntimeError(f"{token!r} is not a single token: {ids}")
    return int(ids[0])


def build_config(tokenizer):
    """The tiny ``Qwen3OmniMoeConfig`` (same structure as the released model, tiny widths)."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeAudioEncoderConfig,
        Qwen3OmniMoeCode2WavConfig,
        Qwen3OmniMoeConfig,
        Qwen3OmniMoeTalkerCodePredictorConfig,
        Qwen3OmniMoeTalkerConfig,
        Qwen3OmniMoeTalkerTextConfig,
        Qwen3OmniMoeTextConfig,
        Qwen3OmniMoeThinkerConfig,
        Qwen3OmniMoeVisionEncoderConfig,
    )

    tid = lambda t: _token_id(tokenizer, t)  # noqa: E731
    vocab_size = int(math.ceil(len(tokenizer) / 64) * 64)

    ids = {
        "im_start": tid("<|im_start|>"),
        "im_end": tid("<|im_end|>"),
        "system": tid("system"),
        "user": tid("user"),
        "assistant": tid("assistant"),
        "tts_pad": tid("<|tts_pad|>"),
        "tts_bos": tid("<|tts_bos|>"),
        "tts_eos": tid("<|tts_eos|>"),
        "audio_start": tid("<|audio_start|>"),
        "audio_end": tid("<|audio_end|>"),
        "audio": tid("<|audio_pad|>"),
        "image": tid("<|image_pad|>"),
        "video": tid("<|video_pad|>"),
        "vision_start": tid("<|vision_start|>"),
        "vision_end": tid("<|vision_end|>"),
    }

    text_config = Qwen3OmniMoeTextConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=32,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=0,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=65536,
        rms_norm_eps=1e-6,
        use_qk_norm=True,
        attention_bias=False,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "interleaved": True,
            "mrope_interleaved": True,
            "mrope_section": [4, 2, 2],
        },
    )
    audio_config = Qwen3OmniMoeAudioEncoderConfig(
        num_mel_bins=128,
        encoder_layers=2,
        encoder_attention_heads=2,
        encoder_ffn_dim=64,
        d_model=32,
        output_dim=64,
        activation_function="gelu",
        max_source_positions=1500,
        n_window=50,
        n_window_infer=800,
        conv_chunksize=500,
        downsample_hidden_size=8,
        scale_embedding=False,
    )
    vision_config = Qwen3OmniMoeVisionEncoderConfig(
        depth=3,
        hidden_size=32,
        hidden_act="gelu_pytorch_tanh",
        intermediate_size=64,
        num_heads=2,
        in_channels=3,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=64,
        num_position_embeddings=2304,
        deepstack_visual_indexes=[0, 1, 2],
        image_size=768,
        tokens_per_second=2,
        apply_vit_abs_pos_embed=True,
    )
    thinker_config = Qwen3OmniMoeThinkerConfig(
        text_config=text_config,
        audio_config=audio_config,
        vision_config=vision_config,
        audio_start_token_id=ids["audio_start"],
        audio_end_token_id=ids["audio_end"],
        audio_token_id=ids["audio"],
        image_token_id=ids["image"],
        video_token_id=ids["video"],
        vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"],
        user_token_id=ids["user"],
        position_id_per_seconds=13,
        seconds_per_chunk=2,
        tie_word_embeddings=False,
    )

    talker_text_config = Qwen3OmniMoeTalkerTextConfig(
        vocab_size=3072,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        hidden_act="silu",
        num_local_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=65536,
        rms_norm_eps=1e-6,
        attention_bias=False,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "interleaved": True,
            "mrope_section": [4, 2, 2],
        },
    )
    code_predictor_config = Qwen3OmniMoeTalkerCodePredictorConfig(
        vocab_size=2048,
        num_code_groups=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        hidden_act="silu",
        layer_types=["full_attention", "full_attention"],
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        attention_bias=False,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    talker_config = Qwen3OmniMoeTalkerConfig(
        text_config=talker_text_config,
        code_predictor_config=code_predictor_config,
        accept_hidden_layer=2,
        thinker_hidden_size=64,
        num_code_groups=16,
        audio_start_token_id=ids["audio_start"],
        audio_end_token_id=ids["audio_end"],
        audio_token_id=ids["audio"],
        image_token_id=ids["image"],
        video_token_id=ids["video"],
        vision_start_token_id=ids["vision_start"],
        codec_bos_id=2149,
        codec_eos_token_id=2150,
        codec_pad_id=2148,
        codec_nothink_id=2155,
        codec_think_bos_id=2156,
        codec_think_eos_id=2157,
        position_id_per_seconds=13,
        seconds_per_chunk=2,
        spatial_merge_size=2,
        speaker_id={"aiden": 2303, "chelsie": 2301, "ethan": 2302},
        tie_word_embeddings=False,
    )
    code2wav_config = Qwen3OmniMoeCode2WavConfig(
        codebook_size=2048,
        num_quantizers=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        hidden_act="silu",
        sliding_window=72,
        max_position_embeddings=8000,
        rms_norm_eps=1e-5,
        layer_scale_initial_scale=0.01,
        decoder_dim=32,
        upsample_rates=[8, 5, 4, 3],
        upsampling_ratios=[2, 2],
        attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    config = Qwen3OmniMoeConfig(
        thinker_config=thinker_config,
        talker_config=talker_config,
        code2wav_config=code2wav_config,
        enable_audio_output=True,
        im_start_token_id=ids["im_start"],
        im_end_token_id=ids["im_end"],
        system_token_id=ids["system"],
        user_token_id=ids["user"],
        assistant_token_id=ids["assistant"],
        tts_pad_token_id=ids["tts_pad"],
        tts_bos_token_id=ids["tts_bos"],
        tts_eos_token_id=ids["tts_eos"],
    )
    config.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    return config


# ---------------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------------

_INIT_STD = 0.02  # initializer_range of every sub-config
_VOCODER_TARGET_PEAK = 0.5  # peak of a decoded random utterance (before the final clamp to [-1, 1])


def _build_model(config, seed: int):
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration

    torch.manual_seed(seed)
    return Qwen3OmniMoeForConditionalGeneration._from_config(config, dtype=torch.float32)


def _init_left_out(model, reference, seed: int) -> list[str]:
    """Initialise, with N(0, 0.02), every parameter transformers left uninitialised.

    In transformers 5.24 the talker's expert tensors are ``torch.empty`` (its ``_init_weights``
    only knows the thinker's expert class) and the talker's router weight stays all zeros.  Rather
    than rely on that list, a parameter is re-initialised when it differs between two builds with
    the same seed (uninitialised memory), is not finite, or is an all-zero matrix (ndim >= 2).
    1-D zeros (biases, SnakeBeta log-alpha/beta) are intended and kept.
    """
    import torch

    ref = dict(reference.named_parameters())
    gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + 17)
    fixed: list[str] = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.is_floating_point():
                continue
            other = ref[name]
            suspicious = (
                not bool(torch.isfinite(param).all())
                or not torch.equal(param, other)
                or (param.ndim >= 2 and not bool(param.any()))
            )
            if suspicious:
                values = torch.randn(param.shape, generator=gen, dtype=torch.float32) * _INIT_STD
                param.copy_(values.to(param.dtype))
                fixed.append(name)
    return fixed


def _scale_vocoder(model, seed: int) -> float:
    """Scale code2wav's last conv so a decoded random utterance peaks near 0.5.

    With N(0, 0.02) weights, layer scale 0.01 and ConvNeXt gamma 1e-6 the vocoder output is ~1e-7
    (silence).  The last conv is linear with a zero bias, so scaling its weight scales the output;
    the factor is rounded to a power of two (exact in float32, robust to 1-ulp differences in the
    measured peak across machines/thread counts).
    """
    import torch

    code2wav = model.code2wav
    last = code2wav.decoder[-1].conv
    gen = torch.Generator().manual_seed(int(seed) + 2)
    cfg = code2wav.config
    codes = torch.randint(0, cfg.codebook_size, (1, cfg.num_quantizers, 25), generator=gen)
    captured: dict[str, torch.Tensor] = {}
    handle = code2wav.decoder[-1].register_forward_hook(lambda _m, _i, out: captured.__setitem__("wav", out))
    try:
        with torch.no_grad():
            code2wav(codes)
    finally:
        handle.remove()
    peak = float(captured["wav"].abs().max())
    if not math.isfinite(peak) or peak <= 0.0:
        raise RuntimeError(f"tiny code2wav produced a degenerate waveform (peak {peak})")
    factor = 2.0 ** round(math.log2(_VOCODER_TARGET_PEAK / peak))
    with torch.no_grad():
        last.weight.mul_(factor)
        if last.bias is not None:
            last.bias.mul_(factor)
    return factor


# Parameters rescaled from N(0, 0.02) to N(0, 1/fan_in) (see _fan_in_scale).
_FAN_IN_PREFIXES = (
    "thinker.model.audio_tower.",
    "thinker.model.language_model.",
    "thinker.lm_head.",
    "talker.",
)
_FAN_IN_EXCLUDE = ("embed_tokens", "codec_embedding")


def _fan_in_scale(model) -> list[str]:
    """Rescale the matrices of the audio encoder, thinker LM, talker and code predictor to std 1/sqrt(fan_in).

    With std 0.02 everywhere and widths of 32-64, every linear map shrinks its input ~10x, so the
    residual blocks barely change the residual stream: the talker's first frames were identical for
    any prompt and speaker, the thinker ignored the audio content (the audio encoder's output was its
    sinusoidal positions), and the projected text rows fed to the talker were 100x smaller than the
    codec embeddings.  Scaling the existing N(0, 0.02) draws by 1/(0.02 * sqrt(fan_in)) (LeCun normal)
    makes every stage depend on its inputs, so tests comparing a pipeline to the reference catch wrong
    rows, ids, speakers, positions or features.  Embedding tables (0.02), norms, biases, the vision
    encoder and code2wav are left as they are.
    """
    import torch

    scaled: list[str] = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim < 2 or not name.startswith(_FAN_IN_PREFIXES) or any(x in name for x in _FAN_IN_EXCLUDE):
                continue
            if param.ndim == 3 and "experts" in name:  # fused experts [E, out, in]
                fan_in = param.shape[-1]
            else:  # Linear [out, in] / Conv2d [out, in, kh, kw]
                fan_in = math.prod(param.shape[1:])
            param.mul_(1.0 / (_INIT_STD * math.sqrt(fan_in)))
            scaled.append(name)
    return scaled


def _mask_padding_rows(model, num_tokens: int) -> None:
    """Zero the thinker lm_head rows of the padding ids (``len(tokenizer)`` .. vocab_size - 1).

    The embedding table is rounded up to a multiple of 64 like the released one; a trained model never
    predicts the padding ids, a random one would.  A zero row gives logit 0, while the max over the
    real rows of a random model is positive (practically always), so greedy decoding only emits ids
    the tokenizer knows.
    """
    import torch

    with torch.no_grad():
        model.thinker.lm_head.weight[num_tokens:].zero_()


def _split_fused_experts(tensors: dict) -> dict:
    """Convert fused expert tensors (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj``
    [E, H, I]) to the released per-expert names (``mlp.experts.{e}.{gate,up,down}_proj.weight``)."""
    out = {}
    for name, tensor in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            inter = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = tensor[e, :inter].contiguous()
                out[f"{prefix}{e}.up_proj.weight"] = tensor[e, inter:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(tensor.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = tensor[e].contiguous()
        else:
            out[name] = tensor
    return dict(sorted(out.items()))


def _ensure_per_expert_layout(out_dir: Path) -> None:
    """Rewrite the safetensors files if transformers wrote fused expert tensors."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    for path in sorted(out_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
            if not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names):
                continue
            metadata = f.metadata() or {"format": "pt"}
            tensors = {n: f.get_tensor(n) for n in names}
        save_file(_split_fused_experts(tensors), str(path), metadata=metadata)
        index = path.parent / "model.safetensors.index.json"
        if index.exists():  # not expected for a ~16 MB checkpoint, but keep the index consistent
            data = json.loads(index.read_text())
            weight_map = {k: v for k, v in data["weight_map"].items() if v != path.name}
            with safe_open(str(path), framework="pt") as f:
                for n in f.keys():
                    weight_map[n] = path.name
            data["weight_map"] = dict(sorted(weight_map.items()))
            index.write_text(json.dumps(data, indent=2) + "\n")


def _save_feature_extractor(out_dir: Path) -> None:
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(
        feature_size=128,
        sampling_rate=16000,
        hop_length=160,
        n_fft=400,
        chunk_length=30,
        padding_value=0.0,
        return_attention_mask=True,
    )
    fe.save_pretrained(str(out_dir))


def make_tiny(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny random-weight Qwen3-Omni checkpoint to ``out_dir`` and return its path."""
    import torch
    from transformers.utils import logging as hf_logging

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    verbosity = hf_logging.get_verbosity()
    progress = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        tokenizer = build_tokenizer()
        config = build_config(tokenizer)

        with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state alone
            model = _build_model(config, seed)
            reference = _build_model(config, seed)
        # 1. N(0, 0.02) for what transformers left uninitialised (talker experts, talker router);
        # 2. LeCun-normal matrices in the audio encoder / thinker LM / talker so that outputs depend
        #    on inputs; 3. an audible vocoder; 4. no padding ids from the thinker's lm_head.
        _init_left_out(model, reference, seed)
        del reference
        _fan_in_scale(model)
        _scale_vocoder(model, seed)
        _mask_padding_rows(model, len(tokenizer))
        model.eval()

        for name, param in model.named_parameters():
            if not bool(torch.isfinite(param).all()):
                raise RuntimeError(f"tiny checkpoint: non-finite values in {name}")

        model.save_pretrained(str(out), safe_serialization=True)
        _ensure_per_expert_layout(out)
        tokenizer.save_pretrained(str(out), save_jinja_files=False)
        _save_feature_extractor(out)
    finally:
        hf_logging.set_verbosity(verbosity)
        if progress:
            hf_logging.enable_progress_bar()
    return out


# ---------------------------------------------------------------------------------------------------
# CLI: `voxpipe make-tiny DIR [--seed N]`
# ---------------------------------------------------------------------------------------------------


def model_or_tiny(model: str | None, prefix: str) -> Path:
    """A host-side bench's checkpoint: the folder given, else the tiny checkpoint (seed 0) made now in a
    new temporary folder named with `prefix`."""
    if model is not None:
        return Path(model)
    import tempfile

    return make_tiny(Path(tempfile.mkdtemp(prefix=prefix)), seed=0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="output folder (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (same seed -> identical weights)")


def run(args: argparse.Namespace) -> int:
    path = make_tiny(args.dir, seed=args.seed)
    size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    print(f"wrote tiny Qwen3-Omni checkpoint to {path} ({size / 1e6:.1f} MB, seed {args.seed})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="voxpipe make-tiny", description="Write a tiny random Qwen3-Omni checkpoint.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
