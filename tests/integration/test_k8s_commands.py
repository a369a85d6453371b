"""The containers of examples/k8s/ run as Kubernetes would run them, and the reducers roll as a
StatefulSet rolls them. First: the reducer container's own
arguments (the image's ENTRYPOINT is ``redsrv``) and the workers' own environment, beside the
variables Kubernetes adds to every pod (service links of a namespace that holds a Service named
"redsrv-metrics" and one named "redsrv", the API server's), and what the training operators add
(a PyTorchJob's RANK / WORLD_SIZE / MASTER_ADDR, a TFJob's TF_CONFIG without reducers). Only
what this machine must differ in is replaced: loopback, free ports, the secret's file.

Then `kubectl rollout restart statefulset/redsrv-reducer` (docs/operations.md): the reducer pods
stopped with SIGTERM one at a time, highest ordinal first, each started again with the same
arguments and waited for before the next, while workers reduce: no step fails, every sum is exact."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import redsrv
from redsrv.cli.fleet import readline_within

from conftest import _drain, child_env
from tests_support import poll

yaml = pytest.importorskip("yaml")
K8S = Path(__file__).resolve().parents[2] / "examples" / "k8s"

SERVICE_LINKS = {
    "KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443", "KUBERNETES_PORT": "tcp://10.96.0.1:443",
    "REDSRV_METRICS_SERVICE_HOST": "10.96.4.7", "REDSRV_METRICS_SERVICE_PORT": "9400",
    "REDSRV_METRICS_PORT": "tcp://10.96.4.7:9400", "REDSRV_METRICS_PORT_9400_TCP": "tcp://10.96.4.7:9400",
    "REDSRV_METRICS_PORT_9400_TCP_ADDR": "10.96.4.7", "REDSRV_METRICS_PORT_9400_TCP_PORT": "9400",
    "REDSRV_METRICS_PORT_9400_TCP_PROTO": "tcp", "REDSRV_SERVICE_HOST": "10.96.4.9", "REDSRV_SERVICE_PORT": "29600",
    "REDSRV_PORT": "tcp://10.96.4.9:29600", "REDSRV_PORT_29600_TCP": "tcp://10.96.4.9:29600",
}

WORKER = """
import numpy as np, redsrv
with redsrv.Client() as client:
    total = client.allreduce(np.full(1000, client.rank + 1.0, np.float32))
    print(client.rank, client.world_size, float(total.sum()), flush=True)
