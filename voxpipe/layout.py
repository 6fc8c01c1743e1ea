"""Where the stage processes of a local stack run: how many replicas of each stage, each on which
device. One spec serves `voxpipe up` and `voxpipe bench` (--devices):

    thinker=cuda:0,talker=cuda:1+cuda:2,code2wav=cuda:1+cuda:2    2 talkers, 2 code2wavs on GPUs 1 and 2
    thinker=cuda:0,talker=cuda:1,code2wav=cuda:1                  the two-GPU layout
    talker=cuda:0*2                                               two talkers sharing GPU 0

`DEV*N` is N replicas on DEV; `+` lists one device per replica. Stages not named run one replica
on the default device. Each stage's callers (the thinker for the talkers, the talkers for the
code2wavs, the gateway for thinkers and code2wavs) get every replica's address and balance over
them (services.runtime.balancer)."""

from __future__ import annotations

import re
from dataclasses import dataclass

STAGES = ("thinker", "talker", "code2wav")
MAX_REPLICAS = 16
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


class LayoutError(ValueError):
    pass


@dataclass(frozen=True)
class Layout:
    devices: dict[str, tuple[str, ...]]     # stage -> one device per replica (every stage present)

    @classmethod
    def parse(cls, spec: str, default: str) -> "Layout":
        """A `--devices` spec (see the module docstring); raises LayoutError naming the bad part."""
        out: dict[str, tuple[str, ...]] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            stage, sep, value = part.partition("=")
            if stage not in STAGES or not sep or not value:
                raise LayoutError(f"--devices: expected STAGE=DEVICE with STAGE in {', '.join(STAGES)}, got {part!r}")
            if stage in out:
                raise LayoutError(f"--devices: {stage} named twice")
            replicas: list[str] = []
            for item in value.split("+"):
                device, star, count = item.partition("*")
                if not _DEVICE.match(device):
                    raise LayoutError(f"--devices: {stage}: {device!r} is not a device (auto, cpu, cuda or cuda:N)")
                if star and not (count.isdigit() and int(count) >= 1):
                    raise LayoutError(f"--devices: {stage}: {item!r}: the replica count after * must be a positive integer")
                replicas += [device] * (int(count) if star else 1)
            if len(replicas) > MAX_REPLICAS:
                raise LayoutError(f"--devices: {stage}: {len(replicas)} replicas (at most {MAX_REPLICAS})")
            out[stage] = tuple(replicas)
        if not _DEVICE.match(default):
            raise LayoutError(f"--device: {default!r} is not a device (auto, cpu, cuda or cuda:N)")
        return cls({s: out.get(s, (default,)) for s in STAGES})

    def replicas(self, stage: str) -> int:
        return len(self.devices[stage])

    def with_replicas(self, stage: str, n: int) -> "Layout":
        """`n` replicas of `stage` on its devices, cycled: (cuda:0,) with 2 -> cuda:0 twice;
        (cuda:0, cuda:1) with 1 -> cuda:0. Raises LayoutError for a count out of range."""
        if not 1 <= n <= MAX_REPLICAS:
            raise LayoutError(f"{stage}: {n} replicas (from 1 to {MAX_REPLICAS})")
        ds = self.devices[stage]
        return Layout({**self.devices, stage: tuple(ds[i % len(ds)] for i in range(n))})

    def names(self, stage: str) -> list[str]:
        """The process names of a stage's replicas: the stage's own name for one, stage0, stage1, ... for more."""
        n = self.replicas(stage)
        return [stage] if n == 1 else [f"{stage}{i}" for i in range(n)]

    def processes(self) -> list[tuple[str, str, str]]:
        """(name, stage, device) of every stage process, stage by stage (a stage dials the next one
        lazily, at its first request, so they may start in any order)."""
        return [(name, stage, device) for stage in STAGES
                for name, device in zip(self.names(stage), self.devices[stage])]

    @property
    def gpus(self) -> list[str]:
        """The distinct CUDA devices used (a bare `cuda` counts as cuda:0)."""
        seen = {d if ":" in d else "cuda:0" for ds in self.devices.values() for d in ds if d.startswith("cuda")}
        return sorted(seen, key=lambda d: int(d.split(":")[1]))

    @property
    def single(self) -> bool:
        """One replica per stage."""
        return all(len(ds) == 1 for ds in self.devices.values())

    def describe(self) -> str:
        """'thinker cuda:0; talker 2x (cuda:1, cuda:2); code2wav 2x (cuda:1, cuda:2)'."""
        parts = []
        for stage in STAGES:
            ds = self.devices[stage]
            parts.append(f"{stage} {ds[0]}" if len(ds) == 1 else f"{stage} {len(ds)}x ({', '.join(ds)})")
        return "; ".join(parts)


