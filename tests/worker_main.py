"""A worker process for integration and fault tests.

    python worker_main.py SPEC_JSON OUT_PREFIX

SPEC: {"reducers": [...], "rank": r, "world_size": n, "job": "...", "config": {...},
       "config_by_rank": {"r": {...}} (this rank's settings beside "config": its local rank, its host),
       "ops": [{"kind": "allreduce"|"broadcast", "size": int, "dtype": str, "seed": int,
                "op": "sum"|"mean"|"min"|"max"|"product"|"band"|"bor"|"bxor", "wire_dtype": null|"bf16"|"fp16",
                "key": ..., "root": 0}],
       "concurrent": bool, "reverse_on_odd_ranks": bool, "start_after": {"rank": path},
       "loop_until_error": bool, "loop_size": int, "loop_seconds": float, "step_pause": float}

Writes OUT_PREFIX.npz with result i as "r{i}" and OUT_PREFIX.json with timings, contributor
counts and, if one was raised, the error's type, message and attributes.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np

import redsrv


def make_input(seed: int, rank: int, size: int, dtype: str) -> np.ndarray:
    """The deterministic input of ``rank``; tests rebuild it to compute references."""
    rng = np.random.default_rng([seed, rank])
    if dtype.startswith("int"):
        return rng.integers(-1000, 1000, size=size).astype(dtype)
    data = rng.standard_normal(size).astype(np.float32)
    if dtype == "bfloat16":
        import ml_dtypes

        return data.astype(ml_dtypes.bfloat16)
    return data.astype(dtype)


def _open_fds() -> set[str]:
    import os

    try:
        return set(os.listdir("/proc/self/fd"))
    except OSError:
        return set()


def _recover(spec: dict) -> dict:  # type: ignore[type-arg]
    """After a failure: a new client and one more step, retried while the fleet comes back."""
    deadline = time.monotonic() + spec["recover"].get("seconds", 40)
    size = spec["recover"].get("size", 1000)
    attempts = 0
    last = None
    while time.monotonic() < deadline:
        attempts += 1
        try:
            with redsrv.Client(spec["reducers"], rank=spec["rank"], world_size=spec["world_size"], job=spec["job"],
                               **spec.get("config", {})) as client:
                out = client.allreduce(make_input(77, spec["rank"], size, "float32"), key=("recovery",))
            expected = make_input(77, 0, size, "float32")
            for r in range(1, spec["world_size"]):
                expected += make_input(77, r, size, "float32")
            return {"ok": bool(out.tobytes() == expected.tobytes()), "attempts": attempts}
        except redsrv.RedsrvError as exc:
            last = repr(exc)
            time.sleep(0.3)  # noqa: TID251 - a retry's backoff while the fleet comes back, inside the deadline above
    return {"ok": False, "attempts": attempts, "last_error": last}


def _mark_raised(out_prefix: str) -> None:
    """Tell a test waiting to repair the fleet (``WorkerRun.wait_for_errors``) that this worker
    has raised: written as soon as the error is caught, before the client's bounded close."""
    with open(out_prefix + ".progress", "w") as f:
        f.write("error")


