"""A redsrv group whose ranks all share this host reduces in shared memory (core/host.py, one
host) and never contacts the reducers: every all-reduce equals gloo's bit for bit, and the
errors keep their types (docs/torch_backend.md, "One host")."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("torch")

pytestmark = [pytest.mark.torch, pytest.mark.timeout(240)]

WORKER = os.path.join(os.path.dirname(__file__), "one_host_worker.py")
OP_TIMEOUT = 3.0


def _run(procs, tmp_path, scenario: str, reducers: str, world: int = 2, env: dict[str, str] | None = None) -> list[dict]:  # type: ignore[no-untyped-def,type-arg]
    from conftest import child_env
    from tests_support import wait_all

    store = str(tmp_path / f"store-{scenario}")
    spec = {"world_size": world, "store": store, "reducers": reducers, "job": f"one-host-{scenario}-{os.getpid()}",
            "op_timeout": OP_TIMEOUT, "scenario": scenario}
    workers = []
    for rank in range(world):
        log = open(tmp_path / f"{scenario}-{rank}.log", "w")
        procs.files.append(log)
        workers.append(procs.popen([sys.executable, WORKER, json.dumps({**spec, "rank": rank}),
                                    str(tmp_path / f"{scenario}-{rank}")], env=child_env(env), stdout=log,
                                   stderr=subprocess.STDOUT))
    wait_all(workers, 200)
    reports = []
    for rank in range(world):
        path = tmp_path / f"{scenario}-{rank}.json"
        if rank == world - 1 and scenario == "lost":
            continue  # the rank that died
        assert path.exists(), (tmp_path / f"{scenario}-{rank}.log").read_text()[-3000:]
        reports.append(json.loads(path.read_text()))
    return reports


@pytest.fixture
def silent_reducer():  # type: ignore[no-untyped-def]
    """An address where a reducer would listen, whose listening socket never accepts: a
    connection made to it would wait in its backlog, where the test finds it."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    yield listener
    listener.close()


def _never_contacted(listener: socket.socket) -> None:
    listener.setblocking(False)
    with pytest.raises(BlockingIOError):
        conn, peer = listener.accept()
        conn.close()
        raise AssertionError(f"{peer} connected to the reducer's address")


def _check_common(reports: list[dict]) -> None:  # type: ignore[type-arg]
    for report in reports:
        assert report["one_host"], report["repr"]
        assert "reducers=none (one host" in report["repr"]
        assert report["checked"] > 100 and report["wrong"] == [], report["wrong"]
        assert report["callback_threads"] and "redsrv-host" not in report["callback_threads"], report["callback_threads"]
        for what, text in report["mismatch"].items():
            assert text.startswith("ContributionMismatchError"), (report["rank"], what, text)
        assert sorted(report["bad root"]) == ["broadcast", "reduce"]
        for what, text in report["bad root"].items():
            assert text.startswith("ValueError") and "is not a rank of this" in text, (report["rank"], what, text)


@pytest.mark.parametrize("world", [2, 3])
def test_a_one_host_group_reduces_in_shared_memory_and_never_contacts_the_reducers(procs, tmp_path, silent_reducer,
                                                                                   world: int) -> None:
    address = f"127.0.0.1:{silent_reducer.getsockname()[1]}"
    reports = _run(procs, tmp_path, "timeout", address, world=world)
    _check_common(reports)
    _never_contacted(silent_reducer)
    for report in reports[:-1]:
        assert report["timeout"].startswith("PeerTimeoutError"), report["timeout"]
        assert "waits for local ranks" in report["timeout"], report["timeout"]
        assert OP_TIMEOUT - 0.5 <= report["timeout_seconds"] <= OP_TIMEOUT + 2.0, report["timeout_seconds"]


def test_a_dead_local_worker_fails_the_others_at_once_with_a_typed_error(procs, tmp_path, silent_reducer) -> None:
    address = f"127.0.0.1:{silent_reducer.getsockname()[1]}"
    reports = _run(procs, tmp_path, "lost", address)
    _check_common(reports)
    _never_contacted(silent_reducer)
    (survivor,) = reports
    assert survivor["lost"].startswith("PeerLostError"), survivor["lost"]
    assert survivor["lost_seconds"] < 2.0, survivor["lost_seconds"]


def test_flat_keeps_a_one_host_group_on_the_reducers(procs, tmp_path, fleet) -> None:
    """REDSRV_HOST_REDUCE=flat: what the tests and demos that exercise the reducers on one machine use."""
    reducers = ",".join(r.address for r in fleet(2))
    reports = _run(procs, tmp_path, "flat", reducers, env={"REDSRV_HOST_REDUCE": "flat"})
    for report in reports:
        assert not report["one_host"] and "reducers=2" in report["repr"], report["repr"]
        assert report["checked"] > 100 and report["wrong"] == [], report["wrong"]
        assert report["callback_threads"] and "redsrv-host" not in report["callback_threads"], report["callback_threads"]
        for what, text in report["mismatch"].items():
            assert text.startswith("ContributionMismatchError"), (report["rank"], what, text)
