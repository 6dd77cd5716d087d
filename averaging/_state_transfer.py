"""State transfer: a newcomer downloads the current training state from a peer.

A *donor* runs ``serve_state``: it announces itself in the DHT and streams a
snapshot of its state (msgpack metadata such as the epoch, plus a nested
state object with tensors, e.g. ``{"model": ..., "optimizer": ...}``) to any
newcomer that asks. A *newcomer* calls ``load_state_from_peers``: it finds
the donors in the DHT, tries them newest first, downloads from the first that
delivers, and verifies what it got before returning it.

DHT record: key ``f"{prefix}.state"``, one sub-key per donor,
``owner_marker(donor)`` (so only the donor can write it), value
``[host, port, version]``, expiring ``announce_ttl`` after each refresh. A
donor that dies disappears from the DHT within ``announce_ttl``; until then a
newcomer fails to reach it and moves on.

Wire protocol of one stream, name ``f"state.{prefix}"``:

1. newcomer -> donor, msgpack: ``[PROTOCOL_VERSION, max_bytes]``, then EOF.
2. donor -> newcomer, one raw frame holding msgpack, decoded by the newcomer
   under its own ``max_header_bytes``: either
   ``["state", version, metadata, state_header]`` (``swarm._state``), or a
   refusal ``["busy", reason]`` (``max_uploads`` uploads are running: try
   again later) or ``["refused", reason]`` (wrong protocol version, state
   larger than ``max_bytes``). Reasons are one line.
3. donor -> newcomer: the bytes of every tensor, in header order, cut into
   raw frames of at most ``chunk_size`` bytes, then EOF.

One upload sends one snapshot: the donor copies every tensor before its
first ``await`` (see ``serve_state``). The newcomer accepts nothing it did
not bound beforehand (header bytes, total tensor bytes, each chunk's length)
and nothing it did not verify after (structure, shapes and dtypes against
an optional template; every floating-point value finite): a donor that fails
any check, breaks the stream, or stalls longer than ``chunk_timeout`` is
dropped and the next one is tried.

Load spreading: a donor runs at most ``max_uploads`` uploads and refuses the
next at once; a refused newcomer tries the next donor immediately and comes
back to busy donors after a short backoff. Among equally new donors each
newcomer uses its own order, shuffled by a generator seeded from its peer id,
so simultaneous newcomers start at different donors.
"""

from __future__ import annotations

import logging
import math
import random
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, NoReturn, Protocol

import torch
import trio

from dht import DHTNode, owner_marker
from swarm import ConfigError, DeadlineError, PeerID, ProtocolError, SwarmError
from swarm._connections import Connections, Stream
from swarm._errors import ClosedError, EndOfStreamError
from swarm._state import (
    FlatState,
    TensorSpec,
    flatten_state,
    parse_state_header,
    state_header,
    tensor_from_bytes,
    tensor_to_bytes,
    unflatten_state,
)
from swarm._wire import MAX_MESSAGE_SIZE, expect_int, expect_list, expect_str, pack, unpack

logger = logging.getLogger(__name__)

PROTOCOL_VERSION: Final = 1
#: Longest ``prefix``: it names the DHT key and the stream, both bounded.
MAX_PREFIX_LENGTH: Final = 200
_OWNER_PREFIX, _OWNER_SUFFIX = "[owner:", "]"
_STATE, _BUSY, _REFUSED = "state", "busy", "refused"
_MAX_REASON = 200

#: ``(metadata, state)``: a msgpack-able dict and a nested state object of
#: dicts, lists, tuples, scalars and tensors (``swarm._state`` grammar).
GetState = Callable[[], tuple[dict[str, Any], Any]]
#: Fault-injection hook (tests, chaos runs): awaited by the donor before it
#: sends chunk ``chunk`` of upload number ``upload`` (counted from 0 per
#: ``serve_state``). It may raise (the upload fails, the newcomer sees a
#: reset), block, or stop the whole peer.
BeforeChunk = Callable[[int, int], Awaitable[None]]


