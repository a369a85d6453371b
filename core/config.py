"""The one place redsrv reads its configuration from the environment.

Two frozen classes, validated eagerly with the same rules: :class:`Config` for a worker (the
client, the adapters, the Horovod API) and :class:`DaemonSettings` for a reducer (``redsrv
reducer``, :class:`~redsrv.ReducerDaemon`). An unknown ``REDSRV_*`` variable, a non-positive
timeout or a malformed address is a :class:`~redsrv.ConfigError` when the client or daemon
starts, not a surprise at step 10,000. Explicit arguments win over the environment.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import constants as C
from .errors import ConfigError
from .plane import PLANES, native_unavailable
from .wire import StragglerMode

__all__ = ["Config", "DaemonSettings", "ClusterSpec", "cluster_from_env", "reducer_bind_address", "parse_address",
           "expand_reducers", "require_positive", "congestion_setting", "check_secret", "read_secret_file",
           "launcher_variables", "local_launcher_variables", "ENV_PREFIX", "WIRE_DTYPES", "STRAGGLER_MODES",
           "HOST_REDUCE_MODES"]

ENV_PREFIX = "REDSRV_"

log = logging.getLogger("redsrv.config")

# Kubernetes injects, for every Service in a pod's namespace, <NAME>_SERVICE_HOST,
# <NAME>_SERVICE_PORT[_<PORT NAME>], <NAME>_PORT=tcp://ip:port and <NAME>_PORT_<n>_<PROTO>[_ADDR|
# _PORT|_PROTO] (docker links' format). A Service called redsrv-metrics or redsrv would put such
# names under our prefix (REDSRV_PORT among them, with a tcp:// value): recognised, never taken
# for settings (docs/operations.md, "Kubernetes").
_SERVICE_LINK_NAME = re.compile(r"_SERVICE_HOST$|_SERVICE_PORT(_[A-Z0-9_]+)?$|_PORT_\d+_(TCP|UDP|SCTP)(_ADDR|_PORT|_PROTO)?$")
_SERVICE_LINK_VALUE = re.compile(r"^(tcp|udp|sctp)://[^\s/]+:\d+$")
_service_links_reported: set[str] = set()

#: Accepted names for compressed wire formats.
WIRE_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}

STRAGGLER_MODES = {"all": StragglerMode.ALL, "first_m": StragglerMode.FIRST_M, "deadline": StragglerMode.DEADLINE}

#: ``host_reduce``: "host" reduces inside each host first (core/host_client.py), "flat" sends every
#: process's whole buffer to the reducers, "auto" picks "host" where a launcher says that several
#: workers share this host and the job spans more than one host. A job whose workers all share one
#: host, under "host", is reduced wholly in shared memory and never contacts the reducers; "auto"
#: does that only in the torch c10d backend, for a group whose ranks find through its store that
#: they share one host (docs/torch_backend.md, "One host"): the clients of the other adapters send
#: a one-host job to the reducers, as the demo, the tests and a user trying the reducers expect.
HOST_REDUCE_MODES = ("auto", "host", "flat")


def parse_address(text: str, default_port: int = C.DEFAULT_PORT) -> tuple[str, int]:
    """``"host:port"``, ``"host"`` or ``"[v6]:port"`` -> (host, port).

    >>> parse_address("10.0.0.5:7000")
    ('10.0.0.5', 7000)
    >>> parse_address("[::1]:7000")
    ('::1', 7000)
    """
    text = text.strip()
    if not text:
        raise ConfigError("empty reducer address")
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep:
            raise ConfigError(f"reducer address {text!r}: missing ']'")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    else:
        host, port_text = text, ""
    try:
        port = int(port_text) if port_text else default_port
    except ValueError:
        raise ConfigError(f"reducer address {text!r}: port {port_text!r} is not a number") from None
    if not 0 < port < 65536 or not host:
        raise ConfigError(f"reducer address {text!r}: need host:port with port in 1..65535")
    return host, port


def expand_reducers(entries: Sequence[str] | str) -> tuple[str, ...]:
    """Reducer addresses, with a port range ``host:P-Q`` standing for ``host:P`` .. ``host:Q``:
    the processes ``redsrv reducer --processes k --port P`` starts on one host.

    >>> expand_reducers("10.0.0.5:29600-29602,10.0.0.6:29600")
    ('10.0.0.5:29600', '10.0.0.5:29601', '10.0.0.5:29602', '10.0.0.6:29600')
    >>> expand_reducers(["[::1]:7000-7001"])
    ('[::1]:7000', '[::1]:7001')
    """
    if isinstance(entries, str):
        entries = entries.split(",")
    out: list[str] = []
    for entry in (e.strip() for e in entries):
        if not entry:
            continue
        host_part, sep, ports = entry.rpartition(":")
        first, dash, last = ports.partition("-")
        if not (sep and dash and host_part):
            parse_address(entry)
            out.append(entry)
            continue
        if not (first.isdigit() and last.isdigit()):
            raise ConfigError(f"reducer address {entry!r}: a port range is two numbers, such as host:29600-29607")
        low, high = int(first), int(last)
        if not 0 < low <= high < 65536:
            raise ConfigError(f"reducer address {entry!r}: need a port range low-high within 1..65535, low <= high")
        if high - low >= C.MAX_PROCESSES_PER_REDUCER_HOST:
            raise ConfigError(f"reducer address {entry!r}: at most {C.MAX_PROCESSES_PER_REDUCER_HOST} ports in a range")
        for port in range(low, high + 1):
            address = f"{host_part}:{port}"
            parse_address(address)
            out.append(address)
    return tuple(out)


@dataclass(frozen=True)
class ClusterSpec:
    """What ``TF_CONFIG`` or Vertex AI's ``CLUSTER_SPEC`` says about this process."""

    reducers: tuple[str, ...]
    num_workers: int | None
    worker_index: int | None  # None: this process is not a training worker
    reducer_index: int | None  # set when this process is one of the reducers
    source: str  # the variable it came from, for messages


