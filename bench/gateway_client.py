"""The benchmark's end-to-end client: the official `openai` SDK streaming a chat completion with
audio from the gateway (SSE), turned into the same events the pipeline client yields."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator

import numpy as np

from voxpipe.client import AudioEvent, DoneEvent, TextEvent

from .requests import ChatRequest


class GatewayStream:
    def __init__(self, base_url: str, model: str) -> None:
        import openai

        self.model = model
        self.client = openai.AsyncOpenAI(base_url=base_url, api_key="voxpipe-bench", max_retries=0, timeout=900.0)

    async def close(self) -> None:
        await self.client.close()

    async def __call__(self, req: ChatRequest) -> AsyncIterator:
        stream = await self.client.chat.completions.create(
            model=self.model, messages=req.messages, modalities=["text", "audio"],
            audio={"voice": req.voice, "format": "pcm16"}, stream=True, stream_options={"include_usage": True},
            max_completion_tokens=req.max_tokens, temperature=req.temperature,
            seed=req.index if req.temperature else None,
            extra_body={"ignore_eos": True, "max_audio_frames": req.max_audio_frames})
        offset = index = 0
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                audio = choice.delta.audio
                if audio is None:
                    continue
                if audio.transcript:
                    yield TextEvent(index, [], audio.transcript)
                    index += 1
                if audio.data:
                    data = base64.b64decode(audio.data)
                    samples = np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767.0
                    yield AudioEvent(offset, 24000, samples, data)
                    offset += samples.shape[0]
        if usage is None:
            raise RuntimeError("the stream ended without a usage chunk")
        details = usage.completion_tokens_details
        text_tokens = getattr(details, "text_tokens", None) or 0
        audio_tokens = getattr(details, "audio_tokens", None) or 0
        yield DoneEvent(0, 0, usage.prompt_tokens, text_tokens, audio_tokens, offset)
