"""Prometheus metrics of a stage service (served on --metrics-port at /metrics).

voxpipe_active_streams{stage}      streams admitted and not finished (autoscaling signal)
voxpipe_queue_depth{stage}         streams waiting for an engine slot (autoscaling signal)
voxpipe_stage_capacity{stage}      streams the engine runs at once (--max-batch): active streams above it wait
voxpipe_throttled_streams{stage}   streams paused because their client reads too slowly
voxpipe_streams_by_slack{stage,band}  streams by their listener's slack (services/runtime/playback.py):
                                    band = under_0.5s (nearly dry, and streams with no audio yet),
                                    0.5s_to_2s, over_2s
voxpipe_streams_under_500ms_slack{stage}  the under_0.5s band alone (autoscaling signal)
voxpipe_underruns_total{stage}     times a stream's listener ran dry before the stream ended, as this
                                    stage models the listener (code2wav: from what its Listen
                                    stream delivered; the talker: 1x after its first frame)
voxpipe_playback_reports_total{stage}  where-the-listener-is reports taken from the next stage (the
                                    talker: code2wav's Playback on its Decode streams)
voxpipe_stage_latency_seconds{stage,phase}  queue_wait | first_output | total per stream
voxpipe_engine_step_seconds{stage}  one engine step
voxpipe_prefill_batch_size{stage}   requests prefilled together in one engine step
voxpipe_streams_total{stage,outcome} finished streams by outcome (stop, length, cancelled, error)
voxpipe_outbox_wait_seconds{stage}  an engine output's wait between the engine thread and its stream
                                    handler (event-loop hand-off lag + the handler's own backlog)
voxpipe_event_loop_lag_seconds{stage}  how late the service's event loop wakes for a 20 ms timer
voxpipe_next_stage_streams_total{stage}  streams this service opened to the next stage (the thinker's
                                    to talkers, the talker's to code2wav), by that stage
voxpipe_next_stage_replicas{stage,state}  the next stage's replicas as this service's balancer sees
                                    them (state: usable, unhealthy, draining); absent until the
                                    first stream to that stage
voxpipe_kv_blocks{stage,state}     the stage's KV blocks: used (held by running sequences), free, cached
                                    (published in the prefix cache, used or free)
voxpipe_kv_capacity_tokens{stage}   positions the KV pool holds (blocks x block size)
voxpipe_prefix_cache_tokens_total{stage,kind}  prompt tokens looked up in the prefix cache at
                                    admission (queried) and found there (hit: their prefill skipped)
voxpipe_prefill_chunks_total{stage,path}  chunks of chunked prefills (long prompts, cached prefixes) by the
                                    attention their first layer took: cudnn (the two-part path planned
                                    at start), flash, paged (the paged kernel), extend graph, sdpa
voxpipe_preemptions_total{stage}    running sequences preempted for lack of KV blocks (recomputed later)
voxpipe_pending_upload_bytes{stage}  bytes still expected by chunked start messages not yet complete
                                    (reserved when the head arrives; bounded by --max-pending-upload-mb)
voxpipe_audio_cache_hits_total{stage}, _misses_total{stage}, _evictions_total{stage}
                                    audio clips whose encoder output was found in / added to / dropped
                                    from the thinker's audio encoder cache (--audio-cache-mb)
voxpipe_audio_cache_bytes{stage}    bytes of encoder outputs that cache holds on the device
"""

from __future__ import annotations

import asyncio
import copy
import errno
import weakref
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from voxpipe.errors import PortInUse

from .playback import BANDS, Paced, PlaybackClock, band_counts

REGISTRY = CollectorRegistry(auto_describe=True)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

ACTIVE = Gauge("voxpipe_active_streams", "Streams admitted and not finished", ["stage"], registry=REGISTRY)
THROTTLED = Gauge("voxpipe_throttled_streams", "Streams paused because their client reads too slowly", ["stage"],
                  registry=REGISTRY)
CAPACITY = Gauge("voxpipe_stage_capacity", "Streams the engine runs at once (its max batch, --max-batch)", ["stage"],
                 registry=REGISTRY)
QUEUE = Gauge("voxpipe_queue_depth", "Streams waiting for an engine slot", ["stage"], registry=REGISTRY)
LATENCY = Histogram("voxpipe_stage_latency_seconds", "Per-stream latency by phase", ["stage", "phase"],
                    buckets=LATENCY_BUCKETS, registry=REGISTRY)
