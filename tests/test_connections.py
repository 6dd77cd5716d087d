"""Peer connections over real sockets on 127.0.0.1 (ephemeral ports).

Tests wait on events and on ``trio.testing.wait_all_tasks_blocked``; none sleeps
and hopes. The MITM proxy below flips one byte at a chosen offset of one
direction of a TCP connection.
"""

from __future__ import annotations

import errno
import hashlib
import random
import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing
from mitm_harness import serve_proxy

from swarm import (
    ClosedError,
    ConfigError,
    DeadlineError,
    Identity,
    PeerUnreachableError,
    ProtocolError,
)
from swarm._connections import (
    _SEND_LOW_WATER,
    MIN_REDIAL_AFTER,
    REDIAL_AFTER,
    ConnectionConfig,
    Connections,
    Stream,
    _Connection,
    _smoothed_rtt,
    open_connections,
    open_tcp_racing,
)
from swarm._errors import EndOfStreamError, StreamResetError
from swarm._framing import FrameKind
from swarm._handshake import Handshake
from swarm._wire import pack

A = Identity.from_seed(b"A" * 32)
B = Identity.from_seed(b"B" * 32)
C = Identity.from_seed(b"C" * 32)
HOST = "127.0.0.1"

PLAIN = ConnectionConfig(encrypt=False)
MODES = [pytest.param(ConnectionConfig(), id="encrypted"), pytest.param(PLAIN, id="plain")]


@asynccontextmanager
async def two_peers(
    config_a: ConnectionConfig | None = None, config_b: ConnectionConfig | None = None
) -> AsyncIterator[tuple[Connections, Connections]]:
    async with open_connections(A, config=config_a) as a, open_connections(B, config=config_b) as b:
        yield a, b


async def echo(stream: Stream) -> None:
    async for message in receive_all(stream):
        await stream.send(message)


async def receive_all(stream: Stream) -> AsyncIterator[Any]:
    while True:
        try:
            yield await stream.receive()
        except EndOfStreamError:
            return


def address(net: Connections) -> tuple[str, int]:
    return (HOST, net.port)


@pytest.mark.parametrize("config", MODES)
async def test_call_and_stream_both_modes(config: ConnectionConfig) -> None:
    async with two_peers(config, config) as (a, b):
        seen: list[bytes] = []

        async def whoami(stream: Stream) -> None:
            seen.append(stream.remote)
            request = await stream.receive()
            await stream.send({"you": bytes(stream.remote), "asked": request})

        b.set_handler("whoami", whoami)
        b.set_handler("echo", echo)
        reply = await a.call(B.peer_id, address(b), "whoami", [1, "x"], timeout=5)
        assert reply == {"you": bytes(A.peer_id), "asked": [1, "x"]}
        assert seen == [A.peer_id]

        async with a.open_stream(B.peer_id, address(b), "echo") as stream:
            assert stream.remote == B.peer_id
            await stream.send({"k": [1, 2.5, None]})
            await stream.send_bytes(b"raw bytes")
            await stream.send_bytes(memoryview(bytearray(b"view")))
            assert await stream.receive() == {"k": [1, 2.5, None]}
            assert await stream.receive() == b"raw bytes"
            assert await stream.receive() == b"view"
            await stream.send_eof()
            with pytest.raises(EndOfStreamError):
                await stream.receive()
            with pytest.raises(EndOfStreamError):  # and again
                await stream.receive()
            with pytest.raises(ClosedError):
                await stream.send(1)
        with pytest.raises(ClosedError):  # its connection went back to the pool
            await stream.receive()


async def test_mixed_modes_are_encrypted() -> None:
    """A session is encrypted if either side asks: plaintext needs both."""
    async with two_peers(PLAIN, ConnectionConfig()) as (a, b):
        b.set_handler("echo", echo)
        assert await a.call(B.peer_id, address(b), "echo", "hi", timeout=5) == "hi"
        (connection,) = a._connections
        assert connection.encrypted


async def test_sequential_streams_reuse_one_connection() -> None:
    async with two_peers() as (a, b):
        b.set_handler("echo", echo)
        for i in range(5):
            assert await a.call(B.peer_id, address(b), "echo", i, timeout=5) == i
        assert len(a._connections) == 1
        assert len(b._connections) == 1


async def test_a_listener_derives_its_streams_keys_from_the_dialers_connections() -> None:
    """``inbound_key_exporters``: the listener has, for each connection the
    dialer made to it, the keys of the streams on it before any message of
    theirs came (the lossy round's header copy); a dialer has none from the
    peer it dialed."""
    async with two_peers() as (a, b):
        b.set_handler("echo", echo)
        label = b"swarm/test-label"
        async with a.open_stream(B.peer_id, address(b), "echo") as stream:
            await stream.send("hello")
            assert await stream.receive() == "hello"
            [export] = b.inbound_key_exporters(A.peer_id)
            assert export(label) == stream.export_key(label)
            assert export(b"swarm/other-label") != stream.export_key(label)
            assert a.inbound_key_exporters(B.peer_id) == []
            assert b.inbound_key_exporters(B.peer_id) == []


async def test_both_ends_resend_a_lost_segment_after_milliseconds() -> None:
    """Each side of a connection asks the kernel for a least retransmission
    timeout of 10 ms (20 ms where the kernel's clock cannot time 10) and for
    delayed ACKs no longer, in place of Linux's 200 ms, which stalls every
    control message that a lossy link loses (``_shorten_retransmission_timer``)."""
    tcp_rto_min_us, tcp_delack_max_us = 45, 46
    async with two_peers() as (a, b):
        b.set_handler("echo", echo)
        assert await a.call(B.peer_id, address(b), "echo", 1, timeout=5) == 1
        sockets = [c.socket for net in (a, b) for c in net._connections]
        assert len(sockets) == 2
        for sock in sockets:
            try:
                rto_min = sock.getsockopt(socket.IPPROTO_TCP, tcp_rto_min_us)
            except OSError as e:  # a kernel before 6.15: its defaults, and the call worked
                assert e.errno == errno.ENOPROTOOPT
                continue
            assert 8_000 <= rto_min <= 20_000  # the kernel rounds up to its clock's tick
            assert sock.getsockopt(socket.IPPROTO_TCP, tcp_delack_max_us) == rto_min


def data_segments_sent(sock: socket.socket) -> int:
    """``tcpi_data_segs_out`` of Linux's ``struct tcp_info`` (4.6 and later)."""
    return int(
        struct.unpack_from("=I", sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256), 156)[0]
    )