# Vertex AI names its pools: 0 the primary replica, 1 the other workers, 2 the reduction servers.
# Tasks that are neither workers nor reducers take no rank: Keras runs parameter servers and the
# evaluator beside the workers' collectives, not in them.
_VERTEX_POOLS: dict[str, Any] = {"chief": "workerpool0", "worker": "workerpool1", "reducer": "workerpool2",
                                 "bystanders": ("workerpool3",)}
_TF_CONFIG_POOLS: dict[str, Any] = {"chief": "chief", "master": "master", "worker": "worker", "reducer": "reducer",
                                    "bystanders": ("ps", "evaluator")}


def cluster_from_env(environ: Mapping[str, str]) -> ClusterSpec | None:
    """Parse ``TF_CONFIG`` (or, if absent, ``CLUSTER_SPEC``) from ``environ``; ``None`` if neither.

    The chief, if any, is worker 0 and the workers follow it (the ``MultiWorkerMirroredStrategy``
    convention; Kubeflow's TFJob may call it ``"master"``, TF 1's name); ``"ps"`` and
    ``"evaluator"`` tasks are not training workers, as Keras treats them. The ``"reducer"`` task
    list (Vertex: ``workerpool2``) names the reducers; a cluster without one (a TFJob) leaves
    them to ``REDSRV_REDUCERS``.

    >>> import json
    >>> spec = cluster_from_env({"TF_CONFIG": json.dumps({
    ...     "cluster": {"worker": ["w0:2222", "w1:2222"], "reducer": ["r0:29600", "r1:29600"]},
    ...     "task": {"type": "worker", "index": 1}})})
    >>> spec.reducers, spec.num_workers, spec.worker_index
    (('r0:29600', 'r1:29600'), 2, 1)
    >>> spec = cluster_from_env({"TF_CONFIG": json.dumps({  # Kubeflow TFJob: no reducers listed
    ...     "cluster": {"master": ["m:2222"], "worker": ["w0:2222"], "ps": ["p:2222"]},
    ...     "task": {"type": "worker", "index": 0}})})
    >>> spec.reducers, spec.num_workers, spec.worker_index
    ((), 2, 1)
    """
    for variable, pools in (("TF_CONFIG", _TF_CONFIG_POOLS), ("CLUSTER_SPEC", _VERTEX_POOLS)):
        raw = environ.get(variable, "").strip()
        if raw:
            return _parse_cluster(variable, raw, pools)
    return None


def _parse_cluster(variable: str, raw: str, pools: Mapping[str, str]) -> ClusterSpec:
    try:
        spec = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"{variable} is not valid JSON: {exc}") from None
    cluster = spec.get("cluster") if isinstance(spec, dict) else None
    if not isinstance(cluster, dict):
        raise ConfigError(f'{variable} has no "cluster" object')

    def tasks(role: str) -> list[str]:
        entries = cluster.get(pools[role], [])
        if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
            raise ConfigError(f'{variable}: cluster["{pools[role]}"] must be a list of "host:port" strings')
        for entry in entries:
            try:
                parse_address(entry)
            except ConfigError as exc:
                raise ConfigError(f"{variable}: {exc}") from None
        return entries

    chiefs = tasks("chief") + (tasks("master") if "master" in pools else [])
    workers, reducers = tasks("worker"), tasks("reducer")
    if len(chiefs) > 1:
        raise ConfigError(f"{variable} lists {len(chiefs)} chiefs (chief and master together): a cluster has one")
    num_workers = len(chiefs) + len(workers)
    task = spec.get("task")
    worker_index = reducer_index = None
    if isinstance(task, dict) and task:
        kind, number = task.get("type"), task.get("index", 0)
        if not isinstance(number, int) or number < 0:
            raise ConfigError(f"{variable}: task index must be a non-negative integer, got {number!r}")
        if kind in (pools["chief"], pools.get("master")):
            worker_index, count = number, len(chiefs)
        elif isinstance(kind, str) and kind in pools["bystanders"]:
            count = len(cluster.get(kind) or [])  # not a worker: no rank
        elif kind == pools["worker"]:
            worker_index, count = len(chiefs) + number, len(chiefs) + len(workers)
        elif kind == pools["reducer"]:
            reducer_index, count = number, len(reducers)
        else:
            workers_named = ", ".join(repr(pools[k]) for k in ("chief", "master", "worker") if k in pools)
            raise ConfigError(f"{variable}: task type {kind!r} is neither a worker ({workers_named}), a reducer "
                              f"({pools['reducer']!r}) nor one of {', '.join(repr(b) for b in pools['bystanders'])}")
        if (worker_index if worker_index is not None else number) >= count:
            raise ConfigError(f"{variable}: task {kind}:{number} is out of range ({count} listed)")
    return ClusterSpec(tuple(reducers), num_workers or None, worker_index, reducer_index, variable)


