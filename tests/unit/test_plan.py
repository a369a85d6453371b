"""The sizing advisor: the reducer count and the predicted speed-up follow the model."""

from __future__ import annotations

import json

import pytest

from redsrv.cli.plan import (
    CLIENT_GIL_SHARE,
    DEFAULT_IO_THREAD_GBPS,
    REDUCER_IO,
    RESULT_LAG_PIECES,
    WORKER_IO,
    WORKER_NIC,
    measure_core_gbps,
    measure_data_path,
    plan,
)

#: A data path far above any NIC here, for the tests of the network terms alone.
FAST_PATH = {"worker_io_gbps": 1000.0, "reducer_io_gbps": 1000.0}


def test_recommends_matching_aggregate_bandwidth() -> None:
    p = plan(workers=16, worker_gbit=100, reducer_gbit=50, reducer_cores=64, **FAST_PATH)
    assert p.reducers == 32 and p.bottleneck == WORKER_NIC
    assert p.warnings == ()
    assert p.speedup == pytest.approx(2 * 15 / 16)


def test_too_few_reducers_warns_predicts_the_loss_and_bounds_the_reducers_receive_windows() -> None:
    p = plan(workers=4, worker_gbit=1, reducer_gbit=1, reducer_cores=8, reducers=2)
    assert p.bottleneck == "reducer NIC"
    assert p.speedup == pytest.approx(0.75)  # BENCH.md measured 0.65x for this fleet
    assert p.recv_buffer_bytes == 256 * 1024
    assert any("below aggregate worker bandwidth" in w and "set REDSRV_RECV_BUFFER_BYTES=262144 on the reducers" in w
               for w in p.warnings)
    # Reducers that keep up with the workers keep the kernel's autotuned windows.
    assert plan(workers=4, worker_gbit=1, reducer_gbit=1, reducer_cores=8, reducers=4).recv_buffer_bytes == 0


def test_the_advised_window_fits_every_workers_window_in_half_the_switch_ports_buffer_where_it_is_known() -> None:
    def advised(workers: int, buffer: int | None) -> int:
        return plan(workers=workers, worker_gbit=1, reducer_gbit=1, reducer_cores=8, reducers=workers // 2,
                    port_buffer_bytes=buffer).recv_buffer_bytes

    assert advised(8, None) == 256 * 1024  # unknown buffer: the most the plan advises
    assert advised(8, 2_500_000) == 152 * 1024  # 2.5 MB / 2 over 8 workers, whole KiB
    assert advised(2, 2_500_000) == 256 * 1024  # never above the maximum
    assert advised(8, 750_000) == 96 * 1024  # never below the window a connection needs
    with pytest.raises(ValueError, match="switch port's buffer must be positive"):
        advised(8, 0)


def test_a_bad_switch_buffer_flag_is_a_configuration_error(capsys) -> None:  # type: ignore[no-untyped-def]
    from redsrv.cli import main

    assert main(["plan", "--workers", "4", "--worker-gbit", "1", "--reducer-gbit", "1", "--reducers", "2",
                 "--switch-buffer-kib", "0"]) == 2
    assert "switch port's buffer must be positive" in capsys.readouterr().err
    assert main(["plan", "--workers", "4", "--worker-gbit", "1", "--reducer-gbit", "1", "--reducers", "2",
                 "--switch-buffer-kib", "750"]) == 0
    out = capsys.readouterr().out
    assert "REDSRV_RECV_BUFFER_BYTES=98304 on the reducers" in out and "sized for the port's buffer you gave" in out


def test_cpu_bound_reducers_need_more_of_them() -> None:
    p = plan(workers=8, worker_gbit=200, reducer_gbit=200, reducer_cores=4, core_gbps=1.0, **FAST_PATH)
    assert p.reducers == 50  # 8 x 25 GB/s of input over 4 GB/s per reducer
    assert p.bottleneck in ("reducer CPU", WORKER_NIC)


def test_network_bound_worker_below_its_data_path_reaches_line_rate() -> None:
    # 16 Gbit/s = 2.0 GB/s, under one I/O thread's 2.44 GB/s: the NIC is the limit.
    p = plan(workers=8, worker_gbit=16, reducer_gbit=16, reducer_cores=8)
    assert p.bottleneck == WORKER_NIC and not p.worker_cpu_bound
    assert p.algbw_gbps == pytest.approx(2.0) and p.line_rate_fraction == pytest.approx(1.0)
    assert p.speedup == pytest.approx(2 * 7 / 8)


