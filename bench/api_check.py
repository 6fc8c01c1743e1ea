"""The served APIs at full size on the GPU (dummy weights): the three stage services and the gateway
as processes, driven by the openai SDK -- chat with audio (whole and streamed) with logprobs /
top_logprobs and stop, /v1/audio/speech in every format (streamed, each decoded with PyAV) and as
SSE. What the CPU tests check on the tiny checkpoint, here through CUDA graphs, the Triton kernels
and full-size shapes. Prints one JSON line per check; exits 1 if any fails.

    bash bench/device.sh python3 -m voxpipe.bench.api_check      (carry .whl: openai, av, the gateway's)
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
import time
from pathlib import Path

FORMATS = ("pcm", "wav", "mp3", "opus", "flac", "aac")


def _check(name: str, ok: bool, **facts) -> bool:
    print(json.dumps({"check": name, "ok": bool(ok), **facts}), flush=True)
    return bool(ok)


def _decoded_samples(data: bytes, fmt: str) -> int:
    if fmt == "pcm":
        return len(data) // 2
    import av

    with av.open(io.BytesIO(data)) as container:
        return sum(frame.samples for frame in container.decode(audio=0))


def run_checks(base_url: str) -> bool:
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    ok = True
    messages = [{"role": "user", "content": "Tell me about the sea."}]

    r = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=12, temperature=0,
                                       logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    ok &= _check("chat logprobs", len(content) == r.usage.completion_tokens and all(
        math.isfinite(t.logprob) and t.logprob <= 0 and len(t.top_logprobs) == 5
        and [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)
        for t in content), tokens=len(content), first=content[0].logprob if content else None)

    # greedy: the run again with a stop string taken from its own text ends right before it
    text = r.choices[0].message.content or ""
    cut = text[len(text) // 2:len(text) // 2 + 3] if len(text) >= 6 else ""
    if cut.strip():
        s = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=12, temperature=0,
                                           stop=[cut])
        got = s.choices[0].message.content or ""
        ok &= _check("chat stop", got == text[:text.index(cut)] and s.choices[0].finish_reason == "stop",
                     stop=cut, text=text, got=got)
    else:
        print(json.dumps({"check": "chat stop", "skipped": f"no usable stop string in the reply {text!r}"}), flush=True)

    t0 = time.perf_counter()
    first = None
    audio = b""
    chunks = 0
    stream = client.chat.completions.create(
        model=model, messages=messages, modalities=["text", "audio"], audio={"voice": "ethan", "format": "pcm16"},
        stream=True, stream_options={"include_usage": True}, max_completion_tokens=16, temperature=0, logprobs=True,
        extra_body={"max_audio_frames": 40})
    import base64

    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.audio is not None and getattr(choice.delta.audio, "data", None):
                first = first or time.perf_counter() - t0
                audio += base64.b64decode(choice.delta.audio.data)
            chunks += 1
    ok &= _check("chat audio stream", len(audio) > 0 and first is not None, samples=len(audio) // 2,
                 first_audio_s=first, chunks=chunks)

    text = "Hello world. This is voxpipe speaking a sentence verbatim."
    for fmt in FORMATS:
        t0 = time.perf_counter()
        first = None
        data = b""
        with client.audio.speech.with_streaming_response.create(model=model, voice="ethan", input=text,
                                                                response_format=fmt) as resp:
            for piece in resp.iter_bytes():
                first = first or time.perf_counter() - t0
                data += piece
        try:
            n = _decoded_samples(data, fmt)
        except Exception as e:  # noqa: BLE001 - reported as a failed check
            n, err = 0, repr(e)
        else:
            err = None
        ok &= _check(f"speech {fmt}", n > 0, bytes=len(data), samples=n, first_byte_s=first,
                     total_s=time.perf_counter() - t0, error=err)

    events = []
    with client.audio.speech.with_streaming_response.create(model=model, voice="ethan", input=text,
                                                            response_format="pcm", stream_format="sse") as resp:
        for line in resp.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]).get("type"))
    ok &= _check("speech sse", events and events[-1] == "speech.audio.done" and "speech.audio.delta" in events,
                 events=len(events), last=events[-1] if events else None)
    return bool(ok)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint folder (default: the released config, dummy weights)")
    p.add_argument("--load-format", default="dummy", choices=["auto", "dummy"], help="weights: read or random")
    p.add_argument("--device", default="cuda", help="the stages' device")
    p.add_argument("--base-port", type=int, default=54051, help="first stage port (the gateway: +99)")
    args = p.parse_args(argv)

    from voxpipe.cli import LocalStack
    from voxpipe.services.runtime.config import released_config_path

    model = Path(args.model) if args.model else released_config_path()
    http_port = args.base_port + 99
    stack = LocalStack(model, "127.0.0.1", args.base_port, args.device, extra=["--load-format", args.load_format],
                       http_port=http_port)
    t0 = time.perf_counter()
    stack.start(timeout=400)
    print(json.dumps({"started_s": round(time.perf_counter() - t0, 1)}), flush=True)
    try:
        return 0 if run_checks(f"http://127.0.0.1:{http_port}") else 1
    finally:
        stack.stop()


if __name__ == "__main__":
    sys.exit(main())
