"""ClientCore, the worker client's decisions, driven without a network: events in, actions out.

A small scripted reducer stands in for the fleet: it takes the pushes the core asks to send and
answers with the rank-order sum of every rank's contribution, whole or in pieces. The engine's
part (landing bytes in the views the core names, then ``Landing.finish_bytes``) is done here
as the engine does it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from redsrv.core import chunker, wire
from redsrv.core.client_core import (
    SKIP,
    Action,
    Broken,
    Channel,
    ClientCore,
    Complete,
    Fail,
    Landing,
    Reconnect,
    Retire,
    SendFrame,
)
from redsrv.core.client_ops import Op, PendingPush, ReduceFuture
from redsrv.core.config import Config
from redsrv.core.errors import PeerLostError, PeerTimeoutError, RedsrvError, RemoteProtocolError

WORLD = 3
RANK = 0


def config(reducers: int = 2, **options: Any) -> Config:
    return Config(reducers=tuple(f"10.0.0.{r}:29600" for r in range(reducers)), rank=RANK, world_size=WORLD,
                  job="core", **options)


def others(arr: np.ndarray) -> list[np.ndarray]:
    """What the other ranks push under the same key: rank r's data is (r + 1) times ours plus r."""
    return [arr * (r + 1) + r for r in range(1, WORLD)]


def rank_order_sum(arr: np.ndarray) -> np.ndarray:
    total = arr.copy()
    for contribution in others(arr):
        total = total + contribution
    return total


def make_op(key: int, arr: np.ndarray, reducers: int, chunk_elements: int, *, now: float = 0.0, timeout: float = 10.0,
            mean: bool = False, out: np.ndarray | None = None) -> tuple[Op, list[PendingPush]]:
    plan = chunker.plan(arr.size, reducers, chunk_elements, chunk_elements, list(range(reducers)))
    if not plan:  # as Client._submit: an empty contribution makes the round trip as one empty chunk
        plan = [chunker.Chunk(0, 0, 0, 0)]
    future = ReduceFuture()
    given_out = out
    out = np.empty(arr.size, arr.dtype) if out is None else out
    op = Op(key, key, out, arr.dtype, mean, {(c.reducer, c.index): c for c in plan}, future, now + timeout, now,
            arr.shape, given_out, in_place=given_out is not None and np.shares_memory(out, arr))
    code = wire.dtype_code(arr.dtype)
    pushes = [PendingPush(op, c, arr, arr.dtype, code, wire.ReduceOp.SUM, 0, True)
              for c in sorted(plan, key=lambda c: (c.index, c.reducer))]
    return op, pushes


def connect(core: ClientCore, reducer: int, incarnation: int, streams: int = 1) -> list[Channel]:
    return [Channel(reducer, i, incarnation, f"10.0.0.{reducer}:29600") for i in range(streams)]


def new_core(reducers: int = 2, streams: int = 1, **options: Any) -> ClientCore:
    core = ClientCore(config(reducers, **options), [0] * reducers)
    for r in range(reducers):
        core.connected(r, connect(core, r, 100 + r, streams))
    return core


def header(op: Op, chunk: chunker.Chunk, start: int, stop: int, contributors: int = WORLD) -> wire.FrameHeader:
    bitmap_len = 1
    data_len = (stop - start) * op.wire_dtype.itemsize
    return wire.FrameHeader(wire.FrameType.RESULT, bitmap_len + data_len,
                            (op.key, start, stop - start, chunk.index, wire.dtype_code(op.wire_dtype), contributors,
                             bitmap_len))


def land(core: ClientCore, channel: Channel, head: wire.FrameHeader, data: np.ndarray,
         now: float = 1.0) -> tuple[bool, list[Action]]:
    """What the engine does with one RESULT frame: ask where it lands, receive it there, finish
    its bytes, report it landed. Returns whether it was received (not skipped), and the actions."""
    landing, actions = core.frame_header(channel, head, now)
    if landing == SKIP:
        return False, actions
    assert isinstance(landing, Landing)
    landing.save_input(core.chunk_buffers.copy)
    bitmap = memoryview(channel.bitmap)[: landing.bitmap_len]
    bitmap[:] = bytes([(1 << WORLD) - 1])
    view, _what = landing.data
    raw = data.view(np.uint8).reshape(-1)
    assert len(view) == raw.size
    view[:] = raw.tobytes()
    landing.finish_bytes(channel)
    _more, landed = core.payload_landed(channel)
    return True, actions + landed


def frames(actions: list[Action], kind: str = "push") -> list[SendFrame]:
    return [a for a in actions if isinstance(a, SendFrame) and a.kind == kind]


