"""The reliability suite (issues #13, #25): fuzzed inputs on every API of a real local deployment,
client disconnects at random and at the worst timings, a short soak, each stage SIGKILLed under
streams of every gateway API and restarted (--chaos, on with --full), a talker SIGKILL and SIGTERM
drain, and the security checks.

    python -m voxpipe.bench.reliability [--full] [--out reliability.json] [--md tables.md] [--seed 0]
        [--cases N] [--disconnects N] [--soak N] [--chaos | --no-chaos]

What it starts (all on 127.0.0.1, the tiny checkpoint, CPU): one thinker (--reflection), two talkers (A, B;
reflection off by default), one code2wav (--no-reflection), and a gateway with --api-key, --grpc-port
(Converse) and --no-reflection.
Every loop is bounded in count and time; traffic goes to loopback only.

Inputs are generated with hypothesis (a fixed seed per API: the same command tries the same cases)
and each case gets an outcome class:

    2xx    accepted and answered (HTTP 2xx, gRPC OK, a realtime event answered without an error)
    4xx    refused as the client's fault (HTTP 4xx; INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAUTHENTICATED,
           NOT_FOUND, OUT_OF_RANGE, FAILED_PRECONDITION, CANCELLED; a realtime `error` event not of type
           server_error)
    5xx    the server's fault (HTTP 5xx or a `server_error` inside a 2xx stream or a body cut short;
           INTERNAL, UNKNOWN, UNAVAILABLE, DATA_LOSS, UNIMPLEMENTED; a realtime server_error or a socket
           closed by the server)
    hang   no complete answer within the hang bound (a generous timeout, not a performance claim)

Generation lengths of accepted cases are kept small (1-8 tokens and frames; out-of-range lengths are
still tried, and refused) so that a case costs well under a second on a CPU.
After every API: every process alive, every gauge back to 0 (voxpipe_active_streams, queue depth,
throttled, pending uploads per stage; voxpipe_gateway_sessions{api}, voxpipe_gateway_active_streams),
and the seeded known-good requests byte-identical to their first run.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import hashlib
import io
import json
import os
import platform
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import wave
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import grpc
import numpy as np

from voxpipe import module_command
from voxpipe.v1 import gateway_pb2 as gw
from voxpipe.v1 import gateway_pb2_grpc as gw_grpc
from voxpipe.v1 import stages_pb2 as pb
from voxpipe.v1 import stages_pb2_grpc as pb_grpc

HOST = "127.0.0.1"
OTHER_LOOPBACK = "127.0.0.2"        # a listener bound to --host 127.0.0.1 must refuse this address
API_KEY = "rel-key-0123456789"
STAGES = ("thinker", "talker_a", "talker_b", "code2wav")
STAGE_LABEL = {"thinker": "thinker", "talker_a": "talker", "talker_b": "talker", "code2wav": "code2wav"}
APIS = ("http_chat", "http_speech", "realtime", "converse", "stage_thinker", "stage_talker", "stage_code2wav")
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 256 * 1024 * 1024),
                   ("grpc.max_receive_message_length", 256 * 1024 * 1024)]
GRPC_4XX = {"INVALID_ARGUMENT", "OUT_OF_RANGE", "FAILED_PRECONDITION", "NOT_FOUND", "RESOURCE_EXHAUSTED",
            "UNAUTHENTICATED", "PERMISSION_DENIED", "ALREADY_EXISTS", "CANCELLED"}


@dataclass(frozen=True)
class Settings:
    mode: str
    cases: int                 # hypothesis examples per API
    disconnects: int           # requests cut at random points
    soak_requests: int
    soak_concurrency: int
    hang_s: float              # the hang bound per case
    kill_streams: int          # concurrent streams when a talker is killed / drained
    listen_timeout_s: float | None = None   # code2wav --listen-timeout (None: its default, 30 s)
    chaos: bool = False        # SIGKILL each stage under streams of every gateway API, then restart it


SHORT = Settings("short", cases=24, disconnects=8, soak_requests=12, soak_concurrency=4, hang_s=60, kill_streams=4,
                 listen_timeout_s=5)    # a to_listener case whose listener never attaches costs 5 s, not 30
FULL = Settings("full", cases=500, disconnects=1000, soak_requests=400, soak_concurrency=4, hang_s=90, kill_streams=8,
                chaos=True)


# ============================================================================== processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Service:
    """One `voxpipe` process; stderr goes to a log file (tracebacks are counted at the end)."""

    def __init__(self, name: str, args: list[str], log_dir: Path, restarted: bool = False) -> None:
        self.name, self.args, self.log_dir = name, args, log_dir
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "a" if restarted else "w")
        self.proc = subprocess.Popen([*module_command("voxpipe.cli"), "--log-level", "WARNING", *args],
                                     stdout=subprocess.PIPE, stderr=self._log, text=True)

    def wait_ready(self, deadline: float) -> None:
        while True:
            line = self.proc.stdout.readline()
            if "ready on port" in line:
                threading.Thread(target=self.proc.stdout.read, daemon=True).start()   # keep the pipe drained
                return
            if (not line and self.proc.poll() is not None) or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start (exit code {self.proc.poll()}); see {self.log_path}")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss_mb(self) -> float:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    def tracebacks(self) -> int:
        self._log.flush()
        return self.log_path.read_text(errors="replace").count("Traceback (most recent call last)")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


class Deployment:
    """thinker -> talker A | talker B -> code2wav, and the gateway (HTTP, realtime, Converse)."""

    def __init__(self, model_dir: Path, log_dir: Path, listen_timeout_s: float | None = None) -> None:
        self.model_dir, self.log_dir, self.listen_timeout_s = model_dir, log_dir, listen_timeout_s
        self.ports = {s: free_port() for s in STAGES}
        self.metrics_ports = {s: free_port() for s in STAGES}
        self.http_port, self.grpc_port = free_port(), free_port()
        self.services: dict[str, Service] = {}

    def address(self, stage: str) -> str:
        return f"{HOST}:{self.ports[stage]}"

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.http_port}"

    @property
    def converse_address(self) -> str:
        return f"{HOST}:{self.grpc_port}"

    def start(self, timeout: float = 300) -> None:
        common = ["--model", str(self.model_dir), "--host", HOST, "--device", "cpu"]
        talkers = f"{self.address('talker_a')},{self.address('talker_b')}"
        extra = {"thinker": ["thinker", f"--talker={talkers}", "--reflection"],
                 "talker_a": ["talker", f"--code2wav={self.address('code2wav')}"],
                 "talker_b": ["talker", f"--code2wav={self.address('code2wav')}", "--grace", "120"],
                 "code2wav": ["code2wav", "--no-reflection"] + (
                     [] if self.listen_timeout_s is None else ["--listen-timeout", str(self.listen_timeout_s)])}
        for s in STAGES:
            cmd, *flags = extra[s]
            self.services[s] = Service(s, [cmd, *common, "--port", str(self.ports[s]), "--metrics-port",
                                           str(self.metrics_ports[s]), *flags], self.log_dir)
        deadline = time.monotonic() + timeout
        try:
            for s in STAGES:
                self.services[s].wait_ready(deadline)
            self.services["gateway"] = Service("gateway", [
                "gateway", "--model", str(self.model_dir), "--host", HOST, "--http-port", str(self.http_port),
                "--grpc-port", str(self.grpc_port), "--thinker", self.address("thinker"),
                "--code2wav", self.address("code2wav"), "--api-key", API_KEY, "--no-reflection"], self.log_dir)
            self.services["gateway"].wait_ready(deadline)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if "gateway" in self.services:
            self.services["gateway"].stop()
        for name, svc in self.services.items():
            if name != "gateway":
                svc.stop()

    def restart(self, name: str, timeout: float = 300) -> None:
        """Start the (ended) process `name` again with its flags and ports; ready."""
        old = self.services[name]
        old.stop()
        self.services[name] = Service(name, old.args, self.log_dir, restarted=True)
        self.services[name].wait_ready(time.monotonic() + timeout)

    def dead(self, expected_gone: tuple[str, ...] = ()) -> list[str]:
        return [n for n, s in self.services.items() if n not in expected_gone and not s.alive]


# ============================================================================== gauges


def _scrape(url: str, headers: dict | None = None) -> str:
    req = urllib.request.Request(url, headers=headers or {})
    return urllib.request.urlopen(req, timeout=10).read().decode()


def _samples(text: str, name: str) -> dict[str, float]:
    out = {}
    for m in re.finditer(rf"^{name}(\{{.*\}})? (\S+)$", text, re.M):
        out[f"{name}{m.group(1) or ''}"] = float(m.group(2))
    return out


STAGE_GAUGES = ("voxpipe_active_streams", "voxpipe_queue_depth", "voxpipe_throttled_streams",
                "voxpipe_pending_upload_bytes")
GATEWAY_GAUGES = ("voxpipe_gateway_sessions", "voxpipe_gateway_active_streams")


def gauges(dep: Deployment, skip: tuple[str, ...] = ()) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in STAGES:
        if s in skip or not dep.services[s].alive:
            continue
        text = _scrape(f"http://{HOST}:{dep.metrics_ports[s]}/metrics")
        for g in STAGE_GAUGES:
            out.update({f"{s}:{k}": v for k, v in _samples(text, g).items()})
    text = _scrape(f"{dep.base_url}/metrics", {"Authorization": f"Bearer {API_KEY}"})
    for g in GATEWAY_GAUGES:
        out.update({f"gateway:{k}": v for k, v in _samples(text, g).items()})
    return out


def settle(dep: Deployment, timeout: float = 20, skip: tuple[str, ...] = ()) -> dict:
    """Wait until every gauge is 0; returns {zero, seconds, nonzero}."""
    t0 = time.monotonic()
    while True:
        g = gauges(dep, skip)
        nonzero = {k: v for k, v in g.items() if v != 0}
        if not nonzero or time.monotonic() - t0 > timeout:
            return {"zero": not nonzero, "seconds": round(time.monotonic() - t0, 2), "nonzero": nonzero,
                    "gauges_checked": len(g)}
        time.sleep(0.1)


# ============================================================================== clients and outcome classes


def auth_headers() -> dict:
    return {"Authorization": f"Bearer {API_KEY}"}


AUTH_METADATA = (("authorization", f"Bearer {API_KEY}"),)


def grpc_class(code: grpc.StatusCode) -> str:
    if code == grpc.StatusCode.OK:
        return "2xx"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "hang"
    return "4xx" if code.name in GRPC_4XX else "5xx"


def http_class(status: int) -> str:
    return "2xx" if status < 300 else "4xx" if status < 500 else "5xx"


@dataclass
class Tally:
    api: str
    counts: Counter = field(default_factory=Counter)
    detail: Counter = field(default_factory=Counter)       # status code / gRPC code -> count
    bad: list = field(default_factory=list)                 # 5xx and hangs: (what was sent, what came back)
    seconds: float = 0.0

    def add(self, cls: str, detail: str, sent: Any = None, got: str = "") -> None:
        self.counts[cls] += 1
        self.detail[detail] += 1
        if cls in ("5xx", "hang") and len(self.bad) < 25:
            self.bad.append({"class": cls, "detail": detail, "sent": _short(sent), "got": got[:400]})

    def row(self) -> dict:
        return {"api": self.api, "cases": sum(self.counts.values()),
                **{k: self.counts.get(k, 0) for k in ("2xx", "4xx", "5xx", "hang")},
                "by_status": dict(sorted(self.detail.items())), "seconds": round(self.seconds, 1),
                "failures": self.bad}


def _short(x: Any, n: int = 300) -> str:
    if x is None:
        return ""
    s = x.decode("utf-8", "replace") if isinstance(x, (bytes, bytearray)) else repr(x)
    return s if len(s) <= n else s[:n] + f"... ({len(s)} chars)"


def run_cases(strategy, n: int, seed: int, fn: Callable[[Any], None]) -> None:
    """Feed `n` hypothesis examples of `strategy` to `fn` (which records, never raises)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    @hseed(seed)
    @given(strategy)
    def inner(case):
        fn(case)

    inner()


