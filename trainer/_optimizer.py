"""``AsyncCollaborativeOptimizer``: one global optimizer step per
``target_batch_size`` samples of the whole swarm (DeDLOC, Diskin et al. 2021),
as an async coordinator on the peer's trio thread; ``CollaborativeOptimizer``
(``_sync_optimizer``) is its synchronous facade.

The user's loop is an ordinary PyTorch loop::

    loss.backward(); await opt.step(); opt.zero_grad()

``step()`` adds this batch's gradients (times its size) to an accumulator and
reports progress to the DHT. When the swarm as a whole has accumulated
``target_batch_size`` samples (give or take one local batch per peer: each
peer estimates the others' count from their records and rates without
waiting for news, see ``_global_batch``), every live peer averages its accumulated mean
gradient with a Moshpit group, weighted by its sample count, then takes the
inner optimizer's step: the epoch advances. A peer that finds no group applies
its own gradients and says so in its log; none waits longer than
``averaging_timeout``. With ``gradient_compression=ArcTopK(...)`` the
all-reduce carries EF21M differences compressed with ARC-Top-K, and the inner
step uses the swarm's shared gradient estimate (``_ef21m``).

Two options change what a global step is (``CollaborativeConfig``): ``diloco``
(``_diloco``: inner steps in ``step()``, an outer step every ``local_steps``)
and ``drop_compute`` (``_dropcompute``: the step also ends once this peer has
computed for its threshold).

The modes (dense gradients, ARC-Top-K/EF21M, DiLoCo) are strategies
(``_strategy``) behind one interface: the step here never asks which one is in
use. It asks the strategy what a batch adds, whether local steps or the swarm's
target end the step, what the group averages, how the average is applied, and
what of its state checkpoints, donors and newcomers carry.

Rounds: each gradient round's Moshpit grid is the one agreed for its epoch
in the DHT and read an epoch ahead (``averaging.GridSchedule``), so peers
whose estimates of the swarm differ still meet and no round waits for the
DHT; a new run's first epochs, which nobody could propose for ahead, are
proposed for as the peer joins (``GridSchedule.cold_start``), so the first
rounds do not put every peer on one key. A state round uses the gradient
round's grid. A gradient round's
matchmaking window and all-reduce timeout follow measured rounds
(``RoundTiming``, ``adaptive_timing``; the configured values are the upper
bounds).

Devices and precision: accumulators are float32 on the parameters' device;
the all-reduce averages their host copy (``averaging.HostStaging``, one
device-to-host and one host-to-device copy per global step, none for a CPU
model). A bf16/fp16 model trains float32 master weights (the inner optimizer
updates them; the model holds them rounded). A model's buffers (``model=``)
travel with the state. ``GradScaler`` accepts the optimizer (see ``_amp``).

Threads: ``AsyncCollaborativeOptimizer`` is the coordinator: ``await
opt.step()`` runs on the peer's trio thread, where the epoch state machine
lives (the ready decision, matchmaking ahead of the step, averaging, applying,
catch-up, state averaging, checkpoints). Tensor work (accumulating, the inner
optimizer step, EF21M and DiLoCo arithmetic, staging copies, checkpoint
capture) runs in a worker thread (``trio.to_thread.run_sync``) under
``_state_lock``, never on the trio thread: the event loop does not wait on
compute or on a device. A donor takes the same lock (without waiting) to copy
the state, so the state a newcomer receives is always a whole step's.
Matchmaking ahead of the step is posted into the coordinator's inbox
(``_post``: ``TrioToken.run_sync_soon``), never awaited by the step.

``CollaborativeOptimizer`` (``_sync_optimizer``) is the synchronous facade
for a training loop in its own thread: it does the batch's own work there
(``_take_batch``), decides from the tracker's latest reading whether the
global step is due (``_quick_decision``, no crossing when it is not), and
otherwise crosses into the trio thread once (``_complete``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import threading
import time
import warnings
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import torch
import trio

from averaging import (
    UNCHECKED,
    Averager,
    AveragerConfig,
    ChunkedStaging,
    Expected,
    GridAgreement,
    GridSchedule,
    Group,
    HostStaging,
    LoadedState,
    LocalTensorError,
    MoshpitGrid,
    StateTransferConfig,
    StepResult,
    chunked_contributors,
    listen_to_sender_weights,
    load_state_from_peers,
    sender_weights,
    serve_state,
)
from swarm import (
    ClosedError,
    ConfigError,
    NonFiniteError,
    PeerID,
    ProtocolError,
    SwarmError,
)

from ._amp import DeviceChecks, Verdicts, device_flags, grads_finite, unscale
from ._buffers import BUFFER_KEY, model_buffers, plain_name
from ._checkpoint import Checkpoint, CheckpointDir
from ._diloco import DiLoCo, OuterLoop
from ._drift import ResyncSchedule, diverged_fraction, kept_own_fraction, lost_fraction
from ._dropcompute import ComputeBudget, DropCompute
from ._ef21m import EF21M, ArcTopK
from ._offload import OffloadedMasters
from ._peer_protocol import TrainerPeer
from ._progress import (
    PeerProgress,
    RateMeter,
    SwarmProgress,
    estimate,
)
from ._progress_tracker import ProgressTracker, Reading, TrackerConfig, expected_peers
from ._round_timing import RoundTiming
from ._strategy import (
    CompressedGradients,
    DenseGradients,
    GradHook,
    LocalSGD,
    Strategy,
    Trainee,
)

log = logging.getLogger(__name__)

_NONFINITE = (
    "gradients hold NaN or Inf and were not accumulated"
    " (a diverging loss: lower the learning rate or clip gradients)"
)


def _nothing() -> None:
    """A write-back with nothing to write: the step applies what it averaged in place."""


T = TypeVar("T")
P = ParamSpec("P")


def _weak(method: Callable[P, T]) -> Callable[P, T]:
    """``method`` called without holding its object: the optimizer's parts
    (its tracker, its strategy) call back into it, and that cycle kept a
    dropped optimizer's model, accumulators and device memory until the cycle
    collector ran. Raises ``ClosedError`` once the object is gone."""
    ref = weakref.WeakMethod(method)

    def call(*args: P.args, **kwargs: P.kwargs) -> T:
        bound = ref()
        if bound is None:
            raise ClosedError("the optimizer is gone")
        return bound(*args, **kwargs)

    return call


LRScheduler = torch.optim.lr_scheduler.LRScheduler
ReduceLROnPlateau = torch.optim.lr_scheduler.ReduceLROnPlateau
__all__ = [
    "AsyncCollaborativeOptimizer",
    "CollaborativeConfig",
    "GlobalStep",
    "GradHook",
    "expected_peers",
]


@dataclass(frozen=True)
class CollaborativeConfig:
    """How a peer takes part in collaborative training; validated on construction."""

    averaging: AveragerConfig = field(default_factory=AveragerConfig)
    #: no peer blocks longer than this in one averaging round (seconds)
    averaging_timeout: float = 60.0
    #: how often a peer publishes its progress and re-reads the swarm's (seconds)
    progress_interval: float = 1.0
    #: peers silent for this long are presumed gone (and their records expire)
    progress_ttl: float = 30.0
    #: average parameters and optimizer state every this many epochs (0: never)
    state_averaging_interval: int = 10
    #: write a checkpoint every this many epochs (with a checkpoint directory)
    checkpoint_every: int = 10
    #: how long a newcomer or a peer that fell behind tries to download the state
    load_state_timeout: float = 60.0
    #: begin matchmaking when the swarm is estimated this many seconds from the
    #: target, so the group is ready when the last batch is (DeDLOC, section 3.2)
    matchmaking_lead: float = 1.0
    state_transfer: StateTransferConfig = field(default_factory=StateTransferConfig)
    #: compress the gradient all-reduce (None: dense); see ``ArcTopK``
    gradient_compression: ArcTopK | None = None
    #: DiLoCo mode (see ``DiLoCo``): local steps, then an outer step; None: off
    diloco: DiLoCo | None = None
    #: a compute budget per global step (see ``DropCompute``); None: off
    drop_compute: DropCompute | None = None
    #: average gradients over the lossy data plane (``AllReduceConfig.lossy``):
    #: for lossy or long links. Parameters are then re-synchronised at a period
    #: chosen from the measured loss (``_drift``): in the gradient round itself
    #: (they ride with the gradients), and with the optimizer state in a state
    #: round over the lossy data plane every ``state_averaging_interval`` epochs.
    #: Dense gradients only. A run setting every peer must share (``swarm train
    #: --lossy``), as are ``state_averaging_interval`` and ``state_chunk_elements``.
    lossy: bool = False
    #: keep float32 master copies of the parameters and the inner optimizer's
    #: state in host memory and step there, once per global step (``_offload``):
    #: the device holds the model, gradients and accumulators only. Not with
    #: DiLoCo, whose inner optimizer steps after every batch.
    offload_optimizer: bool = False
    #: state averaging stages and averages the state (parameters, optimizer
    #: state, buffers) this many values at a time through one reused host
    #: buffer, not all of it at once; every peer of a run must use the same
    state_chunk_elements: int = 1 << 24
    #: adapt the gradient round's matchmaking window and all-reduce timeout to
    #: measured rounds (``RoundTiming``); ``averaging.matchmaking.matchmaking_time``
    #: and ``averaging_timeout`` stay the upper bounds. False: always use those.
    adaptive_timing: bool = True

    def __post_init__(self) -> None:
        bound = self.averaging.matchmaking.bound
        if not (math.isfinite(self.averaging_timeout) and self.averaging_timeout > bound):
            raise ConfigError(
                f"averaging_timeout ({self.averaging_timeout}s) must exceed the matchmaking bound "
                f"({bound:g}s = matchmaking_time + 2 * request_timeout), or no group can form"
            )
        if not 0 < self.progress_interval < self.progress_ttl:
            raise ConfigError(
                f"progress_interval ({self.progress_interval}s) must be positive and below "
                f"progress_ttl ({self.progress_ttl}s), or live peers look gone"
            )
        if self.state_chunk_elements < 1:
            raise ConfigError(f"state_chunk_elements={self.state_chunk_elements} must be >= 1")
        if self.state_averaging_interval < 0 or self.checkpoint_every < 1:
            raise ConfigError("state_averaging_interval must be >= 0 and checkpoint_every >= 1")
        if self.load_state_timeout <= 0:
            raise ConfigError("load_state_timeout must be positive")
        if not 0 <= self.matchmaking_lead < self.averaging.allreduce.sender_timeout:
            raise ConfigError(
                f"matchmaking_lead ({self.matchmaking_lead}s) must be >= 0 and below the "
                f"all-reduce's sender_timeout ({self.averaging.allreduce.sender_timeout}s): "
                "members of an early group must all be ready before they drop each other"
            )
        if self.gradient_compression is not None and not isinstance(
            self.gradient_compression, ArcTopK
        ):
            raise ConfigError("gradient_compression must be None (dense) or an ArcTopK(...)")
        if self.lossy and (self.gradient_compression is not None or self.diloco is not None):
            raise ConfigError(
                "lossy averages dense float32 gradients: it cannot be combined with "
                "gradient_compression or diloco"
            )
        if self.lossy and self.state_averaging_interval < 1:
            raise ConfigError(
                "lossy needs state_averaging_interval >= 1: re-synchronising parameters is "
                "what keeps the peers from drifting apart"
            )
        if self.offload_optimizer and self.diloco is not None:
            raise ConfigError(
                "offload_optimizer steps the inner optimizer on the host once per global "
                "step; DiLoCo steps it after every batch: turn one of them off"
            )
        if self.gradient_compression is not None and self.diloco is not None:
            raise ConfigError(
                "gradient_compression and diloco cannot be combined: DiLoCo averages "
                "pseudo-gradients, not gradients; choose one (DiLoCo has its own codec)"
            )


@dataclass(eq=False)
class _Prematch:
    """Matchmaking begun ahead of a global step (owned by the trio thread)."""

    epoch: int
    done: trio.Event = field(default_factory=trio.Event)
    group: Group | None = None
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)


@dataclass(frozen=True)
class GlobalStep:
    """What the last global step did (for logs, tests and benchmarks)."""

    epoch: int
    samples: int
    averaging: StepResult | None
    averaging_seconds: float
    #: with DropCompute: this step's compute time on its clock, and whether it
    #: ended because the compute threshold was reached
    compute_seconds: float | None = None
    stopped_early: bool = False
    #: what ``grad_hook`` returned for this step (e.g. the gradient norm)
    hook_result: object = None

    @property
    def contributors(self) -> frozenset[PeerID]:
        """The peers whose data is in every element of this step's average
        (empty when this peer applied its own gradients alone)."""
        return frozenset() if self.averaging is None else self.averaging.contributors


class AsyncCollaborativeOptimizer:
    """The collaborative step as an async coordinator on the peer's trio thread.

    Open it with ``open_peer`` in one ``trio.run``::

        async with open_peer(identity, peer_config) as peer:
            async with AsyncCollaborativeOptimizer.open(
                peer, run_id="demo", model=model, optimizer=inner,
                target_batch_size=256, batch_size_per_step=32,
            ) as opt:
                for batch in batches:
                    loss = await trio.to_thread.run_sync(forward_backward, batch)
                    await opt.step(loss=loss)
                    opt.zero_grad()

    ``peer`` is a running async peer (any ``TrainerPeer``: ``open_peer``'s
    ``AsyncPeer``). ``params`` are the parameters the ``optimizer`` updates
    (every peer of a run has the same architecture); ``model`` may be given
    instead (or as well): then its buffers (BatchNorm statistics, any
    registered buffer) are averaged with the state, sent to newcomers and
    saved in checkpoints. Parameters and accumulators may live on any device
    and in any floating dtype; the accumulated gradients are float32 on the
    parameters' device, and what goes on the wire passes through one host
    staging layer (``averaging.HostStaging``).

    The epoch state machine (the ready decision, matchmaking ahead of the
    step, averaging, applying, catch-up, state averaging, checkpoints) runs
    on the trio thread; every piece of tensor work (accumulating, the inner
    step, the strategies' arithmetic, staging copies, checkpoint capture)
    runs in a worker thread (``trio.to_thread.run_sync``) under the one state
    lock, so the event loop never waits on compute or on a device and donors
    see whole steps. ``grad_hook`` is called on the averaged gradient before
    each inner step (see ``GradHook``). ``scheduler`` is stepped once per
    global step; a ``ReduceLROnPlateau`` with the value last given to
    ``report_metric`` (else the smoothed loss). ``batch_size_per_step`` is the
    default number of samples behind one ``step()``. With ``checkpoint_dir``
    the state is saved every ``config.checkpoint_every`` epochs and at
    ``aclose()``, and resumed on start (unless the swarm is further ahead).
    The constructor raises ``ConfigError`` for settings that cannot work and
    starts nothing: ``open`` (or ``start`` then ``aclose``) does, on the
    peer's trio thread. ``CollaborativeOptimizer`` is the
    synchronous facade over this class for a training loop in its own thread.
    """

    def __init__(
        self,
        peer: TrainerPeer,
        *,
        run_id: str,
        params: Iterable[torch.nn.Parameter] | None = None,
        optimizer: torch.optim.Optimizer,
        target_batch_size: int,
        batch_size_per_step: int,
        scheduler: LRScheduler | ReduceLROnPlateau | None = None,
        model: torch.nn.Module | None = None,
        grad_hook: GradHook | None = None,
        config: CollaborativeConfig | None = None,
        checkpoint_dir: str | Path | None = None,
        load_state: bool = True,
        compute_clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not run_id or len(run_id) > 64 or any(c.isspace() or c in "[]" for c in run_id):
            raise ConfigError(f"run_id {run_id!r} must be 1-64 characters, no spaces or brackets")
        if target_batch_size < 1 or batch_size_per_step < 1:
            raise ConfigError("target_batch_size and batch_size_per_step must be at least 1")
        self.peer = peer
        self.run_id = run_id
        if params is None and model is None:
            raise ConfigError("give the parameters to train (params=) or the model (model=)")
        source = params if params is not None else model.parameters()  # type: ignore[union-attr]
        self.params = [p for p in source if p.requires_grad]
        if not self.params:
            raise ConfigError("no trainable parameters")
        self.optimizer = optimizer
        self._warn_foreign_params()
        #: float32 master copies that the inner optimizer updates when the model
        #: is in a lower precision (bf16/fp16); the model gets a rounded copy
        #: after each step. None: float32 parameters, or DiLoCo mode.
        self._masters: list[torch.nn.Parameter] | None = None
        self._model_param: dict[int, torch.nn.Parameter] = {}
        #: the masters in host memory, with config.offload_optimizer (``_offload``)
        self._offload: OffloadedMasters | None = None
        if config is not None and config.offload_optimizer:
            self._offload = OffloadedMasters(self.params)
            self._masters = self._make_masters(self._offload.masters)
        elif (config is None or config.diloco is None) and any(
            p.dtype != torch.float32 for p in self.params
        ):
            self._masters = self._make_masters()
        self.scheduler = scheduler
        self.grad_hook = grad_hook
        self.model = model
        #: the model's buffers by name (``_orig_mod.`` of ``torch.compile`` cut)
        self.buffers: dict[str, torch.Tensor] = {} if model is None else model_buffers(model)
        #: the value ``ReduceLROnPlateau`` steps with (None: the smoothed loss)
        self._metric: float | None = None
        self._scheduler_error: Exception | None = None
        self.target_batch_size = target_batch_size
        self.batch_size_per_step = batch_size_per_step
        self.config = config or CollaborativeConfig()
        self.epoch = 0
        self.last_step: GlobalStep | None = None
        #: the peer whose state this one last downloaded (None: never)
        self.state_source: PeerID | None = None
        self.loss: float | None = None
        self.accuracy: float | None = None
        #: the mode: what a step accumulates and averages, and how it applies it
        self._strategy = self._make_strategy()
        #: the host copy the all-reduce averages (the strategy's tensors
        #: themselves for a CPU model: nothing is copied)
        self._staging = HostStaging(self._strategy.averaged)
        #: losses passed as tensors, read at the next global step (not per batch)
        self._pending_losses: list[torch.Tensor] = []
        #: batches accumulated before the device said whether they were finite
        #: (a CUDA model's: ``_amp``), settled by the training thread
        self._checks = DeviceChecks()
        self._samples = 0
        #: this peer's latest micro-batch: the others count it for at least
        #: one more while it adds to an epoch (``_global_batch``)
        self._batch = 0
        self._rate = RateMeter()
        #: publishes this peer's record and reads the swarm's (see ``_progress_tracker``)
        self._progress = ProgressTracker(
            peer.dht,
            peer.peer_id,
            run_id,
            record=_weak(self._record),
            target_batch_size=target_batch_size,
            config=TrackerConfig(
                progress_interval=self.config.progress_interval,
                progress_ttl=self.config.progress_ttl,
                # silent for a whole matchmaking window (or a few publications):
                # it would have missed this round's group anyway
                fresh_within=max(
                    2.5 * self.config.progress_interval,
                    self.config.averaging.matchmaking.matchmaking_time,
                ),
            ),
        )
        self._last_poke = -math.inf
        self._refresh_seconds = 0.0
        #: this peer adds nothing to its epoch now: from the moment it stops
        #: adding to a step until the step (with any state averaging and
        #: checkpoint after it) is over
        self._frozen = False
        #: monotonic time this peer began adding to its epoch's step
        self._epoch_began = -math.inf
        self._next_catch_up = -math.inf
        #: matchmaking begun ahead of the global step (trio thread), and the
        #: epoch it was begun for (training thread)
        self._prematch: _Prematch | None = None
        self._prematch_epoch = -1
        #: the latest epoch whose matchmaking began (trio thread)
        self._matchmaking_epoch = -1
        #: set when a weight-0 join of a group formed ahead (``_join_formed_group``)
        #: is over; the next matchmaking on the same averager waits for it
        self._joining: trio.Event | None = None
        self._checkpoints = CheckpointDir(Path(checkpoint_dir)) if checkpoint_dir else None
        #: kinds of checkpoint write failures already warned about (see _save_checkpoint)
        self._checkpoint_failures: set[str] = set()
        #: the epoch of the last checkpoint written (None: none yet)
        self._checkpointed_epoch: int | None = None
        #: each epoch's Moshpit grid, agreed through the DHT (see ``_agreed_grid``)
        self._grids = GridSchedule(
            GridAgreement(
                prefix=run_id,
                target_group_size=max(2, self.config.averaging.matchmaking.target_group_size),
            ),
            peer.peer_id,
        )
        #: the background proposal and read of later grids (one at a time)
        self._grids_ahead = trio.CancelScope()
        self._grids_busy = False
        self._grad_averager = self._make_grad_averager()
        self._timing = RoundTiming.for_rounds(
            self.config.averaging.matchmaking,
            averaging_timeout=self.config.averaging_timeout,
            matchmaking_lead=self.config.matchmaking_lead,
            progress_interval=self.config.progress_interval,
            adaptive=self.config.adaptive_timing,
        )
        drop = self.config.drop_compute
        self._budget = None if drop is None else ComputeBudget(drop, compute_clock)
        #: this step's compute budget is spent (DropCompute): average now
        self._out_of_time = False
        self._state_averager: Averager | None = None
        self._state_staging: ChunkedStaging | None = None
        self._resync = (
            ResyncSchedule(self.config.state_averaging_interval) if self.config.lossy else None
        )
        #: the host copy of the parameters and buffers that ride with a lossy
        #: run's gradients when they re-synchronise (``_riding``)
        self._riding_staging: ChunkedStaging | None = None
        #: the epoch whose re-synchronisation rode with its gradient round,
        #: and the staging that holds the averaged values until ``_apply``
        self._rode: tuple[int, ChunkedStaging] | None = None
        self._closed = False
        self._started = False
        #: the peer stopped under this open optimizer (its services ended)
        self._peer_stopped = False
        #: (epoch, the samples of group-mates whose round of that epoch began:
        #: final), replaced whole on the trio thread, read by the training
        #: thread's decisions (``_ready``)
        self._finals: tuple[int, Mapping[PeerID, float]] = (-1, {})
        self._listening = contextlib.ExitStack()
        self._load_state = load_state
        #: held while the state changes (see the module doc); donors try it
        self._state_lock = threading.Lock()
        #: the trio side's own work that a training thread posts without
        #: waiting (``_post``): a step that does not end an epoch never waits
        #: on the trio thread
        self._token: trio.lowlevel.TrioToken | None = None  # set by ``start``
        self._inbox, self._inbox_receive = trio.open_memory_channel[Callable[[], Awaitable[None]]](
            math.inf
        )
        self._coordinator = trio.CancelScope()
        self._donor = trio.CancelScope()
        self._tracker = trio.CancelScope()

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls, peer: TrainerPeer, **kwargs: Any
    ) -> AsyncIterator[AsyncCollaborativeOptimizer]:
        """``async with AsyncCollaborativeOptimizer.open(peer, ...) as opt``:
        constructed (same arguments as the constructor), started (``start``)
        and, on leaving, closed (``aclose``: a final checkpoint, out of the
        progress table), also when the block raises or is cancelled."""
        opt = cls(peer, **kwargs)
        try:
            await opt.start()
            yield opt
        finally:
            with trio.CancelScope(shield=True):
                await opt.aclose()

    async def start(self) -> None:
        """Start the peer's services of this optimizer (coordinator, donor,
        tracker), resume from the newest checkpoint, and download the swarm's
        state when it is ahead (``load_state``). Returns when this peer is in
        the run, ready to train. Raises ``ConfigError`` for a checkpoint that
        does not fit; on cancellation, ``aclose`` undoes what was started."""
        if self._started:
            return
        self._started = True
        self._token = trio.lowlevel.current_trio_token()
        peer = self.peer
        self._coordinator = await peer.start_service(self._serve_inbox, self._inbox_receive)
        self._listening.enter_context(
            listen_to_sender_weights(peer.connections, self._note_sender_weight)
        )
        self._donor = await self._start_donor()
        if self._checkpoints is not None:
            await self._resume_from_checkpoint()
        # Read the swarm without publishing: a peer is in the run (others count
        # it in ``wait_for_peers`` and expect it in their rounds) only once it
        # can train, not while it downloads the state. Counted earlier, it made
        # the peers waiting for it start, fill the first target without it and
        # close the round before it could join.
        await self._progress.refresh(publish=False)
        if self._load_state and self._reading is not None and self._reading.swarm.num_peers > 1:
            await self._catch_up(initial=True)
        await self._progress.refresh()  # ready: in the run from now on
        await self._propose_cold_grids()
        self._tracker = await self._start_tracker()

    # -- the user's API ---------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's parameter groups (what ``GradScaler`` unscales).

        With float32 master weights these are copies of the groups that list
        the model's parameters (whose ``.grad`` the backward pass fills):
        change hyperparameters on the inner optimizer itself."""
        if self._masters is None:
            return self.optimizer.param_groups
        return [
            group | {"params": [self._model_param[id(m)] for m in group["params"]]}
            for group in self.optimizer.param_groups
        ]

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        """The inner optimizer's per-parameter state."""
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def _warn_foreign_params(self) -> None:
        ours = {id(p) for p in self.params}
        foreign = sum(
            1
            for group in self.optimizer.param_groups
            for p in group["params"]
            if id(p) not in ours and p.requires_grad
        )
        if foreign:
            warnings.warn(
                f"the optimizer holds {foreign} trainable parameters that are not in params: "
                "the swarm neither averages nor shares them, so peers drift apart on them",
                stacklevel=3,
            )

    def _with_lock(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the calling thread (never the trio thread: it may
        wait for the lock) under the state lock: tensor work that changes the
        state donors send."""
        with self._state_lock:
            return fn(*args)

    async def _locked(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread under the state lock (see
        ``_with_lock``). Not abandoned on cancellation: a state change is
        always whole; the cancellation is delivered once it is done."""
        return await trio.to_thread.run_sync(self._with_lock, fn, *args)

    def report_metric(self, value: float) -> None:
        """The metric a ``ReduceLROnPlateau`` scheduler steps with at the next
        global step (e.g. a validation loss). Raises ``ConfigError`` if it is
        not a finite number."""
        if not math.isfinite(value):
            raise ConfigError(f"metric must be a finite number, got {value}")
        self._metric = float(value)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' ``.grad`` (the accumulated gradients are kept)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        if self._masters is not None:
            for p in self.params:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.detach_().zero_()

    def _make_masters(
        self, masters: list[torch.nn.Parameter] | None = None
    ) -> list[torch.nn.Parameter]:
        """float32 copies of the parameters (``masters``, or new ones on the
        parameters' devices), put in their place in the inner optimizer (its
        groups and any state it already has)."""
        if masters is None:
            masters = [
                torch.nn.Parameter(p.detach().to(torch.float32, copy=True)) for p in self.params
            ]
        master_of = {id(p): m for p, m in zip(self.params, masters, strict=True)}
        self._model_param = {id(m): p for p, m in zip(self.params, masters, strict=True)}
        for group in self.optimizer.param_groups:
            group["params"] = [master_of.get(id(p), p) for p in group["params"]]
        for p in self.params:
            if p in self.optimizer.state:
                self.optimizer.state[master_of[id(p)]] = self.optimizer.state.pop(p)
        return masters

    @property
    def _trained(self) -> list[torch.nn.Parameter]:
        """What the inner optimizer updates: the float32 masters, or the parameters."""
        return self.params if self._masters is None else self._masters

    def _sync_model(self) -> None:
        """Round the float32 masters into the model's parameters."""
        if self._offload is not None:
            self._offload.to_model()
        elif self._masters is not None:
            with torch.no_grad():
                model: list[torch.Tensor] = list(self.params)
                torch._foreach_copy_(model, list(self._masters))

    async def step(
        self,
        batch_size: int | None = None,
        *,
        loss: float | torch.Tensor | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> bool:
        """Account for one local batch; take the global step when the swarm is ready.

        Returns True if a global step (averaging and the inner optimizer step)
        happened. With ``config.drop_compute`` the global step also happens once
        this peer has computed for longer than its threshold in this step, with
        the samples it has (the loop needs no change). In DiLoCo mode the inner
        optimizer steps now, and the global step is the outer step after
        ``local_steps`` of these calls. Waits at most ``averaging_timeout`` for
        averaging, plus the time to download the state when this peer fell
        behind the swarm. The batch's tensor work runs in a worker thread.
        Raises ``ConfigError`` once closed, ``ClosedError`` once the peer
        stopped, and ``NonFiniteError`` (changing nothing: the batch is not
        counted) if a gradient holds NaN or Inf: averaged in, it would reach
        the whole group, whose reducers would exclude and ban this peer. For a
        CUDA model that check does not wait for the device (``_amp``): a
        failing batch is added as zeros and taken out of the count, and the
        error comes from the call that reads the device's verdict, the batch's
        own or a later one (at the latest the one that would take the global
        step), whose own batch counts. ``loss`` may be a tensor (on any
        device): it is read at the next global step, not now, so the step does not wait
        for the device. With ``grad_scaler`` (the ``GradScaler`` of an AMP
        loop) the gradients are unscaled first, and a batch that overflowed is
        skipped: it returns False, counts for nothing and raises nothing. On
        cancellation a batch already accumulated stays counted; a global step
        cancelled while averaging applies nothing of the round and the next
        call starts over from the ready decision.
        """
        size = self.batch_size_per_step if batch_size is None else batch_size
        now = await trio.to_thread.run_sync(self._take_batch, size, loss, grad_scaler, self)
        if now is None or self._quick_decision(size, now) is False:
            return False
        if self._checks and not await trio.to_thread.run_sync(self._settle_checks):
            return False
        return await self._complete(size, now)

    def _take_batch(
        self,
        size: int,
        loss: float | torch.Tensor | None,
        grad_scaler: torch.amp.GradScaler | None,
        scaled: Any,
    ) -> float | None:
        """The batch's own work, in the calling (not the trio) thread: unscale
        (``scaled`` is the optimizer the scaler knows), check, accumulate and
        count it. The monotonic time, or None if the batch overflowed and was
        skipped. Raises like ``step``."""
        if self._closed:
            raise ConfigError("the optimizer is closed")
        if self._peer_stopped:
            raise ClosedError("the peer stopped: this optimizer cannot take part in the run")
        strategy = self._strategy
        flags = device_flags(self.params, grad_scaler, scaled) if strategy.defers_checks else None
        if flags is not None:  # a CUDA model: the device's verdict is read later
            finite, overflowed = flags
            strategy.accumulate(size, keep=finite if overflowed is None else finite & ~overflowed)
            self._checks.add(size, loss, finite, overflowed)
            now = self._account(size, None)
            self._apply_verdicts(self._checks.settle(wait=False))
            return now
        if grad_scaler is not None and unscale(grad_scaler, scaled):
            log.debug("epoch %d: the scaled gradients overflowed; batch skipped", self.epoch)
            return None
        if not grads_finite(self.params):
            raise NonFiniteError(f"this batch's {_NONFINITE}")
        if strategy.local_steps_left() is None:
            strategy.accumulate(size)  # into accumulators of our own: no lock
        else:
            self._with_lock(strategy.accumulate, size)  # a local step changes the parameters
        return self._account(size, loss)

    def _settle_checks(self) -> bool:
        """Before the global step: wait for the device's verdicts on the
        batches accumulated before it gave them (``_amp``). True if all were
        accepted; False if an overflow was skipped (the count changed: the
        next call decides again). Raises ``NonFiniteError`` for NaN or Inf."""
        verdicts = self._checks.settle(wait=True)
        self._apply_verdicts(verdicts)
        return verdicts.refused == 0

    def _apply_verdicts(self, verdicts: Verdicts) -> None:
        """Take refused batches out of the count and fold the accepted ones'
        losses; raises ``NonFiniteError`` if one held NaN or Inf (it was added
        to the accumulators as zeros)."""
        self._samples = max(0, self._samples - verdicts.refused)
        for loss in verdicts.losses:
            self._fold_batch_loss(loss)
        if verdicts.nonfinite:
            n = verdicts.nonfinite
            batches = "an earlier batch's" if n == 1 else f"{n} earlier batches'"
            raise NonFiniteError(
                f"{batches} {_NONFINITE}; read back from the device only now, since the"
                " check does not wait for it (this call's own batch was taken)"
            )

    def _quick_decision(self, size: int, now: float) -> bool | None:
        """What can be decided without waiting on the trio side (from the
        tracker's latest reading; callable from any thread): False if the
        global step is not due (after posting what the trio side should do
        meanwhile: wake the tracker, begin matchmaking ahead), None if
        ``_complete`` must decide (a reading too old, a swarm ahead, the step
        due)."""
        left = self._strategy.local_steps_left()
        if left is not None:
            if left > 0 and not self._out_of_time:
                self._maybe_prematch_local(left, size)
                return False
            return None
        reading = self._reading
        if reading is not None and reading.epoch < self.epoch - 1 and reading.swarm.num_peers <= 1:
            # alone, this peer took several global steps on one reading (a
            # step every few milliseconds, ``_alone``); that reading has aged
            # past a progress interval: the tracker reads again soon, and
            # until then only this peer's own samples can make a step due
            if self._alone_due:
                return None
            self._hurry(now)
            return False
        if reading is None or reading.epoch not in (self.epoch, self.epoch - 1):
            return None
        if reading.swarm.epoch > self.epoch and now >= self._next_catch_up:
            return None
        if self._ready(reading, size, now) or self._out_of_time:
            return None
        if reading.epoch == self.epoch:
            self._maybe_begin_matchmaking(reading, now)
        if reading.epoch != self.epoch or self._near_target(reading, now):
            # a fresher reading sharpens the estimate (the others' exact
            # counts once they stopped); the tracker reads in the
            # background while this peer computes
            self._hurry(now)
        return False

    async def _complete(self, size: int, now: float) -> bool:
        """On the trio thread: decide with fresh readings where needed (and
        catch up with a swarm that is ahead), then take the global step if it
        is due; True if it was taken."""
        left = self._strategy.local_steps_left()
        ready = (
            await self._target_reached(size, now)
            if left is None
            else await self._local_steps_done(left, size, now)
        )
        if ready is None:
            return False
        alone, expected = ready
        await self._global_step(alone=alone, expected=expected)
        return True

    async def _target_reached(self, size: int, now: float) -> tuple[bool, Expected] | None:
        """Has the swarm reached the target batch (or this peer its compute
        budget)? (alone, peers to expect) if the global step is due now, None
        if not (or after catching up with a swarm that is ahead)."""
        reading = self._reading
        if reading is None or reading.epoch not in (self.epoch, self.epoch - 1):
            # no reading from this epoch or the step before it (the first step,
            # or a download jumped epochs): read now rather than compute blind
            if not await self._refresh_now(now, force=True):
                return None
            reading = self._reading
            if reading is None or reading.epoch not in (self.epoch, self.epoch - 1):
                return None
        swarm = reading.swarm
        if swarm.epoch > self.epoch and now >= self._next_catch_up:
            log.info(
                "epoch %d is behind the swarm's %d: downloading its state", self.epoch, swarm.epoch
            )
            if not await self._catch_up(initial=False, min_epoch=swarm.epoch):
                # nobody could send that epoch: train on, try again later
                self._next_catch_up = now + self.config.progress_ttl / 2
            return None
        if self._ready(reading, size, now):
            self._out_of_time = False  # the swarm's target ended this step, not the threshold
        elif not self._out_of_time:
            if reading.epoch == self.epoch:
                self._maybe_begin_matchmaking(reading, now)
            if reading.epoch != self.epoch or self._near_target(reading, now):
                # a fresher reading sharpens the estimate (the others' exact
                # counts once they stopped); the tracker reads in the
                # background while this peer computes
                self._hurry(now)
            return None
        # Read before the last step ended, the reading names this round's
        # peers (``Reading.awaited_next``). A read here, to learn the same,
        # cost every step a DHT store and read in its way: 20-30 ms, at 10%
        # loss 35-45 ms with a tail to 160 ms (resent requests), for which
        # the other peers' lobbies waited.
        if reading.round_of(self.epoch) is None and swarm.num_peers > 1:
            await self._refresh_now(now, force=True)  # who is in this epoch's round
            reading = self._reading
            assert reading is not None
            swarm = reading.swarm
        if swarm.num_peers <= 1 and await self._refresh_now(now):
            # about to train alone: make sure nobody joined since the last
            # reading (rate-limited: a peer alone steps every few milliseconds)
            reading = self._reading
            if reading is not None and reading.epoch == self.epoch:
                swarm = reading.swarm
        # Expect every peer that is still publishing: one whose record shows the
        # last epoch is about to join (a group closed too early would leave it
        # alone), but one that went silent is not waited for.
        if reading is None:
            return swarm.num_peers <= 1, swarm.num_peers
        expected = reading.round_of(self.epoch)
        return swarm.num_peers <= 1, reading.waits_for if expected is None else expected

    async def _local_steps_done(
        self, left: int, size: int, now: float
    ) -> tuple[bool, Expected] | None:
        """With local steps (DiLoCo): are they done (or this peer's compute
        budget spent)? (alone, peers to expect) if the global step is due now,
        None if not (or after catching up with a swarm that is ahead)."""
        if left <= 0:
            self._out_of_time = False  # the local steps ended this round, not the threshold
        if left > 0 and not self._out_of_time:
            self._maybe_prematch_local(left, size)
            return None
        await self._refresh_now(now, force=True)  # who is live now, and how far they are
        reading = self._reading
        if reading is not None and reading.swarm.epoch > self.epoch and now >= self._next_catch_up:
            # the others synchronised without us: our local steps are stale
            log.info(
                "epoch %d is behind the swarm's %d: downloading its state",
                self.epoch,
                reading.swarm.epoch,
            )
            if await self._catch_up(initial=False, min_epoch=reading.swarm.epoch):
                return None
            # nobody could send that epoch yet (donors announce it a little
            # later): synchronise with the peers at ours, try again later
            self._next_catch_up = now + self.config.progress_ttl / 2
        peers = 1 if reading is None else reading.swarm.num_peers
        expected = 1 if reading is None else reading.waits_for
        return peers <= 1, expected

    def _maybe_prematch_local(self, left: int, size: int) -> None:
        """With local steps left: begin matchmaking ahead once the last of
        them is within ``matchmaking_lead`` seconds, so the group is ready
        when the last local step is. Posts; never waits."""
        reading = self._reading
        rate = self._rate.rate
        if (
            reading is not None
            and reading.swarm.num_peers > 1
            and self._prematch_epoch != self.epoch
            and rate > 0
            and left * size / rate <= self.config.matchmaking_lead
        ):
            self._prematch_epoch = self.epoch
            self._post(partial(self._begin_matchmaking, self.epoch, reading.waits_for, early=True))

    def _account(self, size: int, loss: float | torch.Tensor | None) -> float:
        """Count a local batch of ``size`` samples; returns the monotonic time."""
        self._samples += size
        self._batch = size
        if loss is not None:
            self._fold_batch_loss(loss)
        now = time.monotonic()
        self._rate.update(now, size)
        if self._budget is not None and self._budget.spent(size):
            self._out_of_time = True
        return now

    def _fold_batch_loss(self, loss: float | torch.Tensor) -> None:
        """A batch's loss: a tensor is read at the next global step, a number now."""
        if isinstance(loss, torch.Tensor):
            self._pending_losses.append(loss.detach())
        else:
            self._fold_loss(float(loss))

    def _fold_loss(self, loss: float) -> None:
        self.loss = loss if self.loss is None else 0.9 * self.loss + 0.1 * loss

    def _read_losses(self) -> None:
        """Fold the losses passed as tensors into ``loss`` (one read of the
        device per global step, in a worker thread)."""
        if not self._pending_losses:
            return
        values = torch.stack([t.reshape(()).float() for t in self._pending_losses]).tolist()
        self._pending_losses.clear()
        for value in values:
            if math.isfinite(value):
                self._fold_loss(value)

    def _end_compute(self) -> tuple[float | None, bool]:
        """This step's compute is over (DropCompute): its seconds, and whether
        the threshold ended it."""
        if self._budget is None:
            return None, False
        seconds, early = self._budget.end(), self._out_of_time
        if early:
            log.info(
                "epoch %d: compute threshold %.3gs reached after %d samples; averaging now",
                self.epoch,
                self._budget.threshold,
                self._samples,
            )
        return seconds, early

    def _begin_compute(self) -> None:
        self._out_of_time = False
        self._frozen = False  # adding to the step again: the others may count our rate
        self._epoch_began = time.monotonic()
        if self._budget is not None:
            self._budget.begin()

    @property
    def compute_threshold(self) -> float | None:
        """DropCompute's tau in seconds (None: DropCompute off, or still calibrating)."""
        return None if self._budget is None else self._budget.threshold

    def report_accuracy(self, accuracy: float) -> None:
        """Publish this peer's latest evaluation accuracy (shown by ``swarm status``)."""
        self.accuracy = accuracy
        self._poke()

    async def wait_for_peers(self, count: int, timeout: float) -> bool:
        """Wait until ``count`` peers (this one included) are in the run, or
        ``timeout`` seconds pass; True if they are. For starting a run
        together. On cancellation nothing changes.

        Every peer that waits returns within one poll of the moment the last of
        them is ready to train (see ``_wait_poll``), while that last one starts
        at once: the first round, which it opens alone after one target batch,
        stays open for a matchmaking window, and each waiter must be in it."""
        deadline = trio.current_time() + timeout
        while True:
            # Read, then decide, then sleep: deciding on the reading from before
            # the sleep made a waiter start a whole poll after it could have.
            if await self._peers_in_run(count):
                self._begin_compute()  # waiting is not compute
                return True
            if trio.current_time() >= deadline:
                self._begin_compute()
                return False
            await trio.sleep(min(self._wait_poll, max(0.0, deadline - trio.current_time())))

    async def _peers_in_run(self, count: int) -> bool:
        """Whether ``count`` peers are in the run, reading the swarm again
        unless the latest reading already shows them."""
        reading = self._reading
        if reading is None or reading.swarm.num_peers < count:
            await self._refresh_now(time.monotonic(), force=True)
            reading = self._reading
        return reading is not None and reading.swarm.num_peers >= count

    @property
    def _wait_poll(self) -> float:
        """How often ``wait_for_peers`` reads the swarm: every progress
        interval, but at least four times per matchmaking window, so that a
        waiter is in the first round before its window closes."""
        return min(
            self.config.progress_interval, self.config.averaging.matchmaking.matchmaking_time / 4
        )

    def swarm_progress(self) -> SwarmProgress:
        """The swarm's progress as last read from the DHT."""
        reading = self._reading
        if reading is None:
            return estimate([], now=0.0, target_batch_size=self.target_batch_size, stale_after=1.0)
        return reading.swarm

    def state_dict(self) -> dict[str, Any]:
        """The epoch, the inner optimizer's and scheduler's state, the float32
        masters (if any) and the mode's state (references, not copies)."""
        state = {
            "epoch": self.epoch,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
        }
        if self._masters is not None:  # the model holds them rounded
            state["masters"] = [m.detach() for m in self._masters]
        return state | self._strategy.mode_state()

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what ``state_dict`` returned, in a worker thread under the
        state lock (whole on cancellation)."""
        await self._locked(self._load_state_dict, state)

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        """``load_state_dict``'s work; the caller holds the state lock."""
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self._strategy.load_mode_state(state)
        if self._masters is not None:
            with torch.no_grad():
                if "masters" in state:
                    for m, value in zip(self._masters, state["masters"], strict=True):
                        m.copy_(value)
                else:  # saved without: the model's own values
                    for m, p in zip(self._masters, self.params, strict=True):
                        m.copy_(p)
            self._sync_model()
        self.epoch = int(state["epoch"])

    async def aclose(self) -> None:
        """Save a final checkpoint, stop serving state and leave the progress
        table. Idempotent. A ``SwarmError`` on the way out is logged, not
        raised (the peer may be gone)."""
        if self._closed:
            return
        self._closed = True
        if not self._started:
            return
        # Without local steps the state changes only at global steps, so a
        # checkpoint already written at this epoch is the final one.
        unchanged = (
            self._checkpointed_epoch == self.epoch and self._strategy.local_steps_left() is None
        )
        if self._checkpoints is not None and not unchanged:
            await self._save_checkpoint()
        self._listening.close()
        self._donor.cancel()
        self._tracker.cancel()
        self._coordinator.cancel()
        self._cancel_matchmaking()
        try:
            await self._progress.withdraw()
        except SwarmError as e:
            log.debug("could not withdraw from the swarm cleanly: %s", e)

    # -- progress ---------------------------------------------------------------

    def _ready(self, reading: Reading, size: int, now: float) -> bool:
        """Has the swarm reached the target batch (within half of what it adds
        during this peer's next batch of ``size``)? The others' records at the
        last reading, each extrapolated at its rate to now, plus everything this
        peer has (``_global_batch``). Waiting for a reading that shows the
        target made every peer compute a whole refresh past it. A peer busy
        averaging says so (``_frozen``): its count is final. A record too old
        to be a live peer's is not extrapolated: samples nobody computed are
        not counted."""
        if reading.epoch == self.epoch:
            others, elapsed = reading.others, now - reading.time
        else:
            # read before this peer's last step ended: the others toward the
            # next epoch, counted from when this one began
            others, elapsed = reading.ahead, now - max(reading.time, self._epoch_began)
        epoch, finals = self._finals
        if others is not None and epoch == self.epoch:
            others = others.settled(finals)  # group-mates whose round began
        if others is None or others.epoch != self.epoch:  # a reading without them
            reported = reading.swarm.reported - reading.samples
            return reported + self._samples >= self.target_batch_size
        # a peer whose rate is not measured yet (the first step) computes about
        # as fast as this one: counted as nothing, each filled the target alone
        mine = self._rate.rate
        total = others.total(self._samples, elapsed, prior=mine, prior_batch=size)
        if not (others.rates or others.unmeasured):  # nobody else adds: exact
            return total >= self.target_batch_size
        # Stop where the total lands nearest the target: every peer stops right
        # after a batch, so stopping only past the target overshot by about a
        # batch per peer. One more batch of ours adds what the swarm computes
        # meanwhile; stop now if that would overshoot more than we fall short.
        swarm_rate = others.rate + len(others.unmeasured) * mine + mine
        during = size * swarm_rate / mine if mine > 0 else size
        return total + during / 2 >= self.target_batch_size

    def _hurry(self, now: float) -> None:
        """Near the target: ask the tracker to refresh now (it reads in the
        background). Rate-limited like ``_refresh_now``."""
        if now - self._last_poke < self._refresh_pause:
            return
        self._last_poke = now
        self._poke()

    def _near_target(self, reading: Reading, now: float) -> bool:
        """Would the swarm reach the target within a progress interval?"""
        swarm = reading.swarm
        ahead = now - reading.time + self.config.progress_interval
        extrapolated = swarm.samples + swarm.samples_per_second * ahead
        return extrapolated - reading.samples + self._samples >= self.target_batch_size

    def _maybe_begin_matchmaking(self, reading: Reading, now: float) -> None:
        """Begin this epoch's matchmaking in the background once the swarm is
        estimated within ``matchmaking_lead`` seconds of the target."""
        swarm = reading.swarm
        if self._prematch_epoch == self.epoch or swarm.num_peers <= 1:
            return
        rate = swarm.samples_per_second
        extrapolated = swarm.samples + rate * (now - reading.time) - reading.samples + self._samples
        missing = self.target_batch_size - extrapolated
        if missing > 0 and (rate <= 0 or missing / rate > self.config.matchmaking_lead):
            return
        self._prematch_epoch = self.epoch
        self._post(partial(self._begin_matchmaking, self.epoch, reading.waits_for, early=True))

    async def _begin_matchmaking(
        self, epoch: int, expected: Expected, *, early: bool = False
    ) -> None:
        """On the trio thread: find this epoch's group as a service of the peer.

        ``early``: matchmaking ahead of the step, posted by the training thread
        (``_post``); it may arrive after the step it was for, and then does
        nothing."""
        if early and epoch <= self._matchmaking_epoch:
            return
        self._matchmaking_epoch = max(self._matchmaking_epoch, epoch)
        previous = self._prematch
        if previous is not None:
            if previous.epoch == epoch:
                return
            previous.scope.cancel()
        # no await between the check above and this: the step's own call and
        # one posted ahead by the training thread may run side by side
        prematch = _Prematch(epoch)
        self._prematch = prematch
        self._grad_averager.set_matchmaking_time(self._timing.matchmaking_time(self._swarm_size()))

        async def find(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            task_status.started()
            try:
                joining = self._joining
                if joining is not None:  # the averager is in a weight-0 round
                    await joining.wait()
                self._grad_averager.set_grid(await self._agreed_grid(epoch))
                group = prematch.group = await self._grad_averager.find_group(
                    round=epoch,
                    expected_peers=expected,
                    # lossy: whether the group re-synchronises after this
                    # round is its leader's decision (``_resync_due``, asked
                    # once the step has advanced the epoch to epoch + 1)
                    resync=None if self._resync is None else self._resync.due(epoch + 1),
                )
                if group is not None:  # its members that began before we knew it
                    begun = sender_weights(self.peer.connections, group.group_id)
                    for member, weight in begun.items():
                        self._note_sender_weight(group.group_id, member, weight)
            except* SwarmError as failed:  # matchmaking runs tasks side by side
                log.info("epoch %d: matchmaking failed: %s", epoch, failed.exceptions[0])
            finally:
                prematch.done.set()

        prematch.scope = await self.peer.start_service(find)

    async def _finish_averaging(self, weight: float, expected: Expected) -> StepResult:
        """On the trio thread: wait for this epoch's group, then all-reduce."""
        # tell the others now that this peer's count is final (``_frozen``)
        self._progress.wake()
        await self._begin_matchmaking(self.epoch, expected)
        prematch = self._prematch
        assert prematch is not None
        size = self._swarm_size()
        passed_by = not await self._wait_for_group(prematch, size)
        self._prematch = None
        group = prematch.group
        result: StepResult | None = None
        took: float | None = None
        if group is not None:
            started = trio.current_time()
            with trio.move_on_after(self._timing.averaging_timeout(size)):
                result = await self._average_in_group(group, weight)
                took = trio.current_time() - started
        count = len(expected) if isinstance(expected, frozenset) else expected
        wanted = min(count, self._grad_averager.config.matchmaking.target_group_size)
        one_group = self._grad_averager.grid.dimensions == 1
        if group is not None or not passed_by:  # late, not a window too short
            self._timing.settle(group, took, wanted=wanted, one_group=one_group, swarm_size=size)
        if group is None:
            prematch.scope.cancel()
            await prematch.done.wait()
            if passed_by:
                return self._grad_averager.skip("every other peer stepped past this epoch")
            return self._grad_averager.skip("no group formed in time")
        if result is None:
            return self._grad_averager.skip("timed out during the all-reduce")
        return result

    async def _wait_for_group(self, prematch: _Prematch, size: int) -> bool:
        """Wait up to the matchmaking bound for this epoch's group; False if a
        reading showed every other peer past the epoch first.

        A peer late for its epoch (it downloaded the state, or computes more
        slowly than the others, who reached the target without it) found the
        group closed, and waited out the whole bound for a group that could no
        longer form while the swarm stepped on; it then downloaded the state
        again, and was late again (the tiny LM on the net bed: 5 s waits,
        20-26 downloads in 60 epochs)."""
        passed_by = False

        async def watch(scope: trio.CancelScope) -> None:
            nonlocal passed_by
            await self._until_passed_by(prematch.epoch, self._timing.matchmaking_time(size))
            passed_by = True
            scope.cancel()

        with trio.move_on_after(self.config.averaging.matchmaking.bound + 1.0):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch, nursery.cancel_scope)
                await prematch.done.wait()
                nursery.cancel_scope.cancel()
        return prematch.group is not None or not passed_by

    async def _until_passed_by(self, epoch: int, patience: float) -> None:
        """Return once a reading shows every other peer past ``epoch``
        (``Reading.passed_by``). The tracker's readings come every progress
        interval; once a group would have formed (``patience`` seconds), this
        task reads too, at most every ``_refresh_pause``."""
        read_at = trio.current_time() + patience
        while True:
            reading = self._reading
            if reading is not None and reading.epoch == epoch and reading.passed_by:
                return
            with trio.move_on_at(read_at) as waited:
                await self._progress.next_reading()
            if waited.cancelled_caught:
                await self._refresh_now(time.monotonic())
                read_at = trio.current_time() + self._refresh_pause

    def _note_sender_weight(self, group_id: bytes, peer: PeerID, weight: float) -> None:
        """A member of this epoch's group (formed ahead) began the round with
        ``weight``, its samples: it adds no more, and ``_ready`` counts it at
        exactly that. Other groups' rounds (state averaging, a past epoch's)
        are not this step's."""
        prematch = self._prematch
        if prematch is None or prematch.epoch != self.epoch or prematch.group is None:
            return
        if prematch.group.group_id != group_id:
            return
        epoch, finals = self._finals
        settled = dict(finals) if epoch == self.epoch else {}
        settled[peer] = weight
        self._finals = (self.epoch, settled)

    def _swarm_size(self) -> int:
        """The live peers of the swarm at the last reading (at least 1)."""
        reading = self._reading
        return 1 if reading is None else max(1, reading.swarm.num_peers)

    async def _average_in_group(self, group: Group, weight: float) -> StepResult:
        """The all-reduce itself, as the mode does it (see ``Strategy.average``),
        with the parameters riding along where the group re-synchronises
        (``_riding``): ``_apply`` puts their average in place before the step."""
        host, epoch = self._staging.host, self.epoch
        riding = self._riding(group, epoch)
        if riding is None:
            return await self._strategy.average(self._grad_averager, group, host, weight, epoch)
        params = await self._locked(riding.to_host, 0)
        result = await self._strategy.average(
            self._grad_averager, group, host, weight, epoch, riding=params
        )
        self._rode = (epoch + 1, riding)
        return result

    def _riding(self, group: Group, epoch: int) -> ChunkedStaging | None:
        """Where a lossy run's group re-synchronises after the gradient round
        of ``epoch`` (the leader's ``Group.resync``) at an epoch that is not a
        multiple of ``state_averaging_interval``, the staging of the
        parameters and floating-point buffers, which then ride with the
        gradients in one all-reduce instead of a state round of their own
        (``trainer._drift``: what drifts apart like a random walk; the
        optimizer's moments are averaged at the multiples, as over TCP). None
        where they do not ride: no re-synchronisation, one at a multiple (the
        whole state's round), or parameters that do not fit one staging chunk
        (``state_chunk_elements``; they go in a state round of chunks).
        Every member decides alike: from the group, the epoch, the model's
        shapes and run settings they share."""
        if self._resync is None or group.resync is not True:
            return None
        if (epoch + 1) % self.config.state_averaging_interval == 0:
            return None
        tensors = self._drifting_tensors()
        staging = self._riding_staging
        if staging is None or not _same_tensors(staging.tensors, tensors):
            staging = ChunkedStaging(tensors, self.config.state_chunk_elements)
            self._riding_staging = staging
        return staging if len(staging) == 1 else None

    def _riding_elements(self, group: Group, epoch: int) -> int:
        """How many values ride with ``epoch``'s gradient round (``_riding``)."""
        riding = self._riding(group, epoch)
        return 0 if riding is None else sum(t.numel() for t in riding.chunks[0])

    async def _refresh_now(self, now: float, *, force: bool = False) -> bool:
        """Near the target, publish and read right away instead of waiting for
        the tracker: the sooner every peer sees the target reached, the less the
        global batch overshoots it. Rate-limited unless ``force``; True if it
        refreshed."""
        if not force and now - self._last_poke < self._refresh_pause:
            return False
        self._last_poke = now
        try:
            await self._progress.refresh()
        except ClosedError:
            raise  # our own peer is gone: training cannot go on
        except SwarmError as e:
            log.debug("progress refresh failed: %s", e)
            return False
        finally:
            self._refresh_seconds = time.monotonic() - now
        return True

    @property
    def _refresh_pause(self) -> float:
        """The least time between two refreshes by ``_refresh_now``: a tenth
        of the progress interval, and never more than a fifth of the time
        refreshing: a refresh is a signed DHT store and a read, and peers that
        refresh back to back starve each other's training and averaging."""
        return max(self.config.progress_interval / 10, 4 * self._refresh_seconds)

    @property
    def _reading(self) -> Reading | None:
        """The tracker's latest reading of the swarm (replaced whole)."""
        return self._progress.reading

    def _poke(self) -> None:
        """Ask the tracker to publish and read now rather than at its next
        interval. Does not wait (no thread crossing)."""
        self._post_sync(self._progress.wake)

    def _post_sync(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` on the trio thread soon; returns at once. A peer that
        stopped (or an optimizer not started) runs nothing (the next call that
        waits raises ``ClosedError``)."""
        if self._token is None:
            return
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(fn)

    def _post(self, job: Callable[[], Awaitable[None]]) -> None:
        """Run ``await job()`` on the trio thread soon, in the order posted, as
        the coordinator's work; returns at once. A ``SwarmError`` of the job is
        logged (it concerns matchmaking ahead of time, which the global step
        does again if it has to)."""
        self._post_sync(partial(self._inbox.send_nowait, job))

    async def _serve_inbox(
        self,
        inbox: trio.MemoryReceiveChannel[Callable[[], Awaitable[None]]],
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """The trio side's work posted by the training thread (``_post``),
        until cancelled."""
        task_status.started()
        try:
            async for job in inbox:
                try:
                    await job()
                except* SwarmError as failed:  # a job may run DHT requests side by side
                    log.info("epoch %d: %s", self.epoch, failed.exceptions[0])
        finally:
            # cancelled by ``aclose``, or by the peer stopping: then the next
            # ``step`` says so instead of training on alone without a network
            self._peer_stopped = not self._closed

    def _record(self) -> PeerProgress:
        return PeerProgress(
            self.peer.peer_id,
            self.epoch,
            self._samples,
            self._rate.rate,
            self.peer.dht.now(),
            self.loss,
            self.accuracy,
            self.peer.client_mode,
            reachability=self.peer.reachability.value,
            device=PeerProgress.device_of(self.params),
            # its count is final: the others count it exactly (``_global_batch``)
            stopped=self._frozen,
            batch=self._batch,
            punched=len(self.peer.connections.punched_peers()),
        )

    async def _start_tracker(self) -> trio.CancelScope:
        return await self.peer.start_service(self._progress.serve)

    def _grid_estimate(self) -> int:
        """The swarm's size for a grid proposal: the progress reading's count,
        or the DHT routing table's estimate where that is larger (a new run's
        first readings count little more than this peer)."""
        return max(self._swarm_size(), self.peer.dht.size_estimate())

    async def _propose_cold_grids(self) -> None:
        """As this peer joins: the grids of a new run's first epochs, which
        nobody proposed ahead (``GridSchedule.cold_start``), within the
        averaging timeout. Never raises ``SwarmError``."""
        with trio.move_on_after(self.config.averaging_timeout):
            try:
                await self._grids.cold_start(self.peer.dht, self.epoch, self._grid_estimate())
            except SwarmError as e:
                log.debug("epoch %d: could not propose the first grids: %s", self.epoch, e)

    async def _agreed_grid(self, epoch: int) -> MoshpitGrid:
        """On the trio thread: ``epoch``'s Moshpit grid, the same for every peer
        of its round (``averaging.GridSchedule``), so peers whose estimates of
        the swarm differ still compute the same group keys. It was read an
        epoch ahead, so a round normally does not wait for the DHT (a peer that
        did not, e.g. after catching up, reads it within a request timeout).
        Also starts, in the background, this peer's proposal for a later epoch
        and the read of the next epoch's grid (at most one such task at a
        time, bounded by ``averaging_timeout``). Never raises ``SwarmError``."""
        dht = self.peer.dht
        timeout = self.config.averaging.matchmaking.request_timeout
        grid = await self._grids.grid(dht, epoch, timeout=timeout)
        if not self._grids_busy:
            self._grids_busy = True
            estimate = self._grid_estimate()

            async def ahead(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
                task_status.started()
                try:
                    with trio.move_on_after(self.config.averaging_timeout):
                        await self._grids.prepare(dht, epoch, estimate)
                except* SwarmError as failed:  # a background service must not end the peer
                    log.debug("epoch %d: grid ahead: %s", epoch, failed.exceptions[0])
                finally:
                    self._grids_busy = False

            self._grids_ahead = await self.peer.start_service(ahead)
        return grid

    # -- the global step ----------------------------------------------------------

    async def _global_step(self, *, alone: bool, expected: Expected) -> None:
        """Average what this step accumulated with a group (unless ``alone``)
        and apply the result, as the mode does (see ``Strategy``)."""
        if alone:
            # one thread crossing: nothing happens between staging and applying
            await trio.to_thread.run_sync(self._step_alone)
        else:
            samples, compute, early, started = self._begin_global_step()
            host = await self._locked(self._stage, samples, False)
            result = await self._average_gradients(samples, expected)
            seconds = time.monotonic() - started
            self._rate.pause()
            hook_result = await self._locked(self._apply, host)
            self.last_step = GlobalStep(
                self.epoch, samples, result, seconds, compute, early, hook_result
            )
            self._raise_scheduler_error()
        await self._after_global_step(alone)
        # Averaging is not compute, but the time from here to the next batch
        # is: counted as compute rate, the others extrapolated this peer
        # from the round's end at its bare batch speed, and with steps of a
        # few batches each peer stopped after one (2 peers: 0.71x the target).
        self._rate.resume(time.monotonic())

    def _begin_global_step(self) -> tuple[int, float | None, bool, float]:
        """The step's samples, its compute time and whether the threshold
        ended it (DropCompute), and when its global part began."""
        samples = self._samples
        self._frozen = True  # published with the round's first crossing
        compute, early = self._end_compute()
        return samples, compute, early, time.monotonic()

    def _stage(self, samples: int, alone: bool) -> list[torch.Tensor]:
        """Under the state lock: make the mode's tensors what the group
        averages, and copy them to the host (not for a step alone that can
        apply them where they lie: nobody averages them)."""
        strategy = self._strategy
        self._read_losses()
        strategy.prepare(samples, self._staging.host)
        if alone and strategy.steps_alone_on_device():
            return strategy.averaged
        # the one device-to-host copy of this step (none for a CPU model)
        host = self._staging.to_host()
        strategy.staged(host)
        return host

    def _apply(self, host: list[torch.Tensor]) -> object:
        """Under the state lock: apply the average in ``host`` (the mode's own
        tensors for a step alone on the device) and end the epoch; returns
        what ``grad_hook`` returned."""
        strategy = self._strategy
        rode = self._rode
        if rode is not None and rode[0] == self.epoch + 1:
            # the group's average of the parameters this step began from:
            # the step moves on from there
            rode[1].from_host(0)
        on_device = host is strategy.averaged
        hook_result = strategy.apply(host, _nothing if on_device else self._staging.from_host)
        self._samples = 0
        self.epoch += 1
        self._step_scheduler()
        return hook_result

    def _step_alone(self) -> None:
        """The global step of a peer alone, in the calling thread (never the
        trio thread: it takes the state lock): stage and apply in place under
        the lock, and record it in ``last_step``."""
        samples, compute, early, started = self._begin_global_step()
        log.info("epoch %d: no other peer is training; stepping alone", self.epoch)
        self._rate.pause()
        with self._state_lock:
            host = self._stage(samples, True)
            staged = time.monotonic()
            hook_result = self._apply(host)
        self.last_step = GlobalStep(
            self.epoch, samples, None, staged - started, compute, early, hook_result
        )
        self._raise_scheduler_error()

    def _alone(self, now: float) -> bool:
        """Whether this peer trains alone and can decide its steps in the
        calling thread: the tracker's reading, at most one progress interval
        old, shows nobody else and no epoch ahead. A newcomer is seen at the
        tracker's next reading, as by a peer that waits for one. Not in DiLoCo
        mode, nor when the next step writes a checkpoint (on the trio thread)."""
        reading = self._reading
        return not (
            reading is None
            or self._strategy.local_steps_left() is not None
            or reading.swarm.num_peers > 1
            or reading.swarm.epoch > self.epoch
            or now - reading.time > self.config.progress_interval
            or (
                self._checkpoints is not None
                and (self.epoch + 1) % self.config.checkpoint_every == 0
            )
        )

    @property
    def _alone_due(self) -> bool:
        """For a peer ``_alone``: its samples reach the target (nobody else
        adds any), or its DropCompute threshold ended the step."""
        return self._samples >= self.target_batch_size or self._out_of_time

    def _step_alone_here(self) -> None:
        """The global step of a peer alone, in the calling (training) thread:
        no crossing to the trio thread and back, which on a GPU cost a small
        model several milliseconds per step (``_alone`` says when). The
        tracker publishes the new epoch at its interval, not woken now: a
        refresh after every step of a peer that steps every few milliseconds
        holds the GIL that this thread needs to launch the next batch."""
        if self._samples >= self.target_batch_size:
            self._out_of_time = False  # the target ended this step, not the threshold
        self._step_alone()
        self._begin_compute()
        self._rate.resume(time.monotonic())

    def _resync_due(self) -> bool:
        """Whether parameters and state are averaged after this global step:
        every ``state_averaging_interval`` epochs, or in lossy mode at the
        period ``_drift`` chooses from the measured loss. In lossy mode the
        group's leader decides for its group (``Group.resync``, sent with the
        group): the period follows each peer's own measurements, and a member
        whose measurements put it on a shorter period than its group-mates'
        waited out a state round's matchmaking alone. A lossy round that
        formed no group is followed by none."""
        if self._resync is None:
            interval = self.config.state_averaging_interval
            return bool(interval) and self.epoch % interval == 0
        step = self.last_step
        result = None if step is None or step.averaging is None else step.averaging
        if result is not None and result.allreduce is not None and result.group is not None:
            self._resync.observe(diverged_fraction(result.allreduce, len(result.group.senders())))
        if result is None or result.group is None:
            # no group this round: the peers that re-synchronise now do it in
            # their own groups, whose state rounds close once their members
            # are in; this peer would wait out the window alone (it catches
            # up by download when it falls behind)
            return False
        if result.group.resync is not None:
            return result.group.resync
        return self._resync.due(self.epoch)

    async def _after_global_step(self, alone: bool) -> None:
        due = self._resync_due()
        rode = self._rode is not None and self._rode[0] == self.epoch
        if due and not alone and not rode:
            # the peers that just averaged gradients together are the ones to
            # expect: the round closes as soon as they are in (in lossy mode
            # the members: few have their data in *every* piece of a result)
            step = self.last_step
            if step is not None and self._resync is not None and step.averaging is not None:
                contributors = len(step.averaging.members)
            else:
                contributors = 0 if step is None else len(step.contributors)
            reading = self._reading
            await self._average_state(contributors or (1 if reading is None else reading.expected))
        if self._checkpoints is not None and self.epoch % self.config.checkpoint_every == 0:
            await self._save_checkpoint()
        self._poke()
        self._begin_compute()

    def _make_strategy(self) -> Strategy:
        """The strategy of ``config``'s mode: DiLoCo, compressed, or dense gradients."""
        trainee = Trainee(
            params=self.params,
            trained=self._trained,
            optimizer=self.optimizer,
            sync_model=_weak(self._sync_model),
            grad_hook=self.grad_hook,
        )
        if self.config.diloco is not None:
            return LocalSGD(trainee, OuterLoop(self.params, self.config.diloco))
        if self.config.gradient_compression is not None:
            return CompressedGradients(
                trainee, EF21M(self.params, self.config.gradient_compression)
            )
        return DenseGradients(trainee, lossy=self.config.lossy)

    def _make_grad_averager(self) -> Averager:
        """The averager of each global step, of what the strategy averages."""
        return Averager(
            self.peer,
            self._staging.host,
            prefix=f"{self.run_id}.{self._strategy.prefix_suffix}",
            config=self._strategy.averager_config(self.config.averaging),
            grid=self._grids.agreement.default,
        )

    async def _average_gradients(
        self, samples: int, expected: Expected | None
    ) -> StepResult | None:
        result: StepResult | None = None
        try:
            result = await self._finish_averaging(float(samples), expected or 1)
        except LocalTensorError:
            raise  # this peer's own tensors cannot be sent: not the group's fault
        except SwarmError as e:
            log.warning("epoch %d: averaging failed (%s); applying local gradients", self.epoch, e)
        if result is not None and result.group is None:
            log.info("epoch %d: %s; applying local gradients", self.epoch, result.reason)
        elif result is not None:
            rode = self._rode is not None and self._rode[0] == self.epoch + 1
            _log_average(self.epoch, "gradients and parameters" if rode else "gradients", result)
        return result

    def _step_scheduler(self) -> None:
        """Step the scheduler once for this global step (after the step is whole:
        an error of the scheduler is raised to the caller of ``step`` once the
        global step is recorded, and leaves no step half-done)."""
        scheduler = self.scheduler
        if scheduler is None:
            return
        try:
            if isinstance(scheduler, ReduceLROnPlateau):
                metric = self._metric if self._metric is not None else self.loss
                if metric is not None:
                    scheduler.step(metric)
            else:
                scheduler.step()
        except Exception as e:  # the user's scheduler: raised in the training thread
            self._scheduler_error = e

    def _raise_scheduler_error(self) -> None:
        error, self._scheduler_error = self._scheduler_error, None
        if error is not None:
            raise error

    def _state_tensors(self) -> list[torch.Tensor]:
        tensors: list[torch.Tensor] = [p.data for p in self._trained]
        for p in self._trained:
            for value in self.optimizer.state.get(p, {}).values():
                if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim():
                    tensors.append(value)
        tensors += self._strategy.state_tensors()
        return tensors + self._floating_buffers()

    def _drifting_tensors(self) -> list[torch.Tensor]:
        """What drifts apart like a random walk under lost pieces: the
        parameters and the floating-point buffers (``_riding``)."""
        return [p.data for p in self._trained] + self._floating_buffers()

    def _floating_buffers(self) -> list[torch.Tensor]:
        # running statistics drift apart like parameters (integer counters stay)
        return [b for b in self.buffers.values() if b.is_floating_point()]

    async def _average_state(self, expected: int) -> None:
        """Average parameters, optimizer state and buffers so Moshpit groups do
        not drift. The state is staged to host memory a chunk at a time (one
        reused buffer, ``config.state_chunk_elements`` values) and each chunk
        written back under the state lock, in a worker thread."""
        tensors = self._state_tensors()
        staging = self._state_staging
        if staging is None or not _same_tensors(staging.tensors, tensors):
            staging = self._state_staging = ChunkedStaging(
                tensors, self.config.state_chunk_elements
            )
        if self._state_averager is None:
            self._state_averager = Averager(
                self.peer,
                # never averaged itself: the chunks are (average_in_chunks)
                [staging.buffer],
                prefix=f"{self.run_id}.state",
                config=self._state_averager_config(),
                grid=self._grad_averager.grid,
            )
        averager = self._state_averager
        averager.tensors = [staging.buffer]
        # the grid of the gradient round just done: the one its peers agreed on
        averager.set_grid(self._grad_averager.grid)

        async def average() -> list[StepResult] | StepResult:
            with trio.move_on_after(self.config.averaging_timeout):
                group = await averager.find_group(round=self.epoch, expected_peers=expected)
                if group is None:
                    return averager.skip("no group formed in time")
                return await averager.average_in_chunks(group, staging, write_lock=self._state_lock)
            return averager.skip("timed out")

        try:
            result = await average()
        except LocalTensorError:
            raise  # this peer's own state cannot be sent: not the group's fault
        except SwarmError as e:
            log.warning("epoch %d: parameter averaging failed: %s", self.epoch, e)
        else:
            if isinstance(result, StepResult):
                log.info("epoch %d: parameter averaging: %s", self.epoch, result.reason)
            else:
                _log_state_average(self.epoch, result)
                await self._locked(self._sync_model)
        await self._locked(self._strategy.after_state_averaging)

    def _state_averager_config(self) -> AveragerConfig:
        """The state rounds' configuration: the run's averaging, on the lossy
        data plane exactly when the gradients are (``config.lossy``). A lossy
        re-synchronisation leaves a member its own values where a piece did not
        come back, so it contracts the drift rather than ending it, which
        still bounds it (``_drift``); over TCP the state of a 4-peer digits
        run at 10% loss took 0.2-0.4 s a round against 0.1 s lossless, 17-22%
        of a run (docs/lossy-plane.md, seventeenth pass)."""
        allreduce = replace(self.config.averaging.allreduce, lossy=self.config.lossy)
        return replace(self.config.averaging, allreduce=allreduce)

    # -- state sharing ------------------------------------------------------------

    def _donated_state(self) -> tuple[dict[str, Any], Any]:
        # called on the trio thread by an upload that holds the state lock
        state = {
            "params": [p.detach() for p in self._shared_params()],
            "optimizer": self.optimizer.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
        }
        state |= self._strategy.donated()
        if self.buffers:
            state["buffers"] = {name: b.detach() for name, b in self.buffers.items()}
        return {"epoch": self.epoch}, state

    def _shared_params(self) -> list[torch.Tensor]:
        """The parameters of the swarm's last global step: in DiLoCo mode the
        synced ones (this peer's own are part-way through local steps)."""
        return self._strategy.shared_params()

    async def _start_donor(self) -> trio.CancelScope:
        peer = self.peer
        return await peer.start_service(
            partial(
                serve_state,
                peer,
                self.run_id,
                self._donated_state,
                get_version=lambda: self.epoch,
                config=self.config.state_transfer,
                state_lock=self._state_lock,
            )
        )

    def _cancel_matchmaking(self) -> None:
        if self._prematch is not None:
            self._prematch.scope.cancel()
            self._prematch = None
        self._grids_ahead.cancel()

    async def _join_formed_group(self) -> None:
        """A peer about to catch up whose group for this epoch already formed
        (matchmaking ahead) takes part in its round with weight 0, in the
        background (``Strategy.join_without_data``): its group-mates lose no
        member and wait for nobody, and nothing of this peer is averaged in.
        A group not formed yet is left (``_cancel_matchmaking``), and so is
        one of a mode that cannot join without data. Bounded by ``averaging_timeout``."""
        prematch = self._prematch
        if prematch is None or prematch.group is None or self._joining is not None:
            return
        self._prematch = None
        group, epoch = prematch.group, prematch.epoch
        averager, strategy = self._grad_averager, self._strategy
        done = self._joining = trio.Event()

        async def join(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            task_status.started()
            try:
                with trio.move_on_after(self.config.averaging_timeout):
                    riding = self._riding_elements(group, epoch)
                    result = await strategy.join_without_data(averager, group, riding)
                    if result is None:  # this mode cannot join without data: left
                        log.debug("epoch %d: left the group formed ahead to catch up", epoch)
                    else:
                        log.info(
                            "epoch %d: took part in the group's round with weight 0 (catching up)",
                            epoch,
                        )
            except* SwarmError as failed:  # the round runs tasks side by side
                log.info("epoch %d: the weight-0 round failed: %s", epoch, failed.exceptions[0])
            finally:
                self._joining = None
                done.set()

        await self.peer.start_service(join)

    async def _catch_up(self, *, initial: bool, min_epoch: int | None = None) -> bool:
        """Download the swarm's state (of at least ``min_epoch``); True if loaded."""
        # Leaving the group formed ahead costs its members a timeout; joining
        # it with weight 0 does not (the coordinator owns both this round and
        # the next one's matchmaking, which waits for it).
        await self._join_formed_group()
        self._cancel_matchmaking()
        template: dict[str, Any] = {
            "params": [p.detach() for p in self._trained],
            "optimizer": UNCHECKED,
            "scheduler": UNCHECKED,
        }
        template |= self._strategy.template()
        if self.buffers:
            template["buffers"] = {name: b.detach() for name, b in self.buffers.items()}
        timeout = self.config.load_state_timeout

        try:
            loaded: LoadedState | None = await load_state_from_peers(
                self.peer,
                self.run_id,
                template=template,
                timeout=timeout,
                min_version=min_epoch,
                config=self.config.state_transfer,
            )
        except SwarmError as e:
            log.warning("could not load the swarm's state: %s", e)
            return False
        if loaded is None:
            if not initial:
                log.warning(
                    "no peer could send the swarm's state; training on from epoch %d", self.epoch
                )
            return False
        epoch = int(loaded.metadata.get("epoch", 0))
        if initial and epoch < self.epoch:
            return False  # our checkpoint is newer than anything the swarm offers

        def apply() -> None:
            with torch.no_grad():
                for p, value in zip(self._trained, loaded.state["params"], strict=True):
                    p.copy_(value)
            self._sync_model()
            self.optimizer.load_state_dict(loaded.state["optimizer"])
            if self.scheduler is not None and loaded.state["scheduler"] is not None:
                self.scheduler.load_state_dict(loaded.state["scheduler"])
            self._strategy.reset()
            self._checks.clear()  # what they would take out of the count is gone
            self._strategy.adopt(loaded.state)
            with torch.no_grad():
                for name, buffer in self.buffers.items():
                    buffer.copy_(loaded.state["buffers"][name])
            self._samples = 0
            self.epoch = epoch
            self.state_source = loaded.donor

        await self._locked(apply)
        self._poke()
        self._begin_compute()
        log.info("loaded the state of epoch %d from %s", epoch, loaded.donor.short())
        return True

    # -- checkpoints ----------------------------------------------------------------

    async def _save_checkpoint(self) -> None:
        assert self._checkpoints is not None

        def capture() -> Checkpoint:
            return Checkpoint(
                epoch=self.epoch,
                model={str(i): p.detach().clone() for i, p in enumerate(self._shared_params())}
                | {BUFFER_KEY + name: b.detach().clone() for name, b in self.buffers.items()},
                optimizer=self.optimizer.state_dict(),
                scheduler=None if self.scheduler is None else self.scheduler.state_dict(),
                extra={"run_id": self.run_id}
                | {
                    mode: {name: [t.clone() for t in tensors] for name, tensors in state.items()}
                    for mode, state in self._strategy.mode_state().items()
                },
            )

        checkpoint = await self._locked(capture)
        try:
            path = await trio.to_thread.run_sync(self._checkpoints.save, checkpoint)
        except OSError as e:
            # A full or failing disk must not cost the run: train on, warn once
            # per kind of failure, and try again at the next checkpoint.
            kind = errno.errorcode.get(e.errno, type(e).__name__) if e.errno else type(e).__name__
            report = log.debug if kind in self._checkpoint_failures else log.warning
            self._checkpoint_failures.add(kind)
            report(
                "epoch %d: could not write a checkpoint (%s); training on, retrying at the "
                "next checkpoint",
                checkpoint.epoch,
                e,
            )
            return
        self._checkpointed_epoch = checkpoint.epoch
        log.info("saved checkpoint %s", path)

    async def _resume_from_checkpoint(self) -> None:
        assert self._checkpoints is not None
        checkpoint = await trio.to_thread.run_sync(self._checkpoints.latest)
        if checkpoint is None:
            return
        buffers = {
            plain_name(key[len(BUFFER_KEY) :]): value
            for key, value in checkpoint.model.items()
            if key.startswith(BUFFER_KEY)
        }
        if len(checkpoint.model) - len(buffers) != len(self.params):
            raise ConfigError("the checkpoint does not fit this model: delete it or fix the task")
        if buffers and set(buffers) != set(self.buffers):
            raise ConfigError("the checkpoint's buffers do not fit this model: fix the task")

        def apply() -> None:
            with torch.no_grad():
                for i, p in enumerate(self._trained):
                    p.copy_(checkpoint.model[str(i)])
            self._sync_model()
            self.optimizer.load_state_dict(checkpoint.optimizer)
            if self.scheduler is not None and checkpoint.scheduler is not None:
                self.scheduler.load_state_dict(checkpoint.scheduler)
            self._strategy.load_mode_state(checkpoint.extra)
            with torch.no_grad():
                for name, value in buffers.items():
                    self.buffers[name].copy_(value)
            self.epoch = checkpoint.epoch

        try:
            await self._locked(apply)
        except ProtocolError as e:
            raise ConfigError(f"the checkpoint's DiLoCo state does not fit: {e}") from e
        log.info("resumed from the checkpoint of epoch %d", checkpoint.epoch)


def _same_tensors(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Whether two lists view the very same memory alike (not equal values):
    the optimizer replaces its state tensors when a state is loaded. Not
    ``is``: ``p.data`` is a new tensor object at every call, so a staging
    kept by identity was built anew (its host buffer allocated, pinned on a
    GPU machine) for every state round. The staging holds the tensors it
    was built from, so their memory cannot be reused by another tensor."""
    return len(a) == len(b) and all(
        x.data_ptr() == y.data_ptr()
        and x.shape == y.shape
        and x.stride() == y.stride()
        and x.dtype == y.dtype
        and x.device == y.device
        for x, y in zip(a, b, strict=True)
    )


def _log_state_average(epoch: int, results: list[StepResult]) -> None:
    """Log a state round (one result per chunk): the peers whose data is in
    every chunk, never merely the members; after a lossy one, also the share
    of this peer's values that kept its own (their results did not come back:
    where it may still differ from its group-mates, ``_drift``)."""
    contributors = len(chunked_contributors(results))
    members = len(results[0].members) if results else 0
    rounds = [r.allreduce for r in results if r.allreduce is not None]
    if rounds and all(r.lossy for r in rounds) and contributors != members:
        elements = [r.part_bounds[-1][1] if r.part_bounds else 0 for r in rounds]
        kept = sum(kept_own_fraction(r) * n for r, n in zip(rounds, elements, strict=True))
        log.info(
            "epoch %d: averaged parameters of %d group members over a lossy network: "
            "%.1f%% of this peer's values kept its own (%d of them in every element)",
            epoch,
            members,
            100 * kept / max(sum(elements), 1),
            contributors,
        )
    elif contributors == members:
        log.info("epoch %d: averaged parameters with %d peers", epoch, members)
    else:
        log.info(
            "epoch %d: averaged parameters of %d of %d group members (the others' data is missing)",
            epoch,
            contributors,
            members,
        )


def _log_average(epoch: int, what: str, result: StepResult) -> None:
    """Log the peers whose data is in the average (its contributors), never
    merely the group's members: "with N peers" only when all N are in it.
    After a lossy round, where few members reach every piece, also how much
    of the members' data the average holds, counted per element."""
    contributors, members = len(result.contributors), len(result.members)
    lossy = result.allreduce is not None and result.allreduce.lossy
    if lossy and contributors != members and result.group is not None:
        assert result.allreduce is not None
        held = 1.0 - lost_fraction(result.allreduce, len(result.group.senders()))
        log.info(
            "epoch %d: averaged %s of %d group members over a lossy network: %.1f%% of "
            "their data arrived (%d of them in every element)",
            epoch,
            what,
            members,
            100 * held,
            contributors,
        )
    elif contributors == members:
        log.info("epoch %d: averaged %s with %d peers", epoch, what, contributors)
    else:
        log.info(
            "epoch %d: averaged %s of %d of %d group members (the others' data is missing)",
            epoch,
            what,
            contributors,
            members,
        )