def of(actions: list[Action], kind: type) -> list[Any]:
    return [a for a in actions if isinstance(a, kind)]


# --- pushes and windows ---

def test_chunks_leave_in_order_within_each_streams_push_window() -> None:
    core = new_core(reducers=1, push_window_chunks=2)
    arr = np.arange(40, dtype=np.float32)
    op, pushes = make_op(1, arr, reducers=1, chunk_elements=10)
    sent = frames(core.submit(op, pushes))
    assert [f.push.chunk.index for f in sent if f.push] == [0, 1]  # the window holds two
    assert core.written(sent[0].channel, "push", True)[0].push.chunk.index == 2  # type: ignore[union-attr]
    assert core.written(sent[1].channel, "push", False) == []  # a frame that could not leave frees no room for another
    payload = bytes(sent[0].views[1])
    assert payload == arr[:10].tobytes()  # a view of the caller's array, no copy


def test_the_least_loaded_stream_of_the_reducer_takes_the_next_chunk() -> None:
    core = new_core(reducers=1, streams=2, push_window_chunks=1)
    op, pushes = make_op(1, np.zeros(30, np.float32), reducers=1, chunk_elements=10)
    sent = frames(core.submit(op, pushes))
    assert sorted(f.channel.index for f in sent) == [0, 1]


def test_a_duplicate_key_is_refused_and_a_closed_core_takes_nothing() -> None:
    core = new_core()
    op, pushes = make_op(1, np.zeros(4, np.float32), reducers=2, chunk_elements=2)
    core.submit(op, pushes)
    again, more = make_op(1, np.zeros(4, np.float32), reducers=2, chunk_elements=2)
    with pytest.raises(ValueError, match="already in flight"):
        core.submit(again, more)
    failed = core.close(RuntimeError("closed"))
    assert failed is not None and [a.op for a in of(failed, Fail)] == [op]
    assert core.close(RuntimeError("closed")) is None
    with pytest.raises(RedsrvError, match="closed"):
        core.submit(*make_op(2, np.zeros(4, np.float32), reducers=2, chunk_elements=2))


# --- results ---

def test_results_whole_and_in_pieces_complete_the_operation_once_with_the_rank_order_sum() -> None:
    core = new_core()
    arr = np.arange(40, dtype=np.float32)
    op, pushes = make_op(1, arr, reducers=2, chunk_elements=10)
    core.submit(op, pushes)
    expected = rank_order_sum(arr)
    completions: list[Action] = []
    for (r, index), chunk in sorted(op.chunks.items()):
        channel = core.channels[r][0]
        start, cut, stop = chunk.start, chunk.start + 3, chunk.stop
        if index == 0:  # in pieces: 3 elements, then the rest
            ok, actions = land(core, channel, header(op, chunk, start, cut), expected[start:cut])
            assert ok and not of(actions, Complete)
            assert op.received[(r, index)][0] == 3
            ok, actions = land(core, channel, header(op, chunk, cut, stop), expected[cut:stop])
        else:
            ok, actions = land(core, channel, header(op, chunk, start, stop), expected[start:stop])
        assert ok
        completions += of(actions, Complete)
    [done] = completions
    assert done.op is op and np.array_equal(done.result, expected)
    assert done.contributors.min_count == WORLD and done.contributors.ranks == tuple(range(WORLD))
    assert core.completed == 1 and not core.ops


def test_a_duplicate_frame_is_skipped_and_a_piece_out_of_order_fails_the_operation() -> None:
    core = new_core(reducers=1)
    arr = np.arange(20, dtype=np.float32)
    op, pushes = make_op(1, arr, reducers=1, chunk_elements=10)
    core.submit(op, pushes)
    channel = core.channels[0][0]
    first, second = op.chunks[(0, 0)], op.chunks[(0, 1)]
    expected = rank_order_sum(arr)
    assert land(core, channel, header(op, first, 0, 10), expected[:10])[0]
    assert not land(core, channel, header(op, first, 0, 10), expected[:10] * 0)[0]  # duplicate: dropped
    assert np.array_equal(op.out[:10], expected[:10])
    ok, actions = land(core, channel, header(op, second, 15, 20), expected[15:])  # skips elements 10-14
    [failed] = of(actions, Fail)
    assert not ok and isinstance(failed.error, RemoteProtocolError) and "offset 15" in str(failed.error)
    # Frames for an operation that failed are read and dropped; its buffer is not written again.
    before = op.out.copy()
    assert not land(core, channel, header(op, second, 10, 20), expected[10:] + 1)[0]
    assert op.out.tobytes() == before.tobytes()  # bit for bit: the untouched part of np.empty may hold NaNs


