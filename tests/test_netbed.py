"""Peers with addresses of their own, on emulated home links (``netbed``).

Every peer runs ``swarm`` as a user would, in a network namespace of its own
(``10.77.0.<i+1>`` on a bridge, nothing routes out): default ``--host``, the
first peer started without ``--initial-peer``, the others with the command it
prints. Links are capped with tbf (upload and download) and lossy with
iptables; there is no default route, so a peer cannot guess its address from
the route to the internet.

"Every peer's data in every average" is read from what the peers log: each
all-reduce round logs whose data reached every part of its result
(``averaging._allreduce``), and every such line must say all four.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import pytest
import trio
from cli_harness import CLIProcess, run_command, throttled_task_file
from netbed import Link, NetBed

SWARM = (sys.executable, "-m", "swarm.cli")
# the printed command starts with the path of swarm that works where it was printed
_JOIN = re.compile(r"join with: ((?:\S*/)?swarm \S+ --initial-peer (\S+):(\d+).*)$")
_ROUND = re.compile(r"all-reduce [0-9a-f]+: data of (\d+) of (\d+) senders in every part")


@asynccontextmanager
async def run_in_bed(
    bed: NetBed, peer: int, args: Sequence[str], stderr: Path
) -> AsyncIterator[CLIProcess]:
    """``swarm *args`` inside peer ``peer``'s namespace, stdout piped, stderr to
    a file; killed if still running on exit, and always reaped (``run_command``)."""
    with stderr.open("wb") as log:
        async with run_command(*bed.exec(peer, [*SWARM, *args]), stderr=log) as cli:
            yield cli


async def _join_command(peer: CLIProcess) -> tuple[list[str], str]:
    """The printed join command (argv after ``swarm``) and the announced host."""
    line = await peer.read_line_containing("join with:", timeout=60)
    match = _JOIN.search(line)
    assert match is not None, line
    return shlex.split(match.group(1))[1:], match.group(2)


async def test_announces_the_address_others_can_dial() -> None:
    """No default route, default --host: the first peer announces its only
    non-loopback address; a joining peer the address it reaches the first by."""
    with NetBed([Link(), Link()]) as bed:
        async with AsyncExitStack() as stack:
            first = await stack.enter_async_context(run_in_bed(bed, 0, ["dht"], Path("/dev/null")))
            join, host = await _join_command(first)
            assert host == bed.addresses[0], join
            second = await stack.enter_async_context(run_in_bed(bed, 1, join, Path("/dev/null")))
            _, host = await _join_command(second)
            assert host == bed.addresses[1]


OPEN_PEER = """
import trio
from swarm import PeerConfig, open_peer

async def main():
    async with open_peer(config=PeerConfig(host="0.0.0.0")) as peer:
        print(peer.address)

