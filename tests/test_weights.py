"""The weight loader against the released checkpoint's tensor names and shapes, sharded checkpoints,
bad checkpoints and dummy weights.

The released manifest below is written from the published table of the Qwen3-Omni-30B-A3B-Instruct
checkpoint (15 shards, 28,010 bfloat16 tensors, 35,259,818,545 parameters; experts stored one tensor
per expert); our modules are built from the released config on the meta device (no memory)."""

from __future__ import annotations

import itertools
import json
import logging
import re
import shutil
from importlib import resources
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from voxpipe.services.code2wav.model import Code2WavModel
from voxpipe.services.runtime.config import OmniConfig
from voxpipe.services.runtime.weights import WeightError, build_empty, load_module, load_stage
from voxpipe.services.talker.model import TalkerModel
from voxpipe.services.thinker.model import ThinkerModel

RELEASED_TENSORS = 28_010
RELEASED_PARAMETERS = 35_259_818_545
CPU = torch.device("cpu")
META = torch.device("meta")

# ---------------------------------------------------------------------------------------------- manifest
# (pattern, shape, ranges): every {X} in a pattern runs over range(ranges[X]).

THINKER_TEXT = [
    ("model.embed_tokens.weight", [152064, 2048]),
    ("lm_head.weight", [152064, 2048]),
    ("model.norm.weight", [2048]),
    ("model.layers.{L}.input_layernorm.weight", [2048]),
    ("model.layers.{L}.post_attention_layernorm.weight", [2048]),
    ("model.layers.{L}.self_attn.q_proj.weight", [4096, 2048]),
    ("model.layers.{L}.self_attn.k_proj.weight", [512, 2048]),
    ("model.layers.{L}.self_attn.v_proj.weight", [512, 2048]),
    ("model.layers.{L}.self_attn.o_proj.weight", [2048, 4096]),
    ("model.layers.{L}.self_attn.q_norm.weight", [128]),
    ("model.layers.{L}.self_attn.k_norm.weight", [128]),
    ("model.layers.{L}.mlp.gate.weight", [128, 2048]),
    ("model.layers.{L}.mlp.experts.{E}.gate_proj.weight", [768, 2048]),
    ("model.layers.{L}.mlp.experts.{E}.up_proj.weight", [768, 2048]),
    ("model.layers.{L}.mlp.experts.{E}.down_proj.weight", [2048, 768]),
]
AUDIO_TOWER = [
    ("audio_tower.conv2d1.weight", [480, 1, 3, 3]), ("audio_tower.conv2d1.bias", [480]),
    ("audio_tower.conv2d2.weight", [480, 480, 3, 3]), ("audio_tower.conv2d2.bias", [480]),
    ("audio_tower.conv2d3.weight", [480, 480, 3, 3]), ("audio_tower.conv2d3.bias", [480]),
    ("audio_tower.conv_out.weight", [1280, 7680]),
    ("audio_tower.layers.{A}.self_attn.{qkvo}.weight", [1280, 1280]),
    ("audio_tower.layers.{A}.self_attn.{qkvo}.bias", [1280]),
    ("audio_tower.layers.{A}.fc1.weight", [5120, 1280]), ("audio_tower.layers.{A}.fc1.bias", [5120]),
    ("audio_tower.layers.{A}.fc2.weight", [1280, 5120]), ("audio_tower.layers.{A}.fc2.bias", [1280]),
    ("audio_tower.layers.{A}.{ln}.weight", [1280]), ("audio_tower.layers.{A}.{ln}.bias", [1280]),
    ("audio_tower.ln_post.weight", [1280]), ("audio_tower.ln_post.bias", [1280]),
    ("audio_tower.proj1.weight", [1280, 1280]), ("audio_tower.proj1.bias", [1280]),
    ("audio_tower.proj2.weight", [2048, 1280]), ("audio_tower.proj2.bias", [2048]),
]
THINKER_RANGES = {"L": 48, "E": 128, "A": 32, "qkvo": ["q_proj", "k_proj", "v_proj", "out_proj"],
                  "ln": ["self_attn_layer_norm", "final_layer_norm"]}