class _Peer(Protocol):
    """What state transfer needs of ``swarm.AsyncPeer``."""

    @property
    def peer_id(self) -> PeerID: ...
    @property
    def endpoint(self) -> tuple[str, int]: ...
    @property
    def client_mode(self) -> bool: ...
    @property
    def dht(self) -> DHTNode: ...
    @property
    def connections(self) -> Connections: ...


class _Unchecked:
    def __repr__(self) -> str:
        return "UNCHECKED"


#: Put in a template where any sub-tree is acceptable (only finiteness is
#: checked), e.g. ``{"model": model.state_dict(), "optimizer": UNCHECKED}``.
UNCHECKED: Final = _Unchecked()


@dataclass(frozen=True)
class StateTransferConfig:
    """Limits and deadlines of state transfer (bytes, seconds); validated on construction.

    Donor side: ``max_uploads`` concurrent uploads, of which at most
    ``max_uploads_per_peer`` to one newcomer (a newcomer needs one at a time,
    so one peer cannot take every slot), ``chunk_size`` bytes per
    frame (at most the connections' ``max_frame_size``), an announcement
    every ``announce_interval`` that lives ``announce_ttl``, and
    ``request_timeout`` for a newcomer to send its request. Newcomer side:
    ``max_header_bytes`` for the header, and a busy donor is retried after
    ``retry_backoff`` seconds, doubling up to ``max_retry_backoff``. Both
    sides: no chunk may take longer than ``chunk_timeout`` to send or arrive.
    """

    max_uploads: int = 2
    max_uploads_per_peer: int = 1
    chunk_size: int = 2**20
    announce_interval: float = 10.0
    announce_ttl: float = 30.0
    request_timeout: float = 5.0
    chunk_timeout: float = 10.0
    max_header_bytes: int = MAX_MESSAGE_SIZE
    retry_backoff: float = 0.05
    max_retry_backoff: float = 1.0

    def __post_init__(self) -> None:
        if self.max_uploads < 1:
            raise ConfigError(f"max_uploads={self.max_uploads} must be at least 1")
        if not 1 <= self.max_uploads_per_peer <= self.max_uploads:
            raise ConfigError(
                f"max_uploads_per_peer={self.max_uploads_per_peer} must be in "
                f"[1, max_uploads={self.max_uploads}]"
            )
        if not 1024 <= self.chunk_size <= 8 * 2**20:
            raise ConfigError(
                f"chunk_size={self.chunk_size} must be in [1024, 8 MiB] (one connection frame)"
            )
        if self.max_header_bytes < 64:
            raise ConfigError(f"max_header_bytes={self.max_header_bytes} must be at least 64")
        for name in (
            "announce_interval",
            "announce_ttl",
            "request_timeout",
            "chunk_timeout",
            "retry_backoff",
            "max_retry_backoff",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name}={value} must be a positive number of seconds")
        if self.announce_ttl <= self.announce_interval:
            raise ConfigError(
                f"announce_ttl ({self.announce_ttl}) must exceed announce_interval"
                f" ({self.announce_interval}), or a live donor vanishes from the DHT"
                " between two announcements"
            )
        if self.max_retry_backoff < self.retry_backoff:
            raise ConfigError("max_retry_backoff must be at least retry_backoff")


DEFAULT_CONFIG: Final = StateTransferConfig()


@dataclass(frozen=True)
class LoadedState:
    """A verified state downloaded from ``donor``: its ``metadata``, the nested
    ``state`` (fresh CPU tensors nobody else holds) and the donor's ``version``."""

    metadata: dict[str, Any]
    state: Any
    version: int
    donor: PeerID


@dataclass(frozen=True)
class DonorInfo:
    """One donor as announced in the DHT."""

    peer_id: PeerID
    host: str
    port: int
    version: int


def state_key(prefix: str) -> str:
    """The DHT key under which the donors of ``prefix`` announce themselves."""
    return f"{prefix}.state"


def state_stream(prefix: str) -> str:
    """The name of the stream (connection handler) that serves ``prefix``."""
    return f"state.{prefix}"


def _check_prefix(prefix: str) -> None:
    if not isinstance(prefix, str) or not 0 < len(prefix) <= MAX_PREFIX_LENGTH:
        raise ValueError(f"prefix must be a string of 1 to {MAX_PREFIX_LENGTH} characters")


