"""``redsrv run -np N [--reducers M] python train.py ...``: the ``horovodrun -np N`` of one
machine. Starts M reducers on free loopback ports and N workers running the command with their
rank, world size, reducers, job and a fresh shared secret in the environment; streams every
worker's output with a ``[rank]`` prefix; stops everything when the workers end, one fails, or
on Ctrl-C / SIGTERM. Exits with the first failing worker's status (0 when all succeed).

With ``-H host:slots,...`` or ``--hostfile`` naming other machines, the reducers start here on
an address those hosts reach, and the workers start through ``mpirun`` (Open MPI or MPICH),
an engine that already knows how to reach the hosts; without one, the ``srun`` and ``torchrun``
lines to run by hand are printed instead (cli/hosts.py builds every line). With ``--min-np`` /
``--max-np`` the workers run elastic (cli/elastic.py).
"""

from __future__ import annotations

import argparse
import functools
import os
import queue
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import IO, Any

from redsrv.cli import hosts as host_lists
from redsrv.cli import hvd_env
from redsrv.cli.fleet import free_port, start_reducers, stop_processes
from redsrv.core import constants as C
from redsrv.core.config import Config, DaemonSettings
from redsrv.core.errors import ConfigError

__all__ = ["add_parser", "run"]

#: Variables a worker must not inherit from whatever launched ``redsrv run``: each names a rank
#: or size that would conflict with the one given here.
_INHERITED_PLACEMENT = ("REDSRV_RANK", "REDSRV_WORLD_SIZE", "REDSRV_REDUCERS", "REDSRV_JOB", "REDSRV_SECRET",
                        "REDSRV_SECRET_FILE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                        "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK",
                        "PMI_SIZE", "TF_CONFIG", "CLUSTER_SPEC", "MASTER_ADDR", "MASTER_PORT", "HOROVOD_RANK",
                        "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("run", help="start local reducers and N workers running a command (like horovodrun -np N)",
                       description="Start reducers and N worker processes on this machine running COMMAND, with "
                       "RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, horovodrun's HOROVOD_RANK, HOROVOD_SIZE, "
                       "HOROVOD_LOCAL_RANK, HOROVOD_LOCAL_SIZE, HOROVOD_CROSS_RANK and HOROVOD_CROSS_SIZE, "
                       "MASTER_ADDR and a free MASTER_PORT (for torch.distributed's env:// rendezvous), REDSRV_REDUCERS, "
                       "REDSRV_JOB and a fresh REDSRV_SECRET set. Each rank's stdout and stderr are prefixed with "
                       "[rank] and kept apart, as horovodrun does. Everything stops when the workers end, one fails, "
                       "or on Ctrl-C.")
    p.add_argument("-np", "--num-proc", dest="num_proc", type=int, required=True, help="worker processes")
    p.add_argument("--reducers", type=int, default=1, help="reducer processes (default 1)")
    p.add_argument("--job", default=None, help="job id (default: a fresh one)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", default=None,
                       help="hosts and their slots, host:slots,host:slots (Horovod's -H); ranks fill the first host's "
                            "slots first. Hosts other than this one are started through mpirun")
    where.add_argument("--hostfile", default=None, help="a file of 'host slots=N' lines (Horovod's and Open MPI's format)")
    p.add_argument("--output-filename", "--log-dir", dest="output_dir", default=None,
                   help="also write each rank's stdout and stderr to DIR/rank.<rank>/stdout and stderr (horovodrun's "
                        "--output-filename; --log-dir is torchrun's name for it). Under mpirun, mpirun writes them")
    p.add_argument("--reducer-host", default=None,
                   help="with other hosts: the address the reducers bind and the workers dial (default: this machine's "
                        "address on the route to the first other host)")
    p.add_argument("--mpi-args", default="", help="extra mpirun arguments, e.g. --mpi-args='--mca btl_tcp_if_include eth0'")
    p.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int, default=None,
                   help="elastic: keep training while at least this many workers live (Horovod elastic)")
    p.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int, default=None,
                   help="elastic: never run more workers than this (default -np)")
    p.add_argument("--reset-limit", type=int, default=None,
                   help=f"elastic: give up after this many re-formations of the world (default "
                        f"{C.DEFAULT_ELASTIC_RESET_LIMIT})")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command each worker runs, e.g. python train.py")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    host_list = (host_lists.parse_hosts(args.hosts) if args.hosts else
                 host_lists.read_hostfile(args.hostfile) if args.hostfile else None)
    if args.min_np is not None or args.max_np is not None:
        from redsrv.cli.elastic import run_elastic

        if host_list is not None and not host_lists.is_local(host_list, _own_names()):
            raise ConfigError("elastic runs (--min-np/--max-np) start their workers on this machine only: drop -H/--hostfile")
        return run_elastic(command, num_proc=args.num_proc, min_np=args.min_np, max_np=args.max_np,
                           reset_limit=args.reset_limit, reducers=args.reducers, job=args.job, output_dir=args.output_dir)
    if host_list is not None and not host_lists.is_local(host_list, _own_names()):
        return run_on_hosts(command, host_list, num_proc=args.num_proc, reducers=args.reducers, job=args.job,
                            output_dir=args.output_dir, reducer_host=args.reducer_host, mpi_args=shlex.split(args.mpi_args))
    if host_list is not None:
        host_lists.assign_ranks(host_list, args.num_proc)  # -np must fit the slots listed, here too
    return run(command, num_proc=args.num_proc, reducers=args.reducers, job=args.job, output_dir=args.output_dir)