TALKER = [
    ("model.codec_embedding.weight", [3072, 1024]),
    ("codec_head.weight", [3072, 1024]),
    ("model.norm.weight", [1024]),
    ("model.layers.{L}.input_layernorm.weight", [1024]),
    ("model.layers.{L}.post_attention_layernorm.weight", [1024]),
    ("model.layers.{L}.self_attn.q_proj.weight", [2048, 1024]),
    ("model.layers.{L}.self_attn.k_proj.weight", [256, 1024]),
    ("model.layers.{L}.self_attn.v_proj.weight", [256, 1024]),
    ("model.layers.{L}.self_attn.o_proj.weight", [1024, 2048]),
    ("model.layers.{L}.self_attn.q_norm.weight", [128]),
    ("model.layers.{L}.self_attn.k_norm.weight", [128]),
    ("model.layers.{L}.mlp.gate.weight", [128, 1024]),
    ("model.layers.{L}.mlp.experts.{E}.gate_proj.weight", [384, 1024]),
    ("model.layers.{L}.mlp.experts.{E}.up_proj.weight", [384, 1024]),
    ("model.layers.{L}.mlp.experts.{E}.down_proj.weight", [1024, 384]),
    ("model.layers.{L}.mlp.shared_expert.gate_proj.weight", [768, 1024]),
    ("model.layers.{L}.mlp.shared_expert.up_proj.weight", [768, 1024]),
    ("model.layers.{L}.mlp.shared_expert.down_proj.weight", [1024, 768]),
    ("model.layers.{L}.mlp.shared_expert_gate.weight", [1, 1024]),
    ("{proj}.linear_fc1.weight", [2048, 2048]), ("{proj}.linear_fc1.bias", [2048]),
    ("{proj}.linear_fc2.weight", [1024, 2048]), ("{proj}.linear_fc2.bias", [1024]),
    ("code_predictor.model.codec_embedding.{G}.weight", [2048, 1024]),
    ("code_predictor.lm_head.{G}.weight", [2048, 1024]),
    ("code_predictor.model.layers.{P}.self_attn.q_proj.weight", [2048, 1024]),
    ("code_predictor.model.layers.{P}.self_attn.k_proj.weight", [1024, 1024]),
    ("code_predictor.model.layers.{P}.self_attn.v_proj.weight", [1024, 1024]),
    ("code_predictor.model.layers.{P}.self_attn.o_proj.weight", [1024, 2048]),
    ("code_predictor.model.layers.{P}.self_attn.q_norm.weight", [128]),
    ("code_predictor.model.layers.{P}.self_attn.k_norm.weight", [128]),
    ("code_predictor.model.layers.{P}.mlp.gate_proj.weight", [3072, 1024]),
    ("code_predictor.model.layers.{P}.mlp.up_proj.weight", [3072, 1024]),
    ("code_predictor.model.layers.{P}.mlp.down_proj.weight", [1024, 3072]),
    ("code_predictor.model.layers.{P}.input_layernorm.weight", [1024]),
    ("code_predictor.model.layers.{P}.post_attention_layernorm.weight", [1024]),
    ("code_predictor.model.norm.weight", [1024]),
]
TALKER_RANGES = {"L": 20, "E": 128, "G": 15, "P": 5, "proj": ["text_projection", "hidden_projection"]}

