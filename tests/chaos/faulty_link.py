"""A seeded faulty TCP link on 127.0.0.1: a relay in front of one peer that drops,
delays, stalls, truncates or corrupts what that peer sends.

The relay wraps real connections by composition: peers dial its port instead of
the faulty peer's (the group member's or donor's address points at it), and the
bytes pass through unchanged until the fault. Faults act on the byte stream
below the connection's encryption, as a broken network or a bad NIC would: a
corrupted byte must be caught by the AEAD tag, a truncated frame by the framing.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import partial

import trio

DROP, TRUNCATE, CORRUPT, STALL, DELAY = "drop", "truncate", "corrupt", "stall", "delay"
#: Faults after which the peer behind the link cannot deliver: it must be excluded.
BREAKING = (DROP, TRUNCATE, CORRUPT, STALL)


@dataclass(frozen=True)
class LinkFault:
    """What happens to the bytes the peer sends on each connection through the link.

    ``at``: the byte offset (per connection) where DROP closes the connection,
    TRUNCATE sends half of the pending read and closes, CORRUPT flips one byte
    (and relays on), STALL stops relaying but holds the connection open. DELAY
    holds every read for ``delay`` seconds and breaks nothing."""

    kind: str
    at: int = 0
    delay: float = 0.0

    @classmethod
    def draw(cls, kind: str, rng: random.Random, *, low: int, high: int) -> LinkFault:
        """A fault of ``kind`` at an offset drawn from ``rng`` in ``[low, high]``."""
        return cls(kind, at=rng.randint(low, high), delay=0.02 if kind == DELAY else 0.0)


async def serve_faulty_link(
    target_port: int,
    fault: LinkFault,
    *,
    to_target: bool = False,
    task_status: trio.TaskStatus[int],
) -> None:
    """Relay connections on a fresh 127.0.0.1 port to ``target_port``, applying
    ``fault`` to the bytes coming back from the target (``to_target``: to the
    bytes going to it). Starts with the port; runs until cancelled (which
    closes every relayed connection)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port: int = listeners[0].socket.getsockname()[1]
    task_status.started(port)
    await trio.serve_listeners(partial(_relay, target_port, fault, to_target), listeners)


async def _relay(
    target_port: int, fault: LinkFault, to_target: bool, client: trio.SocketStream
) -> None:
    try:
        server = await trio.open_tcp_stream("127.0.0.1", target_port)
    except OSError:
        await client.aclose()
        return
    async with client, server, trio.open_nursery() as nursery:
        forward, back = (fault, None) if to_target else (None, fault)
        nursery.start_soon(_pipe, client, server, forward, nursery.cancel_scope)
        nursery.start_soon(_pipe, server, client, back, nursery.cancel_scope)


async def _pipe(
    source: trio.SocketStream,
    sink: trio.SocketStream,
    fault: LinkFault | None,
    connection: trio.CancelScope,
) -> None:
    """Relay ``source`` to ``sink`` (applying ``fault``) up to EOF; when either side
    breaks or the fault closes the connection, cancel ``connection`` (both ways)."""
    try:
        if await _relay_bytes(source, sink, fault):
            return
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # one relayed connection broke: that is what the link is for
    connection.cancel()


async def _relay_bytes(
    source: trio.SocketStream, sink: trio.SocketStream, fault: LinkFault | None
) -> bool:
    """True at a clean EOF, False where the fault closes the connection."""
    relayed = 0
    while data := await source.receive_some(65536):
        if fault is not None and fault.kind == DELAY:
            await trio.sleep(fault.delay)
        elif fault is not None and relayed <= fault.at < relayed + len(data):
            cut = fault.at - relayed
            if fault.kind == CORRUPT:
                corrupted = bytearray(data)
                corrupted[cut] ^= 0xFF
                data = bytes(corrupted)
            elif fault.kind == TRUNCATE:
                await sink.send_all(data[: max(1, cut)])
                return False
            elif fault.kind == STALL:
                await sink.send_all(data[:cut])
                await trio.sleep_forever()
            else:  # DROP
                return False
        await sink.send_all(data)
        relayed += len(data)
    await sink.send_eof()
    return True
