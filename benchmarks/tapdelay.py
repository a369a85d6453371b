"""A userspace Ethernet switch that delays every frame, for ``redsrv bench emulate --delay-us``.

Kernels without ``sch_netem`` cannot add delay to a link, so the emulated hosts' ``eth0`` are TAP
devices and this process forwards frames between them (learning MACs, flooding unknown and
broadcast destinations), releasing each one ``DELAY_US`` microseconds after it arrived. Ring
all-reduce and the reduction server pay the same delay per hop.

It is pure Python (no compiler needed) and handles tens of thousands of frames per second:
enough for small-message latency runs, not for bandwidth runs at Gbit/s rates, which is why
``redsrv bench emulate`` keeps the kernel bridge when no delay is asked for. Its own processing
adds a few tens of microseconds per hop on an idle machine, to both implementations alike.

It stands for switch hardware, which does not wait for the hosts' CPUs, so it runs at real-time
priority (``SCHED_FIFO``) where allowed: otherwise the emulated hosts' own load would make every
hop later than asked, the more so the more hops an all-reduce takes. How late frames actually
left is measured and reported.

Usage (started by :class:`redsrv.bench.netns.Cluster`, needs root): ``python -m
redsrv.bench.tapdelay DELAY_US NS0 NS1 ...``; the TAP devices ``eth0`` must already exist in
those namespaces. Prints ``ready`` once attached; on SIGTERM prints ``tapdelay {json}`` to
stderr (frames forwarded, dropped for a full queue, undeliverable to a port that was down; the
scheduling policy; percentiles of how many microseconds after its due time each frame left) and
ends.
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import json
import os
import select
import signal
import struct
import sys
import time

_CLONE_NEWNET = 0x40000000
_TUNSETIFF = 0x400454CA
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000
_PR_SET_TIMERSLACK = 29
_MAX_FRAME = 65536
#: Frames held at most; beyond this new frames are dropped, like a switch's full buffer.
_MAX_QUEUED = 65536
#: Real-time priority: above every emulated host's process, low among real-time threads.
_PRIORITY = 10


def _attach(names: list[str], ifname: str = "eth0") -> list[int]:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)  # wake on time, not up to 50 us late
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    fds = []
    try:
        for name in names:
            nsfd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
            try:
                if libc.setns(nsfd, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {name}")
                fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
                fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", ifname.encode(), _IFF_TAP | _IFF_NO_PI))
                fds.append(fd)
            finally:
                os.close(nsfd)
    finally:
        libc.setns(home, _CLONE_NEWNET)
        os.close(home)
    return fds


def _real_time_priority() -> str:
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(_PRIORITY))
    except (OSError, AttributeError) as exc:
        return f"normal ({exc})"
    return f"SCHED_FIFO {_PRIORITY}"


def lateness_percentiles(counts: dict[int, int], points: tuple[float, ...] = (0.5, 0.99)) -> dict[str, int]:
    """Percentiles (and the maximum) of a histogram ``{microseconds: frames}``.

    >>> lateness_percentiles({3: 98, 40: 1, 900: 1})
    {'p50': 3, 'p99': 40, 'max': 900}
    """
    total = sum(counts.values())
    out: dict[str, int] = {}
    if not total:
        return out
    ordered = sorted(counts.items())
    for point in points:
        rank, seen = point * total, 0
        for value, count in ordered:
            seen += count
            if seen >= rank:
                out[f"p{point * 100:g}"] = value
                break
    out["max"] = ordered[-1][0]
    return out


def run(delay_us: int, names: list[str]) -> int:
    fds = _attach(names)
    priority = _real_time_priority()
    delay = delay_us / 1e6
    port_of = {fd: i for i, fd in enumerate(fds)}
    macs: dict[bytes, int] = {}
    queue: collections.deque[tuple[float, int, bytes]] = collections.deque()
    late_us: collections.Counter[int] = collections.Counter()  # microseconds after the due time -> frames
    forwarded = dropped = undeliverable = 0  # dropped: queue full; undeliverable: the port was down

    def on_term(_signum: int, _frame: object) -> None:
        summary = {"forwarded": forwarded, "dropped": dropped, "undeliverable": undeliverable, "scheduling": priority,
                   "late_us": lateness_percentiles(late_us)}
        print(f"tapdelay {json.dumps(summary)}", file=sys.stderr, flush=True)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    print(f"ready {len(fds)} ports, delay {delay_us} us, {priority}", flush=True)
    while True:
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            due, src, frame = queue.popleft()
            late_us[int((now - due) * 1e6)] += 1
            if not frame[6] & 1:
                macs[frame[6:12]] = src
            dst = macs.get(frame[:6]) if not frame[0] & 1 else None
            targets = [fds[dst]] if dst is not None and dst != src else [fd for i, fd in enumerate(fds) if i != src]
            for fd in targets:
                try:
                    os.write(fd, frame)
                except OSError:
                    undeliverable += 1  # e.g. neighbour discovery before a host's link is up
            forwarded += 1
        timeout = max(0.0, queue[0][0] - time.monotonic()) if queue else 1.0
        ready, _, _ = select.select(fds, [], [], timeout)
        arrived = time.monotonic() + delay
        for fd in ready:
            for _ in range(256):  # bounded: let due frames out between bursts
                try:
                    frame = os.read(fd, _MAX_FRAME)
                except BlockingIOError:
                    break
                if len(queue) >= _MAX_QUEUED:
                    dropped += 1
                    continue
                queue.append((arrived, port_of[fd], frame))


if __name__ == "__main__":
    if len(sys.argv) < 4 or not sys.argv[1].isdigit():
        sys.exit("usage: python -m redsrv.bench.tapdelay DELAY_US NS0 NS1 [...]")
    sys.exit(run(int(sys.argv[1]), sys.argv[2:]))
