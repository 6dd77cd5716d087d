"""Benchmark: our butterfly all-reduce against torch.distributed (gloo) on loopback.

    python benchmarks/allreduce.py --peers 4 --size 25000000 [--rounds 5] [--json]
                                   [--split N] [--ring]

Each implementation runs in its own set of peer processes (this script,
started again with ``--worker``), so peak RSS per peer is measured cleanly.
Processes share nothing but a temporary directory: the port each peer listens
on, a file barrier before every round, and gloo's ``file://`` rendezvous
(its TCP store does reverse DNS look-ups that leave loopback). Nothing is
pickled: workers print one JSON line each.

Peer r holds ``x_r[i] = sin(i / 1000) * (r + 1) + r``, so the true mean is
``sin(i / 1000) * (P + 1) / 2 + (P - 1) / 2``; every worker checks its result
against it chunk by chunk (no extra full copy).

Reported: the median over rounds of the slowest peer's round time, for ours
with encryption (the default), ours in plaintext mode and gloo; the ratios to
gloo (``--ring``: also ours around the pipelined ring, ``AllReduceConfig.ring``,
plaintext and encrypted); the median CPU time per peer and round (``process_time``, all threads:
steadier than wall time on a shared machine), and below it the same split
by thread, user and system time (``RUSAGE_THREAD``): the thread that runs the
round (trio's; gloo's caller) and the others (our bulk transfers; gloo's
own); peak RSS per peer (``ru_maxrss``) of each, and the size of the vector.
On a machine with fewer cores than peers the round is bound by CPU, so the
ratio of times follows the ratio of CPU per peer.

Emulated home links (``--link-rate RATE``, needs root): every peer runs in a
network namespace of its own (``tests/netbed.py``), its upload and download
capped at RATE with tbf; ``--loss P`` drops packets arriving at every peer with
probability P (so P on every path), ``--slow-peer RATE`` caps peer 0's upload
at RATE. gloo (float32), ours in plaintext, encrypted, float16 and 8-bit run
one after the other on the same bed, and each is printed as a share of the
time the links allow: for equal links the link limit 2(n-1)/n x wire bytes /
rate (wire bytes: the codec's payload bytes of the vector, so TCP/IP and frame
headers count against us, about 4%); with a slow peer the bound of that
heterogeneous group, ``link_bound`` (below); with a slow peer, ours also
runs with parts by the links' rates and with parts by the upload rates the
peers measured (``averaging.LinkMeter``) in an untimed first round and every
round since, exchanged through files as matchmaking would publish them.
``--ring`` adds the ring's rows, the last with parts by the measured uploads
(equal where they are alike, ``_partition.RING_UPLOAD_SPREAD``), printed with
each round's slowest over fastest measured upload and whether its parts came
out equal (the ring ran).
``tcp_congestion_control`` is printed with the figures.

    sudo python benchmarks/allreduce.py --link-rate 100mbit --size 5000000 --rounds 3
                                        [--loss 0.01] [--slow-peer 10mbit]

``--lossy`` (with ``--link-rate``) adds our lossy data plane (``AllReduceConfig(lossy=
True)``: paced, encrypted UDP datagrams, never retransmitted) beside the TCP
runs on the same bed, and prints for it the share of the senders' data that
arrived (``held``): on a clean link, what pacing loses; with ``--loss``, what
the network does. Its first round starts at the pacer's initial rate, later
ones at the rates learnt from the receivers' reports (``averaging/_pacing``),
so run several rounds (the median is printed, and every round's time).

    sudo python benchmarks/allreduce.py --link-rate 50mbit --size 2000000 --rounds 6 \
        --codecs none --lossy [--loss 0.01]

``--timeline`` makes every worker sample its TCP connections every 10 ms
(``TCP_INFO``: bytes acknowledged and received, bytes not yet sent, time
limited by the receive window or the send buffer, retransmissions, rtt,
cwnd) and prints per peer how busy its upload and download were, in how
many 10 ms steps the upload idled (below 80% of the link) with nothing the
application had handed over left unsent (the application starved it) or
with bytes unsent (TCP held them), and the last round's upload per 50 ms.
``--congestion cubic`` (with ``--timeline``) sets that congestion control on
every connection the sampler finds, gloo's too (the namespaces' sysctl is
read-only here).

``--compare-chunks 32,64`` (with ``--link-rate``) adds runs of ours in
plaintext with parts cut into at least that many chunks
(``AllReduceConfig.min_chunks_per_part``), on the same bed in the same run.

``--split N`` hands our all-reduce the vector as N tensors of their own, as a
model's parameters are, which it copies into one vector and back every round;
by default it gets one vector, as it gets tensors from ``flat_zeros_like``
(the trainer's gradient accumulators). gloo always gets one vector.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

CHECK_CHUNK = 1 << 20

# Python puts this script's directory first on sys.path, where benchmarks/dht.py
# would shadow the dht package that averaging imports.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
#: the network test bed (``--link-rate``) lives with the tests that use it too
sys.path.append(str(_HERE.parent / "tests"))


def fill(x: torch.Tensor, rank: int) -> None:
    for start in range(0, x.numel(), CHECK_CHUNK):
        end = min(start + CHECK_CHUNK, x.numel())
        idx = torch.arange(start, end, dtype=torch.float64)
        x[start:end] = (torch.sin(idx / 1000) * (rank + 1) + rank).to(torch.float32)


def max_error(x: torch.Tensor, peers: int) -> float:
    worst = 0.0
    for start in range(0, x.numel(), CHECK_CHUNK):
        end = min(start + CHECK_CHUNK, x.numel())
        idx = torch.arange(start, end, dtype=torch.float64)
        want = torch.sin(idx / 1000) * (peers + 1) / 2 + (peers - 1) / 2
        worst = max(worst, float((x[start:end].double() - want).abs().max()))
    return worst


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def cpu_now() -> tuple[float, float, float, float]:
    """CPU seconds so far: (user, system) of the calling thread, then of the
    whole process (Linux's ``RUSAGE_THREAD``)."""
    thread = resource.getrusage(resource.RUSAGE_THREAD)
    process = resource.getrusage(resource.RUSAGE_SELF)
    return thread.ru_utime, thread.ru_stime, process.ru_utime, process.ru_stime


def cpu_split(start: tuple[float, float, float, float]) -> list[float]:
    """CPU seconds since ``start`` (``cpu_now``) as [user, system] of the
    calling thread (the one that runs the round: trio's, or gloo's caller)
    and [user, system] of the process's other threads (our bulk transfers,
    gloo's own)."""
    end = cpu_now()
    thread_user, thread_sys = end[0] - start[0], end[1] - start[1]
    # the two readings are not taken at once: clamp what that skews below zero
    return [
        thread_user,
        thread_sys,
        max(0.0, end[2] - start[2] - thread_user),
        max(0.0, end[3] - start[3] - thread_sys),
    ]


def file_barrier(directory: Path, name: str, rank: int, peers: int) -> None:
    (directory / f"{name}.{rank}").touch()
    while not all((directory / f"{name}.{r}").exists() for r in range(peers)):
        time.sleep(0.001)


#: Linux's SO_MAX_PACING_RATE (Python's socket module does not name it)
_SO_MAX_PACING_RATE = 47
#: ``--timeline``: how often each worker samples its connections (seconds)
TIMELINE_STEP = 0.01


class Timeline:
    """Per-connection traffic of one worker, sampled every ``TIMELINE_STEP``.

    A thread of its own reads each TCP connection's ``TCP_INFO`` (bytes the
    remote acknowledged, bytes received) and its send queue (``SIOCOUTQ``:
    bytes handed to the kernel and not yet acknowledged). From these the
    driver tells, per 10 ms, whether an upload idled with nothing queued (the
    application starved it) or with data queued (TCP or the link held it).
    """

    def __init__(self, congestion: str | None = None, pacing_rate: str | None = None) -> None:
        import threading

        from netbed import rate_bits

        #: an experiment: this congestion control on every connection found
        self.congestion = congestion
        #: another: this pacing cap (bytes/s) on every connection found
        self.pacing = int(rate_bits(pacing_rate) / 8) if pacing_rate else None
        self._dups: dict[str, Any] = {}  # socket inode -> a dup of it (None: not TCP)
        self.samples: list[tuple[float, list[tuple[int, ...]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> list[Any]:
        self._stop.set()
        self._thread.join()
        return [[t, rows] for t, rows in self.samples]

    def _run(self) -> None:
        import socket
        import struct

        while not self._stop.wait(TIMELINE_STEP):
            rows = []
            for sock in self._sockets():
                try:
                    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 192)
                except (OSError, ValueError):
                    continue
                # struct tcp_info: bytes_acked, bytes_received; notsent_bytes;
                # busy_time, rwnd_limited, sndbuf_limited (microseconds)
                acked, received = struct.unpack_from("<QQ", info, 120)
                (notsent,) = struct.unpack_from("<I", info, 144)
                busy, rwnd, sndbuf = struct.unpack_from("<QQQ", info, 168)
                # total_retrans (segments), rtt (us), snd_cwnd (segments)
                (retrans,) = struct.unpack_from("<I", info, 100)
                (rtt,) = struct.unpack_from("<I", info, 68)
                (cwnd,) = struct.unpack_from("<I", info, 80)
                fd = sock.fileno()
                rows.append((fd, acked, received, notsent, busy, rwnd, sndbuf, retrans, rtt, cwnd))
            self.samples.append((time.perf_counter(), rows))

    def _sockets(self) -> list[Any]:
        """Every TCP socket this process has open (gloo's too), as dups."""
        import socket

        found = {}  # by inode: a socket's duplicates (ours too) are one connection
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if not target.startswith("socket:"):
                continue
            if target not in self._dups:
                try:
                    sock = socket.fromfd(int(fd), socket.AF_INET, socket.SOCK_STREAM)
                    sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 192)
                    if self.congestion:
                        sock.setsockopt(
                            socket.IPPROTO_TCP, socket.TCP_CONGESTION, self.congestion.encode()
                        )
                    if self.pacing:
                        sock.setsockopt(socket.SOL_SOCKET, _SO_MAX_PACING_RATE, self.pacing)
                except OSError:
                    sock = None
                self._dups[target] = sock
            if self._dups[target] is not None:
                found[target] = self._dups[target]
        return list(found.values())


def timeline_summary(timelines: list[Any], marks: list[Any], rate_bits: float) -> list[str]:
    """Lines that say, per peer over the timed rounds, how busy its upload and
    download were per ``TIMELINE_STEP`` and why its upload idled.

    ``timelines[r]``: worker r's samples; ``marks[r]``: its rounds' (start,
    end). A step is idle below 80% of the link rate: "starved" if no
    connection had bytes the application handed over and TCP had not sent yet
    (``notsent``), else "TCP held" them; of those, the share of connection
    time TCP counted as limited by the receiver's window or the send buffer.
    """
    lines = []
    full = rate_bits / 8 * TIMELINE_STEP
    for rank, (samples, rounds) in enumerate(zip(timelines, marks, strict=True)):
        up_steps: list[float] = []
        down_steps: list[float] = []
        starved = held = 0
        busy = rwnd = sndbuf = 0.0
        retrans = 0
        rtts: list[int] = []  # of connections with bytes unsent, per sample
        cwnds: list[int] = []
        for (t0, rows0), (t1, rows1) in itertools.pairwise(samples):
            if not any(a <= t0 and t1 <= b for a, b in rounds):
                continue
            before = {row[0]: row for row in rows0}
            up = down = notsent = 0
            for fd, acked, received, unsent, b, r, sb, re, rtt, cwnd in rows1:
                if unsent:
                    rtts.append(rtt)
                    cwnds.append(cwnd)
                if fd in before:
                    _, acked0, received0, _, b0, r0, sb0, re0, _, _ = before[fd]
                    retrans += re - re0
                    up += max(0, acked - acked0)
                    down += max(0, received - received0)
                    busy += (b - b0) / 1e6
                    rwnd += (r - r0) / 1e6
                    sndbuf += (sb - sb0) / 1e6
                notsent += unsent
            scale = TIMELINE_STEP / max(t1 - t0, 1e-6)
            up_steps.append(up * scale / full)
            down_steps.append(down * scale / full)
            if up * scale < 0.8 * full:
                if notsent == 0:
                    starved += 1
                else:
                    held += 1
        steps = max(1, len(up_steps))
        # the last round, 50 ms a character: upload share 0-9 (9: 90% and more)
        last = [
            (
                t1,
                sum(r[1] for r in rows1)
                - sum(r[1] for r in rows0 if r[0] in {x[0] for x in rows1}),
            )
            for (t0, rows0), (t1, rows1) in itertools.pairwise(samples)
            if rounds and rounds[-1][0] <= t0 and t1 <= rounds[-1][1]
        ]
        if last:
            start = rounds[-1][0]
            bins = [0] * (int((rounds[-1][1] - start) / 0.05) + 1)
            for t, up in last:
                bins[int((t - start) / 0.05)] += up
            shares = "".join(str(min(9, int(10 * b / (5 * full)))) for b in bins)
            lines.append(f"    peer {rank} last round, upload per 50 ms (0-9): {shares}")
        lines.append(
            f"    peer {rank}: upload {statistics.mean(up_steps or [0]):5.1%} of the link,"
            f" download {statistics.mean(down_steps or [0]):5.1%}; of 10 ms steps,"
            f" {starved / steps:5.1%} idle (< 80%) with nothing unsent,"
            f" {held / steps:5.1%} idle with bytes unsent; connections busy {busy:.2f} s,"
            f" of it rwnd-limited {rwnd:.2f} s, sndbuf-limited {sndbuf:.2f} s;"
            f" {retrans} segments retransmitted; sending: median rtt"
            f" {statistics.median(rtts or [0]) / 1000:.1f} ms,"
            f" cwnd {statistics.median(cwnds or [0])} segments"
        )
    return lines


# ------------------------------------------------------------------- workers


def run_gloo(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{directory / 'gloo-store'}",
        rank=args.rank,
        world_size=args.peers,
    )
    x = torch.empty(args.size, dtype=torch.float32)
    times: list[float] = []
    cpu_times: list[float] = []
    splits: list[list[float]] = []  # per round: ``cpu_split``
    marks: list[tuple[float, float]] = []
    timeline = Timeline(args.congestion, args.pacing_rate) if args.timeline else None
    if timeline is not None:
        timeline.start()
    for _ in range(args.rounds):
        fill(x, args.rank)
        dist.barrier()
        start, cpu, split = time.perf_counter(), time.process_time(), cpu_now()
        dist.all_reduce(x)
        x.div_(args.peers)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu)
        splits.append(cpu_split(split))
        marks.append((start, start + times[-1]))
    error = max_error(x, args.peers)
    dist.barrier()
    dist.destroy_process_group()
    return {
        "times": times,
        "cpu": cpu_times,
        "cpu_split": splits,
        "error": error,
        "rss_mb": peak_rss_mb(),
        "timeline": timeline.stop() if timeline is not None else None,
        "marks": marks,
    }


def run_ours(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    import trio
    from netbed import rate_bits

    from averaging import LinkMeter
    from averaging._allreduce import AllReduceConfig, all_reduce, serve_allreduce
    from averaging._group import Group, GroupMember
    from averaging._link_meter import MIN_UNPACED
    from swarm import Identity
    from swarm._connections import ConnectionConfig, open_connections

    identities = [Identity.from_seed(bytes([r + 1]) * 32) for r in range(args.peers)]
    bandwidths = [float(b) for b in args.bandwidths.split(",")] if args.bandwidths else None
    bandwidths = bandwidths or [1.0] * args.peers
    config = AllReduceConfig(
        sender_timeout=60.0,
        reducer_timeout=120.0,
        round_timeout=600.0,
        chunk_elements=args.chunk_elements,
        window_bytes=args.window_bytes,
        min_chunks_per_part=args.min_chunks_per_part,
        lossy=args.lossy_worker,
        ring=args.ring_worker,
        upload_pacing=rate_bits(args.upload_pacing) / 8 if args.upload_pacing else None,
        auto_pacing=not args.unpaced_worker,
    )
    x = torch.empty(args.size, dtype=torch.float32)
    bounds = [args.size * i // args.split for i in range(args.split + 1)]
    pieces = list(itertools.pairwise(bounds))
    tensors = [x] if args.split == 1 else [torch.empty(b - a) for a, b in pieces]
    times: list[float] = []
    cpu_times: list[float] = []
    splits: list[list[float]] = []  # per round: ``cpu_split``
    marks: list[tuple[float, float]] = []  # (start, end) of each timed round
    timeline: Timeline | None = None
    contributors_ok = True
    held: list[float] = []  # lossy: the share of the senders' data in our result
    # --measured: per timed round, the smallest published upload over the
    # largest, and whether the parts came out equal (around the ring: it ran)
    spreads: list[float] = []
    equal_parts: list[bool] = []
    paces: list[float] = []  # per timed round: the upload pace in bytes/s, 0 if unpaced

    codec = codec_by_name(args.codec)
    hosts = args.hosts.split(",") if args.hosts else ["127.0.0.1"] * args.peers
    # The meter every averager gives its rounds, which paces them
    # (AllReduceConfig.auto_pacing) after the untimed rounds that measure, as
    # a training run's earlier rounds would. --measured: parts by the upload
    # rates the peers measured, as the averager's members publish them in
    # matchmaking (here through files).
    meter = LinkMeter(trio.current_time)
    warmup = MIN_UNPACED

    async def main() -> None:
        nonlocal contributors_ok, timeline
        net_config = ConnectionConfig(encrypt=args.encrypt)
        async with open_connections(
            identities[args.rank], host=hosts[args.rank], config=net_config
        ) as net:
            # Before anyone can enter a round: a peer that reaches round 0 first
            # must not find the others without a handler (and exclude them).
            serve_allreduce(net)
            (directory / f"port.{args.rank}.tmp").write_text(str(net.port))
            (directory / f"port.{args.rank}.tmp").rename(directory / f"port.{args.rank}")
            await trio.to_thread.run_sync(
                file_barrier, directory, "listening", args.rank, args.peers
            )
            ports = [int((directory / f"port.{r}").read_text()) for r in range(args.peers)]
            if args.timeline:
                timeline = Timeline(args.congestion, args.pacing_rate)
                timeline.start()
            for round_ in range(-warmup, args.rounds):
                fill(x, args.rank)
                if args.split > 1:
                    for t, (a, b) in zip(tensors, pieces, strict=True):
                        t.copy_(x[a:b])
                await trio.to_thread.run_sync(
                    file_barrier, directory, f"ours-{round_}", args.rank, args.peers
                )
                uploads = [0.0] * args.peers
                if args.measured and round_ >= 0:  # all written before the barrier
                    uploads = [
                        float((directory / f"upload.{round_}.{r}").read_text())
                        for r in range(args.peers)
                    ]
                members = tuple(
                    GroupMember(
                        identities[r].peer_id, hosts[r], ports[r], bandwidths[r], upload=uploads[r]
                    )
                    for r in range(args.peers)
                )
                group = Group(f"round-{round_}".encode(), members, args.rank)
                pace = config.upload_pacing or (config.auto_pacing and meter.pacing_rate()) or 0
                start, cpu, split = time.perf_counter(), time.process_time(), cpu_now()
                result = await all_reduce(
                    net, group, tensors, weight=1.0, codec=codec, config=config, meter=meter
                )
                if args.measured:  # what the next round's members publish
                    (directory / f"upload.{round_ + 1}.{args.rank}").write_text(str(meter.upload))
                if round_ < 0:
                    continue
                paces.append(pace)
                if args.measured:
                    sizes = {b - a for a, b in result.part_bounds}
                    spreads.append(min(uploads) / max(uploads))
                    equal_parts.append(max(sizes) - min(sizes) <= 1)
                times.append(time.perf_counter() - start)
                cpu_times.append(time.process_time() - cpu)
                splits.append(cpu_split(split))
                marks.append((start, start + times[-1]))
                if args.split > 1:
                    for t, (a, b) in zip(tensors, pieces, strict=True):
                        x[a:b].copy_(t)
                everyone = frozenset(range(args.peers))
                if args.lossy_worker:
                    from trainer import lost_fraction

                    held.append(1.0 - lost_fraction(result, args.peers))
                else:
                    contributors_ok &= all(
                        c == everyone for part in result.contributors for c in part
                    )
            await trio.to_thread.run_sync(file_barrier, directory, "done", args.rank, args.peers)

    trio.run(main)
    return {
        "timeline": timeline.stop() if timeline is not None else None,
        "marks": marks,
        "times": times,
        "cpu": cpu_times,
        "cpu_split": splits,
        "error": max_error(x, args.peers),
        "rss_mb": peak_rss_mb(),
        "contributors_ok": contributors_ok,
        "held": held,
        "spreads": spreads,
        "equal_parts": equal_parts,
        "paces": paces,
    }


def worker(args: argparse.Namespace) -> None:
    # The all-reduce logs only when it excludes a member: say why on stderr.
    logging.basicConfig(level=logging.WARNING, format=f"[{args.impl} {args.rank}] %(message)s")
    logging.getLogger("averaging").setLevel(logging.INFO)
    # ... but not the line every round logs (whose data is in the result)
    logging.getLogger("averaging._allreduce").addFilter(
        lambda record: "senders in every part" not in record.msg
    )
    if args.pacing_log:  # the lossy plane's rate timeline, one line per receiver report
        logging.getLogger("averaging._pacing").setLevel(logging.DEBUG)
    torch.set_num_threads(args.threads)
    directory = Path(args.dir)
    if args.profile:
        import cProfile

        profiler = cProfile.Profile(time.thread_time)  # its own thread, not the bulk threads
        profiler.enable()
    result = run_gloo(args, directory) if args.impl == "gloo" else run_ours(args, directory)
    if args.profile:
        profiler.disable()
        profiler.dump_stats(f"{args.profile}.{args.impl}.{args.rank}")
    print(json.dumps(result), flush=True)


# ------------------------------------------------------------------- driver


#: codecs by name, and how far each one's result may be from the true mean
#: (per peer: the values are up to P + sin, quantized twice)
CODECS = ("none", "float16", "uint8")
TOLERANCE = {"none": 1e-4, "float16": 1e-2, "uint8": 0.1}


def codec_by_name(name: str) -> Any:
    from averaging._codecs import FLOAT16, NONE, UINT8

    return {"none": NONE, "float16": FLOAT16, "uint8": UINT8}[name]


def wire_bytes(size: int, codec: str) -> int:
    """Payload bytes of the whole vector under ``codec`` (block scales included)."""
    return int(codec_by_name(codec).payload_size(size))


def link_bound(wire: int, up: list[float], down: list[float]) -> float:
    """Seconds the links allow an all-reduce of ``wire`` bytes per peer at least
    (rates in bit/s). In a butterfly with part sizes s_i (sum V), peer i
    uploads V - s_i + (n-1) s_i = V + (n-2) s_i bytes and downloads as many,
    so a round of T seconds needs V + (n-2) s_i <= min(up_i, down_i) T for
    every i. The best parts give T = max(2(n-1) V / sum(m), max(V / m_i)),
    m_i = min(up_i, down_i); for equal links, 2(n-1)/n V / rate."""
    n = len(up)
    m = [min(u, d) / 8 for u, d in zip(up, down, strict=True)]
    return max(2 * (n - 1) * wire / sum(m), max(wire / x for x in m))


def launch(
    args: argparse.Namespace,
    impl: str,
    encrypt: bool,
    codec: str = "none",
    bed: Any = None,
    bandwidths: list[float] | None = None,
    measured: bool = False,
    lossy: bool = False,
    ring: bool = False,
    pacing: str | None = None,
    unpaced: bool = False,
) -> dict[str, Any]:
    """Run one implementation's workers (in ``bed``'s namespaces, if given)."""
    with tempfile.TemporaryDirectory(prefix=f"allreduce-{impl}-") as tmp:
        extra = ["--codec", codec] + (["--measured"] if measured else [])
        if bed is not None:
            extra += ["--hosts", ",".join(bed.addresses)]
        if bandwidths is not None:
            extra += ["--bandwidths", ",".join(f"{b:g}" for b in bandwidths)]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0"} if bed is not None else None

        def command(rank: int, argv: list[str]) -> list[str]:
            return argv if bed is None else list(bed.exec(rank, argv))

        procs = [
            subprocess.Popen(
                command(
                    rank,
                    [
                        sys.executable,
                        os.path.abspath(__file__),
                        "--worker",
                        "--impl",
                        impl,
                        "--rank",
                        str(rank),
                        "--peers",
                        str(args.peers),
                        "--size",
                        str(args.size),
                        "--rounds",
                        str(args.rounds),
                        "--chunk-elements",
                        str(args.chunk_elements),
                        "--window-bytes",
                        str(args.window_bytes),
                        "--min-chunks-per-part",
                        str(args.min_chunks_per_part),
                        "--threads",
                        str(args.threads),
                        "--split",
                        str(args.split),
                        "--dir",
                        tmp,
                    ]
                    + extra
                    + (["--profile", args.profile] if args.profile else [])
                    + (["--timeline"] if args.timeline else [])
                    + (["--congestion", args.congestion] if args.congestion else [])
                    + (["--pacing-rate", args.pacing_rate] if args.pacing_rate else [])
                    + (["--encrypt"] if encrypt else [])
                    + (["--lossy-worker"] if lossy else [])
                    + (["--ring-worker"] if ring else [])
                    + (["--upload-pacing", pacing] if pacing else [])
                    + (["--unpaced-worker"] if unpaced else [])
                    + (["--pacing-log"] if args.pacing_log else []),
                ),
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            for rank in range(args.peers)
        ]
        outputs = []
        for proc in procs:
            out, _ = proc.communicate(timeout=3600)
            if proc.returncode != 0:
                raise SystemExit(f"{impl} worker failed with exit code {proc.returncode}")
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    per_round = [max(o["times"][i] for o in outputs) for i in range(args.rounds)]
    error = max(o["error"] for o in outputs)
    held = [min(o["held"][i] for o in outputs) for i in range(args.rounds)] if lossy else []
    # A lossy round averages what arrived: its error is what was lost, not a bug.
    if not lossy and not error <= TOLERANCE[codec] * max(1, args.peers):
        raise SystemExit(f"{impl}: result differs from the true mean by {error}")
    if not all(o.get("contributors_ok", True) for o in outputs):
        raise SystemExit(f"{impl}: some member was excluded in a fault-free run")
    cpu = statistics.median(
        statistics.mean(o["cpu"][i] for o in outputs) for i in range(args.rounds)
    )
    # each of the four parts as ``cpu`` is (so they need not add up to it exactly)
    split = [
        statistics.median(
            statistics.mean(o["cpu_split"][i][k] for o in outputs) for i in range(args.rounds)
        )
        for k in range(4)
    ]
    timeline = None
    if args.timeline:
        rate = rate_of(args)
        timeline = timeline_summary(
            [o["timeline"] for o in outputs], [o["marks"] for o in outputs], rate
        )
    return {
        "timeline": timeline,
        "cpu_s": cpu,
        "cpu_split_s": split,
        "median_s": statistics.median(per_round),
        "rounds_s": per_round,
        "rss_mb": max(o["rss_mb"] for o in outputs),
        "error": error,
        "held": held,
        # --measured (the same in every worker: every member cuts the same parts)
        "spreads": outputs[0].get("spreads") or [],
        "equal_parts": outputs[0].get("equal_parts") or [],
        # per round, the smallest and largest upload pace of the peers (0: unpaced)
        "paces": [
            (min(o["paces"][i] for o in outputs), max(o["paces"][i] for o in outputs))
            for i in range(args.rounds)
        ]
        if impl == "ours"
        else [],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--size", type=int, default=25_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--chunk-elements",
        type=int,
        default=None,
        help="elements per all-reduce chunk (default: AllReduceConfig's)",
    )
    parser.add_argument("--window-bytes", type=int, default=None, help="default: AllReduceConfig's")
    parser.add_argument(
        "--min-chunks-per-part", type=int, default=None, help="default: AllReduceConfig's"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per peer")
    parser.add_argument(
        "--split", type=int, default=1, help="our all-reduce gets the vector as N tensors"
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--plain-only", action="store_true", help="skip the encrypted run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--impl", choices=["ours", "gloo"], help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--encrypt", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument(
        "--profile", help="write cProfile stats of each worker to PROFILE.IMPL.RANK"
    )
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="sample every connection each 10 ms; say how busy uploads were and why not",
    )
    parser.add_argument(
        "--congestion", help="with --timeline: set this TCP congestion control on every connection"
    )
    parser.add_argument(
        "--pacing-rate",
        help="with --timeline: cap every connection's pacing (SO_MAX_PACING_RATE), e.g. 98mbit",
    )
    parser.add_argument("--link-rate", help="emulated links: tc rate each way, e.g. 100mbit")
    parser.add_argument("--loss", type=float, default=0.0, help="with --link-rate: loss rate")
    parser.add_argument("--slow-peer", help="with --link-rate: peer 0's upload rate")
    parser.add_argument(
        "--lossy", action="store_true", help="with --link-rate: add the lossy data plane"
    )
    parser.add_argument("--lossy-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--ring",
        action="store_true",
        help="also run ours around the ring (AllReduceConfig.ring)",
    )
    parser.add_argument("--ring-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--upload-pacing",
        help="with --link-rate: run ours once more (plaintext, encrypted, each codec; the ring,"
        " with --ring) with AllReduceConfig.upload_pacing at this rate, e.g. 97mbit",
    )
    parser.add_argument(
        "--pacing-log",
        action="store_true",
        help="with --lossy: log each receiver report and the send rate it set (stderr)",
    )
    parser.add_argument(
        "--compare-chunks",
        type=lambda text: [int(x) for x in text.split(",")],
        default=[],
        help="with --link-rate: also run ours (plaintext) with each min_chunks_per_part",
    )
    parser.add_argument(
        "--codecs",
        default=",".join(CODECS),
        help="with --link-rate: our codecs to run (comma-separated: none,float16,uint8)",
    )
    parser.add_argument(
        "--bed-label",
        default="",
        help="with --link-rate: a label in the bed's namespace names (whose they are)",
    )
    parser.add_argument("--codec", default="none", choices=CODECS, help=argparse.SUPPRESS)
    parser.add_argument("--hosts", help=argparse.SUPPRESS)
    parser.add_argument("--bandwidths", help=argparse.SUPPRESS)
    parser.add_argument("--measured", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--compare-unpaced",
        action="store_true",
        help="also run each of ours with AllReduceConfig(auto_pacing=False), each right after"
        " its default (automatically paced) run",
    )
    parser.add_argument("--unpaced-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    from averaging import AllReduceConfig

    defaults = AllReduceConfig()
    for name in ("chunk_elements", "window_bytes", "min_chunks_per_part"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(defaults, name))
    if args.worker:
        worker(args)
        return
    if args.peers < 2 or args.size < 1 or args.rounds < 1 or not 1 <= args.split <= args.size:
        parser.error("need --peers >= 2, --size >= 1, --rounds >= 1, 1 <= --split <= --size")
    if args.link_rate:
        link_main(args)
        return
    gloo = launch(args, "gloo", False)
    plain = launch(args, "ours", False)
    unpaced = launch(args, "ours", False, unpaced=True) if args.compare_unpaced else None
    encrypted = plain if args.plain_only else launch(args, "ours", True)
    ring_plain = launch(args, "ours", False, ring=True) if args.ring else None
    ring_encrypted = (
        launch(args, "ours", True, ring=True) if args.ring and not args.plain_only else None
    )
    vector_mb = args.size * 4 / 2**20
    report = {
        "ours_s": encrypted["median_s"],
        "gloo_s": gloo["median_s"],
        "ratio": encrypted["median_s"] / gloo["median_s"],
        "ours_plain_s": plain["median_s"],
        "ratio_plain": plain["median_s"] / gloo["median_s"],
        "peak_rss_mb": max(encrypted["rss_mb"], plain["rss_mb"]),
        "ours_cpu_s": encrypted["cpu_s"],
        "ours_plain_cpu_s": plain["cpu_s"],
        "gloo_cpu_s": gloo["cpu_s"],
        "ours_cpu_split_s": encrypted["cpu_split_s"],
        "ours_plain_cpu_split_s": plain["cpu_split_s"],
        "gloo_cpu_split_s": gloo["cpu_split_s"],
        "peak_rss_plain_mb": plain["rss_mb"],
        "gloo_peak_rss_mb": gloo["rss_mb"],
        "vector_mb": vector_mb,
        "peers": args.peers,
        "size": args.size,
        "rounds": args.rounds,
        "split": args.split,
    }
    if unpaced is not None:
        report["ours_plain_unpaced_s"] = unpaced["median_s"]
        report["ratio_plain_unpaced"] = unpaced["median_s"] / gloo["median_s"]
    for name, run in (("ring_plain", ring_plain), ("ring", ring_encrypted)):
        if run is not None:
            report[f"{name}_s"] = run["median_s"]
            report[f"ratio_{name}"] = run["median_s"] / gloo["median_s"]
            report[f"{name}_cpu_s"] = run["cpu_s"]
            report[f"{name}_cpu_split_s"] = run["cpu_split_s"]
    if args.json:
        print(json.dumps(report))
        return
    print(
        f"all-reduce of {args.size:,} float32 ({vector_mb:.1f} MiB) over {args.peers} peers,"
        f" median of {args.rounds} rounds (slowest peer per round)"
        + (f"; ours gets it as {args.split} tensors" if args.split > 1 else "")
    )
    print(
        f"  gloo               {gloo['median_s']:8.3f} s   peak RSS {gloo['rss_mb']:7.1f} MiB"
        f"   CPU/peer {gloo['cpu_s']:.3f} s"
    )
    print(split_line(gloo["cpu_split_s"], "its caller", "gloo's"))

    def ours(label: str, run: dict[str, Any], note: str) -> None:
        """One row of ours (the time right-aligned to the gloo row's column)
        and its CPU by thread."""
        name = f"ours, {label}"
        print(
            f"  {name}{run['median_s']:{27 - len(name)}.3f} s   peak RSS {run['rss_mb']:7.1f} MiB"
            f"   CPU/peer {run['cpu_s']:.3f} s   ratio {run['median_s'] / gloo['median_s']:.2f}"
            f" ({note})"
        )
        print(split_line(run["cpu_split_s"], "trio's", "bulk I/O"))

    ours("plaintext", plain, "target <= 1.2")
    if any(high for _, high in plain["paces"]):
        paces = ", ".join(f"{high * 8e-9:.2f}" if high else "unpaced" for _, high in plain["paces"])
        print(f"    paced per round (Gbit/s, fastest peer): {paces}")
    if unpaced is not None:
        ours("unpaced", unpaced, "auto_pacing=False")
    if not args.plain_only:
        ours("encrypted", encrypted, "target <= 1.6")
    for label, run, target in (
        ("ring, plaintext", ring_plain, 1.2),
        ("ring, encrypted", ring_encrypted, 1.6),
    ):
        if run is not None:
            ours(label, run, f"target <= {target}")
    budget = gloo["rss_mb"] + vector_mb
    print(
        f"  RSS budget (gloo + one vector) {budget:.1f} MiB:"
        f" {'met' if report['peak_rss_mb'] <= budget else 'EXCEEDED'}"
    )
    assert math.isfinite(report["ratio"])


def split_line(split: list[float], caller: str, others: str) -> str:
    """The CPU of a peer's round by thread (``cpu_split``), as one line."""
    thread_user, thread_sys, other_user, other_sys = split
    return (
        f"      CPU/peer by thread: {caller} {thread_user:.3f} s user + {thread_sys:.3f} s sys,"
        f" {others} threads {other_user:.3f} s user + {other_sys:.3f} s sys"
    )


def rate_of(args: argparse.Namespace) -> float:
    """The link rate in bit/s the timeline compares with (loopback: 10 Gbit/s)."""
    if not args.link_rate:
        return 10e9
    from netbed import rate_bits

    return rate_bits(args.link_rate)


def link_main(args: argparse.Namespace) -> None:
    """``--link-rate``: gloo and ours on one bed of emulated links (module docstring)."""
    from netbed import Link, NetBed, rate_bits

    rate = rate_bits(args.link_rate)
    codecs = args.codecs.split(",")
    if not set(codecs) <= set(CODECS) or not 0 <= args.loss < 1:
        raise SystemExit(f"--codecs must name some of {CODECS}; --loss must be in [0, 1)")
    links = [Link(args.link_rate, args.link_rate) for _ in range(args.peers)]
    if args.slow_peer:
        links[0] = Link(args.slow_peer, args.link_rate)
    up = [rate_bits(link.up or args.link_rate) for link in links]
    down = [rate] * args.peers
    rows: list[tuple[str, dict[str, Any], float]] = []
    if args.lossy and "none" not in codecs:
        raise SystemExit("--lossy sends raw float32: --codecs must include none")
    with NetBed(links, label=args.bed_label) as bed:
        congestion = subprocess.run(
            bed.exec(0, ["cat", "/proc/sys/net/ipv4/tcp_congestion_control"]),
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        if args.loss:
            for peer in range(args.peers):
                bed.drop_arriving(peer, args.loss)
        runs: list[tuple[str, str, bool, str, list[float] | None, bool]] = [
            ("gloo (float32)", "gloo", False, "none", None, False)
        ]
        for codec in codecs:
            runs.append((f"ours, plaintext, {codec}", "ours", False, codec, None, False))
        if "none" in codecs and not args.plain_only:
            runs.insert(2, ("ours, encrypted, none", "ours", True, "none", None, False))
        if args.slow_peer:
            # what part sizes in proportion to the links would give, and what
            # the rates the peers measured give (after one round to measure)
            runs.append(("ours, parts by link rate", "ours", False, "none", up, False))
            runs.append(("ours, parts by measured rate", "ours", False, "none", None, True))
        for name, impl, encrypt, codec, bandwidths, measured in runs:
            # --compare-unpaced: each of ours as before automatic pacing, right after it
            for unpaced in (False, True) if impl == "ours" and args.compare_unpaced else (False,):
                result = launch(
                    args, impl, encrypt, codec, bed, bandwidths, measured, unpaced=unpaced
                )
                bound = link_bound(wire_bytes(args.size, codec), up, down)
                rows.append((name + (", unpaced" if unpaced else ""), result, bound))
        for chunks in args.compare_chunks:
            # the same run with parts cut into at least this many chunks
            variant = argparse.Namespace(**{**vars(args), "min_chunks_per_part": chunks})
            result = launch(variant, "ours", False, "none", bed)
            bound = link_bound(wire_bytes(args.size, "none"), up, down)
            rows.append((f"ours, plaintext, {chunks} chunks/part", result, bound))
        if args.ring:
            # interleaved with the butterfly's rows above: the same bed, the same minute
            for encrypt in (False,) if args.plain_only else (False, True):
                result = launch(args, "ours", encrypt, "none", bed, ring=True)
                bound = link_bound(wire_bytes(args.size, "none"), up, down)
                kind = "encrypted" if encrypt else "plaintext"
                rows.append((f"ours, ring, {kind}, none", result, bound))
            # the ring with parts by the uploads the peers measured (after one
            # round to measure): equal parts, and the ring, where they are alike
            result = launch(args, "ours", False, "none", bed, measured=True, ring=True)
            bound = link_bound(wire_bytes(args.size, "none"), up, down)
            rows.append(("ours, ring, parts by measured rate", result, bound))
        if args.upload_pacing:
            # the runs above once more, each uplink's streams paced at their
            # shares of the rate: plaintext and encrypted, each codec, the ring
            encryptions = (False,) if args.plain_only else (False, True)
            paced = [(False, codec, False) for codec in codecs]
            if "none" in codecs and not args.plain_only:
                paced.insert(1, (True, "none", False))
            if args.ring:
                paced += [(encrypt, "none", True) for encrypt in encryptions]
            for encrypt, codec, ring in paced:
                result = launch(
                    args, "ours", encrypt, codec, bed, ring=ring, pacing=args.upload_pacing
                )
                bound = link_bound(wire_bytes(args.size, codec), up, down)
                name = ("ring, " if ring else "") + ("encrypted" if encrypt else "plaintext")
                rows.append((f"ours, {name}, {codec}, paced", result, bound))
        if args.lossy:
            result = launch(args, "ours", True, "none", bed, None, lossy=True)
            rows.append(("ours, lossy datagrams", result, link_bound(4 * args.size, up, down)))
    print(
        f"all-reduce of {args.size:,} float32 over {args.peers} peers on emulated links:"
        f" {args.link_rate} each way"
        + (f", peer 0 uploads at {args.slow_peer}" if args.slow_peer else "")
        + (f", {args.loss:.1%} loss" if args.loss else "")
        + f"; congestion control {args.congestion or congestion}"
        + (" (set on every connection)" if args.congestion else "")
        + (f", pacing capped at {args.pacing_rate}" if args.pacing_rate else "")
        + f"; median of {args.rounds} rounds"
    )
    width = max(len(name) for name, _, _ in rows)
    print(f"  {'':{width}} {'time':>8} {'bound':>8} {'share':>6} {'CPU/peer':>9}")
    for name, result, bound in rows:
        held = result.get("held") or []
        per_round = ", ".join(
            f"{t:.2f}s/{h:.1%}"
            for t, h in zip(result["rounds_s"], held or result["rounds_s"], strict=True)
        )
        print(
            f"  {name:{width}} {result['median_s']:7.2f}s {bound:7.2f}s"
            f" {bound / result['median_s']:6.1%} {result['cpu_s']:8.3f}s"
            + (f"   held {statistics.median(held):.1%} (rounds: {per_round})" if held else "")
        )
        threads = ("its caller", "gloo's") if name.startswith("gloo") else ("trio's", "bulk I/O")
        print(split_line(result["cpu_split_s"], *threads))
        if any(high for _, high in result.get("paces") or []):
            paces = ", ".join(
                f"{low * 8e-6:.1f}-{high * 8e-6:.1f}" if high else "unpaced"
                for low, high in result["paces"]
            )
            print(f"  {'':{width}} paced per round (Mbit/s, peers' range): {paces}")
        if result.get("spreads"):
            spreads = ", ".join(f"{x:.3f}" for x in result["spreads"])
            equal = sum(result["equal_parts"])
            print(
                f"  {'':{width}} slowest/fastest measured upload per round: {spreads};"
                f" equal parts in {equal} of {len(result['equal_parts'])} rounds"
            )
        for line in result.get("timeline") or []:
            print(line)
    if args.json:
        print(json.dumps([{"run": n, "bound_s": b, **r} for n, r, b in rows]))


if __name__ == "__main__":
    main()
