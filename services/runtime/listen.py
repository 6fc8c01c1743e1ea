"""Listening ports that are never shared. gRPC Python servers bind with SO_REUSEPORT by default,
so a second stack started on the same ports serves beside the first and requests split between
them; every voxpipe gRPC server turns it off (GRPC_SERVER_OPTIONS), and every port is checked
before the process does anything slow (loading weights): a taken one raises PortInUse naming
the flag that moves it."""

from __future__ import annotations

import argparse
import errno
import os
import socket

from voxpipe.errors import ConfigError, PortInUse

GRPC_SERVER_OPTIONS = (("grpc.so_reuseport", 0),)

HOST_HELP = ("the address every listener of this process binds (env VOXPIPE_HOST; default 127.0.0.1: this "
             "machine only; 0.0.0.0 or [::]: every interface, as in containers)")


def port_number(value: str) -> int:
    """argparse type of a port flag: 0 (any free port, or off, as the flag says) to 65535."""
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (0 to 65535)")
    return port


def default_host() -> str:
    """Every command's --host default: this machine only, unless VOXPIPE_HOST says otherwise (the
    container images set 0.0.0.0)."""
    return os.environ.get("VOXPIPE_HOST") or "127.0.0.1"


def socket_host(host: str) -> str:
    """A gRPC bind host ("[::]", "0.0.0.0", "127.0.0.1") as a plain socket address ("::" ...)."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _addresses(host: str, port: int) -> list[tuple]:
    try:
        return socket.getaddrinfo(socket_host(host) or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"cannot listen on {host}: {e.strerror}; check --host") from None


def _bound(family: int, address: tuple) -> socket.socket:
    """A socket bound to `address` the way the servers bind (SO_REUSEADDR: a port in TIME_WAIT is
    free; no SO_REUSEPORT; IPv6 "::" dual-stack, as gRPC binds it)."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


def check_free(what: str, host: str, port: int, flag: str) -> None:
    """Raise PortInUse when something listens on host:port (port 0: any free port, never taken).
    Other bind failures (an address this machine does not have) are left to the server's own bind."""
    if not port:
        return
    if not 0 < port <= 65535:
        raise ConfigError(f"{flag} {port}: not a port number (0 to 65535)")
    for family, _, _, _, address in _addresses(host, port):
        try:
            _bound(family, address).close()
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise PortInUse(what, host, port, flag) from None


def bind_http(what: str, host: str, port: int, flag: str) -> socket.socket:
    """A listening-ready socket for an HTTP server on host:port (0: any free port), the first
    address `host` resolves to; PortInUse when it is taken."""
    family, _, _, _, address = _addresses(host, port)[0]
    try:
        sock = _bound(family, address)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise PortInUse(what, host, port, flag) from None
        raise ConfigError(f"cannot listen on {host}:{port} ({what}): {e.strerror}; check --host and {flag}") from None
    sock.set_inheritable(True)
    return sock
