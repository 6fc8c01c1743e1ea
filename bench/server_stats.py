"""Server-side numbers per benchmark level, from the stage services' own Prometheus metrics
(services.runtime.metrics): the difference of the histograms' sums and counts across the level."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

# (histogram, label filter) -> column
COLUMNS = {
    "queue_wait_ms": ("voxpipe_stage_latency_seconds", {"phase": "queue_wait"}),
    "first_output_ms": ("voxpipe_stage_latency_seconds", {"phase": "first_output"}),
    "step_ms": ("voxpipe_engine_step_seconds", {}),
    "prefill_batch": ("voxpipe_prefill_batch_size", {}),
    "outbox_wait_ms": ("voxpipe_outbox_wait_seconds", {}),
    "loop_lag_ms": ("voxpipe_event_loop_lag_seconds", {}),
    # the same first output as the gateway sees it, from the request's arrival at the gateway (gateway
    # mode): with the stages' own column, where a request's path to first audio goes between stages
    "at_gateway_ms": ("voxpipe_gateway_stage_first_output_seconds", {}),
}


# streamed turns' prompt tokens, and of them their streamed clips' audio tokens, by when their keys
# were made (services/thinker/streaming.py) -> the column of the share made before the commit
STREAMED = {"voxpipe_streamed_prompt_tokens": "prefilled_before_commit",
            "voxpipe_streamed_audio_tokens": "audio_prefilled_before_commit"}


def parse(text: str) -> dict[tuple[str, str, str], float]:
    """{(histogram, stage, phase or ''), '_sum'|'_count'} totals from a /metrics page."""
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith(("_sum", "_count")) and "stage" in s.labels:
                key = (s.name.rsplit("_", 1)[0], s.labels["stage"], s.labels.get("phase", ""), s.name.rsplit("_", 1)[1])
                out[key] = out.get(key, 0.0) + s.value
            elif s.name in COUNTED and "stage" in s.labels:      # counters: (name, stage, kind, "total")
                key = (s.name, s.labels["stage"], s.labels.get("kind", ""), "total")
                out[key] = out.get(key, 0.0) + s.value
            elif s.name == CHUNKS and "stage" in s.labels:      # (name, stage, path, "total")
                key = (s.name, s.labels["stage"], s.labels.get("path", ""), "total")
                out[key] = out.get(key, 0.0) + s.value
            elif s.name.removesuffix("_total") in STREAMED and "stage" in s.labels:   # (stage, when: before/after_commit)
                key = (s.name.removesuffix("_total"), s.labels["stage"], s.labels.get("when", ""), "total")
                out[key] = out.get(key, 0.0) + s.value
    return out


# counters whose growth over a level each stage reports: prefix-cache tokens found, sequences preempted
COUNTED = {"voxpipe_prefix_cache_tokens_total": "prefix_hit_tokens", "voxpipe_preemptions_total": "preemptions"}


# chunked prefills' chunks by the attention they took -> columns chunks_<path> (cudnn, flash, paged, ...)
CHUNKS = "voxpipe_prefill_chunks_total"


def streams_finished(text: str, stage: str) -> int:
    """Streams a stage process ended, whatever the outcome (voxpipe_streams_total), from its /metrics page."""
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "voxpipe_streams_total" and s.labels.get("stage") == stage:
                total += s.value
    return int(total)


def thinker_counts(text: str) -> dict[str, float]:
    """A thinker process's totals from its /metrics page: streams ended (any outcome), prompt tokens
    looked up in its prefix cache (queried) and found there (hit)."""
    out = {"streams": 0.0, "queried_tokens": 0.0, "hit_tokens": 0.0}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.labels.get("stage") != "thinker":
                continue
            if s.name == "voxpipe_streams_total":
                out["streams"] += s.value
            elif s.name == "voxpipe_prefix_cache_tokens_total" and s.labels.get("kind") in ("queried", "hit"):
                out[f"{'queried' if s.labels['kind'] == 'queried' else 'hit'}_tokens"] += s.value
    return out


def http_source(ports: dict[str, int], host: str = "127.0.0.1") -> Callable[[], str]:
    def read() -> str:
        pages = []
        for port in ports.values():
            with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
                pages.append(r.read().decode())
        return "\n".join(pages)
    return read


def combined(*sources: Callable[[], str]) -> Callable[[], str]:
    return lambda: "\n".join(src() for src in sources)


def registry_source() -> Callable[[], str]:
    from prometheus_client import generate_latest

    from voxpipe.services.runtime.metrics import REGISTRY

    return lambda: generate_latest(REGISTRY).decode()


def level_stats(before: dict, after: dict, stages: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Per stage, the mean of each column over what happened between the two scrapes."""
    out: dict[str, dict[str, float]] = {}
    for stage in stages:
        row = {}
        for col, (name, labels) in COLUMNS.items():
            phase = labels.get("phase", "")
            total = after.get((name, stage, phase, "sum"), 0.0) - before.get((name, stage, phase, "sum"), 0.0)
            count = after.get((name, stage, phase, "count"), 0.0) - before.get((name, stage, phase, "count"), 0.0)
            if count:
                row[col] = total / count * (1000.0 if col.endswith("_ms") else 1.0)
        if "step_ms" in row:
            row["steps"] = after.get(("voxpipe_engine_step_seconds", stage, "", "count"), 0.0) - \
                before.get(("voxpipe_engine_step_seconds", stage, "", "count"), 0.0)
        for name, col in COUNTED.items():
            kind = "hit" if col == "prefix_hit_tokens" else ""
            grew = after.get((name, stage, kind, "total"), 0.0) - before.get((name, stage, kind, "total"), 0.0)
            if grew:
                row[col] = grew
        for (name, st, path, _), value in after.items():    # each chunk path's chunks over the level
            if name == CHUNKS and st == stage and value - before.get((name, st, path, "total"), 0.0):
                row["chunks_" + path.replace(" ", "_")] = value - before.get((name, st, path, "total"), 0.0)
        for name, col in STREAMED.items():     # streamed realtime turns: the share prefilled before the commit
            made = {when: after.get((name, stage, when, "total"), 0.0) - before.get((name, stage, when, "total"), 0.0)
                    for when in ("before_commit", "after_commit")}
            if sum(made.values()):
                row[col] = made["before_commit"] / sum(made.values())
        key = ("voxpipe_stage_latency_seconds", stage, "queue_wait", "count")
        if after.get(key, 0.0) - before.get(key, 0.0):
            row["requests"] = after[key] - before.get(key, 0.0)     # requests that ended between the scrapes
        out[stage] = row
    return out
