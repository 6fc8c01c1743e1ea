"""Where code2wav's batch invariance breaks (`--deterministic`): one target utterance decoded frame by
frame alone and as row R of a batch of C utterances (the others with codes of their own), built as
the service builds it. Two passes:
  eager   every module's output row of the target is kept (forward hooks; no CUDA graphs, whose
          replays run no hooks): the first frame and module whose row differs between alone and
          batched, with its largest difference
  graphs  (CUDA, or VOXPIPE_EMULATE_GRAPHS=1) the same frames through the runner's graph step
          (`Code2WavRunner.decode`): the frames whose samples differ (from the first one on: state;
          one frame alone: its output)
One JSON line per pass; exit status 1 if either differs.

    python -m voxpipe.bench.code2wav_locate --device cuda --load-format dummy --concurrency 64 --frames 8
    python -m voxpipe.bench.code2wav_locate --device cpu --concurrency 4 --frames 6    # the tiny checkpoint"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from .determinism_check import build_engine, checkpoint_flags, resolve_model


def _codes(engine, k: int, frames: int) -> torch.Tensor:
    """Utterance k's codes [frames, Q] (the target is k = 0)."""
    q, size = engine.cfg.num_quantizers, engine.cfg.codebook_size
    return torch.randint(0, size, (frames, q), generator=torch.Generator().manual_seed(k))


def eager_rows(engine, codes: list[torch.Tensor], row: int) -> list[list[tuple[str, bytes, torch.Tensor]]]:
    """Per frame, every hooked module call's input and output row `row` of the batch `codes` (one [F, Q] per
    utterance), decoded one frame per call in fresh slots: [(module name, bytes, row)]."""
    runner, model = engine.runner, engine.runner.model
    b, dev = len(codes), engine.device
    record: list[tuple[str, bytes, torch.Tensor]] = []

    def hook(name):
        def keep(_module, inputs, out):
            # the input first ("NAME input"), then the output: a module whose input already differs did
            # not make the difference (e.g. o_proj's input is the attention's output, which no module returns)
            for label, t in ((f"{name} input", inputs[0] if inputs else None),
                             (name, out[0] if isinstance(out, tuple) else out)):
                if isinstance(t, torch.Tensor) and t.ndim and t.shape[0] == b and t.is_floating_point():
                    r = t[row].detach().float().cpu()
                    record.append((label, r.numpy().tobytes(), r))
        return keep

    handles = [m.register_forward_hook(hook(name)) for name, m in model.named_modules() if name]
    slots = [runner.allocate() for _ in codes]
    frames = []
    try:
        with torch.inference_mode():
            for f in range(codes[0].shape[0]):
                record.clear()
                batch = torch.stack([c[f] for c in codes])[:, :, None].to(dev)
                model.decode_unclamped(batch, torch.tensor(slots, device=dev), torch.full((b,), f, device=dev),
                                       runner.store, f == 0)
                frames.append(list(record))
    finally:
        for h in handles:
            h.remove()
        for s in slots:
            runner.release(s)
    return frames


def first_module_difference(alone, batched) -> dict | None:
    for f, (a, g) in enumerate(zip(alone, batched)):
        for i, ((name, bits_a, ra), (name_g, bits_g, rg)) in enumerate(zip(a, g)):
            if name != name_g:
                return {"frame": f, "call": i, "module": name, "other_module": name_g}
            if bits_a != bits_g:
                return {"frame": f, "call": i, "module": name, "shape": list(ra.shape),
                        "max_abs": float((ra - rg).abs().max()), "elements_differing": int((ra != rg).sum())}
    return None


def graph_samples(engine, codes: list[torch.Tensor], row: int) -> list[bytes]:
    """Row `row`'s samples per frame through the runner's step (CUDA graphs where it has them)."""
    from voxpipe.services.code2wav.runner import FrameWork

    runner = engine.runner
    slots = [runner.allocate() for _ in codes]
    out = []
    try:
        with torch.inference_mode():
            for f in range(codes[0].shape[0]):
                audio, _ok = runner.decode([FrameWork(s, f, [c[f]]) for s, c in zip(slots, codes)])
                out.append(audio[row].tobytes())
    finally:
        for s in slots:
            runner.release(s)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    checkpoint_flags(p)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--concurrency", type=int, default=4, help="utterances in the batch, the target among them")
    p.add_argument("--frames", type=int, default=6)
    p.add_argument("--passes", default="eager,graphs")
    args = p.parse_args(argv)
    resolve_model(args)
    base = ["--model", args.model, "--device", args.device, "--load-format", args.load_format, "--dtype", args.dtype,
            "--max-batch", str(args.concurrency), "--deterministic"]
    row = args.concurrency // 2
    failed = False
    for name in args.passes.split(","):
        engine = build_engine("code2wav", base + (["--no-cuda-graphs"] if name == "eager" else []))
        target = _codes(engine, 0, args.frames)
        batch = [_codes(engine, k, args.frames) for k in range(1, args.concurrency)]
        batch.insert(row, target)
        if name == "eager":
            alone, got = eager_rows(engine, [target], 0), eager_rows(engine, batch, row)
            diff = first_module_difference(alone, got)
            if diff is not None:    # frames whose last module's row (the samples) differs
                diff["frames_differing"] = [f for f, (a, g) in enumerate(zip(alone, got)) if a[-1][1] != g[-1][1]]
        else:
            alone, got = graph_samples(engine, [target], 0), graph_samples(engine, batch, row)
            frames = [f for f, (a, g) in enumerate(zip(alone, got)) if a != g]
            diff = {"frame": frames[0], "frames_differing": frames} if frames else None
        print(json.dumps({"pass": name, "device": args.device, "concurrency": args.concurrency, "frames": args.frames,
                          "graphs": getattr(engine.runner, "graphs", None) is not None, "equal": diff is None,
                          "first_difference": diff}), flush=True)
        failed |= diff is not None
        del engine
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
