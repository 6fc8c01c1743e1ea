"""`voxpipe bench --trace`: each request's path through the services, from their OpenTelemetry spans.

The bench runs an OTLP/gRPC trace receiver (the collector protocol, TraceService/Export) on a local
port and starts the gateway and the stage services with the standard OTEL_* variables pointing at it.
After a level, the spans of its measured requests are grouped by trace. Each trace is rooted at the
gateway's HTTP (or WebSocket) span. For every span name (per service) the report gives the median
start and end in ms from that root span's start: the gateway's call to the thinker, the thinker's
queue wait and prefill, the talker's stream and its prefill up to its first frame, code2wav's first
chunk, the gateway's listen stream; and the gateway span's events, each stage's first output as the
gateway received it ("event: thinker first output" ...).

Tracing costs each service some CPU (a span per stream and phase, exported in batches), so the
headline numbers of a traced run read slightly high: trace to find the path, not for the table."""

from __future__ import annotations

import statistics
import threading
from concurrent import futures
from dataclasses import dataclass

SERVER, CLIENT = 2, 3          # OTLP span kinds


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    kind: int
    start_ns: int
    end_ns: int
    events: tuple[tuple[str, int], ...] = ()     # (name, time ns): the gateway's "<stage> first output"


class SpanReceiver:
    """An OTLP trace receiver on 127.0.0.1 (a free port) that keeps every span it is sent."""

    def __init__(self) -> None:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                receiver._add(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.spans: list[Span] = []
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def _add(self, request) -> None:
        got = []
        for rs in request.resource_spans:
            service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                got += [Span(service, s.name, s.trace_id.hex(), s.kind, s.start_time_unix_nano, s.end_time_unix_nano,
                             tuple((e.name, e.time_unix_nano) for e in s.events))
                        for s in ss.spans]
        with self.lock:
            self.spans += got

    def env(self, service: str) -> dict[str, str]:
        """The environment that makes a voxpipe process export its spans here as `service`."""
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{self.port}",
                "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_BSP_SCHEDULE_DELAY": "100",
                "OTEL_SERVICE_NAME": service, "OTEL_TRACES_SAMPLER": "always_on"}

    def snapshot(self) -> list[Span]:
        with self.lock:
            return list(self.spans)

    def close(self) -> None:
        self.server.stop(grace=None)


def path(spans: list[Span], since_ns: int, until_ns: int) -> list[dict]:
    """Median start and end (ms from the root span's start) of every (service, span name) in the traces
    whose gateway root span started in [since_ns, until_ns], in the order of their median start."""
    traces: dict[str, list[Span]] = {}
    for s in spans:
        traces.setdefault(s.trace_id, []).append(s)
    offsets: dict[tuple[str, str], list[tuple[float, float]]] = {}
    n = 0
    for group in traces.values():
        roots = [s for s in group if s.service == "gateway" and s.kind == SERVER]
        if not roots:
            continue
        root = min(roots, key=lambda s: s.start_ns)
        if not since_ns <= root.start_ns <= until_ns:
            continue
        n += 1
        for s in group:
            offsets.setdefault((s.service, s.name), []).append(((s.start_ns - root.start_ns) / 1e6,
                                                                (s.end_ns - root.start_ns) / 1e6))
        for name, at in root.events:     # what the gateway saw when: each stage's first output
            t = (at - root.start_ns) / 1e6
            offsets.setdefault(("gateway", f"event: {name}"), []).append((t, t))
    rows = [{"service": service, "span": name, "requests": len(v),
             "start_ms": statistics.median(a for a, _ in v), "end_ms": statistics.median(b for _, b in v)}
            for (service, name), v in offsets.items()]
    rows.sort(key=lambda r: (r["start_ms"], r["end_ms"]))
    return [dict(r, traces=n) for r in rows]


def table(rows: list[dict]) -> str:
    out = ["| service | span | requests | start ms | end ms |", "|---|---|---|---|---|"]
    out += [f"| {r['service']} | {r['span']} | {r['requests']} | {r['start_ms']:.1f} | {r['end_ms']:.1f} |"
            for r in rows]
    return "\n".join(out)