def test_an_operation_past_its_deadline_fails_at_the_tick_naming_what_it_waits_for() -> None:
    core = new_core()
    op, pushes = make_op(7, np.zeros(40, np.float32), reducers=2, chunk_elements=10, now=0.0, timeout=5.0)
    core.submit(op, pushes)
    assert of(core.tick(4.9, [], expire=True), Fail) == []
    assert of(core.tick(6.0, [], expire=False), Fail) == []  # another loop's tick: not its job
    [failed] = of(core.tick(6.0, [], expire=True), Fail)
    assert isinstance(failed.error, PeerTimeoutError)
    assert "10.0.0.0:29600 (2 chunk(s)), 10.0.0.1:29600 (2 chunk(s))" in str(failed.error)
    assert core.failed == {"PeerTimeoutError": 1}


# --- recovery ---

def _two_chunk_op(core: ClientCore, key: int = 1) -> tuple[Op, np.ndarray]:
    arr = np.arange(20, dtype=np.float32) + key
    op, pushes = make_op(key, arr, reducers=1, chunk_elements=10)
    core.submit(op, pushes)
    return op, rank_order_sum(arr)


def test_a_lost_reducer_holds_its_chunks_and_a_reconnect_to_the_same_incarnation_resends_the_unanswered_ones() -> None:
    core = new_core(reducers=1, push_window_chunks=4)
    op, expected = _two_chunk_op(core)
    old = core.channels[0][0]
    assert land(core, old, header(op, op.chunks[(0, 0)], 0, 10), expected[:10])[0]
    assert land(core, old, header(op, op.chunks[(0, 1)], 10, 13), expected[10:13])[0]  # a piece of chunk 1
    [reconnect] = core.connection_lost(old, "reset", "connection reset", "pull", now=2.0)
    assert isinstance(reconnect, Reconnect) and reconnect.reducer == 0 and core.recovering == {0: 122.0}
    assert core.connection_lost(old, "eof", "closed", "pull", now=2.1) == []  # once per loss
    later, later_pushes = make_op(2, np.ones(10, np.float32), reducers=1, chunk_elements=10)
    assert frames(core.submit(later, later_pushes)) == []  # waits for the reducer to be back
    new = connect(core, 0, 100)  # same incarnation
    actions = core.reconnected(0, new)
    assert of(actions, Retire) == [Retire((old,))] and old.gone
    assert frames(actions, "settled") == []  # the reducer kept what it had
    resent = frames(actions)
    assert [(f.push.op.key, f.push.chunk.index) for f in resent if f.push] == [(1, 1), (2, 0)]  # older work first
    assert all(f.channel is new[0] for f in resent)
    assert not land(core, old, header(op, op.chunks[(0, 1)], 13, 20), expected[13:])[0]  # the old stream is gone
    ok, done = land(core, new[0], header(op, op.chunks[(0, 1)], 10, 20), expected[10:])  # again from the start
    assert ok and np.array_equal(of(done, Complete)[0].result, expected)


def test_a_restarted_reducer_gets_the_results_not_yet_safe_as_settled_pushes() -> None:
    core = new_core(reducers=1)
    op, expected = _two_chunk_op(core)
    old = core.channels[0][0]
    land(core, old, header(op, op.chunks[(0, 0)], 0, 10), expected[:10])
    land(core, old, header(op, op.chunks[(0, 1)], 10, 20), expected[10:])
    assert core.completed == 1 and len(old.copies) == 2
    assert core.acknowledge(old) is not None and core.acknowledge(old) is None  # one ACK in flight
    core.written(old, "ack", True)
    core.safe(old, 1)  # every rank has the first result
    assert list(old.copies) == [(1, 1)]
    core.connection_lost(old, "eof", "closed", "pull", now=3.0)
    op.out[:] = -1  # the caller owns ``out`` again and overwrites it
    actions = core.reconnected(0, connect(core, 0, 999))  # a new incarnation
    [settled] = frames(actions, "settled")
    assert np.frombuffer(bytes(settled.views[1]), np.float32).tolist() == expected[10:].tolist()
    assert frames(actions) == []  # nothing unanswered to resend


def test_a_reducer_not_back_within_the_window_breaks_the_client() -> None:
    core = new_core(reducers=1, reconnect_window=5.0)
    op, _expected = _two_chunk_op(core)
    core.connection_lost(core.channels[0][0], "reset", "reset", "push", now=1.0)
    actions = core.window_closed(0, now=6.0)
    [failed] = of(actions, Fail)
    assert isinstance(failed.error, PeerLostError) and "reconnect window of 5.0s" in str(failed.error)
    assert of(actions, Broken) and core.broken is failed.error


