"""``redsrv plan``: how many reducers a job needs, and what it gains over ring all-reduce.

The model: in one all-reduce of G bytes every worker sends and receives G (ring: 2(n-1)/n G), and
each of m reducer hosts receives and sends n·G/m and sums n·G/m. The all-reduce takes as long as
the slowest of the worker's NIC and data path, and the reducer hosts' NIC, data path and cores:

    T_bw = max(G / min(W, t·D_w),  n·G / (m·min(R, p·D_r, c·S)))   T_ring = 2(n-1)/n · G / W
    T_redsrv = T_bw · (G + RESULT_LAG_PIECES·min(m·P, G)) / G

with W and R the worker and reducer NIC bandwidths; D_w and D_r the bytes per second one I/O
thread of the worker's client and of a reducer process moves each way (kernel copies and TCP
included: a core's ceiling, not the network's); t the client's I/O threads (``REDSRV_IO_THREADS``:
the plan recommends the smallest t with t·D_w >= W, at most one per worker core and one per
reducer address, since a loop serves whole reducers). The threads share one interpreter: the share
g of a client's work that holds CPython's GIL runs one thread at a time, so t·D_w is capped at
D_w/g whatever t (the worker term is G / min(W, min(t, 1/g)·D_w)); p the reducer processes per host (each one
event loop on its own port: `redsrv reducer --processes p`, listed as ``host:P-Q``); c the cores
per reducer host and S the bytes of contributions one core reduces per second; P the reducers'
cut-through piece, whose lag behind the pushes is paid once per operation. Above
t·D_w the worker's CPU, not its NIC, limits it. The rule every vendor states and nobody
automates: aggregate reducer bandwidth m·R must reach aggregate worker bandwidth n·W, or the
reducers become the bottleneck. The ring figure assumes ring all-reduce reaches the worker line
rate; its own CPU ceiling is not modelled.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from redsrv.cli.units import size_in
from redsrv.core import constants as C
from redsrv.core.config import default_chunk_bytes
from redsrv.core.errors import ConfigError

#: Bytes of contributions one reducer core sums per second, TCP included, when not measured:
#: `redsrv bench local` on a 2-vCPU VM spent ~1.2 CPU-seconds per GB reduced (loopback, both
#: ends' copies on the same cores), i.e. ~0.85 GB/s per core; servers with real NICs do better.
DEFAULT_CORE_GBPS = 0.85

#: GB/s one I/O thread moves each way (sending G and receiving G at once), for the worker's client
#: and for a reducer process, when not measured: one worker and one reducer on loopback reached
#: 2.44 GB/s each way on the project's 2-vCPU VM (`redsrv bench local --workers 1 --reducers 1
#: --sizes 64 256`), about 20 Gbit/s. Both ends shared two cores there, so a host with a core for
#: each may do better, and a busy one worse: `redsrv plan --measure` reads it on yours.
DEFAULT_IO_THREAD_GBPS = 2.44

#: Cores of a worker host the plan lets the client's I/O threads use when not told
#: (``--worker-cores``): one thread per core at most, and a training host's other cores feed its
#: accelerators.
DEFAULT_WORKER_CORES = 8

#: Share of a worker client's CPU spent holding CPython's GIL (in the interpreter rather than in
#: system calls and copies, which release it): ``perf record`` on a worker of the emulated
#: cluster put 42% of its samples in the Python interpreter (docs/performance.md, "What limits
#: it now"). That part runs one thread at a time, so one client process moves at most D_w / 0.42,
#: about 2.4 I/O threads' worth, however many it has; 0 for a free-threaded Python (``--gil-share
#: 0``). Checked against a measured scaling on a 16-core host (docs/performance.md, "On a machine
#: with cores to spare"): with D_w = 1.36 read there, the plan's 3.23 GB/s at k = 3 lies within
#: 12% of the 3.64 one worker moved at k = 4. The GIL itself was held a fifth of the time there
#: (the native receiver took most of the interpreter's work), so this share now stands for the
#: serial part of a client (the caller's thread included) rather than for the GIL alone.
CLIENT_GIL_SHARE = 0.42

#: A worker's results trail its pushes by about this many cut-through pieces per reducer: the
#: first result piece of a full chunk waits for every worker's bytes of it while each worker's link
#: carries all m reducers' chunks at once, and the download of results stays that far behind to the
#: end (a worker's timeline shows it; docs/performance.md, "Scaling: n = 2..8"). Measured on the
#: emulated cluster, 64 MiB, 400 Mbit/s: 1.42, 1.46, 1.52 and 1.57 pieces at n = m = 2, 4, 6, 8; at
#: 300 Mbit/s and n = m = 2, 1.2 for 16 MiB and 64 MiB alike (a lag per operation, not per byte).
RESULT_LAG_PIECES = 1.5

#: The smallest receive window the plan advises: below it a connection's window, not the port,
#: limits it at the round trips that queues build. Emulated cluster, 300 Mbit/s, 64 MiB, 2026-11-26:
#: n=4, m=2 ran 0.804 of the line-rate bound with 64 KiB, 0.957 with 96 KiB, 0.964-0.972 with 128 KiB;
#: n=6, m=3 0.779, 0.872 and 0.883 (256 KiB: 0.736). Where the buffer is known, every worker's
#: window together fits half of it: n=8, m=4 at 1 Gbit/s (2.5 MB ports) ran 0.909-0.911 with 128 KiB
#: against 0.833-0.853 with 256 KiB (docs/performance.md, "Fewer reducers than workers").
ADVISED_RECV_BUFFER_MIN_BYTES = 96 * 1024

#: Bottleneck names, in the order ties are broken (the network first: a NIC at its line rate is
#: the outcome the plan aims for).
WORKER_NIC, WORKER_IO, REDUCER_NIC, REDUCER_IO, REDUCER_CPU = (
    "worker NIC", "worker I/O thread (CPU)", "reducer NIC", "reducer processes (CPU)", "reducer CPU")


@dataclass(frozen=True)
class Plan:
    workers: int
    worker_gbps: float
    reducer_gbps: float
    reducer_cores: int
    core_gbps: float
    reducers: int  # reducer hosts
    bottleneck: str
    algbw_gbps: float  # gigabytes per second of gradient per worker
    line_rate_fraction: float
    ring_algbw_gbps: float
    speedup: float
    theory_max_speedup: float
    warnings: tuple[str, ...]
    reducer_cost_fraction: float | None
    worker_io_gbps: float = DEFAULT_IO_THREAD_GBPS  # per I/O thread, each way
    worker_io_threads: int = 1  # REDSRV_IO_THREADS
    reducer_io_gbps: float = DEFAULT_IO_THREAD_GBPS  # per reducer process, each way
    reducer_processes: int = 1  # per reducer host
    worker_cores: int = DEFAULT_WORKER_CORES
    gil_share: float = CLIENT_GIL_SHARE
    # What the results trail the pushes by, per reducer: the cut-through piece (REDSRV_RESULT_PIECE_BYTES),
    # or a whole chunk where cut-through is off.
    piece_bytes: int = C.DEFAULT_RESULT_PIECE_BYTES
    # The reducers' receive window (REDSRV_RECV_BUFFER_BYTES) this prediction assumes: bounded where
    # the reducers are the bottleneck, so the workers' converging pushes queue at the workers instead
    # of dropping at the reducers' switch ports; 0 (the kernel's autotuning) elsewhere.
    recv_buffer_bytes: int = C.DEFAULT_RECV_BUFFER_BYTES
    # Worker processes per worker host (one per GPU), ``workers`` being the hosts: host-level
    # reduction sends each host's gradient once (core/host_client.py); ``flat_speedup`` is what the
    # flat path (every process sending its own) would give instead.
    workers_per_host: int = 1
    flat_speedup: float | None = None

    def seconds(self, message_bytes: int) -> float:
        """Predicted time of one all-reduce of ``message_bytes`` per worker: its bytes at the
        bottleneck's rate, plus the results' lag behind the pushes, RESULT_LAG_PIECES pieces per
        reducer (a span's worth at most) at the same rate.

        >>> p = plan(workers=4, worker_gbit=8, reducer_gbit=8, reducer_cores=8, reducers=4)
        >>> round(p.seconds(64 * 2**20), 4), round(64 * 2**20 / 1e9, 4)   # 1 GB/s each
        (0.0703, 0.0671)
        """
        lag = RESULT_LAG_PIECES * min(self.reducers * self.piece_bytes, message_bytes)
        return (message_bytes + lag) / (self.algbw_gbps * 1e9)

    def ring_seconds(self, message_bytes: int) -> float:
        """Ring all-reduce's time for ``message_bytes`` at the worker line rate (its hops' latency
        not counted)."""
        return message_bytes / (self.ring_algbw_gbps * 1e9)

    @property
    def worker_path_gbps(self) -> float:
        """GB/s a worker host's clients move each way: each one's I/O threads, one core each at
        most and 1/g threads' worth at most (the GIL), times the worker processes per host."""
        return self.workers_per_host * _worker_path(self.worker_io_threads, self.worker_cores, self.gil_share,
                                                    self.worker_io_gbps)

    @property
    def worker_cpu_bound(self) -> bool:
        """The worker's own data path, not its NIC, caps it."""
        return self.worker_path_gbps < self.worker_gbps / 8


