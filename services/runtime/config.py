"""Typed views of a Qwen3-Omni config.json, one dataclass per stage.

Only what our model code reads is kept; every number comes from the checkpoint's config,
never from a literal in the model code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    mrope_section: tuple[int, ...] | None = None  # (t, h, w) frequency sections, sum = head_dim / 2


@dataclass(frozen=True)
class DecoderConfig:
    """A decoder-only transformer (thinker text model, talker, code predictor, code2wav)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    intermediate_size: int = 0           # dense MLP width
    num_experts: int = 0                 # 0: dense MLP
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_size: int = 0          # 0: no shared expert
    qk_norm: bool = True
    sliding_window: int | None = None
    max_position_embeddings: int = 0     # the longest sequence the model takes (0: not given)


@dataclass(frozen=True)
class AudioEncoderConfig:
    num_mel_bins: int
    d_model: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    output_dim: int
    n_window: int
    n_window_infer: int
    conv_chunksize: int
    downsample_hidden_size: int
    max_source_positions: int


@dataclass(frozen=True)
class SpecialTokens:
    im_start: int
    im_end: int
    system: int
    user: int
    assistant: int
    tts_pad: int
    tts_bos: int
    tts_eos: int
    audio_start: int
    audio_end: int
    audio_token: int
    image_token: int
    video_token: int

    @property
    def multimodal(self) -> tuple[int, int, int]:
        return (self.audio_token, self.image_token, self.video_token)


@dataclass(frozen=True)
class ThinkerConfig:
    text: DecoderConfig
    audio: AudioEncoderConfig
    tokens: SpecialTokens
    accept_hidden_layer: int  # which hidden state (0 = embeddings) the talker takes for multimodal rows


@dataclass(frozen=True)
class CodecIds:
    pad: int
    bos: int
    eos: int
    nothink: int
    think_bos: int
    think_eos: int


@dataclass(frozen=True)
class TalkerConfig:
    text: DecoderConfig
    code_predictor: DecoderConfig
    thinker_hidden_size: int
    num_code_groups: int
    codec: CodecIds
    speakers: dict[str, int] = field(default_factory=dict)
    resize_act: str = "silu"

    @property
    def suppressed_tokens(self) -> range:
        """Codec-0 ids >= vocab - 1024 are control ids: never sampled, except codec EOS."""
        return range(self.text.vocab_size - 1024, self.text.vocab_size)


@dataclass(frozen=True)
class Code2WavConfig:
    transformer: DecoderConfig
    codebook_size: int
    num_quantizers: int
    upsampling_ratios: tuple[int, ...]
    upsample_rates: tuple[int, ...]
    decoder_dim: int
    layer_scale: float
    sample_rate: int = 24000

    @property
    def samples_per_frame(self) -> int:
        n = 1
        for r in self.upsampling_ratios + self.upsample_rates:
            n *= r
        return n


