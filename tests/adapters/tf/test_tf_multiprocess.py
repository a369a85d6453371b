"""Keras ``fit`` across processes: ReductionServerStrategy workers against real reducer processes,
compared with one process running stock ``MirroredStrategy`` over all their devices (the reference).

Workers are seeded differently on purpose (the initial weights must come from worker 0). Tolerances:
float32 weights and losses differ from the reference only by summation order (1e-6); the workers
agree with each other bit for bit.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("tensorflow")

import numpy as np  # noqa: E402

# Three TensorFlow processes share this machine's cores: a run takes about a minute, more when busy.
pytestmark = [pytest.mark.tf, pytest.mark.slow, pytest.mark.timeout(360)]

WORKER = os.path.join(os.path.dirname(__file__), "keras_worker.py")


# The shared fast timeouts, except the operation timeout: between two synchronising exchanges a
# worker may trace tf.data and Keras functions for many seconds on a busy machine, and the first
# exchange after that waits for the slowest worker. Failures are still detected within a second or
# two (heartbeats, closed connections), which is what the killed-reducer test measures.
KERAS_ENV = {"REDSRV_OP_TIMEOUT": "180"}


def start(procs, spec: dict, prefix: str, env: dict[str, str] | None = None) -> subprocess.Popen:  # type: ignore[no-untyped-def,type-arg]
    from conftest import child_env  # the fast REDSRV_* timeouts, no inherited RANK/WORLD_SIZE

    output = open(prefix + ".out", "w")  # a file, not a pipe: a chatty child never blocks
    procs.files.append(output)
    return procs.popen([sys.executable, WORKER, json.dumps(spec), prefix], env=child_env({**KERAS_ENV, **(env or {})}),
                       stdout=output, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, prefix: str, timeout: float = 240) -> tuple[list[np.ndarray], dict]:  # type: ignore[type-arg]
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"Keras process pid {proc.pid} still running after {timeout}s: a hang") from None
    with open(prefix + ".out") as f:
        output = f.read()
    assert proc.returncode == 0, f"exited with {proc.returncode}:\n{output[-4000:]}"
    with open(prefix + ".json") as f:
        report = json.load(f)
    weights = []
    if os.path.exists(prefix + ".npz"):
        with np.load(prefix + ".npz") as data:
            weights = [data[f"w{i}"] for i in range(len(data.files))]
    return weights, report


def tf_config(reducers: list[str], workers: int, index: int) -> dict[str, str]:
    cluster = {"worker": [f"worker{i}:2222" for i in range(workers)], "reducer": reducers}
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})}


def train_and_compare(fleet, procs, tmp_path, *, devices: int, samples: int, worker_extra: dict | None = None,  # type: ignore[no-untyped-def,type-arg]
                      workers: int = 2, worker_env: dict[int, dict[str, str]] | None = None,
                      **extra) -> list[dict]:  # type: ignore[type-arg]
    """``workers`` workers of ``devices`` devices and the workers x ``devices`` reference; checks
    the common expectations and returns the workers' reports. ``worker_extra`` is spec for the
    workers only, ``worker_env`` variables for each worker (a launcher's)."""
    reducers = [r.address for r in fleet(2)]
    base = {"samples": samples, "batch_size": 32, "epochs": 3, "seed": 5, **extra}
    reference = start(procs, {**base, "mode": "reference", "devices": workers * devices}, str(tmp_path / "ref"))
    started = [start(procs, {**base, **(worker_extra or {}), "mode": "worker", "devices": devices,
                             "job": f"keras-{devices}-{samples}-{workers}"},
                     str(tmp_path / f"w{i}"), {**tf_config(reducers, workers, i), **(worker_env or {}).get(i, {})})
               for i in range(workers)]
    results = [finish(w, str(tmp_path / f"w{i}")) for i, w in enumerate(started)]
    want, ref = finish(reference, str(tmp_path / "ref"))
    assert ref["error"] is None, ref["error"]
    # Variables each replica updates on its own (BatchNormalization's moving statistics) stay per
    # replica, as under MirroredStrategy: the reference reports its replica 0's, which is worker 0's.
    per_replica = {i for i, name in enumerate(ref["weights"]) if "moving_" in name}
    reports = []
    for i, (weights, report) in enumerate(results):
        assert report["error"] is None, report["error"]
        assert (report["worker_index"], report["num_workers"], report["num_replicas_in_sync"]) == (i, workers,
                                                                                                   workers * devices)
        assert report["initial"] == ref["initial"], "initial weights are not worker 0's"
        for k, (got, expected) in enumerate(zip(weights, want)):
            if i == 0 or k not in per_replica:
                np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6, err_msg=ref["weights"][k])
        for name, values in ref["history"].items():
            np.testing.assert_allclose(report["history"][name], values, rtol=1e-6, err_msg=name)
        for name, value in ref["evaluate"].items():
            np.testing.assert_allclose(report["evaluate"][name], value, rtol=1e-6, err_msg=name)
        reports.append(report)
    assert reports[0]["seed_probe"] != reports[1]["seed_probe"], "the workers were meant to be seeded differently"
    # predict returns every row on every worker, in the input's order (as under MultiWorkerMirroredStrategy),
    # and the per-step logs are reduced over every worker: the workers' progress bars agree.
    assert len(ref["predict"]) == samples
    for report in reports:
        np.testing.assert_allclose(report["predict"], ref["predict"], rtol=0, atol=1e-5)
    for i in range(1, workers):
        assert reports[0]["batch_losses"] == reports[i]["batch_losses"]
        for k, (a, b) in enumerate(zip(results[0][0], results[i][0])):
            if k not in per_replica:
                np.testing.assert_array_equal(a, b, err_msg=ref["weights"][k])  # the workers agree exactly
    return reports


