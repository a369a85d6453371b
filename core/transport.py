"""Sockets: the non-blocking frame reader and writer that the reducer's and the client's event
loops drive (handshakes are :mod:`handshake`'s state machines, driven by their owners).

The only module besides the daemon and client entry points that touches the network. Every
blocking call has a deadline (handshake reads and writes time out); on the event-loop side the
owners keep the deadlines: a peer silent for the heartbeat bound is frozen, one that stopped
reading for the send timeout is dropped.

Once joined, a connection is served by one event loop per process (the reducer's, the client's)
rather than a reader and a sender thread per connection: each thread cost a wake-up and a GIL
hand-off per frame, which on a loaded host was most of a small all-reduce's time.
"""

from __future__ import annotations

import collections
import errno
import os
import selectors
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import wire
from .constants import MAX_RECEIVE_LOWAT_BYTES
from .errors import RemoteProtocolError

__all__ = ["FrameReader", "FrameWriter", "ReceiverOutcome", "ConnectionBroken", "configure_socket", "set_kernel_timeout",
           "set_send_lowat", "set_receive_buffer", "set_congestion_control", "choose_congestion_control",
           "congestion_control", "send_views", "peer_name", "SKIP", "WAIT", "Waker", "watch"]


class ConnectionBroken(Exception):
    """Internal: the connection ended. ``kind`` is 'eof', 'timeout', 'reset', 'protocol', or 'internal' (a bug
    of ours while serving it)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


def configure_socket(sock: socket.socket) -> None:
    """TCP_NODELAY: small frames (heartbeats, headers, latency-bound reductions) must not wait
    for Nagle's timer. Blocking mode: deadlines come from kernel timeouts (see the module doc)."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(None)


def set_send_lowat(sock: socket.socket, nbytes: int) -> None:
    """``TCP_NOTSENT_LOWAT``: a blocking send returns once at most about ``nbytes`` wait unsent
    in the kernel, instead of once they fit in the (megabytes large) send buffer. Lets the
    application, not the send buffer, decide what leaves next. No-op for 0 or non-TCP sockets."""
    option = getattr(socket, "TCP_NOTSENT_LOWAT", None)
    if nbytes > 0 and option is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, option, nbytes)


def set_receive_buffer(sock: socket.socket, nbytes: int) -> None:
    """``SO_RCVBUF``: the peer may have at most about ``nbytes`` in flight towards this socket
    (Linux books twice the value, half of it for its own overhead), and the kernel stops autotuning
    the window. No-op for 0 or non-TCP sockets (see ``constants.RECOMMENDED_RECV_BUFFER_BYTES``)."""
    if nbytes > 0 and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, nbytes)


def set_congestion_control(sock: socket.socket, name: str) -> str | None:
    """Select the TCP congestion control algorithm ``name`` for this connection. Returns ``None``
    on success, otherwise why not (the kernel lacks it, or an unprivileged process may only pick
    those in ``net.ipv4.tcp_allowed_congestion_control``); the connection then keeps the
    system default, which still works, only slower on some networks."""
    option = getattr(socket, "TCP_CONGESTION", None)
    if option is None:
        return "this platform has no per-connection congestion control (TCP_CONGESTION)"
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return "not a TCP connection"
    try:
        sock.setsockopt(socket.IPPROTO_TCP, option, name.encode("ascii"))
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def choose_congestion_control(sock: socket.socket, wanted: str | None) -> str | None:
    """Apply ``wanted`` (``None``: keep the system default) to a data connection. Returns ``None``
    when done, otherwise a sentence for the log saying what was refused, why, what the connection
    keeps, and how to fix or silence it."""
    if wanted is None:
        return None
    why = set_congestion_control(sock, wanted)
    if why is None:
        return None
    return (f"cannot use TCP congestion control {wanted!r} ({why}); connections keep the system's "
            f"{congestion_control(sock) or 'default'!r} and may reach less of the line rate. Allow it with sysctl "
            "net.ipv4.tcp_allowed_congestion_control, or set REDSRV_TCP_CONGESTION=system to silence this.")