"""


def _free_port_pair() -> int:
    """A port P such that P and P+1 are free now (the reducer's two processes bind both)."""
    for _ in range(100):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return int(port)
    raise RuntimeError("no two consecutive free ports")


def _replaced(args: list[str], values: dict[str, str]) -> list[str]:
    out = list(args)
    for flag, value in values.items():
        out[out.index(flag) + 1] = value
    return out


def _fleet() -> dict:  # type: ignore[type-arg]
    return {d["kind"]: d for d in yaml.safe_load_all((K8S / "base" / "reducers.yaml").read_text()) if d}


def _start_reducer_pod(procs, sts: dict, secret: Path, port: int, metrics: int) -> tuple[subprocess.Popen, list[str]]:  # type: ignore[no-untyped-def,type-arg]
    """The StatefulSet's reducer container on this machine; returns once it lists its addresses
    (the reducer is up; its metrics endpoint, the probes' target, starts right after)."""
    container = sts["spec"]["template"]["spec"]["containers"][0]
    args = _replaced(container["args"], {"--host": "127.0.0.1", "--port": str(port), "--metrics-port": str(metrics),
                                         "--secret-file": str(secret)})
    reducer = procs.popen([sys.executable, "-m", "redsrv", *args], env=child_env(SERVICE_LINKS), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    deadline = time.monotonic() + 30
    while not any("list them as" in line for line in seen):
        line = readline_within(reducer, max(0.1, deadline - time.monotonic()))
        assert line, f"the reducer container did not start:\n{''.join(seen)}"
        seen.append(line)
    procs.pumps += _drain(reducer, seen)
    return reducer, seen


def test_the_reducer_and_worker_containers_run_with_a_pods_environment(procs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    fleet = _fleet()
    sts, config_map = fleet["StatefulSet"], fleet["ConfigMap"]
    (job,) = [d for d in yaml.safe_load_all((K8S / "pytorchjob.yaml").read_text()) if d]
    secret = tmp_path / "secret"
    secret.write_text("a-secret-of-32-hex-chars-0123456789abcdef\n")
    port, metrics = _free_port_pair(), _free_port_pair()
    _reducer, seen = _start_reducer_pod(procs, sts, secret, port, metrics)
    assert f"127.0.0.1:{port}-{port + 1}" in seen[-1]

    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    env = {**config_map["data"], **{e["name"]: e["value"] for e in pod["env"]}}  # envFrom the fleet's ConfigMap, then env
    env |= {"REDSRV_REDUCERS": f"127.0.0.1:{port}-{port + 1}", "REDSRV_SECRET_FILE": str(secret)}
    operators = {  # what each training operator adds for rank r of 2
        "PyTorchJob": lambda r: {"RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "redsrv-ddp-master-0", "MASTER_PORT": "23456"},
        "TFJob": lambda r: {"TF_CONFIG": json.dumps({"cluster": {"master": ["m:2222"], "worker": ["w:2222"], "ps": ["p:2222"]},
                                                     "task": {"type": ["master", "worker"][r], "index": 0}})},
    }
    for operator, placement in operators.items():
        workers = [procs.popen([sys.executable, "-c", WORKER], env=child_env({**SERVICE_LINKS, **env, **placement(r),
                                                                               "REDSRV_JOB": f"k8s-{operator}"}),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
        outputs = []
        for proc in workers:
            out, _ = proc.communicate(timeout=60)
            assert proc.returncode == 0, f"{operator} worker failed:\n{out}"
            outputs.append(out.split("\n")[-2] if out.endswith("\n") else out)
        assert sorted(outputs) == ["0 2 3000.0", "1 2 3000.0"], (operator, outputs)


WORLD = 3
SIZE = 300_001  # several chunks per reducer process, so a SIGTERM lands mid-operation


def _step_input(rank: int, step: int) -> np.ndarray:
    return np.random.default_rng([rank, step]).standard_normal(SIZE).astype(np.float32)


@pytest.mark.slow  # 6-8 s: in the core env's full run
@pytest.mark.timeout(90)
def test_a_rolling_restart_of_the_reducer_statefulset_fails_no_step(procs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    sts = _fleet()["StatefulSet"]
    grace = sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    secret = tmp_path / "secret"
    secret.write_text("a-secret-of-32-hex-chars-0123456789abcdef\n")
    ports = [(_free_port_pair(), _free_port_pair()) for _ in range(2)]  # two reducer pods, two processes each
    pods = [_start_reducer_pod(procs, sts, secret, port, metrics)[0] for port, metrics in ports]
    reducers = [f"127.0.0.1:{port}-{port + 1}" for port, _ in ports]

    done: list[int] = [0] * WORLD  # steps each rank finished
    wrong: list[tuple[int, int]] = []
    errors: list[str] = []
    # Ranks stop together: a rank checks the stop and claims its next step under one lock, and the
    # stop ends the run after the highest step any rank claimed, so no rank is left alone in a
    # step the others never start (it would see them leave: PeerLostError).
    lock = threading.Lock()
    claimed = [0] * WORLD  # steps each rank started
    last: list[int] = []  # set once: the number of steps every rank runs

    def train(rank: int) -> None:
        # The workers' defaults but for heartbeats (a lost reducer noticed in 1 s, not 15 s).
        with redsrv.Client(reducers, rank=rank, world_size=WORLD, job="rolling", secret=secret.read_bytes().strip(),
                           heartbeat_interval=0.2, heartbeat_misses=5, reconnect_window=30.0, op_timeout=30.0) as client:
            step = 0
            while True:
                with lock:
                    if last and step >= last[0]:
                        break
                    claimed[rank] = step + 1
                x = _step_input(rank, step)
                try:
                    result = client.allreduce(x, key=("step", step), out=x)
                except redsrv.RedsrvError as exc:
                    errors.append(f"rank {rank} step {step}: {type(exc).__name__}: {exc}")
                    return
                total = _step_input(0, step)
                for other in range(1, WORLD):
                    total += _step_input(other, step)
                if result.tobytes() != total.tobytes():
                    wrong.append((rank, step))
                step += 1
                done[rank] = step

    threads = [threading.Thread(target=train, args=(r,), name=f"rank-{r}") for r in range(WORLD)]
    for thread in threads:
        thread.start()
    try:
        poll(lambda: min(done) >= 3 or errors, 30, "three steps before the restart")
        for ordinal in reversed(range(len(pods))):  # a StatefulSet rolls from the highest ordinal down
            before = min(done)
            pods[ordinal].send_signal(signal.SIGTERM)
            assert pods[ordinal].wait(grace) == 0, f"reducer pod {ordinal} did not exit 0 within its grace period"
            port, metrics = ports[ordinal]
            pods[ordinal] = poll(lambda port=port, metrics=metrics: _restart(procs, sts, secret, port, metrics), 20,
                                 f"reducer pod {ordinal} started again on port {port}", every=0.2)
            poll(lambda before=before: min(done) >= before + 2 or errors, 30, f"two steps after restarting pod {ordinal}")
    finally:
        with lock:
            last.append(max(claimed))
        for thread in threads:
            thread.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    assert errors == [] and wrong == [], (errors, wrong)
    assert len(set(done)) == 1 and min(done) >= 7, done


def _restart(procs, sts: dict, secret: Path, port: int, metrics: int) -> subprocess.Popen | None:  # type: ignore[no-untyped-def,type-arg]
    """The pod started again, or None while its ports are not yet free (the kernel lets the old
    sockets go)."""
    try:
        return _start_reducer_pod(procs, sts, secret, port, metrics)[0]
    except AssertionError:
        return None
