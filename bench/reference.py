"""transformers' reference generate on full-size dummy weights (run as its own process so its GPU
memory is gone before voxpipe starts): `python -m voxpipe.bench.reference --model MODEL --workload NAME`.
The prompt is the one the split / in-process modes send for request 0 of the workload (for a voice
workload: the same rendered prompt and the same audio features). Prints one JSON line: prefill+1
token time, thinker tok/s, and the whole generate(return_audio=True) time (its TTFP: it cannot
stream) and RTF for the workload's forced lengths."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="checkpoint folder or config .json (its weights are not read)")
    p.add_argument("--workload", default="seedtts-like")
    p.add_argument("--prompt-tokens", type=int, default=0)
    p.add_argument("--text-tokens", type=int, default=0)
    p.add_argument("--frames", type=int, default=0)
    p.add_argument("--audio", help="the voice clip (voice workloads)")
    p.add_argument("--realtime-audio", action="store_true")
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    from voxpipe.bench.requests import RequestMaker
    from voxpipe.bench.voice_clip import load_clip
    from voxpipe.bench.workload import WORKLOADS
    from voxpipe.services.runtime.config import OmniConfig
    from voxpipe.services.thinker.prompt import FeatureExtractor, load_tokenizer

    wl = WORKLOADS[args.workload].with_overrides(args.prompt_tokens, args.text_tokens, args.frames, args.realtime_audio)
    cfg = OmniConfig.load(args.model)
    clip = load_clip(args.audio) if wl.voice else None
    features = FeatureExtractor.for_model(args.model, cfg.thinker) if wl.voice else None
    req = RequestMaker(wl, cfg, load_tokenizer(args.model, cfg), clip, features).speech(0)

    path = Path(args.model)
    config = Qwen3OmniMoeConfig.from_json_file(str(path if path.is_file() else path / "config.json"))
    t0 = time.perf_counter()
    with torch.device(args.device):
        model = Qwen3OmniMoeForConditionalGeneration._from_config(config, dtype=torch.bfloat16).eval()
        gen = torch.Generator(device=args.device).manual_seed(0)
        for prm in model.parameters():
            prm.data.normal_(0.0, 0.02, generator=gen)
    build_s = time.perf_counter() - t0
    ids = torch.tensor([req.token_ids], device=args.device)
    audio = {}
    if req.audio_features:          # one clip: [1, mel bins, frames], every frame valid
        feats = req.audio_features[0].to(args.device, torch.bfloat16)[None]
        audio = {"input_features": feats,
                 "feature_attention_mask": torch.ones(1, feats.shape[-1], dtype=torch.long, device=args.device)}

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
        kw = dict(do_sample=False, eos_token_id=config.im_end_token_id, **audio)
        timed(lambda: th.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw))  # warm-up
        one = timed(lambda: th.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw))
        text = timed(lambda: th.generate(ids, max_new_tokens=wl.text_tokens, min_new_tokens=wl.text_tokens, **kw))
        out = {}

        def full():
            seq, wav = model.generate(ids, speaker=wl.speaker, return_audio=True, thinker_do_sample=False,
                                      talker_do_sample=False, thinker_max_new_tokens=wl.text_tokens,
                                      thinker_min_new_tokens=wl.text_tokens, thinker_eos_token_id=config.im_end_token_id,
                                      talker_max_new_tokens=wl.frames + 1, talker_min_new_tokens=wl.frames + 1, **audio)
            out["samples"] = int(wav.numel())

        total = timed(full)
    audio_s = out["samples"] / 24000
    print(json.dumps({"workload": wl.name, "prompt_tokens": len(req.token_ids), "audio_frames_in":
                      sum(int(f.shape[1]) for f in req.audio_features), "build_s": build_s,
                      "prefill_plus_1_ms": one * 1000, "thinker_tok_s": (wl.text_tokens - 1) / (text - one),
                      "ttfp_s": total, "audio_s": audio_s, "rtf": total / audio_s,
                      "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None}), flush=True)


if __name__ == "__main__":
    main()
