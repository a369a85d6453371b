"""``redsrv run -np N --min-np A --max-np B``: Horovod's elastic mode on one machine.

The driver starts the reducers, the rendezvous (core/rendezvous.py, deciding with
core/membership.py) and N workers; a worker learns its rank, size and epoch's job at
``hvd.init()`` from the rendezvous instead of the environment. When a worker dies, the others'
collectives fail, they restore their last commit and re-form the world without it (at least A
workers); once that world has formed the driver starts a replacement, which joins at the
survivors' next commit. The run ends when the workers of the last world have all exited: 0 when
each exited 0, else the first failure's status; also when fewer than A workers can be alive, or
after ``--reset-limit`` new worlds. Output lines carry the worker's number (``[w3]``): ranks
change from one world to the next.
"""

from __future__ import annotations

import functools
import queue
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Sequence

from redsrv.cli.fleet import start_reducers, stop_processes
from redsrv.cli.run import _interrupt, _note, pump_lines, rank_files, worker_base_env
from redsrv.core import constants as C
from redsrv.core.errors import ConfigError
from redsrv.core.membership import Membership
from redsrv.core.rendezvous import RendezvousServer

__all__ = ["run_elastic"]


def run_elastic(command: Sequence[str], *, num_proc: int, min_np: int | None = None, max_np: int | None = None,
                reset_limit: int | None = None, reducers: int = 1, job: str | None = None,
                output_dir: str | None = None) -> int:
    """Run ``command`` as ``num_proc`` elastic workers (see the module docstring); the exit status."""
    if not command:
        raise SystemExit("redsrv run: no command given (e.g. redsrv run -np 3 --min-np 2 python train.py)")
    min_np = min_np if min_np is not None else num_proc
    max_np = max_np if max_np is not None else num_proc
    if not 1 <= min_np <= num_proc <= max_np:
        raise ConfigError(f"elastic sizes must satisfy 1 <= --min-np ({min_np}) <= -np ({num_proc}) <= --max-np ({max_np})")
    reset_limit = C.DEFAULT_ELASTIC_RESET_LIMIT if reset_limit is None else reset_limit
    if reset_limit < 0:
        raise ConfigError(f"--reset-limit must be >= 0, got {reset_limit}")
    job = job or f"run-{uuid.uuid4().hex[:8]}"
    base = worker_base_env(num_proc, job)
    events: queue.Queue[tuple[str, str, int]] = queue.Queue()
    membership = Membership(job, min_size=min_np, max_size=max_np)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    fleet = start_reducers(reducers, env=base)
    rendezvous = RendezvousServer(membership, base["REDSRV_SECRET"].encode(),
                                  on_formed=lambda epoch: events.put(("formed", "", epoch)))
    driver = _Driver(command, base={**base, "REDSRV_REDUCERS": ",".join(fleet.addresses), "REDSRV_JOB": job,
                                    "REDSRV_RENDEZVOUS": rendezvous.address, "PYTHONUNBUFFERED": "1"},
                     rendezvous=rendezvous, events=events, output_dir=output_dir)
    try:
        for _ in range(num_proc):
            if not driver.spawn():
                return 127
        return driver.supervise(num_proc=num_proc, min_np=min_np, reset_limit=reset_limit)
    except KeyboardInterrupt:
        _note(sys.stderr.buffer, driver.lock, "redsrv run: interrupted; stopping workers and reducers")
        return 130
    finally:
        stop_processes(list(driver.procs.values()), timeout=5)
        rendezvous.close()
        stop_processes(fleet.procs)
        for pump in driver.pumps:
            pump.join(5)
        signal.signal(signal.SIGTERM, previous)


class _Driver:
    def __init__(self, command: Sequence[str], *, base: dict[str, str], rendezvous: RendezvousServer,
                 events: queue.Queue[tuple[str, str, int]], output_dir: str | None) -> None:
        self.command = list(command)
        self.base = base
        self.rendezvous = rendezvous
        self.events = events
        self.output_dir = output_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.pumps: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.started = 0

    def spawn(self) -> bool:
        worker = f"w{self.started}"
        self.started += 1
        self.rendezvous.started(worker)
        try:
            proc = subprocess.Popen(self.command, env={**self.base, "REDSRV_WORKER_ID": worker}, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE)
        except OSError as exc:
            self.rendezvous.exited(worker, 127)
            _note(sys.stderr.buffer, self.lock, f"redsrv run: cannot start {self.command[0]!r}: {exc.strerror}")
            return False
        self.procs[worker] = proc
        files = rank_files(self.output_dir, self.started - 1, 1) if self.output_dir else (None, None)
        for stream, sink, copy, report in ((proc.stdout, sys.stdout.buffer, files[0], True),
                                           (proc.stderr, sys.stderr.buffer, files[1], False)):
            on_exit = functools.partial(self._exited, worker) if report else None
            pump = threading.Thread(target=pump_lines, args=(worker, proc, stream, sink, self.lock, on_exit, copy),
                                    name=f"redsrv-run-{worker}", daemon=True)
            pump.start()
            self.pumps.append(pump)
        return True

    def _exited(self, worker: str, code: int) -> None:
        self.events.put(("exit", worker, code))

    def supervise(self, *, num_proc: int, min_np: int, reset_limit: int) -> int:
        """Handle exits and new worlds until the job ends; its exit status. Lost workers are
        replaced once the survivors have re-formed (so the replacement joins at a commit of that
        world), or at once when too few survive to re-form without it; at most ``reset_limit``
        new worlds and as many replacements."""
        membership = self.rendezvous.membership
        failures: dict[str, int] = {}
        worlds = replacements = 0
        while True:
            kind, worker, status = self.events.get()
            if kind == "formed":
                worlds += 1
                if worlds - 1 > reset_limit:
                    _note(sys.stderr.buffer, self.lock, f"redsrv run: the world re-formed {worlds - 1} times, past "
                          f"--reset-limit {reset_limit}; stopping")
                    return next(iter(failures.values()), 1)
            else:
                proc = self.procs.pop(worker)
                if status != 0:
                    failures[worker] = 128 - status if status < 0 else status
                    _note(sys.stderr.buffer, self.lock, f"redsrv run: worker {worker} (pid {proc.pid}) exited with "
                          f"status {status}")
                self.rendezvous.exited(worker, status)
            with self.rendezvous.changed:
                finished, alive, world = membership.finished, len(membership.alive), list(membership.members)
                survivors = sum(1 for w in world if w in membership.alive)
            if finished:  # someone completed: the job ends with the last world's workers
                if not any(w in self.procs for w in world):
                    return next((failures[w] for w in world if w in failures), 0)
                continue
            if not self.procs:
                return next(iter(failures.values()), 1)
            if kind == "formed" or (status != 0 and survivors < min_np):
                for _ in range(num_proc - alive):
                    replacements += 1
                    if replacements > reset_limit:
                        _note(sys.stderr.buffer, self.lock, f"redsrv run: {replacements - 1} workers replaced, the "
                              f"--reset-limit {reset_limit}; stopping")
                        return next(iter(failures.values()), 1)
                    if not self.spawn():
                        return 127
