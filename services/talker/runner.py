"""Talker model runner: the talker on its device, its paged KV cache and prefix cache, CUDA graphs
and sampling.

KV memory is one pool of blocks shared by all sequences (runtime/block_pool.py, runtime/paged_kv.py,
as the thinker's): a request takes the blocks of its prompt at admission -- the published blocks of
its longest cached prefix of user rows, new ones for the rest -- and one more whenever its decode
crosses a block boundary. Only user rows are ever published (hashed by what they are: their token
ids and, for multimodal rows, their run's key, runtime/row_keys.py); the assistant head, the tts
rows and the frames' inputs depend on the reply and the speaker.

A step: the prefill of the requests admitted now (an early one without its prompt's last row: see
scheduler.py) -- prompts without a cached prefix right-padded into one forward (CUDA graphs with
block tables as inputs), the others (a cached prefix, or a recompute after a preemption) from
their first uncached position, right-padded in the extend graphs (runtime/extend.py) where their
new rows fit, else packed into one eager forward -- then one codec-0 forward over the
requests that decode (block tables as graph inputs), then code 0 and the code predictor's residual
codes for every row that made logits (`frames`), and one host read of the whole step: the frames
of rows that stop are dropped. Greedy batches pick code 0 with one Triton kernel and replay the
greedy predictor graphs. A batch with a sampled row draws each sampled row's noise for the whole
frame from its own generator (one launch a row), picks code 0 for all rows at once and replays the
sampled predictor graphs, which sample inside the graph (runtime/sampling.py: `sample_rows`);
greedy rows in it get exactly their greedy codes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from voxpipe import kernels

from ..runtime import metrics
from ..runtime.block_pool import KVBlockManager
from ..runtime.config import TalkerConfig
from ..runtime.cuda_graphs import GraphedStep, buckets, captured, graphs_available
from ..runtime.extend import ExtendRows, capture_extend, extend_forward
from ..runtime.kv_plan import KVPlan
from ..runtime.paged_kv import PagedKVCache, PagedPackedStep
from ..runtime.row_keys import mm_runs, user_row_spans
from ..runtime.sampling import RowSampling, SamplingParams, exponential_noise, finite_rows, sample_rows
from ..runtime.warm import packed_shapes, warm_packed, warm_sampling
from .job import TalkerJob
from .model import TalkerModel, ThinkerTextEmbedding
from .scheduler import PROMPT_TAIL

# transformers samples the code predictor with these whenever the talker samples
PREDICTOR_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.8)


def greedy_codes(usable: list[torch.Tensor]):
    """The code predictor's greedy `pick`: argmax per row; appends each pass's per-row finite flags
    [B] bool to `usable` (static shapes, no host sync: it runs inside the predictor's CUDA graph)."""

    def pick_codes(logits: torch.Tensor, group: int) -> torch.Tensor:
        usable.append(finite_rows(logits))
        return logits.argmax(-1)

    return pick_codes


@dataclass
class Frames:
    """Whole frames of a step's rows."""

    codes: torch.Tensor        # [rows, G] uint16 on the host: code 0, then the G - 1 residual codes
    code0_usable: list[int]    # per row: 1 if its codec-0 logits (penalised, scaled) were finite
    usable: list[int]          # per row: 1 if every code predictor logit of its frame was finite too
    next_inputs: torch.Tensor  # [rows, Hk] on the device: each row's next input (its G code embeddings summed)


class TalkerRunner:
    def __init__(self, model: TalkerModel, cfg: TalkerConfig, *, device: torch.device, max_active: int,
                 max_len: int, kv: KVPlan, cuda_graphs: bool = True, prefill_batch: int = 8,
                 prefill_graph_len: int = 512, decode_graph_len: int | None = None, eager_fallback: bool = False,
                 text_table: ThinkerTextEmbedding | None = None, prefill_tokens: int = 4096) -> None:
        """Prompts up to `prefill_graph_len` rows, `prefill_batch` at a time, replay CUDA graphs (from
        position 0, or going on from their cached blocks), and decode steps whose longest sequence
        is within `decode_graph_len` positions (default: the whole context: a step past them runs
        eagerly, turns 39-40 of a 40-turn conversation took ~1.2 s to first audio that way).
        `prefill_tokens`: a step's prefill row budget (the scheduler's), warmed up at start.
        `text_table`: the thinker's embedding table, for prompts whose user turns come as token ids."""
        self.model, self.cfg, self.device = model, cfg, device
        self.text_table = text_table
        self.dtype = next(model.parameters()).dtype
        t = cfg.text
        self.cache = PagedKVCache(t.num_layers, kv.blocks, kv.block_size, t.num_kv_heads, t.head_dim, self.dtype, device)
        self.blocks = KVBlockManager(kv.blocks, kv.block_size, kv.prefix_cache)
        suppress = torch.zeros(t.vocab_size, dtype=torch.bool, device=device)
        suppress[list(cfg.suppressed_tokens)] = True
        suppress[cfg.codec.eos] = False
        self.suppress = suppress
        self.seen = torch.zeros(max_active, t.vocab_size, dtype=torch.bool, device=device)  # codec-0 ids per slot
        self._free = list(range(max_active - 1, -1, -1))      # free rows of `seen` (pop from the end)
        self.predictor_vocab = cfg.code_predictor.vocab_size
        self.max_len, self.prefill_tokens = max_len, prefill_tokens
        self.step_graphs = self.predictor_graphs = self.sampled_predictor_graphs = None
        self.prefill_graphs = self.extend_graphs = None
        if cuda_graphs and graphs_available(device):
            self._capture(max_active, min(decode_graph_len or max_len, max_len), min(prefill_batch, max_active),
                          min(prefill_graph_len, max_len), eager_fallback)
        self.warm_len = min(prefill_graph_len, max_len)
        self.warmed = self.step_graphs is not None and device.type == "cuda"
        if self.warmed:
            self.warm_up(self.warm_len)

    @torch.inference_mode()
    def warm_up(self, graph_len: int) -> None:
        """Run once, at start, what the graphs do not cover (runtime/warm.py): the eager packed
        prefill (long and short segments of each class, odd starts, and one of the step's row
        budget `prefill_tokens`, for the allocator), the eager right-padded prefill past the prefill
        graphs (`graph_len` rows), an eager codec step past the step graphs, and code 0's greedy
        kernel and sampled rows (the code predictor always replays its graphs)."""
        dev, null, h = self.device, self.cache.null, self.cfg.text.hidden_size
        longest = min(self.max_len, self.prefill_tokens)
        warm_packed(lambda x, positions, view, last: self.model(x, positions, view, last=last), self.cache,
                    self.blocks, h, self.dtype, packed_shapes(graph_len) + ((longest,),))
        for n, s in ((1, graph_len + 37), (2, graph_len + 16)):
            s = min(s, self.max_len)
            self._prefill_fn(n, s, torch.zeros(n, s, h, dtype=self.dtype, device=dev),
                             torch.full((n,), s - 1, device=dev),
                             torch.full((n, self.blocks.blocks_for(s)), null, dtype=torch.long, device=dev))
        kv_graphs = self.step_graphs.kv_lens[-1]
        if kv_graphs < self.max_len:
            kv = kv_graphs + 1
            self._step_fn(1, kv, torch.zeros(1, 1, h, dtype=self.dtype, device=dev), torch.tensor([kv - 1], device=dev),
                          torch.full((1, self.blocks.blocks_for(kv)), null, dtype=torch.long, device=dev))
        v = self.cfg.text.vocab_size
        for n in (1, 3):
            kernels.sampling.run(torch.zeros(n, v, device=dev), self.suppress, torch.zeros(n, dtype=torch.bool, device=dev),
                                 self.cfg.codec.eos)
        warm_sampling(v, dev)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    @torch.inference_mode()
    def _capture(self, max_active: int, decode_len: int, n: int, prefill_len: int, eager_fallback: bool) -> None:
        """Each step's graphs, or GraphCaptureError (with `eager_fallback`: that step runs eagerly)."""
        h, dev = self.cfg.text.hidden_size, self.device
        null = self.cache.null
        self.prefill_width = self.blocks.blocks_for(prefill_len)
        self.prefill_graphs = captured("talker prefill", lambda: GraphedStep(
            self._prefill_fn, (torch.zeros(n, prefill_len, h, dtype=self.dtype, device=dev),
                               torch.zeros(n, dtype=torch.long, device=dev),
                               torch.full((n, self.prefill_width), null, dtype=torch.long, device=dev)),
            buckets(n), buckets(prefill_len, min(32, prefill_len)), "talker prefill",
            pad=(None, 0, null)), eager_fallback)   # padding rows: the null table (writes go to scratch)
        # prompts going on from their cached blocks (a hit, a recompute): up to prefill_len new rows
        # each, tables as wide as the context
        self.extend_width = self.blocks.blocks_for(self.max_len)
        self.extend_graphs = capture_extend("talker extend", self._extend_fn, n, prefill_len, h, self.dtype,
                                            self.cache, self.extend_width, eager_fallback)
        self.step_graphs = captured("talker step", lambda: GraphedStep(
            self._step_fn, (torch.zeros(max_active, 1, h, dtype=self.dtype, device=dev),
                            torch.zeros(max_active, dtype=torch.long, device=dev),
                            torch.full((max_active, self.blocks.blocks_for(decode_len)), null, dtype=torch.long,
                                       device=dev)),
            buckets(max_active), buckets(decode_len, min(256, decode_len)), "talker step",
            pad=(None, 0, null)), eager_fallback)
        self.predictor_graphs = captured("code predictor", lambda: GraphedStep(
            self._predict_fn, (torch.zeros(max_active, h, dtype=self.dtype, device=dev),
                               torch.zeros(max_active, dtype=torch.long, device=dev)),
            buckets(max_active), [1], "code predictor (15 steps)"), eager_fallback)
        g, vp = self.cfg.num_code_groups - 1, self.predictor_vocab
        self.sampled_predictor_graphs = captured("sampled code predictor", lambda: GraphedStep(
            self._predict_sampled_fn, (torch.zeros(max_active, h, dtype=self.dtype, device=dev),
                                       torch.zeros(max_active, dtype=torch.long, device=dev),
                                       *RowSampling.empty(max_active, dev).tensors(),
                                       torch.ones(max_active, g, vp, device=dev)),
            buckets(max_active), [1], "sampled code predictor (15 steps)"), eager_fallback)

    def _prefill_fn(self, n: int, s: int, x: torch.Tensor, last: torch.Tensor,
                    tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts [n, >= s, H] (right-padded to s) from position 0 into their blocks (tables [n, M],
        padded with the null block): codec-0 logits [n, V] and final hidden [n, H] at each prompt's
        `last` position."""
        positions = torch.arange(s, device=x.device)[None].expand(n, s)
        return self.model(x[:, :s], positions, self.cache.prefill_view(tables, s), last=last)

    def _extend_fn(self, n: int, s: int, x: torch.Tensor, start: torch.Tensor, length: torch.Tensor,
                   last: torch.Tensor, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts going on from their blocks: row b's length[b] new rows ([n, >= s, H], right-padded
        to s) at positions start[b] ..., into its blocks (tables [n, M], M * block_size >= max_len):
        codec-0 logits [n, V] and final hidden [n, H] at each row's `last` new row."""
        return extend_forward(self.model, self.cache, s, x, start, length, tables, self.max_len, last=last)

    def _step_fn(self, n: int, kv_len: int, x: torch.Tensor, start: torch.Tensor,
                 tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One codec step for n sequences: x [n, 1, H] inputs, start [n] their positions, tables [n, M]."""
        return self.model(x, start[:, None], self.cache.decode_view(n, kv_len, tables, start))

    def _predict_fn(self, n: int, _kv: int, hidden: torch.Tensor,
                    code0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Greedy residual codes [n, G-1], the next input's codec part (sum of all G embeddings)
        [n, H], and whether every pass's logits were finite [n] bool."""
        code0_embed = self.model.model.codec_embedding(code0)
        usable: list[torch.Tensor] = []
        residual, embeds = self.model.code_predictor.predict(hidden, code0_embed, greedy_codes(usable))
        return residual, torch.stack([code0_embed] + embeds, dim=1).sum(1), torch.stack(usable, 1).all(1)

    def _predict_sampled_fn(self, n: int, _kv: int, hidden: torch.Tensor, code0: torch.Tensor,
                            greedy: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                            drop_below: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`_predict_fn` with each row's codes sampled (RowSampling's tensors) with its noise
        [n, G-1, Vp]: pass g reads noise[:, g - 1]."""
        rows = RowSampling(greedy, temperature, top_k, drop_below)
        code0_embed = self.model.model.codec_embedding(code0)
        usable: list[torch.Tensor] = []

        def pick_codes(logits: torch.Tensor, group: int) -> torch.Tensor:
            ids, ok = sample_rows(logits.float(), rows, noise[:, group - 1])
            usable.append(finite_rows(logits) & ok)
            return ids

        residual, embeds = self.model.code_predictor.predict(hidden, code0_embed, pick_codes)
        return residual, torch.stack([code0_embed] + embeds, dim=1).sum(1), torch.stack(usable, 1).all(1)

    # ---- slots (rows of the per-request state) and KV blocks
    @property
    def free_slots(self) -> int:
        return len(self._free)

    def _context(self, job: TalkerJob) -> int:
        """Positions its admission covers: its prompt (the whole, also for an early prefill: one row
        more than it writes), or after a preemption every position it had written."""
        return job.next_position() if job.resumed else job.prompt_rows

    def fits(self, job: TalkerJob, headroom: int = 0) -> bool:
        """Whether the pool has the blocks for `job`'s context and its next position now, without a
        cached prefix but the blocks it holds (`hold`), and `headroom` blocks more."""
        need = self.blocks.blocks_for(self._context(job) + 1) - len(job.pinned)
        return need + headroom <= self.blocks.pool.free

    def blocks_needed(self, jobs: list[TalkerJob]) -> int:
        """New blocks the next decode step of `jobs` takes (those whose next position opens a block)."""
        return sum(1 for j in jobs
                   if j.table is not None and self.blocks.blocks_for(j.next_position() + 1) > len(j.table.blocks))

    def allocate(self, job: TalkerJob, headroom: int = 0) -> bool:
        """A slot and the job's blocks: its cached prefix of user rows and new blocks for the rest of
        its context and its next position, leaving `headroom` blocks free (the running requests'
        next decode step). False (nothing taken) when the pool lacks them."""
        if not self._free or not self.fits(job, headroom):
            return False
        if job.keys is None:
            self._identify(job)
        ctx = self._context(job)
        keys = job.keys[:ctx]
        if ctx > len(job.keys):        # resumed: the decode inputs it had fed (never published)
            keys = np.concatenate((keys, np.full(ctx - len(job.keys), -1, dtype=np.int64)))
        table = self.blocks.admit(keys, job.spans, reserve=1, max_cached=job.cacheable)
        if table is None:
            return False
        job.table, job.kv_trusted = table, True
        job.slot = self._free.pop()
        self.seen[job.slot] = False
        if job.codes0:          # resumed: the codes it made so far, for its repetition penalty
            self.seen[job.slot, torch.tensor(job.codes0, device=self.device)] = True
        if not job.resumed:
            job.cached_tokens = table.cached_tokens
            metrics.PREFIX_TOKENS.labels("talker", "queried").inc(job.prompt_rows)
            metrics.PREFIX_TOKENS.labels("talker", "hit").inc(table.cached_tokens)
        return True

    def _identify(self, job: TalkerJob) -> None:
        """What its prompt rows are for the prefix hashes: the user token ids (then -1 for the rest of
        the prompt, never published), its multimodal runs keyed by TalkerPrompt.audio_keys, and how
        many first user rows those name (`cacheable`): all of them, or up to the first multimodal row
        when the keys are missing, or none when the caller's own text rows are not the embeddings of
        their ids (rows given, not looked up here)."""
        mask = job.user_mm_mask.cpu().numpy()
        users = mask.shape[0]
        job.keys = np.full(users + PROMPT_TAIL, -1, dtype=np.int64)
        if job.user_ids is not None:
            job.keys[:users] = job.user_ids.cpu().numpy()
        ids = job.keys[:users]
        job.cacheable = 0
        if not self.blocks.enable_caching or job.user_ids is None:
            return
        runs = mm_runs(mask)
        if job.user_rows is not None and not self._rows_are_embeddings(job):
            return
        if runs and len(job.audio_keys) != len(runs):
            job.cacheable = runs[0][0]
            return
        job.spans = user_row_spans(mask, job.audio_keys)
        job.cacheable = len(ids)

    def _rows_are_embeddings(self, job: TalkerJob) -> bool:
        """Whether the caller's text user rows equal this talker's embeddings of their token ids."""
        if self.text_table is None:
            return False
        text = ~job.user_mm_mask
        if not bool(text.any()):
            return True
        ids = job.user_ids[text]
        if int(ids.min()) < 0 or int(ids.max()) >= self.text_table.weight.shape[0]:   # the caller's own ids
            return False
        want = self.text_table(ids.to(self.device))
        return torch.equal(job.user_rows[text].to(self.device, want.dtype), want)

    def hold(self, job: TalkerJob) -> None:
        """For a prompt whose audio rows follow: find its cached prefix of user rows now and keep its
        blocks (referenced until the job ends, preemptions included: the rows it was not sent are
        never needed again), setting `held_rows` / `held_audio`."""
        self._identify(job)
        bs = self.blocks.block_size
        usable = min((job.prompt_rows - 1) // bs, job.cacheable // bs)
        if not usable:
            return
        pool = self.blocks.pool
        hit = pool.lookup(self.blocks.hasher(job.keys[:usable * bs], job.spans))
        # kept only while the rest of its blocks are free beside them: held blocks of waiting requests
        # are no longer free, so a pool that could not hold the request with them does not hold them
        if hit:     # the longest run k of them whose rest fits: need(k) <= free - (free blocks among the k)
            free_among = np.cumsum(pool.refs[hit] == 0)
            k = len(hit)
            while k and self.blocks.blocks_for(job.prompt_rows + 1) - k > pool.free - int(free_among[k - 1]):
                k -= 1
            del hit[k:]
        job.pinned = hit
        pool.take(job.pinned)
        job.held_rows = len(job.pinned) * bs
        job.held_audio = int(job.user_mm_mask[:job.held_rows].sum())

    def grow(self, job: TalkerJob) -> bool:
        """A block for the job's next decode position; False (nothing taken) when none is free."""
        return self.blocks.grow(job.table, job.next_position() + 1)

    def publish(self, job: TalkerJob) -> None:
        """Publish the job's full blocks of cacheable user rows (after an output of it was finite:
        its attention read every earlier position, so its keys there are finite)."""
        if job.table is None or not job.kv_trusted:
            return
        computed = min(job.next_position(), job.cacheable)
        if computed // self.blocks.block_size > job.table.published:
            self.blocks.publish(job.table, job.keys, computed, job.spans)

    def release(self, job: TalkerJob, keep_held: bool = False) -> None:
        """Give the job's blocks (published ones stay findable) and its slot back; its held blocks
        too unless `keep_held`."""
        if job.pinned and not keep_held:
            self.blocks.pool.release(job.pinned)
            job.pinned = []
        if job.table is not None:
            self.blocks.release(job.table, trusted=job.kv_trusted)
            job.table = None
        if job.slot is not None:
            self._free.append(job.slot)
            job.slot = None

    def preempt(self, job: TalkerJob) -> None:
        """Free a running job's blocks and slot to make room: it waits again and recomputes every
        position it had written (its prompt and its decode inputs) before decoding on, its frames
        unchanged. A job admitted in this step whose prefill has not run gives its blocks back only."""
        self.release(job, keep_held=True)
        if job.prompt_len:
            job.resumed = True
            self.blocks.stats.preempted += 1
            metrics.PREEMPTIONS.labels("talker").inc()
        else:
            job.early = False

    def observe_kv(self) -> None:
        """The KV gauges (after a step)."""
        pool = self.blocks.pool
        metrics.KV_BLOCKS.labels("talker", "used").set(pool.used)
        metrics.KV_BLOCKS.labels("talker", "free").set(pool.free)
        metrics.KV_BLOCKS.labels("talker", "cached").set(pool.cached)

    def scrub(self, job: TalkerJob) -> None:
        """Zero the blocks the job wrote and the graphs' float inputs, so that nothing its non-finite
        numbers left on the device reaches a later request; its blocks are never published."""
        job.kv_trusted = False
        if job.table is not None:
            self.cache.scrub(job.table.blocks[job.table.cached_tokens // self.blocks.block_size:])
        for graphs in (self.step_graphs, self.predictor_graphs, self.sampled_predictor_graphs, self.prefill_graphs,
                       self.extend_graphs):
            if graphs is not None:
                graphs.scrub()

    def _tables(self, jobs: list[TalkerJob], width: int) -> torch.Tensor:
        return self.cache.table_tensor([j.table.array() for j in jobs], width, self.device)

    # ---- forwards
    def forward(self, prefill: list[TalkerJob], decode: list[TalkerJob],
                text_rows: list[torch.Tensor]) -> tuple[list[TalkerJob], torch.Tensor, torch.Tensor]:
        """The step's forwards: the prefill of the `prefill` jobs, then the codec step of the `decode`
        jobs (each with its text row). The jobs that made logits (prefilled first, then decoded), their
        codec-0 logits [n, V] float32 and final hidden rows [n, Hk]. An early prefill and a recompute
        after a preemption make none."""
        results: list[tuple[TalkerJob, torch.Tensor, torch.Tensor]] = []
        if prefill:
            results.extend(self._prefill(prefill))
        if decode:
            results.extend(self._decode(decode, text_rows))
        if not results:       # early prefills and recomputes only: no frame this step
            return [], torch.empty(0), torch.empty(0)
        return ([r[0] for r in results], torch.stack([r[1] for r in results]).float(),
                torch.stack([r[2] for r in results]))

    def _prefill(self, jobs: list[TalkerJob]) -> list[tuple[TalkerJob, torch.Tensor, torch.Tensor]]:
        """The jobs' prefills: those from position 0 right-padded into one forward, those with a cached
        prefix or a recompute right-padded into an extend graph (those that fit) and packed into one
        eager forward (the rest). (job, codec-0 logits [V], hidden [Hk]) for each job
        that makes frame 0 now (not early, not resumed). An `early` job's prompt goes without its last
        row; its next input is that row's codec part, which its frame-0 decode step adds to text row
        0's projection."""
        dev = self.device
        bos = self.model.model.codec_embedding.weight[self.cfg.codec.bos]           # a view: no lookup
        rows = {}
        for j in jobs:
            rows[id(j)] = self._rows(j, j.table.cached_tokens)
            if not j.resumed:
                j.prompt_len = j.prompt_rows
                j.generator = j.params.generator(dev)
                if j.early:
                    j.pending = bos
        whole = [j for j in jobs if not j.resumed and not j.table.cached_tokens]
        extend, packed = self._going_on([j for j in jobs if j.resumed or j.table.cached_tokens], rows)
        out = []
        if whole:
            logits, hidden = self._prefill_whole(whole, [rows[id(j)] for j in whole])
            out += [(j, logits[b], hidden[b]) for b, j in enumerate(whole) if not j.early]
        for part, run in ((extend, self._prefill_extend), (packed, self._prefill_packed)):
            if part:
                logits, hidden = run(part, [rows[id(j)] for j in part])
                out += [(j, logits[b], hidden[b]) for b, j in enumerate(part) if not j.early and not j.resumed]
        for j in jobs:
            j.resumed = False
        return out

    def _rows(self, job: TalkerJob, start: int = 0) -> torch.Tensor:
        """[positions - start, Hk]: what its prefill writes from position `start` (its first uncached
        one: a user row) -- its prompt (without the last row when early) and, resumed after a
        preemption, every decode input it had fed."""
        x = self._prompt(job, last_row=not job.early, start=start)
        if job.resumed and job.inputs:
            x = torch.cat((x, torch.stack(job.inputs).to(x.dtype)))
        return x

    def _prefill_whole(self, jobs: list[TalkerJob], prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts from position 0, right-padded into one forward: codec-0 logits [n, V], hidden [n, Hk]."""
        dev = self.device
        lengths = [p.shape[0] for p in prompts]
        n, s = len(jobs), max(lengths)
        x = torch.nn.utils.rnn.pad_sequence(prompts, batch_first=True)                   # [n, s, Hk]
        last = torch.tensor([k - 1 for k in lengths]).to(dev, non_blocking=True)
        g = self.prefill_graphs
        if g is not None and g.fits(n, s):   # padding rows and positions write the scratch block
            return g(n, s, x, last, self._tables(jobs, self.prefill_width))
        return self._prefill_fn(n, s, x, last, self._tables(jobs, self.blocks.blocks_for(s)))

    def _going_on(self, jobs: list[TalkerJob],
                  rows: dict[int, torch.Tensor]) -> tuple[list[TalkerJob], list[TalkerJob]]:
        """Jobs that go on from their blocks (a cached prefix, a recompute), split into those whose new
        rows fit the extend graphs (as many as their batch holds) and the rest (eager, packed)."""
        g = self.extend_graphs
        if g is None:
            return [], jobs
        fit = [j for j in jobs if g.fits(1, rows[id(j)].shape[0])][:g.batch_sizes[-1]]
        return fit, [j for j in jobs if not any(j is f for f in fit)]

    def _prefill_extend(self, jobs: list[TalkerJob], rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each job's rows from its first uncached position (`rows`: those alone), one right-padded row
        each, in the extend graph: codec-0 logits [n, V] and hidden [n, Hk] at each one's last row."""
        part = ExtendRows.of([(r, j.table.cached_tokens) for j, r in zip(jobs, rows)],
                             self.device)
        # the tables at the graphs' width, null past each job's blocks: no stale columns
        return self.extend_graphs(len(jobs), part.longest, part.x, part.start, part.length, part.last,
                                  self._tables(jobs, self.extend_width))

    def _prefill_packed(self, jobs: list[TalkerJob], rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each job's rows from its first uncached position (`rows`: those alone), packed into one row (eager), each attending
        to its earlier positions: codec-0 logits [n, V] and hidden [n, Hk] at each one's last row."""
        dev = self.device
        parts = [(j.table.blocks, j.table.cached_tokens, r.shape[0]) for j, r in zip(jobs, rows)]
        step = PagedPackedStep.pack(parts)
        x = torch.cat(rows)[None]
        return self.model(x, step.positions(dev), self.cache.packed(step), last=step.ends(dev))

    def _decode(self, jobs: list[TalkerJob],
                text_rows: list[torch.Tensor]) -> list[tuple[TalkerJob, torch.Tensor, torch.Tensor]]:
        """One codec step over `jobs` (each with its text row and a block for its next position):
        (job, codec-0 logits [V], hidden [Hk]) per job. Each input is kept (a recompute replays it)."""
        n = len(jobs)
        x = torch.stack([j.pending for j in jobs]) + self._project(text_rows)          # [n, Hk]
        start_list = [j.next_position() for j in jobs]
        start = torch.tensor(start_list).to(self.device, non_blocking=True)
        kv_len = max(start_list) + 1
        for j, row in zip(jobs, x):
            j.inputs.append(row)
            j.pending = None
        g = self.step_graphs
        if g is not None and g.fits(n, kv_len):   # the tables at the graphs' width: no stale columns
            logits, hidden = g(n, kv_len, x[:, None], start, self._tables(jobs, g.static[2].shape[1]))
        else:
            logits, hidden = self._step_fn(n, kv_len, x[:, None], start,
                                           self._tables(jobs, self.blocks.blocks_for(kv_len)))
        return [(j, logits[i], hidden[i]) for i, j in enumerate(jobs)]

    def _project(self, rows: list[torch.Tensor]) -> torch.Tensor:
        return self.model.text_projection(self._thinker_rows(rows))

    def _thinker_rows(self, rows: list[torch.Tensor]) -> torch.Tensor:
        """Text rows [n, H] on the device in the talker's dtype from a job's rows: [H] rows as they came,
        0-dim int64 token ids looked up in the thinker's embedding table (the values the thinker sends)."""
        dev, dt = self.device, self.dtype
        ids = [i for i, r in enumerate(rows) if r.dim() == 0]
        if not ids:
            return torch.stack(rows).to(dev, dt)
        looked = self.text_table(torch.stack([rows[i] for i in ids]).to(dev)).to(dt)
        if len(ids) == len(rows):
            return looked
        sent = [i for i, r in enumerate(rows) if r.dim()]
        x = torch.empty(len(rows), looked.shape[1], device=dev, dtype=dt)
        x[torch.tensor(ids, device=dev)] = looked
        x[torch.tensor(sent, device=dev)] = torch.stack([rows[i] for i in sent]).to(dev, dt)
        return x

    def _prompt(self, job: TalkerJob, last_row: bool = True, start: int = 0) -> torch.Tensor:
        """The talker's prompt rows [L - start, Hk] from row `start` (a user row: a cached prefix's rows
        are not made again): the user turns (text rows projected, audio rows through the hidden
        projection), the assistant head, four tts_pad, tts_bos and the first text row, each with its
        codec-side embedding (nothink, think_bos, think_eos, speaker, pad, bos). Without `last_row`:
        all but the last (the first text row need not be there)."""
        m, c = self.model, self.cfg.codec
        dev, dt = self.device, self.dtype
        mask = job.user_mm_mask[start:]                 # on the host: which rows are multimodal
        mm = mask.to(dev)
        if job.user_rows is not None:
            user = job.user_rows[start:].to(dev, dt)
        else:           # the user turns' text rows as token ids; the multimodal ones (if any) in audio_rows
            user = self.text_table(job.user_ids[start:].to(dev)).to(dt)
            if job.audio_rows is not None and job.audio_rows.shape[0]:
                first = int(job.user_mm_mask[:start].sum())      # audio rows before `start`
                if first < job.audio_rows.shape[0]:
                    user[mm] = job.audio_rows[first:].to(dev, dt)
        user_part = torch.empty(user.shape[0], self.cfg.text.hidden_size, device=dev, dtype=dt)
        if bool(mask.any()):
            user_part[mm] = m.hidden_projection(user[mm])
        if not bool(mask.all()):
            user_part[~mm] = m.text_projection(user[~mm])
        head = m.text_projection(job.head.to(dev, dt))                                    # [3, Hk]
        bos, _eos, pad = m.text_projection(job.special.to(dev, dt)).unbind(0)
        text_side = [head, pad.expand(4, -1), bos[None]]
        codec_ids = [c.nothink, c.think_bos, c.think_eos, job.speaker_id, c.pad]
        if last_row:
            text_side.append(m.text_projection(self._thinker_rows(job.rows[:1])))
            codec_ids.append(c.bos)
        text_side = torch.cat(text_side)                                           # [PROMPT_TAIL (- 1), Hk]
        codec_side = torch.cat((torch.zeros(3, text_side.shape[1], device=dev, dtype=dt),
                                m.model.codec_embedding(torch.tensor(codec_ids, device=dev))))
        return torch.cat((user_part, text_side + codec_side))

    # ---- sampling
    def _penalized(self, jobs: list[TalkerJob],
                   logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Codec-0 logits with each row's repetition penalty on the ids its slot has seen; the rows'
        slots [n]; whether each row is finite [n] bool (after the penalty, before any mask)."""
        slots = torch.tensor([j.slot for j in jobs], device=self.device)
        penalty = torch.tensor([j.params.repetition_penalty for j in jobs], device=self.device)[:, None]
        seen = self.seen[slots]
        logits = torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)
        return logits, slots, finite_rows(logits)

    def frames(self, jobs: list[TalkerJob], logits: torch.Tensor, hidden: torch.Tensor, ban: list[bool]) -> Frames:
        """Every row's whole frame: the repetition penalty, the suppress mask and the EOS ban (`ban`:
        per row), code 0, then the code predictor for every row straight away; the host reads code 0,
        the residual codes and the usable flags in one sync."""
        eos, dev, n = self.cfg.codec.eos, self.device, len(jobs)
        logits, slots, finite = self._penalized(jobs, logits)
        ban_rows = torch.tensor(ban).to(dev, non_blocking=True)
        if all(j.params.greedy for j in jobs):
            code0 = kernels.sampling.run(logits, self.suppress, ban_rows, eos)   # one Triton kernel on CUDA
            code0_ok = finite
            graphs, fn, extra = self.predictor_graphs, self._predict_fn, ()
        else:
            v, g, vp = logits.shape[1], self.cfg.num_code_groups - 1, self.predictor_vocab
            noise = exponential_noise([j.generator for j in jobs], v + g * vp, dev)   # code 0, then each pass
            masked = logits.masked_fill(self.suppress, float("-inf"))
            masked = masked.masked_fill(ban_rows[:, None] & (torch.arange(v, device=dev) == eos), float("-inf"))
            code0, ok = sample_rows(masked, RowSampling.of([j.params for j in jobs], v, dev), noise[:, :v])
            code0_ok = finite & ok
            predictor = RowSampling.of([SamplingParams() if j.params.greedy else PREDICTOR_SAMPLING for j in jobs],
                                       vp, dev)
            graphs, fn = self.sampled_predictor_graphs, self._predict_sampled_fn
            extra = (*predictor.tensors(), noise[:, v:].view(n, g, vp))
        self.seen[slots, code0] = True
        if graphs is not None and graphs.fits(n, 1):
            residual, nxt, predicted = graphs(n, 1, hidden, code0, *extra)
        else:
            residual, nxt, predicted = fn(n, 1, hidden, code0, *extra)
        # [n, G + 2]: the frame, then its two usable flags (one host read)
        host = torch.cat((code0[:, None], residual, code0_ok.long()[:, None], (code0_ok & predicted).long()[:, None]),
                         dim=1).to(torch.int64).cpu()
        # graph outputs are overwritten by the next replay
        return Frames(host[:, :-2].to(torch.uint16), host[:, -2].tolist(), host[:, -1].tolist(), nxt.clone())
