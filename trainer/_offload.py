"""The inner optimizer offloaded to the host (``CollaborativeConfig.offload_optimizer``).

As hivemind's ``offload_optimizer``: the inner optimizer updates float32
master copies of the parameters that live in host memory (pinned when CUDA
is available, so the copies are asynchronous), and its state (Adam's two
moments, ...) is created next to them, on the host. The device then holds the
model, its gradients, the float32 accumulators and the activations only: on a
volunteer's 8-12 GB card, the two float32 moments and the float32 masters of
an Adam-trained model are what no longer fit.

Once per global step the averaged gradient, already on the host (the staging
layer's copy the all-reduce averaged), becomes the masters' ``.grad``, the
optimizer steps on the host, and the masters are copied into the model's
parameters in one batch through the staging layer (``averaging.HostStaging``:
a side stream ordered with events on CUDA, a plain copy on the CPU).

The masters are the staging buffer's own memory (``HostStaging.host``): there
is one host copy of the parameters, not two.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from averaging import HostStaging


class OffloadedMasters:
    """float32 host copies of ``params`` for the inner optimizer to update.

    ``masters`` are ``torch.nn.Parameter``s over the staging buffer, in the
    order of ``params``, holding the parameters' values when this returns.
    Raises ``averaging.LocalTensorError`` for parameters that are not floating
    point. Not thread-safe: the collaborative optimizer calls it under its
    state lock.
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self._staging = HostStaging([p.detach() for p in params])
        self._staging.to_host()
        self.masters = [torch.nn.Parameter(h) for h in self._staging.host]

    @property
    def pinned(self) -> bool:
        """Whether the masters are in pinned (page-locked) host memory."""
        return self._staging.pinned

    def to_model(self) -> None:
        """Copy the masters into the model's parameters (rounded to their
        dtypes); complete for work the caller queues next when this returns."""
        self._staging.from_host()
