"""The engine loop shared by the three stages.

One thread per service owns the model and runs `step()` whenever a request has work; gRPC
handlers (asyncio) talk to it only through `submit`, `notify` and each request's `Outbox`.
Requests join and leave between steps (continuous batching).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from . import metrics
from .outputs import Finished, FinishReason

log = logging.getLogger(__name__)


def is_device_fatal(exc: BaseException) -> bool:
    """Whether `exc` came from the accelerator itself (an illegal address, a launch failure, an ECC
    error): it poisons the CUDA context, so every later step would fail too. Those are not one
    request's fault and not recoverable in this process."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return isinstance(exc, RuntimeError) and ("CUDA error" in str(exc) or "CUBLAS_STATUS" in str(exc)
                                              or "cuDNN error" in str(exc))


# the voxpipe_streams_total outcome of a request that finished with these reasons
OUTCOMES = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.CANCELLED: "cancelled"}


@dataclass
class StageError:
    """A failure to surface to one request's client as a gRPC status."""

    code: grpc.StatusCode
    message: str
    stage: str | None = None    # the downstream stage the failure is about (None: this stage)


class StepDelivery:
    """The outputs one engine step made, for every request it fed, handed to the event loop in one
    wake-up (one call_soon_threadsafe per loop per step, not one per request and item).

    While a step runs on the engine thread, `Outbox.put` from that thread appends here; `flush`
    delivers them in order. Puts from any other thread (a handler's own items) go at once."""

    _current = threading.local()

    def __init__(self) -> None:
        self.entries: list[tuple["Outbox", tuple[float, Any]]] = []

    @classmethod
    def active(cls) -> "StepDelivery | None":
        return getattr(cls._current, "delivery", None)

    def __enter__(self) -> "StepDelivery":
        StepDelivery._current.delivery = self
        return self

    def __exit__(self, *exc) -> None:
        StepDelivery._current.delivery = None
        self.flush()

    def flush(self) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Outbox, tuple[float, Any]]]] = {}
        for outbox, entry in self.entries:
            by_loop.setdefault(outbox._loop, []).append((outbox, entry))
        self.entries = []
        for loop, entries in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, entries)
            except RuntimeError:  # the loop is closed: the clients are gone
                pass


def deliver_now() -> None:
    """Hand what the running step made so far to the event loops at once, not at the step's end (an
    output another stage can start on while the step's forwards run)."""
    delivery = StepDelivery.active()
    if delivery is not None:
        delivery.flush()


def _deliver(entries: list[tuple["Outbox", tuple[float, Any]]]) -> None:
    for outbox, entry in entries:
        outbox._queue.put_nowait(entry)


class Outbox:
    """Thread-safe hand-off from the engine thread to the request's asyncio handler.

    Bounded without ever blocking the engine: once `limit` items wait unread (a slow client), the
    request is `saturated` and engines leave it out of their steps, its state unchanged, until the
    reader has taken half of them; then `on_drain` wakes the engine. Other requests never wait."""

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int = 64) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._lock = threading.Lock()
        self.backlog = 0
        self.limit = limit
        self.on_drain: Callable[[], None] | None = None

    @property
    def saturated(self) -> bool:
        return self.backlog >= self.limit

    def put(self, item: Any) -> None:
        with self._lock:
            self.backlog += 1
        delivery = StepDelivery.active()
        if delivery is not None:     # on the engine thread, inside a step: delivered with the step's others
            delivery.entries.append((self, (time.monotonic(), item)))
            return
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (time.monotonic(), item))
        except RuntimeError:  # the loop is closed: the client is gone
            pass

    async def get(self) -> Any:
        return (await self.get_timed())[0]

    async def get_timed(self) -> tuple[Any, float]:
        """The next item and the seconds it waited since `put`."""
        return self._taken(await self._queue.get())

    def poll_timed(self) -> tuple[Any, float] | None:
        """Like `get_timed`, but only an item already waiting (None if there is none)."""
        try:
            return self._taken(self._queue.get_nowait())
        except asyncio.QueueEmpty:
            return None

    def _taken(self, entry: tuple[float, Any]) -> tuple[Any, float]:
        put_at, item = entry
        with self._lock:
            self.backlog -= 1
            wake = self.backlog == self.limit // 2
        if wake and self.on_drain is not None:
            self.on_drain()
        return item, time.monotonic() - put_at