# ============================================================================== hostile values


def strategies(model_id: str, omni):
    """hypothesis strategies for every API (built lazily: hypothesis is a test / bench dependency)."""
    from hypothesis import strategies as st

    big_ints = [0, -1, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -2**63 - 1,
                10**100, -10**100]
    floats = [0.0, -0.0, 1e-40, 1e-38, 1e-7, 0.5, 1.0, 2.0, 2.0000001, 100.0, 1e38, 3.4e38, 1e308, -1e308,
              float("nan"), float("inf"), float("-inf"), 5e-324]
    strings = ["", " ", "\x00", "\ud800", "😀" * 100, "a" * 5000, "a" * 250_000, "\u202e\u0000x", "<|im_start|>",
               "<|audio_pad|>" * 50, "../../etc/passwd", "%s%n", "ethan\x00"]
    def pick(values: list):          # sampled_from without the values in hypothesis' reprs (some are huge)
        return st.integers(0, len(values) - 1).map(values.__getitem__)

    proto_strings = [x for x in strings if x != "\ud800"]    # protobuf strings are valid UTF-8
    scalar = st.one_of(st.sampled_from(big_ints), st.sampled_from(floats), pick(strings),
                       st.integers(), st.floats(), st.text(max_size=40), st.booleans(), st.none())
    json_any = st.recursive(scalar, lambda ch: st.lists(ch, max_size=4) | st.dictionaries(st.text(max_size=8), ch,
                                                                                            max_size=4), max_leaves=12)
    hostile = st.one_of(scalar, json_any, st.just([]), st.just({}), st.just([[[[[]]]]]))
    # lengths: small enough to run, or certainly refused (beyond the contexts), or not integers at all
    # (`beyond`: past both the thinker's and the talker's context -- a length under it is served, and
    # thousands of tokens are minutes of work on a CPU, not a case)
    beyond = 1 + max(omni.thinker.text.max_position_embeddings or 32768,
                     omni.talker.text.max_position_embeddings or 32768)
    small = st.integers(1, 8)
    cap = st.one_of(small, small, st.sampled_from([0, -1, 2**32 - 1, 2**32, 2**63, 10**30]),
                    st.integers(max_value=0), st.integers(min_value=beyond), st.sampled_from(floats),
                    pick(strings[:6]), st.booleans(), st.just([]), st.just({}))
    speakers = sorted(omni.talker.speakers)
    voice = st.one_of(st.sampled_from(speakers), st.sampled_from([s.upper() for s in speakers]),
                      st.builds(lambda v: {"id": v}, st.sampled_from(speakers)), hostile)
    temperature = st.one_of(st.floats(0, 2), st.sampled_from(floats), hostile)

    # --------------------------------------------------------------- audio inputs
    def wav_bytes(rate: int, samples: np.ndarray, width: int = 2, channels: int = 1) -> bytes:
        buf = io.BytesIO()
        with wave.open(buf, "wb") as w:
            w.setnchannels(channels)
            w.setsampwidth(width)
            w.setframerate(rate)
            w.writeframes(samples.tobytes())
        return buf.getvalue()

    def lying_header(raw: bytes, rate: int) -> bytes:     # a wav whose header claims another rate
        b = bytearray(raw)
        b[24:28] = rate.to_bytes(4, "little")
        return bytes(b)

    good_wav = wav_bytes(16000, (np.sin(np.arange(8000) / 9) * 8000).astype("<i2"))
    wavs = st.one_of(
        st.just(good_wav),
        st.builds(lambda r, n: wav_bytes(r, np.zeros(n, "<i2")), st.sampled_from([8000, 22050, 44100, 48000]),
                  st.integers(1, 16000)),
        st.builds(lying_header, st.just(good_wav), st.sampled_from([0, 1, 999, 384001, 2**31 - 1, 2**32 - 1])),
        st.binary(max_size=600),
        st.builds(lambda b: b"RIFF" + b, st.binary(max_size=200)),
        st.just(good_wav[:40]), st.just(good_wav[:44]),
    )
    b64 = st.one_of(wavs.map(lambda b: base64.b64encode(b).decode()), st.text(max_size=50),
                    st.sampled_from(["", "===", "AAAA", "not base64!", "QQ"]))

    # --------------------------------------------------------------- HTTP chat
    text_content = st.one_of(st.text(max_size=200), pick(strings), hostile)
    part = st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": text_content}),
        st.fixed_dictionaries({"type": st.just("input_audio"), "input_audio": st.one_of(
            st.fixed_dictionaries({"data": b64, "format": st.one_of(st.sampled_from(["wav", "mp3", "flac", "ogg",
                                                                                        "pcm", ""]), hostile)}),
            hostile)}),
        st.fixed_dictionaries({"type": st.one_of(st.sampled_from(["image_url", "input_image", "file", "video_url",
                                                                  "refusal", ""]), hostile),
                               "text": text_content}),
        hostile)
    message = st.one_of(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer"]),
                               "content": st.one_of(text_content, st.lists(part, max_size=3))}),
        st.fixed_dictionaries({"role": st.just("assistant"), "content": text_content},
                              optional={"audio": st.one_of(st.fixed_dictionaries({"id": st.text(max_size=20)}),
                                                           hostile)}),
        st.fixed_dictionaries({"role": hostile, "content": text_content}),
        st.fixed_dictionaries({"role": st.just("tool"), "content": text_content, "tool_call_id": hostile}),
        hostile)
    messages = st.one_of(st.lists(message, min_size=1, max_size=4),
                         st.just([{"role": "user", "content": "Hello!"}]), st.just([]), hostile)
    KEEP = object()

    def body(base: dict, fuzz: dict) -> Any:
        def build(drawn: dict) -> dict:
            out = dict(base)
            for k, v in drawn.items():
                if v is KEEP:
                    continue
                if isinstance(v, tuple) and v == ("<drop>",):
                    out.pop(k, None)
                else:
                    out[k] = v
            return out
        return st.fixed_dictionaries({k: st.one_of(st.just(KEEP), st.just(KEEP), s) for k, s in fuzz.items()}).map(build)

    drop = st.just(("<drop>",))
    chat_base = {"model": model_id, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4,
                 "max_audio_frames": 4, "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"},
                 "temperature": 0.0}
    chat = body(chat_base, {
        "model": st.one_of(drop, st.just(model_id + "x"), hostile), "messages": st.one_of(drop, messages),
        "max_tokens": cap, "max_completion_tokens": cap, "max_audio_frames": cap,
        "min_tokens": st.one_of(st.integers(0, 8), cap),
        "modalities": st.one_of(drop, st.sampled_from([["text"], ["audio"], ["text", "audio"], ["audio", "audio"],
                                                       ["video"], []]), hostile),
        "audio": st.one_of(drop, st.fixed_dictionaries({"voice": voice, "format": st.one_of(
            st.sampled_from(["wav", "pcm16", "mp3", "flac", "opus", "aac", "pcm"]), hostile)}), hostile),
        "temperature": st.one_of(drop, temperature), "top_p": st.one_of(st.floats(0, 1), hostile),
        "top_k": st.one_of(st.integers(-2, 100), hostile), "seed": st.one_of(st.integers(-2**63, 2**64 - 1), hostile),
        "n": st.one_of(st.just(1), hostile), "stream": st.one_of(st.booleans(), hostile),
        "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), hostile),
        "ignore_eos": st.one_of(st.booleans(), hostile), "stop": hostile, "user": hostile, "tools": hostile,
        "response_format": hostile, "logprobs": hostile, "frequency_penalty": hostile, "presence_penalty": hostile,
    })

    # --------------------------------------------------------------- HTTP speech
    speech_base = {"model": model_id, "input": "Hello there.", "voice": "ethan", "response_format": "wav",
                   "max_audio_frames": 4, "temperature": 0.0}
    speech = body(speech_base, {
        "model": st.one_of(drop, hostile), "input": st.one_of(drop, text_content),
        "voice": st.one_of(drop, voice),
        "response_format": st.one_of(drop, st.sampled_from(["mp3", "opus", "aac", "flac", "wav", "pcm", "ogg"]),
                                     hostile),
        "stream_format": st.one_of(st.sampled_from(["audio", "sse"]), hostile),
        "speed": st.one_of(st.just(1.0), st.sampled_from(floats), hostile), "instructions": text_content,
        "max_tokens": cap, "max_audio_frames": cap, "temperature": temperature,
        "top_k": st.one_of(st.integers(-2, 100), hostile), "seed": st.one_of(st.integers(-2**63, 2**64 - 1), hostile),
        "ignore_eos": st.one_of(st.booleans(), hostile),
    })

    def http_raw(path_body):
        return st.one_of(
            path_body.map(lambda b: json.dumps(b, allow_nan=True).encode()),
            path_body.map(lambda b: json.dumps(b, ensure_ascii=False, allow_nan=True).encode("utf-8", "surrogatepass")),
            st.binary(max_size=300),
            pick([b"", b"{", b"[]", b"null", b"1e999999", b'{"model": NaN}', b"[" * 100_000,
                  b'{"a":' * 50_000, b"\xff\xfe{}", json.dumps({"messages": [[[]]] * 1000}).encode()]),
        )

    # --------------------------------------------------------------- realtime
    pcm = st.one_of(st.binary(max_size=4000).map(lambda b: base64.b64encode(b).decode()),
                    st.builds(lambda n: base64.b64encode(np.zeros(n, "<i2").tobytes()).decode(), st.integers(0, 48000)),
                    st.sampled_from(["", "===", "not base64", "QQ", "AAA"]), hostile)
    rt_item = st.one_of(
        st.fixed_dictionaries({"type": st.just("message"), "role": st.sampled_from(["user", "system", "assistant"]),
                               "content": st.lists(st.one_of(
                                   st.fixed_dictionaries({"type": st.sampled_from(["input_text", "text",
                                                                                   "output_text"]),
                                                          "text": text_content}),
                                   st.fixed_dictionaries({"type": st.just("input_audio"), "audio": pcm}),
                                   st.fixed_dictionaries({"type": st.sampled_from(["output_audio", "audio"]),
                                                          "transcript": text_content}),
                                   hostile), max_size=3)},
                              optional={"id": st.one_of(st.text(max_size=70), hostile)}),
        hostile)
    session = st.fixed_dictionaries({}, optional={
        "type": st.one_of(st.just("realtime"), hostile), "instructions": text_content,
        "voice": voice, "output_modalities": st.one_of(st.sampled_from([["audio"], ["text"], ["text", "audio"], []]),
                                                       hostile),
        "modalities": hostile, "max_output_tokens": cap, "max_response_output_tokens": st.one_of(cap, st.just("inf")),
        "max_audio_frames": cap, "temperature": temperature, "ignore_eos": st.one_of(st.booleans(), hostile),
        "turn_detection": st.one_of(st.none(), st.fixed_dictionaries({}, optional={
            "type": st.one_of(st.just("server_vad"), hostile), "threshold": st.one_of(st.floats(0, 1), hostile),
            "prefix_padding_ms": st.one_of(st.integers(-10, 20000), hostile),
            "silence_duration_ms": st.one_of(st.integers(-10, 20000), hostile),
            "create_response": st.one_of(st.booleans(), hostile)}), hostile),
        "audio": st.one_of(st.fixed_dictionaries({}, optional={"input": hostile, "output": hostile}), hostile),
        "input_audio_format": st.one_of(st.just("pcm16"), hostile), "tools": hostile,
    })
    response = st.fixed_dictionaries({}, optional={
        "instructions": text_content, "voice": voice, "conversation": st.one_of(st.sampled_from(["auto", "none"]),
                                                                               hostile),
        "output_modalities": st.one_of(st.sampled_from([["audio"], ["text"]]), hostile),
        "max_output_tokens": st.one_of(cap, st.just("inf")), "max_audio_frames": cap, "temperature": temperature,
        "metadata": st.one_of(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3), hostile),
        "input": hostile, "tools": hostile, "ignore_eos": st.one_of(st.booleans(), hostile)})
    event_id = st.one_of(st.text(max_size=20), hostile)
    events = st.one_of(
        st.fixed_dictionaries({"type": st.just("session.update"), "session": st.one_of(session, hostile)},
                              optional={"event_id": event_id}),
        st.fixed_dictionaries({"type": st.just("input_audio_buffer.append"), "audio": pcm}),
        st.fixed_dictionaries({"type": st.sampled_from(["input_audio_buffer.commit", "input_audio_buffer.clear"])},
                              optional={"event_id": event_id}),
        st.fixed_dictionaries({"type": st.just("conversation.item.create"), "item": rt_item},
                              optional={"previous_item_id": hostile}),
        st.fixed_dictionaries({"type": st.just("conversation.item.truncate"), "item_id": hostile,
                               "content_index": hostile, "audio_end_ms": st.one_of(st.integers(), hostile)}),
        st.fixed_dictionaries({"type": st.sampled_from(["conversation.item.delete", "conversation.item.retrieve"]),
                               "item_id": hostile}),
        st.fixed_dictionaries({"type": st.just("response.create")}, optional={"response": st.one_of(response, hostile)}),
        st.fixed_dictionaries({"type": st.just("response.cancel")}, optional={"response_id": hostile}),
        st.fixed_dictionaries({"type": hostile}, optional={"event_id": event_id}),
        json_any,
    )
    realtime_frames = st.one_of(
        events.map(lambda e: json.dumps(e, allow_nan=True)),
        events.map(lambda e: json.dumps(e, allow_nan=True)),
        st.text(max_size=100), st.binary(max_size=100),
        pick(["", "{", "null", "[" * 100_000, '{"type":' * 50_000, "1e999999", '"response.create"']),
    )

    # --------------------------------------------------------------- protobuf pieces
    from voxpipe.services.runtime.tensors import to_proto
    import torch

    hidden = omni.thinker.text.hidden_size
    vocab = omni.thinker.text.vocab_size
    mel = omni.thinker.audio.num_mel_bins
    groups, codebook = omni.talker.num_code_groups, omni.code2wav.codebook_size
    f32s = st.sampled_from([0.0, 1.0, -1.0, 1e-40, 1e5, 1e6, 3e38, float("nan"), float("inf"), float("-inf")])
    u32 = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 2**31, 2**32 - 1]))
    i32 = st.one_of(st.integers(-2**31, 2**31 - 1), st.sampled_from([-1, 0, 2**31 - 1, -2**31]))
    pcap = st.one_of(st.integers(1, 8), st.integers(1, 8), st.integers(beyond, 2**32 - 1))   # 0 = 4096 frames

    def sampling():
        return st.one_of(st.none(), st.builds(
            lambda t, k, p, s, r: pb.Sampling(**{n: v for n, v in (("temperature", t), ("top_k", k), ("top_p", p),
                                                                     ("seed", s), ("repetition_penalty", r))
                                                if v is not None}),
            st.one_of(st.none(), st.floats(0, 2, width=32), f32s), st.one_of(st.none(), i32),
            st.one_of(st.none(), st.floats(0, 1, width=32), f32s), st.one_of(st.none(), st.integers(0, 2**64 - 1)),
            st.one_of(st.none(), st.floats(0.5, 2, width=32), f32s)))

    def tensor_like(make_base: Callable[[], pb.Tensor]):
        def mutate(kind: int, dtype: int, shape: list, data: bytes, fill: float) -> pb.Tensor:
            t = make_base()
            if kind == 1:
                t.dtype = dtype
            elif kind == 2:
                del t.shape[:]
                t.shape.extend(shape)
            elif kind == 3:
                t.data = data
            elif kind == 4:
                n = len(t.data) // 4 if t.dtype == pb.FLOAT32 else 0
                if n:
                    t.data = np.full(n, fill, "<f4").tobytes()
            elif kind == 5:
                t = pb.Tensor()
            return t
        return st.builds(mutate, st.integers(0, 5), st.integers(-3, 12),
                         st.lists(st.one_of(st.integers(-2**63, 2**63 - 1), st.integers(-2, 100)), max_size=4),
                         st.binary(max_size=1024), f32s)

    g = torch.Generator().manual_seed(0)
    base_rows = {n: to_proto(torch.randn(n, hidden, generator=g)) for n in (1, 2, 3, 5)}

    def copy(t: pb.Tensor) -> Callable[[], pb.Tensor]:
        def make() -> pb.Tensor:
            out = pb.Tensor()
            out.CopyFrom(t)
            return out
        return make

    prompt_ids = [omni.thinker.tokens.im_start, omni.thinker.tokens.user, 198, 199, 200,
                  omni.thinker.tokens.im_end, omni.thinker.tokens.im_start, omni.thinker.tokens.assistant, 198]
    token_ids = st.one_of(st.just(prompt_ids), st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40),
                          st.lists(u32, max_size=10), st.just([]))
    feats = tensor_like(copy(to_proto(torch.randn(mel, 20, generator=g))))
    code2wav_params = st.one_of(st.none(), st.builds(
        lambda e, f, c, echo: pb.Code2WavParams(encoding=e, first_chunk_frames=f, chunk_frames=c, echo_frames=echo),
        st.integers(-1, 4), u32, u32, st.booleans()))

    def thinker_start(ids, text, use_text, features, samp, mx, mn, rows, speech_on, speaker, tsamp, mf, mnf, c2w):
        s = pb.ThinkerStart(request_id="rel", max_tokens=mx, min_tokens=mn, talker_rows=rows)
        if use_text:
            s.text = text
        else:
            s.token_ids.ids.extend(ids)
        s.audio_features.extend(features)
        if samp is not None:
            s.sampling.CopyFrom(samp)
        if speech_on:
            sp = pb.SpeechParams(speaker=speaker, max_frames=mf, min_frames=mnf)
            if tsamp is not None:
                sp.sampling.CopyFrom(tsamp)
            if c2w is not None:
                sp.code2wav.CopyFrom(c2w)
            s.speech.CopyFrom(sp)
        return pb.ThinkerRequest(start=s)

    speaker_text = st.one_of(st.sampled_from(speakers), st.text(max_size=10), pick(proto_strings[:6]))
    t_start = st.builds(thinker_start, token_ids, st.text(max_size=100), st.booleans(), st.lists(feats, max_size=2),
                        sampling(), pcap, st.one_of(st.integers(0, 8), u32), st.booleans(), st.booleans(),
                        speaker_text, sampling(), pcap, st.one_of(st.integers(0, 8), u32), code2wav_params)
    t_follow = st.lists(st.one_of(st.builds(lambda d: pb.ThinkerRequest(chunk=pb.PayloadChunk(data=d)),
                                            st.binary(max_size=64)),
                                  st.just(pb.ThinkerRequest(cancel=pb.Cancel())), t_start), max_size=2)
    thinker_msgs = st.one_of(st.builds(lambda a, b: [a, *b], t_start, t_follow), st.just([]), t_follow)

    prompt_fields = {"user_rows": (tensor_like(copy(base_rows[5]))),
                     "user_mm_mask": tensor_like(copy(to_proto(torch.zeros(5, dtype=torch.bool)))),
                     "user_token_ids": tensor_like(copy(to_proto(torch.arange(5, dtype=torch.int64)))),
                     "assistant_head": tensor_like(copy(base_rows[3])),
                     "assistant_prefix": tensor_like(copy(to_proto(torch.zeros(0, hidden)))),
                     "tts_special": tensor_like(copy(base_rows[3]))}

    def talker_start(fields, drop_prompt, speaker, samp, mf, mnf, c2w):
        start = pb.TalkerStart(request_id="rel", speaker=speaker, max_frames=mf, min_frames=mnf)
        if not drop_prompt:
            start.prompt.CopyFrom(pb.TalkerPrompt(**fields))
        if samp is not None:
            start.sampling.CopyFrom(samp)
        if c2w is not None:
            start.code2wav.CopyFrom(c2w)
        return pb.TalkerRequest(start=start)

    tk_start = st.builds(talker_start, st.fixed_dictionaries(prompt_fields), st.integers(0, 9).map(lambda n: n == 0),
                         speaker_text, sampling(), pcap, st.one_of(st.integers(0, 8), u32), code2wav_params)
    tk_rows = st.builds(lambda t, ids: pb.TalkerRequest(rows=pb.TextRows(rows=t, token_ids=ids)),
                        tensor_like(copy(base_rows[2])), st.one_of(st.just([]), st.lists(u32, max_size=3)))
    tk_other = st.sampled_from([pb.TalkerRequest(text_end=pb.TextEnd()), pb.TalkerRequest(cancel=pb.Cancel()),
                                pb.TalkerRequest(chunk=pb.PayloadChunk(data=b"\x00" * 16))])
    talker_msgs = st.one_of(
        st.builds(lambda s, r, end: [s, *r, *end], tk_start, st.lists(tk_rows, max_size=3),
                  st.sampled_from([[pb.TalkerRequest(text_end=pb.TextEnd())]] * 3 + [[]])),
        st.lists(st.one_of(tk_start, tk_rows, tk_other), max_size=4))

    codes = tensor_like(copy(to_proto(torch.randint(0, codebook, (3, groups), generator=g).to(torch.uint16))))
    c_start = st.builds(lambda e, f, c, lis, echo: pb.Code2WavRequest(start=pb.Code2WavStart(
        request_id="rel", encoding=e, first_chunk_frames=f, chunk_frames=c, to_listener=lis, echo_frames=echo)),
        st.integers(-1, 4), st.one_of(st.integers(0, 8), u32), st.one_of(st.integers(0, 8), u32),
        st.booleans(), st.booleans())
    c_frames = st.builds(lambda t, i: pb.Code2WavRequest(frames=pb.CodecFrames(codes=t, index=i)), codes, u32)
    c_other = st.sampled_from([pb.Code2WavRequest(frames_end=pb.FramesEnd()), pb.Code2WavRequest(cancel=pb.Cancel())])
    code2wav_msgs = st.one_of(
        st.builds(lambda s, f, end: [s, *f, *end], c_start, st.lists(c_frames, max_size=3),
                  st.sampled_from([[pb.Code2WavRequest(frames_end=pb.FramesEnd())]] * 3 + [[]])),
        st.lists(st.one_of(c_start, c_frames, c_other), max_size=4))

    def raw_or(msgs):
        """Serialized messages, or garbage bytes in their place (sent with an identity serializer)."""
        return st.one_of(msgs.map(lambda ms: [m.SerializeToString() for m in ms]),
                         msgs.map(lambda ms: [m.SerializeToString() for m in ms]),
                         msgs.map(lambda ms: [m.SerializeToString() for m in ms]),
                         st.lists(st.binary(max_size=200), min_size=1, max_size=3),
                         st.lists(st.sampled_from([b"\x0a\xff\xff\xff\xff\x0f", b"\x08\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01",
                                                   b"\xff" * 32, b"\x12\x00", b"\x0a\x05abc"]), min_size=1, max_size=2))

    # --------------------------------------------------------------- Converse
    pcm_in = st.builds(lambda d, r: gw.AudioInput(pcm16=gw.Pcm16Audio(data=d, sample_rate=r)),
                       st.one_of(st.binary(max_size=4000), st.builds(lambda n: np.zeros(n, "<i2").tobytes(),
                                                                     st.integers(0, 32000))),
                       st.one_of(st.sampled_from([16000, 24000, 8000, 0, 1, 999, 384001, 2**32 - 1]), u32))
    wav_in = wavs.map(lambda b: gw.AudioInput(wav=b))
    conv_start = st.builds(
        lambda rid, ins, audio, text, v, mods, samp, mx, mn, mf, mnf, eos, enc: gw.ConverseRequest(start=gw.ConverseStart(
            request_id=rid, instructions=ins, audio=audio, text=text, voice=v, output_modalities=mods,
            max_tokens=mx, min_tokens=mn, max_frames=mf, min_frames=mnf, ignore_eos=eos, audio_encoding=enc,
            **({"sampling": samp} if samp is not None else {}))),
        st.one_of(st.just(""), st.text(max_size=80)), st.one_of(st.just(""), st.text(max_size=100),
                                                                pick(proto_strings)),
        st.lists(st.one_of(pcm_in, wav_in), max_size=2), st.one_of(st.text(max_size=200), pick(proto_strings)),
        st.one_of(st.just(""), speaker_text), st.lists(st.integers(-1, 5), max_size=3), sampling(),
        st.one_of(st.integers(1, 8), st.integers(1, 8), st.integers(beyond, 2**32 - 1)), st.one_of(st.integers(0, 8), u32),
        st.one_of(st.integers(1, 8), st.integers(1, 8), st.integers(beyond, 2**32 - 1)), st.one_of(st.integers(0, 8), u32),
        st.booleans(), st.integers(-1, 4))
    conv_msgs = st.one_of(
        st.builds(lambda s, rest: [s, *rest], conv_start,
                  st.lists(st.one_of(st.just(gw.ConverseRequest(cancel=pb.Cancel())), conv_start), max_size=1)),
        st.lists(st.just(gw.ConverseRequest(cancel=pb.Cancel())), max_size=2))

    return {"http_chat": http_raw(chat), "http_speech": http_raw(speech), "realtime": realtime_frames,
            "converse": raw_or(conv_msgs), "stage_thinker": raw_or(thinker_msgs), "stage_talker": raw_or(talker_msgs),
            "stage_code2wav": raw_or(code2wav_msgs)}