# A GPU shared by several stage processes: each one's --gpu-memory-fraction is its stage's weight
# over the weights of all processes on that GPU, times SHARED_GPU_MEMORY. One of each stage on an
# H200 (139.8 GiB): thinker 0.68 = 95.1 GiB (59.1 GiB in use after its weights were loaded, 6 GiB for
# activations, a KV pool of ~30 GiB = ~327k tokens; at 0.66 it was 296k, bench/RESULTS.md 2026-12-03),
# talker 0.14 = 19.6 GiB (5.6 GiB of weights, 0.6 GiB of the thinker's embedding table, its graphs and
# activations, the rest its KV pool at 20 KiB a position), code2wav 0.08.
MEMORY_WEIGHTS = {"thinker": 0.68, "talker": 0.14, "code2wav": 0.08}
SHARED_GPU_MEMORY = 0.9


def memory_shares(layout: "Layout") -> dict[str, float]:
    """By process name, the --gpu-memory-fraction of each process that shares a GPU with others
    (`cuda`, `cuda:0` and `auto` count as one device; a CPU process has none)."""
    def gpu(device: str) -> str | None:
        if device == "cpu":
            return None
        return device if ":" in device else "cuda:0"

    by_gpu: dict[str, list[tuple[str, str]]] = {}
    for name, stage, device in layout.processes():
        if gpu(device) is not None:
            by_gpu.setdefault(gpu(device), []).append((name, stage))
    shares = {}
    for procs in by_gpu.values():
        if len(procs) > 1:
            total = sum(MEMORY_WEIGHTS[stage] for _, stage in procs)
            shares.update({name: round(SHARED_GPU_MEMORY * MEMORY_WEIGHTS[stage] / total, 3) for name, stage in procs})
    return shares


MPS_SM_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
MPS_SM_HELP = ("experimental: under CUDA MPS, the share of the GPU's SMs each stage's processes may use, e.g. "
               "thinker=60, so that the thinker's large kernels leave SMs free for a talker step "
               "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE in their environment); stages not named use every SM. On one "
               "H200 it gave no throughput gain, and thinker=70,code2wav=50 failed requests with non-finite "
               "thinker logits, cause not found (bench/RESULTS.md, 2026-12-01 20:01)")


def parse_sm_shares(spec: str) -> dict[str, int]:
    """A `--mps-sm-percent` spec, e.g. `thinker=60,code2wav=40`: per stage, the percentage of the
    GPU's SMs (1-100) its processes may use under CUDA MPS (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE in
    their environment); stages not named use every SM. Raises LayoutError naming the bad part."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        stage, sep, value = part.partition("=")
        if stage not in STAGES or not sep:
            raise LayoutError(f"--mps-sm-percent: expected STAGE=PERCENT with STAGE in {', '.join(STAGES)}, got {part!r}")
        if stage in out:
            raise LayoutError(f"--mps-sm-percent: {stage} named twice")
        if not (value.isdigit() and 1 <= int(value) <= 100):
            raise LayoutError(f"--mps-sm-percent: {stage}: {value!r} is not a whole percentage from 1 to 100")
        out[stage] = int(value)
    return out


def sm_share_env(shares: dict[str, int]) -> dict[str, dict[str, str]]:
    """Per stage, the environment that limits its processes to their share of the SMs."""
    return {stage: {MPS_SM_ENV: str(pct)} for stage, pct in shares.items()}


MPS_PRIORITY_ENV = "CUDA_MPS_CLIENT_PRIORITY"
MPS_PRIORITIES = {"normal": 0, "below_normal": 1}     # the driver's client priority levels under MPS
MPS_PRIORITY_HELP = ("experimental: under CUDA MPS, the scheduling priority of each stage's processes, e.g. "
                     "thinker=below_normal, so that the GPU runs a talker or code2wav step's kernels ahead of a "
                     "thinker prefill's (CUDA_MPS_CLIENT_PRIORITY in their environment: normal 0, below_normal 1; "
                     "ignored without MPS); stages not named are normal")


def parse_stage_values(spec: str, flag: str, values) -> dict[str, str]:
    """A `STAGE=VALUE,...` spec (--mps-priority, --colocate-priority): per stage named, its value (one
    of `values`). Raises LayoutError naming `flag` and the bad part."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        stage, sep, value = part.partition("=")
        if stage not in STAGES or not sep:
            raise LayoutError(f"{flag}: expected STAGE=PRIORITY with STAGE in {', '.join(STAGES)}, got {part[:40]!r}")
        if stage in out:
            raise LayoutError(f"{flag}: {stage} named twice")
        if value not in values:
            raise LayoutError(f"{flag}: {stage}: {value[:40]!r} is not one of {', '.join(values)}")
        out[stage] = value
    return out


