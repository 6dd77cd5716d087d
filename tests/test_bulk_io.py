"""The worker thread of a whole transfer (``swarm._bulk_io.worker_batches``):
its items reach the trio thread in batches, and it never outlives its block."""

from __future__ import annotations

import threading

import pytest
import trio

from swarm._bulk_io import Batches, Stopper, worker_batches


async def test_items_made_while_the_trio_thread_is_away_arrive_in_one_wake_up() -> None:
    """A worker that puts 100 items before the trio thread takes any wakes it
    once, not once per item (``run_in_thread`` costs two hand-offs per call)."""
    all_put = threading.Event()

    def work(batches: Batches[int]) -> None:
        for i in range(100):
            batches.put(i)
        all_put.set()

    active: set[Stopper] = set()
    async with worker_batches(work, active, window=100) as batches:
        assert active == {batches.stopper}
        await trio.to_thread.run_sync(all_put.wait)
        assert await batches.next_batch() == list(range(100))
        assert await batches.next_batch() == []
        assert batches.wake_ups == 1
    assert active == set()


async def test_the_worker_waits_for_room_and_its_failure_follows_its_items() -> None:
    """The worker runs at most ``window`` items ahead of what was taken; what
    it raises comes after the items it put before."""
    most_ahead = 0

    def work(batches: Batches[int]) -> None:
        nonlocal most_ahead
        for i in range(20):
            batches.put(i)
            with batches._lock:
                most_ahead = max(most_ahead, len(batches._ready))
        raise ValueError("the twentieth item was the last")

    taken: list[int] = []
    async with worker_batches(work, set(), window=3) as batches:
        with pytest.raises(ValueError, match="twentieth"):
            while True:
                taken += await batches.next_batch()
    assert taken == list(range(20))
    assert most_ahead <= 3


async def test_leaving_the_block_stops_a_waiting_worker() -> None:
    """A worker asleep in ``poll`` (here: until items are taken, which they
    never are) is stopped and waited for when its block is left, by an
    error or a cancellation, and no thread is left behind."""
    returned = threading.Event()

    def work(batches: Batches[int]) -> None:
        try:
            while True:
                batches.put(0)
        finally:
            returned.set()

    active: set[Stopper] = set()
    with trio.move_on_after(60) as scope:
        async with worker_batches(work, active, window=2) as batches:
            assert await batches.next_batch()
            scope.cancel()
            await trio.sleep_forever()
    assert returned.is_set()
    assert active == set()
    assert batches.stopper.stopped


def test_window_is_validated() -> None:
    with pytest.raises(ValueError, match="window=0"):
        Batches(0, set())