# ============================================================================== executors (one call per case)


class HttpFuzz:
    def __init__(self, dep: Deployment, path: str, tally: Tally, hang_s: float) -> None:
        import httpx

        self.httpx, self.path, self.tally, self.hang_s = httpx, path, tally, hang_s
        self.client = httpx.Client(base_url=dep.base_url, timeout=httpx.Timeout(hang_s, connect=10))

    def __call__(self, raw: bytes) -> None:
        headers = {**auth_headers(), "Content-Type": "application/json"}
        t0 = time.monotonic()
        try:
            with self.client.stream("POST", self.path, content=raw, headers=headers) as r:
                data = r.read()
        except self.httpx.TimeoutException:
            self.tally.add("hang", "timeout", raw)
            return
        except self.httpx.HTTPError as e:     # a body cut short, a reset connection
            self.tally.add("5xx", type(e).__name__, raw, str(e))
            return
        cls, detail = http_class(r.status_code), str(r.status_code)
        if cls == "2xx" and b'"server_error"' in data:
            cls, detail = "5xx", f"{r.status_code}+server_error event"
        if time.monotonic() - t0 > self.hang_s:
            cls, detail = "hang", f"{r.status_code} after {time.monotonic() - t0:.0f} s"
        self.tally.add(cls, detail, raw, data[:400].decode("utf-8", "replace"))

    def close(self) -> None:
        self.client.close()


