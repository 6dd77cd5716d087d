"""``CollaborativeOptimizer``: the synchronous facade over
``AsyncCollaborativeOptimizer`` for a training loop in its own thread.

The user's loop is an ordinary PyTorch loop::

    loss.backward(); opt.step(); opt.zero_grad()

The coordinator (``AsyncCollaborativeOptimizer``) runs on the sync peer's
trio thread (``swarm.Peer``). A ``step()`` does the batch's own work here, in
the training thread (unscale, finiteness check, accumulate, count), and
decides from the tracker's latest reading whether the global step is due
(``_quick_decision``); one that is not makes no thread crossing (what the
trio side should do meanwhile is posted without waiting). One that is (or
that must catch up with a swarm that is ahead, or decide on a fresh reading)
makes exactly one: ``peer.run`` of the coordinator's ``_complete``, whose
tensor work runs in worker threads under the state lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import trio

from swarm import ClosedError, SwarmError

from ._optimizer import (
    AsyncCollaborativeOptimizer,
    CollaborativeConfig,
    GlobalStep,
    LRScheduler,
    ReduceLROnPlateau,
)
from ._peer_protocol import SyncTrainerPeer
from ._strategy import GradHook

log = logging.getLogger(__name__)

__all__ = ["CollaborativeOptimizer"]


class CollaborativeOptimizer(torch.optim.Optimizer):
    """Wraps a torch optimizer so that a swarm of peers trains as one, for a
    training loop in its own thread (``AsyncCollaborativeOptimizer`` is the
    same in a ``trio.run``; the arguments and behaviour are its).

    ``peer`` is a running sync ``swarm.Peer`` (any ``SyncTrainerPeer``).
    It is a ``torch.optim.Optimizer`` whose ``param_groups`` and ``state``
    are the inner optimizer's, so ``torch.amp.GradScaler`` accepts it:
    ``scaler.step(opt)`` unscales the gradients (the swarm averages true
    gradients) and skips a batch that overflowed; ``step(grad_scaler=scaler)``
    does the same for loops that call ``step`` themselves. The constructor
    blocks while the coordinator starts (resuming a checkpoint, downloading
    the state of a swarm that is ahead) and raises ``ConfigError`` for
    settings that cannot work.
    """

    def __init__(
        self,
        peer: SyncTrainerPeer,
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
        self.peer = peer
        # torch.optim.Optimizer's own attributes (its __init__ would build
        # param groups of its own: ours are the inner optimizer's)
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._closed = False
        # Built here (its settings' errors and warnings are the caller's),
        # started on the trio thread.
        self._core = AsyncCollaborativeOptimizer(
            peer.async_peer,
            run_id=run_id,
            params=params,
            optimizer=optimizer,
            target_batch_size=target_batch_size,
            batch_size_per_step=batch_size_per_step,
            scheduler=scheduler,
            model=model,
            grad_hook=grad_hook,
            config=config,
            checkpoint_dir=checkpoint_dir,
            load_state=load_state,
            compute_clock=compute_clock,
        )
        try:
            peer.run(self._core.start)
        except BaseException:
            self._closed = True
            try:
                peer.run(self._core.aclose)
            except SwarmError as e:
                log.debug("could not undo a failed start: %s", e)
            raise

    @property
    def coordinator(self) -> AsyncCollaborativeOptimizer:
        """The async optimizer this facade drives (its state, read-only from
        the training thread)."""
        return self._core

    def __getattr__(self, name: str) -> Any:
        # the coordinator's attributes (epoch, last_step, loss, params, ...)
        if name == "_core":
            raise AttributeError(name)
        return getattr(self._core, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # an attribute of the coordinator (e.g. ``scheduler``) is set there
        core = self.__dict__.get("_core")
        if (
            core is not None
            and name not in self.__dict__
            and not hasattr(type(self), name)
            and hasattr(core, name)
        ):
            setattr(core, name, value)
        else:
            super().__setattr__(name, value)

    # -- torch.optim.Optimizer ------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's parameter groups (``AsyncCollaborativeOptimizer.param_groups``)."""
        return self._core.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._core.param_groups = value

    @property
    def state(self) -> Any:
        """The inner optimizer's per-parameter state."""
        return self._core.state

    @state.setter
    def state(self, value: Any) -> None:
        self._core.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self._core.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._core.defaults = value

    @property
    def epoch(self) -> int:
        """The global steps this peer has taken (or downloaded)."""
        return self._core.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._core.epoch = value

    @property
    def last_step(self) -> GlobalStep | None:
        """What the last global step did (None: none yet)."""
        return self._core.last_step

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' ``.grad`` (the accumulated gradients are kept)."""
        self._core.zero_grad(set_to_none)

    def step(  # type: ignore[override]
        self,
        batch_size: int | None = None,
        *,
        loss: float | torch.Tensor | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> bool:
        """``AsyncCollaborativeOptimizer.step``, blocking: True if a global
        step happened. A call that does not take one makes no thread
        crossing; one that does makes exactly one, unless this peer steps
        alone on a fresh reading (then none). Raises what it raises,
        and ``ClosedError`` once the peer has stopped."""
        core = self._core
        size = core.batch_size_per_step if batch_size is None else batch_size
        now = core._take_batch(size, loss, grad_scaler, self)
        if now is None:
            return False
        if core._alone(now):  # decided here: no crossing, and no wait unless due
            if not core._alone_due or (core._checks and not core._settle_checks()):
                return False
            core._step_alone_here()
            return True
        if core._quick_decision(size, now) is False:
            return False
        if core._checks and not core._settle_checks():
            return False
        stepped: bool = self.peer.run(core._complete, size, now)
        return stepped

    def wait_for_peers(
        self, count: int, timeout: float, *, stop: threading.Event | None = None
    ) -> bool:
        """Block until ``count`` peers (this one included) are in the run, or
        ``timeout`` seconds pass, or ``stop`` is set (within one poll); True if
        they are (``AsyncCollaborativeOptimizer.wait_for_peers``)."""
        core = self._core
        deadline = time.monotonic() + timeout
        stop = stop if stop is not None else threading.Event()
        while True:
            # Read, then decide, then sleep (see the async one)
            reading = core._reading
            if reading is None or reading.swarm.num_peers < count:
                self.peer.run(partial(core._refresh_now, force=True), time.monotonic())
                reading = core._reading
            if reading is not None and reading.swarm.num_peers >= count:
                core._begin_compute()  # waiting is not compute
                return True
            if time.monotonic() >= deadline or stop.is_set():
                core._begin_compute()
                return False
            stop.wait(core._wait_poll)

    def state_dict(self) -> dict[str, Any]:
        """``AsyncCollaborativeOptimizer.state_dict``."""
        return self._core.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what ``state_dict`` returned, in this thread under the state lock."""
        self._core._with_lock(self._core._load_state_dict, state)

    def close(self) -> None:
        """Save a final checkpoint, stop serving state and leave the progress
        table. Idempotent; never raises for a peer that already stopped (the
        final checkpoint is then written from this thread)."""
        if self._closed:
            return
        self._closed = True
        core = self._core
        try:
            self.peer.run(core.aclose)
        except ClosedError as e:
            log.debug("the peer stopped before the optimizer closed: %s", e)
            core._closed = True
            if core._checkpoints is not None:
                # no trio thread any more: the checkpoint's worker threads
                # run under a trio loop of this thread's own
                trio.run(core._save_checkpoint)
        except SwarmError as e:
            log.debug("could not withdraw from the swarm cleanly: %s", e)

    def __enter__(self) -> CollaborativeOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
