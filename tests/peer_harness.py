"""Many real peers (DHT + connections) on 127.0.0.1 in one process; any can be killed."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio

from averaging import AllReduceConfig, AveragerConfig
from averaging._matchmaking import MatchmakingConfig
from dht import DHTConfig
from dht._aio import open_asyncio_loop
from swarm import AsyncPeer, Identity, PeerConfig, WallClock, open_peer, system_clock

TEST_DHT = DHTConfig(rpc_timeout=0.5, bootstrap_timeout=5.0)


def trio_wall_clock() -> float:
    """A wall clock that follows trio's clock: with a ``MockClock``, DHT
    expiration times and matchmaking deadlines move with virtual time."""
    return 1_700_000_000.0 + trio.current_time()


@dataclass(eq=False)
class _Running:
    peer: AsyncPeer
    scope: trio.CancelScope
    stopped: trio.Event = field(default_factory=trio.Event)


class Peers:
    def __init__(self, nursery: trio.Nursery, seed: int, clock: WallClock) -> None:
        self._nursery = nursery
        self._clock = clock
        self._random = random.Random(seed)
        self._running: list[_Running] = []

    @property
    def alive(self) -> list[AsyncPeer]:
        return [r.peer for r in self._running if not r.scope.cancel_called]

    async def add(
        self, *, client_mode: bool = False, identity: Identity | None = None
    ) -> AsyncPeer:
        alive = self.alive
        config = PeerConfig(
            initial_peers=(self._random.choice(alive).address,) if alive else (),
            client_mode=client_mode,
            dht=TEST_DHT,
        )
        identity = identity or Identity.from_seed(self._random.randbytes(32))
        running: _Running = await self._nursery.start(self._run, identity, config)
        self._running.append(running)
        return running.peer

    async def _run(
        self,
        identity: Identity,
        config: PeerConfig,
        task_status: trio.TaskStatus[_Running] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        with trio.CancelScope() as scope:
            running: _Running | None = None
            try:
                async with open_peer(identity, config, clock=self._clock) as peer:
                    running = _Running(peer, scope)
                    task_status.started(running)
                    await trio.sleep_forever()
            finally:
                if running is not None:
                    running.stopped.set()

    def crash(self, peer: AsyncPeer) -> None:
        """Stop a peer abruptly, from synchronous code (e.g. a fault-plan hook)."""
        next(r for r in self._running if r.peer is peer).scope.cancel()

    async def kill(self, peer: AsyncPeer) -> None:
        """Stop a peer abruptly: its connections drop, its DHT node goes silent."""
        running = next(r for r in self._running if r.peer is peer)
        running.scope.cancel()
        await running.stopped.wait()


@asynccontextmanager
async def open_peers(
    count: int, *, seed: int = 0, clock: WallClock = system_clock
) -> AsyncIterator[Peers]:
    async with open_asyncio_loop(), trio.open_nursery() as nursery:
        peers = Peers(nursery, seed, clock)
        for _ in range(count):
            await peers.add()
        yield peers
        nursery.cancel_scope.cancel()


def averager_config(
    *,
    group_size: int = 4,
    min_group_size: int = 2,
    matchmaking_time: float = 2.0,
    request_timeout: float = 1.0,
    poll_interval: float | None = 0.2,
    sender_timeout: float = 1.0,
    round_timeout: float = 6.0,
) -> AveragerConfig:
    """Averaging for peers on 127.0.0.1: short matchmaking, a reducer timeout
    twice the sender's (``poll_interval`` None: the default)."""
    polling = {} if poll_interval is None else {"poll_interval": poll_interval}
    return AveragerConfig(
        matchmaking=MatchmakingConfig(
            target_group_size=group_size,
            min_group_size=min_group_size,
            matchmaking_time=matchmaking_time,
            request_timeout=request_timeout,
            **polling,
        ),
        allreduce=AllReduceConfig(
            sender_timeout=sender_timeout,
            reducer_timeout=2 * sender_timeout,
            round_timeout=round_timeout,
        ),
    )
