"""``redsrv soak --framework torch``: DDP training through a local fleet while reducers are
killed, stopped and frozen at random, with an exact oracle for every gradient.

Each worker process trains a small model with ``torch.nn.parallel.DistributedDataParallel``
(several buckets per step; DDP's own process group on gloo through a FileStore) and the redsrv
comm hook (:func:`redsrv.torch.redsrv_hook`), with the default recovery settings: a lost reducer
is ridden through (RELIABILITY R22), nothing in the training loop knows about faults.

The oracle: a rank's batch is generated from a seed per (step, rank), so after ``backward()``
every worker recomputes every rank's gradient on its own (plain autograd through the same module,
the same parameters), sums them in rank order in float32 and divides by the world size with the
same NumPy call the client makes for ``op="mean"`` (``Landing.finish_bytes`` in ``core/client_core.py``), which is what the
reducers and the hook compute (R14: rank-order float32 accumulation). The parameters' ``.grad``
must equal that bit for bit; a step where any element differs is a wrong step. Every
:data:`HASH_EVERY` steps each worker also reports a hash of its parameters and the driver checks
that every rank has the same one.

Meanwhile the driver injects faults at random times (uniform(0.5, 1.5) x ``--fault-interval``
after the previous one ended, independent of the workers' steps), each one of: a reducer killed
(SIGKILL) and restarted on its port, stopped with SIGTERM and restarted, or frozen (SIGSTOP) for
``--reducer-freeze`` seconds and resumed (SIGCONT). The kinds come in shuffled rounds of three,
so each occurs about equally often; ``--seed`` fixes the whole schedule.

Reported: training steps completed, failed steps (a step whose ``backward()`` raised), wrong steps,
parameter mismatches, hangs (a worker making no progress for longer than the reconnect window plus
:data:`HANG_MARGIN_S`), faults by kind, recovery time per fault (from the fault to the moment every
worker completed a step that started after it; median and max per kind, also measured from the
fault's end: the restart listening, or SIGCONT), reducer and worker RSS. A failed step ends that
generation of workers (DDP cannot take a step back), and the driver starts a fresh one under a new
job name, as a real job would restart from a checkpoint; the run goes on.

The driver and the workers share the clock: ``time.monotonic()`` is CLOCK_MONOTONIC, one clock for
every process on a Linux host.
"""

from __future__ import annotations

import bisect
import faulthandler
import hashlib
import json
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from redsrv.core import constants as C

#: Liveness settings for the DDP soak. Heartbeats as in the NumPy soak (a frozen reducer is noticed
#: in a second); an operation may take a minute, so a step fails only if recovery really stalls,
#: never because the shared machine is slow. The reconnect window stays at its default (or
#: whatever REDSRV_RECONNECT_WINDOW says): that is the recovery being measured.
DDP_SOAK_ENV = {"REDSRV_HEARTBEAT_INTERVAL": "0.2", "REDSRV_HEARTBEAT_MISSES": "5", "REDSRV_OP_TIMEOUT": "60",
                "REDSRV_CONNECT_TIMEOUT": "15", "REDSRV_CLOSE_TIMEOUT": "3"}
#: A worker silent this much longer than the reconnect window has hung: past the window every
#: operation must have failed with PeerLostError (R22), and a failed step is reported at once.
HANG_MARGIN_S = 30.0
#: Workers report a hash of their parameters every this many steps.
HASH_EVERY = 50
#: Workers agree (over gloo) whether the run is over every this many steps, so all stop at one step.
STOP_CHECK_EVERY = 25
#: No fault is injected this close to the end: its recovery would not be seen.
QUIET_END_S = 15.0
#: A worker that said it finished exits within this (its hook's client closes within its goodbye
#: deadlines, then gloo's group); one still running after it is a hang at the end, reported as one.
EXIT_GRACE_S = 30.0
FAULT_KINDS = ("kill_reducer", "term_reducer", "freeze_reducer")


# --- worker --------------------------------------------------------------------------------