REALTIME_BASELINE = {"type": "realtime", "voice": "ethan", "turn_detection": None, "max_output_tokens": 4,
                     "max_audio_frames": 4, "output_modalities": ["audio"], "instructions": ""}


class RealtimeFuzz:
    """One case: the fuzzed frame, a session.update back to the capped baseline, then a probe
    (conversation.item.retrieve of a missing item) whose `error` reply marks the end of the case's
    answers; a response the case started is read to its response.done."""

    PER_CONNECTION = 25

    def __init__(self, dep: Deployment, tally: Tally, hang_s: float) -> None:
        self.url = f"ws://{HOST}:{dep.http_port}/v1/realtime"
        self.tally, self.hang_s = tally, hang_s
        self.ws = None
        self.used = self.i = 0
        self.connections = 0

    def _recv(self, deadline: float) -> dict:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        return json.loads(self.ws.recv(timeout=remaining))

    def _open(self) -> None:
        from websockets.sync.client import connect

        self.close()
        self.ws = connect(self.url, additional_headers=auth_headers(), max_size=None, open_timeout=30,
                          close_timeout=5)
        self.connections += 1
        self.used = 0
        deadline = time.monotonic() + self.hang_s
        while self._recv(deadline).get("type") != "session.created":
            pass
        self.ws.send(json.dumps({"type": "session.update", "session": REALTIME_BASELINE}))
        while self._recv(deadline).get("type") != "session.updated":
            pass

    def close(self) -> None:
        if self.ws is not None:
            try:
                self.ws.close()
            except Exception:
                pass
            self.ws = None

    def __call__(self, frame: str | bytes) -> None:
        from websockets.exceptions import ConnectionClosed

        if self.ws is None or self.used >= self.PER_CONNECTION:
            self._open()
        self.used += 1
        self.i += 1
        probe, restore = f"probe-{self.i}", f"restore-{self.i}"
        errors, open_responses, seen_probe = [], set(), False
        deadline = time.monotonic() + self.hang_s
        try:
            self.ws.send(frame)
            self.ws.send(json.dumps({"type": "session.update", "event_id": restore, "session": REALTIME_BASELINE}))
            self.ws.send(json.dumps({"type": "conversation.item.retrieve", "item_id": "rel-missing-item",
                                     "event_id": probe}))
            while not seen_probe or open_responses:
                e = self._recv(deadline)
                kind = e.get("type")
                if kind == "error":
                    err = e.get("error") or {}
                    if err.get("event_id") == probe:
                        seen_probe = True
                    else:
                        errors.append(err)
                elif kind == "response.created":
                    open_responses.add(e["response"]["id"])
                elif kind == "response.done":
                    r = e["response"]
                    open_responses.discard(r["id"])
                    if r.get("status") == "failed":
                        errors.append(((r.get("status_details") or {}).get("error")) or {"type": "server_error"})
        except TimeoutError:
            self.tally.add("hang", "no answer", frame, f"open responses {len(open_responses)}, probe {seen_probe}")
            self.close()
            return
        except ConnectionClosed as e:
            code = e.rcvd.code if e.rcvd else None
            self.tally.add("5xx", f"socket closed ({code})", frame, str(e))
            self.close()
            return
        server = [x for x in errors if x.get("type") == "server_error"]
        if server:
            self.tally.add("5xx", "server_error", frame, json.dumps(server[0]))
        elif errors:
            self.tally.add("4xx", f"error:{errors[0].get('code')}", frame)
        else:
            self.tally.add("2xx", "ok", frame)


