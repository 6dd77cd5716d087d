"""Many real DHT nodes on 127.0.0.1 in one process, each stoppable on its own."""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio

from dht import DHTConfig, DHTNode, open_dht_node
from dht._aio import open_asyncio_loop
from swarm import Identity, WallClock

TEST_CONFIG = DHTConfig(rpc_timeout=0.5, bootstrap_timeout=5.0)


@dataclass
class _Running:
    node: DHTNode
    stop: trio.Event = field(default_factory=trio.Event)
    stopped: trio.Event = field(default_factory=trio.Event)


class Swarm:
    def __init__(
        self, nursery: trio.Nursery, clock: WallClock, config: DHTConfig, seed: int
    ) -> None:
        self._nursery = nursery
        self._clock = clock
        self._config = config
        self._random = random.Random(seed)
        self._running: list[_Running] = []

    @property
    def nodes(self) -> list[DHTNode]:
        return [r.node for r in self._running if not r.stop.is_set()]

    async def add(self, identity: Identity | None = None, *, port: int = 0) -> DHTNode:
        alive = self.nodes
        initial = [self._random.choice(alive).address] if alive else []
        running: _Running = await self._nursery.start(self._run, identity, initial, port)
        self._running.append(running)
        return running.node

    async def _run(
        self,
        identity: Identity | None,
        initial: list[str],
        port: int,
        task_status: trio.TaskStatus[_Running] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        running: _Running | None = None
        try:
            async with open_dht_node(
                identity or Identity.from_seed(self._random.randbytes(32)),
                host="127.0.0.1",
                port=port,
                initial_peers=initial,
                config=self._config,
                clock=self._clock,
            ) as node:
                running = _Running(node)
                task_status.started(running)
                await running.stop.wait()
        finally:
            if running is not None:
                running.stopped.set()

    async def stop(self, node: DHTNode) -> None:
        running = next(r for r in self._running if r.node is node)
        running.stop.set()
        await running.stopped.wait()


@asynccontextmanager
async def open_pair(
    config: DHTConfig, clock: WallClock, *, rate_clock: Callable[[], float] = time.monotonic
) -> AsyncIterator[tuple[DHTNode, DHTNode]]:
    """A target node (budgets refilled by ``rate_clock``) and a well-behaved node
    joined through it, both on 127.0.0.1 with fixed identities."""
    async with (
        open_dht_node(
            Identity.from_seed(b"T" * 32), config=config, clock=clock, rate_clock=rate_clock
        ) as target,
        open_dht_node(
            Identity.from_seed(b"H" * 32),
            initial_peers=[target.address],
            config=config,
            clock=clock,
        ) as honest,
    ):
        yield target, honest


async def send_datagrams(
    node: DHTNode,
    datagrams: list[bytes],
    *,
    batch: int = 64,
    source: trio.socket.SocketType | None = None,
) -> None:
    """Send ``datagrams`` from ``source`` (or one fresh 127.0.0.1 socket) to ``node``,
    as fast as it reads them: a batch at a time, so the kernel's socket buffer
    never overflows and every datagram reaches the node (and so do other peers')."""
    if source is None:
        with trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM) as sock:
            await sock.bind(("127.0.0.1", 0))
            await send_datagrams(node, datagrams, batch=batch, source=sock)
        return
    proto = node._server.proto
    for start in range(0, len(datagrams), batch):
        before = proto.received_datagrams
        chunk = datagrams[start : start + batch]
        for data in chunk:
            await source.sendto(data, ("127.0.0.1", node.port))
        for _ in range(10_000):  # bounded: 10 s at most
            if proto.received_datagrams >= before + len(chunk):
                break
            await trio.sleep(0.001)
        else:
            raise AssertionError("the node stopped reading datagrams")


@asynccontextmanager
async def open_swarm(
    size: int, clock: WallClock, *, config: DHTConfig = TEST_CONFIG, seed: int = 0
) -> AsyncIterator[Swarm]:
    # one asyncio loop for all nodes, as many nodes in one process should share
    async with open_asyncio_loop(), trio.open_nursery() as nursery:
        swarm = Swarm(nursery, clock, config, seed)
        for _ in range(size):
            await swarm.add()
        yield swarm
        nursery.cancel_scope.cancel()