def congestion_control(sock: socket.socket) -> str:
    """The connection's TCP congestion control algorithm ("" where the platform cannot say)."""
    option = getattr(socket, "TCP_CONGESTION", None)
    if option is None:
        return ""
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, option, 16).split(b"\0", 1)[0].decode("ascii", "replace")
    except OSError:
        return ""


def set_kernel_timeout(sock: socket.socket, option: int, seconds: float) -> None:
    """``SO_RCVTIMEO`` / ``SO_SNDTIMEO``: a blocking call waits at most ``seconds``."""
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", whole, int((seconds - whole) * 1e6)))


_TIMED_OUT = (errno.EAGAIN, errno.EWOULDBLOCK)


def peer_name(sock: socket.socket) -> str:
    try:
        address = sock.getpeername()
    except OSError:
        return "?"
    if not isinstance(address, tuple):  # a Unix socket (tests use socket pairs)
        return str(address) or "local"
    host, port = address[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# --- event-loop connections: the reducer's and the client's data path ---------------------

#: Payloads from this size are received with a low-water mark (one wake-up per chunk).
_LOWAT_FROM = 64 * 1024
#: A plain int: ``socket.MSG_DONTWAIT`` is an enum member, whose ``&`` runs Python code.
_DONTWAIT = int(socket.MSG_DONTWAIT)


class ReceiverOutcome:
    """What the native receivers' ``receive`` returns (``redsrv.core._plane.RECEIVE_*``;
    ``tests/unit/test_receiver.py`` checks they agree)."""

    DRAINED, LIMIT, HANDOFF, CLOSED, FAILED = range(5)


#: What ``on_header`` returns instead of a ``(view, what)`` to receive the payload into.
SKIP = "skip"  # read the payload and drop it
WAIT = "wait"  # stop reading this connection now; the next ``read`` asks again (this header, or the next part of its payload)

HeaderStep = tuple[memoryview, str] | str


class FrameReader:
    """Moves bytes from a non-blocking socket into the buffers :class:`wire.FrameDecoder` names,
    for an event loop, resuming wherever the last call stopped. The decoder owns the protocol
    (what comes next, where it lands, what is refused); this class owns the socket, the clock and
    the low-water marks.

    Heartbeats are dropped here, an ERROR frame goes to ``on_error`` and the count an ACK or SAFE
    frame carries to ``on_count`` (where given); the decoder refuses any type other than these
    and ``data_frame`` (PUSH for the reducer, RESULT for the client) at its prefix, a protocol
    error from ``sender``. For each data frame the owner's callbacks decide where the payload
    goes: ``on_header(header)`` returns ``(view, what)`` to receive it into ``view`` (``what``
    names it in timeout messages), or :data:`SKIP` or :data:`WAIT`; ``on_payload()``, once the
    view is full, returns the next ``(view, what)`` of the same payload, :data:`WAIT` (the next
    ``read`` asks again), or ``None`` when the frame is done.

    A large payload is received with a low-water mark (``SO_RCVLOWAT``): the loop wakes when the
    rest of it (up to ``max_lowat``, 4 MiB by default) is in, not for every few segments; it is
    reset before the next frame, or a small header would never wake the loop. An owner that acts
    on part of a payload (the reducer's cut-through) lowers ``max_lowat`` to the part it acts on
    and reads ``payload_received``.

    Between frames the decoder reads ahead (``wire.READ_AHEAD_BYTES``): a result's prefix, header,
    bitmap and the first bytes of its data, or several small frames, in one ``recv``. Bytes read
    ahead are decoded before ``read`` returns, since no poll would report them again.

    On the native plane a receiver in C (``fast``) reads first whenever the decoder is between
    frames: the client's ``ResultReceiver`` (``native/receiver.c``), which lands the results it
    recognises and tells ``on_fast``, or the reducer's ``PushReceiver`` (``native/pushes.c``),
    which reads pushes, ACKs and heartbeats and asks this reader's callbacks itself. Either hands
    any other frame, with the bytes it read ahead, to the decoder.
    """

    __slots__ = ("sock", "peer", "decoder", "sender", "on_header", "on_payload", "on_error", "on_count", "lowat",
                 "_max_lowat", "last_recv", "_stopped", "_waiting", "_lowat_after_frame", "fast", "on_fast", "_fast_views")

    def __init__(self, sock: socket.socket, *, max_payload: int, now: float, data_frame: wire.FrameType, sender: str,
                 on_header: Callable[[wire.FrameHeader], HeaderStep],
                 on_payload: Callable[[], tuple[memoryview, str] | str | None],
                 on_error: Callable[[wire.Error], None],
                 on_count: Callable[[wire.FrameType, int], None] | None = None,
                 parser: wire.FrameParser = wire.PYTHON_PARSER, fast: Any = None,
                 on_fast: Callable[[], None] | None = None) -> None:
        self.sock = sock
        self.peer = peer_name(sock)
        accept = {data_frame, wire.FrameType.HEARTBEAT, wire.FrameType.ERROR}
        if on_count is not None:
            accept |= {wire.FrameType.ACK, wire.FrameType.SAFE}
        self.decoder = wire.FrameDecoder(max_payload, data_frames=frozenset({data_frame}), accept=frozenset(accept),
                                         parser=parser)
        self.sender = sender
        self.on_header, self.on_payload, self.on_error, self.on_count = on_header, on_payload, on_error, on_count
        self.lowat = 1
        # The native plane's receiver (native/receiver.c or native/pushes.c), which reads the frames
        # it recognises and hands every other one to the decoder; ``on_fast`` takes what it landed.
        self.fast, self.on_fast = fast, on_fast
        # The push receiver lands payloads in this reader's owner's views, as the decoder does.
        self._fast_views = fast is not None and hasattr(fast, "landed")
        self._max_lowat = MAX_RECEIVE_LOWAT_BYTES
        self.last_recv = now  # the last time any byte arrived: the owner's frozen-peer clock
        self._stopped = False
        self._waiting = False
        self._lowat_after_frame = 1  # what expect_at_least asked for while a frame was ending

    @property
    def stopped(self) -> bool:
        """Set by the owner when it closes the connection from a callback: nothing more is read."""
        return self._stopped

    @stopped.setter
    def stopped(self, value: bool) -> None:
        self._stopped = value
        if value and self._fast_views:
            self.fast.stop()  # it may be inside one of this reader's callbacks

    @property
    def max_lowat(self) -> int:
        """The largest low-water mark set while a payload lands (4 MiB unless the owner lowers
        it to the part of a payload it acts on)."""
        return self._max_lowat

    @max_lowat.setter
    def max_lowat(self, nbytes: int) -> None:
        self._max_lowat = nbytes
        if self._fast_views:
            self.fast.max_lowat = nbytes

    @property
    def what(self) -> str:
        """What the reader waits for, for timeout messages."""
        fast = self.fast
        return fast.what if fast is not None and fast.busy else self.decoder.what

    def read(self, now: float, max_frames: int) -> None:
        """Receive what the socket holds, at most ``max_frames`` frames (so one busy connection
        cannot starve the loop's others). Raises :class:`ConnectionBroken`."""
        frames = 0
        sock, decoder = self.sock, self.decoder
        self._waiting = drained = False
        fast = self.fast
        if fast is not None and not self.stopped and (fast.busy or decoder.between_frames):
            if not self._receive_fast(fast, now, max_frames):
                return
        # Bytes read ahead are in no socket buffer, so nothing would wake the loop for them:
        # they are decoded now, beyond max_frames if need be (a few small frames at most).
        while (frames < max_frames or decoder.held) and not self._waiting and not self.stopped:
            room = decoder.buffer()
            want = len(room)
            if want:  # a read never asks for zero bytes, whose 0 would read as end-of-file
                if drained:  # what was read ahead is placed and the socket was empty: wait for the rest
                    if decoder.landing >= _LOWAT_FROM:
                        self._set_lowat(min(want, self.max_lowat))
                    return
                try:
                    got = sock.recv_into(room, want)
                except BlockingIOError:
                    return
                except OSError as exc:
                    detail = f"connection to {self.peer} failed while reading {decoder.what}: {exc}"
                    raise ConnectionBroken("reset", detail) from None
                if got == 0:
                    where = "" if decoder.between_frames else f" in the middle of {decoder.what}"
                    raise ConnectionBroken("eof", f"{self.peer} closed the connection{where}")
                self.last_recv = now
                decoder.filled(got)
                if got < want:  # the socket is drained
                    if not decoder.held:  # the part being filled waits for the rest
                        if decoder.landing >= _LOWAT_FROM:
                            self._set_lowat(min(want - got, self.max_lowat))
                        return
                    drained = True  # decode what was read ahead, then wait
            try:
                event = decoder.next_event()
            except RemoteProtocolError as exc:
                raise ConnectionBroken("protocol", f"{exc} from {self.sender}") from None
            if event is not None and self._handle(event):
                frames += 1

    def _receive_fast(self, fast: Any, now: float, max_frames: int) -> bool:
        """Let the native receiver land what it recognises; True when it handed the next frame
        (and the bytes it read ahead of it) to the decoder."""
        outcome = fast.receive(max_frames)
        if fast.received:
            self.last_recv = now
        self.lowat = fast.lowat
        if self.on_fast is not None:
            self.on_fast()  # before the decoder's frame: a SAFE or a chunk the receiver landed came first
        if outcome == ReceiverOutcome.HANDOFF:
            self.decoder.hold(fast.take_held())
            return not self.stopped
        if outcome == ReceiverOutcome.CLOSED:
            where = f" in the middle of {fast.what}" if fast.busy else ""
            raise ConnectionBroken("eof", f"{self.peer} closed the connection{where}")
        if outcome == ReceiverOutcome.FAILED:
            detail = f"connection to {self.peer} failed while reading {fast.what}: {os.strerror(fast.error)}"
            raise ConnectionBroken("reset", detail)
        return False

    def _handle(self, event: wire.Event) -> bool:
        """Answer one decoder event; True when a frame ended."""
        decoder = self.decoder
        if isinstance(event, wire.PayloadWanted):
            step = self.on_header(event.header)
            if self.stopped:  # the owner closed the connection from its callback
                return False
            if step is WAIT:
                self._waiting = True
                return False
            if step is SKIP:
                decoder.skip_payload()
            else:
                assert isinstance(step, tuple)
                decoder.land_payload(*step)
            return False
        if isinstance(event, wire.PayloadLanded):
            more = self.on_payload()
            if self.stopped:
                return True
            if more is WAIT:  # the owner cannot take more of this payload yet
                self._waiting = True
                return False
            if more is not None:
                assert isinstance(more, tuple)
                decoder.land_payload(*more)
                return False
            decoder.end_payload()
        elif isinstance(event, wire.Error):
            self._frame_over()
            self.on_error(event)
            return True
        elif isinstance(event, (wire.Ack, wire.Safe)):
            assert self.on_count is not None
            if isinstance(event, wire.Ack):
                self.on_count(wire.FrameType.ACK, event.results)
            else:
                self.on_count(wire.FrameType.SAFE, event.frames)
        self._frame_over()
        return True

    def _frame_over(self) -> None:
        wanted, self._lowat_after_frame = self._lowat_after_frame, 1
        if self.lowat != wanted and not self.stopped:
            self._set_lowat(wanted)

    def release(self) -> None:
        """The connection is closed: drop the receive buffer and the owner's callbacks. The
        callbacks refer back to the owner, which refers to this reader; without this the pair
        (and the pool buffer the decoder's target views) would wait for the cyclic garbage
        collector, which an idle reducer may not run for a long time."""
        self.stopped = True
        self.decoder.release()
        if self.fast is not None:
            self.fast.release()
        self.on_fast = None
        self.on_header = self.on_payload = self.on_error = _closed_callback  # type: ignore[assignment]
        self.on_count = None

    def expect_at_least(self, nbytes: int) -> None:
        """Called from ``on_payload`` as a frame ends: the owner knows that at least ``nbytes``
        more will come (the rest of a result sent in pieces, headers not counted), so the loop
        need not wake before they are in. Whatever comes instead (an ERROR, a heartbeat) is
        smaller and wakes nobody: the owner must ``read`` connections whose ``lowat`` is raised
        now and then."""
        if nbytes >= _LOWAT_FROM:
            self._lowat_after_frame = min(nbytes, self.max_lowat)

    @property
    def payload_received(self) -> int:
        """Bytes of the current data frame's payload target received so far (0 between payloads)."""
        if self._fast_views and self.fast.busy:
            return int(self.fast.landed)
        return self.decoder.landed

    def _set_lowat(self, nbytes: int) -> None:
        if self.lowat != nbytes:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
            self.lowat = nbytes


def _closed_callback(*_args: object) -> None:
    raise ConnectionBroken("eof", "the connection is closed")


class Waker:
    """Wakes an event loop from another thread: a socket pair whose read end the loop watches."""

    def __init__(self) -> None:
        self.read_end, self._write_end = socket.socketpair()
        self.read_end.setblocking(False)
        self._write_end.setblocking(False)

    def wake(self) -> None:
        try:
            self._write_end.send(b"\0")
        except OSError:
            pass  # full (a wake-up is already pending) or closed (the loop is gone)

    def drain(self) -> None:
        """On the loop, once woken."""
        try:
            while self.read_end.recv(4096):
                pass
        except OSError:
            pass

    def close(self) -> None:
        self.read_end.close()
        self._write_end.close()


def watch(selector: selectors.BaseSelector, sock: socket.socket, data: object, current: int, events: int) -> int:
    """Make ``selector`` watch ``sock`` for ``events`` (0: not at all) instead of ``current``, with
    ``data`` as the key's data. Returns ``events``, the new ``current``."""
    if events != current:
        if current == 0:
            selector.register(sock, events, data)
        elif events == 0:
            selector.unregister(sock)
        else:
            selector.modify(sock, events, data)
    return events


#: A frame's bytes, or a callable that produces them when the frame is about to be written (a
#: float32 -> bfloat16 conversion then runs on the writing thread, next to the write).
Views = list[memoryview] | Callable[[], list[memoryview]]


@dataclass
class _Outgoing:
    views: Views
    done: Callable[[bool], None] | None


class FrameWriter:
    """The write side of a non-blocking connection: frames go out in order, straight from the
    callers' buffers (``sendmsg``, no concatenation). Not thread-safe; its owner serialises
    calls. ``send`` and ``flush`` never block: what the socket does not take waits in ``out``
    until the owner's loop sees the socket writable and calls ``flush``.

    ``done(ok)`` callbacks are not run here but returned, for the owner to run outside whatever
    lock it holds (they may start the next frame)."""

    __slots__ = ("sock", "peer", "out", "last_send", "last_progress")

    def __init__(self, sock: socket.socket, now: float) -> None:
        self.sock = sock
        self.peer = peer_name(sock)
        self.out: collections.deque[_Outgoing] = collections.deque()
        self.last_send = now  # the last time anything was written (heartbeats are due after a pause)
        self.last_progress = now  # the last time a queued frame moved (a peer that stopped reading)

    @property
    def queued(self) -> int:
        """How many frames wait (the frame being written first)."""
        return len(self.out)

    def send(self, views: Views, done: Callable[[bool], None] | None, now: float, finished: list[Callable[[bool], None]],
             *, ahead: bool = False, defer: bool = False) -> None:
        """Write a frame now if nothing is queued ahead of it, else queue it: last, or with
        ``ahead`` right behind the frame being written (a small control frame that must not wait
        for megabytes of data). ``defer``: queue it even when nothing is ahead, for the owner's
        loop to write (``flush``). Appends ``done`` to ``finished`` when the frame is out. Raises
        :class:`ConnectionBroken`."""
        if self.out:
            if ahead:
                self.out.insert(1, _Outgoing(views, done))
            else:
                self.out.append(_Outgoing(views, done))
            return
        if defer:
            self.out.append(_Outgoing(views, done))
            self.last_progress = now  # a frame waits from now: the stall deadline counts from here
            return
        rest = send_views(self.sock, views() if callable(views) else views, _DONTWAIT, self.peer)
        self.last_send = now
        if rest:
            self.out.append(_Outgoing(rest, done))
            self.last_progress = now
        elif done is not None:
            finished.append(done)

    def flush(self, now: float, finished: list[Callable[[bool], None]]) -> None:
        """Write queued frames until the socket is full or nothing is left."""
        out = self.out
        while out:
            item = out[0]
            if callable(item.views):
                item.views = item.views()  # made once, even if this write fails
            views = item.views
            before = (len(views), len(views[0])) if views else (0, 0)  # what is left only shrinks
            rest = send_views(self.sock, views, _DONTWAIT, self.peer)
            if rest:
                if (len(rest), len(rest[0])) != before:
                    self.last_progress = self.last_send = now
                item.views = rest
                return
            out.popleft()
            self.last_progress = self.last_send = now
            if item.done is not None:
                finished.append(item.done)

    def finish_frame(self, deadline: float) -> tuple[bool, list[tuple[Callable[[bool], None], bool]]]:
        """For a last frame (a client's goodbye): write the rest of the frame being written,
        blocking until ``deadline`` at most, and drop the frames queued behind it. Returns whether
        the connection is now between frames, and the callbacks to run with their ``ok``. Leaves
        the socket blocking: the caller restores what it needs."""
        callbacks = [(item.done, False) for item in list(self.out)[1:] if item.done is not None]
        while len(self.out) > 1:
            self.out.pop()
        if not self.out:
            return True, callbacks
        item = self.out[0]
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False, callbacks
        try:
            self.sock.settimeout(remaining)
            send_views(self.sock, list(item.views() if callable(item.views) else item.views), 0, self.peer)
        except (ConnectionBroken, OSError):
            return False, callbacks
        self.out.popleft()
        if item.done is not None:
            callbacks.append((item.done, True))
        return True, callbacks

    def abandon(self) -> list[Callable[[bool], None]]:
        """The connection is gone: the ``done`` callbacks of everything still queued."""
        leftovers = [item.done for item in self.out if item.done is not None]
        self.out.clear()
        return leftovers


def send_views(sock: socket.socket, views: list[memoryview], flags: int, peer: str) -> list[memoryview]:
    """Write ``views`` with ``sendmsg`` (header and payload without a concatenation copy). With
    ``MSG_DONTWAIT`` stop when the socket buffer is full and return what is left; a blocking
    write returns only when everything is written, or raises once the send timeout passed."""
    while views:
        try:
            sent = sock.sendmsg(views, [], flags)
        except OSError as exc:
            if exc.errno in _TIMED_OUT:
                if flags & _DONTWAIT:
                    return views
                raise ConnectionBroken("timeout", f"{peer} stopped reading: send timed out") from None
            raise ConnectionBroken("reset", f"sending to {peer} failed: {exc}") from None
        while sent:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0
        while views and not len(views[0]):
            views.pop(0)
        if views and flags & _DONTWAIT:
            # A short write: the socket buffer is full, and another sendmsg now would only fail
            # with EAGAIN (a system call and an exception for nothing). The poll says when it drained.
            return views
    return views
