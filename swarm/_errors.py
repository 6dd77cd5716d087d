"""Typed errors. Each class means one thing; whose fault it is shows in the name.

``SwarmError`` is the root of everything Swarm raises on purpose. A caller that
wants to exclude or ban a misbehaving peer catches ``ProtocolError`` (the remote
side broke the protocol), not ``Exception``.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator


class SwarmError(Exception):
    """Base class of every error Swarm raises deliberately."""


class ConfigError(SwarmError, ValueError):
    """The local configuration is invalid; the message says what to change.

    The CLI turns it into exit code 2.
    """


class NonFiniteError(SwarmError, ValueError):
    """Local tensors hold NaN or Inf (a diverged loss, an overflowed gradient);
    the operation refused them and changed nothing."""


class ProtocolError(SwarmError):
    """Bytes from another peer are malformed, oversized or violate the protocol.

    This is the one error class every decoder of untrusted input raises. It never
    means a local bug: the remote side (or the network) is at fault.
    """


class AuthenticationError(ProtocolError):
    """Bytes failed their authentication tag: altered on the way (by the network
    or by a relay in between) or not sealed with the session's key. Over a
    direct connection the remote is blamed; over a relay's circuit nobody can
    tell the remote from the relay, so the connection is only closed."""


class PeerUnreachableError(SwarmError):
    """A peer did not answer (connection refused, no reply before the deadline)."""


class SelfDialError(PeerUnreachableError):
    """Dialing another peer's address reached this very peer: the remote proved
    our own peer id. The other peer announced an address that, seen from here,
    is this machine (typically a loopback address); it did not fail, and it
    did not break the protocol, but it cannot be reached at that address."""


class DeadlineError(SwarmError, TimeoutError):
    """An operation did not finish before its deadline."""


class ClosedError(SwarmError):
    """The local side closed the resource this operation needed."""


class PeerCrashedError(ClosedError):
    """The peer's background thread ended with an error it did not mean to
    raise (a bug, or an error a service let escape), so the peer is gone.

    ``crash`` is that error, traceback and all (it is also ``__cause__``); the
    CLI prints its traceback, since a crash is something to report, not a
    message for the user to act on.
    """

    def __init__(self, crash: BaseException) -> None:
        super().__init__(f"the peer stopped: its thread crashed with {crash!r}")
        self.crash = crash


class BootstrapError(SwarmError):
    """None of the initial peers answered, so the node could not join a swarm."""


class RejectReason(enum.Enum):
    """Why a DHT record was refused. Each value reads as one line of explanation."""

    MALFORMED = "the record does not decode to the record layout"
    OVERSIZED = "the key, sub-key or value exceeds its size limit"
    EXPIRED = "the expiration time has already passed"
    TOO_FAR_IN_FUTURE = "the expiration time is further ahead than the allowed lifetime"
    FORGED = "the key names an owner but the signature does not verify for that owner"
    NOT_OWNER = "the key names an owner other than the local peer, so it cannot be signed"
    TOO_MANY_SUBKEYS = "the key already holds the maximum number of sub-keys"
    OVER_QUOTA = "the sender (node id or host) already holds its share of the storing node"
    STORAGE_FULL = "the storing node holds its maximum number of records"
    NOT_STORED = "no node that is responsible for the key accepted the record"


class RecordRejectedError(SwarmError):
    """A DHT record was refused; ``reason`` says why."""

    def __init__(self, reason: RejectReason, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        message = reason.value if not detail else f"{reason.value}: {detail}"
        super().__init__(message)


class EndOfStreamError(SwarmError):
    """The remote side ended its half of a stream cleanly (it sent EOF).

    Not a failure: ``Stream.receive`` raises it once everything the remote sent
    has been received, and again on every later call.
    """


class StreamResetError(SwarmError):
    """The remote side aborted a stream: its handler failed, refused the stream
    (unknown name, too many concurrent streams) or was shut down.

    The message carries the remote's one-line reason. The connection that
    carried the stream is closed; other streams to the same peer are not
    affected. It is not a ``ProtocolError``: the remote followed the protocol.
    """


def _single_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    leaves: list[BaseException] = []
    stack: list[BaseException] = [group]
    while stack:
        exc = stack.pop()
        if isinstance(exc, BaseExceptionGroup):
            stack.extend(exc.exceptions)
        else:
            leaves.append(exc)
        if len(leaves) > 1:
            return None
    return leaves[0] if leaves else None


def unwrap_single(exc: BaseException) -> BaseException:
    """``exc`` itself, or the one exception inside it if it is a group of one."""
    if isinstance(exc, BaseExceptionGroup):
        leaf = _single_leaf(exc)
        if leaf is not None:
            return leaf
    return exc


@contextlib.contextmanager
def collapse_exception_groups() -> Iterator[None]:
    """Re-raise an exception group that holds exactly one exception as that exception.

    Context managers that run a nursery internally use this at their boundary, so
    callers see ``BootstrapError`` rather than a group wrapping it. Groups of
    several exceptions propagate unchanged.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        leaf = _single_leaf(group)
        if leaf is None:
            raise
        raise leaf from leaf.__cause__