CODE2WAV = [
    ("code_embedding.weight", [32768, 1024]),
    ("pre_transformer.layers.{L}.self_attn.{qkvo}.weight", [1024, 1024]),
    ("pre_transformer.layers.{L}.mlp.gate_proj.weight", [3072, 1024]),
    ("pre_transformer.layers.{L}.mlp.up_proj.weight", [3072, 1024]),
    ("pre_transformer.layers.{L}.mlp.down_proj.weight", [1024, 3072]),
    ("pre_transformer.layers.{L}.{norm}.weight", [1024]),
    ("pre_transformer.layers.{L}.{scale}.scale", [1024]),
    ("pre_transformer.norm.weight", [1024]),
    ("upsample.{U}.0.conv.weight", [1024, 1024, 2]), ("upsample.{U}.0.conv.bias", [1024]),
    ("upsample.{U}.1.dwconv.conv.weight", [1024, 1, 7]), ("upsample.{U}.1.dwconv.conv.bias", [1024]),
    ("upsample.{U}.1.norm.weight", [1024]), ("upsample.{U}.1.norm.bias", [1024]),
    ("upsample.{U}.1.pwconv1.weight", [4096, 1024]), ("upsample.{U}.1.pwconv1.bias", [4096]),
    ("upsample.{U}.1.pwconv2.weight", [1024, 4096]), ("upsample.{U}.1.pwconv2.bias", [1024]),
    ("upsample.{U}.1.gamma", [1024]),
    ("decoder.0.conv.weight", [1536, 1024, 7]), ("decoder.0.conv.bias", [1536]),
    ("decoder.5.alpha", [96]), ("decoder.5.beta", [96]),
    ("decoder.6.conv.weight", [1, 96, 7]), ("decoder.6.conv.bias", [1]),
]
CODE2WAV_RANGES = {"L": 8, "U": 2, "qkvo": ["q_proj", "k_proj", "v_proj", "o_proj"],
                   "norm": ["input_layernorm", "post_attention_layernorm"],
                   "scale": ["self_attn_layer_scale", "mlp_layer_scale"]}
# decoder blocks 1-4: SnakeBeta(cin), ConvTranspose1d(cin -> cout, kernel 2r, stride r), 3 residual units (cout)
for _i, (_cin, _cout, _rate) in enumerate([(1536, 768, 8), (768, 384, 5), (384, 192, 4), (192, 96, 3)], start=1):
    CODE2WAV += [
        (f"decoder.{_i}.block.0.alpha", [_cin]), (f"decoder.{_i}.block.0.beta", [_cin]),
        (f"decoder.{_i}.block.1.conv.weight", [_cin, _cout, 2 * _rate]), (f"decoder.{_i}.block.1.conv.bias", [_cout]),
    ]
    for _u in (2, 3, 4):
        CODE2WAV += [
            (f"decoder.{_i}.block.{_u}.act1.alpha", [_cout]), (f"decoder.{_i}.block.{_u}.act1.beta", [_cout]),
            (f"decoder.{_i}.block.{_u}.conv1.conv.weight", [_cout, _cout, 7]),
            (f"decoder.{_i}.block.{_u}.conv1.conv.bias", [_cout]),
            (f"decoder.{_i}.block.{_u}.act2.alpha", [_cout]), (f"decoder.{_i}.block.{_u}.act2.beta", [_cout]),
            (f"decoder.{_i}.block.{_u}.conv2.conv.weight", [_cout, _cout, 1]),
            (f"decoder.{_i}.block.{_u}.conv2.conv.bias", [_cout]),
        ]


def expand(table, ranges: dict) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for pattern, shape in table:
        keys = re.findall(r"\{(\w+)\}", pattern)
        values = [ranges[k] if isinstance(ranges[k], list) else range(ranges[k]) for k in keys]
        for combo in itertools.product(*values):
            name = pattern
            for k, v in zip(keys, combo):
                name = name.replace("{" + k + "}", str(v))
            assert name not in out, name
            out[name] = tuple(shape)
    return out


def released_manifest(stage: str) -> dict[str, tuple[int, ...]]:
    if stage == "thinker":
        return expand(THINKER_TEXT + AUDIO_TOWER, THINKER_RANGES)
    if stage == "talker":
        return expand(TALKER, TALKER_RANGES)
    return expand(CODE2WAV, CODE2WAV_RANGES)


# ---------------------------------------------------------------------------------------------- our names