# -- pure code: announcements, headers, chunks, verification ---------------------


def announcement(host: str, port: int, version: int) -> list[Any]:
    """The DHT value a donor stores under its sub-key."""
    return [host, port, version]


def parse_donors(entries: Any, *, exclude: PeerID | None = None) -> list[DonorInfo]:
    """The well-formed donor announcements among the sub-keys read from the DHT.

    ``entries`` is the ``value`` of a ``DHTValue`` of the state key: a dict from
    sub-key to ``DHTValue``. Sub-keys that are not exactly one owner marker and
    malformed values are skipped (logged), never raised: one bad record must
    not hide the good ones.
    """
    donors: list[DonorInfo] = []
    if not isinstance(entries, dict):
        return donors
    for subkey, entry in entries.items():
        try:
            peer_id = _owner_of(subkey)
            host, port, version = expect_list(getattr(entry, "value", None), 3, "announcement")
            donor = DonorInfo(
                peer_id,
                expect_str(host, "announced host", max_size=253),
                expect_int(port, "announced port", lo=1, hi=65535),
                expect_int(version, "announced version", lo=-(2**63), hi=2**63 - 1),
            )
        except ProtocolError as e:
            logger.debug("skipping a state announcement: %s", e)
            continue
        if donor.peer_id != exclude:
            donors.append(donor)
    return donors


def _owner_of(subkey: Any) -> PeerID:
    if not (
        isinstance(subkey, str)
        and subkey.startswith(_OWNER_PREFIX)
        and subkey.endswith(_OWNER_SUFFIX)
    ):
        raise ProtocolError(f"sub-key {subkey!r} is not an owner marker")
    try:
        peer_id = PeerID.from_hex(subkey[len(_OWNER_PREFIX) : -len(_OWNER_SUFFIX)])
    except ValueError as e:
        raise ProtocolError(f"sub-key {subkey!r} does not name a peer id") from e
    if owner_marker(peer_id) != subkey:
        raise ProtocolError(f"sub-key {subkey!r} is not an owner marker")
    return peer_id


def order_donors(donors: Sequence[DonorInfo], rng: random.Random) -> list[DonorInfo]:
    """Newest version first; equally new donors in an order drawn from ``rng``."""
    shuffled = list(donors)
    rng.shuffle(shuffled)
    return sorted(shuffled, key=lambda donor: -donor.version)  # stable: keeps the shuffle


@dataclass(frozen=True)
class StateHeader:
    """The first frame of an upload, decoded."""

    version: int
    metadata: dict[str, Any]
    skeleton: Any
    specs: list[TensorSpec]

    @property
    def total_bytes(self) -> int:
        return sum(spec.nbytes for spec in self.specs)


class DonorBusy(SwarmError):
    """The donor is running ``max_uploads`` uploads: try another, retry later."""


class DonorRefused(SwarmError):
    """The donor will not upload to us (protocol version, our byte limit)."""


class DonorTooOld(SwarmError):
    """The donor's state is older than the newcomer can use (``min_version``)."""


def encode_header(
    version: int, metadata: dict[str, Any], flat: FlatState
) -> tuple[bytes, list[bytes]]:
    """The header frame and the tensor data of ``flat`` (copied now: a snapshot).

    Raises ``TypeError``/``ValueError`` for metadata that cannot be encoded
    (the local side's mistake).
    """
    if not isinstance(metadata, dict):
        raise TypeError(f"state metadata must be a dict, not {type(metadata).__name__}")
    blobs = [tensor_to_bytes(tensor) for tensor in flat.tensors]
    header = pack([_STATE, version, metadata, state_header(flat)], max_size=2**31)
    return header, blobs


def encode_refusal(kind: str, reason: str) -> bytes:
    return pack([kind, reason[:_MAX_REASON]])


