"""Talker gRPC service: `voxpipe talker --model DIR --port N`."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
import uuid

import grpc
import torch

from voxpipe.v1 import stages_pb2 as pb
from voxpipe.v1 import stages_pb2_grpc as pb_grpc

from ..runtime import metrics
from ..runtime.config import OmniConfig
from ..runtime.downstream import NextStage
from ..runtime.echo import quoted
from ..runtime.engine import Outbox
from ..runtime.sampling import MAX_ROW_VALUE, SamplingParams, check_features
from ..runtime.outputs import Finished, FirstOutput, FramesOut, HeldOut, Routed
from ..runtime.flags import TALKER_TOKENS_PER_STREAM, add_talker_arguments as add_arguments  # noqa: F401
from ..runtime.kv_plan import kv_plan
from ..runtime.row_keys import mm_runs
from ..runtime.server import (Abort, StageServicer, finished_proto, frames_proto, load_stage_model,
                              routed_proto, serve_stage, stage_setup)
from ..runtime.tensors import TensorError, from_proto, view_proto
from ..runtime.tracing import annotate, traced_rpc
from .engine import TalkerEngine
from .job import DEFAULT_TEXT_CAP, TalkerJob
from .model import TalkerModel, ThinkerTextEmbedding
from .relay import Code2WavRelay
from .scheduler import PROMPT_TAIL

DEFAULT_MAX_FRAMES = 4096          # transformers' talker_max_new_tokens default
DEFAULT_REPETITION_PENALTY = 1.05  # transformers' talker_repetition_penalty default
ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_KEY_BYTES = 64                 # a TalkerPrompt.audio_keys entry (the thinker's are 16)
# CUDA memory a talker keeps beside its weights and KV pool: activations of a prefill batch, the
# step graphs' gathered keys, the code predictor's graphs, the allocator's slack
ACTIVATION_RESERVE_BYTES = 2 << 30


def _rows(t: pb.Tensor, hidden: int, name: str, count: int | None = None) -> torch.Tensor:
    """Rows [count, hidden] checked, as they came (their dtype; a view of the received bytes: the
    runner's device copy is their only copy)."""
    x = view_proto(t, shape=(count, hidden), name=name)
    if x.dtype not in ROW_DTYPES:
        raise TensorError(f"{name}: rows must be float32, bfloat16 or float16")
    check_features(x, name, MAX_ROW_VALUE)
    return x


def _audio_keys(keys, mask: torch.Tensor) -> tuple[bytes, ...]:
    """TalkerPrompt.audio_keys, checked: none, or one key of 1..MAX_KEY_BYTES bytes per run of
    multimodal user rows."""
    if not keys:
        return ()
    runs = len(mm_runs(mask))
    if len(keys) != runs:
        raise ValueError(f"prompt.audio_keys: {len(keys)} keys for {runs} runs of multimodal user rows")
    if any(not 0 < len(k) <= MAX_KEY_BYTES for k in keys):
        raise ValueError(f"prompt.audio_keys: each key has 1 to {MAX_KEY_BYTES} bytes")
    return tuple(keys)


class TalkerServicer(StageServicer, pb_grpc.TalkerServicer):
    @staticmethod
    def ending_message() -> pb.TalkerResponse:
        return pb.TalkerResponse(ending=pb.Ending())

    def __init__(self, engine: TalkerEngine, opts, cfg: OmniConfig, code2wav: NextStage | None = None) -> None:
        super().__init__(engine, opts)
        self.cfg = cfg
        self.code2wav = code2wav   # the code2wav replicas routed frames go to (--code2wav); None: frames to the caller

    def merge(self, first: FramesOut | Routed, then: FramesOut | Routed) -> FramesOut | None:
        """Consecutive frames of one request travel as one CodecFrames [n1 + n2, G]."""
        if not isinstance(first, FramesOut) or not isinstance(then, FramesOut):
            return None
        if then.index != first.index + first.count:
            return None
        return FramesOut(first.index, torch.cat((first.codes, then.codes)))

    def to_proto(self, req: TalkerJob, item: FramesOut | Finished | Routed | FirstOutput | HeldOut) -> pb.TalkerResponse:
        if isinstance(item, FramesOut):
            return pb.TalkerResponse(frames=frames_proto(item))
        if isinstance(item, Finished):
            return pb.TalkerResponse(finished=finished_proto(item))
        if isinstance(item, Routed):
            return pb.TalkerResponse(routed=routed_proto(item))
        if isinstance(item, FirstOutput):
            return pb.TalkerResponse(first_output=pb.FirstOutput(stage=item.stage))
        if isinstance(item, HeldOut):
            return pb.TalkerResponse(held=pb.Held(user_rows=item.user_rows, audio_rows=item.audio_rows))
        raise TypeError(f"the talker has no message for {item!r}")

    @traced_rpc("voxpipe.v1.Talker", "Generate")
    async def Generate(self, request_iterator, context: grpc.aio.ServicerContext):
        it = request_iterator.__aiter__()
        job = await self.open_stream(it, context)
        if job is None:
            return
        hidden = self.cfg.talker.thinker_hidden_size

        async def reader() -> None:
            async for msg in it:
                kind = msg.WhichOneof("kind")
                if kind == "rows":
                    if job.text_done:
                        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "rows after text_end")
                    self.engine.add_rows(job, self._text_rows(msg.rows, hidden), more=msg.rows.more)
                elif kind == "audio_rows":
                    self._audio_rows(job, msg.audio_rows, hidden)
                elif kind == "text_end":
                    self.engine.end_text(job)
                elif kind == "cancel":
                    self.engine.cancel(job)
                    job.outbox.put(self.cancelled())
                    return
                else:
                    raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected {kind} after start")
            if not job.text_done:
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "request stream ended before text_end")

        if job.audio_follow:        # the caller sends the audio rows past what this talker holds
            self.engine.hold(job)
            job.outbox.put(HeldOut(job.held_rows, job.held_audio))
        relay = (Code2WavRelay(self.code2wav, job, job.code2wav,
                               lambda played, delivered: self.engine.report_playback(job, played, delivered))
                 if job.code2wav is not None else None)
        # aclosing: the request is freed the moment this handler ends, not when the generator is collected
        async with aclosing(self.serve_request(job, context, reader, relay)) as outputs:
            async for item in outputs:
                yield item

    def _text_rows(self, msg: pb.TextRows, hidden: int) -> torch.Tensor:
        """A TextRows message's rows, checked: [n, hidden] as sent, or (rows unset) its token ids [n]
        int64, which the runner looks up in the thinker's embedding table."""
        if not msg.HasField("rows"):
            if not msg.token_ids:
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "rows: TextRows needs rows or token_ids")
            ids = torch.tensor(list(msg.token_ids), dtype=torch.int64)
            vocab = self.engine.runner.text_table.weight.shape[0]
            if int(ids.max()) >= vocab:
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"rows.token_ids: ids must be in [0, {vocab}) without rows, got up to {int(ids.max())}")
            return ids
        rows = _rows(msg.rows, hidden, "rows")
        if len(msg.token_ids) not in (0, rows.shape[0]):
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"{len(msg.token_ids)} token ids for {rows.shape[0]} rows")
        return rows

    def _audio_rows(self, job: TalkerJob, msg: pb.AudioRows, hidden: int) -> None:
        """An AudioRows message, checked: once, for a prompt with audio_rows_follow, from the Held
        answer's audio_rows on, one row per multimodal user row past it."""
        if not job.audio_follow or job.audio_rows is not None:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                        "audio_rows only once, for a prompt with audio_rows_follow")
        if msg.first != job.held_audio:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"audio_rows.first {msg.first}: this talker holds the first {job.held_audio} audio rows")
        try:
            rows = _rows(msg.rows, hidden, "audio_rows.rows", int(job.user_mm_mask.sum()) - job.held_audio)
        except (TensorError, ValueError) as e:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.engine.add_audio_rows(job, job.held_audio, rows)

    def make_job(self, start: pb.TalkerStart) -> TalkerJob:
        cfg = self.cfg.talker
        h = cfg.thinker_hidden_size
        speaker = start.speaker.lower() or "ethan"
        if speaker not in cfg.speakers:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"unknown speaker {quoted(start.speaker)}; valid: {', '.join(sorted(cfg.speakers))}")
        annotate(voice=speaker, request_id=start.request_id)
        if not start.HasField("prompt"):
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "start.prompt is required")
        p = start.prompt
        try:
            if p.HasField("user_rows"):
                user = _rows(p.user_rows, h, "prompt.user_rows")
                users = user.shape[0]
                mm = from_proto(p.user_mm_mask, dtype=torch.bool, shape=(users,), name="prompt.user_mm_mask")
                ids = from_proto(p.user_token_ids, dtype=torch.int64, shape=(users,), name="prompt.user_token_ids")
                if p.HasField("audio_rows"):
                    raise ValueError("prompt.audio_rows goes without prompt.user_rows (which hold every user row)")
                audio = None
            else:           # the user turns as token ids: this talker looks their text rows up
                user = None
                ids = from_proto(p.user_token_ids, dtype=torch.int64, shape=(None,), name="prompt.user_token_ids")
                users = ids.shape[0]
                mm = from_proto(p.user_mm_mask, dtype=torch.bool, shape=(users,), name="prompt.user_mm_mask")
                multimodal = int(mm.sum())
                if p.audio_rows_follow and (p.HasField("audio_rows") or not multimodal or not p.audio_keys):
                    raise ValueError("prompt.audio_rows_follow needs multimodal user rows with their audio_keys, "
                                     "and the rows not in the start")
                if multimodal and not p.HasField("audio_rows") and not p.audio_rows_follow:
                    raise ValueError("prompt.audio_rows (or prompt.user_rows) is required when a user row is "
                                     "multimodal (user_mm_mask)")
                # one row per multimodal user row
                audio = _rows(p.audio_rows, h, "prompt.audio_rows", multimodal) if p.HasField("audio_rows") else None
                vocab = self.engine.runner.text_table.weight.shape[0]
                if users and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
                    raise ValueError(f"prompt.user_token_ids: ids must be in [0, {vocab}) without prompt.user_rows, "
                                     f"got {int(ids.min())}..{int(ids.max())}")
            keys = _audio_keys(p.audio_keys, mm)
            head = _rows(p.assistant_head, h, "prompt.assistant_head", 3)
            prefix = _rows(p.assistant_prefix, h, "prompt.assistant_prefix") if p.HasField("assistant_prefix") else None
            special = _rows(p.tts_special, h, "prompt.tts_special", 3)
            params = SamplingParams.from_proto(start.sampling, default_repetition_penalty=DEFAULT_REPETITION_PENALTY)
        except (TensorError, ValueError) as e:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if start.HasField("code2wav"):
            if self.code2wav is None:
                raise Abort(grpc.StatusCode.FAILED_PRECONDITION,
                            "this talker has no code2wav to send frames to (start it with --code2wav ADDR)")
            if start.code2wav.encoding not in (pb.AUDIO_ENCODING_UNSPECIFIED, pb.AUDIO_PCM16, pb.AUDIO_FLOAT32):
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown audio encoding {start.code2wav.encoding}")
        max_frames = start.max_frames or DEFAULT_MAX_FRAMES
        if start.min_frames > max_frames:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"min_frames {start.min_frames} > max_frames {max_frames}")
        length = users + PROMPT_TAIL + max_frames
        if length > self.engine.max_len:     # OUT_OF_RANGE: the request is past the context
            raise Abort(grpc.StatusCode.OUT_OF_RANGE,
                        f"{users} user rows + {PROMPT_TAIL} prompt rows + max_frames {max_frames} exceed the talker context of {self.engine.max_len}")
        job = TalkerJob(request_id=start.request_id or uuid.uuid4().hex, outbox=Outbox(asyncio.get_running_loop()),
                        user_rows=user, user_mm_mask=mm, user_ids=ids, audio_rows=audio, audio_keys=keys,
                        audio_follow=p.audio_rows_follow, head=head,
                        special=special, speaker_id=cfg.speakers[speaker],
                        params=params, max_frames=max_frames, min_frames=start.min_frames,
                        text_cap=((start.text_cap.frames_per_token, start.text_cap.base_frames)
                                  if start.HasField("text_cap") else DEFAULT_TEXT_CAP),
                        code2wav=start.code2wav if start.HasField("code2wav") else None)
        if prefix is not None and prefix.shape[0]:
            job.rows.extend(prefix.unbind(0))
        return job