def test_a_100_gbit_worker_is_cpu_bound_on_one_io_thread() -> None:
    p = plan(workers=64, worker_gbit=100, reducer_gbit=32, reducer_cores=8, io_threads=1)
    assert p.bottleneck == WORKER_IO and p.worker_cpu_bound and p.worker_io_threads == 1
    assert p.algbw_gbps == pytest.approx(DEFAULT_IO_THREAD_GBPS)
    assert p.line_rate_fraction == pytest.approx(DEFAULT_IO_THREAD_GBPS / 12.5)  # 20%, not 100%
    # Reducers sized for what the workers can send (64 x 2.44 GB/s over 4 GB/s per host), not for
    # their line rate (which would be 200), with two processes to fill each 32 Gbit/s NIC.
    assert (p.reducers, p.reducer_processes) == (40, 2)
    assert p.speedup == pytest.approx(DEFAULT_IO_THREAD_GBPS / (12.5 * 64 / 126))
    assert any("set REDSRV_IO_THREADS=3" in w for w in p.warnings)  # ceil(1 / 0.42): the GIL's cap


def test_the_plan_recommends_the_io_threads_that_fill_the_worker_nic() -> None:
    # Without the GIL (a free-threaded Python): ceil(12.5 / 2.44) = 6 threads fill 100 Gbit/s.
    p = plan(workers=64, worker_gbit=100, reducer_gbit=32, reducer_cores=8, gil_share=0)
    assert p.worker_io_threads == 6 and not p.worker_cpu_bound and p.bottleneck == WORKER_NIC
    assert p.line_rate_fraction == pytest.approx(1.0) and p.reducers == 200  # now sized for the line rate
    assert not any("REDSRV_IO_THREADS" in w for w in p.warnings)


def test_the_gil_caps_one_client_process_whatever_its_io_threads() -> None:
    p = plan(workers=64, worker_gbit=100, reducer_gbit=32, reducer_cores=8)
    assert p.worker_io_threads == 3 and p.worker_cpu_bound and p.bottleneck == WORKER_IO
    assert p.algbw_gbps == pytest.approx(DEFAULT_IO_THREAD_GBPS / CLIENT_GIL_SHARE)
    assert any("holds the GIL" in w and "several worker processes per host" in w for w in p.warnings)
    more = plan(workers=64, worker_gbit=100, reducer_gbit=32, reducer_cores=8, io_threads=8)
    assert more.algbw_gbps == pytest.approx(p.algbw_gbps)  # threads past the cap add nothing


@pytest.mark.parametrize(("gbit", "gil_share", "threads"),
                         [(19.5, CLIENT_GIL_SHARE, 1), (19.6, CLIENT_GIL_SHARE, 2), (39.0, CLIENT_GIL_SHARE, 2),
                          (39.1, CLIENT_GIL_SHARE, 3), (100, CLIENT_GIL_SHARE, 3), (100, 0.0, 6), (400, 0.0, 8)])
def test_recommended_io_threads_are_the_smallest_that_cover_the_nic_capped_by_the_cores_and_the_gil(
        gbit: float, gil_share: float, threads: int) -> None:
    p = plan(workers=4, worker_gbit=gbit, reducer_gbit=1000, reducer_cores=64, gil_share=gil_share)
    assert p.worker_io_threads == threads  # 8 cores by default: 400 Gbit/s gets 8, not ceil(50 / 2.44) = 21
    ceiling = 8 * DEFAULT_IO_THREAD_GBPS if gil_share == 0 else DEFAULT_IO_THREAD_GBPS / gil_share
    assert p.worker_cpu_bound == (gbit / 8 > ceiling)


def test_io_threads_one_per_core_already_says_so() -> None:
    p = plan(workers=8, worker_gbit=100, reducer_gbit=100, reducer_cores=32, worker_cores=2)
    assert p.worker_io_threads == 2 and p.bottleneck == WORKER_IO
    assert p.algbw_gbps == pytest.approx(2 * DEFAULT_IO_THREAD_GBPS)
    assert any("one per core of its 2 already" in w for w in p.warnings)


def test_a_client_has_no_more_io_threads_than_reducer_addresses() -> None:
    # One reducer process on one host: a client loop serves whole reducers, so one loop.
    p = plan(workers=2, worker_gbit=100, reducer_gbit=100, reducer_cores=32, reducers=1, reducer_processes=1)
    assert p.worker_io_threads == 1 and p.worker_cpu_bound
    assert any("list at least 3 reducer addresses" in w for w in p.warnings)


def test_worker_ceiling_scales_the_cpu_bound_prediction() -> None:
    slow = plan(workers=8, worker_gbit=100, reducer_gbit=100, reducer_cores=32, worker_io_gbps=1.0, io_threads=1)
    fast = plan(workers=8, worker_gbit=100, reducer_gbit=100, reducer_cores=32, worker_io_gbps=2.0, io_threads=1)
    assert slow.algbw_gbps == pytest.approx(1.0) and fast.algbw_gbps == pytest.approx(2.0)


