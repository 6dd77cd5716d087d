"""A state averaged a chunk at a time through one reused host buffer
(``ChunkedStaging``, ``Averager.average_in_chunks``): the same result as
averaging it whole, over real peers on 127.0.0.1."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

import pytest
import torch
import trio
import trio.testing
from peer_harness import averager_config, open_peers, trio_wall_clock
from trainer_harness import FAST, TrainingPeer, training_config, training_peers, whole_group

from averaging import (
    Averager,
    ChunkedStaging,
    HostStaging,
    MoshpitGrid,
    StepResult,
    chunked_contributors,
)
from trainer import CollaborativeOptimizer

CONFIG = averager_config(sender_timeout=2.0, round_timeout=20.0)


@pytest.fixture
def idle_clock() -> trio.testing.MockClock:
    """Virtual time that jumps when every peer of the process waits for a timer."""
    return trio.testing.MockClock(autojump_threshold=0.05)


def _state(seed: int) -> list[torch.Tensor]:
    """Parameters, optimizer state and buffers of various shapes: one
    non-contiguous, one larger than a chunk, one of bfloat16."""
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(1000, generator=gen),
        torch.randn(37, 13, generator=gen),
        torch.randn(20, 30, generator=gen).t(),
        torch.randn(5, generator=gen).to(torch.bfloat16),
        torch.randn(301, generator=gen),
    ]


def test_chunks_cover_every_value_once_in_order_within_the_size() -> None:
    tensors = _state(0)
    staging = ChunkedStaging(tensors, 300)
    sizes = [sum(p.numel() for p in chunk) for chunk in staging.chunks]
    # the non-contiguous 30x20 tensor is one whole piece, the others are cut
    assert sizes == [300, 300, 300, 300, 281, 600, 300, 6]
    before = [t.clone() for t in tensors]
    for k in range(len(staging)):
        host = staging.to_host(k)
        assert all(h.device.type == "cpu" and h.dtype == torch.float32 for h in host)
        for h in host:
            h.mul_(2)
        staging.from_host(k)
    for t, b in zip(tensors, before, strict=True):
        torch.testing.assert_close(t, (2 * b.float()).to(t.dtype), atol=0, rtol=0)
    assert staging.buffer.numel() == 600  # one chunk, the largest, not the state


def test_a_cpu_vector_is_staged_without_a_copy() -> None:
    vector = torch.randn(1000)
    staging = ChunkedStaging([vector], 256)
    host = staging.to_host(1)
    assert host[0].data_ptr() == vector[256:].data_ptr()


@pytest.mark.parametrize("chunk_elements", [64, 450, 10_000])
async def test_the_chunked_average_equals_the_whole_one(
    idle_clock: trio.testing.MockClock, chunk_elements: int
) -> None:
    async with open_peers(2, seed=21, clock=trio_wall_clock) as peers:
        states = [_state(1), _state(2)]
        copies = [[t.clone() for t in s] for s in states]
        # averaged whole: one host copy of everything, one round
        whole_staging = [HostStaging(c) for c in copies]
        whole = [
            Averager(p, s.host, prefix="whole", config=CONFIG, grid=MoshpitGrid(1, 4))
            for p, s in zip(peers.alive, whole_staging, strict=True)
        ]
        chunked_staging = [ChunkedStaging(s, chunk_elements) for s in states]
        chunked = [
            # the averager's own tensors are never averaged here: the chunks are
            Averager(p, [s.buffer], prefix="chunked", config=CONFIG, grid=MoshpitGrid(1, 4))
            for p, s in zip(peers.alive, chunked_staging, strict=True)
        ]
        locks = [threading.Lock(), threading.Lock()]
        results: list[list[StepResult]] = [[], []]

        async def one(i: int) -> None:
            whole_staging[i].to_host()
            step = await whole[i].step(round=0, expected_peers=2)
            assert step.contributors == {p.peer_id for p in peers.alive}
            whole_staging[i].from_host()
            group = await chunked[i].find_group(round=0, expected_peers=2)
            assert group is not None
            results[i] = await chunked[i].average_in_chunks(
                group, chunked_staging[i], write_lock=locks[i]
            )

        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(one, i)
        for i in range(2):
            assert len(results[i]) == len(chunked_staging[i])
            assert chunked_contributors(results[i]) == {p.peer_id for p in peers.alive}
            assert chunked[i].state.round == 1  # the round ended once, after the last chunk
            for a, b in zip(states[i], copies[i], strict=True):
                assert torch.equal(a, b)
        # and the two peers agree
        for a, b in zip(states[0], states[1], strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("lossy", [False, True], ids=["tcp", "lossy"])
def test_peers_that_started_apart_hold_one_state_after_chunked_state_averaging(
    lossy: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Two peers start from different weights: averaging gradients alone never
    makes them equal, so equal parameters (and optimizer state) after a
    global step come from the chunked state averaging, over the lossy data
    plane in a lossy run (``trainer._drift``; nothing is lost on 127.0.0.1).
    The optimizer's step counts, which no state round carries, agree too."""
    torch.set_num_threads(1)
    caplog.set_level(logging.INFO, logger="averaging")
    config = replace(FAST, state_averaging_interval=1, state_chunk_elements=3000, lossy=lossy)
    states: dict[int, dict[int, list[torch.Tensor]]] = {}
    lock = threading.Lock()

    def recorder(i: int):  # type: ignore[no-untyped-def]
        def on_epoch(opt: CollaborativeOptimizer, report: object) -> None:
            if whole_group(opt):
                state = opt.state_dict()["optimizer"]["state"]
                moments = [v for s in state.values() for v in s.values() if v.dim()]
                counts = [s["step"] for s in state.values()]
                with lock:
                    states.setdefault(opt.epoch, {})[i] = [
                        *(p.detach().clone() for p in opt.params),
                        *(m.clone() for m in moments),
                        *(torch.as_tensor(c).clone() for c in counts),
                    ]

        return on_epoch

    with training_peers(2) as (_, peers):
        trainers = [
            TrainingPeer(
                p,
                training_config(i, max_epochs=6, model_seed=i, min_peers=2, optimizer=config),
            )
            for i, p in enumerate(peers)
        ]
        for i, t in enumerate(trainers):
            t.start(on_epoch=recorder(i))
        reports = [t.join() for t in trainers]
    assert all(r.epochs == 6 for r in reports)
    # every round (gradients and each chunk of the state) on the run's plane
    rounds = [
        r for r in caplog.records if r.name == "averaging._allreduce" and "in every part" in r.msg
    ]
    lossy_rounds = [r for r in caplog.records if r.getMessage().startswith("lossy all-reduce")]
    assert len(rounds) > 2 * 6 and len(lossy_rounds) == (len(rounds) if lossy else 0)
    both = {e: s for e, s in states.items() if len(s) == 2}
    assert both, "no global step that both peers averaged whole"
    for epoch, by_peer in sorted(both.items()):
        for a, b in zip(by_peer[0], by_peer[1], strict=True):
            assert torch.equal(a, b), f"epoch {epoch}: the peers differ"
