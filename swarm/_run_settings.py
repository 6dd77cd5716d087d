"""A run's settings: what every peer of a run must share, published in the DHT.

Peers of one run that disagree on the target batch size, the matchmaking and
group settings, DiLoCo or the task train on with no word, and badly: their
global steps and averaging rounds do not line up. So these settings are part of
the run's identity. The first peer of a run publishes them under
``{run_id}.settings``, in a sub-key that names it as the owner (signed, so
nobody writes settings in its name), and renews them while it trains. A peer
that joins reads them before it trains: it adopts every setting it did not set
on its command line, and is refused (``SettingsConflictError``, exit 2 from the
command line) if it set one to a different value.

Every peer agrees on one record by one rule (DESIGN.md, "Scale"): the earliest
``started``, then the lowest peer id. Each peer keeps publishing the run's
settings while fewer than ``MAX_PUBLISHERS`` peers do, so they outlive the
first peer without every peer of a large run writing the key.

``reconcile`` and ``choose`` are pure; ``read_run_settings`` and
``serve_run_settings`` do the DHT work on the peer's trio thread.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import trio

from dht import DHTNode, DHTValue, owner_marker

from ._errors import ConfigError, ProtocolError, SwarmError
from ._identity import PeerID

log = logging.getLogger(__name__)

#: Seconds a published settings record lives unless renewed: a run whose peers
#: are all gone frees its run id for other settings within this long.
SETTINGS_TTL = 60.0
#: Seconds between renewals (well within the TTL).
RENEW_INTERVAL = 20.0
#: At most this many peers keep the settings published (a key many peers write
#: must stay small, DESIGN.md "Scale").
MAX_PUBLISHERS = 4


class SettingsConflictError(ConfigError):
    """This peer set a run setting to a different value than the run has."""


def settings_key(run_id: str) -> str:
    return f"{run_id}.settings"


@dataclass(frozen=True)
class RunSettings:
    """The settings every peer of a run trains with.

    ``task`` is the ``--task`` value as its publisher gave it (a built-in name or
    ``FILE.py:FACTORY``, which must exist on the joiner too); peers agree on the
    task by ``task_name``. ``started`` is the run's start (DHT wall clock).
    """

    task: str
    task_name: str
    target_batch_size: int
    matchmaking_time: float
    target_group_size: int
    #: DiLoCo's local steps (None: off)
    diloco: int | None
    #: the epoch at which the run ends (None: never)
    max_epochs: int | None
    started: float
    #: the model's precision (``--precision``: fp32, bf16 or fp16); records of
    #: runs from before the setting existed mean fp32
    precision: str = "fp32"
    #: gradients over the lossy data plane (``--lossy``); records of runs from
    #: before the setting existed mean off. Peers that disagree would each
    #: refuse the other's streams: every all-reduce round would fail.
    lossy: bool = False
    #: the pipelined ring all-reduce where a group allows it (``--ring``,
    #: ``AllReduceConfig.ring``); records from before the setting existed mean
    #: off. A ring member waits for its predecessor's ring stream, a butterfly
    #: member sends to every reducer's butterfly round: peers that disagree
    #: fail every round they share, and fall back late.
    ring: bool = False

    #: command-line option of each setting a peer must share, by field name
    OPTIONS = {
        "task": "--task",
        "target_batch_size": "--target-batch-size",
        "matchmaking_time": "--matchmaking-time",
        "target_group_size": "--target-group-size",
        "diloco": "--diloco",
        "max_epochs": "--max-epochs",
        "precision": "--precision",
        "lossy": "--lossy",
        "ring": "--ring",
    }

    def to_value(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_value(cls, value: Any) -> RunSettings:
        """Decode a record read from the DHT; ``ProtocolError`` if malformed."""
        if not isinstance(value, Mapping):
            raise ProtocolError("run settings are a map")

        def text(name: str) -> str:
            item = value.get(name)
            if not isinstance(item, str) or not 0 < len(item) <= 1024:
                raise ProtocolError(f"run setting {name} must be a string")
            return item

        def integer(name: str, *, optional: bool = False) -> int | None:
            item = value.get(name)
            if item is None and optional:
                return None
            if isinstance(item, bool) or not isinstance(item, int) or not 1 <= item < 2**62:
                raise ProtocolError(f"run setting {name} must be a positive integer")
            return item

        def number(name: str) -> float:
            item = value.get(name)
            if isinstance(item, bool) or not isinstance(item, int | float):
                raise ProtocolError(f"run setting {name} must be a number")
            if not math.isfinite(item):
                raise ProtocolError(f"run setting {name} must be finite")
            return float(item)

        target, group = integer("target_batch_size"), integer("target_group_size")
        assert target is not None and group is not None
        lossy, ring = value.get("lossy", False), value.get("ring", False)
        if not isinstance(lossy, bool):
            raise ProtocolError("run setting lossy must be true or false")
        if not isinstance(ring, bool):
            raise ProtocolError("run setting ring must be true or false")
        matchmaking_time = number("matchmaking_time")
        if matchmaking_time <= 0:
            raise ProtocolError("run setting matchmaking_time must be positive")
        return cls(
            task=text("task"),
            task_name=text("task_name"),
            target_batch_size=target,
            matchmaking_time=matchmaking_time,
            target_group_size=group,
            diloco=integer("diloco", optional=True),
            max_epochs=integer("max_epochs", optional=True),
            started=number("started"),
            precision=text("precision") if "precision" in value else "fp32",
            lossy=lossy,
            ring=ring,
        )


def parse_run_settings(found: DHTValue | None) -> dict[PeerID, RunSettings]:
    """The valid settings records under a settings key, by publisher (malformed
    ones and sub-keys that name no owner are skipped)."""
    if found is None or not isinstance(found.value, Mapping):
        return {}
    records: dict[PeerID, RunSettings] = {}
    for subkey, entry in found.value.items():
        if not (isinstance(subkey, str) and subkey.startswith("[owner:") and subkey[-1] == "]"):
            continue
        try:
            records[PeerID.from_hex(subkey[len("[owner:") : -1])] = RunSettings.from_value(
                entry.value
            )
        except (ProtocolError, ValueError):
            continue
    return records


def choose(published: Mapping[PeerID, RunSettings]) -> RunSettings | None:
    """The run's settings: the earliest-started record, then the lowest peer id's."""
    if not published:
        return None
    publisher = min(published, key=lambda p: (published[p].started, p.hex()))
    return published[publisher]


def _shown(value: object) -> str:
    if value is None:
        return "none"
    return f"{value:g}" if isinstance(value, float) else str(value)


def reconcile(run: RunSettings | None, mine: RunSettings, given: frozenset[str]) -> RunSettings:
    """The settings this peer trains with.

    ``mine`` are this peer's (its options and their defaults), ``given`` the
    names of the fields it set explicitly. Without ``run`` this peer starts the
    run with ``mine``. Otherwise it adopts the run's settings, keeping its own
    ``task`` value when it named the same task (a file's path may differ from
    machine to machine). Raises ``SettingsConflictError`` naming the first
    setting it gave a different value than the run has.
    """
    if run is None:
        return mine
    for name, option in RunSettings.OPTIONS.items():
        if name not in given:
            continue
        ours, theirs = getattr(mine, name), getattr(run, name)
        if name == "task":
            ours, theirs = mine.task_name, run.task_name
        if ours != theirs:
            raise SettingsConflictError(
                f"{option} {_shown(ours)} differs from run's {_shown(theirs)}: "
                f"drop {option} to adopt the run's value, or pick another --run-id"
            )
    return replace(run, task=mine.task) if "task" in given else run


async def read_run_settings(dht: DHTNode, run_id: str) -> RunSettings | None:
    """The run's settings as published in the DHT (None: nobody published any).

    Raises what ``DHTNode.get`` raises."""
    return choose(parse_run_settings(await dht.get(settings_key(run_id), latest=True)))


async def serve_run_settings(
    dht: DHTNode,
    run_id: str,
    settings: RunSettings,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep ``settings`` published under the run's key while fewer than
    ``MAX_PUBLISHERS`` peers (this one among the first by peer id) do.

    Reports started after the first attempt to publish. Runs until cancelled;
    a failed store or read is logged and retried at the next renewal.
    """
    key, me = settings_key(run_id), dht.peer_id
    started = False
    while True:
        try:
            publishers = sorted(parse_run_settings(await dht.get(key)), key=PeerID.hex)
            if me in publishers[:MAX_PUBLISHERS] or len(publishers) < MAX_PUBLISHERS:
                await dht.store(
                    key, settings.to_value(), dht.now() + SETTINGS_TTL, subkey=owner_marker(me)
                )
        except SwarmError as e:
            log.warning("could not publish the run's settings: %s", e)
        if not started:
            started = True
            task_status.started()
        await trio.sleep(RENEW_INTERVAL)
