"""What a global step averages and how it applies the result: one strategy per mode.

The collaborative optimizer runs one epoch state machine (progress, matchmaking,
averaging, catch-up, checkpoints) for every mode; what differs between the modes
is behind ``Strategy``:

- ``DenseGradients``: accumulate each batch's gradients (times its size), average
  their mean with the group, give the result to the inner optimizer.
- ``CompressedGradients`` (ARC-Top-K with EF21M error feedback, ``_ef21m``): the
  same accumulation; the group averages EF21M's compressed differences, and the
  inner optimizer steps with the swarm's shared gradient estimate.
- ``LocalSGD`` (DiLoCo, ``_diloco``): the inner optimizer steps after every batch;
  after ``local_steps`` of them the group averages the pseudo-gradients and the
  outer optimizer steps.

A strategy answers: what a batch adds (``accumulate``), what ends a step
(``local_steps_left``: the swarm's target batch, or a count of local steps), what
the group averages (``averaged``, whose host copy the all-reduce sees; made ready
by ``prepare``), how it is averaged (``average``), how the average is applied
(``apply``), and its own state for checkpoints, donors and newcomers
(``mode_state``, ``donated``, ``template``, ``adopt``). Tensor work in
``accumulate`` (DiLoCo), ``prepare``, ``apply`` and the state methods runs in
the training thread under the optimizer's state lock; ``average`` runs on the
trio thread and touches only host tensors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from averaging import Averager, AveragerConfig, Group, StepResult, float32_accumulators
from swarm import ConfigError

from ._amp import zero_unless
from ._diloco import OuterLoop
from ._ef21m import EF21M

#: what is called with the parameters, their ``.grad`` the averaged gradient,
#: right before the inner step (e.g. to clip by global norm); its return value
#: is kept in ``GlobalStep.hook_result`` (e.g. the norm, for logs)
GradHook = Callable[[list[torch.nn.Parameter]], object]


@dataclass(frozen=True)
class Trainee:
    """What a strategy trains: the optimizer's side of it."""

    #: the model's trainable parameters (their ``.grad`` is what backward fills)
    params: list[torch.nn.Parameter]
    #: what the inner optimizer updates: the float32 masters, or ``params``
    trained: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    #: rounds the float32 masters into the model's parameters (no-op without)
    sync_model: Callable[[], None]
    grad_hook: GradHook | None = None


