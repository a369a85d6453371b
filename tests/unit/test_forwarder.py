"""The native forwarder (``native/forward.c``) against the state machine's rule (``_ResultRules._forward``).

A forwarder is told each rank's landed bytes in a Hypothesis-made order and writes RESULT frames
to each rank's socket pair through the native frame writer. A model of ``_forward``'s rule, with
the sums from the reference kernels (NumPy, in rank order), says which pieces must leave and what
they hold; every rank's peer must read exactly those frames, the connection counters must count
them, and every reference taken on the result's buffer must be given back. Float data, so a sum
in another order gives other bytes."""

from __future__ import annotations

import contextlib
import socket
from array import array
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from redsrv.core import plane
from redsrv.core.transport import ConnectionBroken
from redsrv.core.wire import DType, ReduceOp, bitmap_from_ranks, result_header_of

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(plane.native_unavailable() is not None, reason="the native plane is not built")]

KINDS = {DType.FLOAT32: np.float32, DType.FLOAT64: np.float64, DType.INT64: np.int64}


def _kernels() -> Any:
    return plane.kernels_for("native")


def _read_all(sock: socket.socket) -> bytes:
    got = bytearray()
    with contextlib.suppress(BlockingIOError):
        while chunk := sock.recv(1 << 20):
            got += chunk
    return bytes(got)


class _Refs:
    """retain(k) and done(ok) as a _SharedBuffer's retain and release are called."""

    def __init__(self) -> None:
        self.held = 0
        self.failed = 0

    def retain(self, count: int) -> None:
        self.held += count

    def done(self, ok: bool) -> None:
        self.held -= 1
        self.failed += not ok