_FUSED = re.compile(r"^(?P<base>.*\.mlp\.experts)\.(?P<proj>gate_up|down)$")


def checkpoint_names(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Our parameters under the names and shapes they load from: fused experts gate_up [E, 2I, H] and
    down [E, H, I] come from per-expert gate_proj / up_proj [I, H] and down_proj [H, I]."""
    out: dict[str, tuple[int, ...]] = {}
    for name, p in module.named_parameters():
        m = _FUSED.match(name)
        if m is None:
            out[name] = tuple(p.shape)
            continue
        e = p.shape[0]
        if m["proj"] == "gate_up":
            inter, hidden = p.shape[1] // 2, p.shape[2]
            for i in range(e):
                out[f"{m['base']}.{i}.gate_proj.weight"] = (inter, hidden)
                out[f"{m['base']}.{i}.up_proj.weight"] = (inter, hidden)
        else:
            for i in range(e):
                out[f"{m['base']}.{i}.down_proj.weight"] = tuple(p.shape[1:])
    return out


FACTORIES = {
    "thinker": lambda cfg: ThinkerModel(cfg.thinker),
    "talker": lambda cfg: TalkerModel(cfg.talker),
    "code2wav": lambda cfg: Code2WavModel(cfg.code2wav),
}
STAGES = tuple(FACTORIES)
IGNORE = {"thinker": ("visual.",), "talker": (), "code2wav": ()}


@pytest.fixture(scope="module")
def released_config() -> OmniConfig:
    path = resources.files("voxpipe.configs") / "qwen3-omni-30b-a3b-instruct.json"
    return OmniConfig.from_dict(json.loads(path.read_text()))


@pytest.fixture(scope="module")
def released_meta(released_config) -> dict[str, nn.Module]:
    """Our three stage modules at full size, on the meta device, exactly as `--load-format dummy` builds them."""
    return {s: load_module(lambda: FACTORIES[s](released_config), "/nonexistent", f"{s}.", device=META,
                           dtype=torch.bfloat16, load_format="dummy") for s in STAGES}


@pytest.mark.parametrize("stage", STAGES)
def test_names_and_shapes_equal_the_released_manifest(released_meta, stage):
    module = released_meta[stage]
    assert all(p.device.type == "meta" for p in module.parameters())
    ours = checkpoint_names(module)
    want = released_manifest(stage)
    assert sorted(set(want) - set(ours))[:5] == [], "released tensors our module does not load"
    assert sorted(set(ours) - set(want))[:5] == [], "tensors our module expects that the release lacks"
    wrong = {n: (ours[n], want[n]) for n in want if ours[n] != want[n]}
    assert wrong == {}
    assert not any(n.startswith("visual.") for n in ours)


def test_manifest_totals_equal_the_release(released_meta, released_config):
    """Ours (thinker without the vision tower, talker, code2wav) + transformers' vision tower =
    the released 28,010 tensors and 35,259,818,545 parameters."""
    from transformers import Qwen3OmniMoeConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeVisionEncoder

    hf = Qwen3OmniMoeConfig.from_dict(released_config.raw)
    with torch.device("meta"):
        visual = Qwen3OmniMoeVisionEncoder._from_config(hf.thinker_config.vision_config).state_dict()
    names = sum(len(checkpoint_names(m)) for m in released_meta.values()) + len(visual)
    params = sum(p.numel() for m in released_meta.values() for p in m.parameters()) + sum(
        t.numel() for t in visual.values())
    assert names == RELEASED_TENSORS
    assert params == RELEASED_PARAMETERS


# ---------------------------------------------------------------------------------------------- tiny checkpoint


@pytest.fixture(scope="module")
def tiny_cfg(tiny_model_dir) -> OmniConfig:
    return OmniConfig.load(tiny_model_dir)


@pytest.fixture(scope="module")
def tiny_tensors(tiny_model_dir) -> dict[str, torch.Tensor]:
    out = {}
    with safe_open(str(tiny_model_dir / "model.safetensors"), framework="pt") as f:
        for k in f.keys():
            out[k] = f.get_tensor(k)
    return out


def load(stage: str, cfg: OmniConfig, model_dir) -> nn.Module:
    return load_module(lambda: FACTORIES[stage](cfg), model_dir, f"{stage}.", device=CPU, dtype=torch.float32,
                       ignore=IGNORE[stage])


@pytest.fixture(scope="module")
def single_file_load(tiny_cfg, tiny_model_dir) -> dict[str, dict[str, torch.Tensor]]:
    return {s: load(s, tiny_cfg, tiny_model_dir).state_dict() for s in STAGES}


def write_checkpoint(folder: Path, shards: dict[str, dict[str, torch.Tensor]], index: bool = True) -> Path:
    """Safetensors shards {file: tensors} (+ model.safetensors.index.json) and the config."""
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    total = 0
    for file, tensors in shards.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / file))
        for k, v in tensors.items():
            weight_map[k] = file
            total += v.numel() * v.element_size()
    if index:
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return folder


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_loads_three_shards_with_an_index(tmp_path, tiny_cfg, tiny_tensors, single_file_load):
    # round-robin: every stage (and every expert tensor set) is spread over all three shards
    names = sorted(tiny_tensors)
    shards = {f"model-0000{i + 1}-of-00003.safetensors": {n: tiny_tensors[n] for n in names[i::3]} for i in range(3)}
    folder = write_checkpoint(tmp_path / "sharded", shards)
    for stage in STAGES:
        assert_same_state(load(stage, tiny_cfg, folder).state_dict(), single_file_load[stage])


def test_loading_logs_each_shard_then_the_time_and_memory(tmp_path, tiny_cfg, tiny_tensors, caplog):
    names = sorted(n for n in tiny_tensors if n.startswith("code2wav."))
    shards = {f"model-0000{i + 1}-of-00002.safetensors": {n: tiny_tensors[n] for n in names[i::2]} for i in range(2)}
    folder = write_checkpoint(tmp_path / "sharded", shards)
    caplog.set_level(logging.INFO, logger="voxpipe.services.runtime.weights")
    module = load("code2wav", tiny_cfg, folder)
    lines = [r.getMessage() for r in caplog.records if r.name == "voxpipe.services.runtime.weights"]
    assert len(lines) == 3, lines
    for i, (line, shard) in enumerate(zip(lines, shards), 1):
        gb = sum(tiny_tensors[n].numel() * 4 for n in shards[shard]) / 1e9      # float32 here
        assert re.fullmatch(rf"code2wav weights: shard {i}/2 {shard}, {gb:.2f} GB in \d+\.\d s", line), line
    total = sum(p.numel() * 4 for p in module.parameters()) / 1e9
    assert re.fullmatch(rf"code2wav weights \(auto\): {total:.2f} GB in \d+\.\d s; process peak RSS \d+\.\d\d GB",
                        lines[-1]), lines[-1]


def test_each_stage_reads_only_its_own_shards(tmp_path, tiny_cfg, tiny_tensors, single_file_load):
    """A talker-only folder (its shards + an index naming only them) serves the talker; the thinker and
    code2wav find nothing there and say what is missing."""
    talker = {n: t for n, t in tiny_tensors.items() if n.startswith("talker.")}
    names = sorted(talker)
    folder = write_checkpoint(tmp_path / "talker-only", {
        "talker-1.safetensors": {n: talker[n] for n in names[: len(names) // 2]},
        "talker-2.safetensors": {n: talker[n] for n in names[len(names) // 2:]}})
    assert_same_state(load("talker", tiny_cfg, folder).state_dict(), single_file_load["talker"])
    for stage in ("thinker", "code2wav"):
        with pytest.raises(WeightError, match=rf"tensors missing under '{stage}\.'"):
            load(stage, tiny_cfg, folder)


def test_index_naming_other_stages_files_that_are_absent(tmp_path, tiny_cfg, tiny_tensors, single_file_load):
    """The index maps each stage to its own shard; the other stages' shards are not on this machine."""
    by_stage = {s: {n: t for n, t in tiny_tensors.items() if n.startswith(s + ".")} for s in STAGES}
    folder = write_checkpoint(tmp_path / "per-stage", {f"{s}.safetensors": by_stage[s] for s in STAGES})
    (folder / "thinker.safetensors").unlink()
    (folder / "talker.safetensors").unlink()
    assert_same_state(load("code2wav", tiny_cfg, folder).state_dict(), single_file_load["code2wav"])
    with pytest.raises(WeightError, match=r"thinker\.safetensors .*missing"):
        load("thinker", tiny_cfg, folder)


def test_thinker_ignores_the_vision_tower(tmp_path, tiny_cfg, tiny_model_dir, tiny_tensors):
    assert any(n.startswith("thinker.visual.") for n in tiny_tensors)
    module = build_empty(lambda: ThinkerModel(tiny_cfg.thinker), CPU, torch.float32)
    assert not any(n.startswith("visual.") for n, _ in module.named_parameters())
    with pytest.raises(WeightError, match=r"unexpected tensors under 'thinker\.'.*thinker\.visual\."):
        load_stage(module, tiny_model_dir, "thinker.")
    load_stage(module, tiny_model_dir, "thinker.", ignore=IGNORE["thinker"])
    # and the thinker service itself loads the tiny checkpoint (which has visual.* tensors)
    import argparse

    from voxpipe.services.thinker import server as thinker_server

    parser = argparse.ArgumentParser()
    thinker_server.add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_model_dir), "--device", "cpu", "--max-len", "64",
                              "--max-batch", "1"])
    servicer, _ = thinker_server.build(args)
    assert_same_state(servicer.engine.runner.model.state_dict(), module.state_dict())


