"""The client of a worker that shares its host with other workers (``Config.host_level``): the
same API as :class:`~redsrv.core.client.Client`, with the host-level path of :mod:`host` behind
it. ``Client(...)`` returns one of these by itself where the configuration asks for host-level
reduction, so adapters and scripts need no change.

What this module adds to :class:`~redsrv.core.host.HostCore` is the I/O:

- **Rendezvous** (:class:`LocalGroup`, on the constructing thread, one deadline): the workers of a
  host meet on abstract Unix sockets named by the job and the host's identity (abstract names
  belong to the network namespace and vanish with their process: no file is left behind), check
  each other's user id (``SO_PEERCRED``) and sizes, and pass each other their staging areas as
  ``memfd`` file descriptors: memory that exists only while a process maps it, so a killed worker
  leaves nothing behind either. Their global ranks give the placement and this host's index.
- **The cross-host job**: a flat :class:`Client` per worker, in job ``<job>/local<l>`` with the
  host index as its rank and the number of hosts as its world size, so the reducers see one
  contribution per host for each share; it rides through reducer restarts as any client does.
  A job whose workers all share one host has none: the core finishes its operations inside the
  host, and no reducer is contacted (not even at construction).
- **The engine**: one thread (``redsrv-host``) owns the local sockets and the core, and is the
  only thread that touches either. Callers' threads and the cross-host client's completion thread
  hand it events through a queue and wake it; it settles futures, whose done-callbacks run on this
  client's own completion thread (``redsrv-done``), as with the flat client. No lock is taken
  except the queue's and the one guarding the set of keys in flight.
"""

from __future__ import annotations

import collections
import concurrent.futures
import errno
import hashlib
import itertools
import logging
import math
import mmap
import os
import selectors
import socket
import struct
import threading
import time
from typing import Any

import numpy as np

from . import constants as C
from . import host, wire
from .buffer_pool import OutputPool
from .client import Client, _open_clients, resolve_config
from .client_ops import Completions, ReduceFuture, label, set_exception
from .config import Config
from .errors import (
    ClientClosedError,
    ConfigError,
    LocalProtocolError,
    PeerLostError,
    PeerTimeoutError,
    RedsrvError,
    RemoteProtocolError,
    StaleContributionError,
)
from .plane import kernels_for
from .transport import Waker

__all__ = ["HostClient", "LocalGroup", "host_identity", "cross_host_config"]

log = logging.getLogger("redsrv.host")

_CONNECT_RETRY_S = 0.02
_GOODBYE = "closed its client"


def host_identity(config: Config) -> str:
    """Who shares this host: ``host_id`` if set (REDSRV_HOST_ID, as NCCL's NCCL_HOSTID), else the
    host name, the kernel's boot id and the network namespace, which together tell apart two
    containers or emulated hosts on one machine (their workers cannot share memory)."""
    if config.host_id is not None:
        return config.host_id
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id",):
        try:
            with open(path) as f:
                parts.append(f.read().strip())
        except OSError:
            pass
    try:
        parts.append(str(os.stat("/proc/self/ns/net").st_ino))
    except OSError:
        pass
    return "|".join(parts)


def _socket_name(config: Config, local_rank: int) -> bytes:
    digest = hashlib.blake2b(f"{config.job}\0{host_identity(config)}".encode(), digest_size=12).hexdigest()
    return f"\0redsrv-host-{digest}-{local_rank}".encode()


def cross_host_config(config: Config, local_rank: int, host_index: int, hosts: int) -> Config:
    """The flat client's settings for this worker's share: its own job per local rank, the host
    index as rank, one contribution per host, its own reducers (:func:`host.share_reducers`). A
    straggler mode's ``min_contributors`` counts workers; across hosts it counts whole hosts
    (every worker of a host contributes at once)."""
    local_size = config.local_size or 1
    timeline = config.timeline.replace("{rank}", str(config.rank)) if config.timeline else None
    mine = host.share_reducers(len(config.reducers), local_size)[local_rank]
    return config.replace(reducers=tuple(config.reducers[j] for j in mine), job=f"{config.job}/local{local_rank}",
                          rank=host_index, world_size=hosts, host_reduce="flat",
                          local_rank=None, local_size=None, timeline=timeline,
                          min_contributors=math.ceil(config.min_contributors / local_size))


