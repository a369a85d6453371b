"""Prometheus metrics for reducers (``redsrv reducer --metrics-port P``) and workers.

The core keeps plain counters; this module turns them into Prometheus metric families at scrape
time, so the core needs no metrics library and nothing is counted twice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from redsrv.core.client import Client
    from redsrv.core.daemon import ReducerDaemon


def _require() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise SystemExit("metrics need prometheus-client: pip install 'redsrv[metrics]'") from None
    return prometheus_client


class ReducerCollector:
    """Reads a daemon's per-job counters at each scrape."""

    def __init__(self, daemon: ReducerDaemon) -> None:
        self.daemon = daemon

    def collect(self):  # type: ignore[no-untyped-def]
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        from redsrv.core.reducer import LATENCY_BUCKETS

        snap = self.daemon.snapshot()
        c_in = CounterMetricFamily("redsrv_reducer_bytes_in", "Contribution bytes received", labels=["job"])
        c_out = CounterMetricFamily("redsrv_reducer_bytes_out", "Result bytes sent", labels=["job"])
        closed = CounterMetricFamily("redsrv_reducer_chunks_closed", "Chunks reduced and answered", labels=["job"])
        failed = CounterMetricFamily("redsrv_reducer_chunks_failed", "Chunks failed, by reason", labels=["job", "reason"])
        rejected = CounterMetricFamily("redsrv_reducer_contributions_rejected", "Contributions rejected, by reason",
                                       labels=["job", "reason"])
        latency = HistogramMetricFamily("redsrv_reducer_chunk_latency_seconds",
                                        "From a chunk's first contribution to its result", labels=["job"])
        late_sum = CounterMetricFamily("redsrv_reducer_rank_lateness_seconds",
                                       "Per rank: total seconds its contributions arrived after the chunk's first "
                                       "(straggler attribution)", labels=["job", "rank"])
        late_count = CounterMetricFamily("redsrv_reducer_rank_contributions", "Per rank: contributions received",
                                         labels=["job", "rank"])
        late_max = GaugeMetricFamily("redsrv_reducer_rank_lateness_max_seconds", "Per rank: worst lateness seen",
                                     labels=["job", "rank"])
        conns = GaugeMetricFamily("redsrv_reducer_connections", "Open worker connections", labels=["job"])
        inflight = GaugeMetricFamily("redsrv_reducer_inflight_bytes", "Bytes of the reducer's memory budget this job "
                                     "holds: open chunks, unsent results, results kept", labels=["job"])
        waits = CounterMetricFamily("redsrv_reducer_memory_waits", "Pushes that had to wait for memory (each wait once)",
                                    labels=["job"])
        refusals = CounterMetricFamily("redsrv_reducer_memory_refusals", "Pushes refused (OVERLOADED) after waiting "
                                       "their operation timeout for memory", labels=["job"])
        dropped = CounterMetricFamily("redsrv_reducer_slow_pushes_dropped", "Pushes dropped under memory pressure: "
                                      "slower than the minimum rate, or paused over the job's fair share",
                                      labels=["job"])
        reclaimed = CounterMetricFamily("redsrv_reducer_chunks_reclaimed", "Stalled chunks failed under memory pressure "
                                        "while their job held more than its fair share", labels=["job"])
        freed = CounterMetricFamily("redsrv_reducer_reclaimed_bytes", "Bytes those drops and failures freed",
                                    labels=["job"])
        for job, entry in snap.items():
            stats: Any = entry["stats"]
            c_in.add_metric([job], stats.bytes_in)
            c_out.add_metric([job], stats.bytes_out)
            closed.add_metric([job], stats.chunks_closed)
            for reason, n in stats.chunks_failed.items():
                failed.add_metric([job, reason], n)
            for reason, n in stats.rejected.items():
                rejected.add_metric([job, reason], n)
            cumulative, buckets = 0, []
            for bound, n in zip([*map(str, LATENCY_BUCKETS), "+Inf"], stats.latency_buckets):
                cumulative += n
                buckets.append((bound, cumulative))
            latency.add_metric([job], buckets, stats.latency_sum)
            for rank in sorted(stats.lateness_count):
                late_sum.add_metric([job, str(rank)], stats.lateness_sum[rank])
                late_count.add_metric([job, str(rank)], stats.lateness_count[rank])
                late_max.add_metric([job, str(rank)], stats.lateness_max[rank])
            conns.add_metric([job], entry["connections"])  # type: ignore[arg-type]
            inflight.add_metric([job], entry["inflight_bytes"])  # type: ignore[arg-type]
            waits.add_metric([job], stats.memory_waits)
            refusals.add_metric([job], stats.memory_refusals)
            dropped.add_metric([job], stats.pushes_dropped)
            reclaimed.add_metric([job], stats.chunks_reclaimed)
            freed.add_metric([job], stats.bytes_reclaimed)
        yield from (c_in, c_out, closed, failed, rejected, latency, late_sum, late_count, late_max, conns, inflight,
                    waits, refusals, dropped, reclaimed, freed)
        memory = self.daemon.memory()
        for name, value, what in (
                ("memory_budget_bytes", memory.budget, "The reducer-wide memory budget (--memory-budget)"),
                ("memory_held_bytes", memory.held, "Bytes of it held over every job"),
                ("active_jobs", memory.active_jobs, "Jobs that hold memory or pushed lately: they share the budget"),
                ("fair_share_bytes", memory.fair_share, "What each active job may always hold while the budget is "
                                                        "contended"),
                ("pushes_waiting", memory.waiting, "Pushes waiting for memory now"),
                ("memory_pressure", int(memory.pressure), "1 while a job within its fair share waits for memory")):
            yield GaugeMetricFamily(f"redsrv_reducer_{name}", what, value=value)


def serve_reducer_metrics(daemon: ReducerDaemon, port: int, host: str = "0.0.0.0") -> None:
    """Expose the daemon's metrics on http://host:port/metrics (a background thread)."""
    prometheus_client = _require()
    registry = prometheus_client.CollectorRegistry()
    registry.register(ReducerCollector(daemon))
    prometheus_client.start_http_server(port, addr=host, registry=registry)


class WorkerCollector:
    """A worker's view: bytes moved and operations completed or failed."""

    def __init__(self, client: Client) -> None:
        self.client = client

    def collect(self):  # type: ignore[no-untyped-def]
        from prometheus_client.core import CounterMetricFamily

        c = self.client
        labels = [c.config.job, str(c.rank)]
        pushed = CounterMetricFamily("redsrv_worker_bytes_pushed", "Bytes sent to reducers", labels=["job", "rank"])
        pushed.add_metric(labels, c.bytes_pushed)
        pulled = CounterMetricFamily("redsrv_worker_bytes_pulled", "Result bytes received", labels=["job", "rank"])
        pulled.add_metric(labels, c.bytes_pulled)
        done = CounterMetricFamily("redsrv_worker_operations", "Collective operations completed", labels=["job", "rank"])
        done.add_metric(labels, c.ops_completed)
        failed = CounterMetricFamily("redsrv_worker_operations_failed", "Operations failed, by error",
                                     labels=["job", "rank", "error"])
        for error, n in dict(c.ops_failed).items():
            failed.add_metric([*labels, error], n)
        yield from (pushed, pulled, done, failed)


def serve_worker_metrics(client: Client, port: int, host: str = "0.0.0.0") -> None:
    """Expose a worker client's metrics on http://host:port/metrics."""
    prometheus_client = _require()
    registry = prometheus_client.CollectorRegistry()
    registry.register(WorkerCollector(client))
    prometheus_client.start_http_server(port, addr=host, registry=registry)