def test_two_workers_of_two_devices_equal_one_process_of_four(fleet, procs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    reports = train_and_compare(fleet, procs, tmp_path, devices=2, samples=96, save=True)
    assert [r["should_checkpoint"] for r in reports] == [True, False]
    # ModelCheckpoint went through strategy.chief_only: worker 0 wrote, worker 1 did not.
    assert (tmp_path / "worker0.weights.h5").exists() and not (tmp_path / "worker1.weights.h5").exists()


def test_partial_last_batch_leaves_replicas_without_data(fleet, procs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # 98 = 3 x 32 + 2: the last global batch feeds two of the four replicas, one on each worker.
    # The workers run two steps per execution (a tf.while_loop around the step), which stock
    # MirroredStrategy fails in Keras 3.15 (a placeholder left unfed): the reference runs one.
    train_and_compare(fleet, procs, tmp_path, devices=2, samples=98, worker_extra={"steps_per_execution": 2})


def test_one_device_per_worker(fleet, procs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # One replica per process: stock CrossDeviceOps would skip the reduction (nothing to add locally).
    # 99 = 3 x 32 + 3 adds a partial batch (2 samples on one worker, 1 on the other); the model adds
    # BatchNormalization and Dropout.
    train_and_compare(fleet, procs, tmp_path, devices=1, samples=99, model="bn")


def test_four_workers_as_two_hosts_of_two_reduce_inside_each_host_first(fleet, procs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # As a launcher would start two processes on each of two hosts: the strategy's client reduces
    # inside each host first (core/host_client.py), and fit still equals MirroredStrategy over all
    # four devices.
    hosts = {i: {"LOCAL_RANK": str(i % 2), "LOCAL_WORLD_SIZE": "2", "REDSRV_HOST_ID": f"host{i // 2}"} for i in range(4)}
    reports = train_and_compare(fleet, procs, tmp_path, devices=1, samples=130, workers=4, worker_env=hosts)
    assert [r["client"] for r in reports] == ["HostClient"] * 4


@pytest.mark.skipif(importlib.util.find_spec("tf_keras") is None, reason="tf-keras is not installed (tox -e tf-keras2)")
def test_tf_keras_2_fit_equals_its_reference(fleet, procs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The same strategy under Keras 2 (the tf-keras package), with a partial last batch. Keras 2's
    # ModelCheckpoint consults should_checkpoint itself (chief_only keeps it on every worker: its
    # saving reduces over all of them) and writes worker 1's copy to a temporary directory.
    train_and_compare(fleet, procs, tmp_path, devices=2, samples=98, keras="tf_keras", save=True)
    assert (tmp_path / "worker0.weights.h5").exists() and not (tmp_path / "worker1.weights.h5").exists()


def test_killed_reducer_makes_fit_raise_instead_of_hanging(fleet, procs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    reducers = fleet(2)
    addresses = [r.address for r in reducers]
    spec = {"mode": "worker", "devices": 1, "samples": 64, "batch_size": 16, "epochs": 100000, "progress": True,
            "job": "keras-kill"}
    prefixes = [str(tmp_path / f"w{i}") for i in range(2)]
    workers = [start(procs, spec, prefixes[i], tf_config(addresses, 2, i)) for i in range(2)]
    from tests_support import poll

    def training() -> bool:  # both are in the training loop
        assert all(w.poll() is None for w in workers), "a worker exited before the reducer was killed"
        return all(os.path.exists(p + ".progress") for p in prefixes)

    poll(training, 180, "both workers finishing an epoch", every=0.2)
    reducers[0].signal(signal.SIGKILL)
    killed_at = time.monotonic()
    for worker, prefix in zip(workers, prefixes):
        _, report = finish(worker, prefix, timeout=60)
        error = report["error"]
        assert error is not None, "fit finished although a reducer was killed"
        # Raised in a traced step it is TensorFlow's error quoting ours; in an eager reduction
        # (the epoch's metrics) it is ours. strategy.check() gives ours either way.
        assert error["type"] == "PeerLostError" or "PeerLostError" in error["message"], error
        assert error["redsrv_type"] == "PeerLostError", error
        assert addresses[0] in error["message"] or "disconnected" in error["message"], error
    assert time.monotonic() - killed_at < 30, "workers took too long to notice the killed reducer"


def test_backup_and_restore_resumes_after_a_killed_worker(fleet, procs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Worker 1 is killed in the middle of epoch 2; the whole job restarts with the same
    redsrv.tf.BackupAndRestore, resumes at epoch 2 on both workers and ends where an uninterrupted run
    ends. Worker 1 is given its own backup directory: it never writes it, and restores the chief's
    backup through the reducers."""
    reducers = [r.address for r in fleet(2)]
    base = {"samples": 96, "batch_size": 16, "epochs": 3, "seed": 5, "devices": 1}
    reference = start(procs, {**base, "mode": "reference", "devices": 2}, str(tmp_path / "ref"))
    backups = ["backup", "backup-w1"]
    prefixes = [str(tmp_path / f"w{i}") for i in range(2)]
    first = [start(procs, {**base, "mode": "worker", "job": "keras-backup-1", "backup": backups[i],
                           **({"stop_at": [1, 2]} if i == 1 else {})}, prefixes[i], tf_config(reducers, 2, i))
             for i in range(2)]
    from tests_support import poll

    def stopped() -> bool:  # worker 1 is at batch 2 of epoch 2, waiting
        assert all(w.poll() is None for w in first), "a worker exited before worker 1 was killed"
        return os.path.exists(prefixes[1] + ".stopped")

    poll(stopped, 180, "worker 1 reaching epoch 2", every=0.2)
    os.kill(first[1].pid, signal.SIGKILL)
    _, report = finish(first[0], prefixes[0], timeout=60)
    assert report["error"] is not None and report["epochs_run"] == [0, 1], report
    with open(tmp_path / "backup" / "training_metadata.json") as f:
        assert json.load(f)["epoch"] == 1  # the backup of epoch 1, the last one finished
    assert not (tmp_path / "backup-w1").exists(), "worker 1 wrote a backup"

    second = [start(procs, {**base, "mode": "worker", "job": "keras-backup-2", "backup": backups[i], "save_model": True},
                    prefixes[i] + "b", tf_config(reducers, 2, i)) for i in range(2)]
    results = [finish(w, prefixes[i] + "b") for i, w in enumerate(second)]
    want, ref = finish(reference, str(tmp_path / "ref"))
    for weights, report in results:
        assert report["error"] is None, report["error"]
        assert report["epochs_run"] == [1, 2], "training did not resume after the last backup"
        for got, expected, name in zip(weights, want, ref["weights"]):
            np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6, err_msg=name)
    for a, b in zip(results[0][0], results[1][0]):
        np.testing.assert_array_equal(a, b)
    assert not (tmp_path / "backup").exists(), "the chief did not delete its backup at the end (delete_checkpoint)"
    # model.save on the chief alone: written once, loadable, the trained weights.
    assert (tmp_path / "worker0.keras").exists() and not (tmp_path / "worker1.keras").exists()
    import keras

    saved = keras.saving.load_model(tmp_path / "worker0.keras")
    for got, expected in zip(saved.weights, results[0][0]):
        np.testing.assert_array_equal(got.numpy(), expected)