class LocalGroup:
    """The workers of this host, met and checked: a link to each other worker, every worker's
    staging area mapped, the placement and this host's index. Built by :meth:`meet`."""

    def __init__(self, config: Config) -> None:
        self.config = config
        assert config.local_rank is not None and config.local_size is not None
        self.local_rank = config.local_rank
        self.local_size = config.local_size
        self.slot_bytes = config.host_slot_bytes
        self.frame_bytes = config.piece_bytes
        self.links: dict[int, socket.socket] = {}  # local rank -> link
        self.hellos: dict[int, host.Hello] = {}
        self.maps: dict[int, mmap.mmap] = {}
        self.placement: host.Placement | None = None
        self.host_index = -1
        self._memfd = -1

    @classmethod
    def meet(cls, config: Config) -> LocalGroup:
        group = cls(config)
        try:
            group._meet()
        except BaseException:
            group.close()
            raise
        return group

    def _meet(self) -> None:
        config = self.config
        deadline = time.monotonic() + config.connect_timeout
        self._memfd = os.memfd_create(f"redsrv-{config.job}-local{self.local_rank}", os.MFD_CLOEXEC)
        os.ftruncate(self._memfd, self.slot_bytes)
        self.maps[self.local_rank] = mmap.mmap(self._memfd, self.slot_bytes)
        mine = host.Hello(self.local_rank, self.local_size, config.rank, config.world_size, os.getpid(), self.slot_bytes,
                          self.frame_bytes)
        self.hellos[self.local_rank] = mine
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            try:
                listener.bind(_socket_name(config, self.local_rank))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                raise ConfigError(f"local rank {self.local_rank} of job {config.job!r} is taken on this host by another "
                                  "process: two workers were given the same local rank, or two jobs run under one job id "
                                  "(REDSRV_JOB)") from None
            listener.listen(self.local_size)
            for peer in range(self.local_rank):
                self._greet(self._connect(peer, deadline), peer, deadline, first=True)
            for _ in range(self.local_size - 1 - self.local_rank):
                listener.settimeout(max(0.001, deadline - time.monotonic()))
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    missing = [r for r in range(self.local_size) if r not in self.links and r != self.local_rank]
                    raise PeerTimeoutError(f"the workers of this host did not all arrive: local ranks {missing} never "
                                           "connected", job=config.job, rank=config.rank, phase="host rendezvous",
                                           timeout=config.connect_timeout) from None
                self._greet(conn, None, deadline, first=False)
        finally:
            listener.close()
        ranks = [self.hellos[r].rank for r in range(self.local_size)]
        found = host.Placement.of(ranks, config.world_size)
        if found is None:
            raise ConfigError(f"the workers of this host have ranks {ranks} (by local rank): host-level reduction needs "
                              "each host's ranks in a block (h*L .. h*L+L-1, as torchrun and mpirun place them) or strided "
                              "(h, h+H, h+2H, ...); launch them so, or set host_reduce='flat' (REDSRV_HOST_REDUCE)")
        self.placement, self.host_index = found

    def _connect(self, peer: int, deadline: float) -> socket.socket:
        name = _socket_name(self.config, peer)
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            try:
                sock.connect(name)
                return sock
            except (ConnectionRefusedError, FileNotFoundError):
                sock.close()
                if time.monotonic() > deadline:
                    raise PeerTimeoutError(f"local rank {peer} of this host never listened", job=self.config.job,
                                           rank=self.config.rank, phase="host rendezvous",
                                           timeout=self.config.connect_timeout) from None
                time.sleep(_CONNECT_RETRY_S)  # the peer is still starting; nothing to wait on but time
            except BaseException:
                sock.close()
                raise

    def _greet(self, sock: socket.socket, peer: int | None, deadline: float, *, first: bool) -> None:
        """Exchange HELLOs and staging areas on a new link; ``first``: this side speaks first."""
        try:
            uid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]
            if uid != os.getuid():
                raise ConfigError(f"a process of user id {uid} tried to join the workers of job {self.config.job!r} on "
                                  f"this host (ours is {os.getuid()})")
            mine = host.encode(self.hellos[self.local_rank])
            if first:
                socket.send_fds(sock, [mine], [self._memfd])
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            try:
                packet, fds, _, _ = socket.recv_fds(sock, host.MAX_MESSAGE_BYTES, 1)
            except TimeoutError:
                raise PeerTimeoutError("a worker of this host connected but never said hello", job=self.config.job,
                                       rank=self.config.rank, phase="host rendezvous",
                                       timeout=self.config.connect_timeout) from None
            try:
                hello = host.decode(packet) if packet else None
                if not isinstance(hello, host.Hello) or len(fds) != 1:
                    raise RemoteProtocolError(f"a worker of this host sent {hello!r} with {len(fds)} descriptors "
                                              "instead of its hello and staging area")
                self._check(hello, peer)
                if not first:
                    socket.send_fds(sock, [mine], [self._memfd])
                self.maps[hello.local_rank] = mmap.mmap(fds[0], self.slot_bytes)
            finally:
                for fd in fds:
                    os.close(fd)
            sock.setblocking(False)
            self.links[hello.local_rank] = sock
            self.hellos[hello.local_rank] = hello
        except BaseException:
            sock.close()
            raise

    def _check(self, hello: host.Hello, peer: int | None) -> None:
        mine = self.hellos[self.local_rank]
        where = f"local rank {hello.local_rank} (rank {hello.rank}, pid {hello.pid})"
        if peer is not None and hello.local_rank != peer:
            raise ConfigError(f"the worker listening as local rank {peer} of this host says it is {where}")
        if not 0 <= hello.local_rank < self.local_size or hello.local_rank in self.hellos:
            raise ConfigError(f"{where} joined the workers of this host twice or out of range "
                              f"(local_size {self.local_size})")
        for name in ("local_size", "world_size", "slot_bytes", "frame_bytes"):
            if getattr(hello, name) != getattr(mine, name):
                setting = {"slot_bytes": "host_slot_bytes", "frame_bytes": "host_piece_bytes"}.get(name, name)
                raise ConfigError(f"the workers of this host disagree on {setting}: local rank {self.local_rank} (rank "
                                  f"{mine.rank}) has {getattr(mine, name)}, {where} has {getattr(hello, name)}")

    def slots(self) -> list[np.ndarray]:
        return [np.frombuffer(self.maps[r], dtype=np.uint8) for r in range(self.local_size)]

    def describe(self, local_rank: int) -> str:
        hello = self.hellos.get(local_rank)
        return f"rank {hello.rank}, pid {hello.pid}" if hello else "?"

    def close(self) -> None:
        for sock in self.links.values():
            sock.close()
        self.links.clear()
        for mapping in self.maps.values():
            try:
                mapping.close()
            except BufferError:
                pass  # a view of it is still alive somewhere; the mapping goes with the last one
        self.maps.clear()
        if self._memfd >= 0:
            os.close(self._memfd)
            self._memfd = -1