def plan(*, workers: int, worker_gbit: float, reducer_gbit: float, reducer_cores: int, core_gbps: float = DEFAULT_CORE_GBPS,
         worker_io_gbps: float = DEFAULT_IO_THREAD_GBPS, reducer_io_gbps: float = DEFAULT_IO_THREAD_GBPS,
         reducer_processes: int | None = None, reducers: int | None = None, worker_price: float | None = None,
         reducer_price: float | None = None, worker_cores: int = DEFAULT_WORKER_CORES,
         io_threads: int | None = None, gil_share: float = CLIENT_GIL_SHARE,
         piece_bytes: int = C.DEFAULT_RESULT_PIECE_BYTES, port_buffer_bytes: int | None = None,
         workers_per_host: int = 1) -> Plan:
    """Recommend reducer hosts, processes per host and the client's I/O threads (or evaluate
    ``reducers`` / ``reducer_processes`` / ``io_threads``) for ``workers`` worker hosts, each
    running ``workers_per_host`` worker processes (one per GPU).

    With several workers per host, each host reduces inside itself first and its NIC carries the
    gradient once; each of its L processes sends 1/L of it across hosts, so a host's data path is
    L clients' worth. Ring all-reduce runs over all n·L ranks, crossing each host's NIC once each
    way (consecutive ranks share a host): 2(nL-1)/(nL) of the gradient.

    >>> p = plan(workers=4, worker_gbit=25, reducer_gbit=25, reducer_cores=16, workers_per_host=8)
    >>> p.reducers, round(p.speedup, 2), round(p.flat_speedup, 2), p.bottleneck
    (4, 1.94, 0.24, 'worker NIC')

    >>> p = plan(workers=8, worker_gbit=10, reducer_gbit=10, reducer_cores=32)
    >>> p.reducers, p.bottleneck, round(p.speedup, 2), p.worker_io_threads
    (8, 'worker NIC', 1.75, 1)
    >>> p = plan(workers=8, worker_gbit=100, reducer_gbit=100, reducer_cores=32)
    >>> p.bottleneck, f"{p.line_rate_fraction:.0%}", p.reducers, p.reducer_processes, p.worker_io_threads
    ('worker I/O thread (CPU)', '46%', 4, 6, 3)
    >>> p = plan(workers=8, worker_gbit=100, reducer_gbit=100, reducer_cores=32, gil_share=0)
    >>> p.bottleneck, f"{p.line_rate_fraction:.0%}", p.reducers, p.worker_io_threads
    ('worker NIC', '100%', 8, 6)
    >>> p = plan(workers=8, worker_gbit=100, reducer_gbit=100, reducer_cores=32, io_threads=1)
    >>> p.bottleneck, f"{p.line_rate_fraction:.0%}", p.reducers
    ('worker I/O thread (CPU)', '20%', 2)
    """
    if port_buffer_bytes is not None and port_buffer_bytes <= 0:
        raise ValueError(f"the switch port's buffer must be positive, got {port_buffer_bytes} bytes")
    if workers < 2 or worker_gbit <= 0 or reducer_gbit <= 0 or reducer_cores < 1 or core_gbps <= 0:
        raise ValueError("need workers >= 2 and positive bandwidths, cores and core throughput")
    if worker_io_gbps <= 0 or reducer_io_gbps <= 0:
        raise ValueError("need positive data-path ceilings (GB/s per I/O thread)")
    if (reducer_processes is not None and reducer_processes < 1) or (reducers is not None and reducers < 1):
        raise ValueError("need at least one reducer and one reducer process per host")
    if worker_cores < 1 or (io_threads is not None and io_threads < 1):
        raise ValueError("need at least one worker core and one client I/O thread")
    if piece_bytes < 0:
        raise ValueError(f"piece_bytes is the reducers' cut-through piece, >= 0 (0: whole chunks); got {piece_bytes}")
    if not 0 <= gil_share <= 1:
        raise ValueError(f"gil_share is a share of the client's CPU, in 0..1; got {gil_share}")
    if workers_per_host < 1:
        raise ValueError(f"need at least one worker process per host, got {workers_per_host}")
    w = worker_gbit / 8  # GB/s
    r = reducer_gbit / 8
    # Enough client I/O threads to fill the worker's NIC (its L processes together), one core each
    # at most, and none past the GIL's cap (1/g threads' worth), where more add nothing.
    gil_threads = math.ceil(1 / gil_share - 1e-9) if gil_share > 0 else worker_cores
    enough_threads = min(worker_cores, gil_threads, max(1, math.ceil(w / workers_per_host / worker_io_gbps - 1e-9)))
    t = io_threads if io_threads is not None else enough_threads
    # Each of a host's L processes has a client of its own: the host's data path is L of them.
    worker_path = workers_per_host * _worker_path(t, worker_cores, gil_share, worker_io_gbps)
    host_cpu = reducer_cores * core_gbps
    # Enough event loops to fill the NIC (or the cores' summing rate), one core each at most.
    enough_processes = min(reducer_cores, max(1, math.ceil(min(r, host_cpu) / reducer_io_gbps - 1e-9)))
    p = reducer_processes if reducer_processes is not None else enough_processes
    loops = min(p, reducer_cores) * reducer_io_gbps  # processes beyond the cores share them
    per_reducer = min(r, loops, host_cpu)  # what one reducer host takes in per second
    # No more reducers than the workers can feed: a CPU-bound worker sends below its line rate.
    m = reducers if reducers is not None else max(1, math.ceil(workers * min(w, worker_path) / per_reducer - 1e-9))
    # A client loop serves whole reducers (core/client_engine.py): no more loops than reducer addresses.
    t = min(t, m * p)
    worker_path = workers_per_host * _worker_path(t, worker_cores, gil_share, worker_io_gbps)
    limits = {WORKER_NIC: w, WORKER_IO: worker_path, REDUCER_NIC: m * r / workers, REDUCER_IO: m * loops / workers,
              REDUCER_CPU: m * host_cpu / workers}
    bottleneck = min(limits, key=lambda k: limits[k])
    algbw = limits[bottleneck]
    ranks = workers * workers_per_host
    ring = w * ranks / (2 * (ranks - 1))
    flat = min(w / workers_per_host, *(v for k, v in limits.items() if k != WORKER_NIC)) / ring
    warnings = []
    if worker_path < w:
        if t < enough_threads:
            lift = (f"set REDSRV_IO_THREADS={enough_threads}" if enough_threads <= m * p else
                    f"a client loop serves whole reducers: list at least {enough_threads} reducer addresses "
                    f"(redsrv reducer --processes) and set REDSRV_IO_THREADS={enough_threads}")
        elif enough_threads == gil_threads < worker_cores:
            lift = (f"the client's Python holds the GIL for about {gil_share:.0%} of its work, so one worker process "
                    f"moves at most {worker_io_gbps / gil_share:.2f} GB/s whatever REDSRV_IO_THREADS: run several worker "
                    f"processes per host (one per GPU), each planned with its share of the NIC")
        else:
            lift = f"one per core of its {worker_cores} already: only faster cores lift it, more reducers do not"
        warnings.append(
            f"a worker's client moves at most {worker_path:.2f} GB/s each way ({worker_path * 8:.1f} Gbit/s) on its "
            f"{t} I/O thread(s): above that NIC speed the worker's CPU, not its {worker_gbit:g} Gbit/s NIC, "
            f"is the bottleneck ({worker_path / w:.0%} of its line rate): {lift}")
    recv_buffer = C.DEFAULT_RECV_BUFFER_BYTES
    if m * r < workers * min(w, worker_path):
        recv_buffer = advised_recv_buffer(workers, port_buffer_bytes)
        warnings.append(f"aggregate reducer bandwidth {m * reducer_gbit:g} Gbit/s is below aggregate worker bandwidth "
                        f"{workers * min(w, worker_path) * 8:g} Gbit/s: the reducers are the bottleneck. The workers' "
                        f"flows converge on each reducer's switch port: set REDSRV_RECV_BUFFER_BYTES={recv_buffer} on "
                        "the reducers, so that the port's queue holds what they have in flight ("
                        + ("sized for the port's buffer you gave" if port_buffer_bytes is not None else
                           "give --switch-buffer-kib to size it for your switch")
                        + ")")
    if loops < min(r, host_cpu):
        lift = (f"run `redsrv reducer --processes {enough_processes}` on each host and list it as host:PORT-LAST"
                if p < enough_processes else "one per core already: add reducer hosts or faster cores")
        warnings.append(f"{p} reducer process(es) per host move at most {loops:.2f} GB/s each way, below the host's "
                        f"{min(r, host_cpu):.2f}: {lift}")
    if m * host_cpu < workers * min(w, worker_path):
        warnings.append(f"{m} reducer(s) x {reducer_cores} cores cannot sum at the workers' rate: add cores or reducers")
    if algbw <= ring:
        warnings.append("with this fleet ring all-reduce is as fast or faster (if ring reaches the worker line rate)")
    cost = None
    if worker_price is not None and reducer_price is not None and worker_price > 0:
        cost = m * reducer_price / (workers * worker_price)
    return Plan(workers, worker_gbit, reducer_gbit, reducer_cores, core_gbps, m, bottleneck, algbw, algbw / w, ring,
                algbw / ring, 2 * (ranks - 1) / ranks, tuple(warnings), cost, worker_io_gbps, t, reducer_io_gbps, p,
                worker_cores, gil_share, piece_bytes or default_chunk_bytes(ranks), recv_buffer, workers_per_host,
                flat if workers_per_host > 1 else None)