def build(args) -> TalkerServicer:
    setup = stage_setup(args)      # bad flags fail before the weights load
    cfg = OmniConfig.load(args.model)
    model = load_stage_model(args, setup, lambda: TalkerModel(cfg.talker), "talker.")
    # the thinker's input embeddings: text prompts' user turns come as token ids (TalkerPrompt.user_rows unset)
    table = load_stage_model(args, setup, lambda: ThinkerTextEmbedding(cfg.thinker.text.vocab_size,
                                                                       cfg.talker.thinker_hidden_size),
                             "thinker.model.embed_tokens.")
    kv, max_len = kv_plan(args, "talker", cfg.talker.text, setup.device, next(model.parameters()).dtype,
                          activation_reserve=ACTIVATION_RESERVE_BYTES,
                          max_tokens=args.max_batch * TALKER_TOKENS_PER_STREAM)
    engine = TalkerEngine(model, cfg.talker, device=setup.device, max_active=args.max_batch, max_len=max_len, kv=kv,
                          cuda_graphs=args.cuda_graphs, eager_fallback=args.eager_fallback, text_table=table,
                          frame_seconds=cfg.code2wav.samples_per_frame / cfg.code2wav.sample_rate)
    metrics.KV_CAPACITY.labels("talker").set(kv.tokens)
    code2wav = NextStage("code2wav", args.code2wav, max_message_bytes=setup.opts.max_message_bytes,
                         tls=setup.tls) if args.code2wav else None
    return TalkerServicer(engine, setup.opts, cfg, code2wav)


def run(args) -> None:
    serve_stage(args, "talker", build, pb_grpc.add_TalkerServicer_to_server, "voxpipe.v1.Talker")