trio.run(main)
"""


async def test_the_python_api_announces_the_same_address() -> None:
    with NetBed([Link()]) as bed:
        with trio.fail_after(60):
            done = await trio.run_process(
                bed.exec(0, [sys.executable, "-c", OPEN_PEER]), capture_stdout=True
            )
    assert done.stdout.decode().startswith(f"{bed.addresses[0]}:"), done.stdout


async def test_no_address_but_loopback_is_a_usage_error(tmp_path: Path) -> None:
    with NetBed([Link()]) as bed:
        await trio.run_process(bed.exec(0, ["ip", "addr", "flush", "dev", "eth0"]))
        for command in (["dht"], ["train", "--threads", "1"]):
            async with run_in_bed(bed, 0, command, tmp_path / "stderr") as peer:
                with trio.fail_after(60):
                    assert await peer.process.wait() == 2
            lines = (tmp_path / "stderr").read_text().strip().splitlines()
            assert len(lines) == 1, lines
            assert lines[0].startswith(f"swarm {command[0]}: error:"), lines
            assert "--announce HOST:PORT" in lines[0]
            assert not any("join with" in line for line in peer.output)


#: 30, not 20: eleven runs of the plain links at 20 epochs ended at
#: 0.897-0.939 accuracy (one, in CI, below the 0.9 asserted below); ten
#: runs at 30 epochs, all three link layouts, at 0.930-0.961
#: (tests/test_netbed_lossy.py chose 30 for the same reason)
EPOCHS = 30
HOME = Link("20mbit", "20mbit")
#: links, the peer whose link loses 1% of packets each way once all have
#: joined, and the run's options beyond the common ones (in the join command)
#: and each peer's own (not in it)
LINKS: dict[str, tuple[list[Link], int | None, list[str], list[str]]] = {
    "20mbit": ([HOME] * 4, None, [], []),
    # peer 1's link is lossy, peer 2 uploads at a tenth of the others' rate (one
    # run for both keeps the suite short; each alone is an easier case)
    "lossy-and-slow-upload": ([HOME, HOME, Link("2mbit", "20mbit"), HOME], 1, [], []),
    # the pipelined ring with the declared, equal uploads that keep parts alike
    "ring-paced": ([HOME] * 4, None, ["--ring"], ["--upload-rate", "20mbit"]),
}
#: --min-peers starts the run when all four are seen, but the last to start may
#: still be loading the state when the first rounds run: those may average
#: three (and say so); from its first round on, every round must have all four.
JOINING_ROUNDS = 5


@pytest.mark.slow
@pytest.mark.parametrize(("links", "lossy", "run", "own"), list(LINKS.values()), ids=list(LINKS))
async def test_four_peers_find_each_other_and_train_with_everyone_in_every_average(
    links: list[Link], lossy: int | None, run: list[str], own: list[str], tmp_path: Path
) -> None:
    train = [
        "train",
        "--task", throttled_task_file(tmp_path, 0.02),
        "--run-id", "netbed",
        "--target-batch-size", "256",
        "--threads", "1",
        "--matchmaking-time", "2",
        *run,
    ]  # fmt: skip
    # not part of the run's settings, so not in the join command
    local = ["--max-epochs", str(EPOCHS), "--min-peers", "4", "--eval-every", str(EPOCHS), *own]
    finals: dict[int, str] = {}
    with NetBed(links) as bed:
        async with AsyncExitStack() as stack:
            first = await stack.enter_async_context(
                run_in_bed(bed, 0, [*train, *local], tmp_path / "peer0.log")
            )
            join, host = await _join_command(first)
            assert host == bed.addresses[0]
            peers = [first]
            for i in range(1, 4):
                peers.append(
                    await stack.enter_async_context(
                        run_in_bed(bed, i, [*join, *local], tmp_path / f"peer{i}.log")
                    )
                )
            for i in range(1, 4):
                _, host = await _join_command(peers[i])
                assert host == bed.addresses[i]  # never loopback
            if lossy is not None:
                # Only now: the DHT's bootstrap pings each initial peer once
                # (dht/_server.py ping_initial), so a lost datagram there fails
                # the join; the training that follows must cope with loss.
                bed.add_loss(lossy, 0.01)

            async def finish(i: int) -> None:
                finals[i] = await peers[i].read_line_containing("finished at epoch", timeout=240)
                with trio.fail_after(30):
                    assert await peers[i].process.wait() == 0

            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(finish, i)
    accuracies = []
    for i in range(4):
        assert finals[i].startswith(f"finished at epoch {EPOCHS}: accuracy "), finals[i]
        accuracies.append(float(finals[i].split("accuracy ")[1].split(",")[0]))
        lines = (tmp_path / f"peer{i}.log").read_text().splitlines()
        rounds = [(int(m.group(1)), int(m.group(2))) for m in map(_ROUND.search, lines) if m]
        # nobody who formed a group with us was left out of any part
        assert all(k == m for k, m in rounds), (i, rounds)
        first = rounds.index((4, 4))
        assert first <= JOINING_ROUNDS and all(r == (4, 4) for r in rounds[first:]), (i, rounds)
        assert len(rounds) - first >= EPOCHS - JOINING_ROUNDS, (i, rounds)
        if "--ring" in run:  # every round of the four went around the ring
            rings = [line for line in lines if _ROUND.search(line) and "(around the ring)" in line]
            assert len(rings) >= len(rounds) - first, (i, len(rings), len(rounds) - first)
    assert min(accuracies) >= 0.9, accuracies
    # one model: every average held every peer's data, so no peer drifted
    assert max(accuracies) - min(accuracies) <= 0.02, accuracies


#: One peer of ``test_parts_follow_the_measured_upload_rates``: averages its
#: vector with the others for ROUNDS rounds (a file barrier before each, so
#: that every round has all four) and prints one JSON line per round.
AVERAGE_ROUNDS = """
import json, sys, time
from pathlib import Path

import torch, trio

from averaging import AllReduceConfig, Averager, AveragerConfig, MatchmakingConfig, MoshpitGrid
from swarm import Identity, PeerConfig, open_peer

index, peers, rounds, size = (int(a) for a in sys.argv[1:5])
host, first, directory = sys.argv[5], sys.argv[6], Path(sys.argv[7])
PORT = 31337
CONFIG = AveragerConfig(
    matchmaking=MatchmakingConfig(
        target_group_size=peers, min_group_size=peers, matchmaking_time=5.0,
        request_timeout=2.0, poll_interval=0.2,
    ),
    allreduce=AllReduceConfig(sender_timeout=10.0, reducer_timeout=20.0, round_timeout=60.0),
)


