"""``redsrv reducer --processes k``: k reducer processes on one host, on consecutive ports.

One reducer process runs one event loop, so it moves at most one core's worth of bytes
(``redsrv plan`` calls it the reducer data-path ceiling, docs/performance.md). A host with a
faster NIC than that runs several: this supervisor starts ``k`` of them on ports ``P .. P+k-1``
(the workers list them as ``host:P-Q``, which :func:`redsrv.core.config.expand_reducers`
expands), restarts one that exits on its own on the same port (the workers ride through that
within their reconnect window, as through any reducer restart), and stops them all on SIGTERM or
SIGINT. Each child is an ordinary ``redsrv reducer``: the processes share nothing, and every
chunk of an operation lives in exactly one of them, so sums stay exact and rank-ordered.

The supervisor resolves the settings once (so a configuration mistake is one error at start-up)
and hands each child explicit flags; the host-wide memory budget is split evenly between them.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from redsrv.core import constants as C
from redsrv.core.config import DaemonSettings
from redsrv.core.errors import ConfigError

from .fleet import LISTEN_LINE, readline_within, stop_on_signals

__all__ = ["supervise"]

log = logging.getLogger("redsrv.reducer")

#: Variables the supervisor has already resolved into each child's flags; a child reading them
#: as well would see two sources for one setting.
_RESOLVED_VARIABLES = ("REDSRV_HOST", "REDSRV_PORT", "REDSRV_MEMORY_BUDGET_BYTES", "REDSRV_MAX_OP_TIMEOUT", "TF_CONFIG",
                       "CLUSTER_SPEC")


@dataclass
class _Child:
    index: int
    port: int  # 0 until the first start reports the port it picked
    proc: subprocess.Popen[str] | None = None
    restarts: int = 0
    next_start: float = 0.0
    backoff: float = C.PROCESS_RESTART_BACKOFF_S


def supervise(settings: DaemonSettings, processes: int, *, secret_file: str | None, require_secret: bool,
              metrics_port: int | None, metrics_host: str | None, log_level: str, log_format: str,
              start_timeout: float = 30.0) -> int:
    """Run ``processes`` reducers until SIGTERM/SIGINT; returns the exit status."""
    if not 1 <= processes <= C.MAX_PROCESSES_PER_REDUCER_HOST:
        raise ConfigError(f"--processes must be in 1..{C.MAX_PROCESSES_PER_REDUCER_HOST}, got {processes}")
    if settings.port != 0 and settings.port + processes - 1 > 65535:
        raise ConfigError(f"--processes {processes} from port {settings.port} runs past port 65535")
    if settings.memory_budget_bytes // processes < settings.job_budget_bytes:
        raise ConfigError(f"the memory budget ({settings.memory_budget_bytes} bytes) split over {processes} processes "
                          f"is below the per-job budget ({settings.job_budget_bytes} bytes): raise --memory-budget")
    env = {k: v for k, v in os.environ.items() if k not in _RESOLVED_VARIABLES}
    children = [_Child(i, settings.port + i if settings.port else 0) for i in range(processes)]

    def argv(child: _Child) -> list[str]:
        args = [sys.executable, "-m", "redsrv", "reducer", "--host", settings.host, "--port", str(child.port),
                "--memory-budget", str(settings.memory_budget_bytes // processes),
                "--max-op-timeout", repr(settings.max_op_timeout), "--log-level", log_level, "--log-format", log_format]
        if secret_file is not None:
            args += ["--secret-file", secret_file]
        if require_secret:
            args.append("--require-secret")
        if metrics_port is not None:
            args += ["--metrics-port", str(metrics_port + child.index)]
            if metrics_host is not None:
                args += ["--metrics-host", metrics_host]
        return args

    def start(child: _Child) -> bool:
        proc = subprocess.Popen(argv(child), stdout=subprocess.PIPE, text=True, env=env)
        line = readline_within(proc, start_timeout)
        match = LISTEN_LINE.search(line)
        if match is None:
            proc.send_signal(signal.SIGTERM)
            _end(proc, settings.close_timeout)
            _close_pipe(proc)
            log.error("reducer process %d of %d did not start on port %d (printed %r, exit code %s)",
                      child.index, processes, child.port, line, proc.poll())
            return False
        child.proc, child.port = proc, int(match.group(2))
        print(line.rstrip("\n"), f"pid={proc.pid}", flush=True)
        # The child prints nothing more on stdout today; drain it anyway so a line it might add
        # can never block it on a full pipe.
        threading.Thread(target=_forward, args=(proc,), name=f"redsrv-child-{child.index}", daemon=True).start()
        return True

    stop, received = stop_on_signals()
    try:
        for child in children:
            if not start(child):
                return 1
        shown = f"[{settings.host}]" if ":" in settings.host else settings.host
        ports = [c.port for c in children]
        listed = (f"{shown}:{ports[0]}-{ports[-1]}" if ports == list(range(ports[0], ports[0] + processes))
                  else ",".join(f"{shown}:{p}" for p in ports))
        print(f"redsrv reducer: {processes} processes; list them as {listed}", flush=True)
        while not stop.wait(0.2):
            now = time.monotonic()
            for child in children:
                if child.proc is not None and child.proc.poll() is not None:
                    log.warning("reducer process %d (pid %d, port %d) exited with %s; restarting it on the same port "
                                "in %.1fs", child.index, child.proc.pid, child.port, child.proc.returncode, child.backoff)
                    child.proc, child.next_start = None, now + child.backoff
                if child.proc is None and now >= child.next_start and not stop.is_set():
                    child.restarts += 1
                    if start(child):
                        child.backoff = C.PROCESS_RESTART_BACKOFF_S
                    else:
                        child.backoff = min(child.backoff * 2, C.PROCESS_RESTART_BACKOFF_MAX_S)
                        child.next_start = time.monotonic() + child.backoff
        log.info("stopping %d reducer processes (%s)", processes, received[0] if received else "stop")
        return 0
    finally:
        for child in children:
            if child.proc is not None and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        for child in children:
            if child.proc is not None:
                _end(child.proc, settings.close_timeout + 2.0)


def _forward(proc: subprocess.Popen[str]) -> None:
    """Copy the rest of a child's stdout to ours; the pipe is this thread's to close, at EOF."""
    assert proc.stdout is not None
    with proc.stdout:
        for line in proc.stdout:
            print(line.rstrip("\n"), flush=True)


def _end(proc: subprocess.Popen[str], timeout: float) -> None:
    """Wait for ``proc`` (already asked to stop) up to ``timeout``, then SIGKILL it; by pid."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _close_pipe(proc: subprocess.Popen[str]) -> None:
    if proc.stdout is not None:
        try:
            proc.stdout.close()
        except OSError:
            pass