@pytest.mark.parametrize("ceiling", [1.0, 2.44, 5.0])
def test_crossover_from_network_to_cpu_at_eight_times_the_ceiling(ceiling: float) -> None:
    crossover_gbit = ceiling * 8
    below = plan(workers=4, worker_gbit=crossover_gbit * 0.99, reducer_gbit=1000, reducer_cores=64, worker_io_gbps=ceiling,
                 io_threads=1)
    above = plan(workers=4, worker_gbit=crossover_gbit * 1.01, reducer_gbit=1000, reducer_cores=64, worker_io_gbps=ceiling,
                 io_threads=1)
    assert below.bottleneck == WORKER_NIC and below.line_rate_fraction == pytest.approx(1.0)
    assert above.bottleneck == WORKER_IO and above.algbw_gbps == pytest.approx(ceiling)
    assert above.line_rate_fraction == pytest.approx(1 / 1.01)


def test_one_reducer_process_caps_a_fast_reducer_host_and_more_lift_it() -> None:
    capped = plan(workers=8, worker_gbit=100, reducer_gbit=100, reducer_cores=32, reducers=8, reducer_processes=1,
                  worker_io_gbps=1000.0)
    assert capped.bottleneck == REDUCER_IO and capped.algbw_gbps == pytest.approx(DEFAULT_IO_THREAD_GBPS)
    assert any("redsrv reducer --processes 6" in w for w in capped.warnings)  # ceil(12.5 / 2.44)
    lifted = plan(workers=8, worker_gbit=100, reducer_gbit=100, reducer_cores=32, reducers=8, worker_io_gbps=1000.0)
    assert lifted.reducer_processes == 6 and lifted.bottleneck == WORKER_NIC


def test_invalid_inputs() -> None:
    with pytest.raises(ValueError):
        plan(workers=1, worker_gbit=1, reducer_gbit=1, reducer_cores=1)
    with pytest.raises(ValueError):
        plan(workers=2, worker_gbit=1, reducer_gbit=1, reducer_cores=1, worker_io_gbps=0)
    with pytest.raises(ValueError):
        plan(workers=2, worker_gbit=1, reducer_gbit=1, reducer_cores=1, reducer_processes=0)
    with pytest.raises(ValueError):
        plan(workers=2, worker_gbit=1, reducer_gbit=1, reducer_cores=1, io_threads=0)
    with pytest.raises(ValueError):
        plan(workers=2, worker_gbit=1, reducer_gbit=1, reducer_cores=1, worker_cores=0)
    with pytest.raises(ValueError):
        plan(workers=2, worker_gbit=1, reducer_gbit=1, reducer_cores=1, gil_share=1.5)


def test_measure_runs_the_real_state_machine() -> None:
    assert measure_core_gbps(seconds=0.2) > 0.05


def test_measure_data_path_over_a_real_reducer() -> None:
    m = measure_data_path(4 << 20, timeout=30)
    assert m.bytes_each_way == 4 << 20 and m.seconds > 0 and m.wall_gbps > 0
    assert m.worker_gbps_per_core >= m.wall_gbps * 0.99 and m.reducer_gbps_per_core > 0


