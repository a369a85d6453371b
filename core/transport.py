"""Blocking sockets for the client and for handshakes: framed reads straight into caller buffers,
and a sender thread per connection (the reducer serves joined connections from its own loop).

The only module besides the daemon and client entry points that touches the network. Every
blocking call has a deadline: reads time out after the heartbeat bound (a silent peer is
frozen), sends after the send timeout (a peer that stopped reading).

Sockets stay in blocking mode with kernel timeouts (``SO_RCVTIMEO``/``SO_SNDTIMEO``) rather than
Python's poll-then-read timeouts, so a chunk's payload arrives in one ``recv_into(...,
MSG_WAITALL)`` call and one thread wake-up instead of one per batch of network segments.
"""

from __future__ import annotations

import collections
import errno
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from . import wire
from .constants import DEFAULT_MAX_FRAME_PAYLOAD
from .errors import RemoteProtocolError

__all__ = ["FramedSocket", "Sender", "ConnectionBroken", "configure_socket", "set_kernel_timeout", "set_send_lowat",
           "set_congestion_control", "choose_congestion_control", "congestion_control", "send_views"]


class ConnectionBroken(Exception):
    """Internal: the connection ended. ``kind`` is 'eof', 'timeout', 'reset' or 'protocol'."""

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


#: Largest piece received in one MSG_WAITALL call: bounds how long one call may run on a slow
#: link, so a partial read is reported and the deadline re-armed, never a false "frozen peer".
_RECV_PIECE = 4 * 1024 * 1024
_TIMED_OUT = (errno.EAGAIN, errno.EWOULDBLOCK)
#: Payload pieces from this size are received with a low-water mark (see ``_recv_into``).
_LOWAT_FROM = 64 * 1024