def _listen(address: str, token: str, hang_s: float, out: list) -> None:
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        try:
            for _ in pb_grpc.Code2WavStub(ch).Listen(pb.ListenRequest(listen_token=token), timeout=hang_s):
                pass
            out.append(grpc.StatusCode.OK)
        except grpc.RpcError as e:
            out.append(e.code())


class GrpcFuzz:
    """A bidirectional stream of raw (possibly garbage) request bytes; when the answer hands out a
    code2wav listen token (to_listener / speech), the case also attaches Code2Wav.Listen, as a caller would."""

    def __init__(self, address: str, method: str, response_cls, tally: Tally, hang_s: float,
                 code2wav: str, metadata: tuple = ()) -> None:
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.call = self.channel.stream_stream(method, request_serializer=None, response_deserializer=None)
        self.response_cls, self.tally, self.hang_s = response_cls, tally, hang_s
        self.code2wav, self.metadata = code2wav, metadata

    def _token(self, raw: bytes) -> str | None:
        r = self.response_cls.FromString(raw)
        kind = r.WhichOneof("kind")
        if kind == "accepted":
            return r.accepted.listen_token
        if kind == "routed" and r.routed.listen_token:
            return r.routed.listen_token
        return None

    def __call__(self, msgs: list[bytes]) -> None:
        listens: list[threading.Thread] = []
        listened: list = []
        details = ""
        try:
            for raw in self.call(iter(msgs), timeout=self.hang_s, metadata=self.metadata):
                token = self._token(raw)
                if token:
                    t = threading.Thread(target=_listen, args=(self.code2wav, token, self.hang_s, listened))
                    t.start()
                    listens.append(t)
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
        for t in listens:
            t.join(self.hang_s + 5)
        cls, detail = grpc_class(code), code.name
        for c in listened:
            if grpc_class(c) in ("5xx", "hang") and cls not in ("5xx", "hang"):
                cls, detail = grpc_class(c), f"{code.name}, listen {c.name}"
        self.tally.add(cls, detail, msgs, details)

    def close(self) -> None:
        self.channel.close()


# ============================================================================== seeded known-good requests


def known_good(dep: Deployment, tokenizer_ids: list[int]) -> dict[str, str]:
    """A sha256 per API of a seeded sampled request's output (text and audio bytes)."""
    import httpx

    out = {}
    with httpx.Client(base_url=dep.base_url, timeout=120, headers=auth_headers()) as c:
        r = c.post("/v1/chat/completions", json={
            "model": dep.model_dir.name, "messages": [{"role": "user", "content": "Tell me about the sea."}],
            "modalities": ["text", "audio"], "audio": {"voice": "chelsie", "format": "wav"}, "temperature": 0.9,
            "seed": 1234, "max_tokens": 12, "max_audio_frames": 12})
        r.raise_for_status()
        msg = r.json()["choices"][0]["message"]
        out["http_chat"] = hashlib.sha256(((msg.get("content") or "") + msg["audio"]["transcript"]).encode()
                                          + base64.b64decode(msg["audio"]["data"])).hexdigest()
        r = c.post("/v1/audio/speech", json={"model": dep.model_dir.name, "input": "One two three.", "voice": "aiden",
                                              "response_format": "pcm", "temperature": 0.9, "seed": 99,
                                              "max_audio_frames": 10})
        r.raise_for_status()
        out["http_speech"] = hashlib.sha256(r.content).hexdigest()
    with grpc.insecure_channel(dep.converse_address) as ch:
        h = hashlib.sha256()
        for resp in gw_grpc.GatewayStub(ch).Converse(iter([gw.ConverseRequest(start=gw.ConverseStart(
                text="Good morning!", voice="ethan", sampling=pb.Sampling(temperature=0.9, seed=7), max_tokens=10,
                max_frames=10))]), timeout=120, metadata=AUTH_METADATA):
            kind = resp.WhichOneof("kind")
            if kind == "text":
                h.update(resp.text.text.encode())
            elif kind == "audio":
                h.update(resp.audio.data)
        out["converse"] = h.hexdigest()
    with grpc.insecure_channel(dep.address("thinker")) as ch:
        ids = []
        for resp in pb_grpc.ThinkerStub(ch).Generate(iter([pb.ThinkerRequest(start=pb.ThinkerStart(
                token_ids=pb.TokenIds(ids=tokenizer_ids), max_tokens=20,
                sampling=pb.Sampling(temperature=0.9, seed=5)))]), timeout=120):
            if resp.WhichOneof("kind") == "text":
                ids += list(resp.text.token_ids)
        out["stage_thinker"] = hashlib.sha256(json.dumps(ids).encode()).hexdigest()
    return out


# ============================================================================== client disconnects

# When a client cuts its request (outputs read before the cut): anywhere in the first 30, before any
# output (an HTTP request whose socket closes once sent, a Converse call cancelled as it starts, a
# realtime socket closed after response.create), after the first, after the end (the whole reply read,
# then the cut: for Converse, Cancel after `done` and then the call cancelled, the timing that leaked
# a session slot in issue #25).
TIMINGS = ("random", "at_once", "first", "after_end")
AT_ONCE, AFTER_END = -1, 10**9


def _send_and_close(port: int, path: str, body: dict) -> None:
    """A whole HTTP request on a raw socket, closed as soon as it is sent."""
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode()
    with socket.create_connection((HOST, port), timeout=10) as sock:
        sock.sendall(head + data)


