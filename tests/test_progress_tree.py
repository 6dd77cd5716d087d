"""Progress that scales: the aggregation tree over the real DHT, and the
summaries it is made of (pure).

The tree is checked end to end: peers on real DHT nodes refresh concurrently
until every view has seen every refresh, then every peer must count every
peer and every sample exactly. Hundreds of signed records under one key are
read back whole (paged replies).
"""

from __future__ import annotations

import random

import pytest
import torch
import trio
from dht_harness import open_swarm

from dht import make_record, owner_marker
from dht._records import encode_key, key_id
from swarm import ConfigError, Identity, ManualClock, PeerID, ProtocolError
from trainer import (
    MAX_DEVICE_LABEL,
    UNKNOWN_DEVICE,
    PeerProgress,
    ProgressSummary,
    ProgressTree,
    device_label,
    estimate,
    parse_progress,
    progress_key,
)

NOW = 1_700_000_000.0


def _record(
    peer: int, epoch: int, samples: int, rate: float = 0.0, time: float = NOW
) -> PeerProgress:
    return PeerProgress(Identity.from_seed(bytes([peer]) * 32).peer_id, epoch, samples, rate, time)


def test_summaries_add_up_like_the_records_they_cover() -> None:
    records = [
        _record(1, 3, 10, 2.0, NOW - 1),
        _record(2, 3, 5),
        _record(3, 2, 99),
        _record(4, 3, 1),
    ]
    whole = ProgressSummary.of_records(records, now=NOW, stale_after=10)
    halves = [
        ProgressSummary.of_records(records[:2], now=NOW - 0.5, stale_after=10),
        ProgressSummary.of_records(records[2:], now=NOW, stale_after=10),
    ]
    combined = ProgressSummary.combine([h for h in halves if h], now=NOW, stale_after=10)
    assert whole is not None and combined is not None
    for summary in (whole, combined):
        assert summary.epoch == 3
        assert summary.samples == pytest.approx(10 + 2.0 + 5 + 1)  # peer 1 extrapolated 1 s
        assert summary.reported == 16
        assert (summary.peers, summary.peers_at_epoch) == (4, 3)
    expected = estimate(records, now=NOW, target_batch_size=100, stale_after=10)
    assert whole.progress(100, NOW) == expected
    # stale sub-trees and stale records are left out
    assert ProgressSummary.combine(halves, now=NOW + 100, stale_after=10) is None
    assert ProgressSummary.of_records(records, now=NOW + 100, stale_after=10) is None


def test_summaries_from_the_wire_are_checked() -> None:
    good = ProgressSummary(3, 10.0, 10, 1.0, 2, 1, NOW)
    assert ProgressSummary.from_value(good.to_value()) == good
    for bad in (
        None,
        [3, 10.0, 10, 1.0, 2, 1],
        [3, -1.0, 10, 1.0, 2, 1, NOW],
        [3, 10.0, 10, 1.0, 1, 2, NOW],  # more at the epoch than in all
        [3, 10.0, 10, "fast", 2, 1, NOW],
    ):
        with pytest.raises(ProtocolError):
            ProgressSummary.from_value(bad)


def test_records_carry_the_device_and_old_records_read_unknown() -> None:
    peer = Identity.from_seed(bytes([9]) * 32).peer_id
    mine = PeerProgress(peer, 3, 10, 2.0, NOW, device=device_label([torch.zeros(1)]))
    assert mine.device == "cpu fp32"
    assert PeerProgress.from_value(peer, mine.to_value()) == mine
    old = mine.to_value()
    del old["device"]  # a record of a peer from before the field
    assert PeerProgress.from_value(peer, old).device == UNKNOWN_DEVICE == "unknown"
    half = torch.zeros(1, dtype=torch.bfloat16)
    assert PeerProgress.device_of([half, torch.zeros(1)]) == "cpu bf16"  # the first tensor's
    assert device_label([]) == "unknown"
    for bad in (None, 3, "", "x" * (MAX_DEVICE_LABEL + 1)):
        with pytest.raises(ProtocolError, match="device"):
            PeerProgress.from_value(peer, mine.to_value() | {"device": bad})


def test_leaves_are_fixed_per_peer_and_spread_evenly() -> None:
    tree = ProgressTree("run", fanout=4, depth=2)
    ids = [Identity.from_seed(random.Random(i).randbytes(32)).peer_id for i in range(1600)]
    leaves = [tree.leaf(p) for p in ids]
    assert leaves[0] == tree.leaf(ids[0])
    counts = {leaf: leaves.count(leaf) for leaf in set(leaves)}
    assert len(counts) == 16 and min(counts.values()) > 60  # about 100 each
    assert tree.leaf_key((1, 2)) == "run.progress.L.1.2"
    assert tree.summary_key(()) == "run.progress.S" and tree.summary_key((3,)) == "run.progress.S.3"
    with pytest.raises(ConfigError):
        ProgressTree("run", fanout=1)