def reducer_bind_address(environ: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """Where a reducer started under ``TF_CONFIG`` / ``CLUSTER_SPEC`` should listen: the address
    listed for its own index. ``None`` when no cluster spec names this process a reducer."""
    spec = cluster_from_env(os.environ if environ is None else environ)
    if spec is None or spec.reducer_index is None:
        return None
    return parse_address(spec.reducers[spec.reducer_index])


def default_chunk_bytes(world_size: int) -> int:
    """The largest pipeline chunk a job of ``world_size`` workers uses unless ``chunk_bytes`` is set:
    constants.SMALL_WORLD_CHUNK_BYTES up to constants.SMALL_WORLD_RANKS workers, where a reducer's
    copies of an open chunk stay small, else constants.DEFAULT_CHUNK_BYTES."""
    return C.SMALL_WORLD_CHUNK_BYTES if world_size <= C.SMALL_WORLD_RANKS else C.DEFAULT_CHUNK_BYTES


def require_positive(settings: object, names: tuple[str, ...]) -> None:
    """Eager validation shared by every settings class: each named field must be > 0."""
    for name in names:
        if not getattr(settings, name) > 0:
            raise ConfigError(f"{name} must be positive, got {getattr(settings, name)}")


def check_data_plane(plane: str) -> None:
    """``REDSRV_DATA_PLANE``: one of core/plane.py's ``PLANES``; ``native`` only where it was built."""
    if plane not in PLANES:
        raise ConfigError(f"data_plane (REDSRV_DATA_PLANE) must be one of {', '.join(PLANES)}, got {plane!r}")
    why = native_unavailable() if plane == "native" else None
    if why is not None:
        raise ConfigError(f"data_plane (REDSRV_DATA_PLANE) is native, but {why}")


def congestion_setting(name: str) -> str | None:
    """A TCP congestion control name as the kernel spells them (``cubic``, ``bbr``, ``dctcp``),
    or ``None`` for ``"system"`` (keep the system default)."""
    name = name.strip().lower()
    if name in ("", "system", "default"):
        return None
    if not re.fullmatch(r"[a-z0-9_]{1,15}", name):
        raise ConfigError(f"tcp_congestion must be an algorithm name such as 'cubic' or 'bbr', or 'system' for the "
                          f"system default; got {name!r}")
    return name


def _env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def check_secret(secret: bytes | None) -> None:
    """The one rule for a shared secret, whatever it came from (argument, variable, file)."""
    if secret is not None and len(secret) < C.MIN_SECRET_BYTES:
        raise ConfigError(f"secret must be at least {C.MIN_SECRET_BYTES} bytes (use e.g. `openssl rand -hex 32`), "
                          f"got {len(secret)}")


def check_recv_buffer(nbytes: int) -> None:
    """``recv_buffer_bytes`` is 0 (the kernel's autotuning) or a window worth its round trips."""
    if nbytes != 0 and nbytes < C.MIN_RECV_BUFFER_BYTES:
        raise ConfigError(f"recv_buffer_bytes (REDSRV_RECV_BUFFER_BYTES) must be 0 (the kernel's autotuning) or at "
                          f"least {C.MIN_RECV_BUFFER_BYTES} bytes, got {nbytes}")


def _known_variables() -> set[str]:
    """Every ``REDSRV_*`` variable a worker or a reducer reads: both accept all of them, so one
    environment can serve a pod that runs either, and each class takes the fields it has (a
    worker leaves ``REDSRV_MEMORY_BUDGET_BYTES`` to the reducers, a reducer ``REDSRV_CHUNK_BYTES``
    to the workers)."""
    names = {f.name for f in dataclasses.fields(Config)} | {f.name for f in dataclasses.fields(DaemonSettings)}
    return ({_env_name(n) for n in names if n != "secret"} | {_env_name("secret"), _env_name("secret_file")}
            | set(_NOT_READ_AT_RUN_TIME))


#: Variables of redsrv's that no process reads at run time, accepted beside the others: setup.py's
#: build switches for the compiled plane, which a build and a test run often share an
#: environment with (tox). Names under ``REDSRV_TEST_`` are the test suite's own switches.
_NOT_READ_AT_RUN_TIME = ("REDSRV_NATIVE_STRICT", "REDSRV_NATIVE_SANITIZE")
_TEST_PREFIX = "REDSRV_TEST_"


class _Sources:
    """Values offered for settings by several sources that must agree; explicit arguments win."""

    def __init__(self, env: Mapping[str, str], overrides: Mapping[str, Any]) -> None:
        env = _without_service_links(env)
        unknown = sorted(k for k in env if k.startswith(ENV_PREFIX) and not k.startswith(_TEST_PREFIX)
                         and k not in _known_variables())
        if unknown:
            raise ConfigError(f"unknown variable(s) {', '.join(unknown)}; known: {', '.join(sorted(_known_variables()))}")
        self.env = env
        self.overrides = overrides
        self.found: dict[str, tuple[Any, str]] = {}

    def offer(self, name: str, value: Any, variable: str) -> None:
        if name in self.overrides and self.overrides[name] is not None:
            return  # an explicit argument settles it; the environment is not consulted
        if name in self.found and self.found[name][0] != value:
            first_value, first_variable = self.found[name]
            raise ConfigError(f"conflicting {name}: {first_variable} gives {first_value!r} but {variable} gives {value!r}")
        self.found.setdefault(name, (value, variable))

    def offer_variables(self, fields: Mapping[str, dataclasses.Field[Any]]) -> None:
        for name, spec in fields.items():
            raw = self.env.get(_env_name(name)) if name != "secret" else None
            if raw is not None:
                self.offer(name, _convert(name, raw, spec.type), _env_name(name))

    def values(self, fields: Mapping[str, dataclasses.Field[Any]], *, secret_file: str | None = None) -> dict[str, Any]:
        values = {name: value for name, (value, _) in self.found.items()}
        secret_file = secret_file or self.env.get(_env_name("secret_file"))
        if secret_file:
            values["secret"] = read_secret_file(secret_file)
        elif self.env.get(_env_name("secret")):
            values["secret"] = self.env[_env_name("secret")].encode("utf-8")
        values.update({k: v for k, v in self.overrides.items() if v is not None})
        unknown_args = sorted(set(values) - set(fields))
        if unknown_args:
            raise ConfigError(f"unknown config field(s) {', '.join(unknown_args)}{_elsewhere(unknown_args)}")
        return values


def _without_service_links(env: Mapping[str, str]) -> Mapping[str, str]:
    """``env`` less the variables Kubernetes made for a Service whose name starts with "redsrv":
    a known name with a ``tcp://`` value (a Service "redsrv" sets ``REDSRV_PORT=tcp://...``), and
    unknown names in the service-link format. Each is logged once, with what to do about it."""
    links = [name for name, value in env.items() if name.startswith(ENV_PREFIX)
             and (_SERVICE_LINK_VALUE.match(value.strip()) or
                  (_SERVICE_LINK_NAME.search(name) and name not in _known_variables()))]
    if not links:
        return env
    new = sorted(set(links) - _service_links_reported)
    if new:
        _service_links_reported.update(new)
        log.warning("ignoring %s: Kubernetes service-link variables of a Service whose name starts with 'redsrv', not "
                    "redsrv settings (set enableServiceLinks: false in the pod spec to keep them out)", ", ".join(new))
    return {name: value for name, value in env.items() if name not in links}


def _elsewhere(names: Sequence[str]) -> str:
    """For an argument given to the wrong class: which class reads it, and on which process."""
    readers = (("Config", "a worker", {f.name for f in dataclasses.fields(Config)}),
               ("DaemonSettings", "a reducer", {f.name for f in dataclasses.fields(DaemonSettings)}))
    hints = [f"{name} is {who}'s setting: {cls}.{name}, or {_env_name(name)} in {who}'s environment"
             for name in names for cls, who, fields in readers if name in fields]
    return "; " + "; ".join(hints) if hints else ""


@dataclass(frozen=True)
class Config:
    """Everything a worker needs: the client, the adapters and the Horovod API read it. A reducer
    reads :class:`DaemonSettings` instead, never this class.

    Build it with ``Config(...)`` for explicit settings or :meth:`from_env` to fill the rest
    from ``REDSRV_*`` variables (each field ``x`` is ``REDSRV_X``) and torchrun's ``RANK`` /
    ``WORLD_SIZE``. Settings both ends use (``handshake_timeout``, the heartbeat,
    ``close_timeout``, ``max_frame_payload``, ``tcp_congestion``) are fields of both classes, read
    from the same variables. The reducer's own (its memory budgets, ``result_piece_bytes``,
    ``stall_warning``) are fields of :class:`DaemonSettings` only: their variables are accepted in
    a worker's environment and left to the reducers, and one given as an argument to
    :meth:`from_env` (through :class:`~redsrv.Client` or an adapter) is a
    :class:`~redsrv.ConfigError` naming the ``DaemonSettings`` field and its variable.
    """

    reducers: tuple[str, ...] = ()
    job: str = "default"
    rank: int = 0
    world_size: int = 1
    secret: bytes | None = field(default=None, repr=False)
    straggler_mode: str = "all"
    min_contributors: int = 0
    deadline: float = 0.0
    wire_dtype: str | None = None
    chunk_bytes: int | None = None  # None: by world size (largest_chunk_bytes)
    chunks_per_span: int | None = None  # None: 32 where results leave whole, else chunk_bytes (constants.CHUNKS_PER_SPAN)
    streams_per_reducer: int = C.DEFAULT_STREAMS_PER_REDUCER
    io_threads: int = C.DEFAULT_IO_THREADS  # client I/O loops; reducer r's streams are on loop r % io_threads
    push_window_chunks: int = C.DEFAULT_PUSH_WINDOW_CHUNKS
    send_lowat_bytes: int = C.DEFAULT_SEND_LOWAT_BYTES
    tcp_congestion: str | None = C.DEFAULT_TCP_CONGESTION  # None: the system default
    connect_timeout: float = C.DEFAULT_CONNECT_TIMEOUT_S
    handshake_timeout: float = C.DEFAULT_HANDSHAKE_TIMEOUT_S
    op_timeout: float = C.DEFAULT_OP_TIMEOUT_S
    reconnect_window: float = C.DEFAULT_RECONNECT_WINDOW_S  # 0: a lost reducer fails the operations at once
    heartbeat_interval: float = C.DEFAULT_HEARTBEAT_INTERVAL_S
    heartbeat_misses: int = C.DEFAULT_HEARTBEAT_MISSES
    close_timeout: float = C.DEFAULT_CLOSE_TIMEOUT_S
    max_frame_payload: int = C.DEFAULT_MAX_FRAME_PAYLOAD
    timeline: str | None = None  # Chrome-trace file; "{rank}" is replaced by the rank
    host_reduce: str = "auto"  # HOST_REDUCE_MODES
    local_rank: int | None = None  # this worker's index among the workers on its host (launchers' LOCAL_RANK & co.)
    local_size: int | None = None  # workers on this host
    host_id: str | None = None  # who shares a host (REDSRV_HOST_ID); None: host name, boot id and network namespace
    host_slot_bytes: int = C.DEFAULT_HOST_SLOT_BYTES  # each local worker's shared-memory staging area
    host_piece_bytes: int | None = None  # the host-level pipeline's piece; None: constants.HOST_PIECES_IN_SLOT
    # The torch backend's cross-rank check before each peer-link collective; None: PyTorch's own
    # convention, on only under TORCH_DISTRIBUTED_DEBUG=DETAIL (docs/torch_backend.md).
    verify_collectives: bool | None = None
    # Which start of the job this process belongs to: torchrun's TORCHELASTIC_RESTART_COUNT. The
    # torch backend keys its peer links' rendezvous by it, so the processes of a restarted group
    # never read the addresses the killed ones left in torchrun's store.
    restart_count: int = 0
    # Which data plane does the byte work (core/plane.py): auto, native or python.
    data_plane: str = "auto"
    # Elastic training (``redsrv run --min-np``): the driver's rendezvous (host:port), this
    # worker's id there, and how long a worker waits at it for its world to form.
    rendezvous: str | None = None
    worker_id: str | None = None
    elastic_timeout: float = C.DEFAULT_ELASTIC_TIMEOUT_S

    def __post_init__(self) -> None:
        object.__setattr__(self, "reducers", expand_reducers(self.reducers))
        if isinstance(self.secret, str):
            object.__setattr__(self, "secret", self.secret.encode("utf-8"))
        check_secret(self.secret)
        job_bytes = self.job.encode("utf-8")
        if not 0 < len(job_bytes) <= C.MAX_JOB_ID_BYTES:
            raise ConfigError(f"job id must be 1..{C.MAX_JOB_ID_BYTES} UTF-8 bytes, got {self.job!r}")
        if not 0 < self.world_size <= C.MAX_WORLD_SIZE:
            raise ConfigError(f"world_size must be in 1..{C.MAX_WORLD_SIZE}, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank must be in 0..{self.world_size - 1} for world_size {self.world_size}, got {self.rank}")
        if self.straggler_mode not in STRAGGLER_MODES:
            raise ConfigError(f"straggler_mode must be one of {sorted(STRAGGLER_MODES)}, got {self.straggler_mode!r}")
        if not 0 <= self.min_contributors <= self.world_size:
            raise ConfigError(f"min_contributors must be in 0..world_size ({self.world_size}), got {self.min_contributors}")
        if self.straggler_mode == "first_m" and self.min_contributors == 0:
            raise ConfigError("straggler_mode 'first_m' needs min_contributors (the m in first m of n)")
        if self.straggler_mode == "deadline" and self.deadline <= 0:
            raise ConfigError("straggler_mode 'deadline' needs a positive deadline (seconds)")
        if self.wire_dtype is not None:
            if self.wire_dtype not in WIRE_DTYPES:
                raise ConfigError(f"wire_dtype must be one of {sorted(WIRE_DTYPES)} or None, got {self.wire_dtype!r}")
            object.__setattr__(self, "wire_dtype", WIRE_DTYPES[self.wire_dtype])
        require_positive(self, ("connect_timeout", "handshake_timeout", "op_timeout", "heartbeat_interval", "close_timeout",
                                "elastic_timeout"))
        self._check_elastic_settings()
        for name in ("chunk_bytes", "chunks_per_span", "streams_per_reducer", "heartbeat_misses", "max_frame_payload"):
            if name in ("chunk_bytes", "chunks_per_span") and getattr(self, name) is None:
                continue
            if not getattr(self, name) >= 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.chunk_bytes is not None and self.chunk_bytes > self.max_frame_payload:
            raise ConfigError(f"chunk_bytes ({self.chunk_bytes}) exceeds max_frame_payload ({self.max_frame_payload})")
        for name in ("push_window_chunks", "send_lowat_bytes", "reconnect_window"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (0 turns it off), got {getattr(self, name)}")
        if self.tcp_congestion is not None:
            object.__setattr__(self, "tcp_congestion", congestion_setting(self.tcp_congestion))
        if self.streams_per_reducer > 64:
            raise ConfigError(f"streams_per_reducer must be <= 64, got {self.streams_per_reducer}")
        if not 1 <= self.io_threads <= C.MAX_IO_THREADS:
            raise ConfigError(f"io_threads (REDSRV_IO_THREADS) must be in 1..{C.MAX_IO_THREADS}, got {self.io_threads}")
        check_data_plane(self.data_plane)
        self._check_host_settings()

    def _check_elastic_settings(self) -> None:
        if self.rendezvous is None:
            return
        parse_address(self.rendezvous)
        if not self.worker_id:
            raise ConfigError(f"rendezvous {self.rendezvous!r} (REDSRV_RENDEZVOUS) needs this worker's id there "
                              "(REDSRV_WORKER_ID): redsrv run --min-np sets both")
        if self.secret is None:
            raise ConfigError("an elastic rendezvous (REDSRV_RENDEZVOUS) needs the job's secret (REDSRV_SECRET or "
                              "REDSRV_SECRET_FILE): redsrv run sets one")

    def _check_host_settings(self) -> None:
        if self.host_reduce not in HOST_REDUCE_MODES:
            raise ConfigError(f"host_reduce (REDSRV_HOST_REDUCE) must be one of {', '.join(HOST_REDUCE_MODES)}, "
                              f"got {self.host_reduce!r}")
        if (self.local_rank is None) != (self.local_size is None):
            raise ConfigError(f"local_rank ({self.local_rank}) and local_size ({self.local_size}) come together: "
                              "give both or neither")
        if self.local_size is not None and self.local_rank is not None and not 0 <= self.local_rank < self.local_size:
            raise ConfigError(f"local_rank must be in 0..{self.local_size - 1} for local_size {self.local_size}, "
                              f"got {self.local_rank}")
        if self.host_reduce == "host":
            if self.local_size is None:
                raise ConfigError("host_reduce='host' needs local_rank and local_size (a launcher's LOCAL_RANK and "
                                  "LOCAL_WORLD_SIZE, or REDSRV_LOCAL_RANK and REDSRV_LOCAL_SIZE)")
            if not 1 <= self.local_size <= self.world_size or self.world_size % self.local_size:
                raise ConfigError(f"host-level reduction needs the same number of workers on every host: world_size "
                                  f"{self.world_size} is not a multiple of local_size {self.local_size} (or set "
                                  "host_reduce='flat')")
        if self.host_id is not None and not 0 < len(self.host_id.encode("utf-8")) <= C.MAX_JOB_ID_BYTES:
            raise ConfigError(f"host_id must be 1..{C.MAX_JOB_ID_BYTES} UTF-8 bytes, got {self.host_id!r}")
        if self.host_slot_bytes < C.MIN_HOST_PIECE_BYTES:
            raise ConfigError(f"host_slot_bytes must be at least {C.MIN_HOST_PIECE_BYTES}, got {self.host_slot_bytes}")
        if self.host_piece_bytes is not None and not C.MIN_HOST_PIECE_BYTES <= self.host_piece_bytes <= self.host_slot_bytes:
            raise ConfigError(f"host_piece_bytes must be in {C.MIN_HOST_PIECE_BYTES}..host_slot_bytes "
                              f"({self.host_slot_bytes}), got {self.host_piece_bytes}")

    @property
    def host_level(self) -> bool:
        """Whether this worker reduces inside its host first (``host_reduce``): "auto" does where
        several workers share this host and the job spans more than one host, as hosts of equal
        size (uneven hosts stay flat: every worker of such a host sees the same sizes, so all of
        them decide alike). "host" with ``local_size == world_size`` is a one-host job: reduced
        in shared memory alone, without the reducers (HOST_REDUCE_MODES)."""
        if self.local_size is None or self.local_size == 1:
            return False  # one worker per host: nothing to reduce inside it, and the flat path is the same
        if self.host_reduce == "auto":
            return self.local_size < self.world_size and self.world_size % self.local_size == 0
        return self.host_reduce == "host"

    @property
    def largest_chunk_bytes(self) -> int:
        """The largest pipeline chunk: ``chunk_bytes``, or by default :func:`default_chunk_bytes`
        for this job's world size, within ``max_frame_payload``."""
        if self.chunk_bytes is not None:
            return self.chunk_bytes
        return min(default_chunk_bytes(self.world_size), self.max_frame_payload)

    @property
    def piece_bytes(self) -> int:
        """The host-level pipeline's piece (``host_piece_bytes``, or constants.HOST_PIECES_IN_SLOT)."""
        if self.host_piece_bytes is not None:
            return self.host_piece_bytes
        # The host path's pushes stay DEFAULT_CHUNK_BYTES per reducer unless chunk_bytes is set: its
        # pieces were measured so (docs/performance.md, "Several workers per host").
        share = max(self.local_size or 1, len(self.reducers)) * (self.chunk_bytes or C.DEFAULT_CHUNK_BYTES)
        return max(C.MIN_HOST_PIECE_BYTES, min(self.host_slot_bytes // C.HOST_PIECES_IN_SLOT, share))

    @property
    def hosts(self) -> int:
        """Hosts of the job: ``world_size / local_size`` in host-level mode, else one per worker."""
        return self.world_size // self.local_size if self.host_level and self.local_size else self.world_size

    @property
    def mode(self) -> StragglerMode:
        return STRAGGLER_MODES[self.straggler_mode]

    @property
    def heartbeat_timeout(self) -> float:
        """Silence after which a peer is declared frozen."""
        return self.heartbeat_interval * self.heartbeat_misses

    def addresses(self) -> list[tuple[str, int]]:
        return [parse_address(a) for a in self.reducers]

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Config:
        """Explicit ``overrides`` (those not ``None``) win. Then the environment, from three
        sources that must agree: ``REDSRV_*`` variables, ``TF_CONFIG`` / ``CLUSTER_SPEC`` (reducers,
        world size and rank) and the launchers' rank and size (torchrun's ``RANK`` / ``WORLD_SIZE``,
        Open MPI's ``OMPI_COMM_WORLD_*``, MPICH's ``PMI_*``, horovodrun's ``HOROVOD_RANK`` /
        ``HOROVOD_SIZE``, SLURM's ``SLURM_PROCID`` /
        ``SLURM_NTASKS``: see :func:`launcher_variables`). Two sources that give
        different values for one setting are a :class:`ConfigError` naming both variables.
        ``REDSRV_SECRET_FILE`` names a file holding the secret (preferred over ``REDSRV_SECRET``,
        which other local users may see)."""
        env = os.environ if environ is None else environ
        fields = {f.name: f for f in dataclasses.fields(cls)}
        sources = _Sources(env, overrides)
        sources.offer_variables(fields)
        cluster = cluster_from_env(env)
        if cluster is not None and cluster.worker_index is not None:
            if cluster.reducers:  # a TFJob's TF_CONFIG lists none: REDSRV_REDUCERS names them
                sources.offer("reducers", cluster.reducers, cluster.source)
            sources.offer("world_size", cluster.num_workers, cluster.source)
            sources.offer("rank", cluster.worker_index, cluster.source)
        for name, var in launcher_variables(env):
            sources.offer(name, _convert(name, env[var], "int", var), var)
        for name, var in local_launcher_variables(env):
            sources.offer(name, _convert(name, env[var], "int", var), var)
        if _TORCHRUN_RESTARTS in env:
            sources.offer("restart_count", _convert("restart_count", env[_TORCHRUN_RESTARTS], "int", _TORCHRUN_RESTARTS),
                          _TORCHRUN_RESTARTS)
        values = sources.values(fields)
        _no_guessed_rank(values, sources, overrides)
        return cls(**values)


def _no_guessed_rank(values: Mapping[str, Any], sources: _Sources, overrides: Mapping[str, Any]) -> None:
    """A process that is evidently one of several (a world size or a host's worker count above
    one) but has no rank from anywhere would take rank 0 and collide with the real rank 0, or
    train alone: refuse, naming what was looked for."""
    if values.get("rank") is not None:
        return
    for what, field_name in (("a world size", "world_size"), ("a local size", "local_size")):
        count = values.get(field_name) or 1
        if count > 1:
            source = "an argument" if overrides.get(field_name) is not None else sources.found[field_name][1]
            looked_for = ", ".join([_env_name("rank"), *(pair[0] for pair in _LAUNCHERS), _SLURM[0], "TF_CONFIG"])
            raise ConfigError(f"{what} of {count} (from {source}) but no rank: pass rank=, or launch with a launcher "
                              f"that sets one of {looked_for}")


@dataclass(frozen=True)
class DaemonSettings:
    """Everything a reducer needs. Build it with ``DaemonSettings(...)`` or :meth:`from_env`,
    which reads the same ``REDSRV_*`` variables as :class:`Config` (each field ``x`` is
    ``REDSRV_X``), with the same rules: unknown variables and conflicting sources are errors."""

    host: str = C.DEFAULT_BIND_HOST
    port: int = C.DEFAULT_PORT
    secret: bytes | None = field(default=None, repr=False)
    handshake_timeout: float = C.DEFAULT_HANDSHAKE_TIMEOUT_S
    heartbeat_interval: float = C.DEFAULT_HEARTBEAT_INTERVAL_S
    heartbeat_misses: int = C.DEFAULT_HEARTBEAT_MISSES
    send_stall_timeout: float = C.DEFAULT_SEND_STALL_S  # a peer that takes none of our bytes this long is dropped
    budget_wait_timeout: float = C.DEFAULT_OP_TIMEOUT_S  # a push waits this long at most for memory (and its op timeout)
    # Under memory pressure a push slower than this (bytes/s) over the grace is dropped; 0: never.
    min_push_rate: int = C.DEFAULT_MIN_PUSH_RATE
    slow_push_grace: float = C.DEFAULT_SLOW_PUSH_GRACE_S
    max_op_timeout: float = C.DEFAULT_MAX_OP_TIMEOUT_S  # cap on the operation timeout a worker asks for
    rejoin_grace: float = C.DEFAULT_REJOIN_GRACE_S  # how long a reconnecting rank's place is kept
    close_timeout: float = C.DEFAULT_CLOSE_TIMEOUT_S
    stall_warning: float = C.DEFAULT_STALL_WARNING_S
    max_frame_payload: int = C.DEFAULT_MAX_FRAME_PAYLOAD
    job_budget_bytes: int = C.DEFAULT_JOB_BUDGET_BYTES
    memory_budget_bytes: int = C.DEFAULT_MEMORY_BUDGET_BYTES
    result_piece_bytes: int = C.DEFAULT_RESULT_PIECE_BYTES  # cut-through piece; 0: whole chunks
    recv_buffer_bytes: int = C.DEFAULT_RECV_BUFFER_BYTES  # SO_RCVBUF of accepted connections; 0: kernel autotuning
    max_connections: int = C.DEFAULT_MAX_CONNECTIONS
    max_pending_handshakes: int = C.DEFAULT_MAX_PENDING_HANDSHAKES
    tcp_congestion: str | None = C.DEFAULT_TCP_CONGESTION  # None or "system": the system default
    data_plane: str = "auto"  # which data plane combines (core/plane.py)

    def __post_init__(self) -> None:
        if isinstance(self.secret, str):
            object.__setattr__(self, "secret", self.secret.encode("utf-8"))
        check_secret(self.secret)
        check_data_plane(self.data_plane)
        if self.tcp_congestion is not None:
            object.__setattr__(self, "tcp_congestion", congestion_setting(self.tcp_congestion))
        require_positive(self, ("handshake_timeout", "heartbeat_interval", "send_stall_timeout", "budget_wait_timeout",
                                "max_op_timeout", "close_timeout", "stall_warning", "rejoin_grace", "slow_push_grace"))
        for name in ("heartbeat_misses", "max_frame_payload", "job_budget_bytes", "memory_budget_bytes", "max_connections",
                     "max_pending_handshakes"):
            if not getattr(self, name) >= 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.job_budget_bytes > self.memory_budget_bytes:
            raise ConfigError(f"job_budget_bytes ({self.job_budget_bytes}) exceeds memory_budget_bytes "
                              f"({self.memory_budget_bytes})")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        if self.result_piece_bytes < 0:
            raise ConfigError(f"result_piece_bytes must be >= 0 (0 turns it off), got {self.result_piece_bytes}")
        if self.min_push_rate < 0:
            raise ConfigError(f"min_push_rate (REDSRV_MIN_PUSH_RATE, bytes per second) must be >= 0 (0: slow pushes are "
                              f"never dropped), got {self.min_push_rate}")
        check_recv_buffer(self.recv_buffer_bytes)

    def replace(self, **changes: Any) -> DaemonSettings:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, secret_file: str | None = None,
                 **overrides: Any) -> DaemonSettings:
        """Explicit ``overrides`` (those not ``None``) win; then ``REDSRV_*`` variables and, for
        ``host`` and ``port``, the address ``TF_CONFIG`` / ``CLUSTER_SPEC`` lists for this
        reducer, which must agree. ``secret_file`` (``--secret-file``) wins over
        ``REDSRV_SECRET_FILE`` and ``REDSRV_SECRET``; every secret obeys :func:`check_secret`."""
        env = os.environ if environ is None else environ
        fields = {f.name: f for f in dataclasses.fields(cls)}
        sources = _Sources(env, overrides)
        sources.offer_variables(fields)
        listed = reducer_bind_address(env)
        if listed is not None:
            spec = cluster_from_env(env)
            assert spec is not None
            sources.offer("host", listed[0], spec.source)
            sources.offer("port", listed[1], spec.source)
        return cls(**sources.values(fields, secret_file=secret_file))


#: (rank variable, size variable) that process launchers set: torchrun, Open MPI's mpirun,
#: MPICH / Intel MPI (Hydra's PMI), and horovodrun (Horovod's own launcher, gloo mode).
_LAUNCHERS = (("RANK", "WORLD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"),
              ("HOROVOD_RANK", "HOROVOD_SIZE"))
#: SLURM's, consulted only when no launcher above set its own: a launcher started inside an
#: allocation (mpirun or torchrun in a batch script) inherits the batch step's SLURM_PROCID.
_SLURM = ("SLURM_PROCID", "SLURM_NTASKS")


def launcher_variables(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """The (field, variable) pairs that give this process's rank and world size, from the
    launchers' own variables present in ``environ``. Every pair is offered to
    :meth:`Config.from_env`, so two launchers that disagree are a :class:`ConfigError`.

    >>> launcher_variables({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "SLURM_PROCID": "0"})
    [('rank', 'OMPI_COMM_WORLD_RANK'), ('world_size', 'OMPI_COMM_WORLD_SIZE')]
    >>> launcher_variables({"SLURM_PROCID": "3", "SLURM_NTASKS": "4"})
    [('rank', 'SLURM_PROCID'), ('world_size', 'SLURM_NTASKS')]
    """
    found = [(field_name, var) for pair in _LAUNCHERS for field_name, var in zip(("rank", "world_size"), pair)
             if var in environ]
    if not found:
        found = [(field_name, var) for field_name, var in zip(("rank", "world_size"), _SLURM) if var in environ]
    return found


#: (local rank variable, local size variable): torchrun, Open MPI, MPICH / Intel MPI (Hydra),
#: Horovod's launcher. SLURM's SLURM_LOCALID / SLURM_NTASKS_PER_NODE (set only with
#: ``--ntasks-per-node``) are consulted, as for the rank, only when none of these is present.
_LOCAL_LAUNCHERS = (("LOCAL_RANK", "LOCAL_WORLD_SIZE"), ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
                    ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"), ("HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"))
_SLURM_LOCAL = ("SLURM_LOCALID", "SLURM_NTASKS_PER_NODE")


_TORCHRUN_RESTARTS = "TORCHELASTIC_RESTART_COUNT"


def local_launcher_variables(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """The (field, variable) pairs that say which of the workers on this host this process is
    (``local_rank``) and how many there are (``local_size``), from the launchers' variables in
    ``environ``. A launcher that gives one without the other is not used (torchrun's
    ``LOCAL_RANK`` alone comes from ``torch.distributed.launch --use-env`` without a size).

    >>> local_launcher_variables({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "SLURM_LOCALID": "1"})
    [('local_rank', 'LOCAL_RANK'), ('local_size', 'LOCAL_WORLD_SIZE')]
    >>> local_launcher_variables({"LOCAL_RANK": "1"})
    []
    """
    found = [(field_name, var) for pair in _LOCAL_LAUNCHERS if all(v in environ for v in pair)
             for field_name, var in zip(("local_rank", "local_size"), pair)]
    if not found and all(v in environ for v in _SLURM_LOCAL):
        found = list(zip(("local_rank", "local_size"), _SLURM_LOCAL))
    return found


def read_secret_file(path: str) -> bytes:
    """The secret in ``path``, surrounding whitespace removed. Never logged."""
    try:
        with open(path, "rb") as f:
            secret = f.read().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read secret file {path!r}: {exc.strerror}") from None
    if not secret:
        raise ConfigError(f"secret file {path!r} is empty")
    return secret


_TRUE, _FALSE, _UNSET = ("1", "true", "yes", "on"), ("0", "false", "no", "off"), ("", "auto")


def _boolean(raw: str) -> bool | None:
    """1/true/yes/on, 0/false/no/off, or "auto"/empty for the documented default (None)."""
    text = raw.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    if text in _UNSET:
        return None
    raise ValueError(raw)


def _convert(name: str, raw: str, type_name: Any, variable: str | None = None) -> Any:
    variable = variable or _env_name(name)
    type_text = str(type_name)
    try:
        if name == "reducers":
            return tuple(a.strip() for a in raw.split(",") if a.strip())
        if name == "timeline":
            return raw or None
        if name == "wire_dtype":
            return None if raw.lower() in ("", "none", "fp32", "float32") else raw.lower()
        if type_text.startswith("bool"):
            return _boolean(raw)
        if type_text.startswith("int"):
            return int(raw)
        if type_text.startswith("float"):
            return float(raw)
        return raw
    except ValueError:
        raise ConfigError(f"{variable}={raw!r} is not a valid {type_text.split()[0]}") from None
