"""What the three stage servers share: the aio server with health, reflection (with --reflection)
and graceful SIGTERM; the per-stream pattern (first message = Start, optional payload chunks,
engine outputs streamed back, cancellation and disconnects freeing the request); ports never
shared (`bind_grpc`, listen.py); and a stage's build and run: `stage_setup` (options, TLS, device
and dtype from the flags, ports checked free), `load_stage_model` (the stage's weights, laid out
for serving) and `serve_stage` (tracing, build, serve until SIGTERM). The flags are in flags.py;
each stage's server.py has only its servicer and its build of engine and model.

Limits: a connection older than `max_connection_age_s` is told to go away (GOAWAY: new streams go
to a new connection) but is never closed while a stream on it is active; the payload chunks of
start messages not yet complete (unadmitted uploads) share one byte budget across the server,
`voxpipe_pending_upload_bytes{stage}`."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
import torch
from torch import nn

from voxpipe.v1 import stages_pb2 as pb

from voxpipe.errors import ConfigError

from .engine import EngineRequest, StageEngine, StageError
from .outputs import Finished, FinishReason, FramesOut, Routed, TalkerPromptOut
from . import metrics
from .logs import REQUEST_ID
from .metrics import serve_metrics
from .calls import ClientGone, abort, send_admitted, when_done
from .rpc_guard import Abort, RequestGuard
from .tensors import Reassembler, TensorError
from .tensors import to_proto as tensor_proto
from . import tracing
from .tls import ClientTLS, ServerTLS, TLSConfigError, add_port, client_tls_from_args, server_tls_from_args
from . import determinism
from .layers import serving_layout
from .listen import GRPC_SERVER_OPTIONS, check_free, socket_host
from .weights import load_module, resolve_device, resolve_dtype

log = logging.getLogger(__name__)


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 0
    max_message_bytes: int = 64 * 1024 * 1024   # one gRPC message, either direction
    max_payload_bytes: int = 512 * 1024 * 1024  # one request's tensors, reassembled
    max_queue: int = 256                         # requests waiting for a slot before RESOURCE_EXHAUSTED
    grace_seconds: float = 30.0                  # drain time on SIGTERM
    max_connection_age_s: float | None = 300.0   # clients reconnect (and rebalance) this often (0/None: never)
    max_pending_upload_bytes: int = 1024 * 1024 * 1024  # all incomplete start payloads together
    metrics_port: int = 0                        # Prometheus /metrics (0: off), on `host` too
    reflection: bool = False                     # grpc.reflection.v1alpha on the service port
    tls: ServerTLS | None = None                 # serve TLS (mTLS when it has a client CA); None: plaintext
    health_port: int = 0                         # a plaintext grpc.health.v1-only port on `host` (0: off), for
                                                 # probes that cannot speak (m)TLS (Kubernetes' grpc probes)


# grpc core's "no limit" for max_connection_age_grace_ms: an aged connection closes only when its
# last stream has ended
UNLIMITED_GRACE_MS = 2**31 - 1


class UploadBudget:
    """Bytes still expected by start messages being reassembled, across all streams of the server.
    `reserve` refuses (RESOURCE_EXHAUSTED) beyond the limit; every reservation is released once."""

    def __init__(self, stage: str, limit: int) -> None:
        self.limit, self.pending = limit, 0
        self.gauge = metrics.PENDING_UPLOAD.labels(stage)

    def reserve(self, nbytes: int) -> int:
        if self.pending + nbytes > self.limit:
            raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"too many bytes of incomplete uploads pending ({self.pending} + {nbytes} > the limit of "
                        f"{self.limit}); retry later")
        self.pending += nbytes
        self.gauge.set(self.pending)
        return nbytes

    def release(self, nbytes: int) -> None:
        self.pending -= nbytes
        self.gauge.set(self.pending)


class Relay(Protocol):
    """Where a request goes after this stage (the thinker's talker, the talker's code2wav)."""

    done: bool   # the caller's stream is complete: nothing more will be forwarded

    async def forward(self, item: Any) -> list[Any]:
        """Pass one outbox item (an engine output, merged, or an item the relay itself put in the
        outbox) on; returns the outputs for this stage's caller, which `to_proto` turns into its
        messages. Failures reach the outbox as StageErrors."""
        ...

    def close(self) -> None:
        """Cancel what still runs downstream (idempotent)."""


class DeviceFailure(Exception):
    """The engine hit a device error (services.runtime.engine.is_device_fatal): the service stopped
    and its process must exit non-zero (run_async does)."""


class StageServicer:
    """Base of the Thinker / Talker / Code2Wav servicers."""

    def __init__(self, engine: StageEngine, opts: ServerOptions) -> None:
        self.engine, self.opts = engine, opts
        self.draining = False
        self.uploads = UploadBudget(engine.name, opts.max_pending_upload_bytes)

    def admit(self) -> None:
        if self.draining:
            raise Abort(grpc.StatusCode.UNAVAILABLE, f"{self.engine.name} is draining (shutting down)")
        if len(self.engine.waiting) >= self.opts.max_queue:
            raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"{self.engine.name} queue is full ({self.opts.max_queue} requests waiting)")

    def make_job(self, start: Any) -> EngineRequest:
        """The engine request for a validated start message (raises Abort on bad input)."""
        raise NotImplementedError

    async def prepare(self, job: EngineRequest) -> None:
        """Work a job needs before it enters the engine, off the engine thread (raises Abort on bad
        input); e.g. the thinker compiles a constraint's grammar in its pool. Default: none."""

    async def open_stream(self, it: AsyncIterator, context: grpc.aio.ServicerContext) -> EngineRequest | None:
        """The request of a stage stream: its start message read (before any refusal: a status sent
        while the client is still writing reaches gRPC Python clients as INTERNAL instead of the real
        code), admitted and turned into a job by the subclass's `make_job`, then the response headers
        that say it was admitted sent (calls.ADMITTED_METADATA: a stage writes past the start only
        after them); None after aborting the call with the refusal's status. A caller that cancels
        before the job exists ends the call as a cancelled stream of this stage (counted, traced),
        like one that cancels later."""
        try:
            try:
                start = await self.read_head(it, "start", "chunk")
                start_read = getattr(context, "start_read", None)     # rpc_guard: a refusal from here on is
                if start_read is not None:                            # not racing a caller awaiting admission
                    start_read()
                if start.request_id:
                    REQUEST_ID.set(start.request_id)      # this call's logs carry it
                self.admit()
                job = self.make_job(start)
                await self.prepare(job)
            except Abort as e:
                await abort(context, e.code, e.message, trailing=e.trailing)
                return None
            await send_admitted(context)
            return job
        except (ClientGone, asyncio.CancelledError):
            metrics.STREAMS.labels(self.engine.name, "cancelled").inc()
            raise

    async def read_head(self, it: AsyncIterator, start_field: str, chunk_field: str) -> Any:
        """The Start message of a stream, with its tensors' continuation chunks appended."""
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "empty request stream: the first message must be start")
        if first.WhichOneof("kind") != start_field:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"the first message must be {start_field}, got {first.WhichOneof('kind')}")
        start = getattr(first, start_field)
        try:
            asm = Reassembler(start, self.opts.max_payload_bytes)
        except TensorError as e:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if asm.complete:
            return start
        reserved = self.uploads.reserve(asm.missing_bytes)
        try:
            await self._read_chunks(it, asm, chunk_field)
        finally:
            self.uploads.release(reserved)
        return start

    async def _read_chunks(self, it: AsyncIterator, asm: Reassembler, chunk_field: str) -> None:
        while not asm.complete:
            try:
                msg = await it.__anext__()
            except StopAsyncIteration:
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "request stream ended before the start payload was complete")
            if msg.WhichOneof("kind") != chunk_field:
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"expected {chunk_field} continuation bytes, got {msg.WhichOneof('kind')}")
            try:
                asm.add(getattr(msg, chunk_field).data)
            except TensorError as e:
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def merge(self, first: Any, then: Any) -> Any | None:
        """One output holding both `first` and `then` (consecutive outputs of one request, never a
        Finished), or None if they cannot travel as one. Stages whose outputs concatenate override this."""
        return None

    def to_proto(self, req: EngineRequest, item: Any) -> Any:
        """The response message of one output for `req`'s caller (an engine output, merged, a
        relay's report or the Finished). Each stage's servicer builds its own."""
        raise NotImplementedError

    ending_message: Callable[[], Any] | None = None     # this stage's Ending response, if it has one

    def ending(self, context: grpc.aio.ServicerContext | None) -> Any | None:
        """The Ending response to send before a failure's status, where the caller takes one (a
        stage that awaited admission, once admitted: it half-closes on it, so the status does not
        race its writes); None otherwise."""
        if self.ending_message is None or not getattr(context, "takes_ending", False):
            return None
        context.ending_sent()
        return self.ending_message()

    async def serve_request(self, req: EngineRequest, context: grpc.aio.ServicerContext,
                            reader: Callable[[], Any] | None, relay: "Relay | None" = None) -> AsyncIterator[Any]:
        """Submit `req`, run `reader` (the rest of the request stream) beside it, and yield the
        messages (`to_proto`) of the engine's outputs until the final one. Outputs that are already
        waiting when one is sent go with it as one message where `merge` allows (no wait is added:
        under load, fewer and larger messages). With a `relay` (the request continues in the next
        stage), each output goes through `relay.forward`, which returns what the caller gets, and
        the stream ends once the relay is done. Frees the request on cancel or disconnect."""
        self.engine.submit(req)
        task = asyncio.ensure_future(self._guard(reader, req)) if reader is not None else None

        def on_done(_context) -> None:
            """The call ended (finished, failed or cancelled): free the request now. grpc-Python does not
            close a handler's generator that sits at a `yield` when its call is cancelled, so the
            `finally` below may run only when the generator is collected."""
            if not req.done:
                self.engine.cancel(req)
            if task is not None and not task.done():
                task.cancel()
            if relay is not None:
                relay.close()

        if context is not None:        # None: driven without gRPC (tests of the output path)
            when_done(context, on_done)
        final = None
        try:
            async for item in self._outputs(req):
                if isinstance(item, StageError):
                    final = final or item
                    if (ending := self.ending(context)) is not None:
                        yield ending
                    await abort(context, item.code, item.message, item.stage)
                if isinstance(item, Finished):
                    final = item
                if relay is None:
                    yield self.to_proto(req, item)
                    if isinstance(item, Finished):
                        return
                    continue
                for out in await relay.forward(item):
                    yield self.to_proto(req, out)
                if relay.done:
                    return
        finally:
            on_done(context)
            tracing.record_phases(self.engine.name, req, final)

    async def _outputs(self, req: EngineRequest) -> AsyncIterator[Any]:
        """The request's outbox items, consecutive mergeable ones merged (see `merge`); the last
        one (a Finished or a StageError) is never merged."""
        wait = metrics.OUTBOX_WAIT.labels(self.engine.name)
        held = None
        while True:
            if held is None:
                item, waited = await req.outbox.get_timed()
                wait.observe(waited)
            else:
                item, held = held, None
            if not isinstance(item, (StageError, Finished)):
                while (polled := req.outbox.poll_timed()) is not None:
                    wait.observe(polled[1])
                    merged = None if isinstance(polled[0], (StageError, Finished)) else self.merge(item, polled[0])
                    if merged is None:
                        held = polled[0]
                        break
                    item = merged
            yield item

    async def _guard(self, reader: Callable[[], Any], req: EngineRequest) -> None:
        try:
            await reader()
        except Abort as e:
            self.engine.cancel(req)
            req.outbox.put(StageError(e.code, e.message))
        except TensorError as e:
            self.engine.cancel(req)
            req.outbox.put(StageError(grpc.StatusCode.INVALID_ARGUMENT, str(e)))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the client went away mid-read
            log.debug("request reader ended: %r", e)
            self.engine.cancel(req)

    def cancelled(self) -> Finished:
        """The last output of a request its caller cancelled with a cancel message."""
        return Finished(FinishReason.CANCELLED)


