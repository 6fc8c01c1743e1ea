"""Prometheus metrics of the gateway (its own registry, served at GET /metrics).

voxpipe_gateway_requests_total{route,status}      HTTP requests by route and status
voxpipe_gateway_active_streams                    generations in flight (HTTP and realtime)
voxpipe_gateway_sessions{api}                     slots of --max-sessions held: api = http (a chat or
                                                  speech request), realtime (a WebSocket), converse (a call)
voxpipe_gateway_streams_by_slack{band}           spoken generations in flight by their listener's slack as the
                                                  gateway sees it (admission.py): under_0.5s, 0.5s_to_2s, over_2s
voxpipe_gateway_capacity_refusals_total           spoken generations refused (429) after waiting --admission-wait
                                                  for capacity
voxpipe_gateway_transcriptions_total{outcome}     realtime input audio transcriptions (completed, failed,
                                                  cancelled: the session ended first)
voxpipe_gateway_audio_ttfp_seconds                request arrival -> first audio bytes
voxpipe_gateway_audio_rtf                         generation wall time / seconds of audio produced
voxpipe_gateway_stage_first_output_seconds{stage} request arrival -> thinker first token,
                                                  talker first frame, code2wav first audio
voxpipe_gateway_audio_cache_hits_total, _misses_total, _evictions_total
                                                  chat `input_audio` clips whose features came from the
                                                  clip cache / were decoded and featurized / were dropped
                                                  for room (--audio-cache-mb)
voxpipe_gateway_audio_cache_bytes                 bytes of features that cache holds
voxpipe_gateway_routed_total{stage,outcome}      thinker streams by how their replica was chosen
                                                  (services.runtime.affinity): session, prefix (its
                                                  longest known prefix), least_loaded (no affinity,
                                                  over the load bound, or one replica)
voxpipe_gateway_routed_prefix_tokens_total{stage,kind}  prompt tokens of the streams routed with a key
                                                  (queried; none with one replica) and of those, the
                                                  prefix known on the replica each went to (matched):
                                                  read beside the replicas' voxpipe_prefix_cache_tokens_total
voxpipe_event_loop_lag_seconds{stage="gateway"}   how late the gateway's event loop (the relay of every
                                                  stage message) wakes for a 20 ms timer
"""

from __future__ import annotations

import weakref

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from voxpipe.services.runtime.affinity import OUTCOMES

from voxpipe.services.runtime.playback import BANDS

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
SESSION_APIS = ("http", "realtime", "converse")
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10)
SHARE_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("voxpipe_gateway_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=self.registry)
        self.active_streams = Gauge("voxpipe_gateway_active_streams", "Generations in flight",
                                    registry=self.registry)
        self.sessions = Gauge("voxpipe_gateway_sessions", "Session slots held (what --max-sessions counts)",
                              ["api"], registry=self.registry)
        for api in SESSION_APIS:
            self.sessions.labels(api)
        self.streams_by_slack = Gauge("voxpipe_gateway_streams_by_slack", "Spoken generations by their listener's slack",
                                      ["band"], registry=self.registry)
        for band, _ in BANDS:
            self.streams_by_slack.labels(band)
        self.capacity_refusals = Counter("voxpipe_gateway_capacity_refusals",
                                         "Spoken generations refused after waiting for capacity", registry=self.registry)
        self.transcriptions = Counter("voxpipe_gateway_transcriptions", "Realtime input audio transcriptions",
                                      ["outcome"], registry=self.registry)
        for outcome in ("completed", "failed", "cancelled"):
            self.transcriptions.labels(outcome)
        self.ttfp = Histogram("voxpipe_gateway_audio_ttfp_seconds", "Request arrival to first audio",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.speech_end_ttfp = Histogram(
            "voxpipe_gateway_realtime_ttfp_seconds", "Realtime: the end of the user's speech to the reply's first "
            "audio (since: speech_stopped with server VAD, committed without)", ["since"],
            buckets=LATENCY_BUCKETS, registry=self.registry)
        for since in ("speech_stopped", "committed"):
            self.speech_end_ttfp.labels(since)
        self.streamed_turns = Counter(
            "voxpipe_gateway_realtime_streamed_turns", "Realtime user audio turns streamed to the thinker while "
            "spoken, by outcome: streamed (answered over the stream), redone (the prompt changed before the "
            "response: sent whole), cancelled (cleared, too short, never answered, or the session closed)",
            ["outcome"], registry=self.registry)
        for outcome in ("streamed", "redone", "cancelled"):
            self.streamed_turns.labels(outcome)
        self.prefilled_before_commit = Histogram(
            "voxpipe_gateway_realtime_prefilled_before_commit", "Realtime streamed turns: the share of the prompt's "
            "tokens prefilled (or found cached) before the commit", buckets=SHARE_BUCKETS, registry=self.registry)
        self.rtf = Histogram("voxpipe_gateway_audio_rtf", "Generation time / audio duration", buckets=RTF_BUCKETS,
                             registry=self.registry)
        self.stage_first_output = Histogram("voxpipe_gateway_stage_first_output_seconds",
                                            "Request arrival to a stage's first output", ["stage"],
                                            buckets=LATENCY_BUCKETS, registry=self.registry)

        self.audio_cache_hits = Counter("voxpipe_gateway_audio_cache_hits", "Chat audio clips found in the clip cache",
                                        registry=self.registry)
        self.audio_cache_misses = Counter("voxpipe_gateway_audio_cache_misses",
                                          "Chat audio clips decoded and featurized", registry=self.registry)
        self.audio_cache_evictions = Counter("voxpipe_gateway_audio_cache_evictions",
                                             "Clip features dropped for room (LRU)", registry=self.registry)
        self.audio_cache_bytes = Gauge("voxpipe_gateway_audio_cache_bytes", "Bytes of clip features cached",
                                       registry=self.registry)

        # the stage services' metric name, so one scrape reads both (voxpipe bench's server table)
        self.loop_lag = Histogram("voxpipe_event_loop_lag_seconds", "Event loop lateness for a 20 ms timer", ["stage"],
                                  buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
                                  registry=self.registry)

        self.routing = RoutingCollector()
        self.registry.register(self.routing)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RoutingCollector:
    """voxpipe_gateway_routed_* read at scrape time from the balancers it watches (held weakly;
    their counters are services.runtime.affinity.RouteStats)."""

    def __init__(self) -> None:
        self.balancers: list[weakref.ref] = []

    def watch(self, balancer) -> None:
        self.balancers.append(weakref.ref(balancer))

    def describe(self):
        return self._families()[:2]

    def _families(self):
        return [CounterMetricFamily("voxpipe_gateway_routed", "Streams by how their replica was chosen",
                                    labels=["stage", "outcome"]),
                CounterMetricFamily("voxpipe_gateway_routed_prefix_tokens",
                                    "Prompt tokens routed with a key (queried) and known on the chosen replica (matched)",
                                    labels=["stage", "kind"])]

    def collect(self):
        routed, tokens = self._families()
        for ref in self.balancers:
            balancer = ref()
            if balancer is None:
                continue
            stats = balancer.affinity.stats
            for outcome in OUTCOMES:
                routed.add_metric([balancer.stage, outcome], stats.outcomes[outcome])
            tokens.add_metric([balancer.stage, "queried"], stats.queried_tokens)
            tokens.add_metric([balancer.stage, "matched"], stats.matched_tokens)
        yield routed
        yield tokens