@pytest.mark.parametrize("nudge", [True, False])
async def test_a_small_send_leaves_with_a_nudge_in_a_segment_of_its_own(nudge: bool) -> None:
    """A control message is followed by a ``NUDGE`` frame, sent apart: lost
    alone, its segment waits for a timer, while with a segment behind it the
    remote's ACK of that one says it is missing (RACK) within a round trip.
    The remote hands out the message only. Raw payloads get no nudge."""
    config = ConnectionConfig(nudge=nudge)
    async with two_peers(config, config) as (a, b):
        b.set_handler("echo", echo)
        async with a.open_stream(B.peer_id, address(b), "echo") as stream:
            await stream.send("warm")
            assert await stream.receive() == "warm"
            [connection] = a._connections
            before = data_segments_sent(connection.socket)
            await stream.send("hello")
            assert await stream.receive() == "hello"
            assert data_segments_sent(connection.socket) - before == (2 if nudge else 1)
            before = data_segments_sent(connection.socket)
            await stream.send_bytes(b"raw")  # data: no nudge
            assert await stream.receive() == b"raw"
            assert data_segments_sent(connection.socket) - before == 1
            await stream.send_eof()
            with pytest.raises(EndOfStreamError):
                await stream.receive()


@pytest.mark.parametrize("redial_after", [REDIAL_AFTER, MIN_REDIAL_AFTER])
async def test_a_dial_whose_syn_is_lost_is_raced_by_another(
    autojump_clock: trio.testing.MockClock, redial_after: float
) -> None:
    """A dial that has not connected after ``redial_after`` (its SYN lost: TCP
    resends it after 1 s) is raced by a second one, which wins; the first is
    cancelled and no third begins."""
    listeners = await trio.open_tcp_listeners(0, host=HOST)
    port = listeners[0].socket.getsockname()[1]
    ready = await trio.open_tcp_stream(HOST, port)  # what the second dial gets
    accepted = await listeners[0].accept()
    dials: list[float] = []
    cancelled = []

    async def connect(host: str, port_: int) -> trio.SocketStream:
        assert (host, port_) == (HOST, port)
        dials.append(trio.current_time())
        if len(dials) > 1:
            return ready
        try:
            await trio.sleep_forever()  # the SYN and its first retransmission lost
        finally:
            cancelled.append(True)

    stream = await open_tcp_racing(HOST, port, connect=connect, redial_after=redial_after)
    assert stream is ready and trio.current_time() == redial_after
    assert dials == [0.0, redial_after] and cancelled == [True]
    await stream.send_all(b"x")
    assert await accepted.receive_some(1) == b"x"
    for resource in (stream, accepted, *listeners):
        await resource.aclose()


async def test_a_dial_to_a_connected_host_is_raced_after_a_few_of_its_round_trips() -> None:
    """Until a connection reaches a host, a dial to it is raced after
    ``REDIAL_AFTER``; while one does (either direction), after a few of its
    round trips as the kernel measured them (on loopback: the least wait)."""
    async with two_peers() as (a, b):
        b.set_handler("echo", echo)
        assert a._redial_after(HOST) == b._redial_after(HOST) == REDIAL_AFTER
        assert await a.call(B.peer_id, address(b), "echo", 1, timeout=5) == 1
        for net in (a, b):
            assert MIN_REDIAL_AFTER <= net._redial_after(HOST) < REDIAL_AFTER
            assert net._redial_after("192.0.2.1") == REDIAL_AFTER  # no connection there
        for connection in list(a._connections):
            a._drop(connection)
        assert a._redial_after(HOST) == REDIAL_AFTER


async def test_a_refused_dial_fails_without_racing(autojump_clock: trio.testing.MockClock) -> None:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]  # nobody listens there
    with pytest.raises(OSError):
        await open_tcp_racing(HOST, port)
    assert trio.current_time() == 0.0  # no second dial was waited for


@pytest.mark.parametrize("config", MODES)
async def test_byte_counters_match_both_ways(config: ConnectionConfig) -> None:
    payload = random.Random(2).randbytes(2**20)
    async with two_peers(config, config) as (a, b):
        assert (a.bytes_sent, a.bytes_received, b.bytes_sent, b.bytes_received) == (0, 0, 0, 0)
        b.set_handler("echo", echo)
        assert await a.call(B.peer_id, address(b), "echo", payload, timeout=10) == payload
        await trio.testing.wait_all_tasks_blocked()
        # every byte one side sent, the other received: handshake, framing, payloads
        assert a.bytes_sent == b.bytes_received
        assert b.bytes_sent == a.bytes_received
        overhead = 4096  # handshake, frame headers and tags of a few frames
        assert len(payload) < a.bytes_sent < len(payload) + overhead
        assert len(payload) < b.bytes_sent < len(payload) + overhead


async def test_wrong_peer_id_is_refused() -> None:
    async with two_peers() as (a, b):
        b.set_handler("echo", echo)
        with pytest.raises(ProtocolError, match="expected peer"):
            await a.call(C.peer_id, address(b), "echo", 1, timeout=5)
        assert not a._connections


async def test_closed_port_is_unreachable() -> None:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    async with open_connections(A) as a:
        with pytest.raises(PeerUnreachableError):
            await a.call(B.peer_id, (HOST, port), "echo", 1, timeout=5)


async def test_call_deadline() -> None:
    async with two_peers() as (a, b):
        started = trio.Event()

        async def stuck(stream: Stream) -> None:
            started.set()
            await trio.sleep_forever()

        b.set_handler("stuck", stuck)
        with pytest.raises(DeadlineError):
            await a.call(B.peer_id, address(b), "stuck", 1, timeout=0.2)
        assert started.is_set()
        # The stuck stream's connection was closed, not pooled; a new call works.
        b.set_handler("echo", echo)
        assert await a.call(B.peer_id, address(b), "echo", 2, timeout=5) == 2


async def test_handler_failure_resets_only_that_stream() -> None:
    async with two_peers() as (a, b):

        async def broken(stream: Stream) -> None:
            await stream.receive()
            raise ValueError("bad request")

        b.set_handler("broken", broken)
        b.set_handler("echo", echo)
        with pytest.raises(StreamResetError, match="bad request"):
            await a.call(B.peer_id, address(b), "broken", 1, timeout=5)
        with pytest.raises(StreamResetError, match="no handler"):
            await a.call(B.peer_id, address(b), "nobody", 1, timeout=5)
        assert await a.call(B.peer_id, address(b), "echo", 3, timeout=5) == 3