@pytest.mark.slow
async def test_every_peer_counts_every_peer_through_the_tree() -> None:
    clock = ManualClock(NOW)
    # a small tree, so that leaves and sub-trees hold several peers each
    tree = ProgressTree("run", fanout=2, depth=2, writers=1_000)
    async with open_swarm(12, clock, seed=5) as swarm:
        peers = swarm.nodes
        mine = [
            PeerProgress(node.peer_id, 7 if i % 5 else 6, 10 + i, 0.0, NOW)
            for i, node in enumerate(peers)
        ]
        views: list[ProgressSummary | None] = [None] * len(peers)
        limiter = trio.CapacityLimiter(6)

        async def refresh(i: int) -> None:
            async with limiter:
                views[i] = await tree.refresh(
                    peers[i], mine[i], now=NOW, ttl=60, stale_after=30, rng=random.Random(i)
                )

        # every refresh writes what it read plus itself: after depth + 1 rounds
        # of everyone, every summary holds every peer
        for _ in range(tree.depth + 2):
            async with trio.open_nursery() as nursery:
                for i in range(len(peers)):
                    nursery.start_soon(refresh, i)
        at_epoch = [m for m in mine if m.epoch == 7]
        for view in views:
            assert view is not None
            assert (view.peers, view.peers_at_epoch, view.epoch) == (12, len(at_epoch), 7)
            assert view.reported == sum(m.samples for m in at_epoch)
        observed = await tree.read(peers[0], now=NOW, stale_after=30)
        assert observed is not None and observed.peers == 12
        # a peer that leaves is no longer counted once its leaf is read again
        await tree.withdraw(peers[3], mine[3], now=NOW, ttl=60, stale_after=30)
        for _ in range(tree.depth + 2):
            async with trio.open_nursery() as nursery:
                for i in range(len(peers)):
                    if i != 3:
                        nursery.start_soon(refresh, i)
        assert all(view is not None and view.peers == 11 for j, view in enumerate(views) if j != 3)


async def test_hundreds_of_progress_records_under_one_key_are_read_whole() -> None:
    clock = ManualClock(NOW)
    async with open_swarm(5, clock, seed=6) as swarm:
        relay, reader = swarm.nodes[0], swarm.nodes[3]
        key = progress_key("crowd")
        peers: list[PeerID] = []
        for i in range(300):
            identity = Identity.from_seed(random.Random(1000 + i).randbytes(32))
            peers.append(identity.peer_id)
            value = PeerProgress(identity.peer_id, 2, i, 1.0, NOW).to_value()
            record = make_record(
                key,
                value,
                NOW + 60,
                subkey=owner_marker(identity.peer_id),
                signer=identity,
                limits=relay.config.limits,
            )
            assert await relay.store_record(record)
        records = parse_progress(await reader.get(key))
        assert sorted(r.peer_id for r in records) == sorted(peers)
        swarm_view = estimate(records, now=NOW, target_batch_size=10**6, stale_after=30)
        assert swarm_view.num_peers == 300 and swarm_view.reported == sum(range(300))


async def test_a_sub_tree_read_short_of_what_its_parent_counts_is_read_again_whole() -> None:
    clock = ManualClock(NOW)
    tree = ProgressTree("run", fanout=2, depth=1)
    async with open_swarm(10, clock, seed=7) as swarm:
        reader, *others = swarm.nodes
        digit = tree.leaf(reader.peer_id)
        # another peer of the reader's leaf, whose record only nodes beyond the
        # three closest to the leaf's key hold: where the reader's look-up
        # stops, as when its look-up and the writer's found different nodes
        seeds = (random.Random(i).randbytes(32) for i in range(1000))
        other = next(i for i in map(Identity.from_seed, seeds) if tree.leaf(i.peer_id) == digit)
        key = tree.leaf_key(digit)
        record = make_record(
            key,
            PeerProgress(other.peer_id, 3, 40, 0.0, NOW).to_value(),
            NOW + 60,
            subkey=owner_marker(other.peer_id),
            signer=other,
            limits=reader.config.limits,
        )
        target = int.from_bytes(key_id(encode_key(key)))
        nearest = sorted(others, key=lambda n: int.from_bytes(bytes(n.peer_id)) ^ target)
        for node in nearest[3:8]:
            assert node._server.storage.store(record)
        # the root counts both peers of the leaf (the other peer wrote it)
        both = ProgressSummary(3, 80.0, 80, 0.0, 2, 2, NOW)
        assert await others[0].store(
            tree.summary_key(()), both.to_value(), NOW + 60, subkey=str(digit[0])
        )
        mine = PeerProgress(reader.peer_id, 3, 40, 0.0, NOW)
        view = await tree.refresh(
            reader, mine, now=NOW, ttl=60, stale_after=30, rng=random.Random(0)
        )
        assert (view.peers, view.reported) == (2, 80)
