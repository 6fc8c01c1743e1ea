"""`voxpipe bench` end to end on the tiny checkpoint (CPU): the transformers reference in its own
process, the gateway driven by the openai SDK, the gRPC pipeline client and the in-process engines,
each at two concurrency levels, with the services' server-side histograms per level. Numbers on a
CPU mean nothing; what is checked is that every path runs, measures and reports."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import free_ports


def test_layouts_parse_and_bad_specs_are_refused():
    import pytest

    from voxpipe.layout import Layout, LayoutError

    two = Layout.parse("thinker=cuda:0,talker=cuda:1,code2wav=cuda:1", "cuda")
    assert two.devices == {"thinker": ("cuda:0",), "talker": ("cuda:1",), "code2wav": ("cuda:1",)}
    assert two.single and two.gpus == ["cuda:0", "cuda:1"]
    omni = Layout.parse("thinker=cuda:0, talker=cuda:1+cuda:2, code2wav=cuda:1*2", "cuda")
    assert omni.devices["talker"] == ("cuda:1", "cuda:2") and omni.devices["code2wav"] == ("cuda:1", "cuda:1")
    assert not omni.single and omni.gpus == ["cuda:0", "cuda:1", "cuda:2"]
    assert omni.names("talker") == ["talker0", "talker1"] and omni.names("thinker") == ["thinker"]
    assert [n for n, _, _ in omni.processes()] == ["thinker", "talker0", "talker1", "code2wav0", "code2wav1"]
    assert Layout.parse("", "cpu").devices == {s: ("cpu",) for s in ("thinker", "talker", "code2wav")}
    for bad, message in [("vocoder=cuda:1", "expected STAGE=DEVICE"), ("thinker", "expected STAGE=DEVICE"),
                         ("talker=", "expected STAGE=DEVICE"), ("talker=gpu1", "'gpu1' is not a device"),
                         ("talker=cuda:1*0", "must be a positive integer"), ("talker=cuda*x", "positive integer"),
                         ("talker=cpu,talker=cpu", "talker named twice"), ("talker=cpu*17", "at most 16"),
                         ("talker=cpu++cpu", "'' is not a device")]:
        with pytest.raises(LayoutError, match=message):
            Layout.parse(bad, "cpu")


def test_sm_shares_parse_reach_their_stage_processes_and_bad_specs_are_refused(stack):
    import pytest

    from voxpipe.layout import MPS_SM_ENV, LayoutError, parse_sm_shares, sm_share_env

    assert parse_sm_shares("thinker=60, code2wav=100") == {"thinker": 60, "code2wav": 100}
    assert parse_sm_shares("") == {} and sm_share_env({"talker": 40}) == {"talker": {MPS_SM_ENV: "40"}}
    for bad, message in [("vocoder=50", "expected STAGE=PERCENT"), ("thinker", "expected STAGE=PERCENT"),
                         ("thinker=0", "not a whole percentage"), ("thinker=101", "not a whole percentage"),
                         ("thinker=50%", "not a whole percentage"), ("talker=40,talker=50", "talker named twice")]:
        with pytest.raises(LayoutError, match=message):
            parse_sm_shares(bad)

    def environ(stage: str) -> dict[str, str]:
        raw = open(f"/proc/{stack.procs[stage].pid}/environ", "rb").read().split(b"\0")
        return dict(item.decode().partition("=")[::2] for item in raw if item)

    # the session's stack runs its talker as `voxpipe up --mps-sm-percent talker=40` does
    assert environ("talker").get(MPS_SM_ENV) == "40"
    assert MPS_SM_ENV not in environ("thinker") and MPS_SM_ENV not in environ("code2wav")


def test_mps_priorities_parse_reach_their_stage_processes_and_bad_specs_are_refused(stack):
    import pytest

    from voxpipe.layout import MPS_PRIORITY_ENV, MPS_SM_ENV, LayoutError, mps_env, parse_mps_priorities

    assert parse_mps_priorities("thinker=below_normal, talker=normal") == {"thinker": 1, "talker": 0}
    assert parse_mps_priorities("") == {}
    assert mps_env({"talker": 40}, {"thinker": 1, "talker": 0}) == {
        "talker": {MPS_SM_ENV: "40", MPS_PRIORITY_ENV: "0"}, "thinker": {MPS_PRIORITY_ENV: "1"}}
    for bad, message in [("vocoder=normal", "expected STAGE=PRIORITY"), ("thinker", "expected STAGE=PRIORITY"),
                         ("thinker=low", "'low' is not one of normal, below_normal"), ("thinker=1", "is not one of"),
                         ("talker=normal,talker=normal", "talker named twice"),
                         ("thinker=" + "x" * 10_000, "is not one of")]:
        with pytest.raises(LayoutError, match=message) as refused:
            parse_mps_priorities(bad)
        assert len(str(refused.value)) < 200      # never the whole value back

    def environ(stage: str) -> dict[str, str]:
        raw = open(f"/proc/{stack.procs[stage].pid}/environ", "rb").read().split(b"\0")
        return dict(item.decode().partition("=")[::2] for item in raw if item)

    # the session's stack runs its thinker as `voxpipe up --mps-priority thinker=below_normal` does
    assert environ("thinker").get(MPS_PRIORITY_ENV) == "1"
    assert MPS_PRIORITY_ENV not in environ("talker") and MPS_PRIORITY_ENV not in environ("code2wav")


def test_bench_and_up_refuse_bad_layouts(tmp_path):
    """Refused before anything starts: every case in this process (the CLI's parser, then what the
    command runs first), one of each command through the real CLI in a subprocess."""
    import pytest

    from voxpipe.bench import harness
    from voxpipe.cli import build_parser, cmd_up
    from voxpipe.errors import ConfigError

    cases = [
        (["bench", "--device", "cpu", "--no-reference", "--out", str(tmp_path), "--devices", "talker=cpu*2"],
         "replicas need separate processes (modes split, gateway)"),
        (["bench", "--device", "cpu", "--no-reference", "--out", str(tmp_path), "--devices", "talker=tpu"],
         "--devices: talker: 'tpu' is not a device"),
        (["up", "--devices", "code2wav=cpu*0"], "error: --devices: code2wav: 'cpu*0': the replica count"),
        (["up", "--mps-sm-percent", "thinker=0"], "error: --mps-sm-percent: thinker: '0' is not a whole percentage"),
        (["bench", "--device", "cpu", "--no-reference", "--out", str(tmp_path), "--mps-sm-percent", "thinker=60"],
         "--mps-sm-percent limits the stages' share of the SMs under CUDA MPS: add --mps"),
        (["up", "--mps-priority", "thinker=high"], "error: --mps-priority: thinker: 'high' is not one of"),
        (["bench", "--device", "cpu", "--no-reference", "--out", str(tmp_path), "--mps-priority", "thinker=below_normal"],
         "--mps-priority sets the stages' client priority under CUDA MPS: add --mps"),
    ]
    for flags, message in cases:
        args = build_parser().parse_args(flags)
        with pytest.raises((SystemExit, ConfigError)) as refused:     # voxpipe up: a ConfigError, one line in main
            harness.prepare(args) if flags[0] == "bench" else cmd_up(args)
        said = str(refused.value.code) if isinstance(refused.value, SystemExit) else f"error: {refused.value}"
        assert message in said, (flags, said)
    for flags, message in (cases[1], cases[2]):
        proc = subprocess.run([sys.executable, "-m", "voxpipe.cli", *flags], capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and message in proc.stderr, (flags, proc.stderr[-1500:])
        assert "starting the stage services" not in proc.stdout and "all services up" not in proc.stdout, flags


# ---------------------------------------------------------------- the other bench/BENCHMARK.md workloads

_BENCH_PORTS = 120


def _without_leak_report(stderr: str) -> str:
    """stderr less triton's nanobind leak report at exit (hundreds of lines that hid the real error)."""
    return "\n".join(line for line in stderr.splitlines()
                     if not line.lstrip().startswith(("- leaked", "nanobind:", "See https://nanobind")))