def parse_mps_priorities(spec: str) -> dict[str, int]:
    """A `--mps-priority` spec, e.g. `thinker=below_normal`: per stage, its processes' client priority
    under CUDA MPS (MPS_PRIORITIES). Raises LayoutError naming the bad part."""
    return {stage: MPS_PRIORITIES[value]
            for stage, value in parse_stage_values(spec, "--mps-priority", MPS_PRIORITIES).items()}


def mps_env(shares: dict[str, int], priorities: dict[str, int]) -> dict[str, dict[str, str]]:
    """Per stage, the environment of its processes under MPS: its SM share and its client priority."""
    env = sm_share_env(shares)
    for stage, level in priorities.items():
        env[stage] = {**env.get(stage, {}), MPS_PRIORITY_ENV: str(level)}
    return env


# `--colocate`: the three stages in one process on one GPU, each stage's engine on a CUDA stream of
# its own priority (services/runtime/colocate.py): high = the greatest priority the GPU offers,
# low = the least (torch.cuda.Stream.priority_range()). A talker or code2wav step's kernels are then
# scheduled ahead of a thinker prefill's waiting ones.
COLOCATE_LEVELS = ("low", "high")
COLOCATE_DEFAULT = {"thinker": "low", "talker": "high", "code2wav": "high"}
COLOCATE_HELP = ("the three stages in one process (one CUDA context, no MPS), each still its own gRPC service on "
                 "its own port with its own health, metrics and flags; each stage's GPU work on a CUDA stream of "
                 "its --colocate-priority (on the CPU: three servers in one process, no priorities)")
COLOCATE_PRIORITY_HELP = ("with --colocate: the CUDA stream priority of each stage, low or high, e.g. "
                          "thinker=low,talker=high (stages not named: thinker low, talker high, code2wav high)")


def parse_colocate_priorities(spec: str) -> dict[str, str]:
    """A `--colocate-priority` spec, e.g. `thinker=low,talker=high`: every stage's stream priority
    level (COLOCATE_LEVELS), stages not named at COLOCATE_DEFAULT's. Raises LayoutError naming the bad part."""
    return {**COLOCATE_DEFAULT, **parse_stage_values(spec, "--colocate-priority", COLOCATE_LEVELS)}


def colocate_spec(priorities: dict[str, str]) -> str:
    """The `--colocate-priority` spec of `priorities` (every stage named)."""
    return ",".join(f"{stage}={priorities[stage]}" for stage in STAGES)


def check_colocatable(layout: Layout) -> str:
    """The one device of a layout whose stages can run in one process (one replica each, one device
    for all); LayoutError otherwise."""
    devices = {ds[0] for ds in layout.devices.values()}
    if not layout.single or len(devices) != 1:
        raise LayoutError(f"--colocate runs one replica of each stage, all on one device, in one process; "
                          f"--devices gives {layout.describe()}")
    return devices.pop()