def _batch(seed: int, step: int, rank: int) -> tuple[Any, Any]:
    import torch

    data = torch.Generator().manual_seed(seed * 2**40 + step * 4096 + rank)
    return torch.randn(32, 64, generator=data), torch.randn(32, 16, generator=data)


def _expected_grads(model: Any, params: list[Any], seed: int, step: int, world: int) -> list[Any]:
    """The averaged gradient the hook must produce, computed here from every rank's batch."""
    import numpy as np
    import torch
    from torch import nn

    total: list[Any] = []
    for rank in range(world):
        x, y = _batch(seed, step, rank)
        grads = torch.autograd.grad(nn.functional.mse_loss(model(x), y), params)
        if rank == 0:
            total = [g.clone() for g in grads]
        else:
            for acc, g in zip(total, grads, strict=True):
                acc.add_(g)  # float32 + float32 rounded once: the reducers' np.add, in rank order
    if world > 1:
        for acc in total:
            array = acc.numpy()
            np.divide(array, world, out=array, casting="unsafe")  # the client's mean (client_core.Landing.finish_bytes)
    return total


def _read_end(path: str) -> float:
    try:
        with open(path) as f:
            return float(f.read())
    except (OSError, ValueError):
        return float("inf")


def _same_bits(a: Any, b: Any) -> bool:
    import torch

    return a.shape == b.shape and torch.equal(a.detach().view(torch.int32), b.detach().view(torch.int32))


def _worker(spec: dict[str, Any]) -> int:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver asks for stacks when a worker hangs
    from datetime import timedelta

    import torch
    import torch._dynamo  # noqa: F401 - DDP imports it on first use; before any client exists
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    import redsrv.torch

    torch.set_num_threads(1)  # one thread: the same kernels on every rank, and the shared CPU stays fair
    rank, world, seed = spec["rank"], spec["world_size"], spec["seed"]

    def emit(record: dict[str, Any]) -> None:
        print(json.dumps(record), flush=True)

    store = dist.FileStore(spec["store"], world)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=spec["gloo_timeout"]))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 16))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.1)  # ~90k parameters: several buckets per step
    state = redsrv.torch.HookState(spec["reducers"], rank=rank, world_size=world, job=spec["job"])
    ddp.register_comm_hook(state, redsrv.torch.redsrv_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    params = list(model.parameters())
    step = 0
    try:
        while True:
            x, y = _batch(seed, step, rank)
            optimizer.zero_grad()
            t0 = time.monotonic()
            try:
                nn.functional.mse_loss(ddp(x), y).backward()  # type: ignore[no-untyped-call]
            except Exception as exc:  # a failed step: report it and end this generation
                emit({"step": step, "t0": t0, "t1": time.monotonic(), "error": f"{type(exc).__name__}: {exc}"})
                return 3
            t1 = time.monotonic()
            expected = _expected_grads(model, params, seed, step, world)
            wrong = [i for i, (p, e) in enumerate(zip(params, expected, strict=True)) if not _same_bits(p.grad, e)]
            optimizer.step()
            record: dict[str, Any] = {"step": step, "t0": t0, "t1": t1, "wrong": len(wrong)}
            if wrong:
                record["wrong_params"] = wrong
                record["max_abs_diff"] = max(float((params[i].grad - expected[i]).abs().max()) for i in wrong)
            if step % HASH_EVERY == 0:
                digest = hashlib.blake2b(digest_size=16)
                for p in params:
                    digest.update(p.detach().numpy().tobytes())
                record["hash"] = digest.hexdigest()
            emit(record)
            step += 1
            if step % STOP_CHECK_EVERY == 0:
                # The driver writes the end once every rank trains; ranks may read it at different
                # steps, so they agree over gloo and all stop after the same step.
                done = torch.tensor([float(time.monotonic() >= _read_end(spec["end_file"]))])
                dist.all_reduce(done, op=dist.ReduceOp.MAX)
                if done.item():
                    emit({"finished": step})
                    return 0
    finally:
        state.close()
        dist.destroy_process_group()


# --- driver --------------------------------------------------------------------------------


@dataclass
class _Fault:
    kind: str
    reducer: int
    generation: int
    at: float
    end: float = float("nan")
    recovery_s: float | None = None  # fault -> every worker completed a step started after it
    recovery_after_end_s: float | None = None


@dataclass
class _Generation:
    index: int
    job: str
    procs: list[subprocess.Popen]  # type: ignore[type-arg]
    started: float
    steps: list[list[tuple[float, float]]] = field(default_factory=list)  # per rank: (t0, t1) of completed steps
    last_progress: list[float] = field(default_factory=list)
    finished: list[bool] = field(default_factory=list)
    failed_at: float | None = None
    hashes: dict[int, dict[int, str]] = field(default_factory=dict)  # step -> rank -> hash


@dataclass
class _Stats:
    failed_steps: int = 0
    wrong_steps: set[tuple[int, int]] = field(default_factory=set)
    wrong_details: list[dict[str, Any]] = field(default_factory=list)
    param_mismatches: list[dict[str, Any]] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)
    hangs: list[dict[str, Any]] = field(default_factory=list)
    rss_mib: dict[str, list[float]] = field(default_factory=dict)