# ---------------------------------------------------------------------------------------------- bad checkpoints


def _broken(tmp_path: Path, tiny_tensors, change) -> Path:
    tensors = dict(tiny_tensors)
    change(tensors)
    return write_checkpoint(tmp_path / "broken", {"model.safetensors": tensors}, index=False)


@pytest.mark.parametrize("stage,change,pattern", [
    ("thinker", lambda t: t.pop("thinker.model.layers.1.self_attn.q_norm.weight"),
     r"1 tensors missing under 'thinker\.'.*thinker\.model\.layers\.1\.self_attn\.q_norm\.weight"),
    ("talker", lambda t: t.pop("talker.model.layers.1.mlp.experts.2.up_proj.weight"),
     r"1 tensors missing under 'talker\.'.*talker\.model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight"),
    ("code2wav", lambda t: t.pop("code2wav.decoder.3.block.1.conv.bias"),
     r"missing.*code2wav\.decoder\.3\.block\.1\.conv\.bias"),
    ("thinker", lambda t: t.__setitem__("thinker.model.layers.0.self_attn.extra.weight", torch.zeros(2)),
     r"1 unexpected tensors under 'thinker\.'.*thinker\.model\.layers\.0\.self_attn\.extra\.weight"),
    ("talker", lambda t: t.__setitem__("talker.model.layers.0.mlp.experts.4.gate_proj.weight", torch.zeros(16, 32)),
     r"unexpected.*talker\.model\.layers\.0\.mlp\.experts\.4\.gate_proj\.weight"),  # the tiny talker has 4 experts
    ("thinker", lambda t: t.__setitem__("thinker.lm_head.weight", torch.zeros(447, 64)),
     r"thinker\.lm_head\.weight: checkpoint shape \[447, 64\] != model shape \[448, 64\]"),
    ("thinker", lambda t: t.__setitem__("thinker.model.layers.0.mlp.experts.3.down_proj.weight", torch.zeros(1, 32)),
     r"experts\.3\.down_proj\.weight: checkpoint shape \[1, 32\] != model shape \[64, 32\]"),  # would broadcast
    ("talker", lambda t: t.__setitem__("talker.model.layers.1.mlp.experts.0.gate_proj.weight", torch.zeros(16, 31)),
     r"experts\.0\.gate_proj\.weight: checkpoint shape \[16, 31\] != model shape \[16, 32\]"),
    ("code2wav", lambda t: t.__setitem__("code2wav.upsample.0.1.gamma", torch.zeros(1)),
     r"gamma: checkpoint shape \[1\] != model shape \[32\]"),
], ids=["missing", "missing-expert", "missing-conv", "unexpected", "unexpected-expert", "shape", "shape-expert-broadcastable",
        "shape-expert", "shape-broadcastable"])
