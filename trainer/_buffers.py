"""A model's buffers (BatchNorm running statistics, any registered buffer) as
the swarm shares them: by name, the same for a plain and a ``torch.compile``d
model.

``torch.compile`` wraps a module in one whose state-dict keys start with
``_orig_mod.``; names here never carry that prefix, so a checkpoint or a
download from a compiled peer fits a plain one and the reverse.
"""

from __future__ import annotations

import torch

#: the prefix ``torch.compile``'s wrapper adds to every state-dict key
COMPILED_PREFIX = "_orig_mod."

#: A checkpoint's model entries are the trained parameters by position ("0",
#: "1", ...) and the buffers under this prefix and their plain name.
BUFFER_KEY = "buffer:"


def plain_name(name: str) -> str:
    """``name`` without ``torch.compile``'s ``_orig_mod.`` prefixes (at any depth)."""
    return ".".join(part for part in name.split(".") if part != COMPILED_PREFIX[:-1])


def model_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's persistent buffers by plain name, in registration order
    (the tensors themselves: loading into them changes the model)."""
    non_persistent: set[str] = set()
    for module_name, module in model.named_modules():
        for buffer_name in getattr(module, "_non_persistent_buffers_set", ()):
            non_persistent.add(f"{module_name}.{buffer_name}" if module_name else buffer_name)
    return {
        plain_name(name): buffer
        for name, buffer in model.named_buffers()
        if name not in non_persistent
    }


def plain_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A model ``state_dict`` with ``torch.compile``'s prefixes cut, so it loads
    into a plain model (and, through ``load_plain_state_dict``, a compiled one)."""
    return {plain_name(key): value for key, value in state.items()}


def load_plain_state_dict(
    model: torch.nn.Module, state: dict[str, torch.Tensor], *, strict: bool = True
) -> None:
    """Load a state dict saved from a plain or a compiled model into ``model``
    (plain or compiled). Raises what ``load_state_dict`` raises for a misfit."""
    plain = plain_state_dict(state)
    own = {plain_name(key): key for key in model.state_dict()}
    missing = [key for key in plain if key not in own]
    if strict and missing:
        raise RuntimeError(f"unexpected keys in the state dict: {missing[:3]}")
    model.load_state_dict(
        {own[key]: value for key, value in plain.items() if key in own}, strict=strict
    )