class _Setup:
    def __init__(self, world: int, kind: DType, op: ReduceOp, count: int, piece_items: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        dtype = np.dtype(KINDS[kind])
        if dtype.kind == "f":
            self.inputs = [rng.standard_normal(count).astype(dtype) for _ in range(world)]
        else:
            self.inputs = [rng.integers(-1000, 1000, count).astype(dtype) for _ in range(world)]
        self.parts = [np.array(x) for x in self.inputs]  # the forwarder sums into parts[0]
        self.world, self.kind, self.op, self.item = world, kind, op, dtype.itemsize
        self.size, self.piece = count * dtype.itemsize, piece_items * dtype.itemsize
        self.pairs = [socket.socketpair() for _ in range(world)]
        for a, b in self.pairs:
            a.setblocking(False)
            b.setblocking(False)
            b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
            a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 22)
        self.writers = [_kernels().frame_writer(a, 0.0) for a, _ in self.pairs]
        self.counters = [array("q", [0]) for _ in range(world)]
        self.queued: list[int] = []
        self.broken: list[tuple[int, BaseException]] = []
        self.refs = _Refs()
        everyone = bitmap_from_ranks((1 << world) - 1, world)
        self.everyone = everyone
        item = self.item

        def header(start: int, stop: int) -> bytes:
            return result_header_of(7, 100 + start // item, (stop - start) // item, 3, kind, world, everyone, stop - start)

        self.header = header
        targets = [(self.writers[r], self.counters[r], (lambda r=r: self.queued.append(r)),
                    (lambda exc, r=r: self.broken.append((r, exc)))) for r in range(world)]
        # The buffers as they are (typed): the forwarder counts and slices them in bytes.
        self.forwarder = _kernels().forwarder(self.parts, self.size, self.item, int(kind),
                                              int(op), self.piece, 0, [0] * world, header, self.refs.retain,
                                              self.refs.done, targets)

    def close(self) -> None:
        self.forwarder.cancel()
        for a, b in self.pairs:
            a.close()
            b.close()

    def expected(self, landings: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The pieces _forward's rule sends for these landings, in order."""
        received, forwarded, pieces = [0] * self.world, 0, []
        for rank, upto in landings:
            if upto > self.size or upto <= received[rank]:
                continue
            received[rank] = upto
            ready = min(received)
            ready -= ready % self.item
            if ready > forwarded and (ready == self.size or ready - forwarded >= self.piece):
                pieces.append((forwarded, ready))
                forwarded = ready
        return pieces

    def frames(self, pieces: list[tuple[int, int]]) -> bytes:
        kernels = plane.kernels_for("python")
        total = self.inputs[0].copy()
        for x in self.inputs[1:]:
            kernels.combine(self.op, total, x)
        raw = total.view(np.uint8)
        return b"".join(self.header(a, b) + raw[a:b].tobytes() for a, b in pieces)


@st.composite
def _cases(draw: st.DrawFn) -> tuple[int, DType, ReduceOp, int, int, list[tuple[int, int]], int]:
    world = draw(st.integers(1, 4))
    kind = draw(st.sampled_from(list(KINDS)))
    op = draw(st.sampled_from([ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]))
    count = draw(st.integers(1, 3000))
    piece = draw(st.integers(1, 1200))
    item = np.dtype(KINDS[kind]).itemsize
    size = count * item
    # Each rank's landings rise to its end (a push lands whole in the end), with bytes beyond the
    # chunk and repeats mixed in, which the forwarder must ignore.
    landings: list[tuple[int, int]] = []
    ends = {r: sorted(draw(st.lists(st.integers(0, size), max_size=6))) + [size] for r in range(world)}
    order = draw(st.permutations([(r, i) for r in range(world) for i in range(len(ends[r]))]))
    seen = {r: 0 for r in range(world)}
    for r, _ in order:  # each rank's own landings keep their order
        landings.append((r, ends[r][seen[r]]))
        seen[r] += 1
        if draw(st.booleans()) and draw(st.booleans()):
            landings.append((r, size + draw(st.integers(1, 64))))
    return world, kind, op, count, piece, landings, draw(st.integers(0, 2**32 - 1))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_every_rank_reads_the_frames_the_state_machines_rule_sends(case) -> None:  # type: ignore[no-untyped-def]
    world, kind, op, count, piece, landings, seed = case
    setup = _Setup(world, kind, op, count, piece, seed)
    try:
        for rank, upto in landings:
            setup.forwarder.landed(rank, upto)
        pieces = setup.expected(landings)
        assert pieces and pieces[-1][1] == setup.size  # every rank landed its end: the chunk is sent whole
        assert setup.forwarder.forwarded == setup.size
        want = setup.frames(pieces)
        for rank, (_, peer) in enumerate(setup.pairs):
            assert _read_all(peer) == want, f"rank {rank}"
            assert setup.counters[rank][0] == len(pieces)
        assert setup.forwarder.take_bytes_out() == world * setup.size
        assert setup.forwarder.take_bytes_out() == 0
        assert setup.refs.held == 0 and setup.refs.failed == 0  # every frame went out whole and gave its reference back
        assert setup.queued == [] and setup.broken == []
    finally:
        setup.close()


def test_a_frame_that_waits_in_a_writer_is_said_and_keeps_its_reference_until_flushed() -> None:
    setup = _Setup(2, DType.FLOAT32, ReduceOp.SUM, 400_000, 100_000, 1)
    try:
        for a, _ in setup.pairs:
            a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        setup.forwarder.landed(0, setup.size)
        setup.forwarder.landed(1, setup.size // 2)  # two pieces of 400 kB each are due
        assert setup.forwarder.forwarded == setup.size // 2
        assert setup.queued == [0, 1]  # neither socket took its frame whole
        assert setup.refs.held == 2
        for rank, (_, peer) in enumerate(setup.pairs):
            finished: list[Any] = []
            got = bytearray()
            while setup.writers[rank].out:
                got += _read_all(peer)
                setup.writers[rank].flush(0.0, finished)
            got += _read_all(peer)
            for done in finished:
                done(True)
            assert bytes(got) == setup.frames([(0, setup.size // 2)])
        assert setup.refs.held == 0
    finally:
        setup.close()


def test_a_write_that_fails_drops_that_rank_only_and_is_told() -> None:
    setup = _Setup(3, DType.FLOAT64, ReduceOp.SUM, 1000, 100, 2)
    try:
        setup.pairs[1][1].close()  # rank 1's worker went away
        setup.pairs[1][0].shutdown(socket.SHUT_WR)
        for rank in range(3):
            setup.forwarder.landed(rank, setup.size)
        assert [r for r, _ in setup.broken] == [1]
        assert isinstance(setup.broken[0][1], ConnectionBroken)
        want = setup.frames([(0, setup.size)])
        assert _read_all(setup.pairs[0][1]) == want and _read_all(setup.pairs[2][1]) == want
        assert setup.refs.held == 0 and setup.refs.failed == 1
        # Counted for every connection it was sent to, as _send_piece counts before it sends.
        assert setup.forwarder.take_bytes_out() == 3 * setup.size
        assert setup.forwarder.active
    finally:
        setup.close()


def test_after_cancel_nothing_is_forwarded_and_the_buffers_are_let_go() -> None:
    setup = _Setup(2, DType.FLOAT32, ReduceOp.SUM, 1000, 100, 3)
    try:
        setup.forwarder.landed(0, setup.size)
        setup.forwarder.landed(1, 400)
        assert setup.forwarder.forwarded == 400
        setup.forwarder.cancel()
        assert not setup.forwarder.active
        setup.forwarder.landed(1, setup.size)
        assert setup.forwarder.forwarded == 400
        assert setup.forwarder.received == ()  # its buffers and callbacks are let go
    finally:
        setup.close()


def test_what_it_refuses() -> None:
    kernels = _kernels()
    buf = np.zeros(16, np.float32)
    sock = socket.socket()
    target = (kernels.frame_writer(sock, 0.0), array("q", [0]), print, print)
    ok = dict(parts=[buf], size=64, itemsize=4, kind=int(DType.FLOAT32), op=int(ReduceOp.SUM), piece=8, forwarded=0,
              received=[0], header=print, retain=print, done=print, targets=[target])
    kernels.forwarder(**ok).cancel()
    for change in ({"size": 65}, {"size": 128}, {"itemsize": 8}, {"op": int(ReduceOp.BAND)}, {"piece": 0},
                   {"forwarded": 68}, {"received": [0, 0]}, {"targets": [target, None]}, {"kind": 99}):
        with pytest.raises(ValueError):
            kernels.forwarder(**{**ok, **change})
    with pytest.raises(ValueError):
        kernels.forwarder(**{**ok, "targets": [(target[0], array("i", [0]), print, print)]})
    with pytest.raises(TypeError):
        kernels.forwarder(**{**ok, "header": None})
    with pytest.raises(BufferError):
        kernels.forwarder(**{**ok, "parts": [bytes(64)]})
    receiver = kernels.push_receiver(0, 1 << 20, 1 << 20, print, print, print, object(), object())
    with pytest.raises(TypeError):
        receiver.feed = (object(), 0)
    forwarder = kernels.forwarder(**ok)
    receiver.feed = (forwarder, 0)
    assert receiver.feed == (forwarder, 0)
    receiver.feed = None
    assert receiver.feed is None
    forwarder.cancel()
    sock.close()