def wait_for(names):
    deadline = time.monotonic() + 120
    while not all((directory / name).exists() for name in names):
        if time.monotonic() > deadline:
            raise SystemExit(f"peer {index}: nobody else reached {names}")
        time.sleep(0.05)


def barrier(name):
    (directory / f"{name}.{index}").touch()
    wait_for([f"{name}.{i}" for i in range(peers)])


async def main():
    if index:
        await trio.to_thread.run_sync(wait_for, ["listening.0"])
    config = PeerConfig(
        host=host, port=PORT, initial_peers=() if index == 0 else (f"{first}:{PORT}",)
    )
    identity = Identity.from_seed(bytes([index + 1]) * 32)
    async with open_peer(identity, config) as peer:
        (directory / f"listening.{index}").touch()
        x = torch.randn(size, generator=torch.Generator().manual_seed(index))
        averager = Averager(peer, [x], prefix="links", config=CONFIG, grid=MoshpitGrid(1, peers))
        for r in range(rounds):
            await trio.to_thread.run_sync(barrier, f"round{r}")
            start = time.monotonic()
            res = await averager.step(round=r, expected_peers=peers)
            members = res.group.members if res.group is not None else ()
            print(json.dumps({
                "round": r,
                "me": bytes(peer.peer_id).hex(),
                "members": [bytes(m.peer_id).hex() for m in members],
                "uploads": [m.upload for m in members],
                "modes": [m.mode.value for m in members],
                "parts": [b - a for a, b in res.allreduce.part_bounds] if res.allreduce else [],
                "contributors": len(res.contributors),
                "seconds": time.monotonic() - start,
            }), flush=True)
        await trio.to_thread.run_sync(barrier, "done")


trio.run(main)
"""


@pytest.mark.slow
def test_parts_follow_the_measured_upload_rates(tmp_path: Path) -> None:
    """One peer uploads at a tenth of the others' rate. The first round cuts
    equal parts (nobody has measured yet); from then on every member publishes
    the upload rate it measured, the slow peer's is the smallest by far, and
    the parts are cut in proportion to the published rates."""
    import json

    from averaging import MemberMode
    from averaging._partition import part_sizes

    peers, rounds, size, slow = 4, 4, 250_000, 2
    fast = Link("40mbit", "40mbit")
    links = [fast, fast, Link("4mbit", "40mbit"), fast]
    with NetBed(links) as bed:
        procs = []
        for i in range(peers):
            argv = [sys.executable, "-c", AVERAGE_ROUNDS, str(i), str(peers), str(rounds)]
            argv += [str(size), bed.addresses[i], bed.addresses[0], str(tmp_path)]
            with (tmp_path / f"out{i}").open("wb") as out, (tmp_path / f"err{i}").open("wb") as err:
                procs.append(bed.popen(i, argv, stdout=out, stderr=err))
        for i, proc in enumerate(procs):
            code = proc.wait(timeout=240)
            assert code == 0, (i, (tmp_path / f"err{i}").read_text()[-3000:])
    reports = [
        [json.loads(line) for line in (tmp_path / f"out{i}").read_text().splitlines()]
        for i in range(peers)
    ]
    slow_id = reports[slow][0]["me"]
    for i in range(peers):
        assert [r["round"] for r in reports[i]] == list(range(rounds)), reports[i]
        for r in reports[i]:
            # everyone's data in every round: the parts did not cost anyone out
            assert len(r["members"]) == peers and r["contributors"] == peers, r
        assert reports[i][0]["uploads"] == [0.0] * peers  # nothing measured yet
        assert len(set(reports[i][0]["parts"])) <= 2, reports[i][0]  # equal, +-1
        for r in reports[i][2:]:
            uploads, parts = r["uploads"], r["parts"]
            modes = [MemberMode(m) for m in r["modes"]]
            assert all(u > 0 for u in uploads), r
            assert parts == part_sizes(size, uploads, modes), r
            s = r["members"].index(slow_id)
            others = [j for j in range(peers) if j != s]
            # the links differ tenfold; a third leaves room for measurement noise
            assert uploads[s] < min(uploads[j] for j in others) / 3, r
            assert parts[s] < min(parts[j] for j in others) / 3, r
    # every member of a round saw the same group (the same published rates)
    for r in range(2, rounds):
        assert len({json.dumps(reports[i][r]["uploads"]) for i in range(peers)}) == 1
