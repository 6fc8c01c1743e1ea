"""Prometheus metrics of a stage service (served on --metrics-port at /metrics).

voxpipe_active_streams{stage}      streams admitted and not finished (autoscaling signal)
voxpipe_queue_depth{stage}         streams waiting for an engine slot (autoscaling signal)
voxpipe_throttled_streams{stage}   streams paused because their client reads too slowly
voxpipe_stage_latency_seconds{stage,phase}  queue_wait | first_output | total per stream
voxpipe_engine_step_seconds{stage}  one engine step
voxpipe_prefill_batch_size{stage}   requests prefilled together in one engine step
voxpipe_streams_total{stage,outcome} finished streams by outcome (stop, length, cancelled, error)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

REGISTRY = CollectorRegistry(auto_describe=True)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

ACTIVE = Gauge("voxpipe_active_streams", "Streams admitted and not finished", ["stage"], registry=REGISTRY)
THROTTLED = Gauge("voxpipe_throttled_streams", "Streams paused because their client reads too slowly", ["stage"],
                  registry=REGISTRY)
QUEUE = Gauge("voxpipe_queue_depth", "Streams waiting for an engine slot", ["stage"], registry=REGISTRY)
LATENCY = Histogram("voxpipe_stage_latency_seconds", "Per-stream latency by phase", ["stage", "phase"],
                    buckets=LATENCY_BUCKETS, registry=REGISTRY)
STEP = Histogram("voxpipe_engine_step_seconds", "Engine step time", ["stage"],
                 buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 5), registry=REGISTRY)
PREFILL_BATCH = Histogram("voxpipe_prefill_batch_size", "Requests prefilled together in one step", ["stage"],
                          buckets=(1, 2, 4, 8, 16, 32, 64), registry=REGISTRY)
STREAMS = Counter("voxpipe_streams_total", "Finished streams", ["stage", "outcome"], registry=REGISTRY)


def serve_metrics(port: int, host: str = "0.0.0.0") -> None:
    """Expose /metrics on its own HTTP port (0 disables)."""
    if port:
        start_http_server(port, addr=host, registry=REGISTRY)
