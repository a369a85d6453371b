"""``redsrv bench emulate`` without running a benchmark: rates, bounds, summaries, the checks that
must fail before anything is created, and the queues a cluster is built with."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from redsrv.bench import report
from redsrv.bench.emulate import Options
from redsrv.bench.netns import (
    DEFAULT_GSO_BYTES,
    HOST_GSO_SECONDS,
    HOST_QUEUE_MIN_BYTES,
    MAX_HOSTS,
    QUEUE_LATENCY_MS,
    Cluster,
    EmulationError,
    our_namespaces,
    parse_rate,
    tcp_goodput_bps,
)
from redsrv.core.config import Config


@pytest.mark.parametrize("text,bps", [("1gbit", 10**9), ("500Mbit", 5 * 10**8), ("2.5gbit", 25 * 10**8),
                                      ("100kbit", 10**5), ("none", 0), ("0", 0)])
def test_parse_rate(text, bps):
    assert parse_rate(text) == bps


@pytest.mark.parametrize("text", ["1g", "fast", "1 gbps", "-1gbit", "", "5bit", "2000gbit"])
def test_bad_rate_is_a_clear_error(text):
    with pytest.raises(EmulationError, match="rate"):
        parse_rate(text)


def test_goodput_matches_the_measured_fraction():
    assert tcp_goodput_bps(10**9) / 8 / 1e9 == pytest.approx(0.1196, abs=5e-4)


def test_bounds_and_theory():
    g = 0.12
    assert report.ring_bound(g, 4) == pytest.approx(0.08)
    assert report.server_bound(g, 4, 4) == pytest.approx(g)
    assert report.server_bound(g, 4, 2) == pytest.approx(g / 2)
    assert report.theory_speedup(4, 4) == pytest.approx(1.5)
    assert report.theory_speedup(2, 2) == pytest.approx(1.0)
    # bf16 on the wire halves every byte redsrv moves; gloo keeps float32.
    assert report.theory_speedup(4, 4, compression=2.0) == pytest.approx(3.0)
    assert report.server_bound(g, 4, 4, compression=2.0) == pytest.approx(2 * g)
    # Colocated reducers share the workers' links: no better than the ring.
    assert report.theory_speedup(4, 4, colocated=True) == pytest.approx(1.0)


def _block(impl, rnd, times, busy=0.5):
    workers = [0.25] * 4 if impl == "gloo" else [0.125] * 4  # redsrv: the reducers used the other half
    return {"n": 4, "m": 4, "round": rnd, "size_bytes": 64 * 2**20, "impl": impl, "times": times, "correct": True,
            "cpu_busy": busy, "cpu_s": 1.0, "worker_cpu_s": workers, "wall_s": sum(times), "cores": 2}


def test_summary_speedup_is_the_ratio_of_medians():
    blocks = [_block("gloo", 0, [0.9, 0.9, 0.9]), _block("redsrv", 0, [0.6, 0.6, 0.6]),
              _block("gloo", 1, [0.8, 0.8, 0.8]), _block("redsrv", 1, [0.6, 0.6, 0.6], busy=0.9)]
    rows = report.summarise(blocks, goodput=0.1196, colocated=False)
    gloo, red = rows
    assert (gloo.impl, red.impl) == ("gloo", "redsrv")
    assert gloo.median_s == pytest.approx(0.85)
    assert red.speedup == pytest.approx(0.85 / 0.6)
    assert (red.speedup_min, red.speedup_max) == (pytest.approx(0.8 / 0.6), pytest.approx(0.9 / 0.6))
    assert red.theory == pytest.approx(1.5)
    assert red.fraction_of_bound == pytest.approx(64 * 2**20 / 0.6 / 1e9 / 0.1196)
    assert red.cpu_busy_max == 0.9
    reduced_gb = 4 * 64 * 2**20 * 6 / 1e9  # n x size x reps, over both rounds
    assert (gloo.cpu_s_per_gb, gloo.worker_cpu_s_per_gb) == (pytest.approx(2 / reduced_gb), pytest.approx(2 / reduced_gb))
    assert (red.cpu_s_per_gb, red.worker_cpu_s_per_gb) == (pytest.approx(2 / reduced_gb), pytest.approx(1 / reduced_gb))
    table = report.format_table(rows)
    assert "1.42x (1.50x)" in table and "64 MiB" in table
    assert f"{2 / reduced_gb:.2f} ({1 / reduced_gb:.2f})" in table


def test_summary_gives_the_share_of_our_cpu_in_user_space():
    # redsrv: of 1 CPU s per block, 0.4 in user space
    blocks = [dict(_block("redsrv", r, [0.6]), cpu_user_s=0.4) for r in range(3)]
    blocks.append(_block("gloo", 0, [0.9]))  # a block from before the split: no user time
    rows = {r.impl: r for r in report.summarise(blocks, goodput=0.1196, colocated=False)}
    assert (rows["redsrv"].user_share, rows["gloo"].user_share) == (pytest.approx(0.4), 0.0)
    assert "  40%  " in report.format_table([rows["redsrv"]])
    assert rows["redsrv"].as_dict()["user_share"] == pytest.approx(0.4)


def test_cpu_meter_tells_user_space_from_the_kernel():
    from redsrv.bench import harness

    meter = harness.CpuMeter([])
    meter.start()
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:  # the interpreter: user time (the clock itself is a system call)
        sum(range(100_000))
    meter.stop()
    spun = meter.fields()
    assert spun["cpu_s"] >= 0.25 and spun["cpu_user_s"] >= 0.8 * spun["cpu_s"], spun
    meter = harness.CpuMeter([])
    meter.start()
    deadline = time.process_time() + 0.3
    with open("/dev/zero", "rb", buffering=0) as zero:
        while time.process_time() < deadline:  # the kernel's copies: system time
            zero.read(1 << 20)
    meter.stop()
    copied = meter.fields()
    assert copied["cpu_s"] >= 0.25 and copied["cpu_user_s"] <= 0.5 * copied["cpu_s"], copied


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    blocks = [_block("gloo", 0, [0.9]), _block("redsrv", 0, [0.6])]
    blocks += [dict(b, n=2, m=2) for b in blocks]
    rows = report.summarise(blocks, goodput=0.1196, colocated=False)
    path = tmp_path / "p.png"
    report.plot(rows, str(path), goodput=0.1196, rate_bps=10**9, title="t", colocated=False)
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_options_validation():
    with pytest.raises(EmulationError, match="at least 2 worker hosts"):
        Options(workers=(1,)).validate()
    with pytest.raises(EmulationError, match="memory"):
        Options(workers=(8,), sizes_bytes=(2**40,)).validate()
    with pytest.raises(EmulationError, match="--chunks-per-span must be >= 1"):
        Options(chunks_per_span=0).validate()
    with pytest.raises(EmulationError, match="--send-lowat-kib must be >= 0"):
        Options(send_lowat_bytes=-1).validate()
    with pytest.raises(EmulationError, match="--piece-kib must be >= 0"):
        Options(result_piece_bytes=-1).validate()
    with pytest.raises(EmulationError, match=r"--goodput-flows must be in 1\.\.7"):  # one stream per other host
        Options(workers=(4,), goodput_flows=8).validate()
    with pytest.raises(EmulationError, match="--goodput-flows"):
        Options(goodput_flows=0).validate()
    Options(workers=(4,), goodput_flows=7).validate()
    # Only what a run sets reaches the workers' clients, under the Config field names; 0 is a setting.
    assert Options().client_options() == {}
    assert Options(chunks_per_span=64, streams=2, send_lowat_bytes=0).client_options() == {
        "chunks_per_span": 64, "streams_per_reducer": 2, "send_lowat_bytes": 0}
    Config(**Options(chunk_bytes=2**20, chunks_per_span=64, streams=2, send_lowat_bytes=0).client_options())
    assert Options(workers=(2, 4)).hosts == 8
    assert Options(workers=(4,), colocate=True).hosts == 4
    assert Options(workers=(4,), reducers=2).hosts == 6


needs_root = pytest.mark.skipif(os.geteuid() != 0 if hasattr(os, "geteuid") else True, reason="needs root")


@needs_root
def test_too_many_hosts_fails_before_creating_anything():
    prefix = f"rsu{os.getpid() % 100000}"
    with pytest.raises(EmulationError, match="do not fit"):
        Cluster(MAX_HOSTS + 1, 10**9, prefix=prefix).check()
    assert our_namespaces(prefix) == []


@needs_root
def test_existing_namespace_with_our_prefix_is_refused():
    prefix = f"rsu{os.getpid() % 100000}"
    subprocess.run(["ip", "netns", "add", f"{prefix}-h0"], check=True)
    try:
        with pytest.raises(EmulationError, match="already exist"):
            Cluster(2, 10**9, prefix=prefix).check()
        assert our_namespaces(prefix) == [f"{prefix}-h0"]  # ours to remove, not the check's
    finally:
        subprocess.run(["ip", "netns", "del", f"{prefix}-h0"], check=True)


def _queue_bytes(ns: str, dev: str) -> float:
    """How many bytes the tbf on ``dev`` queues before it drops (tc reports it as latency)."""
    shown = subprocess.run(["tc", "-j", "-n", ns, "qdisc", "show", "dev", dev], check=True, capture_output=True,
                           text=True, timeout=10).stdout
    (qdisc,) = json.loads(shown)
    assert qdisc["kind"] == "tbf"
    return float(qdisc["options"]["rate"] * qdisc["options"]["lat"] / 1e6)


def _gso_max_size(ns: str, dev: str) -> int:
    shown = subprocess.run(["ip", "-j", "-d", "-n", ns, "link", "show", dev], check=True, capture_output=True,
                           text=True, timeout=10).stdout
    (link,) = json.loads(shown)
    return int(link["gso_max_size"])


@needs_root
def test_hosts_queue_at_least_host_queue_min_bytes_while_switch_ports_queue_20_ms():
    # At 400 Mbit/s a 20 ms queue is 1 MB, less than TCP small queues let eight flows put in a
    # host's own queue: the hosts dropped their own packets (see HOST_QUEUE_MIN_BYTES). Their
    # packets are capped at HOST_GSO_SECONDS of the rate, so that their own queue stays short.
    prefix = f"rsu{os.getpid() % 100000}"
    rate_bps = 400 * 10**6
    with Cluster(2, rate_bps, prefix=prefix) as cluster:
        queues = [(_queue_bytes(h.ns, "eth0"), _queue_bytes(cluster.switch, f"p{h.index}")) for h in cluster.hosts]
        gso = [_gso_max_size(h.ns, "eth0") for h in cluster.hosts]
    assert our_namespaces(prefix) == []
    for host_queue, port_queue in queues:
        assert host_queue >= HOST_QUEUE_MIN_BYTES * 0.99
        assert port_queue == pytest.approx(rate_bps / 8 * QUEUE_LATENCY_MS / 1000, rel=0.02)
    assert gso == [int(rate_bps / 8 * HOST_GSO_SECONDS)] * 2 == [25000] * 2


@needs_root
def test_from_1_gbit_the_hosts_keep_the_kernels_packet_size_and_a_given_size_wins():
    prefix = f"rsu{os.getpid() % 100000}"
    with Cluster(2, 2 * 10**9, prefix=prefix) as cluster:
        gso = [_gso_max_size(h.ns, "eth0") for h in cluster.hosts]
    with Cluster(2, 300 * 10**6, prefix=prefix, gso_bytes=DEFAULT_GSO_BYTES) as cluster:
        given = [_gso_max_size(h.ns, "eth0") for h in cluster.hosts]
    assert our_namespaces(prefix) == []
    assert gso == given == [DEFAULT_GSO_BYTES] * 2


@needs_root
def test_a_host_packet_outside_the_mtu_and_64_kib_is_a_clear_error():
    for size in (1000, DEFAULT_GSO_BYTES + 1):
        with pytest.raises(EmulationError, match="largest packet"):
            Cluster(2, 10**9, gso_bytes=size).check()


def test_not_root_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(EmulationError, match="needs root"):
        Cluster(2, 10**9).check()


def test_missing_ip_is_a_clear_error(monkeypatch):
    import shutil

    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "ip" else "/bin/" + name)
    with pytest.raises(EmulationError, match="ip not found"):
        Cluster(2, 10**9).check()


def test_cli_bad_rate_exits_2_and_creates_nothing(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "redsrv", "bench", "emulate", "--rate", "fast", "--prefix", "rsbad",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "bad rate 'fast'" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_result_files_record_how_fast_the_machine_was():
    from redsrv.bench import harness

    speed = harness.provenance(None)["machine"]["speed"]
    assert speed["python_msteps_per_s"] > 0 and speed["numpy_add_gbps"] > 0
    assert f"{speed['numpy_add_gbps']:g} GB/s" in harness.describe_speed(speed)


def test_several_workers_per_host_options_and_bounds():
    assert Options(workers_per_host=2).host_level and not Options().host_level
    assert not Options(workers_per_host=2, host_reduce="flat").host_level
    with pytest.raises(EmulationError, match="--compare-flat compares host-level reduction"):
        Options(compare_flat=True).validate()
    with pytest.raises(EmulationError, match="--host-piece-kib sets the host-level pipeline"):
        Options(host_piece_bytes=2**20).validate()
    Options(workers_per_host=2, compare_flat=True, host_piece_bytes=2**20).validate()
    # 4 hosts x 2 workers, m = 4: ring over 8 ranks, host-level once per host, flat twice
    g = 0.1
    assert report.bound_of("gloo", g, 4, 4, per_host=2) == report.ring_bound(g, 8)
    assert report.bound_of("redsrv", g, 4, 4, per_host=2) == g
    assert report.bound_of("redsrv-flat", g, 4, 4, per_host=2) == g / 2
    blocks = [{"n": 4, "m": 4, "per_host": 2, "round": 0, "size_bytes": 32 << 20, "impl": impl, "times": [t],
               "cpu_busy": 0.5, "cpu_s": 1.0, "wall_s": t, "correct": True}
              for impl, t in (("gloo", 1.75), ("redsrv", 1.0), ("redsrv-flat", 2.0))]
    rows = {r.impl: r for r in report.summarise(blocks, goodput=g, colocated=False)}
    assert round(rows["redsrv"].theory or 0, 3) == 1.75 and round(rows["redsrv-flat"].theory or 0, 3) == 0.875
    assert rows["redsrv"].speedup == 1.75 and rows["redsrv-flat"].speedup == 0.875
    assert rows["redsrv"].per_host == 2


def test_other_load_counts_other_processes_and_not_the_runs_own():
    # A busy process that is not ours (reparented away from this test by its exiting shell), and
    # one of ours started inside the block: only the first is other load.
    from redsrv.bench import harness
    from redsrv.bench.local import cpu_seconds

    from tests_support import poll

    burn = "import time\nend = time.monotonic() + 20\nwhile time.monotonic() < end: pass"
    shell = subprocess.run(["sh", "-c", f'{sys.executable} -c "{burn}" >/dev/null 2>&1 & echo $!'],
                           capture_output=True, text=True, timeout=30)
    stranger = int(shell.stdout.strip())
    own = None
    try:
        with harness.OtherLoad() as others:
            own = subprocess.Popen([sys.executable, "-c", burn])
            poll(lambda: cpu_seconds(stranger) >= 0.5 and cpu_seconds(own.pid) >= 0.5, 30, "both burners using CPU")
        assert others.by_pid.get(stranger, 0.0) >= 0.3, others.by_pid
        assert own.pid not in others.by_pid, others.by_pid
        assert 0 < others.share <= 1.0
    finally:
        os.kill(stranger, signal.SIGKILL)
        if own is not None:
            own.kill()
            own.wait(10)
