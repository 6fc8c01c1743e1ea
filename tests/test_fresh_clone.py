"""A newcomer's first command, as README.md's "Set up" section writes it, in a fresh clone and a fresh
virtualenv: the commands are read from the README (so the two cannot drift), the main one is run
as written (its installs in the background from the session's start, then its last step), and it must
leave a valid, non-empty wav."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import venv
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import BackgroundRun, background
from voxpipe.audio import read_wav

REPO = Path(__file__).resolve().parents[1]
DEFAULT_STAGE_PORTS = (50051, 50052, 50053)      # `voxpipe up`'s thinker, talker, code2wav


def setup_commands(readme: str) -> list[str]:
    """The indented command lines of the README's "## Set up" section, in order."""
    section = re.search(r"^## Set up\n(.*?)(?=^## )", readme, re.S | re.M)
    assert section, "README.md has no '## Set up' section"
    return [line[4:] for line in section.group(1).splitlines() if line.startswith("    ") and line.strip()]


def test_the_readme_names_two_set_up_commands():
    commands = setup_commands((REPO / "README.md").read_text())
    assert len(commands) == 2 and commands[1] == "bash .ci/run", commands
    steps = [s.strip() for s in commands[0].split("&&")]
    assert steps[-1].startswith("voxpipe up --say ") and any(s.startswith("pip install -e .") for s in steps)


def _taken(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _free_base_port() -> int:
    """A port p with p, p+1, p+2 free (a stack elsewhere on this machine holds the defaults)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p + 2 < 65536 and not any(_taken(p + i) for i in range(3)):
            return p
    raise RuntimeError("no three consecutive free ports")


@dataclass
class FreshClone:
    """A clone of this repository and a virtualenv, the README's set-up steps, and the run of all those
    before the last (the installs), in the background from the session's start."""
    clone: Path
    bin_dir: Path
    env: dict[str, str]
    steps: list[str]
    installs: BackgroundRun
    torch_pin: str | None


def _clone_and_install() -> FreshClone:
    main = setup_commands((REPO / "README.md").read_text())[0]
    tmp = Path(_TMP.name)
    clone, env_dir = tmp / "clone", tmp / "venv"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=60)
    # --system-site-packages: the venv sees this interpreter's torch (and the other dependencies
    # .ci/run installed), so `pip install torch==...` and the dependencies of `pip install -e .` are
    # already satisfied and nothing large is downloaded; the package itself is installed from the clone.
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    bin_dir = env_dir / "bin"
    # `pip` is the base interpreter's pip run by the venv's python (it installs into the venv): no
    # ensurepip, which would copy a pip into every venv this test makes
    (bin_dir / "pip").write_text(f"#!/bin/sh\nexec {bin_dir / 'python'} -m pip \"$@\"\n")
    (bin_dir / "pip").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(env_dir),
           "VOXPIPE_HOME": str(tmp / "home"), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    for name in ("PYTHONPATH", "PYTHONSAFEPATH"):    # a newcomer's shell has neither (conftest sets the second)
        env.pop(name, None)

    steps = [s.strip() for s in main.split("&&")]
    torch_pin = next((s for s in steps if s.startswith("pip install torch")), None)
    if torch_pin is not None and torch_pin.split("==")[-1] != importlib.metadata.version("torch").split("+")[0]:
        # another torch here (a CUDA wheel, say): this test does not download torch; the rest runs as written
        steps.remove(torch_pin)
        torch_pin = None
    installs = BackgroundRun(["bash", "-c", " && ".join(steps[:-1])], cwd=clone, env=env)
    return FreshClone(clone, bin_dir, env, steps, installs, torch_pin)


# the clone's folder, removed when this process exits
_TMP = tempfile.TemporaryDirectory(prefix="voxpipe-fresh-clone-")
BACKGROUND = {"fresh_clone": _clone_and_install}


@pytest.fixture(scope="module")
def fresh_clone() -> FreshClone:
    return background("fresh_clone", _clone_and_install)


def test_a_fresh_clone_follows_the_readme_to_a_wav(fresh_clone):
    """The README's command, its `&&` as written: the installs (in the background since the session
    started) must succeed, then its last step runs here."""
    fc = fresh_clone
    started = time.monotonic()
    installs = fc.installs.result(timeout=300)
    log = f"$ {' && '.join(fc.steps[:-1])}\n{installs.stdout[-4000:]}\n{installs.stderr[-4000:]}"
    assert installs.returncode == 0, log
    if fc.torch_pin is not None:
        assert "Requirement already satisfied: torch" in installs.stdout, log
    say = fc.steps[-1]
    if any(_taken(p) for p in DEFAULT_STAGE_PORTS):
        # another stack on this machine holds the default ports: the same command on ports of its own
        say += f" --base-port {_free_base_port()}"
    proc = subprocess.run(["bash", "-c", say], cwd=fc.clone, env=fc.env, capture_output=True, text=True, timeout=300)
    log = f"{log}\n$ {say}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, log
    installed = subprocess.run([str(fc.bin_dir / "python"), "-c", "import voxpipe.cli as m; print(m.__file__)"],
                               cwd=fc.clone.parent, env=fc.env, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(installed).is_relative_to(fc.clone), f"voxpipe imports from {installed}, not the clone"
    words = shlex.split(say)
    out = words[words.index("-o") + 1]
    samples, rate = read_wav((fc.clone / out).read_bytes())
    assert rate == 24000 and samples.ndim == 1 and samples.size > 0, (rate, samples.shape)
    print(f"fresh clone to {out}: {time.monotonic() - started:.1f} s in the test (the installs ran before)",
          file=sys.stderr)


def test_the_files_the_readme_cites_exist():
    """Every file path from the repository's root that the README names in backticks
    (`bench/BENCHMARK.md`, `tests/test_tls.py`, ...; the layout table's names relative to their folder
    are not checked)."""
    readme = (REPO / "README.md").read_text()
    cited = set(re.findall(r"`((?:[\w.-]+/)+[\w.-]+\.(?:md|py|proto|json|sh))`", readme))
    missing = sorted(c for c in cited if not (REPO / c).exists())
    assert "bench/BENCHMARK.md" in cited and not missing, missing


def test_the_repo_roots_kernels_folder_shadows_nothing():
    """The repo root's kernels/ (installed as voxpipe.kernels) is not the top-level `kernels` module, which
    is Hugging Face's package (transformers imports it): not in this process (conftest takes the root off
    sys.path) and not in a `python -m` child started in the root."""
    import importlib.util

    ours = REPO / "kernels"        # (a virtualenv inside the checkout may hold the real package: that is fine)
    spec = importlib.util.find_spec("kernels")
    assert spec is None or not Path(spec.origin).is_relative_to(ours), spec.origin
    code = "import importlib.util as u; s = u.find_spec('kernels'); print(s.origin if s else '')"
    origin = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                            timeout=60).stdout.strip()
    assert not origin or not Path(origin).is_relative_to(ours), origin