STEP = Histogram("voxpipe_engine_step_seconds", "Engine step time", ["stage"],
                 buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 5), registry=REGISTRY)
PREFILL_BATCH = Histogram("voxpipe_prefill_batch_size", "Requests prefilled together in one step", ["stage"],
                          buckets=(1, 2, 4, 8, 16, 32, 64), registry=REGISTRY)
OUTBOX_WAIT = Histogram("voxpipe_outbox_wait_seconds", "Engine output wait before its stream handler takes it",
                        ["stage"], buckets=LATENCY_BUCKETS, registry=REGISTRY)
LOOP_LAG = Histogram("voxpipe_event_loop_lag_seconds", "Event loop lateness for a 20 ms timer", ["stage"],
                     buckets=LATENCY_BUCKETS, registry=REGISTRY)
PENDING_UPLOAD = Gauge("voxpipe_pending_upload_bytes", "Bytes still expected by incomplete chunked start messages",
                       ["stage"], registry=REGISTRY)
KV_BLOCKS = Gauge("voxpipe_kv_blocks", "KV blocks by state (used, free, cached)", ["stage", "state"], registry=REGISTRY)
KV_CAPACITY = Gauge("voxpipe_kv_capacity_tokens", "Positions the KV pool holds", ["stage"], registry=REGISTRY)
PREFIX_TOKENS = Counter("voxpipe_prefix_cache_tokens", "Prompt tokens looked up in the prefix cache (queried) and "
                        "found (hit)", ["stage", "kind"], registry=REGISTRY)
PREFILL_CHUNKS = Counter("voxpipe_prefill_chunks", "Chunks of chunked prefills by the attention they took (cudnn: the "
                         "two-part path planned at start; flash; paged: the paged kernel; extend graph; sdpa)",
                         ["stage", "path"], registry=REGISTRY)
DRAFT_TOKENS = Counter("voxpipe_draft_tokens", "Tokens of grammar-forced text drafted after a constrained row's last "
                       "token (drafted) and those the model's own choice took (accepted)", ["stage", "kind"],
                       registry=REGISTRY)
PREEMPTIONS = Counter("voxpipe_preemptions", "Sequences preempted for lack of KV blocks", ["stage"],
                      registry=REGISTRY)
STREAMS = Counter("voxpipe_streams_total", "Finished streams", ["stage", "outcome"], registry=REGISTRY)
AUDIO_CACHE_HITS = Counter("voxpipe_audio_cache_hits", "Audio clips whose encoder output was cached", ["stage"],
                           registry=REGISTRY)
AUDIO_CACHE_MISSES = Counter("voxpipe_audio_cache_misses", "Audio clips encoded (not in the cache)", ["stage"],
                             registry=REGISTRY)
AUDIO_CACHE_EVICTIONS = Counter("voxpipe_audio_cache_evictions", "Encoder outputs dropped for room (LRU)", ["stage"],
                                registry=REGISTRY)
AUDIO_CACHE_BYTES = Gauge("voxpipe_audio_cache_bytes", "Bytes of audio encoder outputs cached on the device", ["stage"],
                          registry=REGISTRY)
NEXT_STAGE_STREAMS = Counter("voxpipe_next_stage_streams_total", "Streams opened to the next stage", ["stage"],
                             registry=REGISTRY)

SLACK_STREAMS = Gauge("voxpipe_streams_by_slack", "Streams by their listener's slack", ["stage", "band"],
                      registry=REGISTRY)
DRY_STREAMS = Gauge("voxpipe_streams_under_500ms_slack", "Streams whose listener has under 500 ms of audio ahead "
                    "(or none yet)", ["stage"], registry=REGISTRY)
UNDERRUNS = Counter("voxpipe_underruns", "Times a stream's listener ran dry before the stream ended", ["stage"],
                    registry=REGISTRY)

PLAYBACK_REPORTS = Counter("voxpipe_playback_reports", "Playback reports taken from the next stage", ["stage"],
                           registry=REGISTRY)