async def test_call_requires_exactly_one_reply() -> None:
    async with two_peers() as (a, b):

        async def silent(stream: Stream) -> None:
            await stream.receive()

        async def chatty(stream: Stream) -> None:
            await stream.send(1)
            await stream.send(2)

        b.set_handler("silent", silent)
        b.set_handler("chatty", chatty)
        with pytest.raises(ProtocolError, match="without a reply"):
            await a.call(B.peer_id, address(b), "silent", 0, timeout=5)
        with pytest.raises(ProtocolError, match="more than one"):
            await a.call(B.peer_id, address(b), "chatty", 0, timeout=5)


@pytest.mark.parametrize("config", MODES)
async def test_big_payload_round_trip(config: ConnectionConfig) -> None:
    payload = random.Random(1).randbytes(20 * 2**20 + 12345)
    frame = 3 * 2**20 + 7  # odd sizes: frames and 1 MiB chunks do not line up
    async with two_peers(config, config) as (a, b):
        b.set_handler("echo", echo)
        async with a.open_stream(B.peer_id, address(b), "echo") as stream:
            received: list[bytes] = []

            async def reader() -> None:
                async for chunk in receive_all(stream):
                    received.append(chunk)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(reader)
                view = memoryview(payload)
                for offset in range(0, len(payload), frame):
                    await stream.send_bytes(view[offset : offset + frame])
                await stream.send_eof()
        assert [len(c) for c in received][:-1] == [frame] * (len(received) - 1)
        assert hashlib.sha256(b"".join(received)).digest() == hashlib.sha256(payload).digest()


async def test_frame_size_limit() -> None:
    small = ConnectionConfig(max_frame_size=4096)
    async with two_peers(ConnectionConfig(), small) as (a, b):
        outcome: list[BaseException] = []
        delivered: list[Any] = []
        done = trio.Event()

        async def sink(stream: Stream) -> None:
            try:
                async for message in receive_all(stream):
                    delivered.append(message)
            except BaseException as e:
                outcome.append(e)
                raise
            finally:
                done.set()

        b.set_handler("sink", sink)
        async with a.open_stream(B.peer_id, address(b), "sink") as stream:
            with pytest.raises(ValueError, match="max_frame_size"):
                await stream.send_bytes(bytes(9 * 2**20))  # refused locally, nothing sent
            await stream.send_bytes(b"fits")
            await stream.send_bytes(bytes(5000))
            await done.wait()
            # The listener tells why it drops the connection.
            with pytest.raises(StreamResetError, match="max_frame_size"):
                await stream.receive()
        await trio.testing.wait_all_tasks_blocked()
        assert delivered == [b"fits"]
        assert len(outcome) == 1 and isinstance(outcome[0], ProtocolError)
        assert "max_frame_size" in str(outcome[0])
        assert not b._connections


async def test_dialer_waits_for_a_stream_slot() -> None:
    """Beyond ``max_streams_per_peer`` streams to one peer, open_stream waits."""
    config = ConnectionConfig(max_streams_per_peer=2)
    async with two_peers(config, config) as (a, b):
        b.set_handler("echo", echo)
        opened: list[int] = []

        async def hold(i: int, release: trio.Event) -> None:
            async with a.open_stream(B.peer_id, address(b), "echo") as stream:
                opened.append(i)
                await release.wait()
                await stream.send_eof()
                async for _ in receive_all(stream):
                    pass

        releases = [trio.Event() for _ in range(3)]
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(hold, i, releases[i])
                await trio.testing.wait_all_tasks_blocked()
            assert opened == [0, 1]  # the third waits for a slot
            releases[0].set()
            await trio.testing.wait_all_tasks_blocked()
            assert opened == [0, 1, 2]
            releases[1].set()
            releases[2].set()
        # Every connection went back to the pool and became ready once its
        # handler returned (the third stream may or may not have reused one).
        await trio.testing.wait_all_tasks_blocked()
        pooled = [entry for entries in a._pool.values() for entry in entries]
        assert 2 <= len(pooled) == len(a._connections) <= 3
        assert all(entry.ready for entry in pooled)


async def test_listener_refuses_streams_beyond_its_limit() -> None:
    async with two_peers(ConnectionConfig(), ConnectionConfig(max_streams_per_peer=1)) as (a, b):
        started = trio.Event()
        release = trio.Event()

        async def slow(stream: Stream) -> None:
            started.set()
            await release.wait()
            await stream.send("done")

        b.set_handler("slow", slow)
        async with a.open_stream(B.peer_id, address(b), "slow") as first:
            await started.wait()
            with pytest.raises(StreamResetError, match="more than 1 streams"):
                await a.call(B.peer_id, address(b), "slow", 1, timeout=5)
            release.set()
            assert await first.receive() == "done"


async def test_max_connections() -> None:
    async with two_peers(ConnectionConfig(), ConnectionConfig(max_connections=1)) as (a, b):
        b.set_handler("echo", echo)
        async with (
            open_connections(C) as c,
            a.open_stream(B.peer_id, address(b), "echo") as held,
        ):
            await held.send(1)
            assert await held.receive() == 1
            with pytest.raises(PeerUnreachableError):
                await c.call(B.peer_id, address(b), "echo", 2, timeout=5)


async def test_closing_the_manager_fails_pending_operations() -> None:
    async with open_connections(B) as b:
        started = trio.Event()

        async def stuck(stream: Stream) -> None:
            started.set()
            await trio.sleep_forever()

        b.set_handler("stuck", stuck)
        config = ConnectionConfig(max_streams_per_peer=1)
        errors: list[BaseException] = []
        async with open_connections(A, config=config) as a:

            async def receive_forever(stream: Stream) -> None:
                try:
                    await stream.receive()
                except ClosedError as e:
                    errors.append(e)

            async def open_second() -> None:
                try:
                    async with a.open_stream(B.peer_id, address(b), "stuck"):
                        pass
                except ClosedError as e:
                    errors.append(e)

            async with a.open_stream(B.peer_id, address(b), "stuck") as stream:
                await started.wait()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(receive_forever, stream)
                    nursery.start_soon(open_second)  # waits for the only slot
                    await trio.testing.wait_all_tasks_blocked()
                    await a.aclose()
            assert len(errors) == 2
            with pytest.raises(ClosedError):
                await a.call(B.peer_id, address(b), "stuck", 1, timeout=5)