def peer_name(sock: socket.socket) -> str:
    try:
        address = sock.getpeername()
    except OSError:
        return "?"
    if not isinstance(address, tuple):  # a Unix socket (tests use socket pairs)
        return str(address) or "local"
    host, port = address[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class FramedSocket:
    """Reads frames from a socket with the sans-IO functions in :mod:`wire`.

    Headers go into a preallocated buffer; payloads go wherever the caller says (``recv_into``
    straight into the result array), so steady-state receiving allocates nothing.
    """

    def __init__(self, sock: socket.socket, *, read_timeout: float, max_payload: int = DEFAULT_MAX_FRAME_PAYLOAD) -> None:
        self.sock = sock
        self.peer = peer_name(sock)
        self.max_payload = max_payload
        self._header_buf = bytearray(wire.PREFIX.size + wire.MAX_HEADER_SIZE)
        self._header_view = memoryview(self._header_buf)
        self._discard = bytearray(256 * 1024)
        self._poller: select.poll | None = None
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            self._poller = select.poll()
            self._poller.register(sock, select.POLLIN)
        configure_socket(sock)
        self.set_read_timeout(read_timeout)
        # Handshake writes go straight to the socket; the Sender re-arms this for data.
        set_kernel_timeout(sock, socket.SO_SNDTIMEO, read_timeout)

    def set_read_timeout(self, timeout: float) -> None:
        self._read_timeout_ms = max(1, int(timeout * 1000))
        set_kernel_timeout(self.sock, socket.SO_RCVTIMEO, timeout)

    def _recv_into(self, view: memoryview, what: str, *, wake_when_all_in: bool = False) -> None:
        got = 0
        n = len(view)
        while got < n:
            piece = min(n - got, _RECV_PIECE)
            try:
                if wake_when_all_in and self._poller is not None and piece >= _LOWAT_FROM:
                    self._wait_until_queued(piece, what)
                r = self.sock.recv_into(view[got:], piece, socket.MSG_WAITALL)
            except OSError as exc:
                if exc.errno in _TIMED_OUT:
                    raise ConnectionBroken("timeout", f"no data from {self.peer} while reading {what}") from None
                raise ConnectionBroken("reset", f"connection to {self.peer} failed while reading {what}: {exc}") from None
            if r == 0:
                raise ConnectionBroken("eof", f"{self.peer} closed the connection" + (f" in the middle of {what}" if got or what != "a frame" else ""))
            got += r

    def _wait_until_queued(self, nbytes: int, what: str) -> None:
        """Sleep until ``nbytes`` wait in the kernel's receive queue, with one wake-up.

        A blocking read is woken for every few segments that arrive, copies them and sleeps
        again: most of the context switches of a reducer at n=4. A low-water mark makes the
        kernel wake a poller only once the bytes are in; the read that follows then copies them
        in one go. (A read cannot wait on the mark itself: it consumes as it goes, so what is
        left to arrive would never reach the mark.) Reset after, or a small header would never
        wake the reader."""
        assert self._poller is not None
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
        try:
            ready = self._poller.poll(self._read_timeout_ms)
        finally:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
        if not ready:
            raise ConnectionBroken("timeout", f"no data from {self.peer} while reading {what}")

    def read_header(self) -> wire.FrameHeader:
        prefix = self._header_view[: wire.PREFIX.size]
        self._recv_into(prefix, "a frame")
        try:
            frame_type, header_len, payload_len = wire.parse_prefix(prefix, self.max_payload)
        except RemoteProtocolError as exc:
            raise ConnectionBroken("protocol", str(exc)) from None
        header = self._header_view[wire.PREFIX.size : wire.PREFIX.size + header_len]
        self._recv_into(header, f"a {frame_type.name} header")
        try:
            return wire.parse_header(frame_type, header, payload_len)
        except RemoteProtocolError as exc:
            raise ConnectionBroken("protocol", str(exc)) from None

    def read_into(self, view: memoryview, what: str = "a payload") -> None:
        self._recv_into(view, what, wake_when_all_in=True)

    def read_bytes(self, n: int, what: str = "a payload") -> bytes:
        buf = bytearray(n)
        self._recv_into(memoryview(buf), what)
        return bytes(buf)

    def discard(self, n: int) -> None:
        view = memoryview(self._discard)
        while n > 0:
            step = min(n, len(view))
            self._recv_into(view[:step], "a discarded payload")
            n -= step

    def read_frame(self) -> wire.Frame:
        """A whole frame, payload copied (control path only)."""
        header = self.read_header()
        payload = self.read_bytes(header.payload_len) if header.payload_len else b""
        try:
            return wire.parse_payload(header, payload)
        except RemoteProtocolError as exc:
            raise ConnectionBroken("protocol", str(exc)) from None


@dataclass
class _Item:
    header: bytes
    payload: memoryview | Callable[[], memoryview] | None
    nbytes: int
    done: Callable[[bool], None] | None
    rest: list[memoryview] | None = None  # what an inline send left over, sent before anything else


class Sender:
    """One thread that writes queued frames to a socket, in order.

    Sends a heartbeat whenever nothing was written for ``heartbeat_interval``. Payloads are
    memoryviews written with ``sendmsg`` next to their header (no concatenation copy), or
    callables that produce the view on this thread (e.g. a float32 -> bfloat16 conversion, which
    then overlaps with sending the previous chunk). ``unsent_bytes`` drives least-loaded dispatch.
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        name: str,
        heartbeat_interval: float,
        send_timeout: float,
        on_error: Callable[[ConnectionBroken], None],
    ) -> None:
        # A duplicate descriptor carries its own timeout: long for sends (a peer applying
        # backpressure is legitimate for a while), short for the reader's heartbeat bound.
        self._sock = sock.dup()
        self._sock.settimeout(None)
        set_kernel_timeout(self._sock, socket.SO_SNDTIMEO, send_timeout)
        self.peer = peer_name(sock)
        self._heartbeat_interval = heartbeat_interval
        self._heartbeat = wire.encode(wire.Heartbeat())
        self._queue: collections.deque[_Item] = collections.deque()
        self._cond = threading.Condition()
        self._writing = False  # someone (the thread, or a caller inline) owns the socket's write side
        self._last_send = time.monotonic()
        self._closing = False
        self._close_after_drain = False
        self._on_error = on_error
        self.unsent_bytes = 0
        self.failed: ConnectionBroken | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def send(self, header: bytes, payload: memoryview | Callable[[], memoryview] | None = None, nbytes: int = 0,
             done: Callable[[bool], None] | None = None, *, inline: bool = False) -> None:
        """Queue a frame. ``done(ok)`` runs once the payload is no longer needed (``ok`` False
        when the connection failed first).

        ``inline=True``: when nothing is queued, write from the calling thread without blocking
        (``MSG_DONTWAIT``) and hand only a remainder to the sender thread. This saves a thread
        hand-off per frame, which dominated the reducer's CPU time per chunk.
        """
        item = _Item(header, payload, nbytes, done)
        fast = False
        with self._cond:
            if self._closing or self.failed is not None:
                failed = True
            else:
                failed = False
                if inline and not self._queue and not self._writing and not callable(payload):
                    self._writing = fast = True
                else:
                    self._queue.append(item)
                    self._cond.notify()
                self.unsent_bytes += len(header) + nbytes
        if failed:
            if done is not None:
                done(False)
            return
        if fast:
            self._send_inline(item)

    def _send_inline(self, item: _Item) -> None:
        assert not callable(item.payload)
        views = [memoryview(item.header).cast("B")] + ([] if item.payload is None else [memoryview(item.payload).cast("B")])
        try:
            rest = self._write(views, socket.MSG_DONTWAIT)
        except ConnectionBroken as exc:
            with self._cond:
                self._writing = False
                self.failed = exc
                self._closing = True
                self._cond.notify()
            if item.done is not None:
                item.done(False)
            self._on_error(exc)
            return
        with self._cond:
            self._writing = False
            self._last_send = time.monotonic()
            if rest:
                item.rest = rest
                self._queue.appendleft(item)
                self._cond.notify()
            else:
                self.unsent_bytes -= len(item.header) + item.nbytes
                if self._queue or self._close_after_drain:
                    self._cond.notify()  # frames queued meanwhile wait for us; otherwise let it sleep
        if not rest and item.done is not None:
            item.done(True)

    def close_after_drain(self) -> None:
        """Send what is queued, then stop (used for a final error frame)."""
        with self._cond:
            self._close_after_drain = True
            self._cond.notify()

    def stop(self) -> None:
        """Stop now; queued items complete with ``done(False)``."""
        with self._cond:
            self._closing = True
            self._cond.notify()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        try:
            self._sock.close()
        except OSError:
            pass

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while (self._writing or not self._queue) and not self._closing:
                        if self._close_after_drain and not self._writing:
                            break
                        remaining = self._last_send + self._heartbeat_interval - time.monotonic()
                        if remaining <= 0 and not self._writing:
                            break
                        self._cond.wait(remaining if remaining > 0 else self._heartbeat_interval)
                    if self._closing:
                        return
                    if not self._queue and self._close_after_drain:
                        self._shutdown_write()
                        return
                    item = self._queue.popleft() if self._queue else None
                    self._writing = True  # from here until the frame is out, no inline writer
                if item is None:
                    self._sendall([self._heartbeat])
                    with self._cond:
                        self._writing = False
                else:
                    ok = False
                    try:
                        if item.rest is not None:
                            self._sendall(item.rest)
                        else:
                            payload = item.payload() if callable(item.payload) else item.payload
                            self._sendall([item.header] if payload is None else [item.header, payload])
                        ok = True
                    finally:
                        with self._cond:
                            self._writing = False
                            self.unsent_bytes -= len(item.header) + item.nbytes
                        if item.done is not None:
                            item.done(ok)
                self._last_send = time.monotonic()
        except ConnectionBroken as exc:
            self.failed = exc
            self._on_error(exc)
        finally:
            with self._cond:
                self._closing = True
                leftovers = list(self._queue)
                self._queue.clear()
                self.unsent_bytes = 0
            for item in leftovers:
                if item.done is not None:
                    item.done(False)

    def _shutdown_write(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def _sendall(self, parts: list) -> None:  # type: ignore[type-arg]
        self._write([memoryview(p).cast("B") for p in parts], 0)

    def _write(self, views: list[memoryview], flags: int) -> list[memoryview]:
        return send_views(self._sock, views, flags, self.peer)


def send_views(sock: socket.socket, views: list[memoryview], flags: int, peer: str) -> list[memoryview]:
    """Write ``views`` with ``sendmsg`` (header and payload without a concatenation copy). With
    ``MSG_DONTWAIT`` stop when the socket buffer is full and return what is left; a blocking
    write returns only when everything is written, or raises once the send timeout passed."""
    while views:
        try:
            sent = sock.sendmsg(views, [], flags)
        except OSError as exc:
            if exc.errno in _TIMED_OUT:
                if flags & socket.MSG_DONTWAIT:
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
    return views
