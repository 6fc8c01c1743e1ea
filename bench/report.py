"""`voxpipe bench`'s report: per workload, one table of client-side metrics (p50 / p90 / p99 of every
latency), the transformers reference beside it (or why there is none), the server-side means per
stage, and the side-by-side ratios of bench/BENCHMARK.md."""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import trace_path
from .workload import LevelResult, Workload


@dataclass(frozen=True)
class ReferenceRun:
    """transformers' generate for one workload (bench/reference.py), or why it did not run."""

    result: dict | None            # bench/reference.py's JSON line
    note: str = ""                 # why there is no result, or what it stands for

    def as_dict(self) -> dict:
        return {"result": self.result, "note": self.note}


def _q3(d: dict, fmt: str = "{:.1f}", scale: float = 1.0) -> str:
    return " / ".join(fmt.format(d[k] * scale) for k in ("p50", "p90", "p99"))


def table(results: list[LevelResult], ref: ReferenceRun | None, bw: float, nbytes: dict[str, float]) -> str:
    rows = ["| mode | c | req/s | prompt | TTFP p50 / p90 / p99 ms | RTF p50 / p90 / p99 | E2EL p50 / p90 / p99 s | "
            "TTFT p50 / p90 / p99 ms | thinker tok/s | talker frames/s | thinker BW | talker BW | failed |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def text_cols(r: LevelResult) -> str:
        # the gateway streams text, not token ids: with dummy weights the random ids decode to no
        # visible text, so there is no first-text time and no per-token rate to report there
        if r.thinker_tok_s <= 0 or math.isnan(r.ttft_ms["p50"]):
            return "n/a | n/a | n/a"
        tbw = nbytes["thinker_token"] * r.thinker_tok_s
        return f"{_q3(r.ttft_ms)} | {r.thinker_tok_s:.1f} | {tbw / 1e12:.2f} TB/s ({tbw / bw:.0%})"

    for r in results:
        fbw = nbytes["talker_frame"] * r.talker_frames_s
        ttft, tok_s, tbw = text_cols(r).split(" | ")
        rows.append(f"| {r.mode} | {r.concurrency} | {r.req_per_s:.2f} | {r.prompt_tokens:.0f} | {_q3(r.ttfp_ms)} | "
                    f"{_q3(r.rtf, '{:.3f}')} | {_q3(r.e2el_s, '{:.2f}')} | {ttft} | {tok_s} | {r.talker_frames_s:.1f} | "
                    f"{tbw} | {fbw / 1e12:.2f} TB/s ({fbw / bw:.0%}) | {r.failed} |")
    if ref and ref.result:
        x = ref.result
        rows.append(f"| transformers | 1 | {1 / x['ttfp_s']:.3f} | {x.get('prompt_tokens', '')} | {x['ttfp_s'] * 1000:.0f} | "
                    f"{x['rtf']:.3f} | {x['ttfp_s']:.2f} | {x['prefill_plus_1_ms']:.1f} (prefill+1) | "
                    f"{x['thinker_tok_s']:.1f} | | | | 0 |")
    return "\n".join(rows)


def reference_line(ref: ReferenceRun | None) -> str:
    if ref is None:
        return "transformers reference: not run (--no-reference)"
    if ref.result is None:
        return f"transformers reference: none for this workload ({ref.note})"
    return f"transformers reference: {ref.note}" if ref.note else ""


def server_table(results: list[LevelResult]) -> str:
    """Server-side means per stage and level (from the services' Prometheus histograms; the "client"
    row is the benchmark driver's own event loop). "seen at the gateway": the stage's first output
    (thinker: first token, talker: first frame, code2wav: first audio) from the request's arrival at
    the gateway, as the gateway relays it (gateway mode)."""
    rows = ["| mode | c | stage | queue wait ms | first output ms (from arrival) | seen at the gateway ms | step ms | "
            "steps | prefill batch | outbox wait ms | loop lag ms |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for stage, st in (r.server or {}).items():
            def f(key, fmt="{:.1f}"):
                return fmt.format(st[key]) if key in st else ""
            if not st:
                continue
            rows.append(f"| {r.mode} | {r.concurrency} | {stage} | {f('queue_wait_ms')} | {f('first_output_ms')} | "
                        f"{f('at_gateway_ms')} | "
                        f"{f('step_ms', '{:.2f}')} | {f('steps', '{:.0f}')} | {f('prefill_batch', '{:.2f}')} | "
                        f"{f('outbox_wait_ms', '{:.2f}')} | {f('loop_lag_ms', '{:.2f}')} |")
    streamed = [f"{r.mode} c={r.concurrency} {st['prefilled_before_commit']:.0%} "
                f"(of the clip's audio tokens {st.get('audio_prefilled_before_commit', 0.0):.0%})"
                for r in results for st in (r.server or {}).values() if "prefilled_before_commit" in st]
    if streamed:
        rows += ["", "Streamed realtime turns, share of the prompt prefilled before the commit (of the streamed "
                 "clip's audio tokens: its complete encoder windows): " + ", ".join(streamed)]
    return "\n".join(rows)


def ratios(results: list[LevelResult], ref: ReferenceRun | None) -> list[str]:
    lines = []
    x = ref.result if ref else None
    c1 = {r.mode: r for r in results if r.concurrency == 1}
    for mode in ("gateway", "split"):
        if x and mode in c1 and c1[mode].ttfp_ms["p50"] > 0:
            s = c1[mode]
            tok = f", thinker {s.thinker_tok_s / x['thinker_tok_s']:.1f}x tok/s" if s.thinker_tok_s > 0 else ""
            lines.append(f"- {mode} vs transformers at c=1: TTFP {x['ttfp_s'] * 1000 / s.ttfp_ms['p50']:.0f}x lower, "
                         f"RTF {x['rtf'] / s.rtf['p50']:.1f}x lower{tok}")
    for c in sorted({r.concurrency for r in results}):
        pair = {r.mode: r for r in results if r.concurrency == c}
        for mode in ("split", "gateway"):
            if mode in pair and "inprocess" in pair:
                a, b = pair[mode], pair["inprocess"]
                lines.append(f"- c={c}: {mode} / in-process TTFP p50 = {a.ttfp_ms['p50'] / b.ttfp_ms['p50']:.3f}, "
                             f"req/s = {a.req_per_s / max(b.req_per_s, 1e-9):.3f}")
    return lines


def section(wl: Workload, results: list[LevelResult], ref: ReferenceRun | None, bw: float,
            nbytes: dict[str, float], notes: list[str]) -> str:
    """One workload's part of results.md."""
    mine = [r for r in results if r.workload == wl.name]
    parts = [f"#### {wl.describe()}", table(mine, ref, bw, nbytes)]
    head = [reference_line(ref)] + notes
    parts += ["\n".join(f"- {line}" for line in head if line)]
    parts += ["Server side (means over each level's measured requests, warm-ups left out, from the services' "
              "metrics):", server_table(mine)]
    lines = ratios(mine, ref)
    if lines:
        parts.append("\n".join(lines))
    for r in mine:
        if r.path:
            root = "WebSocket session" if wl.realtime else "HTTP request"
            parts += [f"Path of a request, {r.mode} c={r.concurrency} (--trace: the services' spans of "
                      f"{r.path[0]['traces']} measured requests; median ms from the gateway's {root} span's start):",
                      trace_path.table(r.path)]
    return "\n\n".join(p for p in parts if p)