async def test_cancelled_caller_closes_the_stream() -> None:
    async with two_peers() as (a, b):
        lost: list[BaseException] = []
        started = trio.Event()
        ended = trio.Event()

        async def waiter(stream: Stream) -> None:
            started.set()
            try:
                await stream.receive()
            except PeerUnreachableError as e:
                lost.append(e)
            finally:
                ended.set()

        b.set_handler("wait", waiter)
        b.set_handler("echo", echo)
        with trio.CancelScope() as scope:
            async with a.open_stream(B.peer_id, address(b), "wait"):
                await started.wait()
                scope.cancel()
                await trio.sleep_forever()
        await ended.wait()
        assert len(lost) == 1
        assert not a._connections
        assert await a.call(B.peer_id, address(b), "echo", 5, timeout=5) == 5


async def test_cancelled_receive_loses_nothing() -> None:
    async with two_peers() as (a, b):
        go = trio.Event()

        async def later(stream: Stream) -> None:
            await go.wait()
            await stream.send("late")

        b.set_handler("later", later)
        async with a.open_stream(B.peer_id, address(b), "later") as stream:
            with trio.move_on_after(0.05):
                await stream.receive()
            go.set()
            assert await stream.receive() == "late"


async def test_idle_pooled_connection_is_closed(mock_clock: trio.testing.MockClock) -> None:
    config = ConnectionConfig(idle_timeout=10)
    async with two_peers(config, config) as (a, b):
        b.set_handler("echo", echo)
        assert await a.call(B.peer_id, address(b), "echo", 1, timeout=5) == 1
        await trio.testing.wait_all_tasks_blocked()
        assert len(a._connections) == 1
        mock_clock.jump(9)
        await trio.testing.wait_all_tasks_blocked()
        assert len(a._connections) == 1
        mock_clock.jump(2)
        await trio.testing.wait_all_tasks_blocked()
        assert not a._connections
        assert await a.call(B.peer_id, address(b), "echo", 2, timeout=5) == 2


async def test_a_dialer_leaving_before_the_remote_ends_still_pools_the_connection() -> None:
    """A dialer that has what it wanted leaves after its own EOF, without
    reading the remote's: the connection is reused once the remote's EOF and
    DONE arrive, and closed if anything else comes first."""
    async with two_peers(PLAIN, PLAIN) as (a, b):
        gates = {"last": trio.Event(), "more": trio.Event()}

        async def reply_then_end(stream: Stream) -> None:
            request = await stream.receive()
            await stream.send(request)
            await gates[request].wait()
            if request == "more":
                await stream.send("never read")

        b.set_handler("reply", reply_then_end)
        b.set_handler("echo", echo)
        async with a.open_stream(B.peer_id, address(b), "reply") as stream:
            await stream.send("last")
            assert await stream.receive() == "last"
        await trio.testing.wait_all_tasks_blocked()
        [entry] = [entry for entries in a._pool.values() for entry in entries]
        assert not entry.eof and not entry.ready  # the handler has not ended
        gates["last"].set()
        await trio.testing.wait_all_tasks_blocked()
        assert entry.eof and entry.ready
        assert await a.call(B.peer_id, address(b), "echo", 1, timeout=5) == 1
        assert a.dialed == 1

        async with a.open_stream(B.peer_id, address(b), "reply") as stream:
            await stream.send("more")
            assert await stream.receive() == "more"
        gates["more"].set()
        await trio.testing.wait_all_tasks_blocked()
        assert not a._pool and not a._connections
        assert await a.call(B.peer_id, address(b), "echo", 2, timeout=5) == 2
        assert a.dialed == 2


async def test_a_nudge_after_done_leaves_the_pooled_connection_pooled() -> None:
    """On a real link the listener's nudge comes behind its DONE as a segment
    of its own, after the dialer pooled the connection: the pool consumes it
    and keeps the connection, which the next stream reuses."""
    async with two_peers(PLAIN, PLAIN) as (a, b):
        b.set_handler("echo", echo)
        assert await a.call(B.peer_id, address(b), "echo", 1, timeout=5) == 1
        await trio.testing.wait_all_tasks_blocked()
        [entry] = a._pool[B.peer_id]
        assert entry.ready
        [listener_side] = b._connections
        frames_opened = entry.connection._decoder._counter
        await listener_side._send_gathered([listener_side._encoder.nudge()])
        with trio.fail_after(5):  # until the pool consumed the nudge, or dropped the connection
            while not entry.done.is_set() and entry.connection._decoder._counter == frames_opened:
                await trio.testing.wait_all_tasks_blocked()
        assert a._pool[B.peer_id] == [entry] and not entry.connection.closed
        assert await a.call(B.peer_id, address(b), "echo", 2, timeout=5) == 2
        assert a.dialed == 1


async def test_messages_a_dialer_left_unread_are_discarded_by_the_pool() -> None:
    """A dialer that knows what the remote's last message will say leaves
    without it (``leave_unread``): the pooled connection discards that many
    messages when they come and is reused; one message more still closes it."""
    async with two_peers(PLAIN, PLAIN) as (a, b):
        gates = [trio.Event(), trio.Event()]

        async def reply_then_markers(stream: Stream) -> None:
            which, markers = await stream.receive()
            await stream.send("reply")
            await gates[which].wait()
            for _ in range(markers):
                await stream.send("marker")

        async def leave_before_the_markers(which: int, markers: int, unread: int) -> None:
            async with a.open_stream(B.peer_id, address(b), "reply") as stream:
                await stream.send([which, markers])
                assert await stream.receive() == "reply"
                stream.leave_unread(unread)
            gates[which].set()
            await trio.testing.wait_all_tasks_blocked()

        b.set_handler("reply", reply_then_markers)
        b.set_handler("echo", echo)
        await leave_before_the_markers(0, markers=2, unread=2)
        [entry] = a._pool[B.peer_id]
        assert entry.eof and entry.ready and not entry.unread
        assert await a.call(B.peer_id, address(b), "echo", 1, timeout=5) == 1
        assert a.dialed == 1

        await leave_before_the_markers(1, markers=2, unread=1)
        assert not a._pool and not a._connections
        assert await a.call(B.peer_id, address(b), "echo", 2, timeout=5) == 2
        assert a.dialed == 2
        async with a.open_stream(B.peer_id, address(b), "echo") as stream:
            with pytest.raises(ValueError, match="at least 0"):
                stream.leave_unread(-1)


# A man in the middle (mitm_harness) flips one bit at an offset.