@dataclass
class EngineRequest:
    request_id: str
    outbox: Outbox
    arrived: float = field(default_factory=time.perf_counter)   # submitted to the engine
    started: float | None = None                                  # left the queue (got a slot)
    first_output: float | None = None                             # first token / frame / audio out
    finished_at: float | None = None
    cancelled: bool = False
    done: bool = False

    def mark_started(self) -> None:
        self.started = time.perf_counter()

    def mark_output(self) -> None:
        if self.first_output is None:
            self.first_output = time.perf_counter()


class StageEngine:
    """Subclasses implement `has_work()` and `step()`; both run with `self.lock` held only for
    bookkeeping, never during model compute."""

    name = "stage"
    # the CUDA stream the engine thread runs its steps on (set before `start`; colocated stages: one of
    # its own priority, services/runtime/colocate.py); None: the thread's default stream
    stream: "torch.cuda.Stream | None" = None

    def __init__(self, max_active: int) -> None:
        self.max_active = max_active
        self.lock = threading.Condition()
        self.waiting: list[EngineRequest] = []
        self.running: list[EngineRequest] = []
        self._stop = False
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.fatal: BaseException | None = None   # a device error ended the engine (is_device_fatal)
        self.on_fatal: Callable[[BaseException], None] | None = None   # called once from the engine thread

    # ---- called from handlers
    def start(self) -> None:
        """Start the engine thread; return once its `prepare()` ran there (raising what it raised)."""
        prepared: list[BaseException] = []
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(prepared, ready), name=f"{self.name}-engine",
                                        daemon=True)
        self._thread.start()
        ready.wait()
        if prepared:
            self._thread.join()
            raise prepared[0]

    def prepare(self) -> None:
        """Run on the engine thread before its first step, `start()` waiting: what must be made on the
        thread that serves (caches that a library keeps per thread, as cuDNN's attention plans)."""

    def stop(self) -> None:
        with self.lock:
            self._stop = True
            self.lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def submit(self, req: EngineRequest) -> None:
        req.outbox.on_drain = self.notify
        with self.lock:
            self.waiting.append(req)
            self.lock.notify_all()
        self._gauges()

    def _gauges(self) -> None:
        with self.lock:    # read and set together: a handler's submit and the engine thread both set them
            self._set_gauges()

    def _set_gauges(self) -> None:
        metrics.ACTIVE.labels(self.name).set(len(self.waiting) + len(self.running))
        metrics.QUEUE.labels(self.name).set(len(self.waiting))
        metrics.THROTTLED.labels(self.name).set(sum(r.outbox.saturated for r in self.running))

    def notify(self) -> None:
        with self.lock:
            self.lock.notify_all()

    def cancel(self, req: EngineRequest) -> None:
        with self.lock:
            req.cancelled = True
            self.lock.notify_all()

    @property
    def active(self) -> int:
        with self.lock:
            return len(self.waiting) + len(self.running)

    # ---- engine thread
    def _run(self, prepared: list[BaseException], ready: threading.Event) -> None:
        device = getattr(self, "device", None)
        try:
            if device is not None and device.type == "cuda" and device.index is not None:
                # Triton launches and graph replays on this stage's GPU (in-process: one per stage)
                torch.cuda.set_device(device.index)
            if self.stream is not None:   # every kernel and graph replay of this thread's steps goes on it
                torch.cuda.set_stream(self.stream)
            self.prepare()
        except BaseException as exc:     # start() raises it
            prepared.append(exc)
            ready.set()
            return
        ready.set()
        while True:
            with self.lock:
                while not self._stop and not self._reap_and_check():
                    self.lock.wait(timeout=1.0)
                if self._stop:
                    break
            try:
                t0 = time.perf_counter()
                with StepDelivery():
                    self.step()
                metrics.STEP.labels(self.name).observe(time.perf_counter() - t0)
                self.steps += 1
            except Exception as exc:  # a bug (bad values fail only their own row): fail the batch, keep serving
                fatal = is_device_fatal(exc)
                log.critical("%s engine step failed with a device error: %s", self.name, exc) if fatal else \
                    log.exception("%s engine step failed", self.name)
                with self.lock:
                    victims = self.running + self.waiting
                    self.running, self.waiting = [], []
                    if fatal:
                        self._stop = True      # the context is poisoned: no further step can succeed
                for r in victims:
                    self.finish(r, StageError(grpc.StatusCode.UNAVAILABLE, f"{self.name} hit a device error and restarts")
                                if fatal else StageError(grpc.StatusCode.INTERNAL, f"{self.name} step failed: {exc}"))
                if fatal:
                    self.fatal = exc
                    if self.on_fatal is not None:
                        self.on_fatal(exc)
                    return
        with self.lock:
            victims = self.running + self.waiting
            self.running, self.waiting = [], []
        for r in victims:
            self.finish(r, StageError(grpc.StatusCode.UNAVAILABLE, f"{self.name} is shutting down"))

    def _reap_and_check(self) -> bool:
        for lst in (self.waiting, self.running):
            for r in [r for r in lst if r.cancelled]:
                lst.remove(r)
                self.release(r)
                if not r.done:
                    r.done = True
                    metrics.STREAMS.labels(self.name, "cancelled").inc()
        self._gauges()
        return self.has_work()

    def finish(self, req: EngineRequest, final: Finished | StageError) -> None:
        """Send the last item and free the request's resources."""
        with self.lock:
            if req in self.running:
                self.running.remove(req)
            if req in self.waiting:
                self.waiting.remove(req)
        self.release(req)
        self._gauges()
        if not req.done:
            req.done = True
            req.finished_at = time.perf_counter()
            self._observe(req, final)
            req.outbox.put(final)

    def nonfinite(self, req: EngineRequest, what: str) -> StageError:
        """The error for a request whose own numbers went non-finite on the device; engines finish
        only that request with it, the other rows of the step go on."""
        return StageError(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{self.name}: request {req.request_id}: {what} not finite (NaN or infinity): "
                          f"the request's values overflow the model's arithmetic")

    def _observe(self, req: EngineRequest, final: Finished | StageError) -> None:
        if isinstance(final, StageError):
            outcome = "error"
        else:
            outcome = OUTCOMES.get(final.reason, "other")
        metrics.STREAMS.labels(self.name, outcome).inc()
        lat = metrics.LATENCY
        if req.started is not None:
            lat.labels(self.name, "queue_wait").observe(req.started - req.arrived)
        if req.first_output is not None:
            lat.labels(self.name, "first_output").observe(req.first_output - req.arrived)
        lat.labels(self.name, "total").observe(req.finished_at - req.arrived)

    # ---- KV blocks (stages with a paged KV pool: `self.runner.grow(req)` / `self.runner.preempt(req)`)
    def _with_blocks(self, decode: list[EngineRequest], admitted: list[EngineRequest] | None = None
                     ) -> list[EngineRequest]:
        """The decoding requests, each with a block for its next position. When the pool has none, the
        newest running request is preempted (the runner frees its blocks; it waits, first in line, and
        recomputes its context later, its output unchanged) until one is free, the request itself
        last; a victim admitted in this step leaves `admitted` too (its prefill never ran)."""
        ready: list[EngineRequest] = []
        for req in decode:            # oldest first: the running list is in admission order
            if req.table is None:     # preempted for an older one in this loop
                continue
            while not self.runner.grow(req):
                with self.lock:
                    victim = self.running.pop()
                    self.waiting.insert(0, victim)
                log.info("%s: request %s preempted: no free KV block (%s)", self.name, victim.request_id,
                         self._progress(victim))
                self.runner.preempt(victim)
                for lst in (ready, admitted or []):
                    lst[:] = [r for r in lst if r is not victim]
                if victim is req:
                    break
            else:
                ready.append(req)
        return ready

    def _progress(self, req: EngineRequest) -> str:
        """What a request has made so far (the log of its preemption)."""
        return ""

    # ---- subclass hooks
    def has_work(self) -> bool:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def release(self, req: EngineRequest) -> None:
        """Free the request's slot / cache. Must be idempotent."""
