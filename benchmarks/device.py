"""Device benchmark: plain local PyTorch training vs. Swarm on the same device.

Both train the same model on the same global batch (``--accumulation``
micro-batches of ``--batch-size``): plain PyTorch accumulates the gradients
and steps; Swarm's ``CollaborativeOptimizer`` with ``target_batch_size`` equal
to that batch takes one global step per batch (one peer: no averaging; with
``--peers N``, N peers in one process on the same device average every step).
Each mode runs in its own process, so the peaks are its own. Reported: wall
time per global step (after ``--warmup`` steps), peak device memory (CUDA),
peak RSS, and where the optimizer keeps what it holds besides the model's
parameters (its state, and any float32 master copies), by device. With
``--offload-optimizer`` Swarm keeps those on the host (``offload_optimizer``):
on CUDA the peak device memory drops by them, and on any device the last
column shows them moved to the CPU.

    python benchmarks/device.py                           # CPU-sized, digits-cnn
    python benchmarks/device.py --device cuda --task lm-25m --dtype bf16 --steps 20
    python benchmarks/device.py --peers 2
    python benchmarks/device.py --device cuda --task lm-25m --offload-optimizer

Targets (issue 16): a 1-peer Swarm step within 5% of plain training's time;
device memory at most plain training's plus one float32 copy of the parameters,
and below plain training's with the optimizer offloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from typing import Any

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _task(name: str) -> Any:
    from trainer import load_task

    if name.startswith("lm-"):
        import runpy

        example = runpy.run_path(
            os.path.join(os.path.dirname(__file__), "..", "examples", "tiny_lm.py")
        )
        shapes = {
            "lm-small": dict(embed=128, heads=4, layers=2, context=64, vocab=1024),
            "lm-25m": dict(embed=512, heads=8, layers=8, context=256, vocab=8192),
            "lm-50m": dict(embed=640, heads=10, layers=10, context=256, vocab=16384),
        }
        return example["make_generated_task"](**shapes[name])
    return load_task(name)


def _device(name: str) -> Any:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _worker(args: argparse.Namespace) -> None:
    """One mode in this process; prints one JSON line."""
    import torch

    torch.manual_seed(0)
    device = _device(args.device)
    dtype = getattr(torch, DTYPES[args.dtype])
    task = _task(args.task)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if args.threads:
        torch.set_num_threads(args.threads)
    times: list[float] = []
    held: dict[str, int] = {}
    if args.mode == "plain":
        # In a thread like Swarm's training loop: torch's CPU thread pool
        # behaves differently in the main thread (measured: 2.8 s vs 0.05 s
        # per step on a loaded 2-core machine), which would skew the comparison.
        thread = threading.Thread(target=_plain, args=(args, task, device, dtype, times, held))
        thread.start()
        thread.join()
    else:
        times = _swarm(args, task, device, dtype, held)
    measured = times[args.warmup :]
    peak_device = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    print(
        json.dumps(
            {
                "mode": args.mode,
                "device": str(device)
                + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
                "step_s": sorted(measured)[len(measured) // 2],
                "peak_device_bytes": peak_device,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "optimizer_bytes": held,
            }
        ),
        flush=True,
    )


def _optimizer_bytes(optimizer: Any, model: Any) -> dict[str, int]:
    """Bytes the optimizer holds besides the model's own parameters (its state,
    and master copies it updates in their place), by device."""
    own = {id(p) for p in model.parameters()}
    held: dict[str, int] = {}
    tensors = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in own]
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if hasattr(v, "untyped_storage") and v.dim()]
    for t in tensors:
        key = str(t.device)
        held[key] = held.get(key, 0) + t.numel() * t.element_size()
    return held


def _plain(
    args: argparse.Namespace,
    task: Any,
    device: Any,
    dtype: Any,
    times: list[float],
    held: dict[str, int],
) -> None:
    import torch

    model, optimizer, _ = task.build(seed=0, device=device, dtype=dtype)
    batches = task.batches(0, args.batch_size)
    for _ in range(args.warmup + args.steps):
        started = time.perf_counter()
        for _ in range(args.accumulation):
            loss, _ = task.loss(model, next(batches))
            (loss / args.accumulation).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    held.update(_optimizer_bytes(optimizer, model))
    held["params_float32"] = 4 * sum(p.numel() for p in model.parameters())


def _swarm(
    args: argparse.Namespace, task: Any, device: Any, dtype: Any, held: dict[str, int]
) -> list[float]:
    import torch

    from averaging import AllReduceConfig, AveragerConfig, MatchmakingConfig
    from dht import DHTConfig
    from swarm import Identity, Peer, PeerConfig
    from trainer import CollaborativeConfig, CollaborativeOptimizer

    config = CollaborativeConfig(
        averaging=AveragerConfig(
            matchmaking=MatchmakingConfig(
                target_group_size=16, matchmaking_time=2.0, request_timeout=1.0, poll_interval=0.1
            ),
            allreduce=AllReduceConfig(sender_timeout=5.0, reducer_timeout=10.0, round_timeout=30.0),
        ),
        averaging_timeout=40.0,
        progress_interval=0.2,
        progress_ttl=10.0,
        state_averaging_interval=0,
        offload_optimizer=args.offload_optimizer,
    )
    target = args.batch_size * args.accumulation * args.peers
    times: dict[int, list[float]] = {}
    errors: list[BaseException] = []
    peers: list[Peer] = []
    try:
        for i in range(args.peers):
            initial = (peers[0].address,) if peers else ()
            peer_config = PeerConfig(initial_peers=initial, dht=DHTConfig(rpc_timeout=1.0))
            peers.append(Peer(Identity.from_seed(bytes([i + 1]) * 32), peer_config).__enter__())

        def run(i: int) -> None:
            try:
                model, inner, _ = task.build(seed=0, device=device, dtype=dtype)
                opt = CollaborativeOptimizer(
                    peers[i],
                    run_id="device-bench",
                    model=model,
                    optimizer=inner,
                    target_batch_size=target,
                    batch_size_per_step=args.batch_size,
                    config=config,
                )
                mine = times.setdefault(i, [])
                with opt:
                    opt.wait_for_peers(args.peers, 60.0)
                    batches = task.batches(i, args.batch_size)
                    started = time.perf_counter()
                    for _ in range(100 * (args.warmup + args.steps) * args.accumulation):
                        if opt.epoch >= args.warmup + args.steps:
                            break
                        loss, _ = task.loss(model, next(batches))
                        loss.backward()
                        if opt.step(loss=loss.detach()):
                            if device.type == "cuda":
                                torch.cuda.synchronize(device)
                            now = time.perf_counter()
                            mine.append(now - started)
                            started = now
                        opt.zero_grad(set_to_none=True)
                    if i == 0:
                        held.update(_optimizer_bytes(inner, model))
            except BaseException as e:  # reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(args.peers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for peer in reversed(peers):
            peer.__exit__(None, None, None)
    if errors:
        raise errors[0]
    return times[0]


def _median_launch(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The launch with the median time per step (its peaks with it)."""
    return sorted(results, key=lambda r: float(r["step_s"]))[len(results) // 2]


def _run(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, os.path.abspath(__file__), "--worker", "--mode", mode]
    keys = ("device", "task", "dtype", "steps", "warmup", "batch_size", "accumulation", "threads")
    for key in keys:
        command += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    command += ["--peers", str(args.peers)]
    if args.offload_optimizer:
        command.append("--offload-optimizer")
    out = subprocess.run(command, check=True, capture_output=True, text=True, timeout=1800)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto|cpu|cuda[:N]|mps")
    parser.add_argument(
        "--task", default="digits-cnn", help="digits|digits-cnn|lm-small|lm-25m|lm-50m"
    )
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--steps", type=int, default=10, help="global steps measured")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--peers", type=int, default=1, help="Swarm peers on the device")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument(
        "--offload-optimizer",
        action="store_true",
        help="Swarm keeps the optimizer's state and float32 masters on the host",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="launches of each mode, alternating; each one's median step counts "
        "(plain training alone varied 94-128 ms per step between launches on an H100)",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["plain", "swarm"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    launches: dict[str, list[dict[str, Any]]] = {"plain": [], "swarm": []}
    for _ in range(args.repeat):
        for mode, results in launches.items():
            results.append(_run(mode, args))
    plain, swarm = _median_launch(launches["plain"]), _median_launch(launches["swarm"])
    if args.json:
        print(json.dumps({"plain": plain, "swarm": swarm}))
        return
    print(
        f"device {plain['device']}, task {args.task} ({args.dtype}), global batch "
        f"{args.batch_size}x{args.accumulation} per peer, {args.peers} Swarm peer(s)"
        f"{' with the optimizer offloaded' if args.offload_optimizer else ''}, "
        f"median of {args.steps} steps"
        + (f", median of {args.repeat} launches per mode" if args.repeat > 1 else "")
    )
    print(
        f"{'':>6}  {'s/step':>8}  {'peak device MiB':>15}  {'peak RSS MiB':>12}  "
        "optimizer state + masters MiB"
    )
    for name, r in (("plain", plain), ("swarm", swarm)):
        peak = r["peak_device_bytes"]
        device_mib = "-" if peak is None else f"{peak / 2**20:.0f}"
        rss_mib = r["peak_rss_bytes"] / 2**20
        held = ", ".join(
            f"{size / 2**20:.1f} on {where}"
            for where, size in sorted(r["optimizer_bytes"].items())
            if where != "params_float32"
        )
        print(f"{name:>6}  {r['step_s']:>8.4f}  {device_mib:>15}  {rss_mib:>12.0f}  {held or '-'}")
    ratio = swarm["step_s"] / plain["step_s"]
    if args.peers > 1:  # they average over the network: no target against plain training
        print(f"swarm/plain time per step: {ratio:.3f} ({args.peers} peers averaging)")
        return
    verdict = "PASS" if ratio <= 1.05 else "MISS"
    print(f"{verdict}  swarm/plain time per step: {ratio:.3f} (target <= 1.05 with one peer)")
    if plain["peak_device_bytes"] is not None:
        extra = swarm["peak_device_bytes"] - plain["peak_device_bytes"]
        one_copy = plain["optimizer_bytes"]["params_float32"]
        if args.offload_optimizer:
            verdict, target = "PASS" if extra < 0 else "MISS", "< 0: the optimizer offloaded"
        else:
            verdict = "PASS" if extra <= one_copy else "MISS"
            target = f"<= one float32 copy of the parameters, {one_copy / 2**20:.0f} MiB"
        print(
            f"{verdict}  swarm's peak device memory minus plain's: {extra / 2**20:+.0f} MiB "
            f"(target {target})"
        )


if __name__ == "__main__":
    main()
