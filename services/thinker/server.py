"""Thinker gRPC service: `voxpipe thinker --model DIR --port N`."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
import uuid

import grpc
import numpy as np
import torch

from voxpipe.v1 import stages_pb2 as pb
from voxpipe.v1 import stages_pb2_grpc as pb_grpc

from ..runtime import metrics
from ..runtime.calls import abort, context_metadata, session_of
from ..runtime.config import OmniConfig
from ..runtime.downstream import NextStage
from ..runtime.echo import quoted
from ..runtime.engine import Outbox
from ..runtime.sampling import SamplingParams, check_audio_features
from ..runtime.outputs import Finished, FirstOutput, Routed, StageFinished, TalkerPromptOut, TextOut
from ..runtime.flags import add_thinker_arguments as add_arguments  # noqa: F401  (its flags)
from voxpipe.errors import ConfigError

from ..runtime.server import (Abort, StageServicer, finished_proto, load_stage_model,
                              routed_proto, serve_stage, stage_setup, talker_prompt_proto)
from ..runtime.tensors import TensorError, from_proto, ids_array, to_proto
from ..runtime.tracing import traced_rpc
from ..runtime.kv_plan import KVPlan, kv_plan as stage_kv_plan
from .engine import ThinkerEngine, assistant_head_index
from .constraint import Constraint
from .job import ForcedReply, ThinkerJob
from .model import ThinkerModel, audio_output_length
from .output import StreamText, TokenBytes, stop_strings_problem, top_logprobs_problem
from .prompt import encode_text, load_tokenizer, render, user_turn
from .relay import TalkerRelay
from .turns import StreamedTurns

DEFAULT_MAX_TOKENS = 1024
UNSPOKEN_TOOL_CALL = ("<tool_call>",)   # ThinkerStart.unspoken_tool_calls: the markup a call begins with
MAX_ASSISTANT_TEXT_CHARS = 32768    # ThinkerStart.assistant_text, checked before it is tokenized
COMPILE_WORKERS = 2                 # threads compiling constraints' grammars (each uses grammar.COMPILE_THREADS)
MERGED_ROWS_MAX_BYTES = 4 << 20     # text deltas merge into one message up to this many bytes of talker rows


class ThinkerServicer(StageServicer, pb_grpc.ThinkerServicer):
    """The engine's outputs are typed (runtime/outputs.py): a TalkerPromptOut first (talker rows),
    TextOuts, then the Finished; a spoken reply's relay adds Routed, FirstOutput and the talker's
    StageFinished. `to_proto` builds their messages on the event loop, after merging: the talker
    rows' and the prompt's tensors as bytes, each log probability's token bytes, and the text of a
    reply without stop strings, which the engine leaves out (output.py: StreamText, per stream)."""

    def __init__(self, engine: ThinkerEngine, opts, tokenizer, cfg: OmniConfig, talker: NextStage | None = None) -> None:
        super().__init__(engine, opts)
        self.tokenizer, self.cfg = tokenizer, cfg
        self.token_bytes = TokenBytes(tokenizer)
        self.talker = talker      # the talker replicas spoken replies go to (--talker); None: text only
        # constraints compile here (grammar.py), off the engine thread and the event loop
        self.compile_pool = ThreadPoolExecutor(max_workers=COMPILE_WORKERS, thread_name_prefix="thinker-grammar")
        # the vocabulary's bytes and the rules every JSON constraint shares, ready before a first constraint
        self.compile_pool.submit(lambda: engine.grammars.warm())
        self.turns = StreamedTurns(self)      # ThinkerStart.stream_audio (turns.py)

    def merge(self, first: object, then: object) -> TextOut | None:
        """Consecutive text outputs of one request travel as one (token ids, text, the talker's rows
        and log probabilities concatenated), up to MERGED_ROWS_MAX_BYTES of rows; the end of the
        talker's text (talker_end) stays at the end of one."""
        if not isinstance(first, TextOut) or not isinstance(then, TextOut):
            return None
        if then.index != first.index + first.count or (first.rows is None) != (then.rows is None):
            return None
        if (first.text is None) != (then.text is None) or first.talker_end:
            return None
        rows = None
        if first.rows is not None:
            a, b = first.rows, then.rows
            if a.nbytes + b.nbytes > MERGED_ROWS_MAX_BYTES or a.dtype != b.dtype or a.shape[1:] != b.shape[1:]:
                return None
            rows = torch.cat((a, b))
        text = None if first.text is None else first.text + then.text
        return TextOut(first.index, first.token_ids + then.token_ids, text, rows, first.logprobs + then.logprobs,
                       more=then.more, last=then.last, talker_end=then.talker_end)

    def to_proto(self, req: ThinkerJob, item: object) -> pb.ThinkerResponse:
        if isinstance(item, TextOut):
            msg = pb.ThinkerResponse()
            self.text_delta(req, item, msg.text)
            return msg
        if isinstance(item, Finished):
            return pb.ThinkerResponse(finished=finished_proto(item))
        if isinstance(item, TalkerPromptOut):
            msg = pb.ThinkerResponse()
            talker_prompt_proto(item, msg.talker_prompt)     # in place: no copy of its rows per nesting level
            return msg
        if isinstance(item, Routed):
            return pb.ThinkerResponse(routed=routed_proto(item))
        if isinstance(item, FirstOutput):
            return pb.ThinkerResponse(first_output=pb.FirstOutput(stage=item.stage))
        if isinstance(item, StageFinished):
            return pb.ThinkerResponse(talker_finished=finished_proto(item.finished))
        raise TypeError(f"the thinker has no message for {item!r}")

    def text(self, req: ThinkerJob, out: TextOut) -> str:
        """`out`'s text: the engine's, or (None) its tokens detokenized now, after the stream's earlier
        ones. Call it once per output, in the stream's order."""
        if out.text is not None:
            return out.text
        if req.stream_text is None:
            req.stream_text = StreamText(self.tokenizer)
        return req.stream_text(out)

    def text_delta(self, req: ThinkerJob, out: TextOut, delta: pb.TextDelta | None = None) -> pb.TextDelta:
        """`out` as a TextDelta, filled into `delta` (a message's field) when given."""
        delta = pb.TextDelta() if delta is None else delta
        delta.index = out.index
        delta.token_ids.extend(out.token_ids)
        delta.text = self.text(req, out)
        if out.rows is not None:
            to_proto(out.rows, delta.embeddings)
            delta.more = out.more
        for lp in out.logprobs:
            entry = delta.logprobs.add(token_id=lp.token_id, logprob=lp.logprob, token=self.token_bytes(lp.token_id))
            for t, v in lp.top:
                entry.top.add(token_id=t, logprob=v, token=self.token_bytes(t))
        return delta

    @traced_rpc("voxpipe.v1.Thinker", "Generate")
    async def Generate(self, request_iterator, context: grpc.aio.ServicerContext):
        it = request_iterator.__aiter__()
        try:
            session = session_of(context)
        except ValueError as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return
        job = await self.open_stream(it, context)
        if job is None:
            return
        job.session = session

        async def reader() -> None:
            async for msg in it:
                kind = msg.WhichOneof("kind")
                if kind == "cancel":
                    self.engine.cancel(job)
                    job.outbox.put(self.cancelled())
                    return
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected {kind} after start")

        if job.pending:        # a streamed turn: its audio until the commit, then the committed job
            job = await self.turns.stream(job, it, context)
            if job is None:
                yield pb.ThinkerResponse(finished=finished_proto(self.cancelled()))
                return
            job.session = session
        relay = (TalkerRelay(self.talker, job, job.speech, rows_as_ids=self.engine.talker_prompt_ids)
                 if job.speech is not None else None)
        # aclosing: the request is freed the moment this handler ends, not when the generator is collected
        async with aclosing(self.serve_request(job, context, reader, relay)) as outputs:
            async for item in outputs:
                yield item

    def make_job(self, start: pb.ThinkerStart) -> ThinkerJob:
        th = self.cfg.thinker
        audio = self._audio_features(start)
        if start.stream_audio:
            return self.turns.pending_job(start, audio)
        kind = start.WhichOneof("prompt")
        if kind == "text":
            try:
                ids = render(self.tokenizer, th, user_turn(start.text, audio)).token_ids
            except ValueError as e:
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        elif kind == "token_ids":
            try:
                array = ids_array(start.token_ids)
            except ValueError as e:
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return self.job_of(start, array.tolist(), audio, array=array)
        else:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "start needs a prompt: token_ids or text")
        return self.job_of(start, ids, audio)

    def _audio_features(self, start: pb.ThinkerStart) -> list[torch.Tensor]:
        th = self.cfg.thinker
        try:
            audio = [from_proto(t, dtype=torch.float32, shape=(th.audio.num_mel_bins, None), name=f"audio_features[{i}]")
                     for i, t in enumerate(start.audio_features)]
            check_audio_features(audio)
        except (TensorError, ValueError) as e:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if any(a.shape[1] == 0 for a in audio):
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "audio_features with zero frames")
        return audio

    def check_prompt(self, ids: list[int], audio: list[torch.Tensor], streamed_tokens: int = 0,
                     array: np.ndarray | None = None) -> None:
        """Token ids in the vocabulary, no image or video, and as many audio placeholders as the
        clips make (`streamed_tokens`: those of a streamed clip besides `audio`'s). `array`: `ids` as
        int64 (made here when not given); the checks run over it (a 26k-token prompt: ~0.1 ms)."""
        th = self.cfg.thinker
        if not ids:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "empty prompt")
        arr = array if array is not None else np.fromiter(ids, dtype=np.int64, count=len(ids))
        vocab = th.text.vocab_size
        out = np.flatnonzero((arr >= vocab) | (arr < 0))
        if out.size:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"token id {int(arr[out[0]])} out of range [0, {vocab})")
        tok = th.tokens
        if bool(np.any((arr == tok.image_token) | (arr == tok.video_token))):
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "image and video input are not supported")
        want = sum(audio_output_length(a.shape[1], th.audio.n_window) for a in audio) + streamed_tokens
        have = int(np.count_nonzero(arr == tok.audio_token))
        if have != want:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"prompt has {have} audio placeholder tokens but the "
                        f"{len(audio)} audio feature tensors make {want}")

    def job_of(self, start: pb.ThinkerStart, ids: list[int], audio: list[torch.Tensor],
               streamed_tokens: int = 0, array: np.ndarray | None = None) -> ThinkerJob:
        """The checked job of a start whose prompt is `ids` (`array`: the same as int64, when the
        wire gave it) with `audio`'s clips (and a streamed clip's `streamed_tokens` placeholders,
        whose keys the engine makes)."""
        th = self.cfg.thinker
        try:
            params = SamplingParams.from_proto(start.sampling)
        except ValueError as e:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if array is None and ids:
            array = np.fromiter(ids, dtype=np.int64, count=len(ids))
        self.check_prompt(ids, audio, streamed_tokens, array)
        speech = self._speech(start)
        rows = start.talker_rows or speech is not None
        if start.unspoken_tool_calls and not rows:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                        "unspoken_tool_calls needs talker rows (speech or talker_rows): it ends the talker's text")
        if rows and assistant_head_index(th, ids) is None:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"{'talker_rows' if start.talker_rows else 'speech'} needs a prompt ending in an assistant "
                        "turn start ('<|im_start|>assistant\\n'): render with add_generation_prompt")
        forced = self._forced(start, len(ids))
        if forced is not None:
            max_tokens = len(forced.token_ids)
        elif start.max_tokens:
            max_tokens = start.max_tokens
        else:   # no limit asked: DEFAULT_MAX_TOKENS, or what the context leaves (vLLM's and OpenAI's default), at least 1
            max_tokens = max(min(DEFAULT_MAX_TOKENS, self.engine.max_len - len(ids)), start.min_tokens, 1)
        if start.min_tokens > max_tokens:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"min_tokens {start.min_tokens} > max_tokens {max_tokens}")
        if len(ids) + max_tokens > self.engine.max_len:     # OUT_OF_RANGE: the request is past the context
            asked = f"max_tokens {max_tokens}" if start.max_tokens else \
                f"a reply of at least {max_tokens} token{'s' if max_tokens > 1 else ''}"
            raise Abort(grpc.StatusCode.OUT_OF_RANGE,
                        f"prompt of {len(ids)} tokens + {asked} exceeds the context of {self.engine.max_len}",
                        context_metadata(len(ids), max_tokens, self.engine.max_len))
        problem = stop_strings_problem(start.stop) or top_logprobs_problem(start.logprobs, start.top_logprobs)
        if problem is not None:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        constraint = self._constraint(start)
        return ThinkerJob(request_id=start.request_id or uuid.uuid4().hex, outbox=Outbox(asyncio.get_running_loop()),
                          prompt=ids, audio=audio, params=params, max_tokens=max_tokens, min_tokens=start.min_tokens,
                          talker_rows=rows, speech=speech, stops=tuple(start.stop),
                          unspoken=UNSPOKEN_TOOL_CALL if rows and start.unspoken_tool_calls else (),
                          top_logprobs=start.top_logprobs if start.logprobs else None, forced=forced,
                          audio_keys=None if streamed_tokens else self.engine.runner.audio.keys_soon(audio),
                          constraint=constraint, ids_cache=(ids, array))

    def _constraint(self, start: pb.ThinkerStart) -> Constraint | None:
        """The checked constraint of a start message (None: free text); compiled in `prepare`."""
        if not start.HasField("constraint"):
            return None
        if start.min_tokens:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                        "constraint excludes min_tokens: a constrained reply ends when its grammar is complete")
        try:
            return Constraint.from_proto(start.constraint)
        except ValueError as e:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def prepare(self, job: ThinkerJob) -> None:
        """A constrained job's grammar, compiled (or found in the cache) in the compile pool, never on
        the engine thread nor the event loop; a constraint that does not compile is INVALID_ARGUMENT
        naming it."""
        if job.constraint is None:
            return
        def compile_now():
            grammars = self.engine.grammars
            job.matcher = grammars.matcher(grammars.compile(job.constraint))
            self.engine.open_reply(job)       # the tokens its grammar forces first, before its admission
        try:
            await asyncio.get_running_loop().run_in_executor(self.compile_pool, compile_now)
        except ValueError as e:       # GrammarError, or JSON text that is not JSON
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def _forced(self, start: pb.ThinkerStart, prompt_tokens: int) -> ForcedReply | None:
        """The checked reply of a start message with assistant_text (None: the thinker generates)."""
        if not start.HasField("assistant_text"):
            return None
        text = start.assistant_text
        given = [name for name, present in (("sampling", start.HasField("sampling")), ("max_tokens", start.max_tokens),
                                            ("min_tokens", start.min_tokens), ("stop", start.stop),
                                            ("logprobs", start.logprobs or start.top_logprobs),
                                            ("constraint", start.HasField("constraint"))) if present]
        if given:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"assistant_text excludes {', '.join(given)}: the reply is given, nothing is sampled")
        if not text:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "assistant_text is empty")
        if len(text) > MAX_ASSISTANT_TEXT_CHARS:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"assistant_text has {len(text)} characters; the limit is {MAX_ASSISTANT_TEXT_CHARS}")
        ids = encode_text(self.tokenizer, text) + [self.cfg.thinker.tokens.im_end]
        if prompt_tokens + len(ids) > self.engine.max_len:
            raise Abort(grpc.StatusCode.OUT_OF_RANGE,
                        f"prompt of {prompt_tokens} tokens + assistant_text of {len(ids)} tokens (<|im_end|> included) "
                        f"exceeds the context of {self.engine.max_len}",
                        context_metadata(prompt_tokens, len(ids), self.engine.max_len))
        return ForcedReply(token_ids=ids, text=text)

    def _speech(self, start: pb.ThinkerStart) -> pb.SpeechParams | None:
        """The checked speech parameters of a start message (None: no spoken reply)."""
        if not start.HasField("speech"):
            return None
        if start.talker_rows:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "speech and talker_rows exclude each other")
        if self.talker is None:
            raise Abort(grpc.StatusCode.FAILED_PRECONDITION,
                        "this thinker has no talker to speak with (start it with --talker ADDR)")
        sp = start.speech
        speakers = self.cfg.talker.speakers
        if (sp.speaker.lower() or "ethan") not in speakers:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"unknown speaker {quoted(sp.speaker)}; valid: {', '.join(sorted(speakers))}")
        if sp.max_frames and sp.min_frames > sp.max_frames:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"speech.min_frames {sp.min_frames} > max_frames {sp.max_frames}")
        if sp.code2wav.encoding not in (pb.AUDIO_ENCODING_UNSPECIFIED, pb.AUDIO_PCM16, pb.AUDIO_FLOAT32):
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown audio encoding {sp.code2wav.encoding}")
        return sp