def _handshake_sizes() -> tuple[int, int]:
    """Bytes the dialer and the listener send during a handshake."""
    dialer = Handshake(A, initiator=True, expected_peer=B.peer_id)
    listener = Handshake(B, initiator=False)
    m1 = dialer.start()
    m2 = listener.receive_data(m1)
    m3 = dialer.receive_data(m2)
    return len(m1) + len(m3), len(m2)


@pytest.mark.parametrize("config", MODES)
async def test_mitm_flipping_a_request_byte(config: ConnectionConfig) -> None:
    dialer_bytes, _ = _handshake_sizes()
    open_frame = 21 + len(pack(["sink"])) + 16
    flip_at = dialer_bytes + open_frame + 21 + 3  # inside the first message's payload
    async with two_peers(config, config) as (a, b), trio.open_nursery() as nursery:
        delivered: list[Any] = []
        errors: list[BaseException] = []
        done = trio.Event()

        async def sink(stream: Stream) -> None:
            try:
                async for message in receive_all(stream):
                    delivered.append(message)
            except ProtocolError as e:
                errors.append(e)
            finally:
                done.set()

        b.set_handler("sink", sink)
        proxy_port = await nursery.start(serve_proxy, b.port, flip_at, None)
        async with a.open_stream(B.peer_id, (HOST, proxy_port), "sink") as stream:
            await stream.send_bytes(b"transfer 100 coins to mallory")
            await done.wait()
            with pytest.raises(StreamResetError, match="authentication"):
                await stream.receive()
        assert delivered == []
        assert len(errors) == 1 and "authentication" in str(errors[0])
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("config", MODES)
async def test_mitm_flipping_a_reply_byte(config: ConnectionConfig) -> None:
    _, listener_bytes = _handshake_sizes()
    async with two_peers(config, config) as (a, b), trio.open_nursery() as nursery:
        b.set_handler("echo", echo)
        proxy_port = await nursery.start(serve_proxy, b.port, None, listener_bytes + 30)
        with pytest.raises(ProtocolError, match="authentication"):
            await a.call(B.peer_id, (HOST, proxy_port), "echo", "x" * 100, timeout=5)
        assert not a._connections
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("offset", [5, 40, 100])
async def test_mitm_flipping_a_handshake_byte(offset: int) -> None:
    async with two_peers() as (a, b), trio.open_nursery() as nursery:
        b.set_handler("echo", echo)
        proxy_port = await nursery.start(serve_proxy, b.port, None, offset)
        with pytest.raises(ProtocolError):
            await a.call(B.peer_id, (HOST, proxy_port), "echo", 1, timeout=5)
        nursery.cancel_scope.cancel()


async def test_private_swarm_key() -> None:
    key = ConnectionConfig(swarm_key=b"k" * 32)
    async with two_peers(key, key) as (a, b):
        b.set_handler("echo", echo)
        assert await a.call(B.peer_id, address(b), "echo", 1, timeout=5) == 1
        async with open_connections(C) as outsider:
            with pytest.raises(ProtocolError, match="private swarm"):
                await outsider.call(B.peer_id, address(b), "echo", 1, timeout=5)


def test_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="max_frame_size"):
        ConnectionConfig(max_frame_size=10)
    with pytest.raises(ConfigError, match="idle_timeout"):
        ConnectionConfig(idle_timeout=0)
    with pytest.raises(ConfigError, match="max_streams_per_peer"):
        ConnectionConfig(max_streams_per_peer=0)
    with pytest.raises(ConfigError, match="swarm_key"):
        ConnectionConfig(swarm_key=b"short")


async def test_connection_is_reused_only_after_the_handler_returned() -> None:
    """A handler still running after both EOFs keeps its connection: a new
    stream to that peer must not queue behind it (it could be what the handler
    is waiting for)."""
    async with two_peers() as (a, b):
        release = trio.Event()
        returned = trio.Event()

        async def lingering(stream: Stream) -> None:
            await stream.send("reply")
            await stream.send_eof()
            async for _ in receive_all(stream):
                pass
            await release.wait()
            returned.set()

        async def releaser(stream: Stream) -> None:
            await stream.receive()
            release.set()
            await stream.send("released")

        b.set_handler("lingering", lingering)
        b.set_handler("release", releaser)
        async with a.open_stream(B.peer_id, address(b), "lingering") as stream:
            assert await stream.receive() == "reply"
            with pytest.raises(EndOfStreamError):
                await stream.receive()
        assert await a.call(B.peer_id, address(b), "release", 0, timeout=5) == "released"
        await returned.wait()
        await trio.testing.wait_all_tasks_blocked()
        pooled = [entry for entries in a._pool.values() for entry in entries]
        assert len(pooled) == 2 and all(entry.ready for entry in pooled)


async def test_a_stream_takes_a_connection_whose_last_stream_is_ending_rather_than_dial() -> None:
    """The next stream opens while the last one's handler has not returned
    yet (both EOFs sent, no DONE; it is the same while the remote's EOF is
    on its way): when it returns, the stream takes that connection. The
    address it was given leads nowhere, so a dial, which it also tries
    (``REUSE_HEAD_START`` later), can only fail: the stream still gets the
    ending connection, and nothing more was dialed."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        nowhere = (HOST, s.getsockname()[1])
    async with two_peers() as (a, b):
        release = trio.Event()

        async def lingering(stream: Stream) -> None:
            await stream.send_eof()
            async for _ in receive_all(stream):
                pass
            await release.wait()

        b.set_handler("lingering", lingering)
        b.set_handler("echo", echo)
        async with a.open_stream(B.peer_id, address(b), "lingering") as stream:
            with pytest.raises(EndOfStreamError):
                await stream.receive()
        [entry] = a._pool[B.peer_id]
        assert entry.eof and not entry.ready
        replies: list[Any] = []

        async def next_stream() -> None:
            replies.append(await a.call(B.peer_id, nowhere, "echo", 7, timeout=5))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(next_stream)
            await trio.testing.wait_all_tasks_blocked()
            assert not replies
            release.set()
        assert replies == [7] and a.dialed == 1 and len(a._connections) == 1


async def test_a_stream_that_waited_for_an_ending_connection_finds_a_spare_next_time() -> None:
    """A stream that had to wait for a connection whose last stream was
    ending (as a member's all-reduce stream waits for its matchmaking stream
    to the leader, every round) leaves a spare dialled behind it: when the
    pair of streams comes again, the second takes the spare at once, while
    the first one's handler is still running, and nothing more is dialled."""
    async with two_peers() as (a, b):
        releases = [trio.Event(), trio.Event()]

        async def lingering(stream: Stream) -> None:
            which = await stream.receive()
            await stream.send_eof()
            async for _ in receive_all(stream):
                pass
            await releases[which].wait()

        async def end_lingering(which: int) -> None:
            async with a.open_stream(B.peer_id, address(b), "lingering") as stream:
                await stream.send(which)
                with pytest.raises(EndOfStreamError):
                    await stream.receive()

        b.set_handler("lingering", lingering)
        b.set_handler("echo", echo)
        await end_lingering(0)
        replies: list[Any] = []

        async def call(request: int) -> None:
            replies.append(await a.call(B.peer_id, address(b), "echo", request, timeout=5))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, 1)
            await trio.testing.wait_all_tasks_blocked()
            assert a.dialed == 1  # the call waits for the ending connection
            releases[0].set()
        await trio.testing.wait_all_tasks_blocked()
        assert replies == [1] and a.dialed == 2 and len(a._pool[B.peer_id]) == 2
        assert all(entry.ready for entry in a._pool[B.peer_id])

        await end_lingering(1)
        assert await a.call(B.peer_id, address(b), "echo", 2, timeout=5) == 2
        assert not releases[1].is_set() and a.dialed == 2
        releases[1].set()


