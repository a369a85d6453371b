"""Hosts for ``redsrv run -H`` / ``--hostfile``, and the command lines that launch workers on
them through an engine people already run: ``mpirun`` (Open MPI or MPICH), or, where there is
none, the ``srun`` and ``torchrun --nnodes`` lines to run by hand. Pure functions: nothing here
starts a process or opens a socket, so each command line is checked as text by the unit tests.

Horovod's syntax and semantics: ``-H a:4,b:4`` or a hostfile of ``a slots=4`` lines (a host
without a count has one slot); ranks fill the hosts in the order given, each host's slots
before the next host's; ``-np`` may not exceed the slots listed.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from redsrv.core.errors import ConfigError

__all__ = ["HostSlots", "parse_hosts", "read_hostfile", "assign_ranks", "is_local", "mpi_flavour", "mpirun_command",
           "MpiOutput", "manual_commands", "exported_names", "horovod_variables"]

#: Names that stand for this machine in a host list: ``-H localhost:4`` runs here, without mpirun.
LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})

#: Open MPI's ``--tag-output`` prefix: ``[jobid,rank]<stdout>:``.
_OMPI_TAG = re.compile(rb"\[\d+,(\d+)\]<std(?:out|err)>:")


@dataclass(frozen=True)
class HostSlots:
    """One host of the list and how many workers it may run."""

    name: str
    slots: int


def parse_hosts(text: str) -> list[HostSlots]:
    """``-H``'s ``host:slots,host:slots`` (a bare host has one slot).

    >>> parse_hosts("a:2,b")
    [HostSlots(name='a', slots=2), HostSlots(name='b', slots=1)]
    """
    hosts = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        if entry.startswith("["):  # [v6]:slots
            name, _, rest = entry[1:].partition("]")
            count = rest[1:] if rest.startswith(":") else "1"
        elif entry.count(":") == 1:
            name, count = entry.split(":")
        else:  # a bare name (or a bare IPv6 address): one slot
            name, count = entry, "1"
        hosts.append(_host(name, count, f"-H entry {entry!r}"))
    if not hosts:
        raise ConfigError(f"-H {text!r} names no host; write it as host:slots,host:slots")
    return _distinct(hosts, "-H")


def read_hostfile(path: str) -> list[HostSlots]:
    """A hostfile as Horovod and Open MPI write it: ``host slots=N`` per line (``slots=`` may be
    left out for one slot); blank lines and ``#`` comments are skipped."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read hostfile {path!r}: {exc.strerror}") from None
    hosts = []
    for number, raw in enumerate(lines, 1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        counts = [w.split("=", 1)[1] for w in words[1:] if w.startswith("slots=")]
        if len(words) > 1 + len(counts) or len(counts) > 1:
            raise ConfigError(f"hostfile {path!r} line {number}: {raw.strip()!r} is not 'host slots=N'")
        hosts.append(_host(words[0], counts[0] if counts else "1", f"hostfile {path!r} line {number}"))
    if not hosts:
        raise ConfigError(f"hostfile {path!r} names no host")
    return _distinct(hosts, f"hostfile {path!r}")


def _host(name: str, count: str, where: str) -> HostSlots:
    if not name:
        raise ConfigError(f"{where}: empty host name")
    if not count.isdigit() or int(count) < 1:
        raise ConfigError(f"{where}: slots must be a positive whole number, got {count!r}")
    return HostSlots(name, int(count))


def _distinct(hosts: list[HostSlots], where: str) -> list[HostSlots]:
    names = [h.name for h in hosts]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(f"{where} lists {', '.join(repeated)} more than once: give each host once, with all its slots")
    return hosts


def assign_ranks(hosts: Sequence[HostSlots], num_proc: int) -> list[tuple[str, int]]:
    """The hosts actually used and how many workers each runs: the first host's slots first,
    as Horovod and ``mpirun --map-by slot`` place ranks.

    >>> assign_ranks(parse_hosts("a:2,b:2,c:2"), 3)
    [('a', 2), ('b', 1)]
    """
    total = sum(h.slots for h in hosts)
    if not 1 <= num_proc <= total:
        listed = ",".join(f"{h.name}:{h.slots}" for h in hosts)
        raise ConfigError(f"-np {num_proc} does not fit the {total} slots of {listed}")
    placed, left = [], num_proc
    for host in hosts:
        if left == 0:
            break
        take = min(host.slots, left)
        placed.append((host.name, take))
        left -= take
    return placed


def is_local(hosts: Sequence[HostSlots], own_names: Sequence[str] = ()) -> bool:
    """Whether every host is this machine (then ``redsrv run`` starts the workers itself)."""
    return all(h.name in LOCAL_NAMES or h.name in own_names for h in hosts)


def mpi_flavour(version_text: str) -> str | None:
    """``"openmpi"`` or ``"mpich"`` from ``mpirun --version``'s output (the words Horovod's
    launcher looks for), ``None`` for an implementation we do not drive.

    >>> mpi_flavour("mpirun (Open MPI) 4.1.4"), mpi_flavour("HYDRA build details:"), mpi_flavour("Spectrum")
    ('openmpi', 'mpich', None)
    """
    if "Open MPI" in version_text or "OpenRTE" in version_text:
        return "openmpi"
    if "HYDRA" in version_text or "MPICH" in version_text:
        return "mpich"
    return None


def exported_names(env: Mapping[str, str]) -> list[str]:
    """The variables a remote worker needs from the launcher's environment: redsrv's settings,
    the torch rendezvous, Python's own, and the search paths (the same interpreter and packages
    at the same paths on every host, as with mpirun generally)."""
    wanted = ("MASTER_ADDR", "MASTER_PORT", "PYTHONUNBUFFERED", "PYTHONPATH", "PATH", "VIRTUAL_ENV", "LD_LIBRARY_PATH")
    return sorted(n for n in env if n.startswith("REDSRV_") or n in wanted)


def mpirun_command(flavour: str, placed: Sequence[tuple[str, int]], command: Sequence[str], *, exported: Sequence[str],
                   output_dir: str | None = None, as_root: bool = False, mpi_args: Sequence[str] = ()) -> list[str]:
    """The ``mpirun`` line that starts ``command`` on ``placed`` (host, workers) with the
    variables named in ``exported`` taken from mpirun's own environment (by name only, so the
    job's secret never appears in a process list).

    Open MPI: ``-H`` with slot counts, no binding (``-bind-to none -map-by slot``, as Horovod),
    ``--tag-output`` (rewritten to ``[rank]`` by :class:`MpiOutput`), ``-x`` per variable,
    ``--allow-run-as-root`` only when run as root. MPICH (Hydra): ``-hosts`` with ``-ppn`` (so
    every host runs the same number of workers, Horovod's rule), ``-l`` for ``[rank]`` labels,
    ``-genvlist``.

    >>> mpirun_command("openmpi", [("a", 2), ("b", 2)], ["python", "t.py"], exported=["REDSRV_JOB"])
    ['mpirun', '--tag-output', '-np', '4', '-H', 'a:2,b:2', '-bind-to', 'none', '-map-by', 'slot', '-x', 'REDSRV_JOB', \
'python', 't.py']
    """
    num_proc = sum(count for _, count in placed)
    if flavour == "openmpi":
        line = ["mpirun", *(["--allow-run-as-root"] if as_root else []), "--tag-output", "-np", str(num_proc),
                "-H", ",".join(f"{host}:{count}" for host, count in placed), "-bind-to", "none", "-map-by", "slot"]
        if output_dir is not None:
            line += ["--output-filename", output_dir]
        for name in exported:
            line += ["-x", name]
    elif flavour == "mpich":
        counts = {count for _, count in placed}
        if len(counts) != 1:
            raise ConfigError(f"MPICH's mpirun runs the same number of workers on every host (-ppn); the hosts would "
                              f"run {', '.join(f'{h}:{c}' for h, c in placed)}: list equal slots, or use Open MPI")
        line = ["mpirun", "-l", "-np", str(num_proc), "-hosts", ",".join(host for host, _ in placed),
                "-ppn", str(counts.pop())]
        if output_dir is not None:
            line += ["-outfile-pattern", f"{output_dir}/rank.%r/stdout", "-errfile-pattern", f"{output_dir}/rank.%r/stderr"]
        if exported:
            line += ["-genvlist", ",".join(exported)]
    else:
        raise ValueError(f"flavour must be 'openmpi' or 'mpich', got {flavour!r}")
    return [*line, *mpi_args, *command]


class MpiOutput:
    """Open MPI's ``--tag-output`` stream as whole lines with ``redsrv run``'s ``[rank]`` prefix.

    Open MPI tags every chunk a rank writes, not every line (``[1,3]<stdout>:``), so an
    unbuffered worker's line arrives in pieces, interleaved with other ranks' pieces. This
    gathers each rank's pieces until its newline. Bytes before any tag (mpirun's own messages)
    pass through as they are; MPICH's ``-l`` output, already ``[3] text``, has no tags at all.

    >>> out = MpiOutput()
    >>> out.feed(b"[1,3]<stdout>:ab[1,0]<stdout>:x\\n[1,3]<stdout>:c\\n")
    [b'[0] x\\n', b'[3] abc\\n']
    >>> out.feed(b"mpirun: note\\n"), out.feed(b"[1,2]<stderr>:tail"), out.close()
    ([b'mpirun: note\\n'], [], [b'[2] tail\\n'])
    """

    def __init__(self) -> None:
        self._partial: dict[bytes, bytearray] = {}
        self._order: list[bytes] = []

    def feed(self, data: bytes) -> list[bytes]:
        lines: list[bytes] = []
        rank: bytes | None = None
        position = 0
        for match in _OMPI_TAG.finditer(data):
            self._add(rank, data[position:match.start()], lines)
            rank, position = match.group(1), match.end()
        self._add(rank, data[position:], lines)
        return lines

    def close(self) -> list[bytes]:
        """What is left of unfinished lines, each ended here."""
        lines = [b"[" + rank + b"] " + bytes(self._partial[rank]) + b"\n" for rank in self._order if self._partial[rank]]
        self._partial.clear()
        self._order.clear()
        return lines

    def _add(self, rank: bytes | None, text: bytes, lines: list[bytes]) -> None:
        if not text:
            return
        if rank is None:
            lines.append(text)
            return
        if rank not in self._partial:
            self._partial[rank] = bytearray()
            self._order.append(rank)
        buffer = self._partial[rank]
        buffer += text
        *complete, rest = bytes(buffer).split(b"\n")
        lines += [b"[" + rank + b"] " + line + b"\n" for line in complete]
        buffer[:] = rest


def manual_commands(placed: Sequence[tuple[str, int]], command: Sequence[str], *, variables: Mapping[str, str],
                    master_port: int) -> list[tuple[str, str]]:
    """Where no mpirun is found: (where to run it, line) for the ``srun`` line of a SLURM
    allocation and, when every host runs as many workers, one ``torchrun --nnodes`` line per
    host, each with the variables the workers need (the secret by file, never on a command line).

    >>> for where, line in manual_commands([("a", 2), ("b", 2)], ["python", "t.py"], variables={"REDSRV_JOB": "j"},
    ...                                    master_port=29500):
    ...     print(where, "|", line)
    inside a SLURM allocation | srun --nodes=2 --ntasks=4 --ntasks-per-node=2 --nodelist=a,b --export=ALL,REDSRV_JOB=j python t.py
    on a | env REDSRV_JOB=j torchrun --nnodes=2 --nproc-per-node=2 --node-rank=0 --master-addr=a --master-port=29500 python t.py
    on b | env REDSRV_JOB=j torchrun --nnodes=2 --nproc-per-node=2 --node-rank=1 --master-addr=a --master-port=29500 python t.py
    """
    hosts = [host for host, _ in placed]
    counts = {count for _, count in placed}
    per_node = next(iter(counts)) if len(counts) == 1 else None
    program = shlex.join(command)
    srun = ["srun", f"--nodes={len(hosts)}", f"--ntasks={sum(c for _, c in placed)}"]
    srun += [f"--ntasks-per-node={per_node}"] if per_node else []
    srun += [f"--nodelist={','.join(hosts)}", "--export=ALL" + "".join(f",{n}={v}" for n, v in sorted(variables.items()))]
    lines = [("inside a SLURM allocation", f"{shlex.join(srun)} {program}")]
    if per_node is not None:
        exports = shlex.join(["env", *(f"{name}={value}" for name, value in sorted(variables.items()))])
        for index, host in enumerate(hosts):
            torchrun = ["torchrun", f"--nnodes={len(hosts)}", f"--nproc-per-node={per_node}", f"--node-rank={index}",
                        f"--master-addr={hosts[0]}", f"--master-port={master_port}"]
            lines.append((f"on {host}", f"{exports} {shlex.join(torchrun)} {program}"))
    return lines


def horovod_variables(counts: Sequence[int], rank: int) -> dict[str, str]:
    """The variables horovodrun gives rank ``rank`` when the hosts run ``counts`` workers each,
    filled host by host (``mpirun --map-by slot``): ``HOROVOD_CROSS_RANK`` numbers the hosts
    that have a worker of this local rank, as Horovod's does.

    >>> v = horovod_variables([2, 1], 2)
    >>> [v[n] for n in ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
    ...                 "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")]
    ['2', '3', '0', '1', '1', '2']
    """
    if not 0 <= rank < sum(counts):
        raise ValueError(f"rank {rank} is not one of the {sum(counts)} workers of hosts running {list(counts)}")
    host, local_rank = 0, rank
    while local_rank >= counts[host]:
        local_rank -= counts[host]
        host += 1
    return {"HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(sum(counts)), "HOROVOD_LOCAL_RANK": str(local_rank),
            "HOROVOD_LOCAL_SIZE": str(counts[host]),
            "HOROVOD_CROSS_RANK": str(sum(1 for c in counts[:host] if c > local_rank)),
            "HOROVOD_CROSS_SIZE": str(sum(1 for c in counts if c > local_rank))}
