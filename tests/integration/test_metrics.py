"""Prometheus metrics of a reducer (--metrics-port) and of a worker client."""

from __future__ import annotations

import socket
import threading
import urllib.request

import numpy as np
import pytest

import redsrv

from tests_support import poll, wait_for_open_operations

pytestmark = pytest.mark.timeout(60)
parser = pytest.importorskip("prometheus_client.parser")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    def fetch() -> str | None:  # None until the endpoint is up
        try:
            return str(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())
        except OSError:
            return None

    text = poll(fetch, 10, f"the metrics endpoint on port {port} answering", every=0.1)
    samples = {}
    for family in parser.text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_reducer_metrics_count_bytes_chunks_rejections_and_stragglers(procs) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    # Rank 1 pushes each step only once the reducer has warned that rank 0's push waits for it,
    # so each of its three contributions is at least this late.
    stall_warning = 0.15
    reducer = procs.start_reducer("--metrics-port", str(port), "--metrics-host", "127.0.0.1",
                                  env={"REDSRV_STALL_WARNING": str(stall_warning)})
    x = np.ones(1000, np.float32)
    failures: list[BaseException] = []

    def late_rank() -> None:
        try:
            with redsrv.Client([reducer.address], rank=1, world_size=2, job="m") as c:
                for step in range(3):
                    wait_for_open_operations(reducer.log, step + 1)  # keys 0..step: rank 0's pushes wait for us
                    c.allreduce(x, key=step)
        except BaseException as exc:  # reported by the test's thread
            failures.append(exc)

    t = threading.Thread(target=late_rank)
    t.start()
    with redsrv.Client([reducer.address], rank=0, world_size=2, job="m") as c:
        for step in range(3):
            c.allreduce(x, key=step)
        with pytest.raises(redsrv.StaleContributionError):
            c.allreduce(x, key=0)  # a reused key is rejected as stale
    t.join(30)
    assert not t.is_alive() and not failures, failures
    m = scrape(port)
    job = (("job", "m"),)
    assert m[("redsrv_reducer_bytes_in_total", job)] == 7 * 4000  # the stale push was read, then rejected
    assert m[("redsrv_reducer_bytes_out_total", job)] == 6 * 4000
    assert m[("redsrv_reducer_chunks_closed_total", job)] == 3
    assert m[("redsrv_reducer_chunk_latency_seconds_count", job)] == 3
    late = m[("redsrv_reducer_rank_lateness_seconds_total", (("job", "m"), ("rank", "1")))]
    early = m[("redsrv_reducer_rank_lateness_seconds_total", (("job", "m"), ("rank", "0")))]
    assert late >= 3 * stall_warning and early < late / 3  # rank 1 is attributed the waiting
    assert m[("redsrv_reducer_contributions_rejected_total", (("job", "m"), ("reason", "STALE")))] == 1


def test_worker_metrics(fleet) -> None:  # type: ignore[no-untyped-def]
    from redsrv.cli.metrics import serve_worker_metrics

    (reducer,) = fleet(1)
    port = free_port()
    with redsrv.Client([reducer.address], rank=0, world_size=1, job="w") as c:
        c.allreduce(np.ones(256, np.float32))
        serve_worker_metrics(c, port, host="127.0.0.1")
        m = scrape(port)
    labels = (("job", "w"), ("rank", "0"))
    assert m[("redsrv_worker_bytes_pushed_total", labels)] == 1024
    assert m[("redsrv_worker_operations_total", labels)] == 1


def test_the_metrics_endpoint_binds_the_reducers_host_unless_told_otherwise(procs) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    reducer = procs.start_reducer("--metrics-port", str(port))  # the fixture binds the reducer to 127.0.0.1
    scrape(port)  # served on the reducer's address
    bound = [c.laddr for c in __import__("psutil").Process(reducer.proc.pid).net_connections("tcp")
             if c.status == "LISTEN" and c.laddr.port == port]
    assert [address.ip for address in bound] == ["127.0.0.1"], bound


def test_reducer_metrics_say_who_holds_the_memory_and_who_waited_or_lost_it(procs) -> None:  # type: ignore[no-untyped-def]
    """Job a's rank 0 fills a 4 MiB budget with chunks its rank 1 never sends; job b waits for
    memory, and a's stalled chunks are failed (a over its fair share): the counters name both."""
    port, budget = free_port(), 4 << 20
    reducer = procs.start_reducer("--metrics-port", str(port), "--memory-budget", str(budget), env={
        "REDSRV_JOB_BUDGET_BYTES": str(budget), "REDSRV_SLOW_PUSH_GRACE": "0.5", "REDSRV_STALL_WARNING": "0.2"})
    failures: list[BaseException] = []

    def hold() -> None:
        with redsrv.Client([reducer.address], rank=0, world_size=2, job="a", op_timeout=30) as c:
            with pytest.raises(redsrv.PeerError, match="fair share"):
                c.allreduce(np.ones(1 << 20, np.float32))

    t = threading.Thread(target=lambda: failures.extend(_raised(hold)))
    t.start()
    wait_for_open_operations(reducer.log, 1)
    with redsrv.Client([reducer.address], rank=0, world_size=1, job="b", op_timeout=30) as c:
        assert c.allreduce(np.ones(1 << 18, np.float32)).sum() == 1 << 18
    t.join(30)
    assert not t.is_alive() and not failures, failures
    m = scrape(port)
    a, b = (("job", "a"),), (("job", "b"),)
    assert m[("redsrv_reducer_memory_waits_total", b)] >= 1 and m[("redsrv_reducer_memory_refusals_total", b)] == 0
    assert m[("redsrv_reducer_chunks_reclaimed_total", a)] >= 1 and m[("redsrv_reducer_reclaimed_bytes_total", a)] > 0
    assert m[("redsrv_reducer_slow_pushes_dropped_total", a)] == 0
    assert m[("redsrv_reducer_memory_budget_bytes", ())] == budget
    assert m[("redsrv_reducer_fair_share_bytes", ())] >= 1 << 20 and m[("redsrv_reducer_memory_pressure", ())] == 0


def _raised(run) -> list[BaseException]:  # type: ignore[no-untyped-def]
    try:
        run()
    except BaseException as exc:  # reported by the test's thread
        return [exc]
    return []
