"""Swarm: train one PyTorch model on many unreliable machines.

The ``swarm`` package is the core every other package stands on, and the
application on top of them:

- identity (``Identity``, ``PeerID``): Ed25519 keys and the ids derived from them
- wire format (``pack``/``unpack``): msgpack with size limits, typed errors
- training state (``flatten_state``/``unflatten_state``): nested state dicts as
  msgpack skeleton + raw little-endian tensors, for checkpoints and state transfer
- errors: one class per meaning, rooted at ``SwarmError``
- clocks: injected wall clocks for expiration times
- secret files (``_secret_file``): created 0600, refused if others can read them
- private swarms (``create_swarm_key``/``load_swarm_key``): the pre-shared key file
- bans (``BanList``, ``BanConfig``): local bans of misbehaving peers, growing backoff
- connections (``open_connections``): authenticated, encrypted peer streams over TCP;
  their bulk frames are sealed, written, read and opened by worker threads
  (``_bulk_io``), off the trio thread
- counters (``_counters``): the figures a layer keeps (bytes, connections, DHT
  contacts), as ``prometheus_client`` objects a peer's registry exposes as they are
- reachability (``Reachability``, ``ReachabilityConfig``): whether others can
  dial a peer, found out by asking them to dial it back (behind NAT: no)
- relays (``serve_relay``, ``keep_relay``, ``RelayConfig``, ``Relay``): a
  reachable peer splices end-to-end authenticated connections to peers
  nobody can dial (``Connections.set_relay_route`` dials through one); an
  unreachable peer stays registered (keepalives; another relay when its own
  leaves) and is announced through its relay (``AsyncPeer.relay_route``)
- hole punching (``punch``, ``PunchError``, ``AsyncPeer.punch``, ``PunchConfig``):
  two peers behind NATs that reach each other through a relay coordinate a
  TCP simultaneous open over it, for a direct connection that outlives the
  relay; a peer punches by itself to the peers it dials through a relay
  (``AsyncPeer.auto_punch``)
- the peer facade (``open_peer``, ``Peer``, ``PeerConfig``): identity, DHT node
  and connections on one port; ``Peer`` runs trio in a background thread for
  synchronous training loops
- ``swarm.cli``: the ``swarm`` command, and around ``swarm train`` (application
  modules, imported by the CLI only): ``_config_file`` (``--config run.toml``),
  ``_dashboard`` (each global step to the history, the metrics, the log and the
  display), ``_history`` (the metric history file), ``_metrics`` (Prometheus,
  one registry per peer), ``_plot`` (``swarm plot``), ``_log_file``
  (``--log-file``, JSON lines), ``_live`` (the live display on a terminal)

Implementation lives in private modules (``_identity.py`` ...); this module
only re-exports the public names.
"""

from typing import TYPE_CHECKING

from ._bans import BanConfig, BanList
from ._clock import ManualClock, WallClock, system_clock
from ._connections import ConnectionConfig, Connections, Handler, Stream, open_connections
from ._errors import (
    AuthenticationError,
    BootstrapError,
    ClosedError,
    ConfigError,
    DeadlineError,
    EndOfStreamError,
    NonFiniteError,
    PeerCrashedError,
    PeerUnreachableError,
    ProtocolError,
    RecordRejectedError,
    RejectReason,
    SelfDialError,
    StreamResetError,
    SwarmError,
)
from ._identity import Identity, PeerID, verify_signature
from ._punch import PunchConfig, PunchError, punch
from ._reachability import Reachability, ReachabilityConfig
from ._relay import Relay, RelayConfig, keep_relay, open_circuit, serve_relay
from ._swarm_key import create_swarm_key, load_swarm_key
from ._wire import pack, unpack

# The peer facade composes the layers above the core (dht/), which themselves
# import the core: import it on first use so that importing the core alone
# never imports dht.
_FACADE = {"AsyncPeer", "Peer", "PeerConfig", "SyncDHT", "open_peer"}


if TYPE_CHECKING:
    from ._peer import AsyncPeer, Peer, PeerConfig, SyncDHT, open_peer


def __getattr__(name: str) -> object:
    if name in _FACADE:
        from . import _peer

        return getattr(_peer, name)
    raise AttributeError(f"module 'swarm' has no attribute {name!r}")


__all__ = [  # noqa: RUF022 - grouped: core names, then the peer facade
    "AuthenticationError",
    "BanConfig",
    "BanList",
    "BootstrapError",
    "ClosedError",
    "ConfigError",
    "ConnectionConfig",
    "Connections",
    "DeadlineError",
    "EndOfStreamError",
    "Handler",
    "Identity",
    "ManualClock",
    "PeerID",
    "NonFiniteError",
    "PeerCrashedError",
    "PeerUnreachableError",
    "PunchConfig",
    "PunchError",
    "ProtocolError",
    "Reachability",
    "ReachabilityConfig",
    "RecordRejectedError",
    "Relay",
    "RelayConfig",
    "RejectReason",
    "SelfDialError",
    "Stream",
    "StreamResetError",
    "SwarmError",
    "WallClock",
    "create_swarm_key",
    "keep_relay",
    "punch",
    "load_swarm_key",
    "open_circuit",
    "open_connections",
    "pack",
    "serve_relay",
    "system_clock",
    "unpack",
    "verify_signature",
    "AsyncPeer",
    "Peer",
    "PeerConfig",
    "SyncDHT",
    "open_peer",
]
