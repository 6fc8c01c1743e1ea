"""Weight loading: Hugging Face safetensors checkpoints (one file or many shards, released
per-expert tensor names) or full-size dummy weights built directly on the target device.

Our modules use the checkpoint's own names below each stage prefix (`thinker.`, `talker.`,
`code2wav.`), except that per-expert tensors `...mlp.experts.{e}.{gate,up,down}_proj.weight`
are fused into `...mlp.experts.gate_up` [E, 2I, H] and `...mlp.experts.down` [E, H, I].
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from voxpipe.errors import ConfigError

log = logging.getLogger(__name__)

_EXPERT = re.compile(r"^(?P<base>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(?P<base>.*\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
_OURS_FUSED = re.compile(r"^(?P<base>.*\.mlp\.experts)\.(?P<proj>gate_up|down)$")


class WeightError(ValueError):
    pass


@contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


# torch.nn.init's in-place initialisers: on the meta device they write nothing, but each one goes
# through torch._refs, whose first call imports torch._dynamo (~2 s of CPU in every stage process)
_INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                 "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                 "sparse_")


def _skipping_meta(fn: Callable) -> Callable:
    def init(tensor, *args, **kwargs):
        return tensor if isinstance(tensor, torch.Tensor) and tensor.is_meta else fn(tensor, *args, **kwargs)
    return init


@contextmanager
def no_init():
    """torch.nn.init's initialisers skip meta tensors (they have no values to set; any other tensor --
    another thread's module meanwhile -- is initialised as always)."""
    saved = {name: getattr(nn.init, name) for name in _INITIALISERS if hasattr(nn.init, name)}
    for name, fn in saved.items():
        setattr(nn.init, name, _skipping_meta(fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def build_empty(factory: Callable[[], nn.Module], device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """Construct on the meta device (no memory, no init), then allocate uninitialised storage."""
    with default_dtype(dtype), torch.device("meta"), no_init():
        module = factory()
    return module.to_empty(device=device).eval().requires_grad_(False)


def checkpoint_files(model_dir: Path, prefix: str) -> list[Path]:
    """The safetensors files holding tensors under `prefix` (reads the shard index when present)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted({f for name, f in weight_map.items() if name.startswith(prefix)})
        return [model_dir / f for f in files]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightError(f"no *.safetensors files in {model_dir}")
    return files


def load_stage(module: nn.Module, model_dir: str | Path, prefix: str, *, ignore: tuple[str, ...] = ()) -> float:
    """Copy every `prefix*` tensor of the checkpoint into `module` (which must already live on its
    device in its dtype). Missing, unexpected or wrongly shaped tensors raise WeightError. Returns
    seconds taken."""
    t0 = time.perf_counter()
    model_dir = Path(model_dir)
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    slices: dict[str, set[tuple[int, str]]] = {}   # fused expert parameter -> (expert, proj) slices copied
    unexpected: list[str] = []
    files = checkpoint_files(model_dir, prefix)
    for number, path in enumerate(files, 1):
        if not path.is_file():
            raise WeightError(f"{path.name} (listed in the shard index) is missing from {model_dir}")
        t_shard, nbytes = time.perf_counter(), 0
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if not key.startswith(prefix):
                    continue
                name = key[len(prefix):]
                if any(name.startswith(i) for i in ignore):
                    continue
                target = _copy_tensor(params, name, key, f, slices)
                if target is None:
                    unexpected.append(key)
                else:
                    loaded.add(target)
                    nbytes += params[target.partition("#")[0]].element_size() * _numel(f, key)
        log.info("%s weights: shard %d/%d %s, %.2f GB in %.1f s", prefix.rstrip("."), number, len(files), path.name,
                 nbytes / 1e9, time.perf_counter() - t_shard)
    if unexpected:
        raise WeightError(f"{len(unexpected)} unexpected tensors under {prefix!r}, e.g. {unexpected[:3]}")
    missing: list[str] = []
    for n, p in params.items():
        if n in loaded:
            continue
        if (m := _OURS_FUSED.match(n)) is not None:  # name the absent per-expert tensors
            projs = ("down_proj",) if m["proj"] == "down" else ("gate_proj", "up_proj")
            got = slices.get(n, set())
            missing += [f"{prefix}{m['base']}.{e}.{proj}.weight" for e in range(p.shape[0]) for proj in projs
                        if (e, proj) not in got]
        else:
            missing.append(prefix + n)
    if missing:
        raise WeightError(f"{len(missing)} tensors missing under {prefix!r}, e.g. {missing[:3]}")
    return time.perf_counter() - t0


def _copy_tensor(params: dict[str, nn.Parameter], name: str, key: str, f,
                 slices: dict[str, set[tuple[int, str]]]) -> str | None:
    """Copy checkpoint tensor `key` (`name` below the stage prefix) of the open file `f` into its
    parameter; returns the parameter name it completes (per-expert tensors complete their fused
    parameter only when all slices arrived), None when the model has no such tensor."""
    shape = tuple(f.get_slice(key).get_shape())
    if (m := _EXPERT.match(name)) is not None:
        base, e, proj = m["base"], int(m["e"]), m["proj"]
        pname = base + (".down" if proj == "down_proj" else ".gate_up")
        target = params.get(pname)
        if target is None or e >= target.shape[0]:
            return None
        if proj == "down_proj":
            dest = target.data[e]
        else:
            half = target.shape[1] // 2
            dest = target.data[e, :half] if proj == "gate_proj" else target.data[e, half:]
        _check_shape(key, shape, tuple(dest.shape))
        dest.copy_(f.get_tensor(key))
        got = slices.setdefault(pname, set())
        got.add((e, proj))
        return pname if len(got) == target.shape[0] * (1 if proj == "down_proj" else 2) else f"{pname}#partial"
    if (m := _FUSED.match(name)) is not None:
        pname = m["base"] + (".gate_up" if m["proj"] == "gate_up_proj" else ".down")
    else:
        pname = name
    target = params.get(pname)
    if target is None:
        return None
    _check_shape(key, shape, tuple(target.shape))
    target.data.copy_(f.get_tensor(key))
    return pname


def _numel(f, key: str) -> int:
    n = 1
    for d in f.get_slice(key).get_shape():
        n *= d
    return n


def _check_shape(key: str, checkpoint: tuple[int, ...], model: tuple[int, ...]) -> None:
    if checkpoint != model:
        raise WeightError(f"{key}: checkpoint shape {list(checkpoint)} != model shape {list(model)}")


def init_dummy(module: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights in place, on the module's device: norms and scales 1 (layer scales
    keep their config value), biases 0, everything else N(0, std)."""
    device = next(module.parameters()).device
    if device.type == "meta":  # shapes only: nothing to fill
        return
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in module.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("bias",) or name.endswith((".alpha", ".beta")):
            p.data.zero_()
        elif "norm" in name or leaf in ("scale", "gamma"):
            p.data.fill_(1.0 if leaf != "scale" else 0.01)
        else:
            p.data.normal_(0.0, std, generator=gen)


def parameter_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def resolve_device(name: str | None) -> torch.device:
    """--device as a torch device (auto: cuda if available); ConfigError for one this torch or this
    machine does not have."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name}: not a device (cpu, cuda or cuda:N)") from None
    if device.type == "cuda":
        if torch.version.cuda is None:
            raise ConfigError(f"--device {name}: this torch ({torch.__version__}) is a CPU-only build; install a "
                              "CUDA build of torch, or use --device cpu")
        count = torch.cuda.device_count()
        if count == 0:
            raise ConfigError(f"--device {name}: no CUDA device is visible (check the driver and "
                              "CUDA_VISIBLE_DEVICES), or use --device cpu")
        if device.index is not None and device.index >= count:
            raise ConfigError(f"--device {name}: this machine has {count} CUDA device(s): cuda:0..cuda:{count - 1}")
    elif device.type not in ("cpu", "mps", "xpu"):
        raise ConfigError(f"--device {name}: not supported (cpu, cuda or cuda:N)")
    return device


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_module(factory: Callable[[], nn.Module], model_dir: str | Path, prefix: str, *, device: torch.device,
                dtype: torch.dtype, load_format: str = "auto", ignore: tuple[str, ...] = (), seed: int = 0) -> nn.Module:
    """Build a stage module on `device` in `dtype` and fill it from the checkpoint (`auto`) or
    with random values (`dummy`, full size, no files read but config.json)."""
    t0 = time.perf_counter()
    module = build_empty(factory, device, dtype)
    if load_format == "dummy":
        init_dummy(module, seed=seed)
    elif load_format == "auto":
        load_stage(module, model_dir, prefix, ignore=ignore)
    else:
        raise ValueError(f"unknown load format {load_format!r} (auto or dummy)")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    log.info("%s weights (%s): %.2f GB in %.1f s; %s", prefix.rstrip("."), load_format,
             parameter_bytes(module) / 1e9, time.perf_counter() - t0, memory_in_use(device))
    return module


def memory_in_use(device: torch.device) -> str:
    """What the process holds now: the CUDA caching allocator's memory on a GPU, the peak resident
    set on the CPU."""
    if device.type == "cuda":
        return (f"{device}: {torch.cuda.memory_allocated(device) / 1e9:.2f} GB allocated, "
                f"{torch.cuda.memory_reserved(device) / 1e9:.2f} GB reserved")
    import resource

    return f"process peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB"   # KiB on Linux
