"""``redsrv bench emulate --crosscheck``: `redsrv bench allreduce` run on the emulated hosts as a
user would run it, compared with the emulation's own figures (benchmarks/crosscheck.py).

The smoke run checks that the comparison happens and its figures are sane, not that they agree
within 5%: on a shared machine that is a benchmark's finding (docs/performance.md), not a
unit test's."""

from __future__ import annotations

import importlib.util
import os

import psutil
import pytest

from redsrv.bench import crosscheck
from redsrv.bench.emulate import Options, run_emulate
from redsrv.bench.netns import EmulationError, our_namespaces
from redsrv.bench.report import Row

from tests_support import why_no_namespaces

REASON = why_no_namespaces()
HAS_TORCH = importlib.util.find_spec("torch") is not None


def _row(impl: str, size: int, median: float, n: int = 2) -> Row:
    return Row(n=n, m=n, size_bytes=size, impl=impl, reps=5, rounds=1, median_s=median, min_s=median, max_s=median,
               algbw_gbps=1.0, bound_gbps=1.0, fraction_of_bound=1.0, round_medians_s=[median], cpu_busy=0.5,
               cpu_busy_max=0.5, cpu_steal=0.0, own_cpu_share=0.4, cpu_s_per_gb=1.0, correct=True)


def test_the_comparison_pairs_sizes_and_implementations_and_judges_the_5_percent_bound() -> None:
    rows = [_row("gloo", 1024, 0.100), _row("redsrv", 1024, 0.050), _row("redsrv", 1024, 9.0, n=4)]
    got = crosscheck.compare(rows, [{"impl": "gloo", "size_bytes": 1024, "median_s": 0.104},
                                    {"impl": "redsrv", "size_bytes": 1024, "median_s": 0.056},
                                    {"impl": "redsrv", "size_bytes": 4096, "median_s": 1.0}], n=2)
    assert [(c["impl"], round(c["ratio"], 3), c["agrees"]) for c in got] == [("gloo", 1.04, True), ("redsrv", 1.12, False)]
    text = crosscheck.format_comparison(got)
    assert "1 of 2 within 5%" in text and "(over 5%)" in text


def test_crosscheck_refuses_settings_the_allreduce_bench_does_not_take() -> None:
    with pytest.raises(EmulationError, match="--crosscheck compares"):
        Options(workers=(2,), crosscheck=True, wire_dtype="bf16").validate()
    with pytest.raises(EmulationError, match="--crosscheck compares"):
        Options(workers=(2,), crosscheck=True, chunk_bytes=65536).validate()


@pytest.mark.netns
@pytest.mark.timeout(150)
@pytest.mark.skipif(REASON is not None or not HAS_TORCH, reason=REASON or "needs torch for the gloo baseline")
def test_the_allreduce_bench_runs_on_the_emulated_hosts_and_is_compared(tmp_path) -> None:
    prefix = f"rsx{os.getpid() % 100000}"
    doc = run_emulate(Options(workers=(2,), reducers=2, rate_bps=10**9, sizes_bytes=(4 * 2**20,), reps=4, warmup=1,
                              rounds=1, out=str(tmp_path), prefix=prefix, quiet=True, crosscheck=True))
    assert our_namespaces(prefix) == [], "namespaces left behind"
    children = [c for c in psutil.Process().children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE]
    assert not children, f"processes left behind: {[c.cmdline() for c in children]}"
    assert doc["ok"]
    compared = {c["impl"]: c for c in doc["crosscheck"]}
    assert set(compared) == {"gloo", "redsrv"}
    for c in compared.values():
        # 4 MiB cannot cross a 1 Gbit/s link in under 4 MiB / 125 MB/s = 34 ms: both benches
        # ran on the emulated, rate-limited hosts.
        assert c["allreduce_median_s"] > 0.030 and c["emulate_median_s"] > 0.030, c
        assert 0.5 < c["ratio"] < 2.0, f"the two benchmarks disagree beyond any noise: {c}"
