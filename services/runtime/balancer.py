"""Client-side load balancing over one stage's replicas.

A stage's address list ("a:1,b:2" or a list) holds plain `host:port` entries (one replica each,
dialled as given) and/or `dns:///name:port` entries (a Kubernetes headless Service, say): every
A/AAAA record of the name is one replica, and the name is re-resolved every `resolve_interval_s`
and soon after a connection failure, so replicas come and go with the pods. A replica that leaves
DNS takes no new streams; its channel closes once its last stream ends.

Each new stream goes to the usable replica with the fewest outstanding streams from this client
(ties round-robin) and stays there for its life (BalancedStream); a stream with a RouteKey (its
session, its prompt's block hashes) goes where its session (or the chat conversation its prompt
continues) went before, or a new one where its own longest known prefix is, while that replica is
within its share of the load -- streams in flight and sessions between turns -- else to the least
loaded (services.runtime.affinity: with one replica no key is made). A replica that fails a stream
with UNAVAILABLE is unhealthy: skipped by new picks, re-probed with grpc.health.v1 Check every
`cooldown_s` until it answers SERVING. A replica that refuses a new stream because it is draining
(SIGTERM) is skipped the same way. A status that names a later stage (`voxpipe-stage`: the
replica's talker died, its code2wav drains) is that stage's failure and leaves the replica as it
was. A stream refused (UNAVAILABLE, or grpc's "Internal error from Core" that hides the status
when the refusal races a write) before its first response is replayed once on another replica;
after the first response a failure is the request's. Once its start is written (`end_head`), a
stream writes on only after the replica's admission headers (services.runtime.calls.
ADMITTED_METADATA), so a refusal of a start never races a write.
Channels ping every 20 s during streams, so a replica whose host vanished fails its streams
(UNAVAILABLE) within ~30 s instead of hanging them.

With `tls` (services.runtime.tls.ClientTLS) every channel -- streams and health probes -- is TLS
(mTLS with a client certificate). A plain entry's certificate is checked against its host; the
replicas of a dns:///name:port entry are dialled by IP address, so their certificates are
checked against `name` (or the ClientTLS's server_name when set).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .affinity import AffinityTable, Choice, RouteKey
from .calls import failed_stage, is_admitted
from .tls import ClientTLS, aio_channel

log = logging.getLogger(__name__)

DNS_SCHEME = "dns:"


@dataclass(frozen=True)
class BalancerOptions:
    resolve_interval_s: float = 5.0     # re-resolve dns:/// entries this often
    min_resolve_gap_s: float = 1.0      # re-resolution after failures happens at most this often
    cooldown_s: float = 3.0             # an unhealthy replica is skipped this long, then re-probed
    probe_timeout_s: float = 2.0        # one grpc.health.v1 Check
    retries: int = 1                    # replays of a stream refused before its first response
    # affinity (services.runtime.affinity): a replica's load is its streams in flight plus the sessions
    # placed on it that are between turns (for at most session_ttl_s); a new session or conversation
    # goes where its own prefix is while that replica carries at most ceil(load_bound * mean) +
    # load_slack after it, else to the least loaded; a placed one stays on its replica up to
    # ceil((load_bound + stay_margin) * mean) + load_slack; the table's bounds, in block hashes and sessions
    load_bound: float = 1.1
    load_slack: int = 1
    stay_margin: float = 0.15
    session_ttl_s: float = 120.0
    affinity_blocks: int = 65536
    affinity_sessions: int = 16384


@dataclass(frozen=True)
class Target:
    """One entry of an address list."""
    text: str           # as given
    host: str
    port: int
    dns: bool           # True: resolve `host` to all its addresses; False: one replica dialled as `text`

    @classmethod
    def parse(cls, entry: str) -> "Target":
        entry = entry.strip()
        if not entry.startswith(DNS_SCHEME):
            return cls(entry, entry, 0, False)
        rest = entry[len(DNS_SCHEME):]
        if rest.startswith("//"):
            authority, slash, rest = rest[2:].partition("/")
            if authority or not slash:
                raise ValueError(f"{entry!r}: a DNS server authority is not supported; use dns:///name:port")
        host, port = _split_host_port(rest)
        if port is None:
            raise ValueError(f"{entry!r}: dns:/// entries need a port (dns:///name:port)")
        return cls(entry, host, port, True)


def _split_host_port(text: str) -> tuple[str, int | None]:
    if text.startswith("["):                      # [v6]:port
        host, _, tail = text[1:].partition("]")
        port = tail[1:] if tail.startswith(":") else ""
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    else:                                         # bare name or bare v6 address
        host, port = text, ""
    if not host:
        raise ValueError(f"{text!r}: no host name")
    if port and not port.isdigit():
        raise ValueError(f"{text!r}: bad port {port!r}")
    return host, int(port) if port else None


def parse_targets(addresses: str | Iterable[str]) -> list[Target]:
    entries = addresses.split(",") if isinstance(addresses, str) else list(addresses)
    targets = [Target.parse(e) for e in entries if e.strip()]
    if not targets:
        raise ValueError("no address")
    return targets


def _address(family: int, ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"


def resolve(host: str, port: int) -> list[str]:
    """Every A/AAAA record of `host` as a dialable `ip:port` / `[ip6]:port`, in resolver order."""
    seen: dict[str, None] = {}
    for family, _, _, _, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        if family in (socket.AF_INET, socket.AF_INET6):
            seen[_address(family, sockaddr[0], port)] = None
    return list(seen)


class NoReplicaError(Exception):
    """No replica to send a stream to (a dns:/// name that does not resolve, say)."""


class Replica:
    """One server of a stage and this client's channel to it."""

    def __init__(self, address: str, channel: grpc.aio.Channel, static: bool) -> None:
        self.address, self.channel, self.static = address, channel, static
        self.in_flight = 0                  # streams of this client on it
        self.healthy = True                 # False: a stream failed UNAVAILABLE; until a probe says SERVING
        self.draining = False               # it refused a stream because it is shutting down
        self.retired = False                # left DNS: no new streams, channel closes when in_flight is 0
        self.probe: asyncio.Task | None = None

    @property
    def usable(self) -> bool:
        return self.healthy and not self.draining and not self.retired

    def __repr__(self) -> str:
        state = "ok" if self.usable else ("draining" if self.draining else "retired" if self.retired else "unhealthy")
        return f"Replica({self.address}, {state}, in_flight={self.in_flight})"


class StageBalancer:
    """The replicas of one stage (see the module docstring)."""

    def __init__(self, stage: str, addresses: str | Iterable[str], *, channel_options: list[tuple[str, Any]],
                 options: BalancerOptions | None = None, health_service: str = "",
                 tls: ClientTLS | None = None) -> None:
        self.stage, self.health_service, self.tls = stage, health_service, tls
        self.options = options or BalancerOptions()
        self.targets = parse_targets(addresses)
        backoff_ms = max(100, int(self.options.cooldown_s * 1000))
        self._channel_options = list(channel_options) + [
            ("grpc.use_local_subchannel_pool", 1),       # a fresh connection per client, not a shared one
            # during streams, ping every 20 s: a replica whose host vanished (no RST) fails its
            # streams after ~30 s instead of hanging them (servers allow pings every 10 s)
            ("grpc.keepalive_time_ms", 20_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.initial_reconnect_backoff_ms", min(1000, backoff_ms)),
            ("grpc.min_reconnect_backoff_ms", min(1000, backoff_ms)),
            ("grpc.max_reconnect_backoff_ms", backoff_ms),
        ]
        self._replicas: dict[str, Replica] = {}
        for t in self.targets:
            if not t.dns and t.text not in self._replicas:
                self._replicas[t.text] = self._new_replica(t.text, static=True)
        self._dns_targets = [t for t in self.targets if t.dns]
        self._retired: set[Replica] = set()
        self._rr = itertools.count()
        self._started: asyncio.Future | None = None
        self._refresher: asyncio.Task | None = None
        self._resolve_now: asyncio.Event | None = None
        self._last_resolve = float("-inf")
        self._background: set[asyncio.Task] = set()
        self._closed = False
        o = self.options
        self.affinity = AffinityTable(o.affinity_blocks, o.affinity_sessions, o.load_bound, o.load_slack,
                                      o.stay_margin, o.session_ttl_s)

    def _new_replica(self, address: str, static: bool, server_name: str | None = None) -> Replica:
        """`server_name`: the name its certificate must carry when it is not the dialled host (a
        replica resolved from a dns:/// entry is dialled by IP address)."""
        return Replica(address, aio_channel(address, self.tls, self._channel_options, server_name), static)

    @property
    def replicas(self) -> list[Replica]:
        """The replicas new streams may go to (unhealthy and draining ones included)."""
        return list(self._replicas.values())

    @property
    def choosing(self) -> bool:
        """Whether a pick is a choice (more than one replica known): a RouteKey is worth making."""
        return len(self._replicas) > 1

    # ------------------------------------------------------------------ resolution

    async def start(self) -> None:
        """Resolve the dns:/// entries once and start re-resolving them (idempotent; the first
        stream does it)."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._first_resolve())
        await asyncio.shield(self._started)

    async def _first_resolve(self) -> None:
        if not self._dns_targets:
            return
        self._resolve_now = asyncio.Event()
        await self._resolve_all()
        self._refresher = asyncio.ensure_future(self._refresh_loop())

    async def _refresh_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                await asyncio.wait_for(self._resolve_now.wait(), self.options.resolve_interval_s)
            except asyncio.TimeoutError:
                pass
            gap = self._last_resolve + self.options.min_resolve_gap_s - loop.time()
            if gap > 0:
                await asyncio.sleep(gap)
            self._resolve_now.clear()
            try:
                await self._resolve_all()
            except Exception:  # noqa: BLE001 - keep the replicas we have, try again next round
                log.exception("%s: re-resolving failed", self.stage)

    def request_resolve(self) -> None:
        """Re-resolve soon (after a connection failure): a pod that went away leaves DNS."""
        if self._resolve_now is not None:
            self._resolve_now.set()

    async def _resolve_all(self) -> None:
        self._last_resolve = asyncio.get_running_loop().time()
        results = await asyncio.gather(*(asyncio.to_thread(resolve, t.host, t.port) for t in self._dns_targets),
                                       return_exceptions=True)
        wanted: dict[str, str] = {}         # address -> the name it was resolved from
        failed = False
        for target, result in zip(self._dns_targets, results):
            if isinstance(result, BaseException):
                failed = True
                log.warning("%s: cannot resolve %s: %s", self.stage, target.text, result)
            else:
                for address in result:
                    wanted.setdefault(address, target.host)
        if self._closed:
            return
        for address, name in wanted.items():
            if address not in self._replicas:
                log.info("%s: replica %s added", self.stage, address)
                self._replicas[address] = self._new_replica(address, static=False, server_name=name)
        if failed:      # a resolver hiccup is not a scale-down: keep what we have
            return
        keep = set(wanted)
        for address, replica in list(self._replicas.items()):
            if not replica.static and address not in keep:
                log.info("%s: replica %s left DNS", self.stage, address)
                del self._replicas[address]
                self._retire(replica)

    def _retire(self, replica: Replica) -> None:
        replica.retired = True
        self.affinity.forget(replica.address)
        if replica.probe is not None:
            replica.probe.cancel()
        if replica.in_flight == 0:
            self._spawn(replica.channel.close())
        else:
            self._retired.add(replica)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------------ picking

    async def acquire(self, avoid: Iterable[Replica] = (), key: RouteKey | None = None) -> Replica:
        """The replica for a new stream (with `key`: by affinity), counted as in flight until `release`."""
        return (await self.lease(avoid, key))[0]

    async def lease(self, avoid: Iterable[Replica] = (), key: RouteKey | None = None,
                    unit: str | None = None) -> tuple[Replica, str | None]:
        """`acquire`, and the affinity unit the stream counts for (its session or chat conversation;
        None: neither): give both to `release` when the stream ends; `unit`: a replayed stream's."""
        await self.start()
        if not self._replicas and self._dns_targets:
            loop = asyncio.get_running_loop()
            if loop.time() - self._last_resolve >= self.options.min_resolve_gap_s:
                await self._resolve_all()
        replica, unit = self._pick(avoid, key, unit)
        replica.in_flight += 1
        return replica, unit

    def end_session(self, session: str) -> None:
        """The session is over: its replica no longer counts it, nor does its next stream (if any) follow it."""
        self.affinity.end(session)

    def pick(self, avoid: Iterable[Replica] = (), key: RouteKey | None = None) -> Replica:
        """Among the usable replicas not in `avoid`: with `key` and a choice to make, the affinity
        table's pick (the session's replica, its own longest known prefix, the least load -- streams
        and sessions between turns -- within the load bounds), else the least outstanding streams
        (ties round-robin); when none is usable, the best of the rest (a stream that fails is
        clearer than none). The pick is counted and, with `key`, recorded (its unit open there)."""
        return self._pick(avoid, key, None)[0]

    def _pick(self, avoid: Iterable[Replica], key: RouteKey | None, unit: str | None) -> tuple[Replica, str | None]:
        avoid = set(avoid)
        live = list(self._replicas.values())
        if not live:
            names = ", ".join(t.text for t in self.targets)
            raise NoReplicaError(f"no {self.stage} replica: {names} resolved to no address")

        def tier(r: Replica) -> tuple[bool, bool, bool]:
            return r.draining, r in avoid, not r.healthy

        best = min(tier(r) for r in live)
        candidates = [r for r in live if tier(r) == best]
        turn = next(self._rr)
        if key is not None and len(live) > 1 and best == (False, False, False):
            choice = self.affinity.choose(candidates, key, turn, unit)
        else:       # one replica, no key, or none usable: affinity never picks an unusable one
            low = min(r.in_flight for r in candidates)
            tied = [r for r in candidates if r.in_flight == low]
            choice = Choice(tied[turn % len(tied)], "least_loaded", 0)
        self.affinity.count(choice, key)
        if key is not None:
            unit = self.affinity.record(choice.replica.address, key, choice.unit or unit)
        return choice.replica, unit

    def release(self, replica: Replica, unit: str | None = None) -> None:
        """A stream on `replica` (of the affinity `unit` that `lease` gave) ended."""
        replica.in_flight -= 1
        self.affinity.closed(unit)
        if replica.retired and replica.in_flight == 0 and replica in self._retired:
            self._retired.discard(replica)
            self._spawn(replica.channel.close())

    # ------------------------------------------------------------------ health

    def report_success(self, replica: Replica) -> None:
        """A stream got its first response from `replica`."""
        if not replica.healthy or replica.draining:
            log.info("%s: replica %s is serving again", self.stage, replica.address)
        replica.healthy, replica.draining = True, False

    def report_failure(self, replica: Replica, code: grpc.StatusCode, details: str | None) -> None:
        """A stream on `replica` ended with `code`: UNAVAILABLE takes it out of new picks until a
        health probe says SERVING again."""
        if code != grpc.StatusCode.UNAVAILABLE or replica.retired or is_connection_recycle(details):
            return
        if is_draining(details):
            if not replica.draining:
                log.info("%s: replica %s is draining", self.stage, replica.address)
            replica.draining = True
        else:
            if replica.healthy:
                log.warning("%s: replica %s unavailable (%s); skipping it for %.1f s", self.stage, replica.address,
                            details, self.options.cooldown_s)
            replica.healthy = False
            self.request_resolve()
        self.affinity.forget(replica.address)
        self._start_probe(replica)

    def report_lost_status(self, replica: Replica) -> None:
        """A stream on `replica` ended before its first response but grpc lost its status (see
        LOST_STATUS): ask the replica's health now (NOT_SERVING: draining; no answer: unhealthy)."""
        if not replica.retired:
            self._start_probe(replica, check_now=True)

    def _start_probe(self, replica: Replica, check_now: bool = False) -> None:
        if replica.probe is None and not self._closed:
            replica.probe = asyncio.ensure_future(self._probe(replica, check_now))

    async def _probe(self, replica: Replica, check_now: bool) -> None:
        """grpc.health.v1 Check (now, or after a cooldown), then every cooldown until it answers
        SERVING, which makes the replica usable again."""
        stub = health_pb2_grpc.HealthStub(replica.channel)
        delay = 0.0 if check_now else self.options.cooldown_s
        try:
            while not self._closed and not replica.retired:
                await asyncio.sleep(delay)
                delay = self.options.cooldown_s
                try:
                    resp = await stub.Check(health_pb2.HealthCheckRequest(service=self.health_service),
                                            timeout=self.options.probe_timeout_s, wait_for_ready=True)
                except grpc.aio.AioRpcError as e:
                    log.debug("%s: probe of %s: %s", self.stage, replica.address, e.code().name)
                    if replica.healthy:
                        log.warning("%s: replica %s does not answer health checks (%s)", self.stage,
                                    replica.address, e.code().name)
                        self.affinity.forget(replica.address)
                    replica.healthy = False
                    continue
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    self.report_success(replica)
                    return
                if not replica.draining:
                    log.info("%s: replica %s is not serving (draining)", self.stage, replica.address)
                    self.affinity.forget(replica.address)
                replica.draining = True
        finally:
            replica.probe = None

    # ------------------------------------------------------------------ closing

    async def close(self) -> None:
        self._closed = True
        tasks = [t for t in (self._refresher, self._started) if t is not None]
        tasks += [r.probe for r in self._replicas.values() if r.probe is not None]
        for t in tasks:
            t.cancel()
        channels = [r.channel for r in self._replicas.values()] + [r.channel for r in self._retired]
        self._replicas.clear()
        self._retired.clear()
        await asyncio.gather(*tasks, *self._background, return_exceptions=True)
        for ch in channels:
            await ch.close()


# grpc's Python layer reports this instead of the call's status when a write races the server
# ending the call (it does so on refusing a stream at once: draining, queue full, bad start);
# the real status is lost for good.
LOST_STATUS = "Internal error from Core"


# how long a stream whose replica's headers lack the admission key waits for a status (a refusal's
# comes with them) before it takes the replica for an older version that admits without saying so
UNMARKED_HEADERS_WAIT_S = 0.2


def is_lost_status(code: grpc.StatusCode, details: str | None) -> bool:
    return code == grpc.StatusCode.INTERNAL and details == LOST_STATUS


def is_draining(details: str | None) -> bool:
    """The stage servers refuse new streams with UNAVAILABLE "... is draining ..." after SIGTERM."""
    return "draining" in (details or "").lower()


def is_connection_recycle(details: str | None) -> bool:
    """A stream cut because the server closed an old connection (max_connection_age): the replica is fine."""
    return "max connection age" in (details or "").lower()


def is_ending(resp) -> bool:
    """A stage's Ending response (stages.proto): its status follows; stop writing and half-close."""
    try:
        return resp.WhichOneof("kind") == "ending"
    except (AttributeError, ValueError):    # not a message with a `kind` oneof
        return False


def status_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class BalancedStream:
    """A bidirectional stream on one replica of a stage, for its whole life.

    Until the first response arrives, the messages written are kept; when the replica refuses
    the stream with UNAVAILABLE before then (connection refused, draining, died before
    answering), the stream is reopened on another replica and the messages are replayed
    (`options.retries` times at most). After the first response a failure is final. Reading:
    `async for response in stream`; writing: `write`, `done_writing` (as grpc.aio calls).
    An Ending response (the replica's error status follows) is not passed on and commits nothing:
    the call is half-closed at once, later writes only kept for a replay, so that the status does
    not race a write (grpc-Python would report it as LOST_STATUS).
    """

    def __init__(self, balancer: StageBalancer, open_call: Callable[[grpc.aio.Channel], Any],
                 on_replica: Callable[[Replica], None] | None = None, key: RouteKey | None = None) -> None:
        """`key`: the stream's affinity (its session, its prompt's blocks) for the pick and any replay's."""
        self.balancer, self._open_call, self._on_replica, self.key = balancer, open_call, on_replica, key
        self.replica: Replica | None = None
        self._call = None
        self._tried: list[Replica] = []
        self._unit: str | None = None      # the affinity unit (session, chat conversation) the stream counts for
        self._sent: list | None = []        # replayed on a retry; None once the first response came
        self._head: int | None = None       # messages of the stream's start, once all written (end_head)
        self._admitted = None               # the call whose replica admitted the stream
        self._half_closed = False
        self._ending = None                 # the call that sent an Ending response: nothing more is written to it
        self._lock = asyncio.Lock()
        self._closed = False

    async def open(self) -> "BalancedStream":
        replica, self._unit = await self.balancer.lease(key=self.key)
        self._attach(replica)
        return self

    def _attach(self, replica: Replica) -> None:
        self.replica = replica
        self._tried.append(replica)
        self._call = self._open_call(replica.channel)
        if self._on_replica is not None:
            self._on_replica(replica)

    @property
    def committed(self) -> bool:
        return self._sent is None

    @property
    def ended(self) -> bool:
        """The current call has ended (its status is in; a reader would see it)."""
        return self._call is not None and self._call.done()

    def _may_retry(self) -> bool:
        return not self.committed and len(self._tried) <= self.balancer.options.retries and not self._closed

    def end_head(self) -> None:
        """The stream's start (its first message and continuations) is written: every later write
        waits until the replica admits the stream (its ADMITTED_METADATA response headers). A
        refusal then ends the call while nothing is being written, so its status comes through
        (a write racing it would turn it into LOST_STATUS)."""
        if self._head is None:
            self._head = len(self._sent) if self._sent is not None else 0

    async def _admission(self) -> bool:
        """Whether the current call's replica admitted the stream (waits for its response headers;
        False: it refused, and the reader gets the status)."""
        call = self._call
        if self._head is None or call is self._admitted:
            return True
        if not is_admitted(await call.initial_metadata()):
            # headers without the admission key: a refusal (trailers only, its status right behind them)
            # or a replica from before admission headers, whose headers came with its first response
            try:
                await asyncio.wait_for(asyncio.shield(call.code()), UNMARKED_HEADERS_WAIT_S)
                return False
            except asyncio.TimeoutError:
                log.debug("%s: %s sends no admission headers (an older version): writing on", self.balancer.stage,
                          self.replica.address if self.replica else "?")
        self._admitted = call
        return True

    async def write(self, msg) -> None:
        async with self._lock:
            if self._sent is not None:
                self._sent.append(msg)
            if self._call is self._ending or not await self._admission():
                return          # ending or refused: the reader sees the status (and may replay this on another replica)
            await self._forward(self._call.write(msg))

    async def done_writing(self) -> None:
        async with self._lock:
            self._half_closed = True
            if self._call is self._ending or not await self._admission():
                return
            await self._forward(self._call.done_writing())

    async def _end_writing(self, call) -> None:
        """`call` sent an Ending response: half-close it (once any write in flight is done)."""
        async with self._lock:
            if call is not self._call or call is self._ending:
                return
            self._ending = call
            if self._half_closed:
                return
            try:
                await call.done_writing()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                pass            # the call ended already: the reader sees its status

    async def _forward(self, op) -> None:
        call = self._call
        try:
            await op
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
            if self._may_retry():
                return          # the reader sees the call's status and moves the stream
            if isinstance(e, asyncio.InvalidStateError) and call.done():
                code = await call.code()
                if code != grpc.StatusCode.OK:
                    raise status_error(code, await call.details()) from None
            raise

    async def __aiter__(self) -> AsyncIterator[Any]:
        while True:
            call = self._call
            try:
                async for resp in call:
                    if is_ending(resp):
                        await self._end_writing(call)
                        continue
                    if self._sent is not None:
                        self._sent = None
                        self.balancer.report_success(self.replica)
                    yield resp
                return
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.CANCELLED and self._closed:
                    raise
                lost = is_lost_status(e.code(), e.details())
                if lost and not self.committed:
                    self.balancer.report_lost_status(self.replica)
                elif failed_stage(e, self.balancer.stage) == self.balancer.stage:
                    # a status naming a later stage (voxpipe-stage: its talker died or drains) is not this replica's
                    self.balancer.report_failure(self.replica, e.code(), e.details())
                if not (e.code() == grpc.StatusCode.UNAVAILABLE or lost) or not self._may_retry():
                    raise
                await self._move(e)

    async def _move(self, error: grpc.aio.AioRpcError) -> None:
        """Reopen the stream on another replica and replay what was written."""
        async with self._lock:
            failed = self.replica
            replica, unit = await self.balancer.lease(avoid=self._tried, key=self.key, unit=self._unit)
            self.balancer.release(failed, self._unit)
            self._unit = unit
            log.info("%s: stream refused by %s (%s: %s); retrying on %s", self.balancer.stage, failed.address,
                     error.code().name, error.details(), replica.address)
            self._attach(replica)
            try:
                for i, msg in enumerate(self._sent):
                    if self._head is not None and i >= self._head and not await self._admission():
                        return  # refused again: the reader sees the new call's status
                    await self._call.write(msg)
                if self._half_closed and await self._admission():
                    await self._call.done_writing()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                pass            # the reader sees the new call's status

    def cancel(self) -> None:
        if self._call is not None:
            self._call.cancel()

    def close(self) -> None:
        """Cancel the call (if still running) and give the replica back; idempotent."""
        if self._closed:
            return
        self._closed = True
        self.cancel()
        if self.replica is not None:
            self.balancer.release(self.replica, self._unit)
