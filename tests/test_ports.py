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

from conftest import free_ports
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
        args = [str(port) if a == "PORT" else str(free_ports(3)) if a == "FREE" else a for a in command]
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


@pytest.mark.parametrize("argv, message", [
    (["thinker", "--port", "70000"], "argument --port: 70000 is not a port number (0 to 65535)"),
    (["talker", "--metrics-port", "http"], "argument --metrics-port: 'http' is not a port number"),
    (["gateway", "--http-port", "-1"], "argument --http-port: -1 is not a port number (0 to 65535)"),
    (["up", "--base-port", "65536"], "argument --base-port: 65536 is not a port number (0 to 65535)"),
    (["code2wav", "--max-batch", "0"], "argument --max-batch: 0 is below 1"),
    (["thinker", "--max-len", "many"], "argument --max-len: 'many' is not an integer"),
    (["talker", "--grace", "-1"], "argument --grace: -1 is below 0.0"),
    (["thinker", "--max-message-mb", "0"], "argument --max-message-mb: 0 must be above 0.0"),
    (["code2wav", "--gpu-memory-fraction", "1.5"], "argument --gpu-memory-fraction: 1.5 is above 1"),
])
def test_bad_flag_values_are_one_argparse_line(argv, message, capsys):
    from voxpipe.cli import build_parser

    with pytest.raises(SystemExit) as stopped:
        build_parser(argv[0]).parse_args(argv)
    assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_a_port_range_past_65535_is_refused_before_anything_starts(tiny_model_dir):
    """voxpipe up counts its ports up from --base-port: the last one must exist too."""
    proc = subprocess.run([sys.executable, "-m", "voxpipe.cli", "up", "--model", str(tiny_model_dir), "--device", "cpu",
                           "--base-port", "65534", "--http-port", "0"], capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].endswith("--base-port 65536: not a port number (0 to 65535)"), lines