def decode_header(data: Any, *, max_header_bytes: int, max_bytes: int) -> StateHeader:
    """Decode the donor's first frame.

    Raises ``DonorBusy`` or ``DonorRefused`` for a refusal, ``ProtocolError``
    (and nothing else) for anything malformed, larger than
    ``max_header_bytes``, or announcing more than ``max_bytes`` of tensors.
    """
    if not isinstance(data, bytes):
        raise ProtocolError("state header: expected a raw frame")
    obj = unpack(data, max_size=max_header_bytes)
    if not isinstance(obj, list) or not obj:
        raise ProtocolError("state header: expected a non-empty list")
    kind = obj[0]
    if kind in (_BUSY, _REFUSED):
        reason = expect_str(expect_list(obj, 2, "refusal")[1], "refusal reason")[:_MAX_REASON]
        raise (DonorBusy if kind == _BUSY else DonorRefused)(reason)
    if kind != _STATE:
        raise ProtocolError(f"state header: unknown kind {kind!r}")
    _, version, metadata, header = expect_list(obj, 4, "state header")
    version = expect_int(version, "state version", lo=-(2**63), hi=2**63 - 1)
    if not isinstance(metadata, dict):
        raise ProtocolError("state header: metadata must be a map")
    skeleton, specs = parse_state_header(header, max_total_bytes=max_bytes)
    for spec in specs:
        # An empty tensor passes any byte limit, but torch refuses shapes whose
        # strides overflow int64 (a RuntimeError): refuse them here.
        if math.prod(max(size, 1) for size in spec.shape) >= 2**62:
            raise ProtocolError(f"state header: tensor shape {spec.shape} is too large")
    return StateHeader(version, metadata, skeleton, specs)


def iter_chunks(blobs: Sequence[bytes], chunk_size: int) -> Iterator[bytes | memoryview]:
    """The concatenation of ``blobs`` cut into pieces of ``chunk_size`` bytes
    (the last may be shorter). A piece inside one blob is a view, not a copy."""
    pending: list[memoryview] = []
    size = 0
    for blob in blobs:
        view = memoryview(blob)
        while view.nbytes:
            take = min(chunk_size - size, view.nbytes)
            pending.append(view[:take])
            size += take
            view = view[take:]
            if size == chunk_size:
                yield pending[0] if len(pending) == 1 else b"".join(pending)
                pending, size = [], 0
    if size:
        yield pending[0] if len(pending) == 1 else b"".join(pending)


class StateAssembler:
    """Fills preallocated tensor buffers from chunks of any size, in order.

    Pure code: ``feed`` each raw frame; ``ProtocolError`` for a frame that is
    empty or runs past the announced total. ``tensors()`` once ``done``.
    """

    def __init__(self, specs: Sequence[TensorSpec]) -> None:
        self._specs = list(specs)
        self._buffers = [bytearray(spec.nbytes) for spec in self._specs]
        self.total = sum(spec.nbytes for spec in self._specs)
        self.received = 0
        self._index = 0
        self._offset = 0

    @property
    def done(self) -> bool:
        return self.received == self.total

    def feed(self, data: Any) -> None:
        if not isinstance(data, bytes):
            raise ProtocolError("state data: expected a raw frame")
        size = len(data)
        if size == 0 or size > self.total - self.received:
            raise ProtocolError(
                f"state data: a chunk of {size} bytes, at most"
                f" {self.total - self.received} expected"
            )
        view = memoryview(data)
        while view.nbytes:
            buffer = self._buffers[self._index]
            take = min(len(buffer) - self._offset, view.nbytes)
            buffer[self._offset : self._offset + take] = view[:take]
            self._offset += take
            view = view[take:]
            if self._offset == len(buffer):
                self._index += 1
                self._offset = 0
        self.received += size

    def tensors(self) -> list[torch.Tensor]:
        if not self.done:
            raise ProtocolError(f"state data: {self.total - self.received} bytes missing")
        return [tensor_from_bytes(s, b) for s, b in zip(self._specs, self._buffers, strict=True)]


def check_finite(tensors: Sequence[torch.Tensor]) -> None:
    """``ProtocolError`` if a floating-point or complex tensor holds NaN or Inf."""
    for index, tensor in enumerate(tensors):
        if (tensor.is_floating_point() or tensor.is_complex()) and not bool(
            torch.isfinite(tensor).all()
        ):
            raise ProtocolError(f"state tensor {index} holds NaN or Inf")


