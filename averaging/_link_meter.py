"""How fast this peer's link moves all-reduce traffic, measured from its own rounds.

Parts of a butterfly all-reduce should follow each member's link (DESIGN.md,
"Networks like volunteers have"): a member that uploads at a tenth of the
others' rate should reduce a tenth as much, or every round waits for it. A
declared rate is a guess the user must make; this module measures instead,
from the traffic the rounds carry anyway (no probe traffic).

What is measured. A round reports every payload it sends to, and receives
from, another peer (``RoundTraffic.sending`` / ``receiving``), each with the
time the call took. The *busy time* of a direction is the union of those
calls' intervals: while a send is blocked, its connection has more bytes
than the kernel will queue, so the link is sending as fast as it can. Waiting
that is not the link's doing is left out: a sender that waits for results
(the all-reduce's window) or for the next chunk to be reduced has no send in
progress, and a peer with little to send is not measured as slow.

The bytes that count are those that crossed the link during a send, not
those it handed over: a send that fits the kernel's buffer returns at once,
and its bytes leave later, while nothing is being timed. Counting them
measured a 40 Mbit/s uplink at up to 150 Mbit/s. So each send reads its
connections' unacknowledged bytes (Linux's SIOCOUTQ) when a busy interval
begins and ends: handed over + before - after were acknowledged by the
remotes meanwhile, on whichever connection. A send that returned at once
counts (nearly) nothing, in (nearly) no time, until its bytes leave: while
no send runs and the connections still hold bytes the sends handed over,
the link is draining them, and the round's watcher (``RoundTraffic.
watching_drains``) reads every ``DRAIN_POLL`` how many crossed since it last
looked, counting them with the time since the last read that saw bytes
cross. Without it a peer whose kernel took each of its sends at once (a
fast link, parts under a mebibyte) counted too few bytes to publish a rate,
and one member without a rate means equal parts for its whole group
(``_partition.part_weights``).

Caveats, which decide how the figures are used:

- Bytes acknowledged during a busy interval may have crossed just before it:
  each interval errs by at most what the connections hold unsent plus what
  is in flight. A drain's time errs high by up to one ``DRAIN_POLL`` (the
  read that saw its last bytes gone counts the whole poll), and a drain
  that shows no progress for ``DRAIN_STALL`` (a receiver that stopped
  reading, a loss being recovered) stops being watched: its remaining bytes
  count only if a later send's interval sees them cross.
- A receive lasts as long as the *sender* takes to send, so the download
  rate is bounded by the uploads of the peers it receives from: it is a
  lower bound of the link. The part sizes therefore follow the upload rate
  only (``_partition.part_weights``); the download rate is published for
  observers.

Only rounds in which nothing failed and at least ``MIN_SAMPLE_BYTES`` went
each way count (tiny rounds measure system calls, not links); a measurement
is the median of the last ``window`` such rounds, so one disturbed round
does not move the parts.

Automatic pacing (``LinkMeter.pacing_rate``). Unpaced, the n - 1 flows of an
uplink build a queue at the link and take it from each other in turns; paced
just under the link they keep to their shares (``AllReduceConfig.
upload_pacing``), which needs the link's rate. An unpaced round measures it;
a paced round measures only what the pacing let through, so it cannot tell a
faster link, and a pace taken from paced rounds would drift with the meter's
errors. Pacing helps only where the flows queue at the link; where the CPU
or the receiver is what holds them (loopback, a fast LAN), a pace from one
round's figure would only cap the next. So the pace follows the unpaced
rounds only, and only while their sends saw a queue (their connections'
smoothed round trip ``QUEUED`` over its least, the median over a round's
sends): the largest of the last ``CAPACITY_WINDOW`` such rounds' uploads,
once there are ``MIN_UNPACED``, times ``AUTO_PACING_SHARE``; none above
``AUTO_PACING_MAX``. The largest, because the meter errs low, not high: a
busy CPU or a receiver that drains late makes a round look slower than its
link, and one round's figure (4 peers on a loaded machine: 44-89 Mbit/s on
100 Mbit/s links) paced later rounds under the link. A round runs
unpaced again, a probe, when ``PROBE_EVERY`` paced rounds have passed (the
link may have got faster: a peer that moved to a faster network) or as soon
as a paced round moved less than ``SLOWER_THAN_PACED`` of its pace (the link
got slower). A probe that lands outside ``LINK_CHANGED`` of the estimate
starts a new history: the link changed, and the old figures would hold the
pace where it was.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Protocol

import trio

#: Bytes a direction must carry in one round for the round to count.
MIN_SAMPLE_BYTES = 256 * 1024
#: Seconds between the reads of a drain: the connections' unacknowledged
#: bytes after the sends that handed them over returned (module docstring).
#: A drain's time errs high by up to this much; on a home link the drains
#: of a round's last sends last tens of milliseconds or more.
DRAIN_POLL = 0.002
#: Seconds without a byte crossing after which a drain is no longer watched.
DRAIN_STALL = 0.25
#: The pace of automatic pacing over the upload that unpaced rounds
#: measured. The pace counts IP packets (1500 bytes per 1448 of payload) and
#: the meter payload; and the meter's figure errs low: on 4 peers x 100
#: Mbit/s (tbf) unpaced rounds measured 87-94 Mbit/s where TCP's payload
#: can reach 95.6. Declared paces of 97-98.5 Mbit/s filled those links best
#: (92-94% of the link limit), above 99.5 the queue comes back; 1.07x the
#: measured figures paced at 94-100 (docs/home-links.md).
AUTO_PACING_SHARE = 1.07
#: No automatic pacing above this measured upload (bytes per second, 500
#: Mbit/s): pacing keeps flows from queueing at a home link's shaper, while
#: faster, the peer's CPU or its LAN is what an unpaced round measured (on
#: loopback, 4 peers on 2 busy cores measured 0.63 Gbit/s in their first
#: round), and a cap at that figure would hold the next rounds to it.
AUTO_PACING_MAX = 500e6 / 8
#: The queueing delay (seconds; ``Connection.queueing_delay``, the median
#: over a round's sends) from which an unpaced round counts as one whose
#: flows queued at the link. Unpaced on the 100 Mbit/s test bed, tbf's
#: queues held 20-40 ms; on loopback there is none.
QUEUED = 0.005
#: Unpaced rounds whose upload rates the pace follows (their largest).
CAPACITY_WINDOW = 3
#: Unpaced rounds that must have queued before the first pace.
MIN_UNPACED = 2
#: Paced rounds after which one runs unpaced, to see whether the link got faster.
PROBE_EVERY = 10
#: A paced round whose upload measured less than this share of its pace
#: makes the next round a probe: the link no longer carries the pace.
SLOWER_THAN_PACED = 0.8
#: A probe outside [LINK_CHANGED, 1 / LINK_CHANGED] of the estimate
#: replaces the unpaced history instead of joining it.
LINK_CHANGED = 0.8


class Connection(Protocol):
    """What the meter reads from a connection a round sends on."""

    def unacknowledged_bytes(self) -> int:
        """Bytes handed to the kernel that the remote has not acknowledged yet."""
        ...

    def queueing_delay(self) -> float | None:
        """Seconds the connection's packets wait in queues on the path (its
        smoothed round trip less its least); None if not known."""
        ...


class _Direction:
    """Bytes and busy time of one direction of one round.

    With ``connections`` (whose unacknowledged bytes it reads) the bytes of
    a busy interval are those acknowledged during it: handed over, plus what
    all connections held unacknowledged when it began, minus what they hold
    when it ends (module docstring). Without, those handed over.
    """

    __slots__ = (
        "active",
        "busy",
        "bytes",
        "connections",
        "delays",
        "draining",
        "handed",
        "mark",
        "pending",
        "queued",
        "since",
    )

    def __init__(self) -> None:
        self.active = 0
        self.since = 0.0
        self.busy = 0.0
        self.bytes = 0
        self.handed = 0  # in the current busy interval
        self.queued = 0  # unacknowledged when the current busy interval began
        # by identity; holding them keeps their ids unique for the round
        self.connections: dict[int, Connection] = {}
        self.delays: list[float] = []  # queueing delays, one per send that ended
        # a drain: bytes the connections held when the last send returned
        self.draining = False
        self.pending = 0  # still unacknowledged at the last read
        self.mark = 0.0  # when the busy time counted so far ends

    def start(self, now: float, connection: Connection | None = None) -> None:
        # a send ends a drain: what it still holds counts if it crosses
        # during the interval (``queued``); since the watcher's last read
        # (at most DRAIN_POLL ago), nothing counts
        self.draining = False
        if connection is not None and id(connection) not in self.connections:
            self.connections[id(connection)] = connection
            if self.active:  # new to this interval: what it holds already is not ours
                self.queued += connection.unacknowledged_bytes()
        if self.active == 0:
            self.since = now
            self.handed = 0
            self.queued = self._unacknowledged()
        self.active += 1

    def stop(self, now: float, nbytes: int, connection: Connection | None = None) -> None:
        if connection is not None and (delay := connection.queueing_delay()) is not None:
            self.delays.append(delay)
        self.active -= 1
        self.handed += nbytes
        if self.active == 0:
            self.busy += now - self.since
            if self.connections:
                held = self._unacknowledged()
                left = self.handed + self.queued - held
                self.bytes += min(self.handed + self.queued, max(0, left))
                self.draining, self.pending, self.mark = held > 0, held, now
            else:
                self.bytes += self.handed

    def read_drain(self, now: float) -> bool:
        """Count what crossed since the last read of a drain (module
        docstring); returns whether the drain goes on."""
        if not self.draining or self.active:
            return False
        held = self._unacknowledged()
        if held < self.pending:
            self.bytes += self.pending - held
            self.busy += now - self.mark
            self.mark = now
        self.pending = held
        self.draining = held > 0 and now - self.mark < DRAIN_STALL
        return self.draining

    def _unacknowledged(self) -> int:
        return sum(c.unacknowledged_bytes() for c in self.connections.values())

    def saw_queue(self) -> bool:
        """Whether this direction's sends found their connections queueing
        (the median delay at least ``QUEUED``); False if none said."""
        return bool(self.delays) and statistics.median(self.delays) >= QUEUED

    def rate(self) -> float | None:
        """Bytes per second of busy time, if enough was moved to tell."""
        if self.bytes < MIN_SAMPLE_BYTES or self.busy <= 0:
            return None
        return self.bytes / self.busy


class RoundTraffic:
    """The payload traffic of one round with other peers, and when it moved.

    ``clock`` returns seconds (``trio.current_time`` in the all-reduce).
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.up = _Direction()
        self.down = _Direction()
        self._drain_began = trio.Event()

    @contextmanager
    def sending(self, nbytes: int, connection: Connection | None = None) -> Iterator[None]:
        """Around one send of ``nbytes`` to another peer over ``connection``:
        if given, the round counts the bytes its connections had acknowledged
        while sends ran (module docstring), otherwise those handed over. A
        send that fails or is cancelled counts its time but none of its bytes."""
        with self._timed(self.up, nbytes, connection):
            yield

    @contextmanager
    def receiving(self, nbytes: int) -> Iterator[None]:
        """Around one receive of ``nbytes`` from another peer (as ``sending``,
        counting what arrived)."""
        with self._timed(self.down, nbytes, None):
            yield

    @asynccontextmanager
    async def watching_drains(self) -> AsyncIterator[None]:
        """Around a round's sends: reads the drains that follow them (module
        docstring) until the block ends. What the block raises reaches the
        caller as it was raised, not wrapped in the watcher's nursery's group."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_drains)
                try:
                    yield
                finally:
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            if len(group.exceptions) != 1:  # the block's and the watcher's Cancelled
                raise
            raised = group.exceptions[0]  # the watcher raises nothing else
            raise raised from raised.__cause__

    async def _watch_drains(self) -> None:
        while True:
            await self._drain_began.wait()
            self._drain_began = trio.Event()
            while True:
                await trio.sleep(DRAIN_POLL)
                if not self.up.read_drain(self._clock()):
                    break

    def add_received(self, nbytes: int, seconds: float) -> None:
        """Receipts timed by a worker thread (``_ring``): ``nbytes`` that
        took ``seconds``, in intervals that overlap no ``receiving``'s."""
        self.down.bytes += nbytes
        self.down.busy += seconds

    @contextmanager
    def _timed(
        self, direction: _Direction, nbytes: int, connection: Connection | None
    ) -> Iterator[None]:
        direction.start(self._clock(), connection)
        moved = 0
        try:
            yield
            moved = nbytes
        finally:
            direction.stop(self._clock(), moved, connection)
            if direction.draining:
                self._drain_began.set()


