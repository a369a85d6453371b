"""``redsrv soak``: train through a local fleet for a while under injected faults and count
what happened.

Workers run rounds of all-reduces with mixed sizes and check every sum against a reference
they compute themselves. Meanwhile the driver kills and restarts reducers, stops them with
SIGTERM and restarts them, freezes a reducer for ``--reducer-freeze`` seconds, freezes a worker
for a few seconds, and lets a rogue client send garbage. Workers ride through lost reducers
(RELIABILITY R22). It reports steps completed, steps that failed with a clear error, hangs (must
be 0), wrong sums (must be 0), the time from each fault to the end of its round (median, max), and
reducer memory.

``--framework torch`` trains with PyTorch DDP and the redsrv comm hook instead, checks every
gradient bit for bit against a local recomputation, and injects reducer faults every
``--fault-interval`` seconds on average (``redsrv.cli.soak_ddp``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from redsrv.cli.fleet import readline_within, start_reducers, stop_processes

#: Element counts the workers cycle through (4 KiB .. 4 MiB of float32).
SIZES = (1024, 16_384, 262_144, 1_048_576)


def soak_input(seed: int, rank: int, size: int) -> np.ndarray:
    """Small integers in float32: every sum is exact, so any misplaced or stale element shows."""
    index = np.arange(size, dtype=np.int64)
    return ((index * 31 + rank * 17 + seed) % 1021).astype(np.float32)


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("soak", help="train under random faults and report hangs, wrong sums and memory growth",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=60.0, help="seconds to run (default 60)")
    p.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    p.add_argument("--reducers", type=int, default=2, help="reducer processes (default 2)")
    p.add_argument("--steps-per-round", type=int, default=20, help="steps between synchronisation points (default 20)")
    p.add_argument("--fault-probability", type=float, default=0.3, help="chance that a round gets a fault (default 0.3)")
    p.add_argument("--reducer-freeze", type=float, default=5.0, help="seconds a frozen reducer stays stopped (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the report to this file")
    p.add_argument("--framework", choices=["numpy", "torch"], default="numpy",
                   help="numpy: rounds of all-reduces (default); torch: DDP training with the redsrv hook")
    p.add_argument("--fault-interval", type=float, default=20.0,
                   help="torch: mean seconds between reducer faults, each uniform(0.5, 1.5) x this after the last (default 20)")
    p.add_argument("--log-dir", help="torch: where the workers' logs go (default: a new temporary folder)")
    p.set_defaults(func=_run)


def _run(a: argparse.Namespace) -> int:
    if a.framework == "torch":
        from redsrv.cli.soak_ddp import run_ddp_soak

        return run_ddp_soak(duration=a.duration, workers=a.workers, reducers=a.reducers, fault_interval=a.fault_interval,
                            reducer_freeze=a.reducer_freeze, seed=a.seed, json_path=a.json, log_dir=a.log_dir)
    return run_soak(duration=a.duration, workers=a.workers, reducers=a.reducers, steps_per_round=a.steps_per_round,
                    fault_probability=a.fault_probability, seed=a.seed, json_path=a.json, reducer_freeze=a.reducer_freeze)


#: Shrunk liveness settings so that faults are detected in about a second.
SOAK_ENV = {"REDSRV_HEARTBEAT_INTERVAL": "0.2", "REDSRV_HEARTBEAT_MISSES": "5", "REDSRV_OP_TIMEOUT": "10",
            "REDSRV_CONNECT_TIMEOUT": "15", "REDSRV_CLOSE_TIMEOUT": "3"}
#: A worker that has not finished its round this long after the round's last fault has hung.
HANG_AFTER_S = 45.0


@dataclass
class _Totals:
    rounds: int = 0
    steps_completed: int = 0
    steps_failed: int = 0
    hangs: int = 0
    wrong_sums: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    rss_mib: dict[str, list[float]] = field(default_factory=dict)
    recovery_s: dict[str, list[float]] = field(default_factory=dict)  # fault -> seconds from it to its round's end


def _rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def run_soak(*, duration: float, workers: int, reducers: int, steps_per_round: int, fault_probability: float,
             seed: int, json_path: str | None, reducer_freeze: float = 5.0) -> int:
    rng = random.Random(seed)
    env = {**os.environ, **SOAK_ENV}
    fleet = start_reducers(reducers, env=env)
    ports = [int(a.rsplit(":", 1)[1]) for a in fleet.addresses]
    worker_procs = [subprocess.Popen([sys.executable, "-m", "redsrv.cli.soak", "worker", str(r), str(workers),
                                      ",".join(fleet.addresses)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env) for r in range(workers)]
    totals = _Totals()
    rogue_stop = threading.Event()
    rogue = threading.Thread(target=_rogue_client, args=(fleet.addresses, rogue_stop, rng.random()), daemon=True)
    rogue.start()
    started = time.monotonic()
    print(f"redsrv soak: {workers} workers, {reducers} reducers, {duration:.0f}s, seed {seed}", flush=True)
    try:
        while time.monotonic() - started < duration:
            round_id = totals.rounds
            totals.rounds += 1
            for p in worker_procs:
                assert p.stdin is not None
                p.stdin.write(json.dumps({"round": round_id, "steps": steps_per_round}) + "\n")
                p.stdin.flush()
            kinds = ["kill_reducer", "freeze_reducer", "freeze_worker", "term_reducer"]
            fault = rng.choice(kinds) if rng.random() < fault_probability else None
            last_fault = fault_at = time.monotonic()
            if fault:
                time.sleep(rng.uniform(0.05, 0.5))
                totals.faults[fault] = totals.faults.get(fault, 0) + 1
                fault_at = time.monotonic()
                last_fault = _inject(fault, rng, fleet, ports, worker_procs, env, totals, reducer_freeze)
            replies = _collect(worker_procs, last_fault + HANG_AFTER_S)
            if fault:
                totals.recovery_s.setdefault(fault, []).append(time.monotonic() - fault_at)
            for reply in replies:
                if reply is None:
                    totals.hangs += 1
                    continue
                totals.steps_completed += reply["completed"]
                totals.wrong_sums += reply["wrong"]
                if reply["error"]:
                    totals.steps_failed += 1
                    totals.errors[reply["error"]] = totals.errors.get(reply["error"], 0) + 1
            if any(r is None for r in replies):
                print("redsrv soak: a worker hung; stopping", flush=True)
                break
            for i, p in enumerate(fleet.procs):
                totals.rss_mib.setdefault(fleet.addresses[i], []).append(_rss_mib(p.pid))
            elapsed = time.monotonic() - started
            print(f"  {elapsed:6.0f}s round {round_id:4d}: steps {totals.steps_completed // workers:6d} "
                  f"failed {totals.steps_failed:4d} hangs {totals.hangs} wrong {totals.wrong_sums}"
                  + (f"  [{fault}]" if fault else ""), flush=True)
    finally:
        rogue_stop.set()
        for p in worker_procs:
            if p.stdin is not None and p.poll() is None:
                try:
                    p.stdin.close()
                except OSError:
                    pass
        stop_processes(worker_procs, timeout=10)
        stop_processes(fleet.procs)
        rogue.join(5)
    growth = {a: (max(v[len(v) // 4 :]) - v[len(v) // 4]) if len(v) > 4 else 0.0 for a, v in totals.rss_mib.items()}
    recovery = {f: {"median_s": statistics.median(v), "max_s": max(v)} for f, v in totals.recovery_s.items()}
    report = {"duration_s": time.monotonic() - started, "rounds": totals.rounds, "workers": workers, "reducers": reducers,
              "steps_completed": totals.steps_completed // workers, "worker_steps_failed": totals.steps_failed,
              "hangs": totals.hangs, "wrong_sums": totals.wrong_sums, "faults": totals.faults, "errors": totals.errors,
              "round_end_after_fault": recovery, "reducer_rss_growth_mib": growth,
              "reducer_rss_last_mib": {a: v[-1] for a, v in totals.rss_mib.items() if v}}
    print(f"redsrv soak: {report['steps_completed']} steps completed, {totals.steps_failed} worker steps failed with a "
          f"clear error, {totals.hangs} hangs, {totals.wrong_sums} wrong sums; faults {totals.faults}; errors {totals.errors}; "
          f"reducer RSS growth after warm-up (MiB) {', '.join(f'{v:.1f}' for v in growth.values())}")
    for f, r in recovery.items():
        print(f"  {f}: its round ended {r['median_s']:.1f}s (median), {r['max_s']:.1f}s (max) after the fault")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if totals.hangs == 0 and totals.wrong_sums == 0 and not totals.faults.get("reducer_did_not_exit") else 1


def _inject(fault: str, rng: random.Random, fleet, ports: list[int], worker_procs: list, env: dict,  # type: ignore[no-untyped-def,type-arg]
            totals: _Totals, reducer_freeze: float) -> float:
    if fault in ("kill_reducer", "term_reducer"):
        i = rng.randrange(len(fleet.procs))
        proc = fleet.procs[i]
        proc.send_signal(signal.SIGKILL if fault == "kill_reducer" else signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:  # a reducer that does not stop is a finding, not a crash
            totals.faults["reducer_did_not_exit"] = totals.faults.get("reducer_did_not_exit", 0) + 1
            proc.kill()
            proc.wait(5)
        fleet.procs[i] = _restart_reducer(ports[i], env)
    elif fault == "freeze_reducer":
        proc = rng.choice(fleet.procs)
        proc.send_signal(signal.SIGSTOP)
        time.sleep(reducer_freeze)  # the length of the freeze
        proc.send_signal(signal.SIGCONT)
    else:
        victim = rng.choice(worker_procs)
        victim.send_signal(signal.SIGSTOP)
        time.sleep(rng.uniform(1.5, 3.0))
        victim.send_signal(signal.SIGCONT)
    return time.monotonic()


def _restart_reducer(port: int, env: dict, log_level: str = "error") -> subprocess.Popen:  # type: ignore[type-arg]
    deadline = time.monotonic() + 20
    while True:
        proc = subprocess.Popen([sys.executable, "-m", "redsrv", "reducer", "--host", "127.0.0.1", "--port", str(port),
                                 "--log-level", log_level], stdout=subprocess.PIPE, text=True, env=env)
        if "listening" in readline_within(proc, 20.0):
            return proc
        proc.wait(5)
        if time.monotonic() > deadline:
            raise RuntimeError(f"could not restart the reducer on port {port}")
        time.sleep(0.2)


def _collect(worker_procs: list, deadline: float) -> list[dict | None]:  # type: ignore[type-arg]
    replies: list[dict | None] = [None] * len(worker_procs)  # type: ignore[type-arg]
    threads = []

    def read(i: int) -> None:
        line = worker_procs[i].stdout.readline()
        if line:
            replies[i] = json.loads(line)

    for i in range(len(worker_procs)):
        t = threading.Thread(target=read, args=(i,), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join(max(0.1, deadline - time.monotonic()))
    return replies


def _rogue_client(addresses: list[str], stop: threading.Event, seed: float) -> None:
    """Connects now and then and sends bytes that are not a valid frame."""
    rng = random.Random(seed)
    while not stop.wait(rng.uniform(0.5, 2.0)):
        host, port = rng.choice(addresses).rsplit(":", 1)
        try:
            with socket.create_connection((host, int(port)), timeout=2) as s:
                s.sendall(rng.randbytes(rng.randint(1, 2000)))
                s.settimeout(2)
                s.recv(4096)
        except OSError:
            pass


def _worker(rank: int, world: int, reducers: str) -> int:
    import redsrv

    client: redsrv.Client | None = None
    for line in sys.stdin:
        order = json.loads(line)
        completed = wrong = 0
        error = None
        try:
            if client is None:
                client = redsrv.Client(reducers.split(","), rank=rank, world_size=world, job="soak")
            for step in range(order["steps"]):
                size = SIZES[(order["round"] * 7 + step * 3) % len(SIZES)]
                seed = order["round"] * 1000 + step
                out = client.allreduce(soak_input(seed, rank, size), key=("soak", order["round"], step))
                expected = sum(soak_input(seed, r, size) for r in range(world))
                completed += 1
                wrong += int(out.tobytes() != expected.tobytes())
        except redsrv.RedsrvError as exc:
            error = type(exc).__name__
            if client is not None:
                client.close()
            client = None
        print(json.dumps({"completed": completed, "wrong": wrong, "error": error}), flush=True)
    if client is not None:
        client.close()
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        sys.exit(_worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
    sys.exit("usage: redsrv soak")