def disconnects(dep: Deployment, n: int, seed: int) -> dict:
    """`n` requests, each cut by its client (TIMINGS, in turn): HTTP SSE chat, pcm speech, Converse
    (a Cancel message, or the call dropped), a realtime socket closed, a pipeline client (stage gRPC)
    iteration abandoned."""
    import asyncio

    import httpx
    from websockets.sync.client import connect

    from voxpipe.client import PipelineClient, SpeechRequest

    rng = random.Random(seed)
    kinds = ["http_chat_sse", "http_speech_pcm", "converse_cancel", "converse_drop", "realtime_close", "pipeline"]
    done: Counter = Counter()
    errors: list = []
    model = dep.model_dir.name
    ids = PROMPT_IDS
    with httpx.Client(base_url=dep.base_url, timeout=60, headers=auth_headers()) as http:
        for i in range(n):
            kind = kinds[i % len(kinds)]
            timing = TIMINGS[(i // len(kinds)) % len(TIMINGS)]
            cut = {"random": rng.randint(0, 30), "at_once": AT_ONCE, "first": 1, "after_end": AFTER_END}[timing]
            try:
                if kind in ("http_chat_sse", "http_speech_pcm"):
                    path, body = ("/v1/chat/completions", {
                        "model": model, "messages": [{"role": "user", "content": f"Story {i}"}], "stream": True,
                        "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"},
                        "max_tokens": 30, "max_audio_frames": 30, "ignore_eos": True}) if kind == "http_chat_sse" else (
                        "/v1/audio/speech", {"model": model, "input": f"Count {i}", "voice": "aiden",
                                             "response_format": "pcm", "max_audio_frames": 30, "ignore_eos": True})
                    if cut == AT_ONCE:
                        _send_and_close(dep.http_port, path, body)
                    else:
                        with http.stream("POST", path, json=body) as r:
                            pieces = r.iter_lines() if kind == "http_chat_sse" else r.iter_bytes(1920)
                            for k, _ in enumerate(pieces):
                                if k >= cut:
                                    break
                elif kind.startswith("converse"):
                    import queue

                    q: queue.Queue = queue.Queue()
                    q.put(gw.ConverseRequest(start=gw.ConverseStart(text=f"Hi {i}", max_tokens=30, max_frames=30,
                                                                    ignore_eos=True)))
                    with grpc.insecure_channel(dep.converse_address) as ch:
                        call = gw_grpc.GatewayStub(ch).Converse(iter(q.get, None), timeout=60, metadata=AUTH_METADATA)
                        try:
                            if cut == AT_ONCE:
                                if kind == "converse_cancel":
                                    q.put(gw.ConverseRequest(cancel=pb.Cancel()))
                                call.cancel()
                            for k, resp in enumerate(call):
                                if k >= cut or resp.WhichOneof("kind") == "done":
                                    if kind == "converse_cancel":   # Cancel, read to `done`, then drop the call
                                        q.put(gw.ConverseRequest(cancel=pb.Cancel()))
                                        for resp in call:
                                            if resp.WhichOneof("kind") == "done":
                                                break
                                    call.cancel()
                                    break
                        except grpc.RpcError as e:
                            if e.code() != grpc.StatusCode.CANCELLED:
                                raise
                        q.put(None)
                elif kind == "realtime_close":
                    with connect(f"ws://{HOST}:{dep.http_port}/v1/realtime", additional_headers=auth_headers(),
                                 open_timeout=30) as ws:
                        ws.send(json.dumps({"type": "session.update", "session": {**REALTIME_BASELINE,
                                                                                  "max_output_tokens": 30,
                                                                                  "max_audio_frames": 30}}))
                        ws.send(json.dumps({"type": "conversation.item.create", "item": {
                            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}}))
                        ws.send(json.dumps({"type": "response.create"}))
                        for k in range(-3, cut):        # session.created / updated / item, then the response
                            if json.loads(ws.recv(timeout=60)).get("type") == "response.done":
                                break
                else:
                    async def go():
                        async with PipelineClient(dep.address("thinker"), dep.address("code2wav")) as client:
                            k = 0
                            async for ev in client.stream(SpeechRequest(token_ids=ids, max_tokens=30, min_tokens=30,
                                                                        max_frames=30, min_frames=30)):
                                k += 1
                                if k > cut or type(ev).__name__ == "DoneEvent":
                                    break
                    asyncio.run(go())
                done[f"{kind}/{timing}"] += 1
            except Exception as e:          # the client's own view; the gauges are the check
                errors.append(f"{kind}/{timing}: {type(e).__name__}: {str(e)[:200]}")
    by_kind = Counter(k.split("/")[0] for k in done.elements())
    by_timing = Counter(k.split("/")[1] for k in done.elements())
    return {"requests": n, "by_kind": dict(by_kind), "by_timing": dict(by_timing), "client_errors": errors[:10],
            "client_error_count": len(errors)}


# ============================================================================== soak


def soak(dep: Deployment, n: int, concurrency: int) -> dict:
    import httpx

    model = dep.model_dir.name
    names = [s for s in dep.services if dep.services[s].alive]
    before = {s: round(dep.services[s].rss_mb(), 1) for s in names}
    peak = dict(before)
    outcomes: Counter = Counter()
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.5):
            for s in names:
                peak[s] = max(peak[s], round(dep.services[s].rss_mb(), 1))

    def one(i: int) -> str:
        kind = ("chat", "speech", "converse")[i % 3]
        try:
            if kind == "converse":
                with grpc.insecure_channel(dep.converse_address) as ch:
                    resp = list(gw_grpc.GatewayStub(ch).Converse(iter([gw.ConverseRequest(start=gw.ConverseStart(
                        text=f"Soak {i}", max_tokens=16, max_frames=16))]), timeout=120, metadata=AUTH_METADATA))
                return f"{kind}:ok" if resp and resp[-1].WhichOneof("kind") == "done" else f"{kind}:no-done"
            with httpx.Client(base_url=dep.base_url, timeout=120, headers=auth_headers()) as c:
                if kind == "chat":
                    r = c.post("/v1/chat/completions", json={
                        "model": model, "messages": [{"role": "user", "content": f"Soak {i}"}],
                        "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"},
                        "max_tokens": 16, "max_audio_frames": 16})
                else:
                    r = c.post("/v1/audio/speech", json={"model": model, "input": f"Soak {i}", "voice": "chelsie",
                                                          "response_format": "wav", "max_audio_frames": 16})
                return f"{kind}:{r.status_code}"
        except Exception as e:
            return f"{kind}:{type(e).__name__}"

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        for o in pool.map(one, range(n)):
            outcomes[o] += 1
    seconds = time.monotonic() - t0
    stop.set()
    sampler.join()
    after = {s: round(dep.services[s].rss_mb(), 1) for s in names}
    ok = sum(v for k, v in outcomes.items() if k.endswith((":ok", ":200")))
    return {"requests": n, "concurrency": concurrency, "ok": ok, "errors": n - ok, "outcomes": dict(outcomes),
            "seconds": round(seconds, 1), "rss_mb_before": before, "rss_mb_peak": peak, "rss_mb_after": after}


# ============================================================================== kill and drain


def _pipeline_streams(dep: Deployment, k: int, frames: int, on_running: Callable[[], None]) -> list[dict]:
    """`k` spoken replies through the real pipeline client at once; `on_running()` is called once every
    stream has its talker and its first audio. Returns per stream: talker address, outcome."""
    import asyncio

    from voxpipe.client import PipelineClient, PipelineError, SpeechRequest

    async def go():
        running = [asyncio.Event() for _ in range(k)]

        async def one(i: int, client: PipelineClient) -> dict:
            rec: dict = {"talker": None, "audio_chunks": 0}
            try:
                async for ev in client.stream(SpeechRequest(token_ids=PROMPT_IDS, max_tokens=frames, min_tokens=frames,
                                                            max_frames=frames, min_frames=frames,
                                                            request_id=f"kill-{i}")):
                    name = type(ev).__name__
                    if name == "StageEvent" and ev.kind == "routed" and ev.stage == "talker":
                        rec["talker"] = ev.address
                    elif name == "AudioEvent":
                        rec["audio_chunks"] += 1
                        running[i].set()
                    elif name == "DoneEvent":
                        rec.update(outcome="finished", frames=ev.frames, talker=ev.routes.get("talker", rec["talker"]))
            except PipelineError as e:
                rec.update(outcome="failed", stage=e.stage, code=e.code.name if e.code else None, details=e.details[:200])
            finally:
                running[i].set()
            return rec

        async with PipelineClient(dep.address("thinker"), dep.address("code2wav")) as client:
            tasks = [asyncio.ensure_future(one(i, client)) for i in range(k)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in running)), 120)
            await asyncio.to_thread(on_running)
            return await asyncio.wait_for(asyncio.gather(*tasks), 180)

    return asyncio.run(go())


def kill_and_drain(dep: Deployment, k: int) -> dict:
    import httpx

    out: dict = {}
    frames = 60
    # ---- SIGKILL talker A while k streams run on A and B
    victim = dep.services["talker_a"]
    streams = _pipeline_streams(dep, k, frames, lambda: victim.proc.send_signal(signal.SIGKILL))
    victim.proc.wait(30)
    a, b = dep.address("talker_a"), dep.address("talker_b")
    on_a = [s for s in streams if s["talker"] == a]
    on_b = [s for s in streams if s["talker"] == b]
    out["kill"] = {
        "streams": k, "on_killed_talker": len(on_a), "on_other_talker": len(on_b),
        "killed_failed": sum(s.get("outcome") == "failed" for s in on_a),
        "killed_failed_naming_talker": sum(s.get("outcome") == "failed" and s.get("stage") == "talker" for s in on_a),
        "other_finished_complete": sum(s.get("outcome") == "finished" and s.get("frames") == frames - 1 for s in on_b),
        "statuses": sorted({f"{s.get('stage')}: {s.get('code')}: {s.get('details')}" for s in on_a
                            if s.get("outcome") == "failed"}),
        "exit_signal": -victim.proc.returncode if victim.proc.returncode < 0 else None,
    }
    # ---- after the kill: new spoken requests through the gateway
    after = Counter()
    with httpx.Client(base_url=dep.base_url, timeout=120, headers=auth_headers()) as c:
        for i in range(8):
            r = c.post("/v1/chat/completions", json={
                "model": dep.model_dir.name, "messages": [{"role": "user", "content": f"After {i}"}],
                "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"},
                "max_tokens": 4, "max_audio_frames": 4})
            after[str(r.status_code)] += 1
        ready = c.get("/ready").status_code
    out["kill"]["after_kill_requests"] = dict(after)
    out["kill"]["gateway_ready_status"] = ready
    out["kill"]["gauges_after"] = settle(dep, skip=("talker_a",))
    # ---- SIGTERM talker B (the one left) while k streams run on it
    drained = dep.services["talker_b"]
    t_sig: dict = {}

    def term() -> None:
        t_sig["t"] = time.monotonic()
        drained.proc.send_signal(signal.SIGTERM)

    streams = _pipeline_streams(dep, k, frames, term)
    try:
        code = drained.proc.wait(150)
    except subprocess.TimeoutExpired:
        code = None
    out["drain"] = {
        "streams": k, "on_draining_talker": sum(s["talker"] == b for s in streams),
        "finished_complete": sum(s.get("outcome") == "finished" and s.get("frames") == frames - 1 for s in streams),
        "failed": [f"{s.get('stage')}: {s.get('code')}: {s.get('details')}" for s in streams
                   if s.get("outcome") != "finished"],
        "exit_code": code, "exit_seconds_after_sigterm": round(time.monotonic() - t_sig["t"], 1) if code is not None
        else None,
    }
    return out


# ============================================================================== chaos: every stage killed


def chaos_kills(dep: Deployment) -> list[dict]:
    """After kill_and_drain (both talkers started again): for the thinker, talker A and the code2wav in
    turn, voxpipe.bench.chaos's 16 streams (4 per gateway API), SIGKILL once each has audio; what every
    client saw (streams on talker B finish); then the stage restarted and the seconds until a spoken
    request succeeds."""
    import asyncio

    import httpx

    from . import chaos

    g = chaos.Gateway(dep.base_url, dep.converse_address, dep.model_dir.name, api_key=API_KEY)
    for name in ("talker_a", "talker_b"):       # killed and drained by kill_and_drain
        dep.restart(name)
    settle(dep)
    rows = []
    for name in ("thinker", "talker_a", "code2wav"):
        stage, victim = STAGE_LABEL[name], dep.services[name]
        sent: dict[str, float] = {}

        async def fire() -> None:
            sent["at"] = time.monotonic()
            victim.proc.send_signal(signal.SIGKILL)

        seen = asyncio.run(chaos.streams(g, while_running=fire))
        victim.proc.wait(30)
        errors = [x for x in seen if x.outcome == "error"]
        row = {"stage": name, "streams": len(seen), "complete": sum(x.outcome == "complete" for x in seen),
               "error": len(errors), "cut": sum(x.outcome == "cut" for x in seen),
               "error_names_stage": sum(x.names(stage) for x in errors if x.kind not in chaos.NAMES_NO_STAGE),
               "error_can_name": sum(x.kind not in chaos.NAMES_NO_STAGE for x in errors),
               "worst_report_s": max((round(x.error_at - sent["at"], 3) for x in errors), default=None),
               "by_kind": chaos.summary(seen, sent["at"], stage)}
        t0 = time.monotonic()
        dep.restart(name)
        restarted = time.monotonic()
        body = {"model": g.model, "input": "Back.", "voice": "ethan", "response_format": "pcm", "max_audio_frames": 2}
        status = None
        while time.monotonic() - restarted < 30:
            status = httpx.post(f"{dep.base_url}/v1/audio/speech", json=body, headers=auth_headers(), timeout=60).status_code
            if status == 200:
                break
            time.sleep(0.1)
        row.update(restart_s=round(restarted - t0, 1), serving_after_s=round(time.monotonic() - restarted, 2),
                   serving_status=status, gauges_after=settle(dep))
        rows.append(row)
    return rows


