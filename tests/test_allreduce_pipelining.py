"""How the all-reduce keeps both directions of a link busy: parts cut into
enough chunks (``pipelined_chunk_elements``), senders held within a window
of the results (``_Window``), and a stream's next chunk received (or encoded)
while the last one is decoded (or sent) (``_overlapped``). Pure code, no
network."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from averaging._allreduce import (
    MIN_PIPELINED_CHUNK,
    AllReduceConfig,
    _overlapped,
    _Window,
    pipelined_chunk_elements,
)
from averaging._partition import Partition
from swarm import ConfigError, ProtocolError


def _partition(sizes: list[int], chunk: int) -> Partition:
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return Partition(start, tuple(bounds), chunk)


def test_parts_are_cut_into_enough_chunks_within_the_bounds() -> None:
    config = AllReduceConfig(min_chunks_per_part=8)
    big = config.chunk_elements
    # 5M floats in 4 parts: 1.25M each, so chunks of 156,250
    assert pipelined_chunk_elements(_partition([1_250_000] * 4, big), config) == 156_250
    # the largest part decides (bandwidth-weighted parts differ)
    assert pipelined_chunk_elements(_partition([100, 800_000], big), config) == 100_000
    # never below the floor, never above the configured chunk
    assert pipelined_chunk_elements(_partition([1000] * 4, big), config) == MIN_PIPELINED_CHUNK
    small = AllReduceConfig(chunk_elements=64, min_chunks_per_part=8)
    assert pipelined_chunk_elements(_partition([1000] * 4, 64), small) == 64
    huge = _partition([100_000_000] * 2, big)
    assert pipelined_chunk_elements(huge, config) == big
    # 1: exactly the configured chunks
    one = AllReduceConfig(min_chunks_per_part=1)
    assert pipelined_chunk_elements(_partition([1_250_000] * 4, big), one) == big


async def test_a_sender_waits_for_results_beyond_its_window() -> None:
    window = _Window(2)
    sent: list[int] = []

    async def sender() -> None:
        for chunk in range(5):
            await window.wait_to_send(chunk)
            sent.append(chunk)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender)
        await trio.testing.wait_all_tasks_blocked()
        assert sent == [0, 1]  # two ahead of no results
        window.advance(1)
        await trio.testing.wait_all_tasks_blocked()
        assert sent == [0, 1, 2]
        window.advance(3)  # results may come back several at once
        await trio.testing.wait_all_tasks_blocked()
        assert sent == [0, 1, 2, 3, 4]


async def test_the_next_chunk_is_produced_while_the_last_is_used() -> None:
    """Chunk k+1 arrives while chunk k is decoded, and chunk k+2 (which
    reuses chunk k's receive buffer) only once chunk k is done with."""
    produced: list[int] = []
    used: list[int] = []
    release = [trio.Event() for _ in range(3)]

    async def produce(turn: int) -> int | None:
        if turn == len(release):
            return None
        produced.append(turn)
        return turn

    async def use(item: int) -> None:
        await release[item].wait()
        used.append(item)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(_overlapped, produce, use)
        await trio.testing.wait_all_tasks_blocked()
        assert (produced, used) == ([0, 1], [])
        release[1].set()  # out of order: chunk 1 still waits for chunk 0
        await trio.testing.wait_all_tasks_blocked()
        assert (produced, used) == ([0, 1], [])
        release[0].set()
        await trio.testing.wait_all_tasks_blocked()
        assert (produced, used) == ([0, 1, 2], [0, 1])
        release[2].set()
    assert used == [0, 1, 2]


async def test_what_came_before_a_failed_receive_is_still_used() -> None:
    """A sender whose stream breaks after a whole chunk arrived is excluded
    from the chunks after it, not from that one; a sender whose next chunk
    cannot be encoded still sends the one it began to send."""
    used: list[int] = []
    release = trio.Event()

    async def produce(turn: int) -> int:
        if turn == 1:
            raise ProtocolError("the stream broke")
        return turn

    async def use(item: int) -> None:
        await release.wait()
        used.append(item)

    async def overlapped() -> None:
        with pytest.raises(ProtocolError, match="broke"):
            await _overlapped(produce, use)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(overlapped)
        await trio.testing.wait_all_tasks_blocked()
        assert used == []  # chunk 0 is still being used, after chunk 1 failed
        release.set()
    assert used == [0]


async def test_an_overlapped_failure_is_raised_as_itself() -> None:
    """The first failure reaches the stream's per-peer boundary (``except
    Exception``) unwrapped, also when an enclosing scope is cancelled at the
    same moment, whose ``Cancelled`` would otherwise ride with it in a
    ``BaseExceptionGroup`` that such a boundary does not catch."""

    async def produce(turn: int) -> int:
        return turn

    async def fail_to_produce(turn: int) -> int:
        raise ProtocolError("a malformed chunk")

    async def use(item: int) -> None:
        await trio.sleep_forever()

    with pytest.raises(ProtocolError, match="malformed"):
        await _overlapped(fail_to_produce, use)
    with trio.CancelScope() as enclosing:

        async def use_and_fail(item: int) -> None:
            enclosing.cancel()
            raise ProtocolError("NaN in a chunk")

        with pytest.raises(ProtocolError, match="NaN"):
            await _overlapped(produce, use_and_fail)


def test_config_validation() -> None:
    with pytest.raises(ConfigError, match="window_bytes"):
        AllReduceConfig(window_bytes=0)
    with pytest.raises(ConfigError, match="min_chunks_per_part"):
        AllReduceConfig(min_chunks_per_part=0)
