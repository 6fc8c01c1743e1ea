"""Reference ("oracle") outputs from transformers' own Qwen3-Omni implementation, for tests.

``reference_generate`` runs ``Qwen3OmniMoeForConditionalGeneration.generate(return_audio=True)``
greedily (thinker and talker, and with it the code predictor) and returns the generated text ids,
the codec codes that were fed to code2wav and the waveform.  Our staged pipeline (thinker → talker →
code2wav services) must reproduce these bit for bit on the tiny checkpoint.

Things to know (transformers 5.24):

* Frames: the talker step that runs the prefill has no residual codes, so ``talker_max_new_tokens=N``
  yields at most ``N - 1`` frames (``codes`` is ``[N - 1, 16]`` when EOS is never emitted), and the
  waveform of F frames decoded in one chunk has exactly ``1920 * F - 555`` samples.
* A random-weight talker may emit codec EOS (2150) at its very first step.  That gives zero frames and
  transformers' ``generate()`` then crashes (``torch.stack`` of an empty list).  Tests avoid it by
  passing ``min_frames`` (→ ``talker_min_new_tokens``, which masks EOS for that many steps); with
  ``min_frames == max_frames`` the frame count is exactly ``max_frames - 1``.
* Greedy is not "plain argmax" for the talker: ``generate()`` always applies its talker logits
  processors, i.e. ``repetition_penalty`` (default 1.05, applied to codebook-0 ids generated so far),
  ``suppress_tokens`` (ids 2048..3071 except EOS 2150) and, with ``min_frames``, the min-length EOS
  mask.  ``talker_repetition_penalty`` is exposed here so that tests can pin it.
* ``text_ids`` are the generated thinker ids only (the EOS id ``<|im_end|>`` included when the thinker
  stopped on it).  The thinker's EOS must be passed explicitly: transformers defaults it to the
  released id 151645, which is outside the tiny vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["Reference", "reference_generate", "load_reference_model", "audio_features", "num_audio_tokens",
           "ThinkerReference", "reference_thinker"]

_MODELS: dict[str, object] = {}

# WhisperFeatureExtractor settings of the released checkpoint (preprocessor_config.json).
_FEATURE_KWARGS = dict(
    feature_size=128,
    sampling_rate=16000,
    hop_length=160,
    n_fft=400,
    chunk_length=30,
    padding_value=0.0,
    return_attention_mask=True,
)
_FEATURE_EXTRACTOR = None


@dataclass
class Reference:
    text_ids: list[int]  # generated thinker ids only (prompt excluded)
    codes: torch.Tensor  # [frames, 16] int64, the codec codes fed to code2wav
    wav: torch.Tensor  # float32 1-D, 24 kHz


def load_reference_model(model_dir):
    """``Qwen3OmniMoeForConditionalGeneration`` in float32, cached per (resolved) model_dir."""
    key = str(Path(model_dir).resolve())
    model = _MODELS.get(key)
    if model is None:
        from transformers import Qwen3OmniMoeForConditionalGeneration

        model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(key, dtype=torch.float32)
        model.eval()
        _MODELS[key] = model
    return model


def reference_generate(
    model_dir,
    input_ids: list[int],
    *,
    input_features: torch.Tensor | None = None,
    speaker: str = "ethan",
    max_tokens: int | None = None,
    min_tokens: int = 0,
    max_frames: int,
    min_frames: int = 0,
    talker_repetition_penalty: float = 1.05,
    forced_ids: list[int] | None = None,
    talker_sampling: tuple[float, int, float, int] | None = None,
) -> Reference:
    """Greedy ``generate(return_audio=True)`` of transformers' reference implementation.

    ``input_features``: [1, 128, T] (or [128, T]) float32 Whisper features of the single audio clip in
    the prompt (the prompt must already hold the expanded ``<|audio_pad|>`` run, see
    :func:`num_audio_tokens`).  ``max_frames``/``min_frames`` are talker steps (``talker_max_new_tokens``
    / ``talker_min_new_tokens``): at most ``max_frames - 1`` frames come out.  ``forced_ids``: the
    thinker emits exactly these ids (a logits processor leaves only the next one possible; end them
    with ``<|im_end|>`` to stop there), as for a reply given verbatim (text to speech).
    ``talker_sampling``: (temperature, top_k, top_p, seed): the talker samples (and with it the code
    predictor, at top_k 50 / top_p 0.8) from torch's global generator seeded with ``seed`` right
    before ``generate``; with a greedy or forced thinker those are its only draws.
    """
    model = load_reference_model(model_dir)
    ids = torch.tensor([list(input_ids)], dtype=torch.long)
    if forced_ids is not None:
        max_tokens = len(forced_ids)
    if max_tokens is None:
        raise ValueError("max_tokens (or forced_ids) is required")
    kwargs = dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        return_audio=True,
        speaker=speaker,
        thinker_do_sample=False,
        thinker_max_new_tokens=max_tokens,
        thinker_min_new_tokens=min_tokens,
        thinker_eos_token_id=model.config.im_end_token_id,
        talker_do_sample=False,
        talker_max_new_tokens=max_frames,
        talker_min_new_tokens=min_frames,
        talker_repetition_penalty=talker_repetition_penalty,
    )
    if talker_sampling is not None:
        temperature, top_k, top_p, seed = talker_sampling
        kwargs.update(talker_do_sample=True, talker_temperature=temperature, talker_top_k=top_k, talker_top_p=top_p)
    if forced_ids is not None:
        from transformers import LogitsProcessorList

        kwargs["thinker_logits_processor"] = LogitsProcessorList([_ForceTokens(ids.shape[1], forced_ids)])
    if input_features is not None:
        feats = input_features.to(torch.float32)
        if feats.dim() == 2:
            feats = feats.unsqueeze(0)
        kwargs["input_features"] = feats
        kwargs["feature_attention_mask"] = torch.ones(feats.shape[0], feats.shape[-1], dtype=torch.long)

    captured: list[torch.Tensor] = []
    code2wav = model.code2wav
    original = code2wav.chunked_decode

    def capture(codes, *args, **kw):
        captured.append(codes.detach().clone())
        return original(codes, *args, **kw)

    code2wav.chunked_decode = capture  # instance attribute shadows the method for this call only
    try:
        with torch.no_grad():
            if talker_sampling is not None:
                torch.manual_seed(talker_sampling[3])
            sequences, wav = model.generate(**kwargs)
    finally:
        del code2wav.chunked_decode

    if len(captured) != 1:
        raise RuntimeError(f"expected one chunked_decode call, got {len(captured)}")
    codes = captured[0]  # [1, 16, frames]
    if isinstance(wav, list):  # batched return form
        wav = wav[0]
    return Reference(
        text_ids=[int(t) for t in sequences[0, ids.shape[1] :].tolist()],
        codes=codes[0].transpose(0, 1).contiguous().to(torch.int64),
        wav=wav.reshape(-1).to(torch.float32),
    )


@dataclass
class ThinkerReference:
    text_ids: list[int]  # generated thinker ids only (prompt excluded)
    embeds: torch.Tensor  # [P, H] the prompt's input embeddings (audio placeholders hold the encoder's outputs)
    hidden: torch.Tensor  # [P, H] the prompt's hidden states at talker_config.accept_hidden_layer


def reference_thinker(model_dir, input_ids: list[int], clips: list[torch.Tensor], *, max_tokens: int,
                      repetition_penalty: float = 1.0) -> ThinkerReference:
    """Greedy ``thinker.generate`` of transformers' reference on a prompt with any number of audio
    clips (``clips``: [128, T_i] features each, in prompt order; batched right-padded with a feature
    attention mask, as the processor does), with the prompt's hidden states that ``generate``
    (return_audio) hands the talker: ``hidden_states[0][0]`` (embeddings) and
    ``[accept_hidden_layer]``."""
    model = load_reference_model(model_dir)
    ids = torch.tensor([list(input_ids)], dtype=torch.long)
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                  eos_token_id=model.config.im_end_token_id, output_hidden_states=True, return_dict_in_generate=True)
    if repetition_penalty != 1.0:         # transformers' RepetitionPenaltyLogitsProcessor (prompt + reply ids)
        kwargs["repetition_penalty"] = repetition_penalty
    if clips:
        longest = max(c.shape[1] for c in clips)
        feats = torch.zeros(len(clips), clips[0].shape[0], longest)
        mask = torch.zeros(len(clips), longest, dtype=torch.long)
        for i, c in enumerate(clips):
            feats[i, :, : c.shape[1]] = c
            mask[i, : c.shape[1]] = 1
        kwargs.update(input_features=feats, feature_attention_mask=mask)
    with torch.no_grad():
        out = model.thinker.generate(**kwargs)
    prompt = out.hidden_states[0]
    return ThinkerReference(text_ids=[int(t) for t in out.sequences[0, ids.shape[1] :].tolist()],
                            embeds=prompt[0][0].float(),
                            hidden=prompt[model.config.talker_config.accept_hidden_layer][0].float())


class _ForceTokens:
    """A thinker logits processor: at generated position k only ``ids[k]`` stays possible."""

    def __init__(self, prompt_len: int, ids: list[int]) -> None:
        self.prompt_len, self.ids = prompt_len, list(ids)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        k = input_ids.shape[1] - self.prompt_len
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.ids[k]] = 0.0
        return forced


def _feature_extractor():
    global _FEATURE_EXTRACTOR
    if _FEATURE_EXTRACTOR is None:
        from transformers import WhisperFeatureExtractor

        _FEATURE_EXTRACTOR = WhisperFeatureExtractor(**_FEATURE_KWARGS)
    return _FEATURE_EXTRACTOR


def audio_features(wav_16k: np.ndarray) -> torch.Tensor:
    """Whisper log-mel features [128, T_valid] of one 16 kHz clip, as Qwen3-Omni's processor makes them
    (``padding=True, truncation=False, return_attention_mask=True``, then only the valid frames)."""
    wav = np.asarray(wav_16k, dtype=np.float32).reshape(-1)
    out = _feature_extractor()(
        wav,
        sampling_rate=16000,
        padding=True,
        truncation=False,
        return_attention_mask=True,
        return_tensors="pt",
    )
    feats = out["input_features"][0]
    mask = out["attention_mask"][0].bool()
    return feats[:, mask].to(torch.float32).contiguous()


def num_audio_tokens(frames: int) -> int:
    """Number of ``<|audio_pad|>`` tokens for ``frames`` feature frames (n_window 50)."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    return int(_get_feat_extract_output_lengths(torch.tensor(int(frames)), n_window=50))
