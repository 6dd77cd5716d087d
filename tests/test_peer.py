"""The peer facade: one port for DHT and connections; the sync runtime thread."""

import threading
import time
import traceback

import pytest
import trio

from swarm import (
    BootstrapError,
    ClosedError,
    ConfigError,
    Peer,
    PeerConfig,
    PeerCrashedError,
    PeerUnreachableError,
    open_peer,
)
from swarm.cli import _report_failure


async def test_peers_listen_on_one_port_and_join() -> None:
    async with open_peer() as first:
        assert first.dht.port == first.connections.port == first.port
        config = PeerConfig(initial_peers=(first.address,))
        async with open_peer(config=config) as second:
            assert second.dht.routing_table_size() == 1
            await second.dht.store("k", "v", second.dht.now() + 30)
            found = await first.dht.get("k")
            assert found is not None and found.value == "v"


async def test_taken_port_is_a_config_error() -> None:
    async with open_peer() as first:
        with pytest.raises(ConfigError, match="cannot listen"):
            async with open_peer(config=PeerConfig(port=first.port)):
                pass


async def test_unreachable_initial_peer_is_a_bootstrap_error() -> None:
    async with open_peer() as alone:
        port = alone.port
    with pytest.raises(BootstrapError):
        async with open_peer(config=PeerConfig(initial_peers=(f"127.0.0.1:{port}",))):
            pass


def test_config_is_validated() -> None:
    with pytest.raises(ConfigError):
        PeerConfig(port=70000)
    with pytest.raises(ConfigError):
        PeerConfig(initial_peers=("nonsense",))
    with pytest.raises(ConfigError):
        PeerConfig(initial_peers="127.0.0.1:5")  # type: ignore[arg-type]


def test_sync_peer_runs_trio_in_one_thread_and_joins_it() -> None:
    before = threading.active_count()
    with Peer() as a, Peer(config=PeerConfig(initial_peers=(a.address,))) as b:
        assert b.dht.store("sync", [1, 2], time.time() + 30)
        found = a.dht.get("sync", latest=True)
        assert found is not None and found.value == [1, 2]
        assert a.run(trio.sleep, 0) is None
    assert threading.active_count() == before


def test_sync_peer_reraises_startup_errors() -> None:
    with Peer() as alone:
        port = alone.async_peer.port
    config = PeerConfig(initial_peers=(f"127.0.0.1:{port}",))
    with pytest.raises(BootstrapError), Peer(config=config):
        pass


async def test_a_service_that_fails_as_the_peer_stops_does_not_crash_it() -> None:
    """A ``SwarmError`` of a service while the peer stops (its relay closed
    their connection as it finished too) is the stopping, not a crash; the
    same error while the peer runs still ends it."""
    stopping = trio.Event()

    async def relay_gone(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            stopping.set()
            raise PeerUnreachableError("the relay closed the connection")

    async with open_peer() as peer:
        await peer.start_service(relay_gone)
    assert stopping.is_set()  # it failed, and leaving the block raised nothing

    async def fails_now(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        raise PeerUnreachableError("the relay closed the connection")

    with pytest.raises(PeerUnreachableError):
        async with open_peer() as peer:
            await peer.start_service(fails_now)
            await trio.sleep_forever()


async def test_a_service_started_after_the_peer_stopped_is_refused_as_closed() -> None:
    """A task that outlives its peer (an optimizer's step racing the peer's
    end) is told the peer stopped, not trio's "Nursery is closed"."""
    started: list[str] = []

    async def service(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        started.append("started")
        task_status.started()
        await trio.sleep_forever()

    async with open_peer() as peer:
        await peer.start_service(service)
    with pytest.raises(ClosedError, match="stopped"):
        await peer.start_service(service)
    assert started == ["started"]


def test_sync_peer_surfaces_a_crash_of_its_thread_with_its_traceback() -> None:
    async def crash(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        raise RuntimeError("a service of the peer failed")

    peer = Peer()
    with pytest.raises(ClosedError, match="crashed") as closed, peer:
        peer.run(peer.async_peer.start_service, crash)
        # the crash ends the peer's trio run: the next call says so, with the cause
        peer.run(trio.sleep_forever)
    leaf = closed.value.__cause__
    while isinstance(leaf, BaseExceptionGroup):  # however trio's nurseries wrapped it
        (leaf,) = leaf.exceptions
    assert isinstance(leaf, RuntimeError) and leaf.__traceback__ is not None
    assert "crash" in "".join(traceback.format_tb(leaf.__traceback__))


def test_the_cli_prints_where_the_peers_thread_crashed(caplog: pytest.LogCaptureFixture) -> None:
    async def failing_service(
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        task_status.started()
        raise RuntimeError("a service of the peer failed")

    peer = Peer()
    with pytest.raises(PeerCrashedError) as crashed, peer:
        peer.run(peer.async_peer.start_service, failing_service)
        peer.run(trio.sleep_forever)
    _report_failure("train", crashed.value)
    # not only the message: the frames of the crash, down to the failing service
    (record,) = [r for r in caplog.records if r.exc_info]
    assert record.exc_info is not None and record.exc_info[1] is crashed.value.crash
    assert "failing_service" in caplog.text and "a service of the peer failed" in caplog.text


def test_sync_peer_close_raises_a_crash_nobody_was_told_of() -> None:
    async def crash(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        raise RuntimeError("a service of the peer failed")

    peer = Peer().__enter__()
    peer.run(peer.async_peer.start_service, crash)
    with pytest.raises(ClosedError, match="crashed"):
        peer.close()
    peer.close()  # idempotent: the crash was reported once
