"""Talker: the MoE codec language model (codebook 0) and the code predictor (codebooks 1..15).

Parameter names follow the checkpoint below `talker.`.
"""

from __future__ import annotations

import torch
from torch import nn

from ..runtime import determinism
from ..runtime.config import DecoderConfig, TalkerConfig
from ..runtime.kv_cache import AttentionCache, ShortCache
from ..runtime.layers import ACTIVATIONS, DecoderStack


class ResizeMLP(nn.Module):
    """Thinker space -> talker space: fc2(act(fc1(x)))."""

    def __init__(self, d_in: int, d_mid: int, d_out: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(d_in, d_mid, bias=True)
        self.linear_fc2 = nn.Linear(d_mid, d_out, bias=True)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class TalkerTextModel(DecoderStack):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__(cfg)
        self.codec_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)


class CodePredictorModel(DecoderStack):
    def __init__(self, cfg: DecoderConfig, num_code_groups: int) -> None:
        super().__init__(cfg)
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(cfg.vocab_size, cfg.hidden_size) for _ in range(num_code_groups - 1))


class CodePredictor(nn.Module):
    """Given the talker's final hidden state h and code 0, predicts codes 1..G-1 autoregressively:
    position 0 = h, position 1 = embedding(code 0); step g reads lm_head[g-1] and feeds
    codec_embedding[g-1](code g) back."""

    def __init__(self, cfg: DecoderConfig, num_code_groups: int) -> None:
        super().__init__()
        self.num_code_groups = num_code_groups
        self.model = CodePredictorModel(cfg, num_code_groups)
        self.lm_head = nn.ModuleList(
            nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) for _ in range(num_code_groups - 1))

    def predict(self, hidden: torch.Tensor, code0_embed: torch.Tensor,
                pick: "callable") -> tuple[torch.Tensor, torch.Tensor]:
        """hidden, code0_embed: [B, H]. `pick(logits [B, V], group)` chooses codes [B].
        Returns residual codes [B, G-1] and the sum of their embeddings [B, H]."""
        b = hidden.shape[0]
        cfg = self.model.cfg
        cache = ShortCache(cfg.num_layers, b, self.num_code_groups, cfg.num_kv_heads, cfg.head_dim,
                           hidden.dtype, hidden.device)
        x = torch.stack((hidden, code0_embed), dim=1)                                # [B, 2, H]
        # rotary tables computed twice per frame instead of once per pass: positions 0, 1 for the
        # first pass, and positions 2 .. G-1 laid out position-major so each later pass reads a
        # contiguous [B, 1, D] view
        rope = self.model.rotary(torch.arange(2, device=x.device).expand(b, 2), x.dtype)
        later = torch.arange(2, self.num_code_groups, device=x.device)[:, None].expand(-1, b)
        cos_later, sin_later = self.model.rotary(later, x.dtype)                     # [G - 2, B, D]
        codes, embeds = [], []
        for g in range(self.num_code_groups - 1):
            h, _ = self.model(x, None, cache, rope=rope)
            code = pick(self.lm_head[g](h[:, -1]), g + 1)
            codes.append(code)
            emb = self.model.codec_embedding[g](code)                                # [B, H]
            embeds.append(emb)
            x = emb.unsqueeze(1)
            if g < cos_later.shape[0]:                   # pass g + 1 is at position g + 2
                rope = (cos_later[g].unsqueeze(1), sin_later[g].unsqueeze(1))
        return torch.stack(codes, dim=1), embeds


class ThinkerTextEmbedding(nn.Module):
    """The thinker's input embedding table (checkpoint `thinker.model.embed_tokens.weight`), kept by
    the talker so that a text prompt's user turns can come as token ids: the talker looks their rows
    up itself, the same values the thinker's embedding gives (TalkerPrompt.user_rows unset)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight)


class TalkerModel(nn.Module):
    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        t = cfg.text
        self.model = TalkerTextModel(t)
        self.codec_head = nn.Linear(t.hidden_size, t.vocab_size, bias=False)
        self.text_projection = ResizeMLP(cfg.thinker_hidden_size, t.intermediate_size, t.hidden_size, cfg.resize_act)
        self.hidden_projection = ResizeMLP(cfg.thinker_hidden_size, t.intermediate_size, t.hidden_size, cfg.resize_act)
        self.code_predictor = CodePredictor(cfg.code_predictor, cfg.num_code_groups)
        self.invariant = False      # batch-invariant mode (determinism.apply): the frame's embeddings summed in order

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, cache: AttentionCache,
                last: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds [B, S, H] -> (codec-0 logits [B, V], final hidden [B, H]) at each sequence's last
        position (`last` [B] in a right-padded batch; default S - 1)."""
        h, _ = self.model(embeds, positions, cache)
        h = h[:, -1] if last is None else h[torch.arange(h.shape[0], device=h.device), last]
        return self.codec_head(h), h

    def next_input(self, code0: torch.Tensor, residual_embeds: list[torch.Tensor], text_row: torch.Tensor) -> torch.Tensor:
        """The next step's input [B, H]: the sum of all codebook embeddings of the frame just made,
        plus that step's text row (already projected)."""
        parts = [self.model.codec_embedding(code0)] + residual_embeds
        stacked = torch.stack(parts, dim=1)
        return (determinism.ordered_sum(stacked, 1) if self.invariant else stacked.sum(1)) + text_row
