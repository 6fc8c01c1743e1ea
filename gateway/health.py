"""Readiness of the stages the gateway calls: what `/ready` answers and what the Converse port's
grpc.health.v1 status follows."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from voxpipe.services.runtime.tls import ClientTLS, aio_channel

from .config import GatewayConfig

STAGES = ("thinker", "code2wav")   # the stages the gateway calls (the talker is the thinker's)


async def stage_health(addresses: str, timeout: float = 2.0, tls: ClientTLS | None = None) -> dict[str, str]:
    """grpc.health.v1 status of every replica in a comma-separated address list (dialled with `tls`)."""
    async def check(addr: str) -> str:
        try:
            async with aio_channel(addr, tls) as ch:
                resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        except grpc.aio.AioRpcError as e:
            return e.code().name

    addrs = [a for a in addresses.split(",") if a]
    return dict(zip(addrs, await asyncio.gather(*(check(a) for a in addrs))))


async def readiness(cfg: GatewayConfig) -> tuple[bool, dict[str, dict[str, str]]]:
    """Whether every replica of the stages the gateway calls is SERVING (what /ready answers, and
    what the Converse port's grpc.health.v1 status follows), and each replica's status."""
    stages = dict(zip(STAGES, await asyncio.gather(*(stage_health(getattr(cfg, s), tls=cfg.stage_tls)
                                                     for s in STAGES))))
    ok = all(status == "SERVING" for per_stage in stages.values() for status in per_stage.values())
    return ok, stages
