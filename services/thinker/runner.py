"""Thinker model runner: the thinker on its device, its paged KV cache and prefix cache, CUDA graphs
and sampling.

KV memory is one pool of blocks shared by all sequences (runtime/block_pool.py for the blocks and
the prefix hashes, runtime/paged_kv.py for the tensors): a request takes the blocks of its prompt at
admission -- the published blocks of its longest cached prefix, new ones for the rest -- and one more
block whenever its decode crosses a block boundary; its full computed blocks are published as it
goes and stay findable after it ends.

A step's forwards: the next chunks of long prompts and of prompts with a cached prefix (packed into
one row, eager, each attending to its cached part), one right-padded prefill of the short prompts
admitted now without a cached prefix (a CUDA graph per (batch, length) bucket; eager when the talker
needs a hidden layer of an audio prompt, or past the graphs' lengths), and one decode forward over
the requests that decode (block tables as graph inputs). `sample` picks
every row's token at once (runtime/sampling.py: `sample_rows`, each sampled row's noise from its
own generator) with one host read, and looks up the log probabilities and talker rows asked for."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from ..runtime.config import ThinkerConfig
from ..runtime.cuda_graphs import GraphedStep, buckets, captured, fine_buckets, graphs_available
from ..runtime.extend import ExtendRows, capture_extend, extend_forward
from ..runtime.warm import packed_shapes, warm_packed, warm_sampling
from ..runtime import metrics
from ..runtime.affinity import placeholder_spans
from ..runtime.block_pool import ContentSpan, JoinedIds, KVBlockManager, PrefixHasher
from ..runtime.kv_plan import KVPlan
from ..runtime.lru import BytesLRU
from ..runtime.paged_kv import PagedKVCache, PagedPackedStep
from ..runtime.outputs import TalkerAudioRowsOut, TalkerPromptOut, TokenLogprob
from ..runtime.row_keys import audio_run_keys
from ..runtime.sampling import RowSampling, exponential_noise, finite_rows, penalize_seen, sample_rows
from .audio_cache import AudioEncoderCache
from .grammar import allowed
from .job import ChunkAttended, ThinkerJob
from .model import ThinkerModel
from .streamed import streamed_rows

log = logging.getLogger(__name__)

DRAFT_TOKENS = 16      # a draft's tokens at most (engine._draft)
VERIFY_TOKENS = 32     # a verify graph's new tokens a row: a forced run's, its last sampled token and a draft


def assistant_start(cfg: ThinkerConfig, ids: torch.Tensor | np.ndarray) -> int:
    """Where the prompt's last "<|im_start|>assistant" begins (the talker prompt's assistant head);
    IndexError when there is none. `ids` on the host."""
    tok = cfg.tokens
    a = np.asarray(ids)
    starts = np.flatnonzero(a[:-1] == tok.im_start)
    return int(starts[a[starts + 1] == tok.assistant][-1])


def user_positions(cfg: ThinkerConfig, ids: np.ndarray) -> np.ndarray:
    """[P] bool: the positions in user turns (role = the token after the latest <|im_start|> at or
    before the position; before the first one, the token at position 1), in numpy (a 26k-token
    prompt: ~0.3 ms against ~1.5 ms of torch ops on the CPU)."""
    tok = cfg.tokens
    p = ids.shape[0]
    is_start = ids == tok.im_start
    starts = np.flatnonzero(is_start)
    turn = np.cumsum(is_start)                     # [P] the im_starts at or before each position
    roles = ids[np.minimum(starts + 1, p - 1)]
    turn_is_user = np.concatenate(([ids[min(1, p - 1)] == tok.user], roles == tok.user))
    return turn_is_user[turn]


def talker_prompt(cfg: ThinkerConfig, ids: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor | None,
                  special: torch.Tensor, user_rows: bool = True, spans: tuple[ContentSpan, ...] = (),
                  follow: bool = False) -> TalkerPromptOut:
    """What the talker needs from a prompt (transformers' `_get_talker_user_parts` / assistant parts):
    rows of user turns (role = the token after the latest <|im_start|>), the assistant head, any
    prompt tokens after the head, and the tts special embeddings. ids [P], embeds [P, H], hidden [P, H]
    (the hidden layer at the audio positions, else None). Without `user_rows`: the user turns as token
    ids, for a talker that looks their text rows up itself, and the multimodal rows alone (audio_rows);
    `embeds` may then hold only the rows from `assistant_start` on. `spans`: the prompt's clips with
    their digests (audio_spans), for the keys of its multimodal runs (row_keys.audio_run_keys).
    `follow` (without `user_rows`, with `spans`): the multimodal rows are left out, to follow once the
    talker said which prefix it holds (`hidden` may be None)."""
    tok = cfg.tokens
    p = ids.shape[0]
    a = ids.cpu().numpy()
    user_np = user_positions(cfg, a)
    mm_np = ((a == tok.audio_token) | (a == tok.image_token) | (a == tok.video_token))[user_np]
    user, user_mm = torch.from_numpy(user_np), torch.from_numpy(mm_np)
    start = assistant_start(cfg, a)
    has_mm = bool(mm_np.any())
    if has_mm and hidden is None and not follow:
        raise ValueError("a prompt with audio, image or video rows needs their hidden layer")
    keys = ()
    if has_mm and spans:
        keys = tuple(audio_run_keys(a, np.flatnonzero(user_np).tolist(), mm_np.tolist(), spans))
    audio = None
    if user_rows:
        rows = embeds[user]
        if has_mm:
            rows = rows.clone()
            rows[user_mm] = hidden[user][user_mm]
        tail = embeds[start:]
    else:
        rows = None
        tail = embeds[start:] if embeds.shape[0] == p else embeds
        if has_mm and not follow:
            audio = hidden[user][user_mm]
    return TalkerPromptOut(user_rows=rows, user_mm_mask=user_mm, user_token_ids=torch.from_numpy(a[user_np]),
                           assistant_head=tail[:3], assistant_prefix=tail[3:], tts_special=special,
                           audio_rows=audio, audio_keys=keys, audio_rows_follow=follow and has_mm)


@dataclass
class Prefilled:
    """Prompts whose prefill ended: their logits at the last prompt position, and their talker prompts;
    with drafts (jobs whose `draft` rode after their context: `prefill_draft`), the logits at each
    drafted token, the jobs' in order."""

    logits: torch.Tensor                        # [n, V]
    prompts: list[TalkerPromptOut | None]       # per request: what the talker needs (talker_rows), else None
    drafts: torch.Tensor | None = None          # [sum of the drafts' lengths, V], or None (no job drafted)


@dataclass
class Chunked:
    """What a step of packed chunks made: the prompts that ended (their outputs as `prefill`'s), and
    the prompts still in prefill (or resumed) whose chunk left non-finite values in their blocks (their
    request fails now, before any later chunk or a cancel could publish the values)."""

    done: list[ThinkerJob]
    prefilled: Prefilled
    broken: list[ThinkerJob]
    resumed: list[ThinkerJob]                   # preempted jobs whose prefill ended: they decode on


@dataclass
class Sampled:
    """A step's tokens, row by row."""

    tokens: list[int]                           # -1: the row's logits were not finite (its request fails)
    logprobs: dict[int, TokenLogprob]           # by row: the rows that asked for log probabilities
    rows: list[torch.Tensor | None]             # the token's talker row [H] on the host (talker_rows), else None


def audio_spans(cfg: ThinkerConfig, prompt: list[int], digests: list[bytes]) -> tuple[ContentSpan, ...]:
    """Each audio clip's placeholder run in the prompt with its clip's digest (audio_cache.clip_key:
    the encoder's whole input, features and chunk padding): the content behind those token ids, for
    the prefix hashes. Runs and clips pair up in order (the server checked their counts)."""
    return placeholder_spans(prompt, cfg.tokens.audio_token, digests)


def audio_blocks(spans: tuple[ContentSpan, ...], blocks: int, block_size: int) -> list[int]:
    """The blocks among the first `blocks` that hold an audio placeholder (of any span), in order:
    per span, not per block (a long voice conversation's blocks times its clips)."""
    found = set()
    for sp in spans:
        if sp.end > sp.start:
            found.update(range(sp.start // block_size, min((sp.end - 1) // block_size + 1, blocks)))
    return sorted(found)


def audio_offsets(spans: tuple[ContentSpan, ...], block: int, block_size: int) -> list[int]:
    """The positions within block `block` that are audio placeholders (of any span), in order."""
    lo, hi = block * block_size, (block + 1) * block_size
    return [p - lo for sp in spans for p in range(max(sp.start, lo), min(sp.end, hi))]


class AudioRowCache:
    """The talker's hidden-layer rows of audio placeholders in published blocks, by the block's prefix
    hash (which covers everything before the block and the clip's content): what a talker prompt
    takes for the audio rows of a cached prefix, whose keys are cached but whose hidden layer is
    not. Bounded by bytes (LRU); a missing entry only means the prefix is not taken past there."""

    def __init__(self, max_bytes: int) -> None:
        self.lru = BytesLRU(max_bytes)

    def rows_for(self, job: ThinkerJob, hasher: PrefixHasher) -> tuple[int, dict[int, torch.Tensor]]:
        """How far (tokens, block-aligned) the job's cached prefix may go -- up to its first full block
        with audio whose rows are not held -- and the rows held for the audio blocks before it
        (`hasher`: the prompt's block hashes, those of its history remembered)."""
        block_size = hasher.block_size
        hashes = hasher(job.prompt_ids(), job.spans)
        found: dict[int, torch.Tensor] = {}
        for b in audio_blocks(job.spans, len(hashes), block_size):
            h = hashes[b]
            rows = self.lru.get(h) if self.lru.max_bytes else None
            if rows is None:
                return b * block_size, found
            found[b] = rows
        return len(hashes) * block_size, found

    def put(self, h: bytes, rows: torch.Tensor) -> None:
        self.lru.put(h, rows)


class ThinkerRunner:
    def __init__(self, model: ThinkerModel, cfg: ThinkerConfig, *, device: torch.device, max_active: int,
                 max_len: int, eos_ids: tuple[int, ...], kv: KVPlan, cuda_graphs: bool = True,
                 prefill_batch: int = 8, prefill_graph_len: int = 512, decode_graph_len: int | None = None,
                 eager_fallback: bool = False, audio_cache_bytes: int = 0) -> None:
        """Prompts up to `prefill_graph_len` tokens, `prefill_batch` at a time, replay CUDA graphs;
        decode steps whose longest sequence is within `decode_graph_len` positions (default: the
        whole context) too; up to
        `audio_cache_bytes` of audio encoder outputs are kept by clip content (0: none)."""
        self.model, self.cfg, self.device = model, cfg, device
        self.prefill_batch, self.max_len = prefill_batch, max_len
        self.talker_prompt_ids = True   # a routed talker's prompts: user turns as ids (the engine sets it)
        dtype = next(model.parameters()).dtype
        self.audio = AudioEncoderCache(model.audio_tower, audio_cache_bytes, model.model.embed_tokens.weight.dtype,
                                       device, keyed=kv.prefix_cache)
        t = cfg.text
        self.cache = PagedKVCache(t.num_layers, kv.blocks, kv.block_size, t.num_kv_heads, t.head_dim, dtype, device)
        self.blocks = KVBlockManager(kv.blocks, kv.block_size, kv.prefix_cache)
        self.audio_rows = AudioRowCache(audio_cache_bytes if kv.prefix_cache else 0)
        special = torch.tensor([cfg.tokens.tts_bos, cfg.tokens.tts_eos, cfg.tokens.tts_pad], device=device)
        self.eos = torch.tensor(eos_ids, device=device)
        self._mask_host = self._rows_host = None    # constrained rows' bitmasks (_grammar_masks)
        with torch.inference_mode():
            self.tts_special = model.model.embed_tokens(special).cpu()
            self.graphs = self.prefill_graphs = self.extend_graphs = self.verify_graphs = None
            if cuda_graphs and graphs_available(device):
                self._capture(max_active, min(decode_graph_len or max_len, max_len), min(prefill_graph_len, max_len),
                              eager_fallback)
        # prompts this short replay a prefill graph from position 0 (or, with a cached prefix, an
        # extend graph): faster than the eager packed path (a 100-token prompt: ~8 ms against ~50 ms
        # on the H200)
        self.graph_prompt_len = min(prefill_graph_len, max_len) if self.prefill_graphs is not None else 0
        self.warmed = self.graphs is not None and device.type == "cuda"
        if self.warmed:
            self.warm_up()

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run once, at start, what the graphs do not cover, so that no request pays a first-sight
        cost (Triton compiling a kernel for a new shape class -- its integer arguments specialise on
        being 1, a multiple of 16 or neither --, allocator growth): the eager packed prefill (long and
        short segments, lengths of each class, odd starts, the hidden layer kept), an eager
        decode past the decode graphs, and the sampling kernels. Every write goes to the scratch
        block (null tables); nothing is published or read later."""
        dev, null = self.device, self.cache.null
        keep = self.cfg.accept_hidden_layer
        warm_packed(lambda x, positions, view, last: self.model(x, positions, view, keep_hidden=keep, last=last),
                    self.cache, self.blocks, self.cfg.text.hidden_size, self.tts_special.dtype,
                    packed_shapes(self.graph_prompt_len))
        longest = self.graphs.kv_lens[-1]
        if longest < self.max_len:
            kv = min(self.max_len, longest + 1)
            tables = torch.full((1, self.blocks.blocks_for(kv)), null, dtype=torch.long, device=dev)
            self._decode_fn(1, kv, torch.zeros(1, 1, dtype=torch.long, device=dev),
                            torch.tensor([kv - 1], device=dev), tables)
        warm_sampling(self.cfg.text.vocab_size, dev)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def _capture(self, max_active: int, decode_len: int, prefill_len: int, eager_fallback: bool) -> None:
        """Each step's graphs, or GraphCaptureError (with `eager_fallback`: that step runs eagerly)."""
        dev, h = self.device, self.cfg.text.hidden_size
        dtype = self.tts_special.dtype
        null = self.cache.null
        self.graphs = captured("thinker decode", lambda: GraphedStep(
            self._decode_fn, (torch.zeros(max_active, 1, dtype=torch.long, device=dev),
                              torch.zeros(max_active, dtype=torch.long, device=dev),
                              torch.full((max_active, self.blocks.blocks_for(decode_len)), null, dtype=torch.long,
                                         device=dev)),
            buckets(max_active), buckets(decode_len, min(256, decode_len)), "thinker decode",
            pad=(None, 0, null)), eager_fallback)        # padding rows: the null table (writes go to scratch)
        n = min(self.prefill_batch, max_active)
        self.prefill_width = self.blocks.blocks_for(prefill_len)
        # the graphs also return the hidden layer that audio prompts' talker rows take (one add more)
        self.prefill_graphs = captured("thinker prefill", lambda: GraphedStep(
            lambda *args: self._prefill_fn(*args, keep=self.cfg.accept_hidden_layer),
            (torch.zeros(n, prefill_len, h, dtype=dtype, device=dev), torch.zeros(n, dtype=torch.long, device=dev),
             torch.full((n, self.prefill_width), null, dtype=torch.long, device=dev)),
            buckets(n), buckets(prefill_len, min(32, prefill_len)), "thinker prefill",
            pad=(None, 0, null)), eager_fallback)
        # prompts going on from a cached prefix (and resumed ones): up to prefill_len new tokens each,
        # tables as wide as the context
        self.extend_width = self.blocks.blocks_for(self.max_len)
        self.extend_graphs = capture_extend("thinker extend",
                                            lambda *args: self._extend_fn(*args, keep=self.cfg.accept_hidden_layer),
                                            n, prefill_len, h, dtype, self.cache, self.extend_width, eager_fallback)
        # drafts' verifies (runner.feed): up to VERIFY_TOKENS new tokens a row, the final hidden states
        # at its last 1 + DRAFT_TOKENS positions (last [n, 1 + DRAFT_TOKENS]; a shorter draft repeats its
        # last), whose logits the verify computes for the positions it reads; in the extend graphs' pool
        # (never replayed together), so only their outputs ([n, 1 + DRAFT_TOKENS, H]) are memory of their own
        self.verify_graphs = captured("thinker verify", lambda: GraphedStep(
            lambda *args: self._extend_fn(*args, head=False)[:1],
            (torch.zeros(n, VERIFY_TOKENS, h, dtype=dtype, device=dev),
             *(torch.zeros(n, dtype=torch.long, device=dev) for _ in range(2)),
             torch.zeros(n, 1 + DRAFT_TOKENS, dtype=torch.long, device=dev),
             torch.full((n, self.extend_width), null, dtype=torch.long, device=dev)),
            fine_buckets(n, 1, 2), buckets(VERIFY_TOKENS, 8), "thinker verify", pad=(None, 0, 0, 0, null),
            pool=self.extend_graphs.pool if self.extend_graphs is not None else None),
            eager_fallback=True)     # none: the engine drafts nothing (an eager verify costs more than it saves)

    def _prefill_fn(self, n: int, s: int, embeds: torch.Tensor, last: torch.Tensor, tables: torch.Tensor,
                    keep: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prompts [n, >= s, H] (right-padded to s), from position 0, into their blocks (tables [n, M],
        padded with the null block); logits [n, V] at each prompt's `last` position, and the `keep`
        hidden layer if asked."""
        positions = torch.arange(s, device=embeds.device)[None].expand(n, s)
        return self.model(embeds[:, :s], positions, self.cache.prefill_view(tables, s), keep_hidden=keep, last=last)

    def _extend_fn(self, n: int, s: int, embeds: torch.Tensor, start: torch.Tensor, length: torch.Tensor,
                   last: torch.Tensor, tables: torch.Tensor, keep: int | None = None,
                   kv_bound: int | None = None, head: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prompts going on from their cached prefixes: row b's length[b] new tokens ([n, >= s, H],
        right-padded to s) at positions start[b] ..., into its blocks (tables [n, M]); logits [n, V]
        at each row's `last` new token, and the `keep` hidden layer if asked. `kv_bound`: how far
        any row reaches (default the context). Without `head`: the final hidden states at `last`
        instead of logits."""
        return extend_forward(self.model, self.cache, s, embeds, start, length, tables, kv_bound or self.max_len,
                              keep_hidden=keep, last=last, head=head)

    def _decode_fn(self, n: int, kv_len: int, ids: torch.Tensor, start: torch.Tensor,
                   tables: torch.Tensor) -> tuple[torch.Tensor]:
        """One token for each of n sequences: ids [n, 1], start [n] (their positions), tables [n, M]."""
        view = self.cache.decode_view(n, kv_len, tables, start)
        logits, _ = self.model(self.model.model.embed_tokens(ids), start[:, None], view)
        return (logits,)

    # ---- KV blocks
    def fits(self, job: ThinkerJob) -> bool:
        """Whether the pool has the blocks for `job`'s whole context now, without a cached prefix."""
        return self.blocks.blocks_for(job.prefill_target + 1) <= self.blocks.pool.free

    def allocate(self, job: ThinkerJob) -> bool:
        """The job's blocks: its cached prefix (`prefilled` starts there) and new blocks for the rest of
        its context and its first decode position. False (nothing taken) when the pool lacks them.
        A prompt whose talker needs hidden states of its audio rows (a pending turn among them: it may
        be spoken) takes no cached prefix past its first block with audio whose rows the AudioRowCache
        lacks (a cached block keeps keys, not the hidden layer); a pending turn none past its
        conversation (streaming.py); without extend graphs, a prompt short enough for the prefill graphs takes
        none (graphed from position 0, it is faster)."""
        if not job.spans and job.audio and self.blocks.enable_caching:
            job.spans = audio_spans(self.cfg, job.prompt, self._digests(job))
        limit, rows = None, {}
        # a pending turn may be spoken: as a spoken prompt, it needs the talker's rows of its cached audio
        if (job.pending or job.talker_rows and not job.prompt_sent and not job.generated) and job.spans:
            limit, rows = self.audio_rows.rows_for(job, self.blocks.hasher)
        if job.pending:         # found by its conversation alone (the streamed clip's digest comes at the commit)
            limit = min(limit, job.stream_start) if limit is not None else job.stream_start
        elif not job.generated and len(job.prompt) <= self.graph_prompt_len and self.extend_graphs is None:
            limit = 0           # the prefill graph from position 0 (a resumed job takes the chunked path)
        table = self.blocks.admit(job.context_ids(), job.spans, reserve=1, max_cached=limit)
        if table is None:
            return False
        job.table, job.prefilled, job.kv_trusted = table, table.cached_tokens, True
        job.cached_rows = {b: r for b, r in rows.items() if b < table.cached_tokens // self.blocks.block_size}
        if job.text is None:        # not resumed: its first prefill (a forced opening of the reply is not prompt)
            job.cached_tokens = min(table.cached_tokens, len(job.prompt))
            metrics.PREFIX_TOKENS.labels("thinker", "queried").inc(len(job.prompt))
            metrics.PREFIX_TOKENS.labels("thinker", "hit").inc(job.cached_tokens)
        if job.draft and not self.prefill_draft(job):
            job.draft = []
        return True

    def prefill_draft(self, job: ThinkerJob) -> bool:
        """Whether the job's draft (engine.open_reply) rides in its prefill, after its context: its
        first prefill only, the blocks for its positions taken now from what the pool has free (else
        it is dropped: the prefill goes on without it, and the draft waits for the first token as a
        decode step's does). With CUDA graphs, only where the verify graphs can take the prefill --
        a cached prefix or a forced opening sends it down the chunked path (scheduler.py), its new
        tokens and the draft within VERIFY_TOKENS, no hidden layer kept for the talker --: a prompt's
        eager forward would cost more than the forward the draft saves. The drafted positions are past
        the context, in the job's own blocks (a cached prefix ends before its last token): their keys
        are published only as far as the verify accepts them (`kv_tokens`), the rest is overwritten
        before any read."""
        if job.text is not None or job.pending or job.prefilled >= job.prefill_target:
            return False
        if self.graphs is not None:
            chunked = job.prefilled or job.generated
            keep = job.talker_rows and (job.audio or job.streamed is not None)
            if (self.verify_graphs is None or not chunked or keep
                    or not self.verify_graphs.fits(1, job.prefill_target - job.prefilled + len(job.draft))):
                return False
        return self.blocks.grow(job.table, job.prefill_target + len(job.draft))

    def grow(self, job: ThinkerJob) -> bool:
        """Blocks for the job's next decode position (a forced run: its positions); False (nothing
        taken) when none is free. Not a draft's (`grow_draft`, once every row of the step has its own)."""
        return self.blocks.grow(job.table, job.kv_tokens + job.ahead + 1)

    def grow_draft(self, job: ThinkerJob) -> None:
        """Blocks for the positions of the job's draft, from what the pool has free after every row of
        the step took the block for its next position (engine._decode), else the draft is dropped: a
        draft never takes a block a row needs, so it never preempts one."""
        if job.draft and not self.blocks.grow(job.table, job.kv_tokens + job.ahead + 1 + len(job.draft)):
            job.draft = []

    def publish(self, job: ThinkerJob) -> None:
        """Publish the job's full blocks whose keys are computed (after a step whose outputs were finite)."""
        if job.table is None or not job.kv_trusted or job.pending:   # a pending turn: at its commit
            return
        if job.kv_tokens // self.blocks.block_size > job.table.published:   # a block filled since the last call
            self.blocks.publish(job.table, JoinedIds(job.prompt, job.generated), job.kv_tokens, job.spans)
        if job.pending_rows:
            published, hashes = job.table.published, job.table.hashes
            for b, rows in job.pending_rows:
                if b < published:
                    self.audio_rows.put(hashes[b], rows)
            job.pending_rows = [(b, r) for b, r in job.pending_rows if b >= published]

    def release(self, job: ThinkerJob) -> None:
        """Give the job's blocks back (published ones stay findable) and drop its prefill state."""
        job.embeds, job.embeds_from, job.kept, job.cached_rows = None, 0, [], {}
        job.draft = []
        if job.table is not None:
            self.publish(job)
            self.blocks.release(job.table, trusted=job.kv_trusted)
            job.table = None
        job.pending_rows = []

    def preempt(self, job: ThinkerJob) -> None:
        """Free a running job's blocks to make room: it waits again and prefills its context (the
        prompt and its reply but the last token) before decoding on, its output unchanged."""
        self.release(job)
        job.prefilled, job.ahead = 0, 0      # a forced run is part of the context prefilled again
        job.draft = []
        # the reply but its last token (decoded again); before its first outputs, all of a forced opening
        job.prefill_target = len(job.prompt) + max(len(job.generated) - (job.text is not None), 0)
        self.blocks.stats.preempted += 1
        metrics.PREEMPTIONS.labels("thinker").inc()

    def observe_kv(self) -> None:
        """The KV gauges (after a step)."""
        pool = self.blocks.pool
        metrics.KV_BLOCKS.labels("thinker", "used").set(pool.used)
        metrics.KV_BLOCKS.labels("thinker", "free").set(pool.free)
        metrics.KV_BLOCKS.labels("thinker", "cached").set(pool.cached)

    def scrub(self, job: ThinkerJob) -> None:
        """Zero the blocks the job wrote and the graphs' float inputs, so that nothing its non-finite
        numbers left on the device reaches a later request; its blocks are never published."""
        job.kv_trusted = False
        if job.table is not None:
            own = job.table.blocks[job.table.cached_tokens // self.blocks.block_size:]
            self.cache.scrub(own)
        self.audio.forget(job.audio_digests or [])
        for graphs in (self.graphs, self.prefill_graphs, self.extend_graphs, self.verify_graphs):
            if graphs is not None:
                graphs.scrub()

    def _tables(self, jobs: list[ThinkerJob], width: int) -> torch.Tensor:
        return self.cache.table_tensor([j.table.array() for j in jobs], width, self.device)

    # ---- forwards
    def embed(self, job: ThinkerJob, start: int = 0) -> torch.Tensor:
        """The job's prompt embeddings [P, H] on the device; its clips through the audio encoder cache.
        `start` > 0 (a prompt without audio): only positions start .. P - 1."""
        if start:
            assert not job.audio and job.streamed is None
            return self.model.embed(torch.from_numpy(job.prompt_ids()[start:]).to(self.device))
        ids = torch.from_numpy(job.prompt_ids()).to(self.device)
        if job.streamed is not None:       # its last clip's rows: the windows encoded so far, or all of it
            return self.model.embed(ids, encoded=streamed_rows(self.audio, job, self._digests(job)))
        if not job.audio:
            return self.model.embed(ids)
        return self.model.embed(ids, encoded=self.audio.encode(job.audio, self._digests(job)))

    def _digests(self, job: ThinkerJob) -> list[bytes | None]:
        """Its clips' keys (hashed since its start arrived, or now)."""
        if job.audio_digests is None:
            soon = job.audio_keys
            job.audio_digests = [k.result() for k in soon] if soon is not None else self.audio.keys(job.audio)
        return job.audio_digests

    def prefill(self, jobs: list[ThinkerJob]) -> Prefilled:
        """One forward over the jobs' prompts (right-padded), from position 0, into their blocks. A
        job's draft (`prefill_draft`: without CUDA graphs) rides after its prompt: the logits at its
        prompt's last position and at each drafted token (Prefilled.drafts)."""
        dev = self.device
        # prefill_draft kept none for this path with graphs; a row with log probabilities keeps the
        # forward's shape the undrafted one (its numbers, not only its choices, go out)
        if self.graphs is not None or any(j.top_logprobs is not None for j in jobs):
            for j in jobs:
                j.draft = []
        embeds = [self.embed(j) for j in jobs]
        audio = [bool(j.audio) for j in jobs]   # the server checked: features <=> audio placeholders
        keep = self.cfg.accept_hidden_layer if any(j.talker_rows and a for j, a in zip(jobs, audio)) else None
        drafted = max(len(j.draft) for j in jobs)
        rows = [torch.cat((e, self.model.model.embed_tokens(torch.tensor(j.draft, device=dev)).to(e.dtype)))
                if j.draft else e for j, e in zip(jobs, embeds)]
        n, s = len(jobs), max(len(j.prompt) + len(j.draft) for j in jobs)
        x = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)                   # [n, s, H]
        if drafted:     # [n, 1 + drafted]: each prompt's last position, then its drafted tokens' (the last repeated)
            at = [[len(j.prompt) - 1 + min(k, len(j.draft)) for k in range(1 + drafted)] for j in jobs]
            last = torch.tensor(at).to(dev, non_blocking=True)
        else:
            last = torch.tensor([len(j.prompt) - 1 for j in jobs]).to(dev, non_blocking=True)
        g = self.prefill_graphs
        drafts = None
        if g is not None and g.fits(n, s):   # padding rows and positions write the scratch block
            logits, hidden = g(n, s, x, last, self._tables(jobs, self.prefill_width))
        else:
            logits, hidden = self._prefill_fn(n, s, x, last, self._tables(jobs, self.blocks.blocks_for(s)), keep)
            if drafted:      # logits [n, 1 + drafted, V]
                pick = [(b, 1 + k) for b, j in enumerate(jobs) for k in range(len(j.draft))]
                b, k = torch.tensor(pick).T.to(dev, non_blocking=True)
                logits, drafts = logits[:, 0], logits[b, k]
        prompts = []
        for b, j in enumerate(jobs):
            j.generator = j.params.generator(dev)
            prompt = None
            if j.talker_rows and (not j.prompt_sent or j.audio_follow):
                p = len(j.prompt)
                kept = hidden[b, :p].cpu() if hidden is not None and audio[b] else None
                if kept is not None:
                    self._keep_rows(j, kept)
                prompt = self._talker_prompt(j, embeds[b], kept)
            prompts.append(prompt)
        return Prefilled(logits, prompts, drafts)

    def _keep_rows(self, job: ThinkerJob, kept: torch.Tensor) -> None:
        """Hold the audio rows of the prompt's full blocks that the cache lacks (kept [P, H] on the
        host), to be cached as their blocks are published."""
        if not self.audio_rows.lru.max_bytes or job.table is None or not job.spans:
            return
        bs = self.blocks.block_size
        for b in audio_blocks(job.spans, len(job.prompt) // bs, bs):
            offsets = audio_offsets(job.spans, b, bs)
            if b not in job.cached_rows:
                job.pending_rows.append((b, kept[b * bs + torch.tensor(offsets)].clone()))

    def _talker_prompt(self, job: ThinkerJob, embeds: torch.Tensor,
                       kept: torch.Tensor | None) -> TalkerPromptOut | TalkerAudioRowsOut:
        """A prefilled job's talker prompt (embeds [P, H] on the device, kept [P, H] on the host): to
        a routed talker (`talker_prompt_ids`) its user turns as token ids with the multimodal rows
        alone; its clips' digests key those rows' runs. Its prompt sent at admission without them
        (`audio_follow`): the multimodal rows alone."""
        ids = torch.from_numpy(job.prompt_ids())
        ids_only = self.talker_prompt_ids and job.speech is not None
        if ids_only:
            embeds = embeds[assistant_start(self.cfg, ids):]
        spans = self._talker_spans(job)
        prompt = talker_prompt(self.cfg, ids, embeds.cpu(), kept, self.tts_special, user_rows=not ids_only,
                               spans=spans)
        return TalkerAudioRowsOut(prompt.audio_rows) if job.audio_follow else prompt

    def _talker_spans(self, job: ThinkerJob) -> tuple[ContentSpan, ...]:
        """Its clips with their digests, for the talker's keys of its multimodal runs (none when a
        clip has no digest: the caches are off)."""
        digests = self._digests(job) if job.audio else []
        return audio_spans(self.cfg, job.prompt, digests) if digests and all(digests) else ()

    def _context_embeds(self, job: ThinkerJob, start: int = 0) -> torch.Tensor:
        """[prefill_target - start, H]: the prompt's embeddings (its audio encoded) and, resumed after
        a preemption, its reply's tokens but the last, from position `start` (sets job.embeds_from):
        only a text prompt whose talker prompt does not need them all (sent at admission, or none)
        skips its cached prefix (a long conversation's next turn: 258 of 26k rows looked up)."""
        dev = self.device
        whole = (job.audio or job.streamed is not None or job.pending
                 or (job.talker_rows and (not job.prompt_sent or job.audio_follow)))
        start = 0 if whole else min(start, len(job.prompt))
        job.embeds_from = start
        x = self.embed(job, start)
        reply = job.generated[:job.prefill_target - len(job.prompt)]
        if reply:
            x = torch.cat((x, self.model.model.embed_tokens(torch.tensor(reply, device=dev)).to(x.dtype)))
        return x

    def prefill_chunks(self, chunks: list[tuple[ThinkerJob, int, int]]) -> Chunked:
        """Chunks (job, start, length) of prefills packed into one row (eager, no padding), each
        attending to its job's earlier positions (a cached prefix among them). A chunk's last position
        attends to every position of its context so far, so the logits there are finite exactly when
        nothing non-finite is in its blocks. A job resumed after a preemption ends its prefill without
        outputs (its next token is already out): it is in `resumed`, not `done`. A job's draft
        (`prefill_draft`) rides after its last chunk: the logits at its context's last position and
        at each drafted token (Prefilled.drafts, the done jobs' in order); with CUDA graphs only
        where the verify graphs take the step's chunks, else the step's drafts are dropped."""
        dev = self.device
        for job, start, _ in chunks:
            if job.embeds is None:   # first chunk: the context's embeddings from here, kept until the last chunk
                job.embeds = self._context_embeds(job, start)
                job.kept, job.kept_from = [], start
        kept_by = [bool((job.talker_rows or job.pending) and (job.audio or job.streamed) and not job.generated)
                   for job, _, _ in chunks]
        keep = self.cfg.accept_hidden_layer if any(kept_by) else None
        parts = [(job, job.embeds[start - job.embeds_from:start - job.embeds_from + length], start)
                 for job, start, length in chunks]
        # a draft rides after its job's last chunk (never a resumed job's: preempt dropped it)
        drafted = [len(job.draft) if start + length >= job.prefill_target and not job.pending else 0
                   for job, start, length in chunks]
        if any(drafted) and not self._chunk_drafts_fit(parts, drafted, keep):
            drafted = [0] * len(chunks)
        for (job, start, length), d in zip(chunks, drafted):
            if not d and start + length >= job.prefill_target:
                job.draft = []       # its prefill ends without it: drafted after its first token, if at all
        drafts = None
        if any(drafted):
            parts = [(job, torch.cat((x, self.model.model.embed_tokens(torch.tensor(job.draft, device=dev)).to(x.dtype)))
                      if d else x, start) for (job, x, start), d in zip(parts, drafted)]
            logits, drafts, hidden, rows_of, paths = self._verify(parts, drafted, keep)
        else:
            logits, hidden, rows_of, paths = self._extend(parts, keep)
        for (job, start, length), path in zip(chunks, paths):
            job.chunks.append(ChunkAttended(start, length, path))
            metrics.PREFILL_CHUNKS.labels("thinker", path).inc()
            if log.isEnabledFor(logging.DEBUG):
                log.debug("thinker %s: chunk of %d new tokens after %d (of %d): %s attention", job.request_id, length,
                          start, job.prefill_target, path)
        going_on = [i for i, (job, start, length) in enumerate(chunks)
                    if start + length < job.prefill_target or job.generated or job.pending]
        finite = torch.isfinite(logits[going_on]).all(dim=-1).tolist() if going_on else []
        broken = [chunks[i][0] for i, ok in zip(going_on, finite) if not ok]
        done, rows, prompts, resumed = [], [], [], []
        for i, ((job, start, length), (row, part)) in enumerate(zip(chunks, rows_of)):
            if kept_by[i]:     # a copy: a graph's outputs are overwritten by its next replay (a later chunk)
                job.kept.append(hidden[row, part].clone())
            if start + length < job.prefill_target or job.pending:   # more to come (a pending turn: its audio)
                continue
            if job.text is not None:       # resumed after a preemption: its outputs were made before
                job.embeds, job.kept = None, []
                resumed.append(job)
                continue
            job.generator = job.params.generator(dev)
            prompt = None
            if job.talker_rows and (not job.prompt_sent or job.audio_follow):
                kept = None
                if job.kept:     # before kept_from: audio rows only in cached blocks (allocate's limit)
                    part = torch.cat(job.kept)
                    kept = part.new_zeros(len(job.prompt), part.shape[1]).cpu()
                    kept[job.kept_from:] = part.cpu()
                    bs = self.blocks.block_size
                    for b, held in job.cached_rows.items():
                        kept[b * bs + torch.tensor(audio_offsets(job.spans, b, bs))] = held
                    self._keep_rows(job, kept)
                prompt = self._talker_prompt(job, job.embeds, kept)
            job.embeds, job.kept = None, []
            done.append(job)
            rows.append(i)
            prompts.append(prompt)
        if len(rows) < len(chunks):
            logits = logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]
        # the drafted parts are done jobs' (last chunks, first prefills): `drafts` is theirs, in order
        return Chunked(done, Prefilled(logits, prompts, drafts), broken, resumed)

    def _chunk_drafts_fit(self, parts: list[tuple[ThinkerJob, torch.Tensor, int]], drafted: list[int],
                          keep: int | None) -> bool:
        """Whether a step's packed chunks take their drafts (`drafted[i]` tokens after part i): not
        beside a row with log probabilities (its numbers go out, not only its choices: the forward
        keeps the undrafted shape, as in `prefill`); with CUDA graphs only through the verify graphs
        (no hidden layer kept), as `feed` verifies a decode step's drafts."""
        if any(job.top_logprobs is not None for job, _, _ in parts):
            return False
        if self.graphs is None:
            return True
        g = self.verify_graphs
        return (keep is None and g is not None
                and g.fits(len(parts), max(x.shape[0] + d for (_, x, _), d in zip(parts, drafted))))

    def _extend(self, parts: list[tuple[ThinkerJob, torch.Tensor, int]], keep: int | None
                ) -> tuple[torch.Tensor, torch.Tensor | None, list[tuple[int, slice]], list[str]]:
        """One forward over each part's new rows [L, H] (on the device) at its positions start ...,
        attending to its job's earlier positions: logits [n, V] at each part's last row, the `keep`
        hidden layer if asked, where each part's rows are in it ((batch row, slice)), and the attention
        each part took (ChunkAttended.path). Extend graphs when they fit (a right-padded row per part),
        else packed into one row, eager."""
        dev = self.device
        n, longest = len(parts), max(x.shape[0] for _, x, _ in parts)
        g = self.extend_graphs
        if g is not None and g.fits(n, longest):
            rows = ExtendRows.of([(x, start) for _, x, start in parts], dev)
            # columns past the rows' reach: as for decode
            logits, hidden = g(n, longest, rows.x, rows.start, rows.length, rows.last,
                               self._tables([job for job, _, _ in parts], self.blocks.blocks_for(rows.reach)))
            return (logits, hidden, [(b, slice(0, x.shape[0])) for b, (_, x, _) in enumerate(parts)],
                    ["extend graph"] * n)
        step = PagedPackedStep.pack([(job.table.blocks, start, x.shape[0]) for job, x, start in parts])
        x = torch.cat([x for _, x, _ in parts])[None]
        view = self.cache.packed(step)
        logits, hidden = self.model(x, step.positions(dev), view, keep_hidden=keep, last=step.ends(dev))
        return logits, hidden, [(0, slice(sg.offset, sg.offset + sg.length)) for sg in step.segments], view.paths

    def feed(self, jobs: list[ThinkerJob]) -> tuple[list[ThinkerJob], torch.Tensor, torch.Tensor | None]:
        """The decode forward of jobs with a forced run (`ahead` > 0: their last 1 + ahead reply
        tokens have no keys) or a draft (`draft`: tokens after the last, to verify): those tokens,
        then the draft's, at once, one extend forward; the jobs (`ahead` 0 now, `draft` kept for the
        engine's verify) and their logits [len(jobs), V] at their last token, as a decode step per
        token would end, and with drafts the logits [sum of the drafts' lengths, V] at each drafted
        token, the jobs' in order (else None). A draft's keys past the tokens its verify accepts are
        never read: the next forward writes those positions before anything attends to them. With
        verify graphs, a draft is cut to what fits VERIFY_TOKENS (none left: dropped), and where a row
        still does not fit them (a forced run of VERIFY_TOKENS or more, more rows than they take) the
        step drops its drafts: its runs take the extend graphs, not an eager forward."""
        g = self.verify_graphs
        if g is not None:
            for job in jobs:
                job.draft = job.draft[:max(VERIFY_TOKENS - job.ahead - 1, 0)]
            if not g.fits(len(jobs), max(job.ahead + 1 + len(job.draft) for job in jobs)):
                for job in jobs:
                    job.draft = []
        parts = []
        for job in jobs:
            ids = torch.tensor(job.generated[-(job.ahead + 1):] + job.draft).to(self.device, non_blocking=True)
            parts.append((job, self.model.model.embed_tokens(ids), job.kv_tokens))
        drafts = None
        if not any(job.draft for job in jobs):
            logits, _, _, _ = self._extend(parts, None)
        else:
            logits, drafts, _, _, _ = self._verify(parts)
        for job in jobs:
            job.ahead = 0
        return jobs, logits, drafts

    def _verify(self, parts: list[tuple[ThinkerJob, torch.Tensor, int]], drafted: list[int] | None = None,
                keep: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[tuple[int, slice]], list[str]]:
        """`_extend` of rows whose last `drafted[i]` rows are a draft (default: each job's `draft`):
        the logits [n, V] at each row's token before its draft, [sum(drafted), V] at each drafted
        token (rows in order), the `keep` hidden layer if asked, where each part's rows before its
        draft are in it ((batch row, slice)), and the attention each part took. A verify graph when
        one fits (no `keep`), else packed into one row, eager."""
        dev, jobs = self.device, [job for job, _, _ in parts]
        if drafted is None:
            drafted = [len(job.draft) for job in jobs]
        g = self.verify_graphs
        longest = max(x.shape[0] for _, x, _ in parts)
        if keep is None and g is not None and g.fits(len(parts), longest):
            rows = ExtendRows.of([(x, start) for _, x, start in parts], dev)
            at = [[x.shape[0] - 1 - d + min(k, d) for k in range(1 + DRAFT_TOKENS)]
                  for (_, x, _), d in zip(parts, drafted)]
            (hidden,) = g(len(parts), longest, rows.x, rows.start, rows.length, torch.tensor(at).to(dev, non_blocking=True),
                          self._tables(jobs, self.blocks.blocks_for(rows.reach)))     # [n, 1 + DRAFT_TOKENS, H]
            # each row's last token, then each drafted token, rows in order
            pick = [(b, 0) for b in range(len(jobs))] + [(b, 1 + k) for b, d in enumerate(drafted) for k in range(d)]
            b, k = torch.tensor(pick).T.to(dev, non_blocking=True)
            every = self.model.lm_head(hidden[b, k])
            return (every[:len(jobs)], every[len(jobs):], None,
                    [(b, slice(0, x.shape[0] - d)) for b, ((_, x, _), d) in enumerate(zip(parts, drafted))],
                    ["verify graph"] * len(parts))
        step = PagedPackedStep.pack([(job.table.blocks, start, x.shape[0]) for job, x, start in parts])
        ends = [sg.offset + sg.length - 1 for sg in step.segments]
        at = [e - d for e, d in zip(ends, drafted)]
        at += [e - d + 1 + k for e, d in zip(ends, drafted) for k in range(d)]
        x = torch.cat([x for _, x, _ in parts])[None]
        view = self.cache.packed(step)
        every, hidden = self.model(x, step.positions(dev), view, keep_hidden=keep,
                                   last=torch.tensor(at).to(dev, non_blocking=True))
        return (every[:len(jobs)], every[len(jobs):], hidden,
                [(0, slice(sg.offset, sg.offset + sg.length - d)) for sg, d in zip(step.segments, drafted)], view.paths)

    def decode(self, jobs: list[ThinkerJob]) -> tuple[list[ThinkerJob], torch.Tensor]:
        """One decode forward over `jobs` (each with a token to feed and a block for its position:
        its last, or with a forced run catching up (`ahead`) the run's first without keys): the
        jobs and their logits [len(jobs), V]."""
        n = len(jobs)
        ids = torch.tensor([[j.generated[-1 - j.ahead]] for j in jobs]).to(self.device, non_blocking=True)
        start_list = [j.kv_tokens for j in jobs]
        start = torch.tensor(start_list).to(self.device, non_blocking=True)
        kv_len = max(start_list) + 1
        g = self.graphs
        if g is not None and g.fits(n, kv_len):
            # the tables as wide as the step needs: a graph's columns past them keep what an earlier
            # replay left, blocks no row reads (attention reads a row's positions up to its own)
            (logits,) = g(n, kv_len, ids, start, self._tables(jobs, self.blocks.blocks_for(kv_len)))
        else:
            (logits,) = self._decode_fn(n, kv_len, ids, start, self._tables(jobs, self.blocks.blocks_for(kv_len)))
        return jobs, logits

    def early_talker_prompt(self, job: ThinkerJob, ids_only: bool) -> TalkerPromptOut | None:
        """A text prompt's talker prompt before its prefill (lookups in the embedding table: no row of
        it needs a hidden state), so that the talker prefills it while this prefill runs. `ids_only`: the
        user turns go as token ids (the talker looks their rows up); only the assistant head and what
        follows it are looked up here. A prompt with audio: with `ids_only` and its clips' digests, the
        prompt without its audio rows (audio_rows_follow, `job.audio_follow` set: they follow after the
        prefill, which makes them, past what the talker holds), else None (it goes after the prefill)."""
        ids = torch.from_numpy(job.prompt_ids())
        if job.audio:      # the server checked: audio features <=> audio placeholders in the prompt
            spans = self._talker_spans(job) if ids_only else ()
            if not spans:
                return None
            tail = self.model.model.embed_tokens(ids[assistant_start(self.cfg, ids):].to(self.device)).cpu()
            prompt = talker_prompt(self.cfg, ids, tail, None, self.tts_special, user_rows=False, spans=spans,
                                   follow=True)
            job.audio_follow = prompt.audio_rows_follow
            return prompt
        if not ids_only:
            embeds = self.model.model.embed_tokens(ids.to(self.device)).cpu()
            return talker_prompt(self.cfg, ids, embeds, None, self.tts_special)
        tail = self.model.model.embed_tokens(ids[assistant_start(self.cfg, ids):].to(self.device)).cpu()
        return talker_prompt(self.cfg, ids, tail, None, self.tts_special, user_rows=False)

    def forced_rows(self, ids: list[int]) -> torch.Tensor:
        """The talker rows [len(ids), H] of given tokens (lookups in the embedding table), on the host."""
        return self.model.model.embed_tokens(torch.tensor(ids, device=self.device)).cpu()

    # ---- sampling
    def sample(self, jobs: list[ThinkerJob], logits: torch.Tensor) -> Sampled:
        """Each row's token from logits [n, V] (row i: jobs[i]), its log probabilities (log-softmax
        of the raw logits, for the rows that asked) and its talker row."""
        logits = logits.float()
        asked = [i for i, j in enumerate(jobs) if j.top_logprobs is not None]
        # before _choose, which may mask EOS in place; only the rows that asked (none: no cost)
        logprobs = logits[torch.tensor(asked, device=logits.device)].log_softmax(-1) if asked else None
        tokens = self._choose(jobs, logits)
        entries = self._logprobs(jobs, tokens, asked, logprobs) if asked else {}
        kept = [i for i, t in enumerate(tokens) if t >= 0]
        rows: list[torch.Tensor | None] = [None] * len(jobs)
        if any(jobs[i].talker_rows for i in kept):
            embeds = self.model.model.embed_tokens(torch.tensor([tokens[i] for i in kept], device=self.device)).cpu()
            for r, i in enumerate(kept):
                if jobs[i].talker_rows:
                    rows[i] = embeds[r]
        return Sampled(tokens, entries, rows)

    def _choose(self, jobs: list[ThinkerJob], logits: torch.Tensor) -> list[int]:
        """Each row's token from logits [n, V] float32, or -1 for a row whose logits are not finite
        (or overflow once penalised / scaled): the flags ride in the one host read of the ids.
        Constrained rows (a matcher) choose among the tokens their grammar allows; the others
        in the same batch are untouched."""
        grammar = self._grammar_masks(jobs)   # filled on the host while the device still runs the forward
        finite = finite_rows(logits)       # [n] bool, before the EOS ban writes -inf
        ban = [i for i, j in enumerate(jobs) if len(j.generated) < j.min_tokens]
        if ban:
            rows = torch.tensor(ban, device=logits.device)
            logits[rows[:, None], self.eos[None, :]] = float("-inf")
        if grammar is not None:
            rows, mask = grammar
            banned = ~allowed(mask.to(logits.device, non_blocking=True), logits.shape[1])   # [k, V]
            if len(rows) == len(jobs):      # every row constrained: in place, no gather / scatter
                logits.masked_fill_(banned, float("-inf"))
            else:
                rows = rows.to(logits.device, non_blocking=True)
                logits[rows] = logits[rows].masked_fill(banned, float("-inf"))
        if all(j.params.greedy and j.params.repetition_penalty == 1.0 for j in jobs):
            return torch.where(finite, logits.argmax(-1), -1).tolist()
        # every row at once (`sample_rows`); a sampled row draws its noise from its own generator
        for i, j in enumerate(jobs):
            if j.params.repetition_penalty != 1.0:
                logits[i] = penalize_seen(logits[i], self.seen_ids(j, logits.shape[1]), j.params.repetition_penalty)
        v = logits.shape[1]
        tokens, ok = sample_rows(logits, RowSampling.of([j.params for j in jobs], v, logits.device),
                                 exponential_noise([j.generator for j in jobs], v, logits.device))
        return torch.where(finite & ok, tokens, -1).tolist()

    def seen_ids(self, job: ThinkerJob, width: int) -> torch.Tensor:
        """[width] bool on the device: the ids in the job's prompt and its reply so far (what its
        repetition penalty reads), made once from the prompt and marked as the reply grows: a long
        conversation's 26k-token context is not gathered again at every decode step."""
        if job.seen is None or job.seen[0] is not job.prompt:
            mask = torch.zeros(width, dtype=torch.bool, device=self.device)
            mask[torch.from_numpy(job.prompt_ids()).to(self.device)] = True
            job.seen, job.seen_upto = (job.prompt, mask), 0
        mask = job.seen[1]
        if job.seen_upto < len(job.generated):
            mask[torch.tensor(job.generated[job.seen_upto:], device=self.device)] = True
            job.seen_upto = len(job.generated)
        return mask

    def _grammar_masks(self, jobs: list[ThinkerJob]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The constrained rows' indices [k] and their token bitmasks [k, words] int32 on the host
        (pinned on CUDA, so the copies do not wait), each row filled by its request's matcher;
        None when no row is constrained."""
        rows = [i for i, j in enumerate(jobs) if j.matcher is not None]
        if not rows:
            return None
        words = (self.cfg.text.vocab_size + 31) // 32
        if self._mask_host is None or self._mask_host.shape[0] < len(rows):
            # reused: the step's host read of the ids comes after the copy, so a later fill never races it
            pin = self.device.type == "cuda"
            self._mask_host = torch.empty(len(jobs), words, dtype=torch.int32, pin_memory=pin)
            self._rows_host = torch.empty(len(jobs), dtype=torch.long, pin_memory=pin)
        mask, index = self._mask_host[:len(rows)], self._rows_host[:len(rows)]
        for r, i in enumerate(rows):
            jobs[i].matcher.fill(mask, r)
            index[r] = i
        return index, mask

    def _logprobs(self, jobs: list[ThinkerJob], tokens: list[int], asked: list[int],
                  logprobs: torch.Tensor) -> dict[int, TokenLogprob]:
        """Each asking row's chosen token's log probability and its top alternatives (log-softmax of
        the raw logits, `logprobs` [len(asked), V]), by row index; rows whose token failed get none.
        One host read for all of them."""
        k = max(jobs[i].top_logprobs for i in asked)
        chosen = torch.tensor([max(tokens[i], 0) for i in asked], device=logprobs.device)
        values = logprobs.gather(1, chosen[:, None])
        if k:
            top = torch.topk(logprobs, k, dim=-1)
            values = torch.cat((values, top.values), dim=1)
            top_ids = top.indices.cpu().tolist()
        values = values.cpu().tolist()
        out = {}
        for r, i in enumerate(asked):
            if tokens[i] < 0:
                continue
            top = tuple(zip(top_ids[r][:jobs[i].top_logprobs], values[r][1:])) if k else ()
            out[i] = TokenLogprob(tokens[i], values[r][0], top)
        return out