def test_cli_measure_plans_with_what_it_measured(capsys: pytest.CaptureFixture[str]) -> None:
    from redsrv.cli import main

    assert main(["plan", "--workers", "4", "--worker-gbit", "100", "--reducer-gbit", "100", "--measure",
                 "--measure-mib", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    measured = out["measured"]
    assert measured["bytes_each_way"] == 2 << 20 and measured["reducer_cpu_s"] >= 0
    assert out["worker_io_gbps"] == measured["worker_gbps_per_core"] > 0
    assert out["reducer_io_gbps"] == measured["reducer_gbps_per_core"] > 0
    assert out["core_gbps"] == pytest.approx(measured["core_gbps"] / 2)


def test_an_all_reduce_takes_its_bytes_at_the_bottleneck_plus_the_results_lag_behind_the_pushes() -> None:
    # The lag is per operation: about RESULT_LAG_PIECES result pieces per reducer at the same rate
    # (docs/performance.md, "Scaling: n = 2..8"), so it weighs more with more reducers.
    mib, kib = 2**20, 2**10
    for n in (2, 4, 8):
        p = plan(workers=n, worker_gbit=8, reducer_gbit=8, reducer_cores=8, reducers=n, **FAST_PATH)
        assert p.algbw_gbps == pytest.approx(1.0)
        assert p.seconds(64 * mib) == pytest.approx((64 * mib + RESULT_LAG_PIECES * n * 512 * kib) / 1e9)
        assert p.ring_seconds(64 * mib) == pytest.approx(64 * mib * 2 * (n - 1) / n / 1e9)
    small = plan(workers=8, worker_gbit=8, reducer_gbit=8, reducer_cores=8, reducers=8, **FAST_PATH)
    assert small.seconds(64 * kib) == pytest.approx((1 + RESULT_LAG_PIECES) * 64 * kib / 1e9), "a span's worth at most"
    finer = plan(workers=8, worker_gbit=8, reducer_gbit=8, reducer_cores=8, reducers=8, piece_bytes=128 * kib, **FAST_PATH)
    assert finer.seconds(64 * mib) < small.seconds(64 * mib)
    whole = plan(workers=8, worker_gbit=8, reducer_gbit=8, reducer_cores=8, reducers=8, piece_bytes=0, **FAST_PATH)
    assert whole.piece_bytes == 4 * 2**20, "without cut-through the results trail by whole chunks (8 workers: 4 MiB)"
    larger = plan(workers=16, worker_gbit=8, reducer_gbit=8, reducer_cores=8, reducers=16, piece_bytes=0, **FAST_PATH)
    assert larger.piece_bytes == 2**20, "a job of more than 8 workers pushes 1 MiB chunks"
    with pytest.raises(ValueError, match="piece_bytes"):
        plan(workers=8, worker_gbit=8, reducer_gbit=8, reducer_cores=8, piece_bytes=-1)


def test_cli_predicts_one_all_reduce(capsys: pytest.CaptureFixture[str]) -> None:
    from redsrv.cli import main

    argv = ["plan", "--workers", "4", "--worker-gbit", "8", "--reducer-gbit", "8", "--reducers", "4", "--message-mib", "64"]
    assert main(argv) == 0
    assert "one all-reduce of 64 MiB" in capsys.readouterr().out
    assert main([*argv, "--piece-kib", "128", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["piece_bytes"] == 128 * 1024 and out["message_bytes"] == 64 * 2**20
    assert out["seconds"] > 64 * 2**20 / (out["algbw_gbps"] * 1e9) and out["ring_seconds"] > out["seconds"]


def test_cli_names_a_bad_flag_instead_of_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    from redsrv.cli import main

    base = ["plan", "--workers", "4", "--worker-gbit", "1", "--reducer-gbit", "1"]
    for extra, says in ((["--message-mib", "0"], "--message-mib must be > 0"), (["--gil-share", "2"], "gil_share")):
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert "configuration error" in err and says in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exited:  # not a size at all: argparse's usage error (cli/units.py)
        main([*base, "--piece-kib", "-1"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "argument --piece-kib: not a size: '-1'" in err and "Traceback" not in err


def test_reducer_processes_are_capped_by_the_cores() -> None:
    # A 100 Gbit/s host with two fast cores: two event loops move 4.88 GB/s, and no more fit.
    p = plan(workers=4, worker_gbit=100, reducer_gbit=100, reducer_cores=2, core_gbps=10.0, reducers=4,
             worker_io_gbps=1000.0)
    assert p.reducer_processes == 2 and p.bottleneck == REDUCER_IO
    assert p.algbw_gbps == pytest.approx(2 * DEFAULT_IO_THREAD_GBPS)
    assert any("one per core already" in w for w in p.warnings)


def test_cli_recommends_io_threads_in_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    from redsrv.cli import main

    assert main(["plan", "--workers", "8", "--worker-gbit", "100", "--reducer-gbit", "100", "--reducer-cores", "32",
                 "--gil-share", "0"]) == 0
    assert "6 I/O thread(s) x 2.44 GB/s: set REDSRV_IO_THREADS=6)  (recommended)" in capsys.readouterr().out
    assert main(["plan", "--workers", "8", "--worker-gbit", "100", "--reducer-gbit", "100", "--reducer-cores", "32",
                 "--io-threads", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["worker_io_threads"] == 1 and out["worker_cpu_bound"]
    assert any("set REDSRV_IO_THREADS=3" in w for w in out["warnings"])


def test_several_workers_per_host_are_planned_as_hosts_that_reduce_inside_first() -> None:
    """The issue's case: 4 hosts x 2 workers at 300 Mbit/s, 4 reducers. Host-level reduction sends
    each host's gradient once (1.75x ring over 8 ranks); the flat path sends it twice (0.875x)."""
    p = plan(workers=4, worker_gbit=0.3, reducer_gbit=0.3, reducer_cores=8, workers_per_host=2)
    assert p.reducers == 4 and p.bottleneck == "worker NIC"
    assert round(p.speedup, 3) == 1.75 and round(p.flat_speedup or 0, 3) == 0.875
    assert round(p.theory_max_speedup, 3) == 1.75
    # A host's L clients share its NIC: 8 processes need one I/O thread each for 100 Gbit/s.
    fast = plan(workers=4, worker_gbit=100, reducer_gbit=100, reducer_cores=32, workers_per_host=8)
    assert fast.worker_io_threads == 1 and fast.bottleneck == "worker NIC"
    with pytest.raises(ValueError, match="worker process per host"):
        plan(workers=4, worker_gbit=1, reducer_gbit=1, reducer_cores=8, workers_per_host=0)