def check_template(state: Any, template: Any, path: str = "state") -> None:
    """``ProtocolError`` unless ``state`` has the structure of ``template``.

    Same dict keys, same list/tuple lengths, a tensor of the same shape and
    dtype wherever the template has one, a scalar wherever it has a scalar
    (its value may differ: step counts, learning rates). ``UNCHECKED`` in the
    template accepts any sub-tree.
    """
    if template is UNCHECKED:
        return
    if isinstance(template, torch.Tensor):
        if not isinstance(state, torch.Tensor):
            raise ProtocolError(f"{path}: expected a tensor, got {type(state).__name__}")
        if state.dtype != template.dtype or state.shape != template.shape:
            raise ProtocolError(
                f"{path}: expected {template.dtype} {tuple(template.shape)},"
                f" got {state.dtype} {tuple(state.shape)}"
            )
    elif isinstance(template, Mapping):
        if not isinstance(state, dict):
            raise ProtocolError(f"{path}: expected a dict, got {type(state).__name__}")
        if set(state) != set(template):
            missing = [k for k in template if k not in state][:3]
            extra = [k for k in state if k not in template][:3]
            raise ProtocolError(f"{path}: keys differ (missing {missing}, unexpected {extra})")
        for key, value in template.items():
            check_template(state[key], value, f"{path}[{key!r}]")
    elif isinstance(template, list | tuple):
        if type(state) is not type(template) or len(state) != len(template):
            raise ProtocolError(
                f"{path}: expected a {type(template).__name__} of {len(template)} items"
            )
        for index, (item, expected) in enumerate(zip(state, template, strict=True)):
            check_template(item, expected, f"{path}[{index}]")
    elif isinstance(state, torch.Tensor | dict | list | tuple):
        raise ProtocolError(f"{path}: expected a scalar, got {type(state).__name__}")


# -- donor ---------------------------------------------------------------------


class _Uploads:
    """The donor's running uploads: counted against ``max_uploads``, and
    cancelled when ``serve_state`` ends (they run in the connections' nursery)."""

    def __init__(self, limit: int, peer_limit: int) -> None:
        self.limit = limit
        self.peer_limit = peer_limit
        self.by_peer: dict[PeerID, int] = {}
        self.active = 0
        self.started = 0
        self.scopes: set[trio.CancelScope] = set()
        self.closed = False