@dataclass(frozen=True)
class OmniConfig:
    thinker: ThinkerConfig
    talker: TalkerConfig
    code2wav: Code2WavConfig
    raw: dict

    @classmethod
    def from_dict(cls, cfg: dict) -> "OmniConfig":
        th, ta, cw = cfg["thinker_config"], cfg["talker_config"], cfg["code2wav_config"]
        tt, au = th["text_config"], th["audio_config"]
        tokens = SpecialTokens(
            im_start=cfg["im_start_token_id"], im_end=cfg["im_end_token_id"], system=cfg["system_token_id"],
            user=cfg["user_token_id"], assistant=cfg["assistant_token_id"], tts_pad=cfg["tts_pad_token_id"],
            tts_bos=cfg["tts_bos_token_id"], tts_eos=cfg["tts_eos_token_id"],
            audio_start=th["audio_start_token_id"], audio_end=th.get("audio_end_token_id", ta.get("audio_end_token_id")),
            audio_token=th["audio_token_id"], image_token=th["image_token_id"], video_token=th["video_token_id"],
        )
        thinker = ThinkerConfig(text=_decoder(tt), audio=_audio(au), tokens=tokens,
                                accept_hidden_layer=ta["accept_hidden_layer"])
        tk = ta["text_config"]
        talker = TalkerConfig(
            text=_decoder(tk), code_predictor=_decoder(ta["code_predictor_config"]),
            thinker_hidden_size=ta["thinker_hidden_size"], num_code_groups=ta["num_code_groups"],
            codec=CodecIds(pad=ta["codec_pad_id"], bos=ta["codec_bos_id"], eos=ta["codec_eos_token_id"],
                           nothink=ta["codec_nothink_id"], think_bos=ta["codec_think_bos_id"],
                           think_eos=ta["codec_think_eos_id"]),
            speakers={k.lower(): int(v) for k, v in (ta.get("speaker_id") or {}).items()},
            resize_act=tk.get("hidden_act", "silu"),
        )
        cw_dec = _decoder({**cw, "vocab_size": cw["codebook_size"] * cw["num_quantizers"]}, qk_norm=False, sliding=True)
        code2wav = Code2WavConfig(
            transformer=cw_dec, codebook_size=cw["codebook_size"], num_quantizers=cw["num_quantizers"],
            upsampling_ratios=tuple(cw["upsampling_ratios"]), upsample_rates=tuple(cw["upsample_rates"]),
            decoder_dim=cw["decoder_dim"], layer_scale=cw.get("layer_scale_initial_scale", 0.01),
        )
        return cls(thinker=thinker, talker=talker, code2wav=code2wav, raw=cfg)

    @classmethod
    def load(cls, model: str | Path) -> "OmniConfig":
        """`model`: a checkpoint folder (its config.json) or a config .json file."""
        path = Path(model)
        return cls.from_dict(json.loads((path if path.is_file() else path / "config.json").read_text()))

    @property
    def role_ids(self) -> dict[str, int]:
        return {"system": self.raw["system_token_id"], "user": self.raw["user_token_id"],
                "assistant": self.raw["assistant_token_id"]}


def released_config_path() -> Path:
    """The shipped config.json of Qwen3-Omni-30B-A3B-Instruct (for --load-format dummy)."""
    from importlib.resources import files

    return Path(str(files("voxpipe.configs") / "qwen3-omni-30b-a3b-instruct.json"))


def _rope(d: dict) -> RopeConfig:
    rp = d.get("rope_parameters") or {}
    theta = rp.get("rope_theta", d.get("rope_theta", 10000.0))
    section = rp.get("mrope_section") or (d.get("rope_scaling") or {}).get("mrope_section")
    return RopeConfig(theta=float(theta), mrope_section=tuple(section) if section else None)


def _decoder(d: dict, qk_norm: bool = True, sliding: bool = False) -> DecoderConfig:
    heads = d["num_attention_heads"]
    head_dim = d.get("head_dim") or d["hidden_size"] // heads
    experts = d.get("num_experts", d.get("num_local_experts", 0)) or 0
    return DecoderConfig(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], num_layers=d["num_hidden_layers"],
        num_heads=heads, num_kv_heads=d.get("num_key_value_heads", heads), head_dim=head_dim,
        rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope=_rope(d), intermediate_size=d.get("intermediate_size", 0),
        num_experts=experts, experts_per_token=d.get("num_experts_per_tok", 0),
        moe_intermediate_size=d.get("moe_intermediate_size", 0), norm_topk_prob=d.get("norm_topk_prob", True),
        shared_expert_size=d.get("shared_expert_intermediate_size", 0) or 0, qk_norm=qk_norm,
        sliding_window=d.get("sliding_window") if sliding else None,
        max_position_embeddings=d.get("max_position_embeddings", 0) or 0,
    )


def _audio(d: dict) -> AudioEncoderConfig:
    return AudioEncoderConfig(
        num_mel_bins=d["num_mel_bins"], d_model=d["d_model"], num_layers=d["encoder_layers"],
        num_heads=d["encoder_attention_heads"], ffn_dim=d["encoder_ffn_dim"], output_dim=d["output_dim"],
        n_window=d["n_window"], n_window_infer=d["n_window_infer"], conv_chunksize=d["conv_chunksize"],
        downsample_hidden_size=d["downsample_hidden_size"], max_source_positions=d["max_source_positions"],
    )