class SlackGauges:
    """A stage's voxpipe_streams_by_slack and voxpipe_streams_under_500ms_slack, recounted at most
    every `every_s` (the engine offers them every step; a pass over every stream's clock each
    step would cost more than the gauges are worth)."""

    def __init__(self, stage: str, every_s: float = 0.1) -> None:
        self.stage, self.every_s = stage, every_s
        self._next = float("-inf")
        UNDERRUNS.labels(stage)

    def update(self, jobs: Iterable[Paced], now: float) -> None:
        if now < self._next:
            return
        self._next = now + self.every_s
        counts = band_counts([j.playback.slack(now) for j in jobs])
        for label, n in counts.items():
            SLACK_STREAMS.labels(self.stage, label).set(n)
        DRY_STREAMS.labels(self.stage).set(counts[BANDS[0][0]])


def count_underruns(stage: str, clock: PlaybackClock, before: int) -> None:
    """Count the underruns `clock` found since it had `before`."""
    if clock.underruns > before:
        UNDERRUNS.labels(stage).inc(clock.underruns - before)


REPLICA_STATES = ("usable", "unhealthy", "draining")


class NextStageReplicas:
    """voxpipe_next_stage_replicas, read from the balancers at scrape time (`add`: a bound method
    that returns (stage, [Replica]), or None while there is no balancer yet; held weakly)."""

    NAME = "voxpipe_next_stage_replicas"
    HELP = "The next stage's replicas as this service's balancer sees them, by state"

    def __init__(self) -> None:
        self.sources: list[weakref.WeakMethod] = []

    def add(self, source: Callable[[], tuple[str, list] | None]) -> None:
        self.sources.append(weakref.WeakMethod(source))

    def describe(self):
        return [GaugeMetricFamily(self.NAME, self.HELP, labels=["stage", "state"])]

    def collect(self):
        family = GaugeMetricFamily(self.NAME, self.HELP, labels=["stage", "state"])
        for ref in list(self.sources):
            source = ref()
            got = source() if source is not None else None
            if got is None:
                continue
            stage, replicas = got
            counts = dict.fromkeys(REPLICA_STATES, 0)
            for r in replicas:
                counts["draining" if r.draining else "unhealthy" if not r.healthy else "usable"] += 1
            for state, n in counts.items():
                family.add_metric([stage, state], n)
        yield family


NEXT_STAGE_REPLICAS = NextStageReplicas()
REGISTRY.register(NEXT_STAGE_REPLICAS)


# the stage a voxpipe_next_stage_* series belongs to: the one that calls the stage its label names
CALLER = {"talker": "thinker", "code2wav": "talker"}


class StageSeries:
    """The series of REGISTRY that belong to one stage: those labelled with it, and the
    voxpipe_next_stage_* ones of the stage it calls (labelled with that stage). For stages
    colocated in one process (services/runtime/colocate.py): each one's --metrics-port serves its
    own, as a process of its own would."""

    def __init__(self, stage: str) -> None:
        self.stage = stage

    def _owner(self, family: str, labels: dict[str, str]) -> str | None:
        stage = labels.get("stage")
        return CALLER.get(stage) if family.startswith("voxpipe_next_stage") else stage

    def collect(self):
        for family in REGISTRY.collect():
            samples = [s for s in family.samples if self._owner(family.name, s.labels) == self.stage]
            if samples:
                family = copy.copy(family)
                family.samples = samples
                yield family


def stage_registry(stage: str) -> CollectorRegistry:
    """What a colocated stage's --metrics-port serves (StageSeries)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StageSeries(stage))
    return registry


def serve_metrics(port: int, host: str = "127.0.0.1", registry: CollectorRegistry | None = None) -> None:
    """Expose /metrics on its own HTTP port (0 disables); PortInUse (--metrics-port) when it is taken.
    `registry`: what it serves (default: REGISTRY, every series of the process)."""
    if port:
        try:
            start_http_server(port, addr=host, registry=REGISTRY if registry is None else registry)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise PortInUse("metrics", host, port, "--metrics-port") from None
            raise


async def watch_loop_lag(observe: Callable[[float], None], interval: float = 0.02) -> None:
    """Until cancelled, observe how late this event loop wakes for an `interval` timer: a loop busy
    with messages, or starved of the GIL by an engine thread, wakes late."""
    loop = asyncio.get_running_loop()
    while True:
        start = loop.time()
        await asyncio.sleep(interval)
        observe(max(0.0, loop.time() - start - interval))