def test_without_a_reconnect_window_a_lost_reducer_fails_everything() -> None:
    core = new_core(reducers=1, reconnect_window=0.0)
    op, _expected = _two_chunk_op(core)
    actions = core.connection_lost(core.channels[0][0], "eof", "closed", "pull", now=1.0)
    assert [a.op for a in of(actions, Fail)] == [op] and of(actions, Broken)


def test_an_in_place_result_keeps_the_input_it_overwrites_for_a_resend() -> None:
    core = new_core(reducers=1, push_window_chunks=4)
    arr = np.arange(20, dtype=np.float32)
    original = arr.copy()
    op, pushes = make_op(1, arr, reducers=1, chunk_elements=10, out=arr)
    core.submit(op, pushes)
    old = core.channels[0][0]
    expected = rank_order_sum(original)
    land(core, old, header(op, op.chunks[(0, 1)], 10, 13), expected[10:13])  # overwrites part of the input
    core.connection_lost(old, "reset", "reset", "pull", now=1.0)
    first, second = frames(core.reconnected(0, connect(core, 0, 555)))
    assert np.frombuffer(bytes(first.views[1]), np.float32).tolist() == original[:10].tolist()
    assert np.frombuffer(bytes(second.views[1]), np.float32).tolist() == original[10:].tolist()


# --- random interleavings against a model ---

