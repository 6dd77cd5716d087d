"""Progress tracking: how far the swarm has got toward the next global step.

Every peer publishes a signed record under ``{run_id}.progress`` (its sub-key
names it, so nobody can write another peer's progress): its epoch, the samples
it accumulated in this epoch, its samples per second, when it reported, its
latest loss and accuracy. Every peer reads all records and estimates, for the
swarm's current epoch, how many samples the live peers hold now and when the
target batch size will be reached (DeDLOC, Diskin et al. 2021, section 3.2).

``estimate`` is pure: records and a clock in, ``SwarmProgress`` out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dht import DHTValue
from swarm import PeerID, ProtocolError
from swarm._wire import expect_float, expect_int

#: Fields of a progress record, in order.
_FIELDS = ("epoch", "samples", "samples_per_second", "time", "loss", "accuracy", "client")


def progress_key(run_id: str) -> str:
    return f"{run_id}.progress"


@dataclass(frozen=True)
class PeerProgress:
    """One peer's progress record."""

    peer_id: PeerID
    epoch: int
    samples: int
    samples_per_second: float
    time: float
    loss: float | None = None
    accuracy: float | None = None
    client: bool = False

    def to_value(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "samples": self.samples,
            "samples_per_second": self.samples_per_second,
            "time": self.time,
            "loss": self.loss,
            "accuracy": self.accuracy,
            "client": self.client,
        }

    @classmethod
    def from_value(cls, peer_id: PeerID, value: Any) -> PeerProgress:
        """Decode a record from the DHT; raises ``ProtocolError`` if malformed."""
        if not isinstance(value, dict):
            raise ProtocolError("a progress record is a map")

        def optional(name: str) -> float | None:
            item = value.get(name)
            if item is None:
                return None
            return expect_float(item, name)

        sps = expect_float(value.get("samples_per_second"), "samples_per_second")
        if sps < 0:
            raise ProtocolError("samples_per_second must be >= 0")
        return cls(
            peer_id,
            expect_int(value.get("epoch"), "epoch", lo=0, hi=2**62),
            expect_int(value.get("samples"), "samples", lo=0, hi=2**62),
            sps,
            expect_float(value.get("time"), "time"),
            optional("loss"),
            optional("accuracy"),
            bool(value.get("client", False)),
        )


def parse_progress(found: DHTValue | None) -> list[PeerProgress]:
    """The valid records under a progress key (malformed ones are skipped)."""
    if found is None or not isinstance(found.value, Mapping):
        return []
    records = []
    for subkey, entry in found.value.items():
        if not isinstance(subkey, str) or not subkey.startswith("[owner:"):
            continue
        try:
            peer_id = PeerID.from_hex(subkey[len("[owner:") : -1])
            records.append(PeerProgress.from_value(peer_id, entry.value))
        except (ProtocolError, ValueError):
            continue
    return records


@dataclass(frozen=True)
class SwarmProgress:
    """The swarm as one peer sees it."""

    #: the most advanced epoch any live peer reports
    epoch: int
    #: samples accumulated toward ``epoch``'s global step, extrapolated to now
    samples: int
    target_batch_size: int
    #: samples per second of the peers at ``epoch``
    samples_per_second: float
    #: live peers (any epoch), and those at ``epoch``
    num_peers: int
    num_peers_at_epoch: int
    #: estimated seconds until ``samples`` reaches the target (0 if it has)
    eta: float
    #: samples the peers at ``epoch`` reported, without extrapolation
    reported: int = 0

    @property
    def ready(self) -> bool:
        """True once the peers *reported* the target: extrapolated samples may be
        samples nobody computed (a peer waiting on the network computes none)."""
        return self.reported >= self.target_batch_size


def estimate(
    records: list[PeerProgress],
    *,
    now: float,
    target_batch_size: int,
    stale_after: float,
) -> SwarmProgress:
    """Estimate the swarm's progress from the peers' records.

    Records older than ``stale_after`` seconds are from peers presumed gone.
    Samples of peers at the swarm's epoch are extrapolated with their rate
    since they reported, so a peer need not publish after every batch.
    """
    live = [r for r in records if now - r.time <= stale_after]
    if not live:
        return SwarmProgress(0, 0, target_batch_size, 0.0, 0, 0, math.inf, 0)
    epoch = max(r.epoch for r in live)
    current = [r for r in live if r.epoch == epoch]
    reported = sum(r.samples for r in current)
    samples = sum(r.samples + r.samples_per_second * max(0.0, now - r.time) for r in current)
    rate = sum(r.samples_per_second for r in current)
    missing = max(0.0, target_batch_size - samples)
    eta = 0.0 if missing == 0 else (missing / rate if rate > 0 else math.inf)
    return SwarmProgress(
        epoch=epoch,
        samples=int(samples),
        target_batch_size=target_batch_size,
        samples_per_second=rate,
        num_peers=len(live),
        num_peers_at_epoch=len(current),
        eta=eta,
        reported=reported,
    )


class RateMeter:
    """Samples per second as an exponential moving average over steps."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.rate = 0.0
        self._last: float | None = None

    def update(self, now: float, samples: int) -> float:
        if self._last is not None and now > self._last:
            instant = samples / (now - self._last)
            self.rate = (
                instant if self.rate == 0 else (1 - self.alpha) * self.rate + self.alpha * instant
            )
        self._last = now
        return self.rate

    def pause(self) -> None:
        """Forget the last time: waiting (averaging) is not compute."""
        self._last = None