def main() -> int:
    spec = json.loads(sys.argv[1])
    out_prefix = sys.argv[2]
    report: dict = {"rank": spec["rank"], "results": [], "error": None}
    results: dict[str, np.ndarray] = {}
    if spec.get("recover_only"):  # a replacement for a worker that died
        report["recovery"] = _recover(spec)
        with open(out_prefix + ".json", "w") as f:
            json.dump(report, f)
        np.savez(out_prefix + ".npz")
        return 0
    client = None
    fds_before = _open_fds()
    x = None
    try:
        config = {**spec.get("config", {}), **spec.get("config_by_rank", {}).get(str(spec["rank"]), {})}
        client = redsrv.Client(spec["reducers"], rank=spec["rank"], world_size=spec["world_size"], job=spec["job"], **config)
        report["connected_at"] = time.time()
        report["client"] = type(client).__name__
        io_threads = getattr(client, "io_threads", None)  # the flat client's I/O loops
        report["io_threads"] = sorted(t.name for t in io_threads) if io_threads is not None else []
        if spec.get("loop_until_error"):
            x = make_input(1, spec["rank"], spec.get("loop_size", 1000), "float32")
            original = x.copy()
            step = 0
            deadline = time.monotonic() + spec.get("loop_seconds", 60)
            while time.monotonic() < deadline:
                client.allreduce(x, key=("step", step))
                step += 1
                report["steps"] = step
                report["last_step_at"] = time.time()
                if step in (1, 3, 10):  # progress marks for tests that inject a fault mid-training
                    with open(out_prefix + ".progress", "w") as f:
                        f.write(str(step))
                time.sleep(spec.get("step_pause", 0.0))  # noqa: TID251 - a training step's compute time: pacing
        else:
            futures = []
            order = list(enumerate(spec["ops"]))
            if spec.get("reverse_on_odd_ranks") and spec["rank"] % 2:
                order.reverse()  # keys, not submission order, must match results across ranks
            go = spec.get("start_after", {}).get(str(spec["rank"]))
            if go is not None:  # a straggler by construction: it pushes once the test says so
                from tests_support import poll

                poll(lambda: os.path.exists(go), 60, f"the go-ahead file {go}")
            for i, op in order:
                x = make_input(op.get("seed", i), spec["rank"], op["size"], op.get("dtype", "float32"))
                key = tuple(op["key"]) if isinstance(op.get("key"), list) else op.get("key")
                start = time.perf_counter()
                if op.get("kind", "allreduce") == "broadcast":
                    fut = client.broadcast_async(x, root=op.get("root", 0), key=key)
                else:
                    # op["out"]: "inplace" reduces into x, "given" into a preallocated array
                    target = {"inplace": x, "given": np.full_like(x, 7)}.get(op.get("out", ""))
                    fut = client.allreduce_async(x, op=op.get("op", "sum"), key=key, wire_dtype=op.get("wire_dtype"),
                                                 out=target)
                    if target is not None:
                        returned = fut.result(timeout=120)
                        report.setdefault("out_is_target", []).append(returned is target)
                if spec.get("concurrent"):
                    futures.append((i, fut, start))
                else:
                    results[f"r{i}"] = fut.result(timeout=120)
                    report["results"].append({"i": i, "seconds": time.perf_counter() - start,
                                              "contributors": fut.contributors.min_count if fut.contributors else None})
            for i, fut, start in futures:
                results[f"r{i}"] = fut.result(timeout=120)
                report["results"].append({"i": i, "seconds": time.perf_counter() - start,
                                          "contributors": fut.contributors.min_count if fut.contributors else None})
    except redsrv.RedsrvError as exc:
        report["error"] = {"type": type(exc).__name__, "message": str(exc), "at": time.time(),
                           "mro": [c.__name__ for c in type(exc).__mro__],
                           **{k: getattr(exc, k, None) for k in ("peer", "job", "rank", "phase")}}
        _mark_raised(out_prefix)
    except Exception as exc:  # an untyped error is a test failure: report it as such
        report["error"] = {"type": type(exc).__name__, "message": str(exc), "at": time.time(), "mro": [],
                           "traceback": traceback.format_exc()}
        _mark_raised(out_prefix)
    finally:
        if client is not None:
            client.close()
    if spec.get("loop_until_error") and x is not None:
        # the caller's buffer is never written: results go to a new array
        report["input_intact"] = bool(np.array_equal(x, original))
    report["fds_leaked"] = len(_open_fds() - fds_before)
    import threading

    report["threads_left"] = [t.name for t in threading.enumerate() if t.name.startswith("redsrv-")]
    if spec.get("recover") and report["error"] is not None:
        report["recovery"] = _recover(spec)
    # npz cannot store bfloat16: save its bits and let the loader view them back.
    storable = {(k + "__bf16" if v.dtype.name == "bfloat16" else k): (v.view(np.uint16) if v.dtype.name == "bfloat16" else v)
                for k, v in results.items()}
    np.savez(out_prefix + ".npz", **storable)
    with open(out_prefix + ".json", "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