async def test_silent_listener_is_a_handshake_deadline() -> None:
    """A TCP listener that never answers the handshake: DeadlineError."""
    listeners = await trio.open_tcp_listeners(0, host=HOST)
    port = listeners[0].socket.getsockname()[1]
    accepted: list[trio.SocketStream] = []

    async def accept_and_ignore() -> None:
        accepted.append(await listeners[0].accept())
        await trio.sleep_forever()

    config = ConnectionConfig(handshake_timeout=0.2)
    async with trio.open_nursery() as nursery, open_connections(A, config=config) as a:
        nursery.start_soon(accept_and_ignore)
        with pytest.raises(DeadlineError, match="handshake"):
            async with a.open_stream(B.peer_id, (HOST, port), "echo"):
                pass
        assert len(accepted) == 1
        nursery.cancel_scope.cancel()
    await listeners[0].aclose()


async def test_body_exceptions_propagate_unwrapped() -> None:
    with pytest.raises(KeyError):
        async with open_connections(A):
            raise KeyError("mine")


async def test_closing_right_after_a_call() -> None:
    """Closing while a just-pooled connection's watcher has not started yet."""
    async with open_connections(B) as b:
        b.set_handler("echo", echo)
        for i in range(3):
            async with open_connections(A) as a:
                assert await a.call(B.peer_id, address(b), "echo", i, timeout=5) == i


async def test_frames_pipelined_behind_the_handshake_then_garbage() -> None:
    """Bytes that arrive with the last handshake message are decoded too: the
    authentic frames first, then the ProtocolError; the connection is broken."""
    from swarm._framing import FrameEncoder, FrameKind

    dialer = Handshake(A, initiator=True, expected_peer=B.peer_id)
    listener = Handshake(B, initiator=False)
    dialer.receive_data(listener.receive_data(dialer.start()))
    result = dialer.result
    # Frames the listener would send, sealed with its key (our receive key).
    encoder = FrameEncoder(result.receive_key, encrypt=True, max_frame_size=2**20)
    frame = b"".join(bytes(b) for b in encoder.encode(FrameKind.MESSAGE, pack("first")))
    left, right = trio.socket.socketpair()
    with left, right:
        connection = _Connection(
            trio.SocketStream(left), result, ConnectionConfig(), frame + b"\x00" * 30, dialer=True
        )
        assert await connection.receive_frame() == (FrameKind.MESSAGE, pack("first"))
        with pytest.raises(ProtocolError, match="authentication"):
            await connection.receive_frame()
        assert connection.broken and connection.closed


async def test_worn_out_connection_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """After KEY_USAGE_LIMIT bytes under one key pair, the next stream gets a
    fresh connection (and fresh keys); the call that crossed the limit works."""
    import swarm._connections

    monkeypatch.setattr(swarm._connections, "KEY_USAGE_LIMIT", 10_000)
    async with two_peers() as (a, b):
        b.set_handler("echo", echo)
        assert await a.call(B.peer_id, address(b), "echo", b"x" * 100, timeout=5) == b"x" * 100
        (first,) = a._connections
        assert await a.call(B.peer_id, address(b), "echo", b"y" * 6000, timeout=5) == b"y" * 6000
        await trio.testing.wait_all_tasks_blocked()
        assert first not in a._connections and not b._connections
        assert await a.call(B.peer_id, address(b), "echo", 1, timeout=5) == 1
        assert len(a._connections) == 1 and first not in a._connections


@pytest.mark.parametrize("config", MODES)
async def test_receive_into_and_send_bytes_batch(config: ConnectionConfig) -> None:
    """A batch of raw frames arrives frame by frame; ``receive_into`` puts a raw
    payload (small, or larger than the 1 MiB sealing chunk) into the caller's
    buffer, and refuses a frame that is not raw bytes or does not fit."""
    rng = random.Random(5)
    big, small = rng.randbytes(3 * 2**20 + 7), rng.randbytes(100)

    async def source(stream: Stream) -> None:
        await stream.send_bytes_batch([b"head", big, small])
        await stream.send_bytes(small)
        await stream.send({"not": "bytes"})
        await stream.send_eof()

    async with two_peers(config, config) as (a, b):
        b.set_handler("source", source)
        async with a.open_stream(B.peer_id, address(b), "source") as stream:
            buffer = bytearray(4 * 2**20)
            assert await stream.receive() == b"head"
            assert await stream.receive_into(buffer) == len(big)
            assert buffer[: len(big)] == big
            assert await stream.receive_into(memoryview(buffer)[10:]) == len(small)
            assert buffer[10 : 10 + len(small)] == small
            with pytest.raises(ProtocolError, match="more than the 50 expected"):
                await stream.receive_into(bytearray(50))
        b.set_handler("source", source)
        async with a.open_stream(B.peer_id, address(b), "source") as stream:
            for _ in range(4):  # head, big, small, small
                await stream.receive()
            with pytest.raises(ProtocolError, match="where raw bytes were expected"):
                await stream.receive_into(buffer)