def finished_proto(finished: Finished) -> pb.Finished:
    return pb.Finished(reason=int(finished.reason), prompt_tokens=finished.prompt_tokens,
                       completion_tokens=finished.completion_tokens, samples=finished.samples,
                       cached_tokens=finished.cached_tokens, streamed_tokens=finished.streamed_tokens)


def routed_proto(routed: Routed) -> pb.Routed:
    return pb.Routed(stage=routed.stage, address=routed.address, listen_token=routed.listen_token)


def finished_from_proto(msg: pb.Finished) -> Finished:
    """A next stage's Finished as a typed one (a reason this build does not know: UNSPECIFIED)."""
    known = msg.reason in FinishReason._value2member_map_
    return Finished(FinishReason(msg.reason) if known else FinishReason.UNSPECIFIED, prompt_tokens=msg.prompt_tokens,
                    completion_tokens=msg.completion_tokens, samples=msg.samples, cached_tokens=msg.cached_tokens)


def frames_proto(frames: FramesOut) -> pb.CodecFrames:
    return pb.CodecFrames(index=frames.index, codes=tensor_proto(frames.codes))


def talker_prompt_proto(prompt: TalkerPromptOut, out: pb.TalkerPrompt | None = None) -> pb.TalkerPrompt:
    """The TalkerPrompt message of `prompt`, filled into `out` (a message's field) when given; its
    tensors are written in place (each tensor's bytes copied into the message once)."""
    msg = pb.TalkerPrompt() if out is None else out
    for field in ("user_rows", "audio_rows"):
        if getattr(prompt, field) is not None:
            tensor_proto(getattr(prompt, field), getattr(msg, field))
    for field in ("user_mm_mask", "user_token_ids", "assistant_head", "assistant_prefix", "tts_special"):
        tensor_proto(getattr(prompt, field), getattr(msg, field))
    msg.audio_keys.extend(prompt.audio_keys)
    msg.audio_rows_follow = prompt.audio_rows_follow
    return msg


