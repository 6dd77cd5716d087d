"""``TrainerPeer``: what the collaborative optimizer uses of a peer.

The trainer depends on this Protocol, not on the ``swarm.AsyncPeer`` class:
any object with these members (the real ``AsyncPeer`` from ``open_peer``, a
peer of a test harness) can train. ``SyncTrainerPeer`` is what the
synchronous facade ``CollaborativeOptimizer`` uses of ``swarm.Peer``: the
trio thread it runs the coordinator on, and the async peer inside it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import trio

from dht import DHTNode
from swarm import PeerID
from swarm._connections import Connections
from swarm._reachability import Reachability

T = TypeVar("T")

__all__ = ["SyncTrainerPeer", "TrainerPeer"]


class TrainerPeer(Protocol):
    """What ``AsyncCollaborativeOptimizer`` uses of a running peer; all of it
    on the peer's trio thread."""

    @property
    def peer_id(self) -> PeerID: ...

    @property
    def endpoint(self) -> tuple[str, int]: ...

    @property
    def client_mode(self) -> bool: ...

    @property
    def dht(self) -> DHTNode: ...

    @property
    def connections(self) -> Connections: ...

    @property
    def reachability(self) -> Reachability: ...

    @property
    def relay_route(self) -> tuple[str, int] | None: ...

    async def start_service(
        self, fn: Callable[..., Awaitable[Any]], *args: Any
    ) -> trio.CancelScope:
        """Run ``fn(*args, task_status=...)`` as a service that stops with the
        peer or when the returned scope is cancelled."""
        ...


class SyncTrainerPeer(Protocol):
    """What ``CollaborativeOptimizer`` uses of a sync peer (``swarm.Peer``):
    its trio thread and the async peer that runs there."""

    @property
    def peer_id(self) -> PeerID: ...

    @property
    def async_peer(self) -> TrainerPeer: ...

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``await fn(*args)`` on the peer's trio thread, blocking until done."""
        ...

    def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the peer's trio thread, blocking until done."""
        ...
