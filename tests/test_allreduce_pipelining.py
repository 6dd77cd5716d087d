"""How the all-reduce keeps both directions of a link busy: parts cut into
enough chunks (``pipelined_chunk_elements``) and senders held within a window
of the results (``_Window``). Pure code, no network."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from averaging._allreduce import (
    MIN_PIPELINED_CHUNK,
    AllReduceConfig,
    _Window,
    pipelined_chunk_elements,
)
from averaging._partition import Partition
from swarm import ConfigError


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


def test_config_validation() -> None:
    with pytest.raises(ConfigError, match="window_bytes"):
        AllReduceConfig(window_bytes=0)
    with pytest.raises(ConfigError, match="min_chunks_per_part"):
        AllReduceConfig(min_chunks_per_part=0)
