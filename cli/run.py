"""``redsrv run -np N [--reducers M] python train.py ...``: the ``horovodrun -np N`` of one
machine. Starts M reducers on free loopback ports and N workers running the command with their
rank, world size, reducers, job and a fresh shared secret in the environment; streams every
worker's output with a ``[rank]`` prefix; stops everything when the workers end, one fails, or
on Ctrl-C / SIGTERM. Exits with the first failing worker's status (0 when all succeed)."""

from __future__ import annotations

import argparse
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Sequence
from typing import IO, Any

from redsrv.cli.fleet import free_port, start_reducers, stop_processes
from redsrv.core.config import Config, DaemonSettings

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
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command each worker runs, e.g. python train.py")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return run(command, num_proc=args.num_proc, reducers=args.reducers, job=args.job)


def run(command: Sequence[str], *, num_proc: int, reducers: int = 1, job: str | None = None,
        output: IO[bytes] | None = None, errors: IO[bytes] | None = None) -> int:
    """Run ``command`` as ``num_proc`` workers through ``reducers`` local reducers; the exit
    status: 0, or the first failing worker's (128 + signal number when killed by one). The
    workers' stdout goes to ``output`` and their stderr to ``errors`` (default: ours)."""
    if not command:
        raise SystemExit("redsrv run: no command given (e.g. redsrv run -np 2 python train.py)")
    if num_proc < 1 or reducers < 1:
        raise SystemExit("redsrv run: -np and --reducers must be at least 1")
    sink = output if output is not None else sys.stdout.buffer
    error_sink = errors if errors is not None else sys.stderr.buffer
    base = {k: v for k, v in os.environ.items() if k not in _INHERITED_PLACEMENT}
    base["REDSRV_SECRET"] = secrets.token_hex(32)  # reducers and workers of this run only
    job = job or f"run-{uuid.uuid4().hex[:8]}"
    # Bad REDSRV_* fail here, once: the workers' settings and the reducers' own (REDSRV_STALL_WARNING...).
    Config.from_env(base, rank=0, world_size=num_proc, reducers=("127.0.0.1:1",), job=job)
    DaemonSettings.from_env(base)
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
            for stream, target, report in ((proc.stdout, sink, exits), (proc.stderr, error_sink, None)):
                pump = threading.Thread(target=_pump, args=(rank, proc, stream, target, write_lock, report),
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



def _pump(rank: int, proc: subprocess.Popen[bytes], stream: IO[bytes] | None, sink: IO[bytes], lock: threading.Lock,
          exits: queue.Queue[tuple[int, int]] | None) -> None:
    """Copy one of the worker's streams line by line with its rank in front; the stdout pump
    reports the worker's exit once its output is drained."""
    prefix = f"[{rank}] ".encode()
    assert stream is not None
    for line in stream:
        with lock:
            sink.write(prefix + line)
            sink.flush()
    stream.close()
    if exits is not None:
        exits.put((rank, proc.wait()))


def _note(sink: IO[bytes], lock: threading.Lock, text: str) -> None:
    with lock:
        sink.write(text.encode() + b"\n")
        sink.flush()
