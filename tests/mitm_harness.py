"""A man in the middle on 127.0.0.1: a TCP proxy that forwards both ways and
flips one bit at a chosen byte offset of each direction of every connection.
"""

from __future__ import annotations

import trio

HOST = "127.0.0.1"


async def _pump(source: trio.SocketStream, sink: trio.SocketStream, flip_at: int | None) -> None:
    offset = 0
    try:
        while data := await source.receive_some(65536):
            if flip_at is not None and offset <= flip_at < offset + len(data):
                tampered = bytearray(data)
                tampered[flip_at - offset] ^= 0x01
                data = bytes(tampered)
            offset += len(data)
            await sink.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        sink.socket.close()
        source.socket.close()


async def serve_proxy(
    target_port: int,
    flip_to_server: int | None,
    flip_to_client: int | None,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Forward connections to ``HOST:target_port``; report the proxy's port.

    ``flip_to_server``/``flip_to_client``: the byte offset, counted from the
    start of each connection in that direction, whose lowest bit is flipped
    (None: that direction passes unchanged). Runs until cancelled.
    """

    async def forward(client: trio.SocketStream) -> None:
        server = await trio.open_tcp_stream(HOST, target_port)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_pump, client, server, flip_to_server)
            nursery.start_soon(_pump, server, client, flip_to_client)

    listeners = await trio.open_tcp_listeners(0, host=HOST)
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(forward, listeners)