class LinkMeter:
    """This peer's measured upload and download rates (bytes per second).

    ``round_traffic()`` makes the recorder for one all-reduce round;
    ``record`` adds a finished round's figures. ``upload``/``download`` are 0
    until a round that counts (module docstring) has been recorded. Pure
    bookkeeping: the clock is passed in.
    """

    def __init__(self, clock: Callable[[], float], window: int = 5) -> None:
        if window < 1:
            raise ValueError("window must be at least 1")
        self._clock = clock
        self._up: deque[float] = deque(maxlen=window)
        self._down: deque[float] = deque(maxlen=window)
        self._capacity: deque[float] = deque(maxlen=CAPACITY_WINDOW)  # unpaced uploads
        self._paced_rounds = 0  # since the last unpaced round
        self._probe = False  # the last paced round moved less than its pace

    def round_traffic(self) -> RoundTraffic:
        return RoundTraffic(self._clock)

    def record(self, traffic: RoundTraffic, paced: float | None = None) -> None:
        """Add the rates of a round in which nothing failed (the caller's
        judgement: a stalled peer makes the others' sends look slow).
        ``paced``: the upload pace (bytes per second) the round's streams
        shared, None if they were not paced; a paced round's upload is not
        a measure of the link (module docstring)."""
        up, down = traffic.up.rate(), traffic.down.rate()
        if down is not None:
            self._down.append(down)
        if up is None:
            return
        self._up.append(up)
        if paced is not None:
            self._paced_rounds += 1
            self._probe = self._probe or up < SLOWER_THAN_PACED * paced
            return
        self._paced_rounds = 0
        self._probe = False
        if not traffic.up.saw_queue():  # nothing to gain from pacing (module docstring)
            self._capacity.clear()
            return
        if self._capacity:
            estimate = max(self._capacity)
            if not LINK_CHANGED * estimate <= up <= estimate / LINK_CHANGED:
                self._capacity.clear()
        self._capacity.append(up)

    def pacing_rate(self) -> float | None:
        """The upload pace (bytes per second) for this peer's next round, to
        share among its streams (``AllReduceConfig.upload_pacing``): under
        the upload its unpaced rounds measured. None: run unpaced, because
        too few unpaced rounds have counted yet or a probe is due (module
        docstring)."""
        if len(self._capacity) < MIN_UNPACED or self._probe or self._paced_rounds >= PROBE_EVERY:
            return None
        estimate = max(self._capacity)
        return AUTO_PACING_SHARE * estimate if estimate <= AUTO_PACING_MAX else None

    @property
    def upload(self) -> float:
        """Median upload rate over the recent rounds that counted; 0 if none."""
        return statistics.median(self._up) if self._up else 0.0

    @property
    def download(self) -> float:
        """Median download rate over the recent rounds that counted; 0 if none."""
        return statistics.median(self._down) if self._down else 0.0
