"""The live workload's plot (PNG): the live-stream capacity per layout and client over one or more
reports (live.json, as `voxpipe bench --workload live` writes under --out), and the slack over time
of each session in the first report's slack series (at the capacity, and the fewest sessions that
failed above it).

    python -m voxpipe.bench.live_plot OUT/live.json [MORE/live.json ...] --out bench/live-capacity.png
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path


def label(report: dict, client: str) -> str:
    commit = report.get("commit", "")
    return f"{report['layout']}\n{client}" + (f" @ {commit}" if commit else "")


def draw(reports: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slack = reports[0]["slack"]
    fig, axes = plt.subplots(1, 1 + len(slack), figsize=(5 + 6 * len(slack), 4.5), squeeze=False)
    bars = axes[0][0]
    names, caps = [], []
    for r in reports:
        for client, n in r["capacity"].items():
            names.append(label(r, client))
            caps.append(n)
    bars.bar(range(len(caps)), caps, color="tab:blue")
    bars.set_xticks(range(len(caps)), names, fontsize=7)
    for x, n in enumerate(caps):
        bars.annotate(str(n), (x, n), ha="center", va="bottom")
    s = reports[0]["settings"]
    bars.set_ylabel("sessions")
    bars.set_title(f"live-stream capacity\n(0 underruns, TTFP p90 <= {s['ttfp_budget_ms']:g} ms)", fontsize=9)
    for ax, series in zip(axes[0][1:], slack):
        for values in series["slack_s"].values():
            ax.plot(series["t_s"], values, linewidth=0.7)
        ax.axhline(0.0, color="black", linewidth=0.5)
        ax.set_xlabel("s since the level's start")
        ax.set_ylabel("slack: audio delivered - played (s)")
        verdict = "holds" if series["holds"] else "fails"
        ax.set_title(f"{series['client']}, {series['sessions']} sessions ({verdict}): "
                     f"{len(series['slack_s'])} sessions' slack", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_or_say(reports: list[dict], path: Path) -> str:
    """Draw when matplotlib is importable (the bench / test extras); else say how to draw it later."""
    if importlib.util.find_spec("matplotlib") is None:
        return (f"live plot not drawn: matplotlib is not installed here; draw it where it is with "
                f"python -m voxpipe.bench.live_plot {path.with_suffix('.json')} --out {path}")
    draw(reports, path)
    return f"live plot: {path}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", help="live.json files (the first one's slack is drawn)")
    p.add_argument("--out", required=True, help="the PNG to write")
    args = p.parse_args(argv)
    draw([json.loads(Path(f).read_text()) for f in args.reports], Path(args.out))
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