def _bench(tmp_path, model, *flags: str, timeout: float = 600, base_port: int | None = None
           ) -> tuple[subprocess.CompletedProcess, dict, str]:
    """`voxpipe bench` on the CPU at small size, its report under tmp_path/bench. `base_port`: the first
    of _BENCH_PORTS ports set aside for it (default: a block free now)."""
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "voxpipe.cli", "--log-level", "WARNING", "bench", "--model", str(model),
           "--load-format", "auto", "--device", "cpu", "--concurrency", "1,2", "--requests", "2", "--warmup", "1",
           "--text-tokens", "4", "--frames", "6", "--out", str(out), *flags]
    if "--base-port" not in flags:
        cmd += ["--base-port", "free"]
    # a block of ports free now and below the ephemeral range (stages, the gateway at +99, metrics at +100)
    cmd = [str(base_port or free_ports(_BENCH_PORTS)) if a == "free" else a for a in cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + _without_leak_report(proc.stderr)[-3000:]
    return proc, json.loads((out / "results.json").read_text()), (out / "results.md").read_text()


# The runs of the three tests below that start services and check no timing: two at a time, from the
# first of those tests on (a bench on the tiny checkpoint keeps about one of CI's two cores busy, most
# of it starting processes); each test checks its own run's outcome. Longest first. The voice-clip run
# times the thinker against the appends: it runs alone, in its test.
_PARALLEL_RUNS = {
    "every_mode": ("--workload", "seedtts-like,voice-in,realtime", "--modes", "gateway,split,inprocess",
                   "--devices", "thinker=cpu,talker=cpu,code2wav=cpu", "--trace",
                   # the bench's requests share their system turn: with the prefix cache they would skip
                   # the batched prefill from position 0 that this checks (the thinker alone takes the flag)
                   "--thinker-arg=--no-prefix-cache"),
    "thinker_replicas": ("--workload", "conversation,realtime-conversation", "--modes", "split,gateway",
                         "--no-reference", "--thinker-replicas", "1,2", "--concurrency", "4", "--turns", "2",
                         "--turn-tokens", "40", "--context-tokens", "0", "--realtime-pace", "0",
                         "--text-tokens", "2", "--frames", "4"),
    "replicas": ("--workload", "seedtts-like,realtime", "--modes", "gateway,split",
                 "--devices", "talker=cpu+cpu,code2wav=cpu*2", "--temperature", "0.9", "--no-reference"),
}


@dataclass
class _Run:
    tmp: Path           # the run's folder: its report under bench/
    future: Future

    def result(self) -> tuple[subprocess.CompletedProcess, dict, str]:
        return self.future.result()


@pytest.fixture(scope="module")
def bench_runs(tiny_model_dir, tmp_path_factory) -> dict[str, _Run]:
    """_PARALLEL_RUNS started two at a time, each on its own block of ports; every_mode on the tiny
    checkpoint without its preprocessor_config.json (voice-in's features then come from config.json,
    as for full-size dummy runs)."""
    no_preprocessor = tmp_path_factory.mktemp("tiny-no-preprocessor")
    for f in tiny_model_dir.iterdir():
        if f.name != "preprocessor_config.json":
            (no_preprocessor / f.name).symlink_to(f)
    first_port = free_ports(_BENCH_PORTS * len(_PARALLEL_RUNS))
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = {}
        for i, (name, flags) in enumerate(_PARALLEL_RUNS.items()):
            tmp = tmp_path_factory.mktemp(f"bench-{name}")
            model = no_preprocessor if name == "every_mode" else tiny_model_dir
            runs[name] = _Run(tmp, pool.submit(_bench, tmp, model, *flags, base_port=first_port + i * _BENCH_PORTS))
        yield runs


AUDIO_S = (6 * 1920 - 555) / 24000      # 6 frames forced


def _check_levels(levels: dict, want: set, prompt_tokens: int | None = None) -> None:
    assert set(levels) == want
    for key, lv in levels.items():
        assert lv["requests"] == 2 and lv["failed"] == 0 and not lv["errors"], (key, lv["errors"])
        assert len(lv["ttfp_each_ms"]) == 2 and min(lv["ttfp_each_ms"]) > 0, key
        assert abs(lv["audio_s"] - AUDIO_S) < 1e-9, key
        for metric in ("ttfp_ms", "rtf", "e2el_s", "ttft_ms"):
            assert set(lv[metric]) == {"p50", "p90", "p99", "mean"}, (key, metric)
        assert 0 < lv["ttfp_ms"]["p50"] <= lv["ttfp_ms"]["p90"] <= lv["ttfp_ms"]["p99"] <= lv["e2el_s"]["p99"] * 1000
        if prompt_tokens is not None:
            assert lv["prompt_tokens"] == prompt_tokens, key


def test_bench_runs_every_mode_and_reports(bench_runs):
    """seedtts-like, voice-in and realtime against one start of the services, in every mode (realtime:
    gateway only), on the tiny checkpoint without its preprocessor_config.json; each workload's
    reference gets the same prompt as its levels, and realtime takes seedtts-like's reference, the
    same model work, run once."""
    proc, res, md = bench_runs["every_mode"].result()
    ref = res["reference"]
    assert ref == res["references"]["seedtts-like"]["result"]
    assert ref and ref["ttfp_s"] > 0 and ref["audio_s"] == AUDIO_S
    levels = {(lv["mode"], lv["concurrency"]): lv for lv in res["levels"] if lv["workload"] == "seedtts-like"}
    assert set(levels) == {(m, c) for m in ("gateway", "split", "inprocess") for c in (1, 2)}
    for (mode, c), lv in levels.items():
        assert lv["requests"] == 2 and lv["failed"] == 0, (mode, c)
        assert len(lv["ttfp_each_ms"]) == 2 and min(lv["ttfp_each_ms"]) > 0, (mode, c)
        assert abs(lv["audio_s"] - AUDIO_S) < 1e-9, (mode, c)
        assert 0 < lv["ttft_ms"]["p50"] <= lv["ttfp_ms"]["p50"] <= lv["e2el_s"]["p50"] * 1000
        assert lv["thinker_tok_s"] > 0 and lv["talker_frames_s"] > 0
        for stage in ("thinker", "talker", "code2wav"):
            st = lv["server"][stage]
            assert st["steps"] > 0 and st["step_ms"] > 0 and st["first_output_ms"] > 0, (mode, c, stage)
            assert st["requests"] == 2, (mode, c, stage, st)   # the measured requests: the warm-up left out
            assert st["outbox_wait_ms"] >= 0, (mode, c, stage)
            if mode != "inprocess":   # each service's own event loop
                assert st["loop_lag_ms"] >= 0, (mode, c, stage)
        assert lv["server"]["thinker"]["prefill_batch"] >= 1
        assert lv["server"]["client"]["loop_lag_ms"] >= 0     # the driver's loop (the relay in split mode)
        if mode == "gateway":                                   # the gateway's loop (the relay in this mode)
            assert lv["server"]["gateway"]["loop_lag_ms"] >= 0
            # each stage's first output as the gateway saw it: in path order, and after the stage made it
            seen = [lv["server"][s]["at_gateway_ms"] for s in ("thinker", "talker", "code2wav")]
            assert 0 < seen[0] <= seen[1] <= seen[2] <= lv["ttfp_ms"]["p99"], seen
            assert lv["server"]["thinker"]["first_output_ms"] <= seen[0]
            # --trace: the measured requests' path through the services, from their spans
            spans = {(r["service"], r["span"]): r for r in lv["path"]}
            assert all(r["traces"] == 2 and r["requests"] >= 2 for r in lv["path"]), lv["path"]
            call = spans[("gateway", "voxpipe.v1.Thinker/Generate")]
            thinker = spans[("thinker", "voxpipe.v1.Thinker/Generate")]
            prefill = spans[("thinker", "prefill")]
            talker = spans[("talker", "voxpipe.v1.Talker/Generate")]
            first_frame = spans[("talker", "first_frame")]
            assert 0 <= call["start_ms"] <= thinker["start_ms"] <= prefill["start_ms"] <= prefill["end_ms"]
            # the talker's stream opens during the thinker's prefill (the prompt leaves at admission)
            assert talker["start_ms"] < prefill["end_ms"] < first_frame["end_ms"], lv["path"]
            assert ("code2wav", "first_chunk_out") in spans and ("gateway", "voxpipe.v1.Code2Wav/Listen") in spans
            seen = [spans[("gateway", f"event: {s} first output")]["start_ms"] for s in ("thinker", "talker", "code2wav")]
            assert prefill["end_ms"] <= seen[0] <= seen[1] <= seen[2], lv["path"]
        else:
            assert all("at_gateway_ms" not in lv["server"][s] for s in ("thinker", "talker", "code2wav"))
            assert lv["path"] == []
    assert "| transformers | 1 |" in md and "Server side" in md and "| loop lag ms |" in md
    assert "gateway vs transformers at c=1" in md and "c=2: gateway / in-process TTFP p50" in md
    assert "Path of a request, gateway c=1 (--trace" in md and "| thinker | prefill | 2 |" in md

    # voice-in: gateway (wav decoded there) and split / in-process (features made by the driver): one prompt
    voice = res["references"]["voice-in"]["result"]
    assert voice["audio_frames_in"] == 570 and voice["audio_s"] == AUDIO_S   # the 5.7 s clip, 100 frames a second
    levels = {(lv["workload"], lv["mode"], lv["concurrency"]): lv for lv in res["levels"] if lv["workload"] == "voice-in"}
    _check_levels(levels, {("voice-in", m, c) for m in ("gateway", "split", "inprocess") for c in (1, 2)},
                  prompt_tokens=voice["prompt_tokens"])
    assert voice["prompt_tokens"] > 570 // 8                # the clip's audio placeholders are in it
    assert "#### voice-in: the voice clip + \"Please answer briefly.\"" in md
    assert "| TTFP p50 / p90 / p99 ms | RTF p50 / p90 / p99 | E2EL p50 / p90 / p99 s | TTFT p50 / p90 / p99 ms |" in md

    # realtime: gateway mode only, and no second reference run (seedtts-like's is the same model work)
    assert proc.stdout.count("transformers reference (") == 4       # seedtts-like's and voice-in's: starting, result
    refs = res["references"]
    assert refs["seedtts-like"]["result"] and refs["realtime"]["result"] == refs["seedtts-like"]["result"]
    assert "same model work as seedtts-like" in refs["realtime"]["note"]
    assert res["notes"]["realtime"] == ["not run in mode split, inprocess: the realtime WebSocket is the gateway's"]
    levels = {(lv["mode"], lv["concurrency"]): lv for lv in res["levels"] if lv["workload"] == "realtime"}
    _check_levels({("realtime", *k): lv for k, lv in levels.items()}, {("realtime", "gateway", c) for c in (1, 2)},
                  prompt_tokens=100)


def test_bench_realtime_beside_seedtts_like_in_one_run_on_replicas(bench_runs):
    """Two workloads against one start of the services, laid out as two talkers and two code2wavs
    (--devices, issue 14's layouts on the CPU), sampled (--temperature: chat, realtime and the gRPC
    pipeline client each ask for it); realtime runs in gateway mode only and says so. No reference
    (test_bench_runs_every_mode_and_reports checks that realtime shares seedtts-like's); the notes
    still say that the reference would run greedy."""
    proc, res, md = bench_runs["replicas"].result()
    assert proc.stdout.count("split: starting the stage services (thinker cpu; talker 2x (cpu, cpu); "
                             "code2wav 2x (cpu, cpu)) and the gateway") == 1
    assert res["layout"] == {"thinker": ["cpu"], "talker": ["cpu", "cpu"], "code2wav": ["cpu", "cpu"]}
    assert "layout: thinker cpu; talker 2x (cpu, cpu); code2wav 2x (cpu, cpu)" in md
    # 3 modes x levels (1, 2) x 2 requests + warm-ups went through one thinker; every replica took some
    served = res["split_info"]["streams_by_process"]
    assert set(served) == {"thinker", "talker0", "talker1", "code2wav0", "code2wav1"}
    assert all(served[n] > 0 for n in served), served
    assert served["talker0"] + served["talker1"] == served["code2wav0"] + served["code2wav1"] == served["thinker"]
    levels = {(lv["workload"], lv["mode"], lv["concurrency"]): lv for lv in res["levels"]}
    want = {("seedtts-like", m, c) for m in ("gateway", "split") for c in (1, 2)} | {("realtime", "gateway", c) for c in (1, 2)}
    _check_levels(levels, want, prompt_tokens=100)
    greedy_reference = ("the transformers reference runs greedy (its cost per token and frame is that of sampling "
                        "but for the draws)")
    assert res["notes"]["realtime"] == ["not run in mode split: the realtime WebSocket is the gateway's",
                                        greedy_reference]
    assert res["notes"]["seedtts-like"] == [greedy_reference]
    assert "frames forced, sampled at temperature 0.9 (seed: the request's index)" in md
    assert "; sampled at temperature 0.9; copy bandwidth" in md and "; greedy; " not in md
    assert res["references"] == {} and "transformers reference: not run (--no-reference)" in md
    assert "#### realtime: a 100-token text prompt over the realtime WebSocket" in md
    assert "not run in mode split: the realtime WebSocket is the gateway's" in md


def test_bench_realtime_with_the_voice_clip(tiny_model_dir, tmp_path):
    """realtime with the user turn spoken (input_audio_buffer.append + commit), on the tiny checkpoint
    with its preprocessor_config.json, the shipped 10 s utterance (bench/voice_clip.py: LONG_CLIP)."""
    from voxpipe.bench.voice_clip import LONG_CLIP

    proc, res, md = _bench(tmp_path, tiny_model_dir, "--workload", "realtime", "--realtime-audio", "--modes", "gateway",
                           "--no-reference", "--concurrency", "2", "--base-port", "free", "--realtime-pace", "8",
                           "--audio", str(LONG_CLIP))
    levels = {(lv["workload"], lv["mode"], lv["concurrency"]): lv for lv in res["levels"]}
    _check_levels(levels, {("realtime", "gateway", 2)})
    assert levels["realtime", "gateway", 2]["prompt_tokens"] > 130
    assert res["references"] == {} and "transformers reference: not run (--no-reference)" in md
    assert ("realtime: the voice clip appended to the input audio buffer and committed over the realtime WebSocket, "
            "appended at 8x real time (TTFP from the commit: the end of speech)") in md
    # the clip streamed to the thinker as it was appended: some of each prompt prefilled before its commit;
    # of its 130 audio tokens (1,000 frames), at most its one complete 8 s window's 104
    thinker = levels["realtime", "gateway", 2]["server"]["thinker"]
    assert 0 < thinker["prefilled_before_commit"] <= 1
    assert 0 < thinker["audio_prefilled_before_commit"] <= 104 / 130 + 1e-9
    assert "Streamed realtime turns, share of the prompt prefilled before the commit (of the streamed clip's audio " \
           "tokens: its complete encoder windows): gateway c=2 " in md
    assert "% of the clip's audio tokens" in proc.stdout


def test_bench_compares_one_thinker_replica_with_two(bench_runs):
    """--thinker-replicas 1,2: the services started twice, with one thinker and with two; the chat
    conversation (split: prefix-aware choice) and the realtime voice sessions (gateway: session
    affinity) run against each start; the report sets the prefix hit rate with two replicas beside
    one's and gives the turns per replica and their spread."""
    run = bench_runs["thinker_replicas"]
    proc, res, md = run.result()
    tmp_path = run.tmp
    assert proc.stdout.count("split: starting the stage services (thinker cpu; talker cpu; code2wav cpu)") == 1
    assert proc.stdout.count("split: starting the stage services (thinker 2x (cpu, cpu); talker cpu; code2wav cpu)") == 1
    assert res["thinker_replicas"] == [1, 2] and [r["thinker_replicas"] for r in res["replica_runs"]] == [1, 2]
    one, two = res["replica_runs"]
    assert set(one["streams_by_process"]) == {"thinker", "talker", "code2wav"}
    assert {"thinker0", "thinker1"} <= set(two["streams_by_process"])
    for key in ("conversation", "realtime_conversation"):
        assert res[key] == one[key]
        for n in (1, 2):
            saved = json.loads((tmp_path / "bench" / f"{key}-{n}-thinkers.json").read_text())
            assert saved == res["replica_runs"][n - 1][key]
        a, b = one[key]["levels"][0], two[key]["levels"][0]
        assert a["sessions"] == b["sessions"] == 4 and a["failed"] == b["failed"] == 0
        assert len(a["replicas"]) == 1 and len(b["replicas"]) == 2, (a["replicas"], b["replicas"])
        loads = [d.get("turns", d.get("streams")) for d in b["replicas"].values()]
        assert sum(loads) == 8, b["replicas"]                            # 4 sessions x 2 turns
        assert b["load_spread"] == (max(loads) - min(loads)) / (sum(loads) / 2)
        if key == "conversation":   # no two sessions share a block: their first turns go by load, 2 and 2
            assert sorted(loads) == [4, 4], b["replicas"]
        # each session's second turn found its history where its first turn went, as on one replica (the
        # realtime sessions' first turns share the system turn's block: a replica that has not seen it misses)
        assert a["cached_fraction"] > 0 and b["cached_fraction"] >= a["cached_fraction"] - 0.05, (key, a, b)
    # the gateway's thinker picks: every session's second turn where its first went. (Their first turns
    # share the system turn's block, known where the warm-up session went: it attracts the first of them
    # only -- from then on more than one session began with it -- and the others go by load.)
    routed = two["realtime_conversation"]["levels"][0]["routed"]
    assert sum(routed.values()) == 8 and routed["session"] == 4, routed
    assert one["realtime_conversation"]["levels"][0]["routed"] == {"least_loaded": 8, "prefix": 0, "session": 0}
    assert "#### thinker replicas compared (--thinker-replicas)" in md
    assert "| conversation | 4 | 2 |" in md and "| realtime-conversation | 4 | 2 |" in md
    assert "With 2 thinker replicas (thinker 2x (cpu, cpu); talker cpu; code2wav cpu):" in md
    assert "| thinker0 |" in md and "load spread (max - min) / mean of streams" in md


def test_bench_refuses_bad_workload_flags(tmp_path, capsys):
    """Each bad flag is refused, naming it, before anything starts: two cases through the real CLI in
    a subprocess, every case through the same parser and `harness.prepare` (what `bench` runs first)."""
    import pytest

    from voxpipe.bench import harness
    from voxpipe.cli import build_parser

    base = ["bench", "--device", "cpu", "--no-reference", "--out", str(tmp_path)]
    cases = [
        (["--workload", "seedtts-like,voice-out"], "unknown workload 'voice-out'; choose from seedtts-like, long-prompt"),
        (["--workload", ""], "unknown workload"),
        (["--temperature", "warm"], "--temperature: not a number: 'warm'"),
        (["--temperature", "-0.5"], "--temperature: temperature must be in [0, 100], got -0.5"),
        (["--realtime-pace", "-1"], "--realtime-pace: must be >= 0, got -1"),
        (["--concurrency", "1,x"], "--concurrency: expected positive integers"),
        (["--modes", "gateway,grpc"], "--modes: expected a comma list of gateway, split, inprocess"),
        (["--workload", "realtime", "--modes", "split,inprocess"], "--workload realtime runs only in gateway mode"),
        (["--trace", "--modes", "split"], "--trace follows requests from the gateway's spans: add gateway to --modes"),
        (["--workload", "voice-in", "--modes", "split", "--audio", str(tmp_path / "missing.wav")],
         f"--audio: no such file: {tmp_path / 'missing.wav'}"),
    ]
    cases += [   # the live workload's flags
        (["--workload", "live", "--live-clients", "chat,grpc"], "--live-clients: expected a comma list of realtime, chat"),
        (["--workload", "live", "--reply-seconds", "0"], "--reply-seconds: must be positive, got 0"),
        (["--workload", "live", "--live-duration", "nan"], "--live-duration: must be positive, got nan"),
        (["--workload", "live", "--think-seconds", "-1"], "--think-seconds: must be >= 0, got -1"),
        (["--workload", "live", "--jitter-ms", "soon"], "--jitter-ms: not a number: 'soon'"),
        (["--workload", "live", "--live-max", "1.5"], "--live-max: not a whole number: '1.5'"),
        (["--workload", "live", "--live-resolution", "0"], "--live-resolution: must be positive, got 0"),
        (["--workload", "live", "--modes", "split"], "--workload live runs only in gateway mode"),
        (["--workload", "live", "--ablation"], "--ablation runs closed-loop split levels; the live workload runs"),
    ]
    cases += [   # the multi-turn workloads and --thinker-replicas
        (["--workload", "realtime-conversation", "--modes", "split"],
         "--workload realtime-conversation runs only in gateway mode"),
        (["--workload", "realtime-conversation", "--modes", "gateway", "--turns", "0"], "--turns must be at least 1, got 0"),
        (["--thinker-replicas", "1,0"], "--thinker-replicas: expected positive integers separated by commas, got '1,0'"),
        (["--thinker-replicas", "two"], "--thinker-replicas: expected positive integers"),
        (["--thinker-replicas", "1,17", "--modes", "split"], "--thinker-replicas: thinker: 17 replicas (from 1 to 16)"),
        (["--thinker-replicas", "1,2"], "--thinker-replicas starts the services once per count (modes split, gateway): "
                                        "leave inprocess out of --modes"),
        (["--thinker-replicas", "2", "--modes", "split", "--ablation"], "--thinker-replicas starts the services once"),
        (["--workload", "live", "--modes", "gateway", "--thinker-replicas", "1,2"],
         "--thinker-replicas compares conversation workloads"),
    ]
    (tmp_path / "noise.wav").write_bytes(b"not a wav file at all")
    cases.append((["--workload", "voice-in", "--modes", "split", "--audio", str(tmp_path / "noise.wav")],
                  "is not a readable wav file"))
    for flags, message in cases:
        capsys.readouterr()
        with pytest.raises(SystemExit) as refused:
            harness.prepare(build_parser().parse_args(base + flags))
        said = refused.value.code if isinstance(refused.value.code, str) else capsys.readouterr().err
        assert refused.value.code != 0 and message in said, (flags, said[-1500:])
    for flags, message in (cases[2], cases[6]):     # an argparse refusal and a plan refusal, end to end
        proc = subprocess.run([sys.executable, "-m", "voxpipe.cli", *base, *flags], capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode != 0 and message in proc.stderr, (flags, proc.stderr[-1500:])
        assert "starting the stage services" not in proc.stdout, flags


def test_bench_names_the_packages_a_gateway_workload_lacks(monkeypatch):
    import argparse
    import importlib.util

    import pytest

    from voxpipe.bench import harness

    p = argparse.ArgumentParser()
    harness.add_arguments(p)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("websockets", "soundfile") else real(name, *a))
    plan = harness.Plan.of(p.parse_args(["--workload", "seedtts-like,realtime", "--modes", "gateway,split"]))
    assert plan.modes == {"seedtts-like": ["gateway", "split"], "realtime": ["gateway"]}
    with pytest.raises(SystemExit, match="needs the Python packages websockets: pip install"):
        harness.check_packages(plan)
    plan = harness.Plan.of(p.parse_args(["--workload", "voice-in", "--modes", "gateway"]))
    with pytest.raises(SystemExit, match="needs the Python packages soundfile"):
        harness.check_packages(plan)
    harness.check_packages(harness.Plan.of(p.parse_args(["--workload", "voice-in,long-prompt", "--modes", "split"])))
    monkeypatch.setattr(importlib.util, "find_spec",        # --trace: the OTLP exporter the services need
                        lambda name, *a: None if name.startswith("opentelemetry.exporter") else real(name, *a))
    with pytest.raises(SystemExit, match="needs the Python packages opentelemetry.exporter.otlp.proto.grpc"):
        harness.check_packages(harness.Plan.of(p.parse_args(["--trace", "--modes", "gateway"])))
    monkeypatch.setattr(importlib.util, "find_spec",        # the live workload: both gateway clients
                        lambda name, *a: None if name in ("openai", "websockets") else real(name, *a))
    with pytest.raises(SystemExit, match="needs the Python packages openai, websockets: pip install"):
        harness.check_packages(harness.Plan.of(p.parse_args(["--workload", "live", "--modes", "gateway"])))
    assert [w.levels for w in harness.workloads_from(p.parse_args(["--workload", "long-prompt,realtime"]))] == \
        [(1, 16), (1, 8)]
    wl = harness.workloads_from(p.parse_args(["--workload", "long-prompt", "--text-tokens", "48", "--frames", "125"]))[0]
    assert (wl.prompt_tokens, wl.text_tokens, wl.frames) == (2500, 48, 125)


# ---------------------------------------------------------------- the live workload (bench/live.py)

LIVE_FLAGS = ["--reply-seconds", "0.5", "--think-seconds", "0.2", "--live-duration", "1.5"]


def _live_args(model, out, *flags: str):
    from voxpipe.bench import harness
    from voxpipe.cli import build_parser

    args = build_parser().parse_args(["bench", "--workload", "live", "--quick", "--device", "cpu", "--model", str(model),
                                      "--load-format", "auto", "--no-reference", "--out", str(out), *LIVE_FLAGS, *flags])
    return args, *harness.prepare(args)


def _served(base_url: str) -> str:
    import httpx

    return httpx.get(f"{base_url}/v1/models").json()["data"][0]["id"]


def test_bench_live_quick_searches_both_clients_and_writes_its_report(gateway, tiny_model_dir, tmp_path):
    """`voxpipe bench --workload live --quick` as the bench runs it once its services are up (the CLI's
    parser, `prepare`, `run_live`, `write_live`), against the session's stack and gateway: levels 1
    and 2 through the realtime WebSocket and chat SSE, each level's arithmetic consistent, the JSON
    report and the plot under --out."""
    import asyncio

    from voxpipe.bench import harness, live, playback

    args, plan, cfg, _, makers = _live_args(tiny_model_dir, tmp_path)
    wl = plan.workloads[0]
    assert plan.modes == {"live": ["gateway"]} and plan.notes["live"] == \
        ["not run in mode split, inprocess: the live sessions' clients are the gateway's"]
    assert (wl.frames, wl.text_tokens) == (6, 2)          # 0.5 s at 12.5 frames a second; 48 / 125 of that
    report = asyncio.run(harness.run_live(args, wl, makers["live"], gateway.base_url, _served(gateway.base_url), plan))
    harness.write_live(tmp_path, report)
    assert set(report["capacity"]) == {"realtime", "chat"}
    assert report["settings"]["first"] == [1, 2] and report["settings"]["most"] == 2
    for run in report["clients"]:
        levels = run["levels"]
        assert [lv["sessions"] for lv in levels] == [1, 2], run
        assert run["capacity"] == playback.capacity([live.LiveLevel(**lv) for lv in levels])
        for lv in levels:
            assert lv["refusals"] == 0 and lv["failed"] == 0 and not lv["errors"], lv
            assert lv["requests"] == lv["completed"] >= lv["sessions"]
            assert abs(lv["audio_s"] - AUDIO_S) < 1e-9 and lv["packets"] >= 1
            t = lv["ttfp_ms"]
            assert 0 < t["p50"] <= t["p90"] <= t["p99"]
            assert (lv["underruns"] == 0) == (lv["underrun_ms"] == 0) and lv["underrun_ms"] >= 0
            assert lv["sessions_with_underruns"] <= min(lv["sessions"], lv["underruns"])
            assert lv["holds"] == (lv["underruns"] == 0 and t["p90"] <= 300.0)
            assert lv["client_lag_ms"]["max"] >= lv["client_lag_ms"]["mean"] >= 0
    assert 1 <= len(report["slack"]) <= 2
    for series in report["slack"]:
        assert series["client"] == "realtime" and len(series["slack_s"]) == series["sessions"]
        for values in series["slack_s"].values():
            assert len(values) == len(series["t_s"]) and min(values) >= 0 and max(values) > 0
    assert json.loads((tmp_path / "live.json").read_text()) == report
    assert (tmp_path / "live.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = live.section(report)
    assert "| realtime | 2 |" in md and "| chat | 1 |" in md and "Live-stream capacity: realtime: **" in md


def test_bench_live_counts_refusals_apart(stack, tiny_model_dir, tmp_path):
    """A gateway with --max-sessions=1 whose one slot a realtime session holds: every live turn is
    refused (429 over HTTP, session_limit_reached over the WebSocket), counted as refusals, not as
    failures, and the level does not hold; once the slot is free the next level is served."""
    import asyncio

    from websockets.asyncio.client import connect

    from conftest import GatewayProcess
    from voxpipe.bench import live
    from voxpipe.bench.gateway_client import GatewayStream
    from voxpipe.bench.realtime_client import RealtimeStream

    args, plan, _, _, makers = _live_args(tiny_model_dir, tmp_path, "--live-duration", "0.5")
    settings = live.Settings.of(args, plan.workloads[0])
    maker = makers["live"]
    gw = GatewayProcess(tiny_model_dir, stack.address("thinker"), stack.address("code2wav"), "--max-sessions=1")
    try:
        model = _served(gw.base_url)

        async def go():
            sse = GatewayStream(gw.base_url + "/v1", model)
            try:
                async with connect(gw.base_url.replace("http", "ws") + f"/v1/realtime?model={model}") as held:
                    assert json.loads(await held.recv())["type"] == "session.created"
                    refused = [(await live.run_level("chat", sse, maker.chat, 1, settings))[0],
                               (await live.run_level("realtime", RealtimeStream(gw.base_url, model), maker.realtime,
                                                     1, settings))[0]]
                served = (await live.run_level("chat", sse, maker.chat, 1, settings))[0]
                return refused, served
            finally:
                await sse.close()
        refused, served = asyncio.run(go())
    finally:
        gw.stop()
    for lv in refused:
        assert lv.requests >= 1 and lv.refusals == lv.requests and lv.failed == 0 and lv.completed == 0, lv
        assert not lv.holds and lv.errors == [] and lv.underruns == 0
    assert served.refusals == 0 and served.failed == 0 and served.completed >= 1


def test_ablation_levels_keep_the_runs_layout_and_mps_settings():
    """--ablation's one-workload split plan (it was built with too few fields: a TypeError before any level)."""
    import argparse

    from voxpipe.bench import harness

    p = argparse.ArgumentParser()
    harness.add_arguments(p)
    plan = harness.Plan.of(p.parse_args(["--workload", "seedtts-like,long-prompt", "--modes", "gateway,split", "--mps",
                                         "--mps-priority", "thinker=below_normal", "--mps-sm-percent", "talker=50"]))
    one = plan.split_only(plan.workloads[1])
    assert [w.name for w in one.workloads] == ["long-prompt"] and one.modes == {"long-prompt": ["split"]}
    assert one.notes == {"long-prompt": []} and one.layout == plan.layout and one.thinker_replicas == ()
    assert one.mps_priorities == {"thinker": 1} and one.sm_shares == {"talker": 50}


def test_per_stage_flags_go_to_their_stage_after_the_benchs_own():
    """--talker-arg / --code2wav-arg / --thinker-arg: each stage's own flags, last on its command line (so a talker's
    --kv-cache-tokens or --gpu-memory-fraction wins over the bench's memory share); unknown flags fail in that stage."""
    import argparse

    from voxpipe.bench import harness

    p = argparse.ArgumentParser()
    harness.add_arguments(p)
    args = p.parse_args(["--talker-arg=--kv-cache-tokens=65536", "--thinker-arg=--no-prefix-cache",
                         "--talker-arg=--gpu-memory-fraction=0.12", "--code2wav-arg=--max-batch=8"])
    assert harness.stage_args(args) == {"thinker": ["--no-prefix-cache"],
                                        "talker": ["--kv-cache-tokens=65536", "--gpu-memory-fraction=0.12"],
                                        "code2wav": ["--max-batch=8"]}
    assert harness.stage_args(p.parse_args([])) == {"thinker": [], "talker": [], "code2wav": []}
