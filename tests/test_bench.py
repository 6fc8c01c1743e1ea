"""`voxpipe bench` end to end on the tiny checkpoint (CPU): the transformers reference in its own
process, the gateway driven by the openai SDK, the gRPC pipeline client and the in-process engines,
each at two concurrency levels, with the services' server-side histograms per level. Numbers on a
CPU mean nothing; what is checked is that every path runs, measures and reports."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_runs_every_mode_and_reports(tiny_model_dir, tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "voxpipe.cli", "--log-level", "WARNING", "bench", "--model", str(tiny_model_dir),
           "--load-format", "auto", "--device", "cpu", "--modes", "gateway,split,inprocess", "--concurrency", "1,2",
           "--requests", "3", "--warmup", "1", "--text-tokens", "4", "--frames", "6", "--base-port", "53151",
           "--devices", "thinker=cpu,talker=cpu,code2wav=cpu",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    ref = res["reference"]
    assert ref and ref["ttfp_s"] > 0 and ref["audio_s"] == (6 * 1920 - 555) / 24000
    levels = {(lv["mode"], lv["concurrency"]): lv for lv in res["levels"]}
    assert set(levels) == {(m, c) for m in ("gateway", "split", "inprocess") for c in (1, 2)}
    for (mode, c), lv in levels.items():
        assert lv["requests"] == 3 and lv["failed"] == 0, (mode, c)
        assert len(lv["ttfp_each_ms"]) == 3 and min(lv["ttfp_each_ms"]) > 0, (mode, c)
        assert abs(lv["audio_s"] - (6 * 1920 - 555) / 24000) < 1e-9, (mode, c)
        assert 0 < lv["ttft_ms"]["p50"] <= lv["ttfp_ms"]["p50"] <= lv["e2el_s"]["p50"] * 1000
        assert lv["thinker_tok_s"] > 0 and lv["talker_frames_s"] > 0
        for stage in ("thinker", "talker", "code2wav"):
            st = lv["server"][stage]
            assert st["steps"] > 0 and st["step_ms"] > 0 and st["first_output_ms"] > 0, (mode, c, stage)
            assert st["outbox_wait_ms"] >= 0, (mode, c, stage)
            if mode != "inprocess":   # each service's own event loop
                assert st["loop_lag_ms"] >= 0, (mode, c, stage)
        assert lv["server"]["thinker"]["prefill_batch"] >= 1
        assert lv["server"]["client"]["loop_lag_ms"] >= 0     # the driver's loop (the relay in split mode)
        if mode == "gateway":                                   # the gateway's loop (the relay in this mode)
            assert lv["server"]["gateway"]["loop_lag_ms"] >= 0
    md = (out / "results.md").read_text()
    assert "| transformers | 1 |" in md and "Server side" in md and "| loop lag ms |" in md
    assert "gateway vs transformers at c=1" in md and "c=2: gateway / in-process TTFP p50" in md


def test_bench_rejects_a_bad_devices_spec():
    from voxpipe.bench.harness import stage_devices

    assert stage_devices("thinker=cuda:0,talker=cuda:1") == {"thinker": "cuda:0", "talker": "cuda:1"}
    for bad in ("vocoder=cuda:1", "thinker", "talker="):
        try:
            stage_devices(bad)
        except SystemExit as e:
            assert "--devices: expected STAGE=DEVICE" in str(e) and repr(bad.split(",")[0]) in str(e)
        else:
            raise AssertionError(f"{bad!r} was accepted")
