"""Resource limits under a flood from one address (real sockets on 127.0.0.1).

A host that opens hundreds of connections is refused beyond
``ConnectionConfig.max_connections_per_address``, before any handshake work,
and the listener serves again once the flood ends. A newcomer cannot take
more than ``StateTransferConfig.max_uploads_per_peer`` of a donor's upload
slots.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
import trio
import trio.testing

from averaging._state_transfer import (
    PROTOCOL_VERSION,
    DonorBusy,
    StateTransferConfig,
    decode_header,
    load_state_from_peers,
    serve_state,
    state_stream,
)
from dht import DHTConfig
from swarm import ConfigError, Identity, PeerUnreachableError, Stream
from swarm._connections import ConnectionConfig, open_connections
from swarm._peer import PeerConfig, open_peer

HOST = "127.0.0.1"
FLOOD = 300
A = Identity.from_seed(b"r" * 32)
B = Identity.from_seed(b"s" * 32)


async def echo(stream: Stream) -> None:
    await stream.send(await stream.receive())


async def _wait_until(condition: Callable[[], bool]) -> None:
    """Let the listener's tasks run until ``condition`` holds (at most 30 s):
    it accepts and closes sockets as the kernel reports them, with no event
    of its own to wait on."""
    with trio.fail_after(30):
        while not condition():
            await trio.testing.wait_all_tasks_blocked(cushion=0.01)


async def test_a_host_opening_hundreds_of_connections_is_refused_beyond_its_limit() -> None:
    # Defaults but a long handshake timeout: the flood's silent connections
    # must stay open for the whole test, however loaded the machine.
    config = ConnectionConfig(handshake_timeout=600.0)
    limit = config.max_connections_per_address
    assert limit == 64 < FLOOD < config.max_connections + limit
    async with open_connections(A, config=config) as a, open_connections(B) as b:
        a.set_handler("echo", echo)
        flood: list[trio.SocketStream] = []
        try:
            for _ in range(FLOOD):
                flood.append(await trio.open_tcp_stream(HOST, a.port))
            await _wait_until(lambda: a.inbound_count() + a.refused_inbound == FLOOD)
            assert a.inbound_count(HOST) == a.inbound_count() == limit
            assert a.refused_inbound == FLOOD - limit
            # Another peer from the same address is refused too while the flood lasts.
            with pytest.raises(PeerUnreachableError):
                await b.call(A.peer_id, (HOST, a.port), "echo", 1, timeout=10)
        finally:
            for sock in flood:
                sock.socket.close()
        await _wait_until(lambda: a.inbound_count() == 0)
        assert await b.call(A.peer_id, (HOST, a.port), "echo", 2, timeout=10) == 2


def test_per_address_limit_is_validated() -> None:
    with pytest.raises(ConfigError, match="max_connections_per_address"):
        ConnectionConfig(max_connections_per_address=0)
    with pytest.raises(ConfigError, match="max_uploads_per_peer"):
        StateTransferConfig(max_uploads=2, max_uploads_per_peer=3)


async def test_one_newcomer_cannot_take_every_upload_slot() -> None:
    state = {"w": torch.arange(4096, dtype=torch.float32)}
    config = StateTransferConfig(chunk_size=1024, max_uploads=2, max_uploads_per_peer=1)
    holding, release = trio.Event(), trio.Event()

    async def hold_first_upload(upload: int, chunk: int) -> None:
        if upload == 0 and chunk == 1:
            holding.set()
            await release.wait()

    dht = DHTConfig(rpc_timeout=0.3)
    with trio.fail_after(20):
        async with (
            open_peer(Identity.from_seed(b"d" * 32), PeerConfig(dht=dht)) as donor,
            trio.open_nursery() as nursery,
        ):
            await nursery.start(
                functools.partial(
                    serve_state,
                    donor,
                    "run",
                    lambda: ({"epoch": 1}, state),
                    config=config,
                    before_chunk=hold_first_upload,
                )
            )
            joined = PeerConfig(initial_peers=(donor.address,), dht=dht)
            async with open_peer(config=joined) as greedy, open_peer(config=joined) as other:
                loaded: list[object] = []
                first_done = trio.Event()

                async def first_load() -> None:
                    loaded.append(await load_state_from_peers(greedy, "run", config=config))
                    first_done.set()

                nursery.start_soon(first_load)
                await holding.wait()
                # The same newcomer asks for a second upload: busy...
                async with greedy.connections.open_stream(
                    donor.peer_id, donor.endpoint, state_stream("run")
                ) as stream:
                    await stream.send([PROTOCOL_VERSION, 2**30])
                    with pytest.raises(DonorBusy, match="to this peer"):
                        decode_header(await stream.receive(), max_header_bytes=4096, max_bytes=0)
                # ...while another newcomer still gets the second slot.
                assert await load_state_from_peers(other, "run", config=config) is not None
                release.set()
                await first_done.wait()
                assert loaded[0] is not None
            nursery.cancel_scope.cancel()
