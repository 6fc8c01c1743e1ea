"""What `--model` names and how a command says it cannot run: a Hugging Face repo id resolved from
a hub cache laid out as huggingface_hub lays it out (HF_HOME, HF_HUB_OFFLINE=1: never the network),
a folder that is not a Qwen3-Omni checkpoint, a device this torch lacks -- each a single line
and exit 2; `--help` without the heavy imports, `--version` and the gateway's `/version`."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import GatewayProcess, StageProcesses
from voxpipe import version
from voxpipe.errors import ConfigError
from voxpipe.services.runtime.checkpoint import resolve_model

REPO = "Qwen/Qwen3-Omni-Tiny-Test"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(hf_home: Path, checkpoint: Path, repo: str = REPO) -> Path:
    """`checkpoint`'s files in a hub cache under `hf_home` as huggingface_hub writes one: blobs named
    by their hash, the snapshot's files as relative links to them, refs/main naming the snapshot."""
    root = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / REVISION
    (root / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(checkpoint.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, root / "blobs" / digest)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", digest))
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(REVISION)
    return snapshot


@pytest.fixture(scope="module")
def hub(tiny_model_dir, tmp_path_factory) -> Path:
    hf_home = tmp_path_factory.mktemp("hf-home")
    fake_hub_cache(hf_home, Path(tiny_model_dir))
    return hf_home


@pytest.fixture
def offline_hub(hub, monkeypatch) -> Path:
    monkeypatch.setenv("HF_HOME", str(hub))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "voxpipe.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return lines[0]


# ----------------------------------------------------------------------------- a repo id from the hub cache

def test_a_stage_and_the_gateway_serve_a_repo_id_from_the_hub_cache(offline_hub):
    stages = StageProcesses(REPO)          # `--model Qwen/...`: resolved in the stage process
    gateway = None
    try:
        address = stages.start("thinker", "thinker")
        stages.wait_ready()
        with grpc.insecure_channel(address) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        gateway = GatewayProcess(REPO, address, "127.0.0.1:1")
        # clients see the repo id, not the cache's snapshot folder
        assert httpx.get(f"{gateway.base_url}/v1/models").json()["data"][0]["id"] == REPO
        assert httpx.get(f"{gateway.base_url}/version").json() == {"version": version(), "model": REPO}
    finally:
        if gateway is not None:
            gateway.stop()
        stages.stop()


def resolve_in_a_process(name: str, weights: bool = True) -> str:
    """resolve_model(name) in a fresh process (huggingface_hub reads HF_HOME / HF_HUB_OFFLINE when
    it is imported): the folder, or the ConfigError's message."""
    code = ("import sys\nfrom voxpipe.errors import ConfigError\n"
            "from voxpipe.services.runtime.checkpoint import resolve_model\n"
            "try:\n    print(resolve_model(sys.argv[1], weights=sys.argv[2] == '1'))\n"
            "except ConfigError as e:\n    print('ConfigError:', e)\n")
    proc = subprocess.run([sys.executable, "-c", code, name, "1" if weights else "0"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1]


def test_a_repo_id_resolves_to_its_snapshot_and_an_uncached_one_says_how_to_get_it(offline_hub):
    snapshot = offline_hub / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / REVISION
    assert resolve_in_a_process(REPO) == str(snapshot)
    assert resolve_in_a_process(f"{REPO}@{REVISION}", weights=False) == str(snapshot)
    assert re.fullmatch(r"ConfigError: --model Qwen/Not-Cached: not in the Hugging Face cache \(.*\) and HF_HUB_OFFLINE "
                        r"is set: download it first \(hf download Qwen/Not-Cached\) or unset HF_HUB_OFFLINE",
                        resolve_in_a_process("Qwen/Not-Cached"))
    with pytest.raises(ConfigError, match="no such folder, and not a Hugging Face repo id"):
        resolve_model("./no/such/folder")


# ----------------------------------------------------------------------------- a folder that is not a checkpoint

def _copy(src: Path, dst: Path, drop: tuple[str, ...] = ()) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in drop:
            shutil.copyfile(f, dst / f.name)
    return dst


def _sharded(tiny: Path, dst: Path) -> Path:
    """The tiny checkpoint with an index naming two shards, the second absent."""
    folder = _copy(tiny, dst, drop=("model.safetensors",))
    shutil.copyfile(tiny / "model.safetensors", folder / "model-00001-of-00002.safetensors")
    weight_map = {"thinker.a": "model-00001-of-00002.safetensors", "talker.b": "model-00002-of-00002.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


BAD_FOLDERS = {
    "empty": (lambda tiny, d: (d.mkdir(), d)[1], "is not a checkpoint folder: config.json is missing"),
    "other model": (lambda tiny, d: (_copy(tiny, d), (d / "config.json").write_text('{"model_type": "llama"}'), d)[2],
                    "is not a Qwen3-Omni checkpoint: config.json's model_type is 'llama'"),
    "no tokenizer": (lambda tiny, d: _copy(tiny, d, drop=("tokenizer.json",)),
                     "missing the tokenizer (tokenizer.json, or vocab.json and merges.txt)"),
    "no weights": (lambda tiny, d: _copy(tiny, d, drop=("model.safetensors",)), "missing the weights (*.safetensors)"),
    "a shard missing": (_sharded, "missing 1 of the 2 weight shards the index lists (model-00002-of-00002.safetensors)"),
}


@pytest.mark.parametrize("case", list(BAD_FOLDERS))
def test_a_folder_that_is_not_a_checkpoint_is_one_line_saying_what_is_missing(case, tiny_model_dir, tmp_path):
    make, message = BAD_FOLDERS[case]
    folder = make(Path(tiny_model_dir), tmp_path / "m")
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_model(str(folder))


def test_a_stage_given_a_bad_folder_stops_with_one_line(tiny_model_dir, tmp_path):
    folder = _copy(Path(tiny_model_dir), tmp_path / "m", drop=("model.safetensors",))
    line = one_error_line(cli("talker", "--model", str(folder), "--port", "0", "--device", "cpu"))
    assert line.endswith(f"voxpipe talker: error: --model {folder} is not a complete Qwen3-Omni checkpoint: "
                         "missing the weights (*.safetensors)"), line
    # the gateway reads no weights: only the config and the tokenizer matter to it
    assert resolve_model(str(folder), weights=False) == folder


# ----------------------------------------------------------------------------- devices and flags

def test_a_device_this_torch_does_not_have_is_one_line(tiny_model_dir):
    import torch

    device = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    line = one_error_line(cli("thinker", "--model", str(tiny_model_dir), "--port", "0", "--device", device))
    assert f"voxpipe thinker: error: --device {device}: " in line
    assert ("CPU-only build" in line) if torch.version.cuda is None else ("CUDA device" in line), line
    line = one_error_line(cli("code2wav", "--model", str(tiny_model_dir), "--port", "0", "--device", "gpu0"))
    assert line.endswith("--device gpu0: not a device (cpu, cuda or cuda:N)"), line


def test_debug_logging_shows_the_traceback_of_a_configuration_error(tiny_model_dir):
    proc = cli("--log-level", "debug", "thinker", "--model", str(tiny_model_dir), "--port", "0", "--device", "cpu",
               "--prefill-chunk", "0")
    assert proc.returncode == 2 and "Traceback" in proc.stderr and "ConfigError" in proc.stderr, proc.stderr[-2000:]
    assert "--prefill-chunk must be at least 1, got 0" in proc.stderr


# ----------------------------------------------------------------------------- --help and --version

HEAVY = ("torch", "grpc", "transformers", "fastapi", "numpy")


@pytest.mark.parametrize("command", ["", "thinker", "talker", "code2wav", "gateway", "up", "say", "health",
                                     "make-tiny", "bench"])
def test_help_imports_nothing_heavy_and_shows_defaults(command):
    code = ("import sys\nfrom voxpipe.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            f"print('HEAVY', sorted(m for m in {HEAVY!r} if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code, *([command] if command else []), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("HEAVY []"), proc.stdout[-500:]
    if command in ("thinker", "gateway"):
        assert "(default: 16)" in proc.stdout if command == "thinker" else "(default 0: none" in proc.stdout


def test_version():
    proc = cli("--version", timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == f"voxpipe {version()}" and version() != "unknown"