class Strategy(ABC):
    """One mode of the global step (see the module doc)."""

    #: the name of this mode's state in ``state_dict``, checkpoints and donations
    #: (None: it has none of its own)
    state_name: str | None = None
    #: the suffix of the averager's DHT prefix (``{run_id}.{suffix}``)
    prefix_suffix: str = "grads"

    def __init__(self, trainee: Trainee) -> None:
        self.trainee = trainee

    @property
    @abstractmethod
    def averaged(self) -> list[torch.Tensor]:
        """The float32 tensors (on the parameters' device) whose host copy the
        group averages, and where ``apply`` finds the average."""

    def averager_config(self, config: AveragerConfig) -> AveragerConfig:
        """The averager's configuration for this mode, from the run's."""
        return config

    @abstractmethod
    def accumulate(self, size: int, keep: torch.Tensor | None = None) -> None:
        """Account for one batch of ``size`` samples whose gradients are in the
        parameters' ``.grad``. ``keep``: a 0-dim bool tensor on the gradients'
        device, whether to add them at all (a check the device has not
        finished; only for modes whose ``defers_checks``): where it is False,
        the gradients are zeroed in place and add nothing."""

    #: whether ``accumulate`` takes ``keep``: a batch it adds can still be
    #: refused by the device's verdict, read later (``_amp.DeviceChecks``)
    defers_checks = False

    def steps_alone_on_device(self) -> bool:
        """Whether a step taken alone may apply ``averaged`` where it lies: no
        host copy and back when nobody averages it (a GPU model's gradients
        would cross the bus twice for nothing)."""
        return False

    def local_steps_left(self) -> int | None:
        """Local steps until this step ends; None: the swarm's target batch ends it."""
        return None

    def prepare(self, samples: int, host: list[torch.Tensor]) -> None:
        """Before averaging ``samples`` samples' worth: make ``averaged`` what the
        group should average. ``host`` is its host copy, filled right after this
        (the accumulators themselves for a CPU model)."""
        return None  # nothing, unless the mode says otherwise

    def staged(self, host: list[torch.Tensor]) -> None:
        """After ``host`` was filled from ``averaged``: last touches on the host copy."""
        return None  # nothing, unless the mode says otherwise

    @abstractmethod
    async def average(
        self,
        averager: Averager,
        group: Group,
        host: list[torch.Tensor],
        weight: float,
        epoch: int,
        riding: list[torch.Tensor] | None = None,
    ) -> StepResult:
        """On the trio thread: average ``host`` with ``group`` (in place).
        ``riding``: host tensors averaged in the same all-reduce, after
        ``host`` (a lossy run's parameters, ``trainer._drift``); only
        ``DenseGradients`` takes them (``ConfigError`` from the others)."""

    async def join_without_data(
        self, averager: Averager, group: Group, riding: int = 0
    ) -> StepResult | None:
        """On the trio thread: take part in ``group``'s round with weight 0, for
        a peer that must catch up instead: it contributes nothing, the average
        lands in scratch tensors (``host`` is left alone), and its group-mates
        lose no member and wait for nobody. ``riding``: how many more values
        the group's members average in the round (``average``). None if this
        mode's round cannot be joined so (then the caller leaves the group)."""
        scratch = [torch.zeros_like(t) for t in averager.tensors]
        extra = [torch.zeros(riding)] if riding else []
        return await averager.average(group, 0.0, tensors=scratch, riding=extra)

    @abstractmethod
    def apply(self, host: list[torch.Tensor], write_back: Callable[[], None]) -> object:
        """Take the step with the average in ``host`` (``write_back`` copies it into
        ``averaged``); returns what ``grad_hook`` returned (None without one)."""

    def reset(self) -> None:
        """Forget what was accumulated (the state was replaced by a download)."""
        return None  # nothing, unless the mode says otherwise

    def state_tensors(self) -> list[torch.Tensor]:
        """This mode's tensors that drift like the parameters (state averaging)."""
        return []

    def after_state_averaging(self) -> None:
        """The parameters were just replaced by the group's average."""
        return None  # nothing, unless the mode says otherwise

    def shared_params(self) -> list[torch.Tensor]:
        """The parameters of the swarm's last global step (what donors send)."""
        return list(self.trainee.trained)

    def mode_state(self) -> dict[str, Any]:
        """This mode's state (the tensors themselves), for ``state_dict`` and
        checkpoints: keyed by ``state_name``; empty without."""
        return {}

    def load_mode_state(self, state: dict[str, Any]) -> None:
        """Load ``mode_state()`` output from ``state`` (which may lack it: saved
        by a run in another mode). Raises what the mode raises for a misfit."""
        return None  # nothing, unless the mode says otherwise

    def donated(self) -> dict[str, Any]:
        """What a donor sends a newcomer of this mode's state."""
        return {}

    def template(self) -> dict[str, Any]:
        """The structure ``adopt`` accepts, for checking downloads."""
        return {}

    def adopt(self, state: dict[str, Any]) -> None:
        """Take this mode's part of a downloaded state (``donated()`` of a donor)."""
        return None  # nothing, unless the mode says otherwise