def advised_recv_buffer(workers: int, port_buffer_bytes: int | None) -> int:
    """The reducers' receive window for a fleet whose reducers are the bottleneck: every worker's
    window towards a reducer together (one connection each, the client's default
    REDSRV_STREAMS_PER_REDUCER) within half the buffer of the switch port in front of it (the other
    half takes the bursts), between ADVISED_RECV_BUFFER_MIN_BYTES and RECOMMENDED_RECV_BUFFER_BYTES;
    that maximum where the buffer is unknown.

    >>> advised_recv_buffer(4, None) // 1024, advised_recv_buffer(8, 2_500_000) // 1024, advised_recv_buffer(4, 750_000) // 1024
    (256, 152, 96)
    """
    if port_buffer_bytes is None:
        return C.RECOMMENDED_RECV_BUFFER_BYTES
    share = port_buffer_bytes // 2 // workers // 1024 * 1024
    return max(ADVISED_RECV_BUFFER_MIN_BYTES, min(C.RECOMMENDED_RECV_BUFFER_BYTES, share))


def _worker_path(threads: int, cores: int, gil_share: float, per_thread: float) -> float:
    """GB/s a client moves each way on ``threads`` I/O threads: one core each at most, and at
    most 1/``gil_share`` threads' worth (the share that holds the GIL runs one at a time)."""
    useful = min(threads, cores, 1 / gil_share if gil_share > 0 else cores)
    return useful * per_thread


