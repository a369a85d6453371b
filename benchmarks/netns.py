"""Emulated hosts on one Linux machine, for ``redsrv bench emulate``.

Each host is a network namespace with one interface, ``eth0``, cabled into a bridge that lives
in a "switch" namespace. A kernel ``tbf`` qdisc limits every link at both ends, like a switch
port: the host side's egress is the host's upload, the switch side's egress its download.
Addresses come from the RFC 2544 benchmarking range (198.18.0.0/15) and no namespace has a
default route, so no benchmark packet can leave the machine. Nothing is created in the caller's
namespace.

With ``delay_us`` the bridge is replaced by a userspace forwarder (:mod:`redsrv.bench.tapdelay`)
that holds every frame ``delay_us`` before passing it on, because kernels without ``sch_netem``
cannot add delay; each host then has a TAP ``eth0``, its download limited by ``tbf`` on an
``ifb`` device that ingress traffic is redirected to.

Everything is created by :meth:`Cluster.up` after :meth:`Cluster.check` found nothing wrong,
and :meth:`Cluster.down` removes every namespace and ends every process this cluster created,
by pid. Needs root and iproute2 (``ip``, ``tc``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from redsrv.cli.fleet import readline_within, stop_processes

__all__ = ["Cluster", "Host", "EmulationError", "parse_rate", "format_rate", "tcp_goodput_bps", "our_namespaces",
           "MAX_HOSTS", "DEFAULT_PREFIX", "SUBNET", "close_pipes", "signals_deferred", "host_gso_bytes"]

#: Namespaces are named PREFIX-h0, PREFIX-h1, ... and PREFIX-sw. Distinct from other tools'
#: defaults so that a hand-made cluster and a benchmark can coexist.
DEFAULT_PREFIX = "redsrv"

#: Hosts get SUBNET.1, SUBNET.2, ... in a /24 of the benchmarking range 198.18.0.0/15.
SUBNET = "198.18.0"
MAX_HOSTS = 254

IFNAME = "eth0"

#: tbf queue limit expressed as latency: a deep enough queue that TCP keeps the link full.
QUEUE_LATENCY_MS = 20

#: Least queue on a host's own egress (its NIC): a real NIC's qdisc holds 1000 packets, GSO packets
#: of up to 64 KiB among them, and TCP small queues keep each local flow to about two of those
#: there, so a NIC's queue does not drop a host's own TCP data. A queue of QUEUE_LATENCY_MS alone
#: is shallower than that at slow emulated rates once a host has many flows (1 MB at 400 Mbit/s
#: against 8 flows x 2 x 64 KiB for a worker at n = 8): every host dropped its own packets and
#: redsrv reached 0.70 of its bound there; with this floor none did and it reached 0.91
#: (docs/performance.md, "Scaling: n = 2..8"). Switch ports keep QUEUE_LATENCY_MS.
HOST_QUEUE_MIN_BYTES = 8 * 1024 * 1024

#: Longest a host's largest packet may take on its link. TCP hands a NIC packets of up to 64 KiB
#: (GSO) and TCP small queues let each flow keep about two of them in the host's own queue; that
#: queue is one FIFO with the flow's ACKs of incoming data behind it. On the links the emulation
#: stands for (25-100 Gbit/s) 64 KiB takes 5-21 us, so a host with eight flows queues well under
#: a millisecond of its own data. Emulated at 300 Mbit/s the same 1 MB took 29 ms: a reducer's
#: ACKs for the pushes it received waited that long behind its results, and with the bounded
#: receive windows `redsrv plan` advises its incoming flows stalled on their windows (n=8, m=4
#: at 300 Mbit/s reached 0.74 of its bound; with 16 KiB packets 0.91). Capping a host's GSO
#: packets at this much of its rate (62.5 KB at 1 Gbit/s, the kernel's 64 KiB above) keeps its
#: own queue as short, in time, as at 1 Gbit/s (docs/performance.md, "Method").
HOST_GSO_SECONDS = 0.0005
#: Largest GSO packet the kernel builds by default, and the least this cap goes to (CPU per
#: packet grows as packets shrink).
DEFAULT_GSO_BYTES = 65536
MIN_GSO_BYTES = 8192


def host_gso_bytes(rate_bps: int) -> int:
    """The largest packet (``gso_max_size``) a host of the emulated cluster sends at ``rate_bps``
    (0: unlimited), HOST_GSO_SECONDS of it within MIN_GSO_BYTES..DEFAULT_GSO_BYTES.

    >>> host_gso_bytes(300 * 10**6), host_gso_bytes(400 * 10**6), host_gso_bytes(10**9), host_gso_bytes(0)
    (18750, 25000, 62500, 65536)
    """
    if not rate_bps:
        return DEFAULT_GSO_BYTES
    return max(MIN_GSO_BYTES, min(DEFAULT_GSO_BYTES, int(rate_bps / 8 * HOST_GSO_SECONDS)))


#: tbf bucket: at least 1 ms at the rate, and never below two 64 KiB GSO segments with their
#: headers, which tbf must be able to pass whole.
MIN_BURST_BYTES = 128 * 1024


def port_queue_bytes(rate_bps: int) -> int:
    """What a switch port of the emulated cluster queues at ``rate_bps``: QUEUE_LATENCY_MS of it.

    >>> port_queue_bytes(10**9)
    2500000
    """
    return rate_bps // 8 * QUEUE_LATENCY_MS // 1000


_RATE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*(gbit|mbit|kbit|bit)\s*$", re.IGNORECASE)
_UNIT = {"gbit": 10**9, "mbit": 10**6, "kbit": 10**3, "bit": 1}
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.]{0,15}$")
_CLONE_NEWNET = 0x40000000


class EmulationError(RuntimeError):
    """The emulated cluster cannot be built or run. The message says what to change; nothing
    is left behind when this is raised."""


def parse_rate(text: str) -> int:
    """A tc-style rate in bits per second; ``none`` or ``0`` means unlimited (0).

    >>> parse_rate("1gbit"), parse_rate("500mbit"), parse_rate("2.5Gbit"), parse_rate("none")
    (1000000000, 500000000, 2500000000, 0)
    """
    if text.strip().lower() in ("0", "none", "unlimited"):
        return 0
    match = _RATE.match(text)
    if not match:
        raise EmulationError(f"bad rate {text!r}: use a number and a unit, e.g. 1gbit, 500mbit, 2.5gbit (or none)")
    bps = int(float(match.group(1)) * _UNIT[match.group(2).lower()])
    if not 10**5 <= bps <= 10**12:
        raise EmulationError(f"rate {text!r} is outside 100kbit..1000gbit")
    return bps


def format_rate(bps: int) -> str:
    """A rate for people.

    >>> format_rate(1_000_000_000), format_rate(2_500_000_000), format_rate(0)
    ('1 Gbit/s', '2.5 Gbit/s', 'unlimited')
    """
    if bps == 0:
        return "unlimited"
    for unit, scale in (("Gbit/s", 10**9), ("Mbit/s", 10**6), ("kbit/s", 10**3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps} bit/s"


def tcp_goodput_bps(rate_bps: int, mtu: int = 1500) -> float:
    """Best TCP payload rate through a tbf-limited link: tbf counts every byte of the Ethernet
    frame (14 header bytes, no preamble or gap), and each full frame carries MTU - 52 bytes of
    payload (20 IP + 20 TCP + 12 timestamp option). At MTU 1500 that is 0.956 of the rate, which
    is what a single TCP stream measures here.

    >>> round(tcp_goodput_bps(10**9) / 10**9, 4)
    0.9564
    """
    return rate_bps * (mtu - 52) / (mtu + 14)


@dataclass(frozen=True)
class Host:
    index: int
    ns: str
    ip: str


def _run(argv: Sequence[str], what: str) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip()
        raise EmulationError(f"{what} failed: `{' '.join(argv)}` exited {proc.returncode}: {detail}")
    return proc.stdout


def list_namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], "listing network namespaces")
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def our_namespaces(prefix: str) -> list[str]:
    """Namespaces whose names this prefix would create (PREFIX-sw, PREFIX-hN)."""
    pattern = re.compile(rf"^{re.escape(prefix)}-(sw|h\d+)$")
    return [ns for ns in list_namespaces() if pattern.match(ns)]


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP while cleaning up (a second Ctrl-C must not leave namespaces
    behind), then deliver them."""
    sigs = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class Cluster:
    """``hosts`` emulated hosts at ``rate_bps`` per link (0: unlimited).

    >>> with Cluster(3, 10**9) as c:  # doctest: +SKIP
    ...     p = c.spawn(0, ["python3", "-c", "print('hello from', 'h0')"])

    :meth:`check` validates without side effects; :meth:`up` builds (and removes what it made
    if any step fails); :meth:`down` is idempotent and runs on every exit of the ``with`` block.
    """

    def __init__(self, hosts: int, rate_bps: int, *, prefix: str = DEFAULT_PREFIX, mtu: int = 1500,
                 delay_us: int = 0, python: str = sys.executable, gso_bytes: int | None = None) -> None:
        self.count = hosts
        self.rate_bps = rate_bps
        self.prefix = prefix
        self.mtu = mtu
        #: The hosts' largest packet (gso_max_size); None: host_gso_bytes(rate_bps).
        self.gso_bytes = host_gso_bytes(rate_bps) if gso_bytes is None else gso_bytes
        self.delay_us = delay_us
        self.python = python
        self.hosts = [Host(i, f"{prefix}-h{i}", f"{SUBNET}.{i + 1}") for i in range(hosts)]
        self.switch = f"{prefix}-sw"
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []  # type: ignore[type-arg]
        self._forwarder: subprocess.Popen | None = None  # type: ignore[type-arg]
        #: What the delay forwarder said when it ended (see redsrv.bench.tapdelay), else None.
        self.forwarder_report: dict[str, Any] | None = None

    # --- validation: no side effects ---

    def check(self) -> None:
        """Raise :class:`EmulationError` for anything that would stop :meth:`up`."""
        if not sys.platform.startswith("linux"):
            raise EmulationError(f"network namespaces need Linux (this is {sys.platform})")
        if os.geteuid() != 0:
            raise EmulationError("creating network namespaces needs root: run this command as root (e.g. with sudo)")
        missing = [b for b in ("ip", "tc") if shutil.which(b) is None]
        if missing:
            raise EmulationError(f"{' and '.join(missing)} not found on PATH: install iproute2")
        if not _NAME.match(self.prefix) or len(self.prefix) > 10:
            raise EmulationError(f"prefix {self.prefix!r}: use up to 10 letters, digits, '_' or '.', starting with a letter")
        if not 2 <= self.count <= MAX_HOSTS:
            raise EmulationError(f"{self.count} hosts do not fit: need 2..{MAX_HOSTS} (one /24 of the benchmarking range "
                                 f"{SUBNET}.0/24)")
        if not 576 <= self.mtu <= 9000:
            raise EmulationError(f"MTU {self.mtu} is outside 576..9000")
        if not self.mtu <= self.gso_bytes <= DEFAULT_GSO_BYTES:
            raise EmulationError(f"a host's largest packet ({self.gso_bytes} bytes) must be within the MTU "
                                 f"({self.mtu}) and {DEFAULT_GSO_BYTES}")
        if self.delay_us < 0 or self.delay_us > 1_000_000:
            raise EmulationError(f"delay {self.delay_us} us is outside 0..1000000")
        if self.delay_us and not os.path.exists("/dev/net/tun"):
            raise EmulationError("--delay-us needs TAP devices but /dev/net/tun does not exist")
        existing = our_namespaces(self.prefix)
        if existing:
            raise EmulationError(
                f"network namespace(s) {', '.join(existing)} already exist: another run may be in progress, or one was "
                f"killed without cleaning up. Use another --prefix, or remove them with "
                f"`redsrv bench emulate --cleanup --prefix {self.prefix}` once no run is using them.")

    # --- lifecycle ---

    def __enter__(self) -> Cluster:
        self.check()
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        """Build the cluster; on any failure remove what was built and re-raise."""
        try:
            if self.delay_us:
                self._up_tap()
            else:
                self._up_bridge()
        except BaseException:
            self.down()
            raise

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name], f"creating namespace {name}")
        self._created.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"], f"bringing up lo in {name}")

    def _up_bridge(self) -> None:
        sw = self.switch
        self._add_ns(sw)
        _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"], "creating the bridge")
        _run(["ip", "-n", sw, "link", "set", "br0", "mtu", str(self.mtu), "up"], "bringing up the bridge")
        for h in self.hosts:
            port = f"p{h.index}"
            self._add_ns(h.ns)
            # Made inside the host namespace, then the peer moves to the switch: nothing ever
            # appears in the caller's namespace.
            _run(["ip", "-n", h.ns, "link", "add", IFNAME, "mtu", str(self.mtu), "type", "veth", "peer", "name", port,
                  "mtu", str(self.mtu)], f"cabling {h.ns}")
            _run(["ip", "-n", h.ns, "link", "set", port, "netns", sw], f"plugging {h.ns} into the switch")
            _run(["ip", "-n", sw, "link", "set", port, "master", "br0", "up"], f"enabling switch port {port}")
            self._configure_host(h)
            self._set_rate(h.ns, IFNAME, host_egress=True)
            self._set_rate(sw, port)

    def _up_tap(self) -> None:
        for h in self.hosts:
            self._add_ns(h.ns)
            _run(["ip", "-n", h.ns, "tuntap", "add", "mode", "tap", "name", IFNAME], f"creating a TAP device in {h.ns}")
        self._forwarder = subprocess.Popen(
            [self.python, "-m", "redsrv.bench.tapdelay", str(self.delay_us), *(h.ns for h in self.hosts)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        line = readline_within(self._forwarder, 20.0)
        if not line.startswith("ready"):
            err = ""
            if self._forwarder.poll() is not None and self._forwarder.stderr is not None:
                err = self._forwarder.stderr.read()
            raise EmulationError(f"the delay forwarder did not start (printed {line!r}; {err.strip()[-500:]})")
        for h in self.hosts:
            self._configure_host(h)
            self._set_rate(h.ns, IFNAME, host_egress=True)
            if self.rate_bps:
                # Download: frames the forwarder writes arrive as ingress; redirect them to an
                # ifb device whose egress tbf shapes them.
                _run(["ip", "-n", h.ns, "link", "add", "ifb0", "type", "ifb"], f"creating ifb0 in {h.ns}")
                _run(["ip", "-n", h.ns, "link", "set", "ifb0", "up"], f"bringing up ifb0 in {h.ns}")
                _run(["tc", "-n", h.ns, "qdisc", "add", "dev", IFNAME, "handle", "ffff:", "ingress"], f"ingress qdisc in {h.ns}")
                _run(["tc", "-n", h.ns, "filter", "add", "dev", IFNAME, "parent", "ffff:", "protocol", "all", "prio", "1",
                      "u32", "match", "u32", "0", "0", "action", "mirred", "egress", "redirect", "dev", "ifb0"],
                     f"ingress redirect in {h.ns}")
                self._set_rate(h.ns, "ifb0")

    def _configure_host(self, h: Host) -> None:
        _run(["ip", "-n", h.ns, "link", "set", IFNAME, "mtu", str(self.mtu)], f"setting the MTU in {h.ns}")
        _run(["ip", "-n", h.ns, "addr", "add", f"{h.ip}/24", "dev", IFNAME], f"addressing {h.ns}")
        _run(["ip", "-n", h.ns, "link", "set", IFNAME, "up"], f"bringing up {IFNAME} in {h.ns}")
        if self.gso_bytes < DEFAULT_GSO_BYTES:
            _run(["ip", "-n", h.ns, "link", "set", IFNAME, "gso_max_size", str(self.gso_bytes)],
                 f"capping packets on {h.ns}")

    def _set_rate(self, ns: str, dev: str, host_egress: bool = False) -> None:
        if not self.rate_bps:
            _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "pfifo", "limit", "10000"], f"queue on {ns}/{dev}")
            return
        burst = max(MIN_BURST_BYTES, self.rate_bps // 8 // 1000)
        queue = port_queue_bytes(self.rate_bps)
        if host_egress:
            queue = max(queue, HOST_QUEUE_MIN_BYTES)
        _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{self.rate_bps}bit",
              "burst", str(burst), "limit", str(queue + burst)], f"rate limit on {ns}/{dev}")

    def spawn(self, host: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:  # type: ignore[type-arg]
        """Start ``argv`` inside host ``host`` (``ip netns exec`` execs in place: the pid is the
        command's). In its own session, so a terminal's Ctrl-C reaches only us and we stop the
        children in order."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.hosts[host].ns, *argv], start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def stop(self, procs: Sequence[subprocess.Popen], timeout: float = 5.0) -> None:  # type: ignore[type-arg]
        """SIGTERM, then SIGKILL after ``timeout``; by pid."""
        stop_processes(list(procs), timeout)
        close_pipes(procs)
        self._procs = [p for p in self._procs if p not in procs]

    def down(self) -> list[str]:
        """End every process we started and every process left in our namespaces, delete the
        namespaces; returns their names. Idempotent; signals wait until it is done."""
        with signals_deferred():
            stop_processes(self._procs, 5.0)
            close_pipes(self._procs)
            self._procs = []
            removed = remove_namespaces(list(reversed(self._created)))
            self._created = []
            if self._forwarder is not None:
                stop_processes([self._forwarder], 5.0)
                self.forwarder_report = _forwarder_report(self._forwarder)
                close_pipes([self._forwarder])
                self._forwarder = None
        return removed


def _forwarder_report(proc: subprocess.Popen) -> dict[str, Any] | None:  # type: ignore[type-arg]
    """The ``tapdelay {json}`` summary the forwarder printed on its way out, if any."""
    if proc.stderr is None or proc.poll() is None:
        return None
    try:
        text = proc.stderr.read()
    except (OSError, ValueError):
        return None
    for line in reversed(text.splitlines()):
        if line.startswith("tapdelay {"):
            try:
                report: dict[str, Any] = json.loads(line.partition(" ")[2])
            except ValueError:
                return None
            return report
    return None


def remove_namespaces(names: Sequence[str]) -> list[str]:
    """End the processes inside ``names`` (by pid), then delete the namespaces."""
    for ns in names:
        pids = _ns_pids(ns)
        for pid in pids:
            _kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = [p for p in pids if _alive(p)]
        for pid in pids:
            _kill(pid, signal.SIGKILL)
    removed = []
    errors = []
    for ns in names:
        proc = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True, timeout=30)
        if proc.returncode == 0:
            removed.append(ns)
        else:
            errors.append(f"{ns}: {proc.stderr.strip()}")
    if errors:
        print(f"redsrv bench: could not delete namespace(s): {'; '.join(errors)}", file=sys.stderr)
    return removed


def _ns_pids(ns: str) -> list[int]:
    proc = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
    return [int(x) for x in proc.stdout.split() if x.isdigit() and int(x) != os.getpid()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def close_pipes(procs: Sequence[subprocess.Popen]) -> None:  # type: ignore[type-arg]
    """Close our ends of the pipes of processes that have exited."""
    for p in procs:
        for stream in (p.stdin, p.stdout, p.stderr):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