# CUDA memory a thinker keeps beside its weights and KV pool: activations of a prefill chunk, the
# decode graphs' gathered keys, the allocator's slack (bench/RESULTS.md: the pool sizing)
ACTIVATION_RESERVE_BYTES = 6 << 30


def kv_plan(args, cfg: OmniConfig, device: torch.device, dtype: torch.dtype) -> tuple[KVPlan, int]:
    """The thinker's KV pool and context (runtime/kv_plan.py)."""
    return stage_kv_plan(args, "thinker", cfg.thinker.text, device, dtype, activation_reserve=ACTIVATION_RESERVE_BYTES)


def build(args) -> tuple[ThinkerServicer, OmniConfig]:
    setup = stage_setup(args)      # bad flags fail before the weights load
    if args.prefill_chunk < 1:
        raise ConfigError(f"--prefill-chunk must be at least 1, got {args.prefill_chunk}")
    if not 0 <= args.audio_cache_mb < float("inf"):
        raise ConfigError(f"--audio-cache-mb must be a number of MB, at least 0, got {args.audio_cache_mb:g}")
    cfg = OmniConfig.load(args.model)
    model = load_stage_model(args, setup, lambda: ThinkerModel(cfg.thinker), "thinker.", ignore=("visual.",))
    kv, max_len = kv_plan(args, cfg, setup.device, next(model.parameters()).dtype)
    engine = ThinkerEngine(model, cfg.thinker, load_tokenizer(args.model, cfg), device=setup.device,
                           max_active=args.max_batch, max_len=max_len, eos_ids=(cfg.thinker.tokens.im_end,), kv=kv,
                           cuda_graphs=args.cuda_graphs, prefill_chunk=args.prefill_chunk, eager_fallback=args.eager_fallback,
                           talker_prompt_ids=not args.talker_prompt_rows, draft_forced=args.draft_forced,
                           draft_prefill=args.draft_prefill,
                           audio_cache_bytes=int(args.audio_cache_mb * 1024 * 1024))
    metrics.KV_CAPACITY.labels("thinker").set(kv.tokens)
    talker = NextStage("talker", args.talker, max_message_bytes=setup.opts.max_message_bytes,
                       tls=setup.tls) if args.talker else None
    return ThinkerServicer(engine, setup.opts, engine.tokenizer, cfg, talker), cfg


def run(args) -> None:
    serve_stage(args, "thinker", lambda a: build(a)[0], pb_grpc.add_ThinkerServicer_to_server, "voxpipe.v1.Thinker")