def add_health_and_reflection(server: grpc.aio.Server, service_name: str,
                              with_reflection: bool = True) -> health.aio.HealthServicer:
    """grpc.health.v1 and (unless turned off) server reflection, listing `service_name` and Health,
    on `server`; the caller sets SERVING once the server has started."""
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if with_reflection:
        reflection.enable_server_reflection(
            (service_name, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    return health_servicer


def bind_grpc(server: grpc.aio.Server, host: str, port: int, tls: ServerTLS | None, what: str, flag: str) -> int:
    """Bind host:port on `server` (a server made with GRPC_SERVER_OPTIONS: never shared) and return
    the port; PortInUse naming `flag` when it is taken, ConfigError when it cannot be bound at all."""
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        bound = add_port(server, address, tls)
    except RuntimeError:         # grpc >= 1.5x raises where older versions returned 0
        bound = 0
    if bound == 0:
        check_free(what, host, port, flag)
        raise ConfigError(f"could not listen on {address} ({what}); check --host and {flag}")
    return bound


async def run_server(servicer: StageServicer, add_to_server: Callable[[Any, grpc.aio.Server], None],
                     service_name: str, opts: ServerOptions, ready: Callable[[int], None] | None = None,
                     stop: asyncio.Event | None = None, metrics_registry: Any = None) -> None:
    """Serve until SIGTERM/SIGINT (or, given `stop`, until it is set: the caller owns the signals),
    then: health NOT_SERVING, refuse new streams, let in-flight streams finish for up to
    `grace_seconds`, stop the engine. `metrics_registry`: what --metrics-port serves (default: the
    process's metrics.REGISTRY; colocated stages: each its own series, metrics.stage_registry)."""
    options = [
        ("grpc.max_send_message_length", opts.max_message_bytes),
        ("grpc.max_receive_message_length", opts.max_message_bytes),
        # clients (voxpipe.services.runtime.balancer) ping every 20 s during streams to notice a vanished host: allow it
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        *GRPC_SERVER_OPTIONS,
    ]
    if opts.max_connection_age_s:
        options += [("grpc.max_connection_age_ms", int(opts.max_connection_age_s * 1000)),
                    ("grpc.max_connection_age_grace_ms", UNLIMITED_GRACE_MS)]
    server = grpc.aio.server(options=options, interceptors=[RequestGuard()])
    add_to_server(servicer, server)
    health_servicer = add_health_and_reflection(server, service_name, opts.reflection)
    port = bind_grpc(server, opts.host, opts.port, opts.tls, f"{service_name} gRPC", "--port")
    loop = asyncio.get_running_loop()
    own_signals = stop is None
    stop, fatal = stop or asyncio.Event(), asyncio.Event()
    # a device error poisons the CUDA context: NOT_SERVING, then exit non-zero so Kubernetes restarts us
    servicer.engine.on_fatal = lambda exc: loop.call_soon_threadsafe(fatal.set)
    health_server = None
    if opts.health_port:
        # health only, plaintext: the service itself is reachable on `port` alone
        health_server = grpc.aio.server(options=GRPC_SERVER_OPTIONS)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
        bind_grpc(health_server, opts.host, opts.health_port, None, f"{service_name} health", "--health-port")
    servicer.engine.start()
    metrics.CAPACITY.labels(servicer.engine.name).set(servicer.engine.max_active)
    try:
        serve_metrics(opts.metrics_port, socket_host(opts.host), metrics_registry)
        await server.start()
        if health_server is not None:
            await health_server.start()
    except BaseException:      # a port taken since it was checked: the engine thread goes too
        servicer.engine.stop()
        raise
    for name in ("", service_name):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("%s serving on port %d (%s)", service_name, port,
             "plaintext" if opts.tls is None else "mutual TLS" if opts.tls.mutual else "TLS")
    if ready is not None:
        ready(port)
    lag_watch = asyncio.ensure_future(metrics.watch_loop_lag(metrics.LOOP_LAG.labels(servicer.engine.name).observe))
    for sig in (signal.SIGTERM, signal.SIGINT) if own_signals else ():
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(fatal.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    if fatal.is_set():
        servicer.draining = True
        for name in ("", service_name):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.stop(grace=1.0)     # the engine already failed its streams with UNAVAILABLE
        if health_server is not None:
            await health_server.stop(None)
        lag_watch.cancel()
        raise DeviceFailure(f"{service_name}: device error, exiting for a restart: {servicer.engine.fatal}")
    log.info("%s draining (up to %.0f s)", service_name, opts.grace_seconds)
    servicer.draining = True
    await health_servicer.enter_graceful_shutdown()
    deadline = loop.time() + opts.grace_seconds
    while servicer.engine.active and loop.time() < deadline:
        await asyncio.sleep(0.05)
    await server.stop(grace=max(0.0, deadline - loop.time()))
    if health_server is not None:
        await health_server.stop(None)
    lag_watch.cancel()
    servicer.engine.stop()
    log.info("%s stopped", service_name)


def server_options(args) -> ServerOptions:
    """The options of the stage's flags; ConfigError naming the flags when the TLS ones are half given."""
    try:
        tls = server_tls_from_args(args)
    except TLSConfigError as e:
        raise ConfigError(str(e)) from None
    return ServerOptions(host=args.host, port=args.port, max_message_bytes=int(args.max_message_mb * 1024 * 1024),
                         max_queue=args.max_queue, grace_seconds=args.grace, metrics_port=args.metrics_port,
                         max_connection_age_s=args.max_connection_age or None,
                         max_pending_upload_bytes=int(args.max_pending_upload_mb * 1024 * 1024),
                         reflection=args.reflection, tls=tls, health_port=getattr(args, "health_port", 0))


def client_tls(args) -> ClientTLS | None:
    """How the stage dials its next stage (--tls-ca ...); ConfigError naming the flags when half given."""
    try:
        return client_tls_from_args(args)
    except TLSConfigError as e:
        raise ConfigError(str(e)) from None


def run_async(coro) -> None:
    """asyncio.run on uvloop when it is installed; a DeviceFailure exits the process with status 1."""
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        runner(coro)
    except DeviceFailure as e:
        raise SystemExit(str(e)) from None


# ----------------------------------------------------------------------------- a stage's build and run

@dataclass(frozen=True)
class StageSetup:
    """What a stage's build starts from (`stage_setup`)."""

    opts: ServerOptions
    tls: ClientTLS | None         # how it dials its next stage (--tls-ca ...; None: plaintext)
    device: torch.device
    dtype: torch.dtype


def stage_setup(args) -> StageSetup:
    """The server options and client TLS of the stage's flags (ConfigError naming the flags when they
    are bad: before any weights load; every stage checks the client flags, a shared environment, even
    one that dials no stage), its device (--device) and dtype (--dtype), with --gpu-memory-fraction
    applied on CUDA."""
    opts, tls = server_options(args), client_tls(args)
    for what, port, flag in (("gRPC", opts.port, "--port"), ("health", opts.health_port, "--health-port"),
                             ("metrics", opts.metrics_port, "--metrics-port")):
        check_free(f"{getattr(args, 'command', None) or 'stage'} {what}", opts.host, port, flag)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    colocated = getattr(args, "colocation", None) is not None   # the process's cap: the colocated stages' sum
    if args.gpu_memory_fraction and device.type == "cuda" and not colocated:   # a bare "cuda": the current device
        torch.cuda.set_per_process_memory_fraction(args.gpu_memory_fraction,
                                                   device.index if device.index is not None else None)
    return StageSetup(opts=opts, tls=tls, device=device, dtype=dtype)


def load_stage_model(args, setup: StageSetup, factory: Callable[[], nn.Module], prefix: str, *,
                     dtype: torch.dtype | None = None, ignore: tuple[str, ...] = ()) -> nn.Module:
    """The stage's module built by `factory` on the setup's device, in `dtype` (default: the setup's),
    its `prefix` tensors read from --model (--load-format; `ignore`: prefixes of the stage's tensors
    it does not use), laid out for serving (fused projections on CUDA), in batch-invariant mode with
    --deterministic (determinism.apply)."""
    model = load_module(factory, args.model, prefix, device=setup.device, dtype=setup.dtype if dtype is None else dtype,
                        load_format=args.load_format, ignore=ignore)
    serving_layout(model, setup.device)
    if args.deterministic:
        determinism.apply(model)
    return model


def serve_stage(args, stage: str, build: Callable[[Any], StageServicer],
                add_to_server: Callable[[Any, grpc.aio.Server], None], service_name: str) -> None:
    """`voxpipe STAGE`: tracing (service voxpipe-STAGE), the servicer of `build(args)`, served by
    `run_server` until SIGTERM (run_async: uvloop when installed, a device failure exits non-zero);
    "STAGE ready on port N" is printed once it serves."""
    tracing.setup_tracing(f"voxpipe-{stage}")
    servicer = build(args)
    # what the imports and the build made lives as long as the process (`voxpipe STAGE` starts with the
    # collector off: ~1 s less CPU at start): out of the collector's generations, full collections
    # while serving skip it, and so does the one at exit (seconds)
    gc.freeze()
    gc.enable()
    run_async(run_server(servicer, add_to_server, service_name, servicer.opts,
                         ready=lambda port: print(f"{stage} ready on port {port}", flush=True)))
