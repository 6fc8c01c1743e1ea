"""Time to the first token of a voice turn sent whole at its end against the same turn streamed
while it is spoken (ThinkerStart.stream_audio), on a running thinker:

    python -m bench.streamed_turn --thinker 127.0.0.1:50051 --model DIR_OR_CONFIG [--seconds 10] [--turns 3]

The clip (noise, `--seconds` long) is sent as raw log-mel frames paced at `--speed` times real time
(1: as spoken); the time is measured from the commit (the end of speech) to the first TextDelta, and
for the whole turn from its start message. Prints one JSON line per turn: both times, the prompt's
tokens and the share prefilled before the commit (Finished.streamed_tokens / prompt_tokens)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import grpc
import numpy as np
import torch

from voxpipe.services.runtime.config import OmniConfig
from voxpipe.services.runtime.tensors import to_proto
from voxpipe.services.thinker.log_mel import LogMelStream, scale
from voxpipe.services.thinker.prompt import ChatMessage, ChatPart, FeatureExtractor, load_tokenizer, render
from voxpipe.services.thinker.streamed import around_last_clip
from voxpipe.v1 import stages_pb2 as pb
from voxpipe.v1 import stages_pb2_grpc as pb_grpc

PIECE_SECONDS = 0.1       # the gateway's pieces of input audio


async def first_token(call, since: list[float]) -> tuple[float, pb.Finished]:
    first, finished = None, None
    async for msg in call:
        if msg.WhichOneof("kind") == "text" and first is None:
            first = time.perf_counter() - since[0]
        elif msg.WhichOneof("kind") == "finished":
            finished = msg.finished
    return first, finished


async def turn(stub, fe, tok, cfg, seed: int, args) -> dict:
    wav = (np.random.default_rng(seed).standard_normal(int(16000 * args.seconds)) * 0.1).astype(np.float32)
    stream, piece = LogMelStream(fe.fe.mel_filters), int(16000 * PIECE_SECONDS)
    frames = [stream.push(wav[i:i + piece]) for i in range(0, len(wav), piece)]
    tail = stream.finish()
    clip = scale(torch.cat(frames + [tail], dim=1))
    messages = [ChatMessage.text("system", "You are a helpful voice assistant."),
                ChatMessage("user", [ChatPart(features=clip)])]
    rendered = render(tok, cfg, messages)
    prefix, suffix = around_last_clip(rendered.token_ids, cfg.tokens.audio_token)
    gen = dict(max_tokens=args.max_tokens, min_tokens=args.max_tokens)

    since = [0.0]

    async def whole_requests():
        since[0] = time.perf_counter()
        yield pb.ThinkerRequest(start=pb.ThinkerStart(token_ids=pb.TokenIds(ids=rendered.token_ids),
                                                      audio_features=[to_proto(clip)], **gen))

    whole_s, _ = await first_token(stub.Generate(whole_requests()), since)

    async def streamed_requests():
        yield pb.ThinkerRequest(start=pb.ThinkerStart(stream_audio=True, token_ids=pb.TokenIds(ids=prefix)))
        for f in frames:
            if f.shape[1]:
                yield pb.ThinkerRequest(audio=pb.AudioFrames(log_mel=to_proto(f.contiguous())))
            await asyncio.sleep(PIECE_SECONDS / args.speed)
        since[0] = time.perf_counter()
        yield pb.ThinkerRequest(commit=pb.StreamCommit(log_mel=to_proto(tail.contiguous()),
                                                       start=pb.ThinkerStart(token_ids=pb.TokenIds(ids=suffix), **gen)))

    streamed_s, finished = await first_token(stub.Generate(streamed_requests()), since)
    return {"seconds": args.seconds, "prompt_tokens": finished.prompt_tokens,
            "whole_ttft_ms": round(whole_s * 1000, 2), "streamed_ttft_from_commit_ms": round(streamed_s * 1000, 2),
            "prefilled_before_commit": round(finished.streamed_tokens / finished.prompt_tokens, 3)}


async def main(args) -> None:
    cfg = OmniConfig.load(args.model)
    tok, fe = load_tokenizer(args.model, cfg), FeatureExtractor.for_model(args.model, cfg.thinker)
    async with grpc.aio.insecure_channel(args.thinker, options=[("grpc.max_send_message_length", 64 << 20),
                                                                 ("grpc.max_receive_message_length", 64 << 20)]) as ch:
        stub = pb_grpc.ThinkerStub(ch)
        for i in range(args.turns):
            print(json.dumps(await turn(stub, fe, tok, cfg.thinker, i, args)), flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--thinker", required=True)
    p.add_argument("--model", required=True, help="the checkpoint folder or config .json the thinker serves")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--speed", type=float, default=1.0, help="times real time the frames are sent at")
    p.add_argument("--max-tokens", type=int, default=4)
    asyncio.run(main(p.parse_args()))
