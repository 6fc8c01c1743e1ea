"""The short reliability suite (issue #13) in CI: voxpipe.bench.reliability in its short mode on the
tiny checkpoint -- a few dozen hypothesis-fuzzed cases per API (HTTP chat and speech, realtime events,
Converse, raw thinker / talker / code2wav gRPC), a few random client disconnects, a small soak, a talker
SIGKILL and a SIGTERM drain, and the security checks -- against its own real processes (a thinker, two
talkers, a code2wav, a gateway with --api-key). The full run (`python -m voxpipe.bench.reliability
--full`) produced RELIABILITY.md."""

from __future__ import annotations

import json

import pytest

from voxpipe.bench import reliability as rel


@pytest.fixture(scope="module")
def report(tiny_model_dir):
    r = rel.run(rel.SHORT, tiny_model_dir, seed=0, log=lambda m: print(m, flush=True))
    print(rel.markdown(r))
    return r


def _bad(report) -> str:
    return json.dumps([f for row in report["fuzz"] for f in row["failures"]], indent=1)[:4000]


def test_every_api_was_fuzzed(report):
    assert [row["api"] for row in report["fuzz"]] == list(rel.APIS)
    for row in report["fuzz"]:
        assert row["cases"] >= rel.SHORT.cases // 2, row
        assert row["4xx"] > 0, row            # hostile inputs were refused ...
    assert sum(row["2xx"] for row in report["fuzz"]) > 0   # ... and valid ones served


def test_no_5xx_for_any_input(report):
    assert report["verdict"]["no_5xx"], _bad(report)


def test_no_hang_for_any_input(report):
    assert report["verdict"]["no_hang"], _bad(report)


def test_no_process_died(report):
    assert report["verdict"]["no_process_died"], (report["unexpected_exits"], [r["dead_after"] for r in report["fuzz"]])


def test_gauges_return_to_zero(report):
    assert report["verdict"]["gauges_zero"], ([r["gauges_after"] for r in report["fuzz"]],
                                              report["disconnects"]["gauges_after"], report["soak"]["gauges_after"])


def test_seeded_known_good_outputs_stay_byte_identical(report):
    assert report["verdict"]["known_good_identical"], report["known_good_checks"]


def test_soak_has_no_errors(report):
    assert report["verdict"]["soak_no_errors"], report["soak"]["outcomes"]


def test_a_killed_talker_fails_only_its_own_streams(report):
    kill = report["lifecycle"]["kill"]
    assert kill["on_killed_talker"] > 0 and kill["on_other_talker"] > 0, kill
    assert kill["killed_failed"] == kill["on_killed_talker"], kill
    assert kill["other_finished_complete"] == kill["on_other_talker"], kill


def test_a_killed_talkers_streams_fail_naming_the_talker(report):
    kill = report["lifecycle"]["kill"]
    assert kill["killed_failed_naming_talker"] == kill["on_killed_talker"], kill["statuses"]


def test_sigterm_drains_in_flight_streams(report):
    drain = report["lifecycle"]["drain"]
    assert drain["on_draining_talker"] == drain["streams"] > 0, drain
    assert report["verdict"]["drain_finished_all"], drain


def test_security_checks(report):
    failed = [c for c in report["security"] if not c["pass"]]
    assert not failed, failed


# ---------------------------------------------------------------------------------------------- bugs the full run found


def test_audio_too_short_for_the_features_is_a_value_error_not_a_crash(tiny_model_dir, omni_config):
    """Converse pcm16 audio of 2 samples at 384 kHz (and any clip under 201 samples at 16 kHz) made the
    gateway raise from numpy / torch.stft (UNKNOWN); now resampling keeps zero samples and the feature
    extractor refuses the clip with a ValueError, which every API turns into its 4xx."""
    import numpy as np

    from voxpipe.audio import resample
    from voxpipe.services.thinker.prompt import FeatureExtractor

    assert resample(np.zeros(2, np.float32), 384000, 16000).shape == (0,)
    fe = FeatureExtractor.for_model(tiny_model_dir, omni_config.thinker)
    for n in (0, 4, 200):
        with pytest.raises(ValueError):
            fe(np.zeros(n, np.float32))
    assert fe(np.zeros(201, np.float32)).shape[1] >= 1
