"""``redsrv demo``: a reducer fleet and worker processes on this machine.

Starts ``reducers`` reducer processes on free loopback ports, ``workers`` worker processes that
train through them, compares the trained weights with a single-process reference, prints a
summary, and ends every process it started (also on Ctrl-C or an error).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np

from redsrv.cli.fleet import start_reducers, stop_processes

#: Framework -> module with train_worker(...) and train_reference(...).
FRAMEWORKS = {"numpy": "redsrv.examples.numpy_sgd", "torch": "redsrv.examples.torch_ddp", "jax": "redsrv.examples.jax_optax",
              "tf": "redsrv.examples.keras_fit"}

#: How close the distributed weights must be to the single-process reference, relative to the
#: largest weight. float32 on the wire sums in the same order as the reference (rank order), so
#: only library-level differences remain; 16-bit wire formats round every gradient.
TOLERANCE = {None: 1e-5, "bf16": 3e-2, "fp16": 5e-3}


def pick_framework(requested: str) -> str:
    if requested != "auto":
        return requested
    if importlib.util.find_spec("torch") is not None and importlib.util.find_spec("redsrv.examples.torch_ddp") is not None:
        return "torch"
    return "numpy"


def run_demo(*, workers: int = 3, reducers: int = 2, steps: int = 60, framework: str = "auto",
             wire_dtype: str | None = None, timeout: float = 300.0) -> int:
    framework = pick_framework(framework)
    module = importlib.import_module(FRAMEWORKS[framework])
    job = f"demo-{uuid.uuid4().hex[:8]}"
    print(f"redsrv demo: {workers} workers, {reducers} reducers, {framework} model, {steps} steps"
          + (f", {wire_dtype} on the wire" if wire_dtype else ""), flush=True)
    started = time.perf_counter()
    fleet = start_reducers(reducers)
    worker_procs: list[subprocess.Popen] = []  # type: ignore[type-arg]
    try:
        print(f"  reducers listening on {', '.join(fleet.addresses)}", flush=True)
        with tempfile.TemporaryDirectory(prefix="redsrv-demo-") as tmp:
            outs = [os.path.join(tmp, f"rank{r}.npz") for r in range(workers)]
            for r in range(workers):
                cmd = [sys.executable, "-m", "redsrv.cli.demo", "worker", "--framework", framework,
                       "--rank", str(r), "--world-size", str(workers), "--reducers", ",".join(fleet.addresses),
                       "--job", job, "--steps", str(steps), "--out", outs[r]]
                if wire_dtype:
                    cmd += ["--wire-dtype", wire_dtype]
                worker_procs.append(subprocess.Popen(cmd))
            deadline = time.monotonic() + timeout
            for p in worker_procs:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    print(f"redsrv demo: worker pid {p.pid} did not finish within {timeout:.0f}s", file=sys.stderr)
                    return 1
            failed = [r for r, p in enumerate(worker_procs) if p.returncode != 0]
            if failed:
                print(f"redsrv demo: worker(s) {failed} failed (see their errors above)", file=sys.stderr)
                return 1
            results = []
            for path in outs:
                with np.load(path) as data:
                    results.append({k: data[k] for k in data.files})
        reference = module.train_reference(world_size=workers, steps=steps)
        identical = all(np.array_equal(res["weights"], results[0]["weights"]) for res in results)
        scale = float(np.abs(reference).max()) or 1.0
        error = float(np.abs(results[0]["weights"] - reference).max()) / scale
        tolerance = TOLERANCE[wire_dtype]
        ok = identical and error <= tolerance
        seconds = float(results[0]["seconds"])
        pushed = sum(float(res["bytes_pushed"]) for res in results)
        pulled = sum(float(res["bytes_pulled"]) for res in results)
        print(f"  trained {steps} steps in {seconds:.2f}s ({seconds / max(steps, 1) * 1000:.1f} ms/step); "
              f"loss {float(results[0]['first_loss']):.4f} -> {float(results[0]['last_loss']):.4f}")
        print(f"  moved {pushed / 2**20:.1f} MiB to and {pulled / 2**20:.1f} MiB from the reducers "
              f"({reference.size:,} parameters)")
        print(f"  weights identical on every worker: {'yes' if identical else 'NO'}")
        print(f"  max difference from a single-process reference: {error:.2e} of the largest weight "
              f"(tolerance {tolerance:.0e})")
        print(f"redsrv demo: check {'passed' if ok else 'FAILED'} in {time.perf_counter() - started:.1f}s total")
        return 0 if ok else 1
    finally:
        stop_processes(worker_procs, timeout=5)
        stop_processes(fleet.procs)


def _worker_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="redsrv.cli.demo worker")
    parser.add_argument("--framework", choices=sorted(FRAMEWORKS), required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--reducers", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--wire-dtype", default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    module = importlib.import_module(FRAMEWORKS[args.framework])
    out = module.train_worker(rank=args.rank, world_size=args.world_size, reducers=args.reducers.split(","),
                              job=args.job, steps=args.steps, wire_dtype=args.wire_dtype)
    np.savez(args.out, **{k: np.asarray(v) for k, v in out.items()})
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        sys.exit(_worker_main(sys.argv[2:]))
    sys.exit("usage: redsrv demo (this module's 'worker' mode is started by the demo)")