@pytest.mark.parametrize("config", MODES)
async def test_cancelled_receive_into_loses_nothing(config: ConnectionConfig) -> None:
    """A ``receive_into`` cancelled halfway through a payload (in a worker
    thread: ``_bulk_io``) moves what arrived out of the caller's buffer; the
    next receive gets the whole frame."""
    payload = random.Random(6).randbytes(2**20 + 5)
    sent_half = trio.Event()
    go_on = trio.Event()

    async def slow(stream: Stream) -> None:
        # A raw frame whose payload arrives in two parts, by hand.
        connection = stream._connection
        buffers = [bytes(b) for b in connection._encoder.encode(FrameKind.BYTES, payload)]
        wire = b"".join(buffers)
        half = len(wire) // 2
        await connection._send_gathered([wire[:half]])
        sent_half.set()
        await go_on.wait()
        await connection._send_gathered([wire[half:]])
        await stream.send_eof()

    async with two_peers(config, config) as (a, b):
        b.set_handler("slow", slow)
        async with a.open_stream(B.peer_id, address(b), "slow") as stream:
            buffer = bytearray(2**21)
            with trio.move_on_after(5) as scope:
                async with trio.open_nursery() as nursery:

                    async def cancel_when_half_arrived() -> None:
                        await sent_half.wait()
                        await trio.testing.wait_all_tasks_blocked()
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(cancel_when_half_arrived)
                    await stream.receive_into(buffer)
            assert not scope.cancelled_caught
            buffer[:] = bytes(len(buffer))  # the caller reuses its buffer: nothing may depend on it
            go_on.set()
            assert await stream.receive() == payload
            with pytest.raises(EndOfStreamError):
                await stream.receive()


async def _blocked_bulk_send(
    a: Connections, b: Connections, body: Any
) -> tuple[list[BaseException], trio.Event]:
    """Open a stream from ``a`` to a handler of ``b`` that never reads, send
    more bulk frames than the two kernels buffer (so the send blocks in its
    worker thread), and run ``body(stream, sending)`` meanwhile: what the
    send raised, and an event set when the handler saw its connection end."""
    lost = trio.Event()
    release = trio.Event()

    async def deaf(stream: Stream) -> None:
        await release.wait()  # reads nothing until the dialer's send is over
        with trio.move_on_after(30):
            try:
                for _ in range(16):  # what the kernel had buffered, then the end
                    await stream.receive()
            except (PeerUnreachableError, ClosedError, EndOfStreamError):
                lost.set()

    b.set_handler("deaf", deaf)
    raised: list[BaseException] = []
    frame = bytes(8 * 2**20 - 64)
    async with a.open_stream(B.peer_id, address(b), "deaf") as stream:
        sending = trio.Event()

        sent = trio.Event()

        async def send() -> None:
            sending.set()
            try:
                for _ in range(8):  # 64 MiB: more than both kernels' buffers hold
                    await stream.send_bytes(frame)
            except BaseException as e:
                raised.append(e)
                if isinstance(e, trio.Cancelled):
                    raise
            finally:
                sent.set()

        with trio.move_on_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send)
                await body(stream, nursery, sending)
                await sent.wait()
        release.set()
        with pytest.raises(ClosedError):
            await stream.send(b"more")
    return raised, lost


async def _until_blocked(stream: Stream) -> None:
    """Until the stream's connection has bytes the remote kernel has not
    acknowledged and no more go out (bounded): the sender waits in its thread."""
    before = -1
    for _ in range(3000):
        await trio.sleep(0.01)
        now = stream.unacknowledged_bytes()
        if now and now == before:
            return
        before = now
    raise AssertionError("the bulk send never blocked")


@pytest.mark.parametrize("config", MODES)
async def test_cancelling_a_bulk_send_stops_its_thread(config: ConnectionConfig) -> None:
    """A send blocked in its worker thread ends at once when its caller is
    cancelled (``Cancelled``, not an error of ours); the stream is then
    unusable, as after any cancelled send."""
    async with two_peers(config, config) as (a, b):

        async def cancel(stream: Stream, nursery: trio.Nursery, sending: trio.Event) -> None:
            await sending.wait()
            await _until_blocked(stream)
            nursery.cancel_scope.cancel()

        raised, _ = await _blocked_bulk_send(a, b, cancel)
        assert [type(e) for e in raised] == [trio.Cancelled]


async def test_closing_a_connection_stops_a_bulk_send() -> None:
    """Closing the stream while a send waits in its worker thread fails that
    send with ``ClosedError`` and ends the connection for the remote too."""
    async with two_peers() as (a, b):

        async def close(stream: Stream, nursery: trio.Nursery, sending: trio.Event) -> None:
            await sending.wait()
            await _until_blocked(stream)
            await stream.aclose()

        raised, lost = await _blocked_bulk_send(a, b, close)
        assert [type(e) for e in raised] == [ClosedError]
        with trio.fail_after(30):
            await lost.wait()


async def test_a_connection_holds_at_most_a_mebibyte_unsent() -> None:
    """Both ends of a connection tell their kernel to hold at most
    ``_SEND_LOW_WATER`` unsent bytes (TCP_NOTSENT_LOWAT), so that a bulk
    sender on a slow link sleeps until half of that has left, instead of
    waking for every 64 KB the link drained."""
    async with two_peers() as (a, b):
        b.set_handler("echo", echo)
        async with a.open_stream(B.peer_id, address(b), "echo") as stream:
            await stream.send(1)
            assert await stream.receive() == 1
        for net in (a, b):
            assert [
                c.socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT)
                for c in net._connections
            ] == [_SEND_LOW_WATER]


def max_pacing_rate(connection: _Connection) -> int:
    """The connection's SO_MAX_PACING_RATE (bytes/s; 2**64 - 1: no cap)."""
    return int(struct.unpack("=Q", connection.socket.getsockopt(socket.SOL_SOCKET, 47, 8))[0])


def max_pacing_rates(net: Connections) -> list[int]:
    """Each connection's SO_MAX_PACING_RATE."""
    return [max_pacing_rate(c) for c in net._connections]


async def test_a_stream_paces_its_connection_until_lifted() -> None:
    """``Stream.pace`` caps what the connection sends; ``pace(None)`` lifts
    the cap, so that the pooled connection carries later streams unpaced."""
    async with two_peers() as (a, b):
        b.set_handler("echo", echo)
        async with a.open_stream(B.peer_id, address(b), "echo") as stream:
            stream.pace(1_250_000.0)
            await stream.send(1)
            assert await stream.receive() == 1
            assert max_pacing_rates(a) == [1_250_000]
            stream.pace(None)
            assert max_pacing_rates(a) == [2**64 - 1]


