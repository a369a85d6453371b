"""The elastic rendezvous on the wire: a small HTTP service the driver (``redsrv run --min-np``)
runs, and the client a worker uses to ask for its place in the next world and, at a commit,
whether newcomers wait. The decisions are :class:`~redsrv.core.membership.Membership`'s; this
module only carries them.

Requests and answers are small JSON objects (never pickle), each request signed with the job's
secret (HMAC-SHA256, compared in constant time), so only the job's own workers can take a place
or end a world. The server binds loopback: elastic workers run on the driver's machine. Every
call has a deadline: a request is held at most ``poll`` seconds (then answered "not yet" and
asked again), and a worker gives up after its elastic timeout with :class:`PeerTimeoutError`;
a driver that is gone is :class:`PeerLostError`.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from . import constants as C
from .config import parse_address
from .errors import PeerLostError, PeerTimeoutError
from .membership import Assignment, Membership

__all__ = ["RendezvousServer", "RendezvousClient", "sign"]

_SIGNATURE_HEADER = "X-Redsrv-Signature"
#: Requests are a few dozen bytes; anything much larger is not one of ours.
_MAX_BODY_BYTES = 4096


def sign(secret: bytes, body: bytes) -> str:
    """The signature a request carries: HMAC-SHA256 of the body under the job's secret, with a
    label so that it can never be taken for a signature of the reducers' handshake."""
    return hmac.new(secret, b"redsrv-rendezvous\0" + body, hashlib.sha256).hexdigest()


class RendezvousServer:
    """Serves ``membership`` on ``host``:(a free port) until :meth:`close`. ``on_formed(epoch)``
    is called (on a request thread) each time a new world forms."""

    def __init__(self, membership: Membership, secret: bytes, *, host: str = "127.0.0.1",
                 poll: float = C.RENDEZVOUS_POLL_S, on_formed: Callable[[int], None] | None = None) -> None:
        self.membership = membership
        self.changed = threading.Condition()
        self._secret = secret
        self._poll = poll
        self._on_formed = on_formed
        self._closed = False
        self._http = ThreadingHTTPServer((host, 0), _handler_for(self))
        self._http.daemon_threads = True
        self._thread = threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="redsrv-rendezvous", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        host, port = self._http.server_address[:2]
        return f"{host!s}:{port}"  # an IPv4 bind: host is a str

    def exited(self, worker: str, status: int) -> None:
        """The driver saw ``worker``'s process end."""
        with self.changed:
            formed = self.membership.exited(worker, status)
            self.changed.notify_all()
        if formed:
            self._formed()

    def started(self, worker: str) -> None:
        with self.changed:
            self.membership.started(worker)

    def close(self) -> None:
        with self.changed:
            self._closed = True
            self.changed.notify_all()
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(C.DEFAULT_CLOSE_TIMEOUT_S)

    def _formed(self) -> None:
        if self._on_formed is not None:
            self._on_formed(self.membership.epoch)

    def answer(self, path: str, request: dict[str, Any]) -> dict[str, Any]:
        """The answer to one verified request."""
        if path not in ("/join", "/commit"):
            raise KeyError(path)
        if not isinstance(request, dict) or not {"worker", "epoch"} <= request.keys():
            raise ValueError("a request names its worker and epoch")
        worker, epoch = str(request["worker"]), int(request["epoch"])
        if path == "/commit":
            with self.changed:
                return {"hosts_updated": self.membership.hosts_updated(epoch)}
        deadline = time.monotonic() + self._poll
        formed_here = False
        with self.changed:
            while True:
                assigned, formed = self.membership.join(worker, epoch)
                formed_here |= formed
                if formed:
                    self.changed.notify_all()
                left = deadline - time.monotonic()
                if assigned is not None or self.membership.finished or self._closed or left <= 0:
                    break
                self.changed.wait(left)
        if formed_here:
            self._formed()
        if assigned is None:
            return {"finished": self.membership.finished or self._closed}
        return {"epoch": assigned.epoch, "rank": assigned.rank, "size": assigned.size, "job": assigned.job}