async def serve_state(
    peer: _Peer,
    prefix: str,
    get_state: GetState,
    *,
    get_version: Callable[[], int] | None = None,
    config: StateTransferConfig = DEFAULT_CONFIG,
    before_chunk: BeforeChunk | None = None,
    state_lock: threading.Lock | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Offer this peer's state to newcomers until cancelled.

    Start it with ``await nursery.start(serve_state, peer, prefix, get_state)``
    (``functools.partial`` for the keywords): when that returns, the stream
    handler is registered and the first announcement has been stored, so
    newcomers can find this donor. It then re-announces every
    ``announce_interval``; a failed announcement is logged and retried at the
    next interval. A client-mode peer accepts no connections: it neither
    serves nor announces (this returns from ``start`` and waits).

    ``get_state()`` is called once per upload and every tensor it returns is
    copied at once: one upload sends one snapshot whatever changes the tensors
    later. Without ``state_lock`` the call and the copy run in trio, before the
    upload's first ``await``, so trio tasks may change the state in place. An
    owner that changes its state under ``state_lock`` (a training loop in
    another thread) gets both in a worker thread holding the lock (taken
    without waiting: if it is held, the newcomer is told this donor is busy and
    tries again), so an upload sends a whole step's state and the event loop
    never waits on training nor on the copy of a model-sized state.
    ``get_version()`` gives the announced version (newcomers prefer the
    highest); by default it is ``metadata["epoch"]`` of ``get_state()``, or 0.

    Cancellation stops the announcements, refuses later requests and cancels
    running uploads (their newcomers see a reset and move on); the DHT record
    expires within ``announce_ttl``.
    """
    _check_prefix(prefix)
    if peer.client_mode:
        task_status.started()
        await trio.sleep_forever()

    def version_of(metadata: dict[str, Any]) -> int:
        if get_version is not None:
            return get_version()
        epoch = metadata.get("epoch", 0) if isinstance(metadata, dict) else 0
        return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else 0

    uploads = _Uploads(config.max_uploads, config.max_uploads_per_peer)
    name = state_stream(prefix)

    def announced() -> int:
        return get_version() if get_version is not None else version_of(get_state()[0])

    async def handle(stream: Stream) -> None:
        await _serve_upload(
            stream, uploads, get_state, version_of, config, before_chunk, state_lock
        )

    peer.connections.set_handler(name, handle)
    try:
        await _announce(peer, prefix, announced(), config)
        task_status.started()
        while True:
            await trio.sleep(config.announce_interval)
            await _announce(peer, prefix, announced(), config)
    finally:
        uploads.closed = True
        for scope in uploads.scopes:
            scope.cancel()
        peer.connections.set_handler(name, _refuse_stopped)


async def _announce(peer: _Peer, prefix: str, version: int, config: StateTransferConfig) -> None:
    host, port = peer.endpoint
    try:
        stored = await peer.dht.store(
            state_key(prefix),
            announcement(host, port, version),
            peer.dht.now() + config.announce_ttl,
            subkey=owner_marker(peer.peer_id),
        )
    except SwarmError as e:
        logger.warning("could not announce the state of %r: %s", prefix, e)
        return
    if not stored:
        logger.warning("no DHT node kept the state announcement of %r", prefix)


async def _refuse_stopped(stream: Stream) -> None:
    await stream.send_bytes(encode_refusal(_REFUSED, "this peer no longer serves its state"))


async def _serve_upload(
    stream: Stream,
    uploads: _Uploads,
    get_state: GetState,
    version_of: Callable[[dict[str, Any]], int],
    config: StateTransferConfig,
    before_chunk: BeforeChunk | None,
    state_lock: threading.Lock | None = None,
) -> None:
    """Serve one newcomer's stream (runs in the connections' nursery).

    Raises ``ProtocolError`` for a malformed request, ``DeadlineError`` if the
    request or a chunk takes longer than its deadline, ``ClosedError`` if
    ``serve_state`` ended meanwhile, and the stream's errors; the connection
    layer resets the stream with the error as its reason.
    """
    request = await _receive_within(stream, config.request_timeout)
    version, max_bytes = expect_list(request, 2, "state request")
    version = expect_int(version, "state request version", lo=0)
    max_bytes = expect_int(max_bytes, "state request max_bytes", lo=0)
    if uploads.closed:
        await stream.send_bytes(encode_refusal(_REFUSED, "this peer no longer serves its state"))
        return
    if version != PROTOCOL_VERSION:
        reason = f"protocol version {version} is not {PROTOCOL_VERSION}"
        await stream.send_bytes(encode_refusal(_REFUSED, reason))
        return
    if uploads.active >= uploads.limit:
        reason = f"{uploads.active} uploads in progress, the limit is {uploads.limit}"
        await stream.send_bytes(encode_refusal(_BUSY, reason))
        return
    remote = stream.remote
    if uploads.by_peer.get(remote, 0) >= uploads.peer_limit:
        reason = f"{uploads.peer_limit} uploads to this peer in progress already"
        await stream.send_bytes(encode_refusal(_BUSY, reason))
        return
    upload = uploads.started
    uploads.started += 1
    uploads.active += 1
    uploads.by_peer[remote] = uploads.by_peer.get(remote, 0) + 1
    scope = trio.CancelScope()
    uploads.scopes.add(scope)
    try:
        with scope:
            snapshot: _Snapshot | None
            if state_lock is None:
                snapshot = _snapshot(get_state, version_of, max_bytes)
            else:
                # The copy of a model-sized state takes tens of milliseconds or
                # more: made in a worker thread, under the lock that the owner
                # changes its state under, it never stalls the event loop.
                snapshot = await trio.to_thread.run_sync(
                    _snapshot_under, state_lock, get_state, version_of, max_bytes
                )
            if snapshot is None:
                reason = "this peer is changing its state (a training step)"
                await stream.send_bytes(encode_refusal(_BUSY, reason))
                return
            total, header, blobs = snapshot
            if total > max_bytes:
                reason = f"the state is {total} bytes, the newcomer accepts {max_bytes}"
                await stream.send_bytes(encode_refusal(_REFUSED, reason))
                return
            await _send_within(stream, header, config.chunk_timeout)
            for index, chunk in enumerate(iter_chunks(blobs, config.chunk_size)):
                if before_chunk is not None:
                    await before_chunk(upload, index)
                await _send_within(stream, chunk, config.chunk_timeout)
            await stream.send_eof()
    finally:
        uploads.active -= 1
        uploads.scopes.discard(scope)
        left = uploads.by_peer[remote] - 1
        if left:
            uploads.by_peer[remote] = left
        else:
            del uploads.by_peer[remote]
    if scope.cancelled_caught:
        raise ClosedError("this peer stopped serving its state during the upload")


_Snapshot = tuple[int, bytes, list[bytes]]


def _snapshot(
    get_state: GetState, version_of: Callable[[dict[str, Any]], int], max_bytes: int
) -> _Snapshot:
    """The state's total tensor bytes, and its header and data copied now (both
    empty when the total exceeds ``max_bytes``: nothing is copied for a
    newcomer that will be refused)."""
    metadata, state = get_state()
    flat = flatten_state(state)
    total = sum(tensor.numel() * tensor.element_size() for tensor in flat.tensors)
    if total > max_bytes:
        return total, b"", []
    header, blobs = encode_header(version_of(metadata), metadata, flat)
    return total, header, blobs


def _snapshot_under(
    lock: threading.Lock,
    get_state: GetState,
    version_of: Callable[[dict[str, Any]], int],
    max_bytes: int,
) -> _Snapshot | None:
    """``_snapshot`` while holding ``lock``, in the calling (worker) thread;
    None, without waiting, when the lock is held (a step is changing the state)."""
    if not lock.acquire(blocking=False):
        return None
    try:
        return _snapshot(get_state, version_of, max_bytes)
    finally:
        lock.release()


async def _send_within(stream: Stream, data: bytes | memoryview, timeout: float) -> None:
    with trio.move_on_after(timeout):
        await stream.send_bytes(data)
        return
    raise DeadlineError(f"the newcomer did not take a chunk within {timeout} s")


# -- newcomer -------------------------------------------------------------------


async def load_state_from_peers(
    peer: _Peer,
    prefix: str,
    *,
    template: Any = None,
    timeout: float = 60.0,
    max_bytes: int = 2**34,
    min_version: int | None = None,
    config: StateTransferConfig = DEFAULT_CONFIG,
) -> LoadedState | None:
    """Download and verify the newest state that the donors of ``prefix`` offer.

    Donors are read from the DHT (this peer excluded) and tried newest
    announced first, equally new ones in this peer's own shuffled order. A
    donor re-announces only every ``announce_interval``, so its announced
    version may lag its state by many steps: ``min_version`` is checked
    against the version in the donor's header, and a donor whose state is
    older is dropped for this call before any tensor is sent. A donor that
    is unreachable, breaks or resets the stream, stalls more than
    ``config.chunk_timeout`` on a chunk, sends more than ``max_bytes`` of
    tensors or ``config.max_header_bytes`` of header, or sends a state that
    fails verification (a NaN or Inf; with ``template``, see
    ``check_template``) is dropped for this call and the next is tried at
    once. A busy donor is tried again after a backoff, so when the newest
    donors are busy an older one may deliver: pass ``min_version`` to refuse
    states older than the caller can use. Buffers for the announced tensors
    (at most ``max_bytes``) are allocated when the header arrives.

    Returns the first state that arrives whole and verified, or None (the
    reasons are logged) when no donor is announced, every donor failed, or
    ``timeout`` seconds passed. Never waits longer than ``timeout``.
    Cancellation closes the open stream and propagates.
    """
    _check_prefix(prefix)
    if not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"timeout={timeout} must be a positive number of seconds")
    rng = random.Random(bytes(peer.peer_id))
    failures: dict[PeerID, str] = {}
    backoff = config.retry_backoff
    with trio.move_on_after(timeout):
        while True:
            entry = await peer.dht.get(state_key(prefix), latest=True)
            announced = parse_donors(None if entry is None else entry.value, exclude=peer.peer_id)
            donors = [donor for donor in announced if donor.peer_id not in failures]
            if not donors:
                _log_failure(prefix, failures, "no donor is announced")
                return None
            busy = 0
            for donor in order_donors(donors, rng):
                try:
                    return await _download(
                        peer, prefix, donor, template, max_bytes, config, min_version
                    )
                except DonorBusy as e:
                    busy += 1
                    logger.debug("donor %s is busy: %s", donor.peer_id.short(), e)
                except ClosedError:
                    raise  # we are shutting down: no donor is at fault
                except Exception as e:  # per-donor boundary: drop it, try the next one
                    failures[donor.peer_id] = f"{type(e).__name__}: {e}"
                    logger.info(
                        "state from %s failed: %s", donor.peer_id.short(), failures[donor.peer_id]
                    )
            if not busy:
                _log_failure(prefix, failures, "every donor failed")
                return None
            await trio.sleep(backoff * (1 + rng.random()))
            backoff = min(2 * backoff, config.max_retry_backoff)
    _log_failure(prefix, failures, f"no donor delivered within {timeout} s")
    return None


def _log_failure(prefix: str, failures: Mapping[PeerID, str], why: str) -> None:
    detail = "; ".join(f"{peer_id.short()}: {reason}" for peer_id, reason in failures.items())
    detail = f" ({detail})" if detail else ""
    logger.warning("could not load the state of %r: %s%s", prefix, why, detail)


async def _download(
    peer: _Peer,
    prefix: str,
    donor: DonorInfo,
    template: Any,
    max_bytes: int,
    config: StateTransferConfig,
    min_version: int | None = None,
) -> LoadedState:
    """Download and verify the state of one donor.

    Raises ``DonorBusy``/``DonorRefused``, ``DonorTooOld`` (the header's version
    is below ``min_version``: the stream is closed before any tensor),
    ``ProtocolError`` (malformed, oversized, or failing verification),
    ``DeadlineError`` (a frame took longer
    than ``chunk_timeout``; connecting is bounded by the connection config),
    and the errors of ``open_stream`` and ``Stream.receive``.
    """
    address = (donor.host, donor.port)
    async with peer.connections.open_stream(donor.peer_id, address, state_stream(prefix)) as stream:
        await stream.send([PROTOCOL_VERSION, max_bytes])
        await stream.send_eof()
        header = decode_header(
            await _receive_within(stream, config.chunk_timeout),
            max_header_bytes=config.max_header_bytes,
            max_bytes=max_bytes,
        )
        if min_version is not None and header.version < min_version:
            raise DonorTooOld(f"it offers version {header.version}, below {min_version}")
        assembler = StateAssembler(header.specs)
        while not assembler.done:
            assembler.feed(await _receive_within(stream, config.chunk_timeout))
        try:
            await _receive_within(stream, config.chunk_timeout)
        except EndOfStreamError:
            pass
        else:
            raise ProtocolError(f"{donor.peer_id.short()} sent more than its state")
    # A pass over every tensor of a model-sized state: off the event loop.
    state = await trio.to_thread.run_sync(_verified_state, assembler, header, template)
    return LoadedState(header.metadata, state, header.version, donor.peer_id)


def _verified_state(assembler: StateAssembler, header: StateHeader, template: Any) -> Any:
    """The downloaded state; ``ProtocolError`` if a tensor is not finite or the
    state does not match ``template`` (when given)."""
    tensors = assembler.tensors()
    check_finite(tensors)
    state = unflatten_state(header.skeleton, tensors)
    if template is not None:
        check_template(state, template)
    return state


async def _receive_within(stream: Stream, timeout: float) -> Any:
    with trio.move_on_after(timeout):
        return await stream.receive()
    raise DeadlineError(f"{stream.remote.short()} sent nothing for {timeout} s")