@dataclass
class _Reducer:
    """The scripted reducer: which chunks reached it on its current connection."""

    pushed: set[tuple[int, int]] = field(default_factory=set)  # (key, chunk) on the current connection
    sent: dict[tuple[int, int], int] = field(default_factory=dict)  # elements of each result already sent
    answered: set[tuple[int, int]] = field(default_factory=set)  # whole results the client took


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_interleavings_complete_every_operation_once_with_the_rank_order_sum(data: st.DataObject) -> None:
    reducers = data.draw(st.integers(1, 3), label="reducers")
    streams = data.draw(st.integers(1, 2), label="streams")
    core = new_core(reducers, streams, push_window_chunks=data.draw(st.integers(0, 3), label="window"),
                    reconnect_window=data.draw(st.sampled_from([0.0, 50.0]), label="reconnect window"))
    now = 0.0
    ops: dict[int, tuple[Op, np.ndarray]] = {}
    spans: dict[int, dict[tuple[int, int], chunker.Chunk]] = {}
    settled: dict[int, list[Action]] = {}
    frozen: dict[int, np.ndarray] = {}  # ``out`` of each completed operation, as it was then
    means: dict[int, np.ndarray] = {}  # the expected result of each mean (the reducer still sends sums)
    garbled: set[int] = set()  # operations sent a piece out of order: they may fail with a protocol error
    in_writer: list[SendFrame] = []  # frames asked for and not yet reported written
    model = [_Reducer() for _ in range(reducers)]
    incarnation = [100 + r for r in range(reducers)]

    def execute(actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, SendFrame):
                if action.kind != "ack":
                    in_writer.append(action)
                else:
                    core.written(action.channel, "ack", True)
            elif isinstance(action, (Complete, Fail)):
                settled.setdefault(action.op.key, []).append(action)
                if isinstance(action, Complete):
                    frozen[action.op.key] = action.op.out.copy()

    for key in range(data.draw(st.integers(1, 3), label="operations")):
        size = data.draw(st.integers(0, 40), label="size")
        arr = np.arange(size, dtype=np.float32) * (key + 1)
        mean = data.draw(st.booleans(), label="mean")
        op, pushes = make_op(key, arr, reducers, data.draw(st.integers(1, 12), label="chunk"), now=now, timeout=100.0,
                             mean=mean)
        total = rank_order_sum(arr)
        ops[key] = (op, total)
        spans[key] = dict(op.chunks)
        if mean:
            means[key] = total / np.float32(WORLD)
        execute(core.submit(op, pushes))

    for _ in range(data.draw(st.integers(0, 60), label="events")):
        event = data.draw(st.sampled_from(["write", "write", "result", "result", "result", "lose", "back", "tick",
                                           "safe"]))
        now += 0.5
        if event == "write" and in_writer:
            frame = in_writer.pop(data.draw(st.integers(0, len(in_writer) - 1)))
            ok = not frame.channel.gone and data.draw(st.booleans())
            if ok and frame.push is not None:
                model[frame.channel.reducer].pushed.add((frame.push.op.key, frame.push.chunk.index))
            execute(core.written(frame.channel, frame.kind, ok) if frame.kind == "push" else [])
            if not ok:  # a write fails when its connection broke (IOLoop.send_frame)
                execute(core.connection_lost(frame.channel, "reset", "write failed", "push", now))
        elif event == "result":
            r = data.draw(st.integers(0, reducers - 1))
            ready = sorted(model[r].pushed | model[r].answered)
            if not ready or r in core.recovering:
                continue
            key, index = data.draw(st.sampled_from(ready))
            op, expected = ops[key]
            chunk = spans[key][(r, index)]
            channel = data.draw(st.sampled_from(core.channels[r]))
            if (key, index) in model[r].answered:  # the whole result once more: dropped
                again = header(op, chunk, chunk.start, chunk.stop)
                assert not land(core, channel, again, expected[chunk.start : chunk.stop] + 1, now)[0]
                continue
            start = chunk.start + model[r].sent.get((key, index), 0)
            if data.draw(st.integers(0, 9), label="out of order") == 0 and start > chunk.start:
                start = chunk.start  # a piece again: the operation fails with a protocol error
                garbled.add(key)
            stop = data.draw(st.integers(min(start + 1, chunk.stop), chunk.stop), label="piece end")
            ok, actions = land(core, channel, header(op, chunk, start, stop), expected[start:stop], now)
            model[r].sent[(key, index)] = stop - chunk.start
            if stop == chunk.stop:
                model[r].pushed.discard((key, index))
                model[r].sent.pop((key, index), None)
                if ok:
                    model[r].answered.add((key, index))
            execute(actions)
        elif event == "lose":
            r = data.draw(st.integers(0, reducers - 1))
            execute(core.connection_lost(core.channels[r][0], "reset", "reset", "pull", now))
        elif event == "back" and core.recovering:
            r = data.draw(st.sampled_from(sorted(core.recovering)))
            if data.draw(st.booleans(), label="restarted"):
                incarnation[r] += 1
            model[r] = _Reducer()  # the old connection's pushes and results are gone
            execute(core.reconnected(r, connect(core, r, incarnation[r], streams)))
        elif event == "tick":
            execute(core.tick(now, [c for cs in core.channels for c in cs], expire=True))
        elif event == "safe":
            channel = data.draw(st.sampled_from([c for cs in core.channels for c in cs]))
            core.safe(channel, channel.frames_received)
        for key, out in frozen.items():  # no buffer is written after its operation completed
            assert np.array_equal(ops[key][0].out, out), f"operation {key}'s buffer changed after it completed"

    # Drain: reconnect what is lost, write what is queued, answer everything, then the deadline.
    for _ in range(200):
        for r in sorted(core.recovering):
            model[r] = _Reducer()
            execute(core.reconnected(r, connect(core, r, incarnation[r], streams)))
        while in_writer:
            frame = in_writer.pop(0)
            if frame.push is not None and not frame.channel.gone:
                model[frame.channel.reducer].pushed.add((frame.push.op.key, frame.push.chunk.index))
            execute(core.written(frame.channel, frame.kind, not frame.channel.gone) if frame.kind == "push" else [])
        answered = False
        for r in range(reducers):
            for key, index in sorted(model[r].pushed):
                op, expected = ops[key]
                chunk = op.chunks.get((r, index))
                model[r].pushed.discard((key, index))
                if chunk is None:
                    continue
                start = chunk.start + model[r].sent.pop((key, index), 0)
                execute(land(core, core.channels[r][0], header(op, chunk, start, chunk.stop), expected[start:chunk.stop],
                             now)[1])
                answered = True
        if not answered and not in_writer and not core.recovering:
            break
    execute(core.tick(now + 1000.0, [], expire=True))

    for key, (op, expected) in ops.items():
        outcome = settled.get(key, [])
        assert len(outcome) == 1, f"operation {key} settled {len(outcome)} times: {outcome}"
        [action] = outcome
        if isinstance(action, Complete):
            assert np.array_equal(action.result, means.get(key, expected)), f"operation {key}: wrong sum"
            assert op.out.tobytes() == frozen[key].tobytes()
        else:
            # The only failures a correct core may give here: a protocol error for a garbled
            # result, and a lost reducer where there is no reconnect window. Every deadline is
            # far: an operation still open at the final tick was stuck.
            error = action.error
            assert isinstance(error, RedsrvError), f"operation {key} failed with {error!r}"
            assert (isinstance(error, RemoteProtocolError) and key in garbled) or (
                isinstance(error, PeerLostError) and core.config.reconnect_window == 0), \
                f"operation {key} failed with {error!r}"
    assert not core.ops