def test_bad_checkpoint_is_a_clear_weight_error(tmp_path, tiny_cfg, tiny_tensors, stage, change, pattern):
    folder = _broken(tmp_path, tiny_tensors, change)
    with pytest.raises(WeightError, match=pattern):
        load(stage, tiny_cfg, folder)


def test_a_failed_load_leaves_no_state_behind(tmp_path, tiny_cfg, tiny_tensors, tiny_model_dir, single_file_load):
    """Loading after a failure (half the experts copied) is still complete and exact."""
    folder = _broken(tmp_path, tiny_tensors,
                     lambda t: t.__setitem__("talker.model.norm.weight", torch.zeros(3)))
    for _ in range(2):
        with pytest.raises(WeightError):
            load("talker", tiny_cfg, folder)
    assert_same_state(load("talker", tiny_cfg, tiny_model_dir).state_dict(), single_file_load["talker"])


def test_no_safetensors_is_a_weight_error(tmp_path, tiny_cfg):
    with pytest.raises(WeightError, match="no \\*.safetensors files"):
        load("code2wav", tiny_cfg, tmp_path)


# ---------------------------------------------------------------------------------------------- dummy weights


@pytest.mark.parametrize("stage", STAGES)
def test_dummy_weights_fill_every_parameter(tiny_cfg, stage):
    module = load_module(lambda: FACTORIES[stage](tiny_cfg), "/nonexistent", f"{stage}.", device=CPU,
                         dtype=torch.float32, load_format="dummy", seed=3)
    named = dict(module.named_parameters())
    assert named
    for name, p in named.items():
        assert torch.isfinite(p).all(), name
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "bias" or leaf in ("alpha", "beta"):
            assert not p.any(), name
        elif "norm" in name:
            assert torch.all(p == 1), name
        elif p.numel() > 64 and leaf not in ("scale", "gamma"):
            assert 0.01 < float(p.std()) < 0.03, name  # N(0, 0.02), not left uninitialised
    again = load_module(lambda: FACTORIES[stage](tiny_cfg), "/nonexistent", f"{stage}.", device=CPU,
                        dtype=torch.float32, load_format="dummy", seed=3)
    assert_same_state(module.state_dict(), again.state_dict())  # seeded


def test_unknown_load_format(tiny_cfg):
    with pytest.raises(ValueError, match="unknown load format"):
        load_module(lambda: Code2WavModel(tiny_cfg.code2wav), "/nonexistent", "code2wav.", device=CPU,
                    dtype=torch.float32, load_format="pt")


def test_dummy_service_stage_serves_without_weights_files(tmp_path, tiny_model_dir):
    """`--load-format dummy` needs config.json only."""
    folder = tmp_path / "config-only"
    folder.mkdir()
    shutil.copy(tiny_model_dir / "config.json", folder / "config.json")
    import argparse

    from voxpipe.services.code2wav import server as code2wav_server

    parser = argparse.ArgumentParser()
    code2wav_server.add_arguments(parser)
    args = parser.parse_args(["--model", str(folder), "--device", "cpu", "--load-format", "dummy", "--max-batch", "1"])
    servicer = code2wav_server.build(args)
    assert all(torch.isfinite(p).all() for p in servicer.engine.runner.model.parameters())