def _handler_for(server: RendezvousServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = C.DEFAULT_HANDSHAKE_TIMEOUT_S  # a client that stops sending mid-request is dropped

        def do_POST(self) -> None:  # noqa: N802 - the name http.server calls
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= _MAX_BODY_BYTES:
                self._reply(413, {"error": f"a request is 1..{_MAX_BODY_BYTES} bytes"})
                return
            body = self.rfile.read(length)
            if not hmac.compare_digest(self.headers.get(_SIGNATURE_HEADER, ""), sign(server._secret, body)):
                self._reply(403, {"error": "bad signature: not a worker of this job"})
                return
            try:
                request = json.loads(body)
                self._reply(200, server.answer(self.path, request))
            except KeyError:
                self._reply(404, {"error": f"no such call {self.path!r}"})
            except (ValueError, TypeError) as exc:
                self._reply(400, {"error": str(exc)})

        def _reply(self, status: int, answer: dict[str, Any]) -> None:
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
            pass  # every request is routine; failures reach the worker as errors

    return Handler


class RendezvousClient:
    """A worker's side: ``address`` is the driver's rendezvous (``REDSRV_RENDEZVOUS``)."""

    def __init__(self, address: str, worker: str, secret: bytes, *, poll: float = C.RENDEZVOUS_POLL_S,
                 connect_timeout: float = C.DEFAULT_CONNECT_TIMEOUT_S) -> None:
        self.host, self.port = parse_address(address)
        self.address = address
        self.worker = worker
        self._secret = secret
        self._timeout = poll + connect_timeout  # the server holds a request up to ``poll``

    def join(self, after_epoch: int, *, timeout: float) -> Assignment:
        """This worker's place in the first world after ``after_epoch``; waits for it to form
        up to ``timeout`` seconds."""
        start = time.monotonic()
        while True:
            answer = self._call("/join", after_epoch)
            if "epoch" in answer:
                return Assignment(int(answer["epoch"]), int(answer["rank"]), int(answer["size"]), str(answer["job"]))
            elapsed = time.monotonic() - start
            if answer.get("finished"):
                raise PeerLostError(f"elastic job has ended: worker {self.worker} gets no place after epoch {after_epoch}",
                                    peer=self.address, phase="rendezvous", elapsed=elapsed)
            if elapsed >= timeout:
                raise PeerTimeoutError(f"no world formed with worker {self.worker} after epoch {after_epoch} (too few "
                                       "workers alive for --min-np?)", peer=self.address, phase="rendezvous",
                                       elapsed=elapsed, timeout=timeout)

    def hosts_updated(self, epoch: int) -> bool:
        """Whether newcomers wait to join the world of ``epoch`` (asked by its rank 0 at a commit)."""
        return bool(self._call("/commit", epoch).get("hosts_updated"))

    def _call(self, path: str, epoch: int) -> dict[str, Any]:
        body = json.dumps({"worker": self.worker, "epoch": epoch}).encode()
        connection = http.client.HTTPConnection(self.host, self.port, timeout=self._timeout)
        started = time.monotonic()
        try:
            connection.request("POST", path, body, {_SIGNATURE_HEADER: sign(self._secret, body),
                                                    "Content-Type": "application/json"})
            response = connection.getresponse()
            data = response.read(_MAX_BODY_BYTES + 1)
        except TimeoutError:
            raise PeerTimeoutError(f"the elastic rendezvous did not answer {path}", peer=self.address,
                                   phase="rendezvous", elapsed=time.monotonic() - started, timeout=self._timeout) from None
        except OSError as exc:
            raise PeerLostError(f"cannot reach the elastic rendezvous ({exc}): the driver (redsrv run) is gone",
                                peer=self.address, phase="rendezvous") from None
        finally:
            connection.close()
        if response.status != 200:
            raise PeerLostError(f"the elastic rendezvous refused {path} with {response.status}: {data[:200]!r}",
                                peer=self.address, phase="rendezvous")
        answer = json.loads(data)
        if not isinstance(answer, dict):
            raise PeerLostError(f"the elastic rendezvous answered {path} with {data[:200]!r}", peer=self.address,
                                phase="rendezvous")
        return answer
