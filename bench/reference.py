"""transformers' reference generate on full-size dummy weights (run as its own process so its GPU
memory is gone before voxpipe starts): `python -m voxpipe.bench.reference --config CONFIG.json`.
Prints one JSON line: prefill+1 token time, thinker tok/s, and the whole generate(return_audio=True)
time (its TTFP: it cannot stream) and RTF for the workload's forced lengths."""

from __future__ import annotations

import argparse
import json
import time

import torch


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument("--text-tokens", type=int, default=48)
    p.add_argument("--frames", type=int, default=125)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    from voxpipe.bench.workload import Workload
    from voxpipe.services.runtime.config import OmniConfig

    config = Qwen3OmniMoeConfig.from_json_file(args.config)
    t0 = time.perf_counter()
    with torch.device(args.device):
        model = Qwen3OmniMoeForConditionalGeneration._from_config(config, dtype=torch.bfloat16).eval()
        gen = torch.Generator(device=args.device).manual_seed(0)
        for prm in model.parameters():
            prm.data.normal_(0.0, 0.02, generator=gen)
    build_s = time.perf_counter() - t0
    wl = Workload(prompt_tokens=args.prompt_tokens, text_tokens=args.text_tokens, frames=args.frames)
    ids = torch.tensor([wl.prompt(OmniConfig.load(args.config), 0)], device=args.device)

    cuda = torch.device(args.device).type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def timed(fn) -> float:
        sync()
        t = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t

    with torch.inference_mode():
        th = model.thinker
        kw = dict(do_sample=False, eos_token_id=config.im_end_token_id)
        timed(lambda: th.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw))  # warm-up
        one = timed(lambda: th.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw))
        text = timed(lambda: th.generate(ids, max_new_tokens=wl.text_tokens, min_new_tokens=wl.text_tokens, **kw))
        out = {}

        def full():
            seq, wav = model.generate(ids, speaker=wl.speaker, return_audio=True, thinker_do_sample=False,
                                      talker_do_sample=False, thinker_max_new_tokens=wl.text_tokens,
                                      thinker_min_new_tokens=wl.text_tokens, thinker_eos_token_id=config.im_end_token_id,
                                      talker_max_new_tokens=wl.frames + 1, talker_min_new_tokens=wl.frames + 1)
            out["samples"] = int(wav.numel())

        total = timed(full)
    audio_s = out["samples"] / 24000
    print(json.dumps({"build_s": build_s, "prefill_plus_1_ms": one * 1000, "thinker_tok_s": (wl.text_tokens - 1) / (text - one),
                      "ttfp_s": total, "audio_s": audio_s, "rtf": total / audio_s,
                      "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None}), flush=True)


if __name__ == "__main__":
    main()