class HostClient(Client):
    """A :class:`Client` whose operations reduce inside the host first (module docstring).

    Build it as a :class:`Client`: ``Client(...)`` returns a ``HostClient`` where
    ``Config.host_level`` holds. Its results are the same on every rank; sums are combined in
    local-rank order inside each host and in host order across hosts."""

    def __init__(self, reducers: Any = None, *, rank: int | None = None, world_size: int | None = None,
                 job: str | None = None, config: Config | None = None, **options: Any) -> None:
        config = resolve_config(reducers, rank, world_size, job, config, options)
        if not config.host_level:
            raise ConfigError("HostClient needs a host-level configuration (host_reduce, local_rank, local_size)")
        self.config = config
        self._auto_keys = itertools.count()
        self._completions = Completions("redsrv-done")
        self._outputs = OutputPool()  # the results of operations given no ``out``
        self._live: set[int] = set()  # keys whose futures are not settled yet
        self._live_lock = threading.Lock()
        self._inbox: collections.deque[tuple[Any, ...]] = collections.deque()
        self._shut = False
        self._completed = 0
        self._failed: dict[str, int] = {}
        self._inner: Client | None = None
        self._thread: threading.Thread | None = None
        self._engine_error: PeerLostError | None = None
        self._leaving: threading.Thread | None = None
        self._group = LocalGroup.meet(config)
        self._waker = Waker()
        try:
            placement = self._group.placement
            assert placement is not None
            one_host = placement.hosts == 1  # the core finishes every operation inside the host
            if not one_host:
                self._inner = Client(config=cross_host_config(config, self._group.local_rank, self._group.host_index,
                                                              placement.hosts))
            self._core = host.HostCore(
                local_rank=self._group.local_rank, placement=placement, host=self._group.host_index,
                slots=self._group.slots(), frame_bytes=self._group.frame_bytes, job=config.job, rank=config.rank,
                peers={r: self._group.describe(r) for r in range(placement.local_size)},
                all_mode=config.straggler_mode == "all",
                weights=None if one_host else [len(r) for r in host.share_reducers(len(config.reducers),
                                                                                    placement.local_size)],
                kernels=kernels_for(config.data_plane))
            self._outgoing: dict[int, collections.deque[bytes]] = {r: collections.deque() for r in self._group.links}
            # The core and the links are the engine's, and a submitting thread's while it holds
            # this lock (:meth:`_submit_here`); selector changes wanted off the engine wait in
            # _rewatch for the engine to make them (it may be inside select()).
            self._core_lock = threading.Lock()
            self._rewatch: set[int] = set()
            self._dead_writers: set[int] = set()
            self._leave_when_idle = False
            self._selector = selectors.DefaultSelector()
            self._selector.register(self._waker.read_end, selectors.EVENT_READ, None)
            for peer, sock in self._group.links.items():
                self._selector.register(sock, selectors.EVENT_READ, peer)
        except BaseException:
            self._release_resources()
            raise
        self._thread = threading.Thread(target=self._run, name="redsrv-host", daemon=True)
        self._thread.start()
        _open_clients.add(self)

    # --- the public API that differs from the flat client ---

    @property
    def _closed(self) -> bool:
        return self._shut

    @property
    def host_index(self) -> int:
        """This worker's host among the job's hosts (the rank of its cross-host client)."""
        return self._group.host_index

    @property
    def hosts(self) -> int:
        placement = self._group.placement
        return placement.hosts if placement else 0

    @property
    def local_rank(self) -> int:
        return self._group.local_rank

    @property
    def session(self) -> int:
        return self._inner.session if self._inner else 0

    @property
    def bytes_pushed(self) -> int:
        return self._inner.bytes_pushed if self._inner else 0

    @property
    def bytes_pulled(self) -> int:
        return self._inner.bytes_pulled if self._inner else 0

    @property
    def ops_completed(self) -> int:
        return self._completed

    @property
    def ops_failed(self) -> dict[str, int]:
        return dict(self._failed)

    def check(self) -> None:
        if self._shut:
            raise ClientClosedError(f"client for job {self.config.job!r} rank {self.rank} is closed")
        if self._engine_error is not None:
            raise self._engine_error
        broken = self._core.broken if self._core is not None else None
        if broken is not None and not isinstance(broken, ClientClosedError):
            raise broken

    def close(self) -> None:
        """Idempotent and bounded by ``close_timeout``: pending operations fail with
        :class:`ClientClosedError`, the other workers of the host are told (and fail theirs), the
        cross-host client closes."""
        _open_clients.discard(self)
        if self._shut:
            return
        self._shut = True
        deadline = time.monotonic() + self.config.close_timeout
        self._post(("close",))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(max(0.0, deadline - time.monotonic()))
        self._release_resources()
        self._completions.close(max(0.0, deadline - time.monotonic()))

    def __del__(self) -> None:
        if not self.__dict__.get("_shut", True):
            try:
                self.close()
            except Exception:
                pass

    # --- submission (called by Client's argument-checking front) ---

    def _submit(self, arr: np.ndarray, shape: tuple[int, ...], key: Any, wire_dt: np.dtype, op_code: wire.ReduceOp,
                root: int, mean: bool, timeout: float | None, out: np.ndarray | None = None, *,
                ramp: bool = True) -> ReduceFuture:
        self.check()
        wire.dtype_code(arr.dtype)
        key_u64 = self._key(key)
        future = ReduceFuture()
        future.key = key
        future._completions = self._completions
        flat_out = self._outputs.empty(arr.size, arr.dtype) if out is None else out.reshape(-1)
        now = time.monotonic()
        timeout = self.config.op_timeout if timeout is None else timeout
        op = host.HostOp(key_u64, key, arr, flat_out, wire_dt, op_code, root, mean, future, now + timeout, now, shape, out)
        with self._live_lock:
            if self._shut:
                raise ClientClosedError(f"client for job {self.config.job!r} rank {self.rank} is closed")
            if key_u64 in self._live:
                raise LocalProtocolError(f"operation key {key!r} is already in flight on this client")
            self._live.add(key_u64)
        if not self._submit_here(op):
            self._post(("submit", op))
        return future

    def _submit_here(self, op: host.HostOp) -> bool:
        """Submit ``op`` and stage its first piece on the calling thread, when the engine is not
        busy and nothing submitted earlier waits for it (the core must see operations in
        submission order). A small operation's INPUT then leaves without waking the engine:
        one thread hand-off less per operation, which on one host is a good part of a small
        all-reduce's time (docs/torch_backend.md, "Small operations, second step"). False: post it to the engine."""
        if not self._core_lock.acquire(blocking=False):
            return False
        try:
            if self._inbox or self._core is None or self._engine_error is not None:
                return False
            self._handle(("submit", op))
            self._execute(self._core.stage())
            wake = self._core.can_stage or bool(self._rewatch)
        except Exception as exc:  # a bug: the engine fails as if it were its own (every operation at once)
            self._inbox.append(("fail", exc, op))
            wake = True
        finally:
            self._core_lock.release()
        if wake:
            self._waker.wake()
        return True

    # --- the engine ---

    def _post(self, event: tuple[Any, ...]) -> None:
        self._inbox.append(event)
        self._waker.wake()

    def _run(self) -> None:
        failed: host.HostOp | None = None  # an operation whose submission on its caller's thread hit a bug
        try:
            next_tick = time.monotonic() + C.TICK_INTERVAL_S
            while True:
                with self._core_lock:
                    timeout = 0.0 if self._core.can_stage else max(0.0, next_tick - time.monotonic())
                ready = self._selector.select(timeout)
                with self._core_lock:
                    for peer in list(self._rewatch):
                        self._watch(peer)
                    self._serve(ready)
                    while self._inbox:
                        event = self._inbox.popleft()
                        if event[0] == "close":
                            self._shutdown()
                            return
                        if event[0] == "fail":
                            failed = event[2]
                            raise event[1]
                        self._handle(event)
                    self._execute(self._core.stage())  # one piece, then the others' messages again
                    if self._leave_when_idle and not self._core.busy:
                        self._leave_cross_host_job()
                    now = time.monotonic()
                    if now >= next_tick:
                        self._execute(self._core.tick(now))
                        self._outputs.release_idle(now)
                        next_tick = now + C.TICK_INTERVAL_S
        except BaseException as exc:  # a bug here must fail every operation at once, not leave them to time out
            log.exception("the host-level engine failed")
            error = PeerLostError(f"the host-level engine of this worker failed: {exc!r}", job=self.config.job,
                                  rank=self.config.rank, phase="host-level reduction")
            with self._core_lock:  # not while a submitting thread is inside the core
                self._engine_error = error  # check() raises it: nothing will run a later operation
                actions = self._core.close(ClientClosedError(str(error)))
            for action in actions:
                if isinstance(action, host.Settle):
                    self._settle(action.key, action.future, error=error)
            if failed is not None and not failed.future.done():  # it failed before the core took it
                self._settle(failed.key, failed.future, error=error)

    def _serve(self, ready: list[tuple[selectors.SelectorKey, int]]) -> None:
        """What select() found ready: the waker, and the links to flush or read."""
        for selected, events in ready:
            peer = selected.data
            if peer is None:
                self._waker.drain()
                continue
            if events & selectors.EVENT_WRITE:
                self._flush(peer)
            if events & selectors.EVENT_READ:
                self._read(peer)

    def _handle(self, event: tuple[Any, ...]) -> None:
        if event[0] == "submit":
            op: host.HostOp = event[1]
            if op.key in self._core.ops:
                error = StaleContributionError(f"operation key {op.label!r} was used again before the workers of this host "
                                               "released the previous operation under it", job=self.config.job,
                                               rank=self.config.rank, key=label(op.label))
                self._settle(op.key, op.future, error=error)
                return
            self._execute(self._core.submit(op))
        elif event[0] == "share":
            _, key, piece, future = event
            error = future.exception()
            self._execute(self._core.share_finished(key, piece, time.monotonic(), contributors=future.contributors,
                                                     error=error))

    def _execute(self, actions: list[host.Action]) -> None:
        for action in actions:
            if isinstance(action, host.SendToPeers):
                packet = host.encode(action.message)
                for peer in list(self._group.links):
                    self._send(peer, packet)
                if action.then_here:
                    self._execute(self._core.receive(self._core.local_rank, action.message))
            elif isinstance(action, host.SubmitShare):
                self._submit_share(action)
            else:
                self._settle(action.key, action.future, result=action.result, error=action.error,
                             contributors=action.contributors)

    def _submit_share(self, action: host.SubmitShare) -> None:
        assert self._inner is not None
        remaining = max(0.001, action.deadline - time.monotonic())
        try:
            future = self._inner._submit(action.x, action.x.shape, ("host", action.key, action.piece), action.wire_dtype,
                                         action.op, action.root, action.mean, remaining, action.out, ramp=False)
        except RedsrvError as exc:
            if action.poison:
                return
            failed: concurrent.futures.Future[Any] = concurrent.futures.Future()
            failed.set_exception(exc)
            self._handle(("share", action.key, action.piece, failed))
            return
        if action.poison:
            return  # its outcome concerns the other hosts only
        future.add_done_callback(lambda done: self._post(("share", action.key, action.piece, done)))

    def _settle(self, key: int, future: ReduceFuture, *, result: np.ndarray | None = None,
                error: BaseException | None = None, contributors: Any = None) -> None:
        with self._live_lock:
            self._live.discard(key)
        if error is not None:
            name = type(error).__name__
            self._failed[name] = self._failed.get(name, 0) + 1
            set_exception(future, error)
            return
        self._completed += 1
        future.contributors = contributors
        if future.set_running_or_notify_cancel():
            future.set_result(result)

    def _send(self, peer: int, packet: bytes) -> None:
        if peer in self._dead_writers:
            return
        queue = self._outgoing[peer]
        if queue:
            queue.append(packet)
            return
        try:
            self._group.links[peer].send(packet)
        except BlockingIOError:
            queue.append(packet)
            self._watch(peer)
        except OSError:
            self._unwritable(peer)

    def _watch(self, peer: int) -> None:
        """Watch ``peer``'s link for writing while packets wait for it, else for reading only;
        off the engine, the engine does it next time round (the caller wakes it)."""
        if threading.current_thread() is not self._thread:
            self._rewatch.add(peer)
            return
        self._rewatch.discard(peer)
        sock = self._group.links.get(peer)
        if sock is not None:
            writing = bool(self._outgoing.get(peer))  # a dead writer's queue is cleared and stays empty
            self._selector.modify(sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if writing else 0), peer)

    def _flush(self, peer: int) -> None:
        queue, sock = self._outgoing[peer], self._group.links.get(peer)
        if sock is None:
            return
        try:
            while queue:
                sock.send(queue[0])
                queue.popleft()
        except BlockingIOError:
            return
        except OSError:
            self._unwritable(peer)
            return
        self._watch(peer)

    def _unwritable(self, peer: int) -> None:
        """A peer that closed or died cannot be written to; what it sent before is still to be
        read, in order, and its end of file (or goodbye) is what declares it gone (:meth:`_read`).
        Until then, what is sent to it is dropped: it no longer reads."""
        self._outgoing[peer].clear()
        self._dead_writers.add(peer)
        self._watch(peer)

    def _read(self, peer: int) -> None:
        sock = self._group.links.get(peer)
        while sock is not None:
            try:
                packet = sock.recv(host.MAX_MESSAGE_BYTES + 1)
            except BlockingIOError:
                return
            except OSError as exc:
                self._lose(peer, f"broke its link ({exc.strerror or exc})")
                return
            if not packet:
                self._lose(peer, "is gone (its process ended or closed its link)")
                return
            try:
                message = host.decode(packet)
            except RemoteProtocolError as exc:
                self._lose(peer, f"sent garbage ({exc})")
                return
            if isinstance(message, host.Bye):
                self._lose(peer, _GOODBYE)
                return
            self._execute(self._core.receive(peer, message))

    def _lose(self, peer: int, why: str) -> None:
        sock = self._group.links.pop(peer, None)
        if sock is None:
            return
        self._selector.unregister(sock)
        sock.close()
        self._outgoing.pop(peer, None)
        log.log(logging.INFO if why == _GOODBYE else logging.WARNING, "job %r rank %d: local rank %d (%s) %s",
                self.config.job, self.config.rank, peer, self._group.describe(peer), why)
        self._execute(self._core.peer_lost(peer, why))
        self._leave_when_idle = True

    def _leave_cross_host_job(self) -> None:
        """A host that lost a worker cannot reduce that worker's share any more: once the
        operations that do not need it are settled, its other workers leave the cross-host jobs,
        so that the reducers fail the other hosts' operations at once (RELIABILITY R2) instead
        of at their deadline."""
        self._leave_when_idle = False
        if self._inner is not None:
            # Not on the engine: closing says goodbye to every reducer, within the close timeout.
            self._leaving = threading.Thread(target=self._inner.close, name="redsrv-host-leave", daemon=True)
            self._leaving.start()

    def _shutdown(self) -> None:
        self._linger(time.monotonic() + self.config.close_timeout / 2)
        error = ClientClosedError(f"client for job {self.config.job!r} rank {self.rank} was closed with the operation pending")
        self._execute(self._core.close(error))
        packet = host.encode(host.Bye())
        for peer, sock in list(self._group.links.items()):
            try:
                for queued in self._outgoing.get(peer, ()):
                    sock.send(queued)
                sock.send(packet)
            except OSError:
                pass

    def _linger(self, deadline: float) -> None:
        """Before the goodbye, read the other workers' messages until each has released every
        operation this worker finished (or ``deadline``). A link closed with messages unread in
        it resets the other end (ECONNRESET), and that end loses what this worker sent it and it
        has not read yet: on one host, the INPUTs of operations this worker finished first (a
        whole piece waits for nobody's DONE). Once a worker said RELEASED it had read them."""
        while self._group.links and any(op.settled and not op.failed for op in self._core.ops.values()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._serve(self._selector.select(remaining))

    def _release_resources(self) -> None:
        """After the engine stopped (or never started): the cross-host client, then the memory it
        may still have been reading, then the links."""
        leaving = self.__dict__.get("_leaving")
        if leaving is not None:
            leaving.join(self.config.close_timeout)  # the cross-host client's goodbye is bounded by it too
        if self._inner is not None:
            self._inner.close()
        selector = self.__dict__.get("_selector")
        if selector is not None:
            selector.close()
        lock = self.__dict__.get("_core_lock")
        if lock is not None:
            with lock:  # a submitting thread may be inside the core (_submit_here)
                self._core = None  # type: ignore[assignment]  # its views of the staging areas go first
        else:
            self._core = None  # type: ignore[assignment]
        self._group.close()
        self._waker.close()