def _items(count: int, size: int) -> list[bytes]:
    """``count`` items' frames: a 4-byte header (index, values size) and,
    unless the size is 0, the values."""
    rng = random.Random(count)
    frames: list[bytes] = []
    for i in range(count):
        frames.append(struct.pack("<HH", i, size // 1024))
        if size:
            frames.append(rng.randbytes(size))
    return frames


def _placement(
    buffer: bytearray, size: int
) -> Any:  # the ``Placement`` of ``_items``: values into ``buffer``, one slot per item
    def place(header: memoryview) -> tuple[memoryview | None, Any]:
        index, kib = struct.unpack("<HH", header)
        if kib * 1024 != size:
            raise ProtocolError(f"item {index} announces {kib} KiB")
        into = memoryview(buffer)[index * size : (index + 1) * size] if size else None
        return into, lambda: index

    return place


@pytest.mark.parametrize("config", MODES)
async def test_a_sequence_arrives_in_place_in_a_worker_thread(config: ConnectionConfig) -> None:
    """``receive_sequence`` puts each item's values where ``place`` says and
    hands the items over in order, at most one trio wake-up per item; the
    stream goes on as usual after it (here: its EOF)."""
    size, count = 256 * 1024, 24
    frames = _items(count, size)

    async def source(stream: Stream) -> None:
        await stream.send_bytes_batch(frames)
        await stream.send_eof()

    async with two_peers(config, config) as (a, b):
        b.set_handler("source", source)
        async with a.open_stream(B.peer_id, address(b), "source") as stream:
            buffer = bytearray(count * size)
            taken: list[int] = []
            async with stream.receive_sequence(count, _placement(buffer, size)) as items:
                while batch := await items.next_batch():
                    taken += batch
                assert items.wake_ups <= count
            assert taken == list(range(count))
            assert bytes(buffer) == b"".join(frames[1::2])
            assert stream._connection._workers == set()
            with pytest.raises(EndOfStreamError):
                await stream.receive()
            await stream.send_eof()
            assert stream.finished_cleanly


async def test_a_sequence_refuses_what_its_placement_or_sizes_refuse() -> None:
    """A header that ``place`` refuses, or a values frame of another size
    than its buffer, is a ``ProtocolError`` after the items before it, and
    the connection is not reused."""
    size = 128 * 1024
    good = _items(3, size)

    async def wrong_header(stream: Stream) -> None:
        await stream.send_bytes_batch([*good, struct.pack("<HH", 3, 7), bytes(7 * 1024)])
        await stream.send_eof()

    async def short_values(stream: Stream) -> None:
        await stream.send_bytes_batch([*good, struct.pack("<HH", 3, 128), bytes(size - 4)])
        await stream.send_eof()

    async with two_peers() as (a, b):
        for handler, error in ((wrong_header, "announces 7 KiB"), (short_values, "expected")):
            b.set_handler("source", handler)
            async with a.open_stream(B.peer_id, address(b), "source") as stream:
                taken: list[int] = []
                place = _placement(bytearray(4 * size), size)
                with pytest.raises(ProtocolError, match=error):
                    async with stream.receive_sequence(4, place) as items:
                        while batch := await items.next_batch():
                            taken += batch
                assert taken == [0, 1, 2]
                assert stream._connection.broken


async def test_a_sequence_cut_short_by_the_remote_fails_and_leaves_no_worker() -> None:
    """An EOF before the last item is ``EndOfStreamError``, and a connection
    lost mid-values (the remote's stream closed) ``PeerUnreachableError``,
    each after the items before it; no worker thread is left running."""
    size = 256 * 1024
    frames = _items(4, size)

    async def ends_early(stream: Stream) -> None:
        await stream.send_bytes_batch(frames[:4])
        await stream.send_eof()

    async def dies_mid_values(stream: Stream) -> None:
        connection = stream._connection
        wire = b"".join(
            bytes(b)
            for frame in frames[:6]
            for b in connection._encoder.encode(FrameKind.BYTES, frame)
        )
        await connection._send_gathered([wire[: len(wire) - size // 2]])
        await stream.aclose()  # not a clean end: the connection closes

    async with two_peers() as (a, b):
        for handler, error in (
            (ends_early, EndOfStreamError),
            (dies_mid_values, PeerUnreachableError),
        ):
            b.set_handler("source", handler)
            async with a.open_stream(B.peer_id, address(b), "source") as stream:
                taken: list[int] = []
                with pytest.raises(error), trio.fail_after(30):
                    async with stream.receive_sequence(
                        4, _placement(bytearray(4 * size), size)
                    ) as items:
                        while batch := await items.next_batch():
                            taken += batch
                assert taken == [0, 1]
                assert stream._connection._workers == set()


async def test_cancelling_a_sequence_stops_its_worker_and_breaks_the_stream() -> None:
    """A sequence whose caller is cancelled while its worker waits for the
    next item stops the worker and waits for it; the stream's connection is
    not reused, and the remote sees it end with the stream."""
    size = 256 * 1024
    frames = _items(4, size)
    lost = trio.Event()

    async def stalls(stream: Stream) -> None:
        await stream.send_bytes_batch(frames[:4])
        try:
            await stream.receive()  # until the dialer gives up
        except (PeerUnreachableError, ClosedError, EndOfStreamError):
            lost.set()

    async with two_peers() as (a, b):
        b.set_handler("stalls", stalls)
        async with a.open_stream(B.peer_id, address(b), "stalls") as stream:
            taken: list[int] = []
            with trio.CancelScope() as scope:
                async with stream.receive_sequence(
                    4, _placement(bytearray(4 * size), size)
                ) as items:
                    while len(taken) < 2:
                        taken += await items.next_batch()
                    scope.cancel()
                    await items.next_batch()
            assert scope.cancelled_caught
            assert taken == [0, 1]
            assert stream._connection._workers == set()
            assert stream._connection.broken  # closed when the stream ends, never pooled
        with trio.fail_after(30):
            await lost.wait()


async def test_a_stream_tells_how_long_its_packets_wait_in_queues() -> None:
    """``Stream.queueing_delay``: the connection's smoothed round trip less
    its least (``TCP_INFO``), which the link meter reads to tell a link that
    queues (worth pacing) from one that does not."""
    async with two_peers() as (a, b):
        b.set_handler("echo", echo)
        async with a.open_stream(B.peer_id, address(b), "echo") as stream:
            for i in range(3):
                await stream.send(i)
                assert await stream.receive() == i
            delay = stream.queueing_delay()
            [connection] = a._connections
            rtt = _smoothed_rtt(connection.socket)
            assert delay is not None and rtt is not None
            assert 0 <= delay <= rtt