def run_ddp_soak(*, duration: float, workers: int, reducers: int, fault_interval: float, reducer_freeze: float,
                 seed: int, json_path: str | None, log_dir: str | None = None) -> int:
    from redsrv.cli.fleet import start_reducers, stop_processes
    from redsrv.cli.soak import _restart_reducer, _rss_mib

    rng = random.Random(seed)
    env = {**os.environ, **DDP_SOAK_ENV, "PYTHONUNBUFFERED": "1"}
    window = float(env.get("REDSRV_RECONNECT_WINDOW", C.DEFAULT_RECONNECT_WINDOW_S))
    hang_after = window + HANG_MARGIN_S
    logs = log_dir or tempfile.mkdtemp(prefix="redsrv-soak-ddp-")
    os.makedirs(logs, exist_ok=True)
    fleet = start_reducers(reducers, env=env)
    ports = [int(a.rsplit(":", 1)[1]) for a in fleet.addresses]
    lines: queue.Queue[tuple[int, int, dict[str, Any] | None]] = queue.Queue()
    generations: list[_Generation] = []
    faults: list[_Fault] = []
    stats = _Stats()
    frozen: tuple[int, float, _Fault] | None = None  # reducer index, when to resume, its fault
    kinds: list[str] = []
    print(f"redsrv soak (torch DDP): {workers} workers, {reducers} reducers, {duration:.0f}s of training, a fault every "
          f"~{fault_interval:g}s, seed {seed}; reconnect window {window:g}s; worker logs in {logs}", flush=True)

    def start_generation(end_file: str) -> _Generation:
        index = len(generations)
        job = f"soak-ddp-{index}"
        procs = []
        for rank in range(workers):
            spec = {"rank": rank, "world_size": workers, "seed": seed * 1000 + index, "reducers": fleet.addresses,
                    "job": job, "store": os.path.join(logs, f"gen{index}.store"), "end_file": end_file,
                    "gloo_timeout": hang_after * 2}
            log = open(os.path.join(logs, f"gen{index}-rank{rank}.log"), "w")  # noqa: SIM115 - the child owns it
            proc = subprocess.Popen([sys.executable, "-m", "redsrv.cli.soak_ddp", "worker", json.dumps(spec)],
                                    stdout=subprocess.PIPE, stderr=log, text=True, env=env)
            log.close()
            procs.append(proc)
            threading.Thread(target=_pump, args=(proc, index, rank, lines), daemon=True).start()
        now = time.monotonic()
        gen = _Generation(index, job, procs, now, [[] for _ in range(workers)], [now] * workers, [False] * workers)
        generations.append(gen)
        return gen

    def drain(wait: float) -> None:
        try:
            item: tuple[int, int, dict[str, Any] | None] | None = lines.get(timeout=wait)
        except queue.Empty:
            return
        while item is not None:
            g, rank, record = item
            _take(generations[g], rank, record, stats)
            try:
                item = lines.get_nowait()
            except queue.Empty:
                item = None

    def sample_rss() -> None:
        for i, p in enumerate(fleet.procs):
            stats.rss_mib.setdefault(f"reducer {fleet.addresses[i]}", []).append(_rss_mib(p.pid))
        for rank, p in enumerate(gen.procs):
            if p.poll() is None:
                stats.rss_mib.setdefault(f"worker {rank}", []).append(_rss_mib(p.pid))

    def restart(i: int) -> None:
        proc = fleet.procs[i]
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:  # a reducer that does not stop is a finding, not a crash
            stats.errors["reducer_did_not_exit"] = stats.errors.get("reducer_did_not_exit", 0) + 1
            proc.kill()
            proc.wait(5)
        fleet.procs[i] = _restart_reducer(ports[i], env, log_level="warning")

    training_started: float | None = None
    end = float("inf")
    end_file = os.path.join(logs, "end")
    gen = start_generation(end_file)
    next_fault = next_print = next_rss = float("inf")
    try:
        while True:
            drain(0.1)
            now = time.monotonic()
            if training_started is None and all(gen.steps):
                training_started = now
                end = now + duration
                next_fault = now + rng.uniform(0.5, 1.5) * fault_interval
                next_print = now + 10.0
                next_rss = now
                with open(end_file + ".tmp", "w") as f:
                    f.write(repr(end))
                os.replace(end_file + ".tmp", end_file)  # workers never read half a number
            if frozen is not None and now >= frozen[1]:
                i, _, fault = frozen
                os.kill(fleet.procs[i].pid, signal.SIGCONT)
                fault.end = time.monotonic()
                frozen = None
                next_fault = fault.end + rng.uniform(0.5, 1.5) * fault_interval
            if frozen is None and now >= next_fault and now < end - QUIET_END_S and gen.failed_at is None:
                if not kinds:
                    kinds = list(FAULT_KINDS)
                    rng.shuffle(kinds)
                fault = _Fault(kinds.pop(0), rng.randrange(reducers), gen.index, time.monotonic())
                faults.append(fault)
                victim = fleet.procs[fault.reducer]
                if fault.kind == "freeze_reducer":
                    victim.send_signal(signal.SIGSTOP)
                    frozen = (fault.reducer, fault.at + reducer_freeze, fault)
                else:
                    victim.send_signal(signal.SIGKILL if fault.kind == "kill_reducer" else signal.SIGTERM)
                    restart(fault.reducer)
                    fault.end = time.monotonic()
                    next_fault = fault.end + rng.uniform(0.5, 1.5) * fault_interval
            if now >= next_rss:
                sample_rss()
                next_rss = now + 5.0
            if now >= next_print:
                next_print = now + 10.0
                print(f"  {now - (training_started or now):6.0f}s gen {gen.index}: steps {_steps(generations):6d} "
                      f"failed {stats.failed_steps} wrong {len(stats.wrong_steps)} hangs {len(stats.hangs)} "
                      f"faults {len(faults)}", flush=True)
            # A generation ends when all of its workers exited: finished, failed or crashed.
            exited = [p.poll() for p in gen.procs]
            if all(code is not None for code in exited):
                drain(0.5)  # what they printed last
                for rank, code in enumerate(exited):
                    if code != 0 and gen.failed_at is None:  # after a failed step the driver ends the rest
                        stats.crashes.append(f"generation {gen.index} rank {rank} exited with {code}")
                if all(gen.finished):
                    break
                if training_started is None or time.monotonic() > end - QUIET_END_S:
                    break
                gen = start_generation(end_file)
                continue
            if gen.failed_at is not None and now > gen.failed_at + float(env["REDSRV_OP_TIMEOUT"]) + 10:
                # A failed step fails for every rank (R3); the rest had the operation timeout to say so.
                stop_processes(gen.procs, timeout=5)
                continue
            # Its last line came this long ago: a step, or "finished" (then it should have exited).
            stuck = [r for r in range(workers) if exited[r] is None
                     and now - gen.last_progress[r] > (EXIT_GRACE_S if gen.finished[r] else hang_after)]
            if stuck:
                for r in stuck:
                    os.kill(gen.procs[r].pid, signal.SIGUSR1)  # stacks into its log
                    stats.hangs.append({"generation": gen.index, "rank": r, "last_step": len(gen.steps[r]) - 1,
                                        "silent_s": round(now - gen.last_progress[r], 1),
                                        "finished": gen.finished[r]})
                print(f"redsrv soak: worker(s) {stuck} made no progress for {hang_after:g}s, or did not exit "
                      f"{EXIT_GRACE_S:g}s after finishing; stopping (stacks in {logs})", flush=True)
                time.sleep(1.0)  # give faulthandler its moment before the workers are ended
                break
    finally:
        if frozen is not None:
            os.kill(fleet.procs[frozen[0]].pid, signal.SIGCONT)
        stopped = time.monotonic()
        for generation in generations:
            stop_processes(generation.procs, timeout=10)
        sample_rss()
        stop_processes(fleet.procs)
    while True:  # anything still queued
        try:
            index, rank, record = lines.get_nowait()
        except queue.Empty:
            break
        _take(generations[index], rank, record, stats)
    report = _report(generations, faults, stats, workers=workers, reducers=reducers, duration=duration,
                     fault_interval=fault_interval, seed=seed, window=window, logs=logs,
                     trained_s=(stopped - training_started) if training_started else 0.0)
    _print_report(report)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    bad = report["wrong_steps"] or report["param_mismatches"] or report["hangs"] or report["crashes"]
    return 1 if bad or stats.errors.get("reducer_did_not_exit") or training_started is None else 0