class DenseGradients(Strategy):
    """Average the mean gradient of the step; the inner optimizer applies it."""

    def __init__(self, trainee: Trainee, *, lossy: bool = False) -> None:
        super().__init__(trainee)
        #: average over the lossy data plane (``CollaborativeConfig.lossy``)
        self.lossy = lossy
        #: the accumulated gradients: float32 on the parameters' device, whatever
        #: their dtype, back to back in one buffer per device
        self.grads = float32_accumulators(trainee.params)
        #: which parameters received a gradient in this global step
        self._got_grad = [False] * len(trainee.params)

    @property
    def averaged(self) -> list[torch.Tensor]:
        return self.grads

    def averager_config(self, config: AveragerConfig) -> AveragerConfig:
        if not self.lossy:
            return config
        return replace(config, allreduce=replace(config.allreduce, lossy=True))

    defers_checks = True

    def accumulate(self, size: int, keep: torch.Tensor | None = None) -> None:
        accs: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        with torch.no_grad():
            for i, (acc, p) in enumerate(zip(self.grads, self.trainee.params, strict=True)):
                if p.grad is None:
                    continue
                self._got_grad[i] = True
                accs.append(acc)
                grads.append(p.grad)
            if not accs:
                return
            if keep is not None:
                # zeros where refused, in place (a copy would be one more
                # gradient's memory), NaN and Inf included
                zero_unless(keep, grads)
            torch._foreach_add_(accs, grads, alpha=size)

    def steps_alone_on_device(self) -> bool:
        # an offloaded optimizer steps on the host: it needs the host copy
        return all(
            t.device == acc.device for t, acc in zip(self.trainee.trained, self.grads, strict=True)
        )

    def prepare(self, samples: int, host: list[torch.Tensor]) -> None:
        with torch.no_grad():
            torch._foreach_div_(self.grads, float(max(1, samples)))

    async def average(
        self,
        averager: Averager,
        group: Group,
        host: list[torch.Tensor],
        weight: float,
        epoch: int,
        riding: list[torch.Tensor] | None = None,
    ) -> StepResult:
        return await averager.average(group, weight, riding=riding or ())

    def apply(self, host: list[torch.Tensor], write_back: Callable[[], None]) -> object:
        write_back()
        trainee = self.trainee
        unused = self._unused_params()
        with torch.no_grad():
            for i, (acc, p) in enumerate(zip(self.grads, trainee.trained, strict=True)):
                # None, not zeros: AdamW must not decay what nobody trained
                p.grad = None if i in unused else self._gradient(acc, host[i], p)
        self._got_grad = [False] * len(trainee.params)
        hook_result = None if trainee.grad_hook is None else trainee.grad_hook(trainee.trained)
        trainee.optimizer.step()
        trainee.sync_model()
        trainee.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_zero_(self.grads)  # after the step: it may have read them
        return hook_result

    @staticmethod
    def _gradient(acc: torch.Tensor, host: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """The ``.grad`` that ``p`` steps with: the host copy where it is next
        to the master (an offloaded optimizer: no second device-to-host copy of
        the average), copied, since a hook may clip it in place and the mode may
        keep it (EF21M's estimate); else the accumulator itself when it has
        ``p``'s dtype (a float32 master: no copy), zeroed after the step."""
        if host.device == p.device and host is not acc:
            return host.to(p.dtype, copy=True)
        return acc if acc.dtype == p.dtype else acc.to(p.dtype)

    def _unused_params(self) -> set[int]:
        """Indices of the parameters that got no gradient in this global step:
        none here, and none from the group (their average is exactly zero)."""
        idle = [i for i, got in enumerate(self._got_grad) if not got]
        if not idle:
            return set()
        norms = torch._foreach_norm([self.grads[i] for i in idle], float("inf"))
        values = torch.stack([n.cpu() for n in norms]).tolist()
        return {i for i, norm in zip(idle, values, strict=True) if norm == 0}

    def reset(self) -> None:
        for acc in self.grads:
            acc.zero_()
        self._got_grad = [False] * len(self.trainee.params)


class CompressedGradients(DenseGradients):
    """ARC-Top-K with EF21M error feedback (``_ef21m``): the group averages the
    compressed differences (densely, in ArcTopK's codec, during the warm-up), and
    the inner optimizer steps with the swarm's shared estimate ``g_bar``."""

    state_name = "ef21m"

    def __init__(self, trainee: Trainee, ef21m: EF21M) -> None:
        super().__init__(trainee)
        self.ef21m = ef21m

    def staged(self, host: list[torch.Tensor]) -> None:
        # averaging now carries EF21M's difference v - g (see _ef21m)
        self.ef21m.begin(host)

    def steps_alone_on_device(self) -> bool:
        return False  # EF21M's estimate is kept, and updated, on the host

    async def join_without_data(
        self, averager: Averager, group: Group, riding: int = 0
    ) -> StepResult | None:
        # ARC-Top-K's sub-rounds select rows from every member's data: a member
        # without data cannot take part in them truthfully
        return None

    async def average(
        self,
        averager: Averager,
        group: Group,
        host: list[torch.Tensor],
        weight: float,
        epoch: int,
        riding: list[torch.Tensor] | None = None,
    ) -> StepResult:
        _refuse_riding(riding, "gradient_compression")
        if self.ef21m.config.compresses(epoch):
            return await self.ef21m.average(averager, group, host, weight, epoch)
        return await self.ef21m.average_dense(averager, group, host, weight)

    def apply(self, host: list[torch.Tensor], write_back: Callable[[], None]) -> object:
        self.ef21m.finish(host)  # the host copy now holds g_bar
        return super().apply(host, write_back)

    def state_tensors(self) -> list[torch.Tensor]:
        return list(self.ef21m.g_bar)  # the shared estimate drifts like the parameters

    def mode_state(self) -> dict[str, Any]:
        return {"ef21m": self.ef21m.state_dict()}

    def load_mode_state(self, state: dict[str, Any]) -> None:
        if "ef21m" in state:  # else: saved without EF21M, keep our own
            self.ef21m.load_state_dict(state["ef21m"])

    def donated(self) -> dict[str, Any]:
        return {"ef21m_estimate": list(self.ef21m.g_bar)}

    def template(self) -> dict[str, Any]:
        return {"ef21m_estimate": list(self.ef21m.g_bar)}

    def adopt(self, state: dict[str, Any]) -> None:
        self.ef21m.adopt(state["ef21m_estimate"])


class LocalSGD(Strategy):
    """DiLoCo (``_diloco``): an inner step per batch; after ``local_steps`` the
    group averages the pseudo-gradients and the outer optimizer steps."""

    state_name = "diloco"
    prefix_suffix = "diloco"

    def __init__(self, trainee: Trainee, outer: OuterLoop) -> None:
        super().__init__(trainee)
        self.outer = outer

    @property
    def averaged(self) -> list[torch.Tensor]:
        return self.outer.deltas

    def averager_config(self, config: AveragerConfig) -> AveragerConfig:
        return replace(config, codec=self.outer.config.codec)

    def accumulate(self, size: int, keep: torch.Tensor | None = None) -> None:
        self.trainee.optimizer.step()  # never deferred: it changes the parameters
        self.outer.local_steps += 1

    def local_steps_left(self) -> int | None:
        return self.outer.config.local_steps - self.outer.local_steps

    def prepare(self, samples: int, host: list[torch.Tensor]) -> None:
        self.outer.compute_pseudo_gradients()

    async def average(
        self,
        averager: Averager,
        group: Group,
        host: list[torch.Tensor],
        weight: float,
        epoch: int,
        riding: list[torch.Tensor] | None = None,
    ) -> StepResult:
        _refuse_riding(riding, "diloco")
        return await averager.average(group, weight)

    def apply(self, host: list[torch.Tensor], write_back: Callable[[], None]) -> object:
        # the outer step runs on the host, on the averaged host copy: the
        # device's deltas are recomputed before the next average anyway
        self.outer.outer_step(host)
        return None

    def state_tensors(self) -> list[torch.Tensor]:
        return self.outer.momentum()

    def after_state_averaging(self) -> None:
        self.outer.resync()  # right after the outer step: nothing lost

    def shared_params(self) -> list[torch.Tensor]:
        # this peer's own parameters are part-way through local steps
        return list(self.outer.synced)

    def mode_state(self) -> dict[str, Any]:
        return {"diloco": self.outer.state_dict()}

    def load_mode_state(self, state: dict[str, Any]) -> None:
        if "diloco" in state:
            self.outer.load_state_dict(state["diloco"])
        else:  # saved without DiLoCo: resync from the parameters
            self.outer.resync()

    def donated(self) -> dict[str, Any]:
        return {"diloco": self.outer.state_dict()}

    def template(self) -> dict[str, Any]:
        return {"diloco": self.outer.template()}

    def adopt(self, state: dict[str, Any]) -> None:
        self.outer.load_state_dict(state["diloco"])


def _refuse_riding(riding: list[torch.Tensor] | None, mode: str) -> None:
    """Only dense gradients carry other tensors in their round (the lossy
    plane's re-synchronisations, which no other mode runs)."""
    if riding:
        raise ConfigError(f"{mode} averages its own tensors only: nothing rides with them")