def _own_names() -> list[str]:
    return [socket.gethostname(), socket.getfqdn()]


def worker_base_env(num_proc: int, job: str) -> dict[str, str]:
    """Our environment less any placement a launcher above us left, with a fresh secret; checked
    once here, so a bad ``REDSRV_*`` (the workers' or the reducers') fails before anything starts."""
    base = {k: v for k, v in os.environ.items() if k not in _INHERITED_PLACEMENT}
    base["REDSRV_SECRET"] = secrets.token_hex(32)  # reducers and workers of this run only
    Config.from_env(base, rank=0, world_size=num_proc, reducers=("127.0.0.1:1",), job=job)
    DaemonSettings.from_env(base)
    return base


def run(command: Sequence[str], *, num_proc: int, reducers: int = 1, job: str | None = None,
        output: IO[bytes] | None = None, errors: IO[bytes] | None = None, output_dir: str | None = None) -> int:
    """Run ``command`` as ``num_proc`` workers through ``reducers`` local reducers; the exit
    status: 0, or the first failing worker's (128 + signal number when killed by one). The
    workers' stdout goes to ``output`` and their stderr to ``errors`` (default: ours), and with
    ``output_dir`` also to ``output_dir/rank.<rank>/stdout`` and ``stderr``."""
    if not command:
        raise SystemExit("redsrv run: no command given (e.g. redsrv run -np 2 python train.py)")
    if num_proc < 1 or reducers < 1:
        raise SystemExit("redsrv run: -np and --reducers must be at least 1")
    sink = output if output is not None else sys.stdout.buffer
    error_sink = errors if errors is not None else sys.stderr.buffer
    job = job or f"run-{uuid.uuid4().hex[:8]}"
    base = worker_base_env(num_proc, job)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    fleet = start_reducers(reducers, env=base)
    workers: list[subprocess.Popen[bytes]] = []
    exits: queue.Queue[tuple[int, int]] = queue.Queue()
    write_lock = threading.Lock()
    pumps = []
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    try:
        for rank in range(num_proc):
            env = {**base, **rendezvous, "REDSRV_REDUCERS": ",".join(fleet.addresses), "REDSRV_JOB": job,
                   "RANK": str(rank), "WORLD_SIZE": str(num_proc), "LOCAL_RANK": str(rank),
                   "LOCAL_WORLD_SIZE": str(num_proc), "PYTHONUNBUFFERED": "1",
                   # What horovodrun exports (one host here: the cross-host rank and size are 0 and 1).
                   "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(num_proc), "HOROVOD_LOCAL_RANK": str(rank),
                   "HOROVOD_LOCAL_SIZE": str(num_proc), "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1"}
            try:
                proc = subprocess.Popen(list(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            except OSError as exc:
                _note(error_sink, write_lock, f"redsrv run: cannot start {command[0]!r}: {exc.strerror}")
                return 127
            workers.append(proc)
            files = rank_files(output_dir, rank, num_proc)
            on_exit = functools.partial(_exited, exits, rank)
            for stream, target, copy, report in ((proc.stdout, sink, files[0], on_exit),
                                                 (proc.stderr, error_sink, files[1], None)):
                pump = threading.Thread(target=pump_lines, args=(str(rank), proc, stream, target, write_lock, report, copy),
                                        name=f"redsrv-run-{rank}", daemon=True)
                pump.start()
                pumps.append(pump)
        for _ in range(num_proc):
            rank, code = exits.get()
            if code != 0:
                status = 128 - code if code < 0 else code
                _note(error_sink, write_lock, f"redsrv run: rank {rank} exited with status {code}; stopping the other workers")
                return status
        return 0
    except KeyboardInterrupt:
        _note(error_sink, write_lock, "redsrv run: interrupted; stopping workers and reducers")
        return 130
    finally:
        stop_processes(workers, timeout=5)
        stop_processes(fleet.procs)
        for pump in pumps:
            pump.join(5)
        signal.signal(signal.SIGTERM, previous)


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt



def rank_files(output_dir: str | None, rank: int, num_proc: int) -> tuple[IO[bytes] | None, IO[bytes] | None]:
    """``output_dir/rank.<rank>/stdout`` and ``stderr`` opened for writing (horovodrun's layout:
    the rank padded with zeros so the folders sort in rank order), or none without a folder."""
    if output_dir is None:
        return None, None
    folder = os.path.join(output_dir, f"rank.{rank:0{len(str(max(num_proc - 1, 0)))}d}")
    os.makedirs(folder, exist_ok=True)
    return open(os.path.join(folder, "stdout"), "wb"), open(os.path.join(folder, "stderr"), "wb")


def _exited(exits: queue.Queue[tuple[int, int]], rank: int, code: int) -> None:
    exits.put((rank, code))


def pump_lines(label: str, proc: subprocess.Popen[bytes], stream: IO[bytes] | None, sink: IO[bytes],
               lock: threading.Lock, on_exit: Callable[[int], None] | None, copy: IO[bytes] | None = None) -> None:
    """Copy one of a worker's streams line by line with ``[label]`` in front (and as it is to
    ``copy``, the worker's own file); the stdout pump reports the worker's exit status to
    ``on_exit`` once its output is drained. ``redsrv run``'s and the elastic driver's."""
    prefix = f"[{label}] ".encode()
    assert stream is not None
    for line in stream:
        with lock:
            sink.write(prefix + line)
            sink.flush()
        if copy is not None:
            copy.write(line)
            copy.flush()
    stream.close()
    if copy is not None:
        copy.close()
    if on_exit is not None:
        on_exit(proc.wait())


def _note(sink: IO[bytes], lock: threading.Lock, text: str) -> None:
    with lock:
        sink.write(text.encode() + b"\n")
        sink.flush()


def run_on_hosts(command: Sequence[str], hosts: Sequence[host_lists.HostSlots], *, num_proc: int, reducers: int = 1,
                 job: str | None = None, output_dir: str | None = None, reducer_host: str | None = None,
                 mpi_args: Sequence[str] = (), mpirun: str | None = None) -> int:
    """Run ``command`` as ``num_proc`` workers placed on ``hosts`` through ``mpirun``, with
    ``reducers`` reducers started here on ``reducer_host``; mpirun's exit status. Without an
    mpirun we can drive, print the lines to start the workers by hand and return 2."""
    if not command:
        raise SystemExit("redsrv run: no command given (e.g. redsrv run -np 4 -H a:2,b:2 python train.py)")
    placed = host_lists.assign_ranks(hosts, num_proc)
    job = job or f"run-{uuid.uuid4().hex[:8]}"
    base = worker_base_env(num_proc, job)
    bind = reducer_host or _address_towards(next(h for h, _ in placed if h not in _own_names()))
    mpirun = mpirun or shutil.which("mpirun")
    flavour = _mpi_flavour(mpirun) if mpirun else None
    rendezvous = {"MASTER_ADDR": placed[0][0], "MASTER_PORT": str(free_port())}
    if flavour is None:
        return _print_manual_launch(placed, command, job=job, bind=bind, mpirun=mpirun, rendezvous=rendezvous)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    fleet = start_reducers(reducers, env=base, host=bind)
    env = {**base, **rendezvous, "REDSRV_REDUCERS": ",".join(fleet.addresses), "REDSRV_JOB": job, "PYTHONUNBUFFERED": "1"}
    # Each rank learns its HOROVOD_* variables from its MPI rank on its host (cli/hvd_env.py).
    wrapped = hvd_env.wrap([count for _, count in placed], command)
    line = host_lists.mpirun_command(flavour, placed, wrapped, exported=host_lists.exported_names(env),
                                     output_dir=output_dir, as_root=os.geteuid() == 0, mpi_args=mpi_args)
    line[0] = mpirun
    lock = threading.Lock()
    proc: subprocess.Popen[bytes] | None = None
    pumps = []
    try:
        proc = subprocess.Popen(line, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for stream, sink in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
            pump = threading.Thread(target=_retag, args=(stream, sink, lock), name="redsrv-run-mpirun", daemon=True)
            pump.start()
            pumps.append(pump)
        code = proc.wait()
        for pump in pumps:
            pump.join(C.DEFAULT_CLOSE_TIMEOUT_S)
        if code != 0:
            _note(sys.stderr.buffer, lock, f"redsrv run: mpirun exited with status {code}")
        return 128 - code if code < 0 else code
    except KeyboardInterrupt:
        _note(sys.stderr.buffer, lock, "redsrv run: interrupted; stopping mpirun and the reducers")
        return 130
    finally:
        stop_processes([proc] if proc is not None else [], timeout=C.DEFAULT_CLOSE_TIMEOUT_S)
        stop_processes(fleet.procs)
        signal.signal(signal.SIGTERM, previous)


def _mpi_flavour(mpirun: str) -> str | None:
    try:
        shown = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=C.DEFAULT_CONNECT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return host_lists.mpi_flavour(shown.stdout + shown.stderr)


def _address_towards(host: str) -> str:
    """This machine's address on the route to ``host``: connecting a UDP socket picks the
    source address and sends nothing."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise ConfigError(f"cannot find this machine's address towards {host!r} ({exc}); give it with --reducer-host") from None


def _retag(stream: IO[bytes] | None, sink: IO[bytes], lock: threading.Lock) -> None:
    assert stream is not None
    output = host_lists.MpiOutput()
    for text in stream:  # whole lines of mpirun's output: a tag never spans one
        lines = output.feed(text)
        with lock:
            sink.writelines(lines)
            sink.flush()
    with lock:
        sink.writelines(output.close())
        sink.flush()
    stream.close()


def _print_manual_launch(placed: Sequence[tuple[str, int]], command: Sequence[str], *, job: str, bind: str,
                         mpirun: str | None, rendezvous: dict[str, str]) -> int:
    reducer = f"{bind}:{C.DEFAULT_PORT}"
    variables = {"REDSRV_REDUCERS": reducer, "REDSRV_JOB": job, "REDSRV_SECRET_FILE": "<a file holding the secret>"}
    why = f"{mpirun} is neither Open MPI nor MPICH" if mpirun else "no mpirun on PATH"
    print(f"redsrv run: {why}, so the workers on other hosts are not started from here. Start a reducer:\n"
          f"  redsrv reducer --host {bind} --port {C.DEFAULT_PORT} --secret-file <a file holding the secret>\n"
          "then the workers, with one of:", file=sys.stderr)
    for where, line in host_lists.manual_commands(placed, command, variables=variables,
                                                  master_port=int(rendezvous["MASTER_PORT"])):
        print(f"  # {where}\n  {line}", file=sys.stderr)
    return 2
