"""Both ends of every data connection use the configured TCP congestion control, and a kernel
that refuses it costs one warning per process, never a failed job; a reducer given a receive
buffer bounds the window of every connection it accepts (constants.RECOMMENDED_RECV_BUFFER_BYTES)."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

import redsrv
from redsrv.core.transport import congestion_control

pytestmark = pytest.mark.timeout(60)


@contextmanager
def _reduced_on_two_ranks(tcp_congestion: str = "reno", **reducer_settings: int) -> Iterator[
        tuple[redsrv.ReducerDaemon, list[redsrv.Client]]]:
    """An in-process reducer and two clients, both asking for ``tcp_congestion``, after one
    all-reduce whose exact result is checked; everything is closed on exit."""
    daemon = redsrv.ReducerDaemon(redsrv.DaemonSettings(host="127.0.0.1", port=0, close_timeout=2,
                                                        tcp_congestion=tcp_congestion, **reducer_settings))
    host, port = daemon.start()
    clients: list[redsrv.Client] = []
    try:
        clients = [redsrv.Client([f"{host}:{port}"], rank=r, world_size=2, job="cc", tcp_congestion=tcp_congestion,
                                 chunk_bytes=4096) for r in range(2)]
        futures = [c.allreduce_async(np.full(10_000, r + 1, dtype=np.float32)) for r, c in enumerate(clients)]
        for c, f in zip(clients, futures):
            assert np.array_equal(c.wait(f), np.full(10_000, 3, dtype=np.float32))
        yield daemon, clients
    finally:
        for c in clients:
            c.close()
        daemon.stop()


def test_worker_and_reducer_sockets_use_the_configured_algorithm() -> None:
    # reno: built into every Linux kernel and allowed to every user
    with _reduced_on_two_ranks("reno") as (daemon, clients):
        worker_side = [congestion_control(conn.sock) for c in clients for conn in c.connections()]
        reducer_side = [congestion_control(conn.sock) for conn in list(daemon._conns.values())]
    assert worker_side and set(worker_side) == {"reno"}
    assert reducer_side and set(reducer_side) == {"reno"}


def test_an_algorithm_the_kernel_refuses_is_one_warning_per_process_and_the_job_still_runs(caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.WARNING)
    with _reduced_on_two_ranks("no_such_cc"):
        pass
    warnings = [r.getMessage() for r in caplog.records if "congestion control 'no_such_cc'" in r.getMessage()]
    worker_warnings = [w for w in warnings if w.startswith("rank ")]
    reducer_warnings = [w for w in warnings if not w.startswith("rank ")]
    assert len(worker_warnings) == 2 and len(reducer_warnings) == 1, warnings
    assert "REDSRV_TCP_CONGESTION=system" in warnings[0] and "tcp_allowed_congestion_control" in warnings[0]


def _receive_buffers(daemon: redsrv.ReducerDaemon) -> list[int]:
    return [conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) for conn in list(daemon._conns.values())]


def test_the_reducer_bounds_the_receive_window_of_every_connection_where_told_and_leaves_autotuning_by_default() -> None:
    with socket.socket() as probe:
        untouched = probe.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    with _reduced_on_two_ranks(recv_buffer_bytes=256 * 1024) as (daemon, _):
        bounded = _receive_buffers(daemon)
    with _reduced_on_two_ranks(recv_buffer_bytes=32 * 1024) as (daemon, _):
        smaller = _receive_buffers(daemon)
    with _reduced_on_two_ranks() as (daemon, _):
        autotuned = _receive_buffers(daemon)
    # Linux books twice what SO_RCVBUF asks for (half for its own overhead), and reports that.
    assert len(bounded) == 2 and set(bounded) == {2 * 256 * 1024}, bounded
    assert len(smaller) == 2 and set(smaller) == {2 * 32 * 1024}, smaller
    # Left to the kernel, a buffer starts at its default and autotuning may only have grown it.
    assert len(autotuned) == 2 and all(b >= untouched for b in autotuned), (autotuned, untouched)
    assert not set(autotuned) & {2 * 256 * 1024, 2 * 32 * 1024}, autotuned
