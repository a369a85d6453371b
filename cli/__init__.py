"""The ``redsrv`` command line: ``redsrv reducer``, ``redsrv demo``, ``redsrv run``, ``redsrv bench``."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import threading
from collections.abc import Sequence

from redsrv.cli.fleet import stop_on_signals
from redsrv.cli.units import parse_size, plain_help
from redsrv.core import constants as C
from redsrv.core.config import DaemonSettings
from redsrv.core.daemon import ReducerDaemon
from redsrv.core.errors import ConfigError

__all__ = ["main"]


def _add_log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="log verbosity (default: info)")
    parser.add_argument("--log-format", default="text", choices=["text", "json"],
                        help="text lines, or one JSON object per line for log collectors (default: text)")


class _JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message (which names job, rank, key,
    chunk and peer), plus the process id to tell reducers apart in a merged stream."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"), "level": record.levelname,
                 "logger": record.name, "message": record.getMessage(), "pid": record.process}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def _setup_logging(level: str, fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler])


def _reducer(args: argparse.Namespace) -> int:
    _setup_logging(args.log_level, args.log_format)
    # One validated source: flags, then REDSRV_* variables, then TF_CONFIG / CLUSTER_SPEC; a
    # secret from any of them obeys the same rules (see DaemonSettings.from_env).
    settings = DaemonSettings.from_env(
        host=args.host, port=args.port, secret_file=args.secret_file,
        memory_budget_bytes=None if args.memory_budget is None else _parse_bytes(args.memory_budget, "--memory-budget"),
        max_op_timeout=args.max_op_timeout,
    )
    if args.require_secret and settings.secret is None:
        raise ConfigError("--require-secret given but no secret: pass --secret-file or set REDSRV_SECRET_FILE")
    if args.processes != 1:
        from redsrv.cli.processes import supervise

        return supervise(settings, args.processes, secret_file=args.secret_file, require_secret=args.require_secret,
                         metrics_port=args.metrics_port, metrics_host=args.metrics_host, log_level=args.log_level,
                         log_format=args.log_format)
    daemon = ReducerDaemon(settings)
    stop, received = stop_on_signals()
    host, port = daemon.start()
    if args.metrics_port is not None:
        from redsrv.cli.metrics import serve_reducer_metrics

        serve_reducer_metrics(daemon, args.metrics_port, host=args.metrics_host or host)
    shown = f"[{host}]" if ":" in host else host
    print(f"redsrv reducer listening on {shown}:{port} incarnation={daemon.incarnation:#x} plane={daemon.plane}",
          flush=True)
    while not stop.wait(0.5):
        if daemon.failure is not None:
            print(f"redsrv reducer: stopped serving after an internal error: {daemon.failure!r}", file=sys.stderr,
                  flush=True)
            os._exit(1)
    # The bound on shutdown holds even if something in it were stuck: past the close timeout
    # (plus a grace second) dump every thread's stack for diagnosis and exit anyway.
    watchdog = threading.Timer(settings.close_timeout + 1.0, _force_exit, args=(settings.close_timeout,))
    watchdog.daemon = True
    watchdog.start()
    daemon.stop(f"reducer received {received[0] if received else 'stop'}")
    # Nothing is left to save: leave now rather than risk interpreter finalisation waiting on a
    # thread still inside a system call (a soak run once saw a reducer outlive its SIGTERM).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _parse_bytes(text: str, option: str) -> int:
    """``"2GiB"``, ``"512MB"``, ``"1048576"`` -> bytes (cli/units.py); a bad one is a configuration error."""
    try:
        return parse_size(text)
    except ValueError:
        raise ConfigError(f"{option} must be a size such as 2GiB, 512MiB or 1000000, got {text!r}") from None


def _force_exit(close_timeout: float) -> None:
    import faulthandler

    logging.getLogger("redsrv.reducer").error("shutdown took longer than the close timeout (%.1fs); exiting now. "
                                               "Thread stacks follow.", close_timeout)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(1)


def _demo(args: argparse.Namespace) -> int:
    from redsrv.cli.demo import run_demo

    return run_demo(workers=args.workers, reducers=args.reducers, steps=args.steps, framework=args.framework,
                    wire_dtype=args.wire_dtype)


#: Each module under redsrv.bench adds its own ``redsrv bench NAME`` subcommand with
#: ``add_parser(subparsers)``; importing them is cheap (frameworks are imported when run).
BENCH_MODULES = ("local", "emulate", "train", "sessions", "torch_ops", "fsdp", "allreduce", "plan_check", "frame_path",
                 "core_path", "frame_writer")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="redsrv",
        description="A reduction server for data-parallel training: workers push gradient chunks to stateless CPU "
        "reducers and pull back the sums.",
    )
    from redsrv import __version__

    parser.add_argument("--version", action="version", version=f"redsrv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("reducer", help="run one reducer until SIGTERM",
                       description="Run one reducer. Start one per CPU host; give the workers every reducer's "
                       "host:port (REDSRV_REDUCERS). Aggregate reducer bandwidth should match aggregate worker bandwidth.")
    p.add_argument("--host", default=None,
                   help=f"address to bind (default: this reducer's entry in TF_CONFIG / CLUSTER_SPEC, else "
                   f"{C.DEFAULT_BIND_HOST}; use 0.0.0.0 on a cluster, with a secret)")
    p.add_argument("--port", type=int, default=None,
                   help=f"port (default: from TF_CONFIG / CLUSTER_SPEC, else {C.DEFAULT_PORT}; 0 picks a free one and prints it)")
    p.add_argument("--secret-file", help="file holding the shared secret (else REDSRV_SECRET_FILE / REDSRV_SECRET)")
    p.add_argument("--require-secret", action="store_true", help="refuse to start without a secret")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (needs redsrv[metrics])")
    p.add_argument("--metrics-host", default=None,
                   help="address for the metrics endpoint (default: the reducer's own --host; the endpoint has no "
                        "authentication and names jobs)")
    p.add_argument("--memory-budget", default=None,
                   help="bytes of contributions and results held over every job together, e.g. 2GiB (default "
                        f"{C.DEFAULT_MEMORY_BUDGET_BYTES // 2**20} MiB; REDSRV_MEMORY_BUDGET_BYTES)")
    p.add_argument("--processes", type=int, default=1,
                   help="run this many reducer processes on ports PORT..PORT+k-1, one event loop (about one core) each; "
                        "list them as host:PORT-LAST. The memory budget is split between them; one that exits is "
                        "restarted on its port (default 1; `redsrv plan` recommends k)")
    p.add_argument("--max-op-timeout", type=float, default=None,
                   help=f"cap on the operation timeout a worker may ask for, seconds (default {C.DEFAULT_MAX_OP_TIMEOUT_S:g})")
    _add_log_level(p)
    p.set_defaults(func=_reducer)

    p = sub.add_parser("demo", help="train a small model through a local reducer fleet and check the result",
                       description="Starts reducers and worker processes on this machine, trains a small model for a "
                       "few seconds through the reduction server, checks the weights against a single-process "
                       "reference, prints a summary and cleans up.")
    p.add_argument("--workers", type=int, default=3, help="worker processes (default 3)")
    p.add_argument("--reducers", type=int, default=2, help="reducer processes (default 2)")
    p.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    p.add_argument("--framework", choices=["auto", "numpy", "torch", "jax", "tf"], default="auto",
                   help="model framework: PyTorch DDP with the redsrv hook when torch is installed, else NumPy "
                   "(default auto); jax trains with optax through redsrv.jax, tf with Keras fit and "
                   "ReductionServerStrategy")
    p.add_argument("--wire-dtype", choices=["bf16", "fp16"], default=None, help="compress gradients on the wire")
    p.set_defaults(func=_demo)

    importlib.import_module("redsrv.cli.run").add_parser(sub)
    importlib.import_module("redsrv.cli.soak").add_parser(sub)
    importlib.import_module("redsrv.cli.plan").add_parser(sub)
    importlib.import_module("redsrv.cli.timeline").add_parser(sub)

    p = sub.add_parser("bench", help="benchmarks", description="Benchmarks of the reduction server.")
    bench = p.add_subparsers(dest="bench_command", required=True, metavar="KIND")
    for name in BENCH_MODULES:
        importlib.import_module(f"redsrv.bench.{name}").add_parser(bench)
    plain_help(parser)  # the subcommands' descriptions are module docstrings, written in reST
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result: int = args.func(args)
        return result
    except ConfigError as exc:
        print(f"redsrv: configuration error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
