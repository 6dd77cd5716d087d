"""Training peers in one process: each has its own sync Peer (trio thread) and
its own training thread; all threads are joined before a test ends."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

from averaging import AllReduceConfig, AveragerConfig, MatchmakingConfig
from dht import DHTConfig
from swarm import Identity, Peer, PeerConfig
from trainer import CollaborativeConfig, CollaborativeOptimizer, Task, load_task
from trainer._loop import TrainingConfig, TrainingReport, train

FAST = CollaborativeConfig(
    averaging=AveragerConfig(
        matchmaking=MatchmakingConfig(
            target_group_size=8,
            min_group_size=2,
            matchmaking_time=1.5,
            request_timeout=1.0,
            poll_interval=0.2,
        ),
        allreduce=AllReduceConfig(sender_timeout=3.0, reducer_timeout=6.0, round_timeout=10.0),
    ),
    averaging_timeout=15.0,
    progress_interval=0.2,
    progress_ttl=5.0,
    state_averaging_interval=0,
    load_state_timeout=5.0,
)
TEST_DHT = DHTConfig(rpc_timeout=0.5, bootstrap_timeout=5.0)


@dataclass(eq=False)
class TrainingPeer:
    peer: Peer
    config: TrainingConfig
    stop: threading.Event = field(default_factory=threading.Event)
    report: TrainingReport | None = None
    error: BaseException | None = None
    thread: threading.Thread | None = None
    optimizer: Any = None

    def start(
        self,
        on_epoch: Any = None,
        *,
        task: Task[Any] | None = None,
        compute_clock: Callable[[], float] = time.monotonic,
        on_start: Callable[[CollaborativeOptimizer], None] | None = None,
    ) -> None:
        task = task or load_task("digits")

        def run() -> None:
            try:
                self.report = train(
                    self.peer,
                    task,
                    self.config,
                    stop=self.stop,
                    on_epoch=on_epoch,
                    compute_clock=compute_clock,
                    on_start=on_start,
                )
            except BaseException as e:  # re-raised by the test thread in join()
                self.error = e

        self.thread = threading.Thread(target=run, name=f"train-{self.peer.peer_id.short()}")
        self.thread.start()

    def join(self, timeout: float = 120.0) -> TrainingReport:
        assert self.thread is not None
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.stop.set()
            self.thread.join()
            raise AssertionError("training did not finish in time")
        if self.error is not None:
            raise self.error
        assert self.report is not None
        return self.report


@contextmanager
def training_peers(count: int, **overrides: Any) -> Iterator[tuple[ExitStack, list[Peer]]]:
    """``count`` running peers joined into one swarm; all stopped on exit."""
    with ExitStack() as stack:
        peers: list[Peer] = []
        for i in range(count):
            initial = (peers[0].address,) if peers else ()
            config = PeerConfig(initial_peers=initial, dht=TEST_DHT, **overrides)
            peers.append(stack.enter_context(Peer(Identity.from_seed(bytes([i + 1]) * 32), config)))
        yield stack, peers


def training_config(i: int, **kwargs: Any) -> TrainingConfig:
    defaults: dict[str, Any] = dict(
        run_id="digits-test",
        target_batch_size=192,
        batch_size=32,
        max_epochs=20,
        eval_every=0,
        model_seed=0,
        data_seed=100 + i,
        optimizer=FAST,
        min_peers=3,  # start together: a lone early peer would train on alone
        min_peers_timeout=30.0,
    )
    defaults.update(kwargs)
    return TrainingConfig(**defaults)


def whole_group(opt: CollaborativeOptimizer) -> bool:
    """Did the last global step average every chunk over every member?"""
    step = opt.last_step
    if step is None or step.averaging is None or step.averaging.allreduce is None:
        return False
    result = step.averaging.allreduce
    everyone = frozenset(range(len(step.averaging.members)))
    return all(chunk == everyone for part in result.contributors for chunk in part if part)


def join_run(
    peer: Peer, config: CollaborativeConfig, *, seed: int, **kwargs: Any
) -> CollaborativeOptimizer:
    """A digits optimizer of the test run on ``peer`` outside a training loop (a
    newcomer, a restarted peer), its model built from ``seed`` (another seed than
    the run's: what it holds must come from the swarm or the checkpoint).
    ``kwargs`` go to ``CollaborativeOptimizer`` (e.g. ``checkpoint_dir``)."""
    model, inner, _ = load_task("digits").build(seed=seed)
    return CollaborativeOptimizer(
        peer,
        run_id="digits-test",
        params=model.parameters(),
        optimizer=inner,
        target_batch_size=192,
        batch_size_per_step=32,
        config=config,
        **kwargs,
    )