def _pump(proc: subprocess.Popen, generation: int, rank: int,  # type: ignore[type-arg]
          out: queue.Queue[tuple[int, int, dict[str, Any] | None]]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        try:
            out.put((generation, rank, json.loads(line)))
        except ValueError:
            out.put((generation, rank, {"noise": line.rstrip()}))
    out.put((generation, rank, None))


def _take(gen: _Generation, rank: int, record: dict[str, Any] | None, stats: _Stats) -> None:
    if record is None or "noise" in record:
        return
    gen.last_progress[rank] = time.monotonic()
    if "finished" in record:
        gen.finished[rank] = True
        return
    if "error" in record:
        stats.failed_steps += 1
        kind = record["error"].split(":", 1)[0]
        stats.errors[kind] = stats.errors.get(kind, 0) + 1
        stats.failures.append({"generation": gen.index, "rank": rank, "step": record["step"],
                               "error": record["error"][:1000]})
        if gen.failed_at is None:
            gen.failed_at = time.monotonic()
        print(f"redsrv soak: generation {gen.index} rank {rank} step {record['step']} failed: {record['error'][:300]}",
              flush=True)
        return
    gen.steps[rank].append((record["t0"], record["t1"]))
    if record["wrong"]:
        stats.wrong_steps.add((gen.index, record["step"]))
        stats.wrong_details.append({"generation": gen.index, "rank": rank, "step": record["step"],
                                    "params": record["wrong_params"], "max_abs_diff": record["max_abs_diff"]})
    if "hash" in record:
        seen = gen.hashes.setdefault(record["step"], {})
        seen[rank] = record["hash"]
        if len(seen) == len(gen.steps) and len(set(seen.values())) > 1:
            stats.param_mismatches.append({"generation": gen.index, "step": record["step"], "hashes": dict(seen)})


def _steps(generations: list[_Generation]) -> int:
    """Training steps every rank completed, over every generation."""
    return sum(min(len(s) for s in g.steps) for g in generations)


def _recover(fault: _Fault, gen: _Generation) -> None:
    done = []
    for steps in gen.steps:  # each rank's steps in order, so their start times are sorted
        first = bisect.bisect_right(steps, (fault.at, float("inf")))
        if first == len(steps):
            return  # this rank never completed a step started after the fault (its generation failed, or the run ended)
        done.append(steps[first][1])
    fault.recovery_s = max(done) - fault.at
    if fault.end == fault.end:  # not NaN: the fault ended
        fault.recovery_after_end_s = max(done) - fault.end


def _summary(values: list[float]) -> dict[str, float] | None:
    return {"median_s": round(statistics.median(values), 3), "max_s": round(max(values), 3)} if values else None


def _report(generations: list[_Generation], faults: list[_Fault], stats: _Stats, **info: Any) -> dict[str, Any]:
    for fault in faults:
        _recover(fault, generations[fault.generation])
    by_kind: dict[str, Any] = {}
    for kind in FAULT_KINDS:
        mine = [f for f in faults if f.kind == kind]
        if not mine:
            continue
        by_kind[kind] = {
            "injected": len(mine), "recovered": sum(f.recovery_s is not None for f in mine),
            "recovery": _summary([f.recovery_s for f in mine if f.recovery_s is not None]),
            "recovery_after_fault_end": _summary([f.recovery_after_end_s for f in mine if f.recovery_after_end_s is not None]),
        }
    rss = {name: {"start_mib": round(v[0], 1), "max_mib": round(max(v), 1), "last_mib": round(v[-1], 1)}
           for name, v in stats.rss_mib.items() if v}
    return {
        "framework": "torch", **info, "generations": len(generations),
        "steps_completed": _steps(generations), "worker_steps_completed": sum(len(s) for g in generations for s in g.steps),
        "failed_steps": stats.failed_steps, "wrong_steps": len(stats.wrong_steps), "wrong_details": stats.wrong_details[:20],
        "param_checks": sum(len(g.hashes) for g in generations), "param_mismatches": stats.param_mismatches[:20],
        "failures": stats.failures[:20], "hangs": stats.hangs, "crashes": stats.crashes, "errors": stats.errors,
        "faults": {k: v["injected"] for k, v in by_kind.items()}, "recovery_by_kind": by_kind,
        "fault_log": [{"kind": f.kind, "reducer": f.reducer, "generation": f.generation,
                       "recovery_s": None if f.recovery_s is None else round(f.recovery_s, 3),
                       "recovery_after_end_s": None if f.recovery_after_end_s is None else round(f.recovery_after_end_s, 3)}
                      for f in faults],
        "rss": rss,
    }


def _print_report(r: dict[str, Any]) -> None:
    print(f"redsrv soak (torch DDP): {r['steps_completed']} steps completed in {r['trained_s']:.0f}s of training "
          f"({r['generations']} generation(s)), {r['failed_steps']} worker-steps failed, {r['wrong_steps']} wrong steps, "
          f"{len(r['param_mismatches'])} parameter mismatches in {r['param_checks']} checks, {len(r['hangs'])} hangs, "
          f"{len(r['crashes'])} crashes; errors {r['errors']}")
    for kind, k in r["recovery_by_kind"].items():
        rec, after = k["recovery"], k["recovery_after_fault_end"]
        line = f"  {kind}: {k['injected']} injected, {k['recovered']} recovered"
        if rec:
            line += f"; every worker past it {rec['median_s']:.2f}s median, {rec['max_s']:.2f}s max after the fault"
        if after:
            line += f" ({after['median_s']:.2f}s / {after['max_s']:.2f}s after its end)"
        print(line)
    for name, v in r["rss"].items():
        print(f"  RSS {name}: {v['start_mib']:.1f} MiB at start, {v['max_mib']:.1f} max, {v['last_mib']:.1f} last")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "worker":
        sys.exit(_worker(json.loads(sys.argv[2])))
    sys.exit("usage: redsrv soak --framework torch")