def _listed(processes: int) -> str:
    """How a worker lists one reducer host running ``processes`` reducer processes."""
    return "host:PORT" if processes == 1 else f"host:PORT-PORT+{processes - 1}"


def measure_core_gbps(seconds: float = 1.0, workers: int = 4, chunk_bytes: int = 512 * 1024) -> float:
    """Bytes of contributions per second one core pushes through the reducer state machine
    (receive copy + rank-order sum + result), excluding the kernel's TCP work."""
    from redsrv.core import wire
    from redsrv.core.reducer import PushTicket, ReducerCore, SendResult

    core = ReducerCore(1)
    for rank in range(workers):
        core.join(rank, wire.Hello("probe", rank, workers, rank + 1, bytes(32)))
    payload = np.random.default_rng(0).standard_normal(chunk_bytes // 4).astype(np.float32).view(np.uint8)
    count = chunk_bytes // 4
    done = 0
    started = time.perf_counter()
    key = 0
    while time.perf_counter() - started < seconds:
        for rank in range(workers):
            push = wire.Push(key, 1, count, 0, count, 0, wire.DType.FLOAT32)
            ticket = core.begin_push(rank, push, chunk_bytes, 0.0)
            assert isinstance(ticket, PushTicket) and ticket.buffer is not None
            ticket.buffer[:] = payload  # what recv_into does
            for action in core.finish_push(ticket, 0.0):
                if isinstance(action, SendResult):
                    for _ in action.conns:
                        action.release()
            done += chunk_bytes
        key += 1
    return done / (time.perf_counter() - started) / 1e9


#: Below this many CPU seconds the kernel's tick-counted CPU times are too coarse to divide by.
_MIN_CPU_SECONDS = 0.05
#: Largest single operation of the data-path probe: 64 MiB keeps what a reducer holds for the
#: probe's job well inside its default per-job budget (128 MiB).
_PROBE_OP_BYTES = 64 << 20


@dataclass(frozen=True)
class DataPathMeasurement:
    """One worker client and one reducer process on loopback: bytes each way, wall-clock and the
    CPU seconds of each end."""

    bytes_each_way: int
    seconds: float
    worker_cpu_s: float  # the whole worker process: its I/O thread does nearly all of it
    reducer_cpu_s: float

    @property
    def wall_gbps(self) -> float:
        """GB/s each way with both ends on this machine's cores at once."""
        return self.bytes_each_way / self.seconds / 1e9

    def _per_core(self, cpu_s: float) -> float:
        # Bytes per CPU-second: what the end moves on a core of its own. On loopback the kernel
        # bills a receive's TCP work to the sending process; each end sends and receives the
        # same bytes, so the two bills even out. Too little CPU to read: the wall-clock rate,
        # a lower bound (one thread is busy at most the whole run).
        return self.bytes_each_way / cpu_s / 1e9 if cpu_s >= _MIN_CPU_SECONDS else self.wall_gbps

    @property
    def worker_gbps_per_core(self) -> float:
        return self._per_core(self.worker_cpu_s)

    @property
    def reducer_gbps_per_core(self) -> float:
        return self._per_core(self.reducer_cpu_s)


def measure_data_path(total_bytes: int = 256 << 20, *, timeout: float = 120.0) -> DataPathMeasurement:
    """Push ``total_bytes`` of float32 through a :class:`redsrv.Client` (world size 1) and a
    ``redsrv reducer`` process on 127.0.0.1, in operations of at most 64 MiB after one warm-up,
    and read the wall-clock time and each end's CPU seconds. With one rank the reducer sums
    nothing: this is the data path alone (framing, kernel copies, TCP), each way."""
    import os

    import redsrv
    from redsrv.bench.local import cpu_seconds
    from redsrv.cli.fleet import start_reducers, stop_processes

    if total_bytes < 4:
        raise ValueError(f"total_bytes must be at least one float32 (4 bytes), got {total_bytes}")
    op_elements = min(total_bytes, _PROBE_OP_BYTES) // 4
    ops = max(1, total_bytes // (op_elements * 4))
    x = np.ones(op_elements, np.float32)
    fleet = start_reducers(1)
    try:
        reducer_pid = fleet.procs[0].pid
        with redsrv.Client(fleet.addresses, rank=0, world_size=1, job=f"plan-probe-{os.getpid()}",
                           op_timeout=timeout) as client:
            client.allreduce(x, out=x)  # warm-up: connections, the reducer's buffer pool, page faults
            cpu_before, reducer_before = time.process_time(), cpu_seconds(reducer_pid)
            started = time.perf_counter()
            for _ in range(ops):
                client.allreduce(x, out=x)
            seconds = time.perf_counter() - started
            worker_cpu, reducer_cpu = time.process_time() - cpu_before, cpu_seconds(reducer_pid) - reducer_before
    finally:
        stop_processes(fleet.procs)
        for proc in fleet.procs:
            if proc.stdout is not None:
                proc.stdout.close()  # the pipe start_reducers read the listening address from
    return DataPathMeasurement(ops * x.nbytes, seconds, worker_cpu, reducer_cpu)


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("plan", help="recommend the number of reducers and predict the speed-up over ring all-reduce",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, required=True, help="number of worker hosts (n)")
    p.add_argument("--workers-per-host", type=int, default=1, metavar="L",
                   help="worker processes per worker host, one per GPU (default 1): each host reduces inside itself "
                        "first (host-level reduction), so its NIC carries the gradient once")
    p.add_argument("--worker-gbit", type=float, required=True, help="worker NIC bandwidth, Gbit/s")
    p.add_argument("--reducer-gbit", type=float, required=True, help="reducer NIC bandwidth, Gbit/s")
    p.add_argument("--reducer-cores", type=int, default=8, help="cores per reducer host (default 8)")
    p.add_argument("--worker-cores", type=int, default=DEFAULT_WORKER_CORES,
                   help=f"cores a worker's client I/O threads may use (default {DEFAULT_WORKER_CORES})")
    p.add_argument("--io-threads", type=int,
                   help="evaluate this many client I/O threads per worker (REDSRV_IO_THREADS) instead of recommending")
    p.add_argument("--gil-share", type=float, default=CLIENT_GIL_SHARE,
                   help=f"share of a client's CPU that holds the GIL, capping its I/O threads at 1/share threads' worth "
                        f"(default {CLIENT_GIL_SHARE}; 0 for a free-threaded Python)")
    p.add_argument("--reducers", type=int, help="evaluate this many reducer hosts instead of recommending")
    p.add_argument("--reducer-processes", type=int,
                   help="evaluate this many `redsrv reducer` processes per reducer host instead of recommending")
    p.add_argument("--core-gbyte", dest="core_gbps", type=float,
                   help=f"GB/s of contributions one core reduces (default {DEFAULT_CORE_GBPS})")
    p.add_argument("--worker-io-gbyte", dest="worker_io_gbps", type=float,
                   help=f"GB/s one of the worker's client I/O threads moves each way (default {DEFAULT_IO_THREAD_GBPS})")
    p.add_argument("--reducer-io-gbyte", dest="reducer_io_gbps", type=float,
                   help=f"GB/s one reducer process moves each way (default {DEFAULT_IO_THREAD_GBPS})")
    p.add_argument("--measure", action="store_true",
                   help="measure this machine first: reduce throughput per core, and the data path of one worker client "
                        "and one reducer process on loopback (flags given explicitly win over the measurement)")
    p.add_argument("--measure-mib", type=size_in("MiB"), default=256,
                   help="MiB each way for the data-path measurement (default 256)")
    p.add_argument("--worker-price", type=float, help="price of a worker per hour (any currency)")
    p.add_argument("--reducer-price", type=float, help="price of a reducer per hour (same currency)")
    p.add_argument("--message-mib", type=size_in("MiB"), default=64,
                   help="predict the time of one all-reduce of this many MiB per worker (default 64)")
    p.add_argument("--piece-kib", type=size_in("KiB", whole=True), default=C.DEFAULT_RESULT_PIECE_BYTES // 1024,
                   help="the reducers' cut-through piece in KiB (REDSRV_RESULT_PIECE_BYTES; default "
                        f"{C.DEFAULT_RESULT_PIECE_BYTES // 1024}; 0: whole chunks)")
    p.add_argument("--switch-buffer-kib", type=size_in("KiB"), default=None, metavar="KIB",
                   help="the queue of the switch port in front of each reducer, in KiB, where known: sizes the "
                        "reducers' receive window the plan advises when they are the bottleneck (default: "
                        f"{C.RECOMMENDED_RECV_BUFFER_BYTES // 1024} KiB)")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="write the plan as JSON to PATH instead of a table (no PATH or -: standard output)")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    core_gbps, worker_io, reducer_io = args.core_gbps, args.worker_io_gbps, args.reducer_io_gbps
    measured = None
    if args.measure:
        # With --json the measurement goes into the JSON; its prose to stderr, keeping stdout parseable.
        say = sys.stderr if args.json == "-" else sys.stdout
        core = measure_core_gbps()
        print(f"measured: one core moves {core:.2f} GB/s of contributions through the reducer state machine "
              f"(TCP excluded; planning with {core / 2:.2f}, half of it, to leave room for the network stack)", file=say)
        path = measure_data_path(int(args.measure_mib * 2**20))
        print(f"measured: one worker client and one reducer process on 127.0.0.1 moved {path.bytes_each_way / 2**20:g} MiB "
              f"each way in {path.seconds:.3f} s = {path.wall_gbps:.2f} GB/s each way (both ends on this machine's cores); "
              f"CPU seconds: worker {path.worker_cpu_s:.3f}, reducer {path.reducer_cpu_s:.3f}; per core each way: "
              f"worker {path.worker_gbps_per_core:.2f} GB/s, reducer process {path.reducer_gbps_per_core:.2f} GB/s", file=say)
        measured = {"core_gbps": core, **asdict(path), "wall_gbps": path.wall_gbps,
                    "worker_gbps_per_core": path.worker_gbps_per_core, "reducer_gbps_per_core": path.reducer_gbps_per_core}
        core_gbps = core_gbps or core / 2
        worker_io = worker_io or path.worker_gbps_per_core
        reducer_io = reducer_io or path.reducer_gbps_per_core
    if not args.message_mib > 0:
        raise ConfigError(f"--message-mib must be > 0, got {args.message_mib:g}")
    try:
        p = plan(workers=args.workers, worker_gbit=args.worker_gbit, reducer_gbit=args.reducer_gbit,
                 reducer_cores=args.reducer_cores, core_gbps=core_gbps or DEFAULT_CORE_GBPS,
                 worker_io_gbps=worker_io or DEFAULT_IO_THREAD_GBPS, reducer_io_gbps=reducer_io or DEFAULT_IO_THREAD_GBPS,
                 reducer_processes=args.reducer_processes, reducers=args.reducers,
                 worker_price=args.worker_price, reducer_price=args.reducer_price, worker_cores=args.worker_cores,
                 io_threads=args.io_threads, gil_share=args.gil_share, piece_bytes=args.piece_kib * 1024,
                 port_buffer_bytes=None if args.switch_buffer_kib is None else int(args.switch_buffer_kib * 1024),
                 workers_per_host=args.workers_per_host)
    except ValueError as exc:  # the flags are the configuration here (see the package's exception policy)
        raise ConfigError(str(exc)) from None
    message = int(args.message_mib * 2**20)
    if args.json:
        # JSON keys say their unit as the flags do (cli/units.py): the NICs in Gbit/s, rates in GB/s.
        fields = {{"worker_gbps": "worker_gbit", "reducer_gbps": "reducer_gbit"}.get(k, k): v for k, v in asdict(p).items()}
        text = json.dumps({**fields, "worker_cpu_bound": p.worker_cpu_bound, "message_bytes": message,
                           "seconds": p.seconds(message), "ring_seconds": p.ring_seconds(message),
                           **({"measured": measured} if measured else {})}, indent=1)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
            print(f"wrote {args.json}")
        return 0
    worker_path = p.worker_path_gbps
    rows = [
        ("workers x NIC", f"{p.workers} x {p.worker_gbps:g} Gbit/s"
         + (f", {p.workers_per_host} worker processes each (host-level reduction: each host's NIC carries the "
            "gradient once)" if p.workers_per_host > 1 else "")),
        ("worker data path", f"{worker_path:.2f} GB/s each way = {worker_path * 8:.1f} Gbit/s "
         + (f"per host ({p.workers_per_host} processes x " if p.workers_per_host > 1 else "(")
         + f"{p.worker_io_threads} I/O thread(s) x {p.worker_io_gbps:.2f} GB/s"
         + (f", capped by the GIL ({p.gil_share:.0%} of the work)" if p.worker_io_threads * p.gil_share > 1 else "")
         + f": set REDSRV_IO_THREADS={p.worker_io_threads})"
         + ("  (recommended)" if args.io_threads is None else "")),
        ("reducers x NIC x cores", f"{p.reducers} x {p.reducer_gbps:g} Gbit/s x {p.reducer_cores}"
         + ("  (recommended)" if args.reducers is None else "")),
        ("reducer processes per host", f"{p.reducer_processes} x {p.reducer_io_gbps:.2f} GB/s each way "
         f"(redsrv reducer --processes {p.reducer_processes}; list each host as {_listed(p.reducer_processes)})"
         + ("  (recommended)" if args.reducer_processes is None else "")),
        ("reduce throughput per core", f"{p.core_gbps:.2f} GB/s"),
        ("reducers' receive window", (f"{p.recv_buffer_bytes // 1024} KiB per connection (REDSRV_RECV_BUFFER_BYTES="
                                      f"{p.recv_buffer_bytes} on the reducers)  (recommended)") if p.recv_buffer_bytes
         else "the kernel's autotuning (REDSRV_RECV_BUFFER_BYTES=0, the default)"),
        ("bottleneck", p.bottleneck),
        ("predicted algbw (redsrv)", f"{p.algbw_gbps:.3f} GB/s = {p.line_rate_fraction:.0%} of the worker line rate"),
        ("ring all-reduce algbw", f"{p.ring_algbw_gbps:.3f} GB/s (at the worker line rate)"),
        ("predicted speed-up", f"{p.speedup:.2f}x (at most {p.theory_max_speedup:.2f}x for "
         f"{p.workers * p.workers_per_host} workers)"
         + (f"; without host-level reduction (REDSRV_HOST_REDUCE=flat) {p.flat_speedup:.2f}x" if p.flat_speedup else "")),
        (f"one all-reduce of {args.message_mib:g} MiB",
         f"{p.seconds(message) * 1e3:.1f} ms (ring {p.ring_seconds(message) * 1e3:.1f} ms; the results trail the pushes "
         f"by {RESULT_LAG_PIECES:g} pieces of {p.piece_bytes // 1024} KiB per reducer)"),
    ]
    if p.reducer_cost_fraction is not None:
        rows.append(("reducer cost", f"{p.reducer_cost_fraction:.1%} of the workers' cost"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    for w in p.warnings:
        print(f"  warning: {w}")
    return 0
