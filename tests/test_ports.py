"""Every listening port refuses to be shared: a stage's gRPC, health and metrics ports, the
gateway's HTTP and Converse ports, and `voxpipe up`'s ports, each taken by another listener
before the real command starts on it. The command exits 2 with one line naming the port and the
flag that moves it (no traceback), before it loads anything."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from concurrent import futures

import grpc
import pytest

from conftest import free_port
from voxpipe.errors import PortInUse
from voxpipe.services.runtime.listen import GRPC_SERVER_OPTIONS
from voxpipe.services.runtime.server import bind_grpc


def grpc_occupant() -> tuple[grpc.Server, int]:
    """A gRPC server as gRPC Python makes one by default (SO_REUSEPORT on): what a voxpipe from
    before this check, or any other gRPC service, holds a port with."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def http_occupant() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, sock.getsockname()[1]


# (occupant, the command with PORT where the taken port goes, the flag named, what is named)
CASES = {
    "thinker gRPC": (grpc_occupant, ["thinker", "--port", "PORT"], "--port", "thinker gRPC port"),
    "talker health": (grpc_occupant, ["talker", "--port", "0", "--health-port", "PORT"], "--health-port",
                      "talker health port"),
    "code2wav metrics": (http_occupant, ["code2wav", "--port", "0", "--metrics-port", "PORT"], "--metrics-port",
                         "code2wav metrics port"),
    "gateway HTTP": (http_occupant, ["gateway", "--http-port", "PORT"], "--http-port", "gateway HTTP port"),
    "gateway Converse": (grpc_occupant, ["gateway", "--http-port", "0", "--grpc-port", "PORT"], "--grpc-port",
                         "gateway Converse gRPC port"),
    "up stage": (grpc_occupant, ["up", "--base-port", "PORT", "--http-port", "0"], "--base-port", "thinker port"),
    "up HTTP": (http_occupant, ["up", "--base-port", "FREE", "--http-port", "PORT"], "--http-port",
                "gateway HTTP port"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_taken_port_stops_the_command_with_one_line(case, tiny_model_dir):
    make_occupant, command, flag, what = CASES[case]
    occupant, port = make_occupant()
    try:
        args = [str(port) if a == "PORT" else str(free_port()) if a == "FREE" else a for a in command]
        args += ["--model", str(tiny_model_dir), "--host", "127.0.0.1"]
        if command[0] != "gateway":
            args += ["--device", "cpu"]
        proc = subprocess.run([sys.executable, "-m", "voxpipe.cli", *args], capture_output=True, text=True,
                              timeout=300)
    finally:
        occupant.stop(None) if isinstance(occupant, grpc.Server) else occupant.close()
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"{what} {port} on 127.0.0.1 is already in use" in lines[0] and lines[0].endswith(f"with {flag}")
    assert "ready on port" not in proc.stdout


def test_a_taken_port_with_debug_logging_shows_the_traceback(tiny_model_dir):
    occupant, port = http_occupant()
    try:
        proc = subprocess.run([sys.executable, "-m", "voxpipe.cli", "--log-level", "debug", "gateway", "--model",
                               str(tiny_model_dir), "--host", "127.0.0.1", "--http-port", str(port)],
                              capture_output=True, text=True, timeout=300)
    finally:
        occupant.close()
    assert proc.returncode == 2 and "Traceback" in proc.stderr and "PortInUse" in proc.stderr, proc.stderr[-2000:]


def test_voxpipe_grpc_servers_never_share_a_port():
    """The bind itself (not only the check before it): a server made with GRPC_SERVER_OPTIONS cannot
    take a port another gRPC server holds, and one holding a port keeps the next one out."""
    occupant, port = grpc_occupant()

    async def bind(port: int) -> int:
        server = grpc.aio.server(options=GRPC_SERVER_OPTIONS)
        try:
            return bind_grpc(server, "127.0.0.1", port, None, "test gRPC", "--port")
        finally:
            await server.stop(None)

    try:
        with pytest.raises(PortInUse, match=f"test gRPC port {port} on 127.0.0.1 is already in use.*with --port"):
            asyncio.run(bind(port))
    finally:
        occupant.stop(None)

    async def hold_then_bind() -> None:
        holder = grpc.aio.server(options=GRPC_SERVER_OPTIONS)
        held = bind_grpc(holder, "127.0.0.1", 0, None, "holder", "--port")
        await holder.start()
        try:
            with pytest.raises(PortInUse):
                await bind(held)
            second = grpc.server(futures.ThreadPoolExecutor(max_workers=1))   # reuseport on: still refused
            with pytest.raises(RuntimeError):
                second.add_insecure_port(f"127.0.0.1:{held}")
        finally:
            await holder.stop(None)

    asyncio.run(hold_then_bind())