# ============================================================================== security


def security(dep: Deployment) -> list[dict]:
    import httpx
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    checks: list[dict] = []

    def check(name: str, passed: bool, got: Any) -> None:
        checks.append({"check": name, "pass": bool(passed), "got": str(got)[:200]})

    body = {"model": dep.model_dir.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "modalities": ["text"]}
    with httpx.Client(base_url=dep.base_url, timeout=60) as c:
        for label, headers in (("no key", {}), ("wrong key", {"Authorization": "Bearer nope"}),
                               ("key without Bearer", {"Authorization": API_KEY})):
            for path, method in (("/v1/models", "GET"), ("/v1/chat/completions", "POST"), ("/v1/audio/speech", "POST")):
                r = c.request(method, path, headers=headers, json=body if method == "POST" else None)
                check(f"HTTP {method} {path}, {label}: 401", r.status_code == 401, r.status_code)
        r = c.post("/v1/chat/completions", headers=auth_headers(), json=body)
        check("HTTP chat with the key: 200", r.status_code == 200, r.status_code)
    url = f"ws://{HOST}:{dep.http_port}/v1/realtime"
    for label, headers in (("no key", {}), ("wrong key", {"Authorization": "Bearer nope"})):
        try:
            with connect(url, additional_headers=headers, open_timeout=30) as ws:
                got = ws.recv(timeout=10)
            check(f"WebSocket {label}: handshake refused", False, got)
        except InvalidStatus as e:
            check(f"WebSocket {label}: handshake refused (401)", e.response.status_code == 401, e.response.status_code)
    with connect(url, additional_headers=auth_headers(), open_timeout=30) as ws:
        first = json.loads(ws.recv(timeout=30))
    check("WebSocket with the key: session.created", first.get("type") == "session.created", first.get("type"))
    start = [gw.ConverseRequest(start=gw.ConverseStart(text="hi", max_tokens=2,
                                                      output_modalities=[gw.MODALITY_TEXT]))]
    with grpc.insecure_channel(dep.converse_address) as ch:
        stub = gw_grpc.GatewayStub(ch)
        for label, md in (("no key", ()), ("wrong key", (("authorization", "Bearer nope"),))):
            try:
                list(stub.Converse(iter(start), timeout=60, metadata=md))
                check(f"Converse {label}: UNAUTHENTICATED", False, "OK")
            except grpc.RpcError as e:
                check(f"Converse {label}: UNAUTHENTICATED", e.code() == grpc.StatusCode.UNAUTHENTICATED, e.code().name)
        resp = list(stub.Converse(iter(start), timeout=60, metadata=AUTH_METADATA))
        check("Converse with the key: done", resp[-1].WhichOneof("kind") == "done", resp[-1].WhichOneof("kind"))
    # every listener on --host only
    ports = {"gateway http": dep.http_port, "gateway converse": dep.grpc_port,
             **{f"{s} grpc": dep.ports[s] for s in STAGES}, **{f"{s} metrics": dep.metrics_ports[s] for s in STAGES}}
    for name, port in ports.items():
        with socket.create_connection((HOST, port), timeout=5):
            pass
        try:
            socket.create_connection((OTHER_LOOPBACK, port), timeout=5).close()
            check(f"{name} port {port}: not listening on {OTHER_LOOPBACK}", False, "connected")
        except OSError as e:
            check(f"{name} port {port}: listens on {HOST} only", True, type(e).__name__)

    def reflection(address: str) -> str:
        with grpc.insecure_channel(address) as ch:
            try:
                r = list(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
                return "on: " + ",".join(s.name for s in r[0].list_services_response.service)
            except grpc.RpcError as e:
                return e.code().name

    got = reflection(dep.converse_address)
    check("gateway --no-reflection: reflection UNIMPLEMENTED", got == "UNIMPLEMENTED", got)
    got = reflection(dep.address("code2wav"))
    check("code2wav --no-reflection: reflection UNIMPLEMENTED", got == "UNIMPLEMENTED", got)
    got = reflection(dep.address("thinker"))
    check("thinker --reflection: reflection on", got.startswith("on:"), got)
    got = reflection(dep.address("talker_a"))
    check("talker_a (default): reflection UNIMPLEMENTED", got == "UNIMPLEMENTED", got)
    r = httpx.get(f"{dep.base_url}/metrics", timeout=10)
    check("gateway /metrics without the key: 401", r.status_code == 401, r.status_code)
    return checks


# ============================================================================== the run


PROMPT_IDS: list[int] = []


def fuzz_api(dep: Deployment, api: str, strategy, s: Settings, seed: int) -> dict:
    tally = Tally(api)
    code2wav = dep.address("code2wav")
    if api in ("http_chat", "http_speech"):
        ex = HttpFuzz(dep, "/v1/chat/completions" if api == "http_chat" else "/v1/audio/speech", tally, s.hang_s)
    elif api == "realtime":
        ex = RealtimeFuzz(dep, tally, s.hang_s)
    elif api == "converse":
        ex = GrpcFuzz(dep.converse_address, "/voxpipe.v1.Gateway/Converse", gw.ConverseResponse, tally, s.hang_s,
                      code2wav, AUTH_METADATA)
    else:
        stage = api.removeprefix("stage_")
        target = {"thinker": ("thinker", "/voxpipe.v1.Thinker/Generate", pb.ThinkerResponse),
                  "talker": ("talker_a", "/voxpipe.v1.Talker/Generate", pb.TalkerResponse),
                  "code2wav": ("code2wav", "/voxpipe.v1.Code2Wav/Decode", pb.Code2WavResponse)}[stage]
        ex = GrpcFuzz(dep.address(target[0]), target[1], target[2], tally, s.hang_s, code2wav)
    t0 = time.monotonic()
    try:
        run_cases(strategy, s.cases, seed, ex)
    finally:
        ex.close()
        tally.seconds = time.monotonic() - t0
    row = tally.row()
    if api == "realtime":
        row["connections"] = ex.connections
    row["dead_after"] = dep.dead()
    row["gauges_after"] = settle(dep)
    return row


def run(s: Settings, model_dir: Path, seed: int = 0, log: Callable[[str], None] = print,
        apis: tuple[str, ...] = APIS) -> dict:
    from voxpipe.services.runtime.config import OmniConfig

    omni = OmniConfig.load(model_dir)
    t = omni.thinker.tokens
    PROMPT_IDS[:] = [t.im_start, t.user, 198, 199, 200, t.im_end, t.im_start, t.assistant, 198]
    report: dict = {"settings": asdict(s), "seed": seed, "started": datetime.datetime.now().isoformat(timespec="seconds"),
                    "machine": machine(), "commit": commit()}
    with tempfile.TemporaryDirectory(prefix="voxpipe-rel-") as tmp:
        dep = Deployment(model_dir, Path(tmp), s.listen_timeout_s)
        t0 = time.monotonic()
        dep.start()
        report["startup_seconds"] = round(time.monotonic() - t0, 1)
        log(f"deployment up in {report['startup_seconds']} s")
        try:
            report["security"] = security(dep)
            log(f"security: {sum(c['pass'] for c in report['security'])}/{len(report['security'])} pass")
            reference = known_good(dep, PROMPT_IDS)
            report["known_good_reference"] = reference
            strategies_ = strategies(dep.model_dir.name, omni)
            report["fuzz"] = []
            report["known_good_checks"] = []
            for i, api in enumerate(apis):
                row = fuzz_api(dep, api, strategies_[api], s, seed * 1000 + i)
                report["fuzz"].append(row)
                again = known_good(dep, PROMPT_IDS)
                report["known_good_checks"].append({"after": api, "identical": again == reference,
                                                    "differs": [k for k in again if again[k] != reference[k]]})
                log(f"{api}: {row['cases']} cases, 2xx {row['2xx']}, 4xx {row['4xx']}, 5xx {row['5xx']}, "
                    f"hang {row['hang']} in {row['seconds']} s; gauges zero {row['gauges_after']['zero']}; "
                    f"known-good identical {again == reference}")
            t1 = time.monotonic()
            report["disconnects"] = disconnects(dep, s.disconnects, seed)
            report["disconnects"]["seconds"] = round(time.monotonic() - t1, 1)
            report["disconnects"]["gauges_after"] = settle(dep)
            report["disconnects"]["dead_after"] = dep.dead()
            again = known_good(dep, PROMPT_IDS)
            report["disconnects"]["known_good_identical"] = again == reference
            log(f"disconnects: {report['disconnects']['requests']} cut, gauges zero "
                f"{report['disconnects']['gauges_after']['zero']}, known-good identical {again == reference}")
            report["soak"] = soak(dep, s.soak_requests, s.soak_concurrency)
            report["soak"]["gauges_after"] = settle(dep)
            again = known_good(dep, PROMPT_IDS)
            report["soak"]["known_good_identical"] = again == reference
            log(f"soak: {report['soak']['ok']}/{report['soak']['requests']} ok in {report['soak']['seconds']} s")
            report["lifecycle"] = kill_and_drain(dep, s.kill_streams)
            log(f"kill: {json.dumps(report['lifecycle']['kill'])[:400]}")
            log(f"drain: {json.dumps(report['lifecycle']['drain'])[:400]}")
            if s.chaos:
                report["chaos"] = chaos_kills(dep)
                for row in report["chaos"]:
                    log(f"chaos {row['stage']}: {json.dumps({k: v for k, v in row.items() if k != 'by_kind'})[:400]}")
            report["tracebacks_in_logs"] = {n: svc.tracebacks() for n, svc in dep.services.items()}
            report["unexpected_exits"] = dep.dead(expected_gone=("talker_a", "talker_b"))
        finally:
            dep.stop()
            report["logs_tail"] = {n: _tail(svc.log_path) for n, svc in dep.services.items()
                                   if report.get("tracebacks_in_logs", {}).get(n)}
    report["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
    report["verdict"] = verdict(report)
    return report


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def verdict(r: dict) -> dict:
    """The invariants, each True when it held."""
    fuzz = r.get("fuzz", [])
    kill, drain = r["lifecycle"]["kill"], r["lifecycle"]["drain"]
    return {
        "no_5xx": all(row["5xx"] == 0 for row in fuzz),
        "no_hang": all(row["hang"] == 0 for row in fuzz),
        "no_process_died": not any(row["dead_after"] for row in fuzz) and not r["unexpected_exits"],
        "gauges_zero": all(row["gauges_after"]["zero"] for row in fuzz) and r["disconnects"]["gauges_after"]["zero"]
        and r["soak"]["gauges_after"]["zero"],
        "known_good_identical": all(c["identical"] for c in r["known_good_checks"])
        and r["disconnects"]["known_good_identical"] and r["soak"]["known_good_identical"],
        "soak_no_errors": r["soak"]["errors"] == 0,
        "kill_only_its_streams": kill["killed_failed_naming_talker"] == kill["on_killed_talker"]
        and kill["other_finished_complete"] == kill["on_other_talker"],
        "drain_finished_all": drain["finished_complete"] == drain["streams"] and drain["exit_code"] == 0,
        "security": all(c["pass"] for c in r["security"]),
        "kills_reported_within_1s": all(row["cut"] == 0 and row["error_names_stage"] == row["error_can_name"]
                                        and (row["worst_report_s"] or 0) <= 1.0 and row["serving_status"] == 200
                                        for row in r.get("chaos", [])),
    }


def machine() -> dict:
    cpu = ""
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                   if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        import torch
        torch_v = torch.__version__
    except ImportError:
        torch_v = None
    return {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "cpu": cpu, "python": platform.python_version(),
            "torch": torch_v, "platform": platform.platform()}


def commit() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                               text=True).stdout
        return sha.strip() + ("+dirty" if dirty.strip() else "")
    except OSError:
        return ""


def markdown(r: dict) -> str:
    lines = ["| API | cases | 2xx | 4xx | 5xx | hangs | processes died | gauges back to 0 | seconds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in r["fuzz"]:
        g = row["gauges_after"]
        lines.append(f"| {row['api']} | {row['cases']} | {row['2xx']} | {row['4xx']} | {row['5xx']} | {row['hang']} | "
                     f"{', '.join(row['dead_after']) or 'none'} | {'yes' if g['zero'] else 'NO ' + str(g['nonzero'])} "
                     f"({g['gauges_checked']} gauges) | {row['seconds']} |")
    lines += ["", "| phase | known-good outputs byte-identical to the first run |", "|---|---|"]
    for c in r["known_good_checks"]:
        lines.append(f"| after {c['after']} | {'yes' if c['identical'] else 'NO: ' + ', '.join(c['differs'])} |")
    d = r["disconnects"]
    lines.append(f"| after {d['requests']} disconnects | {'yes' if d['known_good_identical'] else 'NO'} |")
    lines.append(f"| after the soak | {'yes' if r['soak']['known_good_identical'] else 'NO'} |")
    so = r["soak"]
    lines += ["", f"Soak: {so['requests']} requests at c={so['concurrency']} in {so['seconds']} s, {so['ok']} ok, "
              f"{so['errors']} errors ({so['outcomes']}).", "",
              "| process | RSS before soak (MB) | peak | after | change |", "|---|---|---|---|---|"]
    for n in so["rss_mb_before"]:
        b, p, a = so["rss_mb_before"][n], so["rss_mb_peak"][n], so["rss_mb_after"][n]
        lines.append(f"| {n} | {b} | {p} | {a} | {(a - b) / b * 100:+.1f} % |" if b else f"| {n} | {b} | {p} | {a} | |")
    if "lifecycle" in r:
        k, dr = r["lifecycle"]["kill"], r["lifecycle"]["drain"]
        g = k["gauges_after"]
        lines += ["", "| kill / drain | result |", "|---|---|",
                  f"| SIGKILL talker A with {k['streams']} streams running | {k['on_killed_talker']} on A, "
                  f"{k['on_other_talker']} on B |",
                  f"| streams on the killed talker that failed | {k['killed_failed']} of {k['on_killed_talker']} |",
                  f"| ... whose error names the talker | {k['killed_failed_naming_talker']} of {k['on_killed_talker']} |",
                  f"| statuses the callers saw | {'; '.join(k['statuses'])} |",
                  f"| streams on the other talker finished with every frame | {k['other_finished_complete']} of "
                  f"{k['on_other_talker']} |",
                  f"| gateway chat requests after the kill | {k['after_kill_requests']} |",
                  f"| gateway /ready after the kill | {k['gateway_ready_status']} |",
                  f"| gauges after the kill | {'0' if g['zero'] else 'NOT 0: ' + str(g['nonzero'])} |",
                  f"| SIGTERM talker B with {dr['streams']} streams running ({dr['on_draining_talker']} on B) | "
                  f"{dr['finished_complete']} finished with every frame; failed: {dr['failed'] or 'none'} |",
                  f"| talker B exit | code {dr['exit_code']}, {dr['exit_seconds_after_sigterm']} s after SIGTERM |"]
    if r.get("chaos"):
        lines += ["", "| SIGKILL under 16 streams (4 chat SSE, 4 speech, 4 realtime, 4 Converse) | complete | error | "
                  "... naming the stage | cut | worst report after the kill (s) | restart (s) | serving again after (s) | "
                  "gauges after |", "|---|---|---|---|---|---|---|---|---|"]
        for row in r["chaos"]:
            g = row["gauges_after"]
            lines.append(f"| {row['stage']} | {row['complete']} | {row['error']} | {row['error_names_stage']} of "
                         f"{row['error_can_name']} | {row['cut']} | {row['worst_report_s']} | {row['restart_s']} | "
                         f"{row['serving_after_s']} ({row['serving_status']}) | {'0' if g['zero'] else g['nonzero']} |")
    d = r.get("disconnects")
    if d:
        g = d["gauges_after"]
        timings = d.get("by_timing")     # absent from runs before the timings
        lines += ["", f"Disconnects: {d['requests']} requests cut by their clients "
                  + (f"({', '.join(f'{k} {v}' for k, v in timings.items())}) " if timings else "at random points ")
                  + f"({', '.join(f'{k} {v}' for k, v in d['by_kind'].items())}; {d['client_error_count']} raised on the "
                  f"client side) in {d['seconds']} s: gauges "
                  f"{'back to 0 after ' + str(g['seconds']) + ' s' if g['zero'] else 'NOT back to 0: ' + str(g['nonzero'])}, "
                  f"processes died: {', '.join(d['dead_after']) or 'none'}."]
    if "security" in r:
        lines += ["", "| security check | pass | got |", "|---|---|---|"]
        lines += [f"| {c['check']} | {'yes' if c['pass'] else 'NO'} | {c['got']} |" for c in r["security"]]
    bad = [(row["api"], f) for row in r["fuzz"] for f in row["failures"]]
    if bad:
        lines += ["", "5xx and hangs (first of each API):", ""]
        lines += [f"- {api}: {f['class']} {f['detail']}: sent `{f['sent'][:200]}` got `{f['got'][:200]}`"
                  for api, f in bad[:30]]
    lines += ["", "Tracebacks in the services' logs: " +
              ", ".join(f"{n} {v}" for n, v in r.get("tracebacks_in_logs", {}).items()) + "."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import warnings

    warnings.simplefilter("ignore")     # hypothesis' and websockets' advice on how the suite uses them
    p = argparse.ArgumentParser(prog="python -m voxpipe.bench.reliability", description=__doc__.split("\n\n")[0])
    p.add_argument("--full", action="store_true", help=f"{FULL.cases} cases per API, {FULL.disconnects} disconnects, "
                                                        f"{FULL.soak_requests}-request soak (default: the short run)")
    p.add_argument("--cases", type=int, help="override the cases per API")
    p.add_argument("--disconnects", type=int, help="override the number of client disconnects")
    p.add_argument("--soak", type=int, help="override the soak's requests")
    p.add_argument("--chaos", action=argparse.BooleanOptionalAction, default=None,
                   help="SIGKILL each stage under streams of every API, then restart it (default: on with --full)")
    p.add_argument("--model", help="checkpoint folder (default: the tiny checkpoint)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--apis", default=",".join(APIS))
    p.add_argument("--out", default="reliability.json")
    p.add_argument("--md", help="also write the tables as Markdown here")
    p.add_argument("--render", metavar="JSON", help="only print the tables of an earlier run's JSON")
    args = p.parse_args(argv)
    if args.render:
        print(markdown(json.loads(Path(args.render).read_text())))
        return 0
    s = FULL if args.full else SHORT
    overrides = {"cases": args.cases, "disconnects": args.disconnects, "soak_requests": args.soak, "chaos": args.chaos}
    s = Settings(**{**asdict(s), **{k: v for k, v in overrides.items() if v is not None}})
    if args.model:
        model = Path(args.model)
    else:
        from voxpipe.cli import default_model_dir
        model = default_model_dir()
    t0 = time.monotonic()
    report = run(s, model, args.seed, log=lambda m: print(f"[{time.monotonic() - t0:7.1f} s] {m}", flush=True),
                 apis=tuple(args.apis.split(",")))
    report["command"] = "python -m voxpipe.bench.reliability " + " ".join(argv if argv is not None else sys.argv[1:])
    report["wall_seconds"] = round(time.monotonic() - t0, 1)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    tables = markdown(report)
    if args.md:
        Path(args.md).write_text(tables + "\n")
    print(tables)
    print(json.dumps(report["verdict"], indent=1))
    return 0 if all(report["verdict"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
