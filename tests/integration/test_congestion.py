"""Both ends of every data connection use the configured TCP congestion control, and a kernel
that refuses it costs one warning per process, never a failed job."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import redsrv
from redsrv.core.transport import congestion_control

pytestmark = pytest.mark.timeout(60)


def _fleet(tcp_congestion: str) -> redsrv.ReducerDaemon:
    daemon = redsrv.ReducerDaemon(redsrv.DaemonSettings(host="127.0.0.1", port=0, close_timeout=2,
                                                        tcp_congestion=tcp_congestion))
    daemon.start()
    return daemon


def _reduce_on_two_ranks(address: str, tcp_congestion: str) -> tuple[list[redsrv.Client], list[np.ndarray]]:
    clients = [redsrv.Client([address], rank=r, world_size=2, job="cc", tcp_congestion=tcp_congestion,
                             chunk_bytes=4096) for r in range(2)]
    data = [np.full(10_000, r + 1, dtype=np.float32) for r in range(2)]
    futures = [c.allreduce_async(x) for c, x in zip(clients, data)]
    return clients, [c.wait(f) for c, f in zip(clients, futures)]


def test_worker_and_reducer_sockets_use_the_configured_algorithm() -> None:
    daemon = _fleet("reno")  # reno: built into every Linux kernel and allowed to every user
    clients: list[redsrv.Client] = []
    try:
        assert daemon.address is not None
        clients, results = _reduce_on_two_ranks(f"{daemon.address[0]}:{daemon.address[1]}", "reno")
        for result in results:
            assert np.array_equal(result, np.full(10_000, 3, dtype=np.float32))
        worker_side = [congestion_control(s.sock) for c in clients for streams in c._streams for s in streams]
        reducer_side = [congestion_control(conn.sock) for conn in list(daemon._conns.values())]
        assert worker_side and set(worker_side) == {"reno"}
        assert reducer_side and set(reducer_side) == {"reno"}
    finally:
        for c in clients:
            c.close()
        daemon.stop()


def test_an_algorithm_the_kernel_refuses_is_one_warning_per_process_and_the_job_still_runs(caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.WARNING)
    daemon = _fleet("no_such_cc")
    clients: list[redsrv.Client] = []
    try:
        assert daemon.address is not None
        clients, results = _reduce_on_two_ranks(f"{daemon.address[0]}:{daemon.address[1]}", "no_such_cc")
        for result in results:
            assert np.array_equal(result, np.full(10_000, 3, dtype=np.float32))
    finally:
        for c in clients:
            c.close()
        daemon.stop()
    warnings = [r.getMessage() for r in caplog.records if "congestion control 'no_such_cc'" in r.getMessage()]
    worker_warnings = [w for w in warnings if w.startswith("rank ")]
    reducer_warnings = [w for w in warnings if not w.startswith("rank ")]
    assert len(worker_warnings) == 2 and len(reducer_warnings) == 1, warnings
    assert "REDSRV_TCP_CONGESTION=system" in warnings[0] and "tcp_allowed_congestion_control" in warnings[0]
