"""Network faults under the real all-reduce and state transfer, in one process.

One peer sits behind a seeded ``faulty_link`` relay that drops, stalls,
truncates or corrupts (below the connection's frame authentication, in
plaintext and encrypted mode) the bytes it sends, or delays them. The
invariants hold for every fault offset the seed draws:

- all-reduce: every healthy member returns by the round deadline; each chunk
  of its result is exactly the weighted mean of the inputs of the members it
  records as contributors (so no corrupted byte is ever averaged in); a
  breaking fault excludes the faulty member somewhere, and a mere delay
  excludes nobody.
- state transfer: a newcomer that tries the faulty donor first ends with the
  healthy donor's exact state; through a delay it gets the faulty donor's.

Real sockets carry the data, so these run on the real clock; the all-reduce's
deadlines (``test_allreduce.CONFIG``) are far above a healthy round's time,
and a stalled link is slower than any deadline, so no outcome is a race.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace
from functools import partial
from typing import Any

import pytest
import torch
import trio
from faulty_link import (
    BREAKING,
    CORRUPT,
    DELAY,
    DROP,
    STALL,
    TRUNCATE,
    LinkFault,
    serve_faulty_link,
)
from test_allreduce import CONFIG, make_groups, open_peers, run_round
from test_state_transfer import (
    CONFIG as TRANSFER_CONFIG,
)
from test_state_transfer import (
    assert_identical,
    load,
    make_state,
    open_newcomers,
    open_swarm,
    start_donor,
)

from averaging._allreduce import AllReduceResult
from swarm import PeerID

KINDS = [DROP, TRUNCATE, CORRUPT, STALL, DELAY]
SEEDS = [1, 2]
WEIGHTS = [1.0, 2.0, 0.5, 1.5]


@asynccontextmanager
async def open_link(
    target_port: int, fault: LinkFault, *, to_target: bool = False
) -> AsyncIterator[int]:
    async with trio.open_nursery() as nursery:
        port: int = await nursery.start(
            partial(serve_faulty_link, target_port, fault, to_target=to_target)
        )
        yield port
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def open_links_out(
    nets: list[Any], faulty: int, fault: LinkFault
) -> AsyncIterator[dict[int, int]]:
    """A faulty link from member ``faulty`` to each other member (the fault on
    the bytes it sends): the port it dials for each, by member."""
    async with AsyncExitStack() as stack:
        ports = {}
        for j, net in enumerate(nets):
            if j != faulty:
                ports[j] = await stack.enter_async_context(
                    open_link(net.port, fault, to_target=True)
                )
        yield ports


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", KINDS)
async def test_allreduce_excludes_a_faulty_link_and_averages_only_clean_data(
    kind: str, seed: int
) -> None:
    rng = random.Random(seed)
    faulty = rng.randrange(4)
    # ~1 KiB of each part flows per connection: hit it mid-stream
    fault = LinkFault.draw(kind, rng, low=100, high=900)
    print(f"seed {seed}: member {faulty} behind {fault}")
    # Both connection modes authenticate every frame: seed 1 runs plaintext, seed 2 encrypted.
    encrypt = seed % 2 == 0
    async with (
        open_peers(4, encrypt=encrypt) as nets,
        open_link(nets[faulty].port, fault) as port,
        open_links_out(nets, faulty, fault) as out,
    ):
        # the others dial the faulty member through the link (the fault on what
        # it answers), and it dials each of them through one (the fault on what
        # it sends: its chunks, and its part's results on its own streams)
        groups = make_groups(nets)
        members = list(groups[0].members)
        members[faulty] = replace(members[faulty], port=port)
        theirs = [replace(m, port=out[j]) if j in out else m for j, m in enumerate(members)]
        groups = [
            replace(g, members=tuple(theirs if i == faulty else members))
            for i, g in enumerate(groups)
        ]
        outcome = await run_round(nets, groups, WEIGHTS)
    healthy = [i for i in range(4) if i != faulty]
    excluded = False
    for i in healthy:
        result = outcome.results[i]
        assert isinstance(result, AllReduceResult), result
        assert outcome.finished_at[i] - outcome.started_at <= CONFIG.round_timeout + 0.5
        excluded |= faulty in result.failed_senders | result.failed_reducers
        for part, (start, end) in enumerate(result.part_bounds):
            for chunk, contributors in enumerate(result.contributors[part]):
                a = start + chunk * result.chunk_elements
                b = min(a + result.chunk_elements, end)
                total = sum(WEIGHTS[s] for s in contributors)
                mean = sum(WEIGHTS[s] * outcome.inputs[s][a:b] for s in contributors) / total
                assert torch.allclose(outcome.outputs[i][a:b], mean, atol=1e-5, rtol=0), (
                    i,
                    part,
                    chunk,
                    contributors,
                )
                if kind == DELAY:
                    assert contributors == frozenset(range(4)), (i, part, chunk)
    assert excluded == (kind in BREAKING), (kind, [outcome.results[i] for i in healthy])


class _Redirected:
    """A peer whose dials to ``donor`` go through the faulty link (composition:
    every other attribute is the real peer's)."""

    def __init__(self, peer: Any, donor: PeerID, port: int) -> None:
        self._peer, self._donor, self._port = peer, donor, port

    def __getattr__(self, name: str) -> Any:
        return getattr(self._peer, name)

    @property
    def connections(self) -> Any:
        return self

    def open_stream(self, peer_id: PeerID, address: tuple[str, int], name: str) -> Any:
        if peer_id == self._donor:
            address = ("127.0.0.1", self._port)
        return self._peer.connections.open_stream(peer_id, address, name)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", KINDS)
async def test_state_transfer_through_a_faulty_link_loads_only_a_whole_state(
    kind: str, seed: int
) -> None:
    rng = random.Random(seed)
    fault = LinkFault.draw(kind, rng, low=100, high=8000)  # the state is ~20 KB
    print(f"seed {seed}: newest donor behind {fault}")
    good, newest = make_state(1), make_state(2)
    config = replace(TRANSFER_CONFIG, chunk_timeout=1.0)  # a stall costs one chunk timeout
    with trio.fail_after(30):
        async with open_swarm() as (nursery, bootstrap):
            healthy = await start_donor(nursery, bootstrap, 2, good, {"epoch": 5}, config=config)
            faulty = await start_donor(nursery, bootstrap, 3, newest, {"epoch": 10}, config=config)
            async with (
                open_link(faulty.peer.endpoint[1], fault) as port,
                open_newcomers(bootstrap, 10) as (newcomer,),
            ):
                peer = _Redirected(newcomer, faulty.peer.peer_id, port)
                loaded = await load(peer, template=good, config=config, timeout=20.0)
    assert loaded is not None
    if kind == DELAY:
        assert loaded.donor == faulty.peer.peer_id and loaded.version == 10
        assert_identical(loaded.state, newest)
    else:
        assert loaded.donor == healthy.peer.peer_id and loaded.version == 5
        assert_identical(loaded.state, good)
