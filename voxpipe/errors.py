"""Errors a `voxpipe` command reports as one line (no traceback unless --log-level debug) and an
exit status: a bad flag value, a model folder that is not a checkpoint, a device this torch does
not have, a port another process listens on. Light on purpose: `voxpipe.cli.main` catches them
without importing the servers."""

from __future__ import annotations


class ConfigError(Exception):
    """The command cannot run as configured; the message names the flag to change."""

    exit_code = 2


class PortInUse(ConfigError):
    """A port this process must listen on is already taken (by another voxpipe, say)."""

    def __init__(self, what: str, host: str, port: int, flag: str) -> None:
        self.what, self.host, self.port, self.flag = what, host, port, flag
        super().__init__(f"{what} port {port} on {host} is already in use (another voxpipe?); "
                         f"choose another with {flag}")
