"""The reducer state machine, driven without sockets."""

from __future__ import annotations

import itertools
import mmap

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from redsrv.core import constants as C
from redsrv.core import wire
from redsrv.core.errors import RemoteProtocolError
from redsrv.core.reducer import WAIT_FOR_MEMORY, Log, PushTicket, ReducerCore, SendError, SendResult

INC = 0xABC
NONCE = bytes(32)


def hello(rank: int, world: int, job: str = "j", session: int | None = None, **kw) -> wire.Hello:  # type: ignore[no-untyped-def]
    return wire.Hello(job, rank, world, session if session is not None else 100 + rank, NONCE, **kw)


def make_core(world: int, job: str = "j", budget: int = 1 << 30, **kw) -> ReducerCore:  # type: ignore[no-untyped-def]
    core = ReducerCore(INC, job_budget_bytes=budget, stall_warning=kw.pop("stall_warning", 30.0))
    for r in range(world):
        assert core.join(conn_id(job, r), hello(r, world, job, **kw)) == []
    return core


#: Connection ids by (job, rank): one per pair, alike in every process. (A hash of the pair cut to
#: 16 bits, as before, varies with PYTHONHASHSEED and now and then gave two pairs one id.) They
#: start above the literal ids some tests pass, so the two never meet.
_CONN_IDS: dict[tuple[str, int], int] = {}


def conn_id(job: str, rank: int) -> int:
    return _CONN_IDS.setdefault((job, rank), 0x10000 + len(_CONN_IDS))


def push(core: ReducerCore, rank: int, data: np.ndarray, *, key: int = 1, chunk: int = 0, offset: int = 0,
         total: int | None = None, job: str = "j", now: float = 0.0, op: wire.ReduceOp = wire.ReduceOp.SUM,
         root: int = 0, incarnation: int = INC, conn: int | None = None) -> list:  # type: ignore[type-arg]
    conn = conn if conn is not None else conn_id(job, rank)
    payload = data.view(np.uint8).reshape(-1)
    count = data.size
    p = wire.Push(key, incarnation, total if total is not None else offset + count, offset, count, chunk,
                  wire.dtype_code(data.dtype), op, root)
    nbytes = 0 if (op is wire.ReduceOp.BROADCAST and rank != root) else payload.nbytes
    outcome = core.begin_push(conn, p, nbytes, now)
    if outcome is None or isinstance(outcome, list):
        return outcome  # type: ignore[return-value]
    assert isinstance(outcome, PushTicket)
    if outcome.buffer is not None:
        outcome.buffer[:] = payload
    return core.finish_push(outcome, now)


def result_of(actions: list, dtype: np.dtype) -> tuple[np.ndarray, list[int], int]:  # type: ignore[type-arg]
    results = [a for a in actions if isinstance(a, SendResult)]
    assert len(results) == 1, actions
    res = results[0]
    decoder = wire.FrameDecoder()
    decoder.receive_data(res.header + bytes(res.data))
    frame = decoder.next_frame()
    assert isinstance(frame, wire.Result)
    data = np.frombuffer(bytes(frame.payload), dtype=dtype).copy()
    for _ in res.conns:
        res.release()
    return data, wire.ranks_from_bitmap(frame.bitmap), frame.contributors


def errors(actions: list) -> list[SendError]:  # type: ignore[type-arg]
    return [a for a in actions if isinstance(a, SendError)]


@settings(max_examples=60, deadline=None)
@given(st.permutations(range(4)), st.integers(1, 300))
def test_sum_is_in_rank_order_whatever_the_arrival_order(order: list[int], size: int) -> None:
    core = make_core(4)
    rng = np.random.default_rng(size)
    data = [rng.standard_normal(size).astype(np.float32) * np.float32(10.0) ** rng.integers(-3, 4) for _ in range(4)]
    actions: list = []  # type: ignore[type-arg]
    for rank in order:
        actions = push(core, rank, data[rank])
    out, ranks, count = result_of(actions, np.dtype(np.float32))
    expected = ((data[0] + data[1]) + data[2]) + data[3]
    assert out.tobytes() == expected.tobytes()
    assert ranks == [0, 1, 2, 3] and count == 4
    assert core.bytes_held("j") == 0


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_16bit_floats_accumulate_in_float32_and_round_once(dtype: type) -> None:
    core = make_core(3)
    small = 0.2 if dtype is np.float16 else 1.5  # below half the type's spacing at 1000
    values = [np.full(8, v, dtype=dtype) for v in (1000.0, small, small)]
    for rank in (2, 0, 1):
        actions = push(core, rank, values[rank])
    out, _, _ = result_of(actions, np.dtype(dtype))
    exact = (values[0].astype(np.float32) + values[1].astype(np.float32)) + values[2].astype(np.float32)
    assert out.tobytes() == exact.astype(dtype).tobytes()
    # Summing in the 16-bit type would lose the small terms twice over.
    naive = (values[0] + values[1]) + values[2]
    assert not np.array_equal(out, naive)


def test_integers_sum_exactly() -> None:
    core = make_core(2)
    push(core, 0, np.array([2**40, -5], dtype=np.int64))
    out, _, _ = result_of(push(core, 1, np.array([1, 5], dtype=np.int64)), np.dtype(np.int64))
    assert out.tolist() == [2**40 + 1, 0]


def test_dtype_mismatch_fails_the_chunk_on_every_rank_naming_both() -> None:
    core = make_core(3)
    assert push(core, 0, np.zeros(4, np.float32)) == []
    actions = push(core, 1, np.zeros(4, np.float16))
    errs = errors(actions)
    assert {e.conn for e in errs} == {conn_id("j", 0), conn_id("j", 1)}
    message = errs[0].frame.message
    assert "rank 0 sent float32[4]" in message and "rank 1 sent float16[4]" in message
    assert errs[0].frame.code is wire.ErrorCode.CONTRIBUTION_MISMATCH and not errs[0].frame.fatal
    # The rank that comes later gets the same error instead of waiting forever.
    late = errors(push(core, 2, np.zeros(4, np.float32)))
    assert late[0].frame.message == message
    assert core.bytes_held("j") == 0


def test_length_mismatch_names_both_lengths() -> None:
    core = make_core(2)
    push(core, 0, np.zeros(4, np.float32), total=10)
    message = errors(push(core, 1, np.zeros(4, np.float32), total=12))[0].frame.message
    assert "of 10" in message and "of 12" in message


def test_duplicate_contribution_is_an_error_for_that_job_only() -> None:
    core = make_core(2)
    core.join(conn_id("other", 0), hello(0, 1, "other"))
    push(core, 0, np.ones(2, np.float32))
    errs = errors(push(core, 0, np.ones(2, np.float32)))
    assert errs and errs[0].frame.code is wire.ErrorCode.DUPLICATE
    out, _, _ = result_of(push(core, 0, np.ones(2, np.float32) * 7, job="other"), np.dtype(np.float32))
    assert out.tolist() == [7, 7]


def test_first_m_closes_at_m_and_late_rank_gets_the_same_result() -> None:
    core = make_core(4, mode=wire.StragglerMode.FIRST_M, min_contributors=3)
    data = [np.full(3, r + 1, np.float32) for r in range(4)]
    push(core, 3, data[3])
    push(core, 0, data[0])
    actions = push(core, 2, data[2])
    results = [a for a in actions if isinstance(a, SendResult)]
    assert len(results) == 1 and len(results[0].conns) == 3
    first, ranks, count = result_of(actions, np.dtype(np.float32))
    assert ranks == [0, 2, 3] and count == 3 and first.tolist() == [8, 8, 8]
    late, late_ranks, _ = result_of(push(core, 1, data[1]), np.dtype(np.float32))
    assert late.tobytes() == first.tobytes() and late_ranks == [0, 2, 3]
    # Every rank has its answer: the retained result is freed.
    assert core.bytes_held("j") == 0
    # A second late push of the same key is stale, never summed.
    assert errors(push(core, 1, data[1]))[0].frame.code is wire.ErrorCode.STALE


def test_deadline_mode_closes_after_t_with_the_minimum() -> None:
    core = make_core(3, mode=wire.StragglerMode.DEADLINE, min_contributors=2, deadline_ms=500)
    push(core, 0, np.ones(2, np.float32), now=10.0)
    assert core.tick(10.6) == []  # one contribution is below the minimum
    push(core, 2, np.ones(2, np.float32) * 2, now=10.7)
    assert core.tick(10.8)  # past the deadline with two
    # all three would have closed it immediately; here the chunk closed with ranks 0 and 2


def test_deadline_mode_result() -> None:
    core = make_core(3, mode=wire.StragglerMode.DEADLINE, min_contributors=2, deadline_ms=500)
    push(core, 0, np.ones(2, np.float32), now=0.0)
    push(core, 2, np.ones(2, np.float32) * 2, now=0.1)
    out, ranks, count = result_of(core.tick(0.6), np.dtype(np.float32))
    assert out.tolist() == [3, 3] and ranks == [0, 2] and count == 2


def test_operation_timeout_names_missing_ranks() -> None:
    core = make_core(3, op_timeout_ms=2000)
    push(core, 1, np.ones(2, np.float32), now=0.0)
    assert errors(core.tick(1.0)) == []
    errs = errors(core.tick(2.5))
    assert errs and errs[0].frame.code is wire.ErrorCode.TIMEOUT
    assert "rank(s) 0, 2" in errs[0].frame.message and "job 'j'" in errs[0].frame.message


def test_stall_warning_names_missing_ranks_once() -> None:
    core = make_core(3, stall_warning=1.0)
    push(core, 0, np.ones(2, np.float32), now=0.0)
    logs = [a for a in core.tick(1.5) if isinstance(a, Log)]
    assert len(logs) == 1 and "rank(s) 1, 2" in logs[0].message
    assert not [a for a in core.tick(2.0) if isinstance(a, Log)]


def test_lost_worker_fails_open_chunks_naming_the_rank_then_rejoin_recovers() -> None:
    core = make_core(3)
    push(core, 0, np.ones(2, np.float32))
    actions = core.leave(conn_id("j", 2), "connection reset", 1.0)
    errs = errors(actions)
    assert [e.conn for e in errs] == [conn_id("j", 0)]
    assert "rank 2" in errs[0].frame.message and errs[0].frame.code is wire.ErrorCode.PEER_LOST
    # While rank 2 is gone, new pushes fail at once instead of waiting for the timeout.
    again = errors(push(core, 1, np.ones(2, np.float32), key=2))
    assert again and again[0].frame.code is wire.ErrorCode.PEER_LOST
    # Rank 2 comes back (a new session): the next step works.
    core.join(conn_id("j", 2), hello(2, 3, session=999))
    for r in range(2):
        push(core, r, np.ones(2, np.float32), key=3)
    out, _, _ = result_of(push(core, 2, np.ones(2, np.float32), key=3), np.dtype(np.float32))
    assert out.tolist() == [3, 3]


def test_straggler_modes_tolerate_a_lost_worker() -> None:
    core = make_core(3, mode=wire.StragglerMode.FIRST_M, min_contributors=2)
    push(core, 0, np.ones(2, np.float32))
    assert errors(core.leave(conn_id("j", 2), "gone", 0.0)) == []
    out, ranks, _ = result_of(push(core, 1, np.ones(2, np.float32)), np.dtype(np.float32))
    assert out.tolist() == [2, 2] and ranks == [0, 1]


def test_job_parameters_must_agree() -> None:
    core = make_core(2)
    actions = core.join(99, hello(1, 3, session=5))
    errs = errors(actions)
    assert errs and errs[0].frame.code is wire.ErrorCode.JOB_MISMATCH and errs[0].close_after
    assert "world_size: job has 2, rank 1 sent 3" in errs[0].frame.message


def test_a_second_live_client_claiming_a_rank_is_refused_naming_the_rank_and_both_peers() -> None:
    core = ReducerCore(INC)
    assert core.join(1, hello(0, 2), peer="10.0.0.1:5000") == []
    assert core.join(2, hello(1, 2), peer="10.0.0.2:5000") == []
    errs = errors(core.join(77, hello(1, 2, session=12345), peer="10.0.0.9:6000"))
    assert [e.conn for e in errs] == [77] and errs[0].close_after and errs[0].frame.code is wire.ErrorCode.JOB_MISMATCH
    message = errs[0].frame.message
    assert "rank 1" in message and "10.0.0.2:5000" in message and "10.0.0.9:6000" in message
    assert core.join(78, hello(1, 2), peer="10.0.0.2:5001") == [], "another stream of the same client joins"


def test_a_rank_whose_old_client_is_gone_may_join_with_a_new_session() -> None:
    core = ReducerCore(INC)
    core.join(1, hello(0, 2))
    core.join(2, hello(1, 2))
    core.leave(2, "worker restarted", 0.0)
    assert errors(core.join(77, hello(1, 2, session=12345))) == []


RECONNECT = dict(reconnect_window_ms=60_000)


def test_a_new_session_replacing_the_last_kept_place_starts_the_job_afresh_and_can_push() -> None:
    # Rank 0 left without a goodbye (its place kept for a reconnect), rank 1 closed for good; a
    # new client for rank 0 voids the old session, which was the job's last member: the job is
    # dropped, and the newcomer must join a job that exists (it once joined the dropped one, and
    # its first push failed the connection with a KeyError).
    core = ReducerCore(INC, rejoin_grace=5.0)
    assert core.join(1, hello(0, 2, **RECONNECT)) == []
    assert core.join(2, hello(1, 2, **RECONNECT)) == []
    core.leave(1, "closed the connection", 0.0)
    core.leave(2, "the worker closed its client", 0.0, for_good=True)
    assert errors(core.join(3, hello(0, 2, session=999, **RECONNECT))) == []
    data = np.arange(5, dtype=np.float32)
    assert push(core, 0, data, conn=3) == []  # before rank 1's new client is there
    assert core.join(4, hello(1, 2, session=998, **RECONNECT)) == []
    total, ranks, _ = result_of(push(core, 1, data * 2, conn=4), np.float32)
    assert total.tolist() == (data * 3).tolist() and ranks == [0, 1]


def recovering_core(world: int, piece_bytes: int = 64) -> ReducerCore:
    core = ReducerCore(INC, piece_bytes=piece_bytes, rejoin_grace=5.0)
    for r in range(world):
        assert core.join(conn_id("j", r), hello(r, world, **RECONNECT)) == []
    return core


def begin_on(core: ReducerCore, conn: int, data: np.ndarray, key: int = 1):  # type: ignore[no-untyped-def]
    p = wire.Push(key, INC, data.size, 0, data.size, 0, wire.dtype_code(data.dtype))
    return core.begin_push(conn, p, data.nbytes, 0.0)


def test_a_rank_that_reconnects_mid_push_continues_and_everyone_gets_the_exact_sum() -> None:
    core = recovering_core(2)
    data = [np.arange(64, dtype=np.float32) * (r + 1) for r in range(2)]
    # rank 0 pushes whole; rank 1's connection breaks after 100 of 256 bytes
    t0 = begin_on(core, conn_id("j", 0), data[0])
    t0.buffer[:] = data[0].view(np.uint8)
    assert not errors(core.finish_push(t0, 0.0))
    t1 = begin_on(core, conn_id("j", 1), data[1])
    t1.buffer[:100] = data[1].view(np.uint8)[:100]
    sent = core.progress(t1, 100, 0.0)
    assert [a for a in sent if isinstance(a, SendResult)], "the first piece leaves while rank 1 still pushes"
    kept = t1.buffer
    core.abort_push(t1)
    assert not errors(core.leave(conn_id("j", 1), "connection reset", 0.0)), "nobody fails while rank 1 may come back"
    # rank 1 reconnects and resends the whole chunk on a new connection
    assert not errors(core.join(500, hello(1, 2, **RECONNECT), now=1.0))
    t2 = begin_on(core, 500, data[1])
    assert isinstance(t2, PushTicket) and t2.skip == 100 and t2.buffer is kept
    replay = [a for a in t2.replay if isinstance(a, SendResult)]
    assert replay and replay[0].conns == [500], "what was already sent goes again to the new connection"
    t2.buffer[100:] = data[1].view(np.uint8)[100:]
    done = core.finish_push(t2, 1.0)
    results = [a for a in done if isinstance(a, SendResult)]
    assert results and all(set(a.conns) == {conn_id("j", 0), 500} for a in results)
    total = data[0] + data[1]
    got = np.frombuffer(bytes(replay[0].data) + b"".join(bytes(a.data) for a in results), np.float32)
    assert got.tobytes() == total.tobytes()


def test_a_result_the_old_connection_never_acknowledged_is_sent_again_after_the_reconnect() -> None:
    core = recovering_core(2, piece_bytes=0)
    data = [np.full(8, r + 1, np.float32) for r in range(2)]
    assert push(core, 0, data[0]) == []
    closing = push(core, 1, data[1])
    assert [a for a in closing if isinstance(a, SendResult)]
    core.ack(conn_id("j", 0), 1)  # rank 0 has it; rank 1's connection breaks before it says so
    core.leave(conn_id("j", 1), "connection reset", 0.0)
    core.join(600, hello(1, 2, **RECONNECT), now=1.0)
    again = push(core, 1, data[1], conn=600)
    results = [a for a in again if isinstance(a, SendResult)]
    assert results and results[0].conns == [600]
    assert np.frombuffer(bytes(results[0].data), np.float32).tolist() == [3.0] * 8
    stale = errors(push(core, 0, data[0]))
    assert stale and stale[0].frame.code is wire.ErrorCode.STALE, "rank 0 acknowledged it: a push again is a reused key"


def test_a_rank_that_does_not_reconnect_within_the_grace_is_lost_and_its_job_hears_it() -> None:
    core = recovering_core(2)
    assert push(core, 0, np.ones(64, np.float32)) == []
    core.leave(conn_id("j", 1), "connection reset", 0.0)
    assert not errors(core.tick(4.9))
    lost = errors(core.tick(5.1))
    assert lost and lost[0].conn == conn_id("j", 0) and lost[0].frame.code is wire.ErrorCode.PEER_LOST
    assert "did not reconnect within 5.0s" in lost[0].frame.message


def test_old_incarnation_is_rejected_as_stale() -> None:
    core = make_core(2)
    errs = errors(push(core, 0, np.ones(2, np.float32), incarnation=INC + 1))
    assert errs[0].frame.code is wire.ErrorCode.STALE and "restarted" in errs[0].frame.message


def test_push_before_handshake_is_a_protocol_error() -> None:
    core = make_core(1)
    errs = errors(push(core, 0, np.ones(2, np.float32), conn=4242))
    assert errs[0].frame.code is wire.ErrorCode.PROTOCOL and errs[0].close_after


def test_jobs_are_isolated() -> None:
    core = make_core(2, job="a")
    for r in range(2):
        core.join(conn_id("b", r), hello(r, 2, "b"))
    push(core, 0, np.ones(4, np.float32), job="b")
    errors(push(core, 1, np.ones(4, np.int32), job="b"))  # job b breaks
    core.leave(conn_id("b", 0), "gone", 0.0)
    push(core, 0, np.full(4, 2, np.float32), job="a")
    out, _, _ = result_of(push(core, 1, np.full(4, 3, np.float32), job="a"), np.dtype(np.float32))
    assert out.tolist() == [5, 5, 5, 5]


def test_budget_applies_backpressure_to_new_chunks_only() -> None:
    core = make_core(2, budget=64)
    assert push(core, 0, np.ones(8, np.float32), key=1) == []  # 32 bytes held
    assert push(core, 0, np.ones(8, np.float32), key=2) == []  # 64 bytes held
    assert push(core, 0, np.ones(8, np.float32), key=3) is None  # a new chunk must wait
    # The other rank completes an open chunk: that is always allowed and frees memory.
    result_of(push(core, 1, np.ones(8, np.float32), key=1), np.dtype(np.float32))
    assert push(core, 0, np.ones(8, np.float32), key=3) == []


def test_broadcast_sends_the_roots_data_exactly() -> None:
    core = make_core(3)
    root_data = np.array([-0.0, 1.5, np.inf], np.float32)
    push(core, 0, np.zeros(3, np.float32), op=wire.ReduceOp.BROADCAST, root=1)
    push(core, 1, root_data, op=wire.ReduceOp.BROADCAST, root=1)
    out, _, _ = result_of(push(core, 2, np.zeros(3, np.float32), op=wire.ReduceOp.BROADCAST, root=1), np.dtype(np.float32))
    assert out.tobytes() == root_data.tobytes()


def test_shutdown_fails_every_open_chunk() -> None:
    core = make_core(2)
    push(core, 0, np.ones(2, np.float32), key=1)
    push(core, 1, np.ones(2, np.float32), key=2)
    errs = errors(core.shutdown("SIGTERM"))
    assert len(errs) == 2 and all(e.frame.code is wire.ErrorCode.SHUTDOWN for e in errs)
    assert core.bytes_held("j") == 0


def test_many_keys_in_flight_complete_independently() -> None:
    core = make_core(2)
    keys = list(range(20))
    for k in keys:
        push(core, 0, np.full(3, k, np.float32), key=k)
    for k in reversed(keys):
        out, _, _ = result_of(push(core, 1, np.full(3, 1, np.float32), key=k), np.dtype(np.float32))
        assert out.tolist() == [k + 1] * 3
    assert core.open_chunks("j") == 0 and core.bytes_held("j") == 0


def test_memory_is_released_for_every_outcome() -> None:
    core = make_core(3, mode=wire.StragglerMode.FIRST_M, min_contributors=2, op_timeout_ms=1000)
    for key in itertools.count():
        if key == 5:
            break
        push(core, 0, np.ones(100, np.float32), key=key)
        actions = push(core, 1, np.ones(100, np.float32), key=key)
        result_of(actions, np.dtype(np.float32))
    # Results retained for rank 2 are dropped at expiry.
    assert core.bytes_held("j") > 0
    core.tick(5.0)
    assert core.bytes_held("j") == 0


def test_a_straggler_connecting_after_the_others_left_still_gets_the_result() -> None:
    core = ReducerCore(INC)
    for r in range(3):
        core.join(conn_id("j", r), hello(r, 4, mode=wire.StragglerMode.FIRST_M, min_contributors=3))
    for r in range(3):
        actions = push(core, r, np.full(2, r + 1, np.float32))
    first, _, _ = result_of(actions, np.dtype(np.float32))
    for r in range(3):
        core.leave(conn_id("j", r), "finished", 1.0)
    # rank 3 connects only now: the job (and the result kept for it) must still be there
    core.join(conn_id("j", 3), hello(3, 4, mode=wire.StragglerMode.FIRST_M, min_contributors=3))
    late, ranks, _ = result_of(push(core, 3, np.full(2, 9, np.float32)), np.dtype(np.float32))
    assert late.tobytes() == first.tobytes() and ranks == [0, 1, 2]
    core.leave(conn_id("j", 3), "finished", 2.0)
    core.tick(2.0)
    assert core.job_names() == []  # nothing left to keep: the job is gone


# --- cut-through: sums forwarded in pieces while payloads arrive (StragglerMode.ALL) -----------


def begin(core: ReducerCore, rank: int, data: np.ndarray, *, key: int = 1, now: float = 0.0) -> PushTicket:
    p = wire.Push(key, INC, data.size, 0, data.size, 0, wire.dtype_code(data.dtype))
    ticket = core.begin_push(conn_id("j", rank), p, data.nbytes, now)
    assert isinstance(ticket, PushTicket) and ticket.part is not None, ticket
    return ticket


def arrive(core: ReducerCore, ticket: PushTicket, data: np.ndarray, upto: int) -> list:  # type: ignore[type-arg]
    """What the daemon does as ``upto`` bytes of the payload are in: copy, report progress."""
    assert ticket.buffer is not None and ticket.part is not None
    already = ticket.part.received  # like recv_into, never rewrite bytes already in (rank 0's hold sums)
    ticket.buffer[already:upto] = data.view(np.uint8).reshape(-1)[already:upto]
    return core.progress(ticket, upto, 0.0)


def pieces_of(actions: list) -> list[wire.Result]:  # type: ignore[type-arg]
    frames = []
    for res in (a for a in actions if isinstance(a, SendResult)):
        decoder = wire.FrameDecoder()
        decoder.receive_data(res.header + bytes(res.data))
        frame = decoder.next_frame()
        assert isinstance(frame, wire.Result)
        frames.append(frame)
        for _ in res.conns:
            res.release()
    return frames


@settings(max_examples=60, deadline=None)
@given(st.data(), st.sampled_from([np.float32, ml_dtypes.bfloat16, np.int32]), st.integers(1, 4000))
def test_cut_through_pieces_tile_the_chunk_and_equal_the_rank_order_sum(data, dtype: type, size: int) -> None:  # type: ignore[no-untyped-def]
    core = make_core(3)
    core.piece_bytes = data.draw(st.sampled_from([64, 1000, 4096]))
    rng = np.random.default_rng(size)
    values = [(rng.standard_normal(size) * 100).astype(dtype) for _ in range(3)]
    order = data.draw(st.permutations(range(3)))
    tickets = {r: begin(core, r, values[r]) for r in order}
    nbytes = values[0].nbytes
    received = dict.fromkeys(range(3), 0)
    actions: list = []  # type: ignore[type-arg]
    while any(received[r] < nbytes for r in range(3)):
        rank = data.draw(st.sampled_from([r for r in range(3) if received[r] < nbytes]))
        received[rank] = data.draw(st.integers(received[rank] + 1, nbytes))
        actions += arrive(core, tickets[rank], values[rank], received[rank])
        if received[rank] == nbytes:
            actions += core.finish_push(tickets[rank], 0.0)
    pieces = pieces_of(actions)
    assert pieces, actions
    itemsize = values[0].itemsize
    assert [p.offset for p in pieces] == list(itertools.accumulate([0] + [p.count for p in pieces[:-1]]))
    assert sum(p.count for p in pieces) == size
    assert all(p.count * itemsize >= core.piece_bytes for p in pieces[:-1])
    assert all(p.contributors == 3 and wire.ranks_from_bitmap(p.bitmap) == [0, 1, 2] for p in pieces)
    got = np.frombuffer(b"".join(bytes(p.payload) for p in pieces), dtype=dtype)
    assert got.tobytes() == rank_order_sum(values, dtype).tobytes()
    assert core.open_chunks("j") == 0 and core.bytes_held("j") == 0


def rank_order_sum(values: list[np.ndarray], dtype: type) -> np.ndarray:
    if np.dtype(dtype).itemsize == 2:
        acc = values[0].astype(np.float32)
        for v in values[1:]:
            acc = acc + v.astype(np.float32)
        return acc.astype(dtype)
    acc = values[0].copy()
    for v in values[1:]:
        acc = acc + v
    return acc


def test_cut_through_forwards_nothing_until_every_rank_has_the_bytes() -> None:
    core = make_core(2)
    core.piece_bytes = 1024
    a, b = np.ones(4096, np.float32), np.full(4096, 2, np.float32)
    ta = begin(core, 0, a)
    assert arrive(core, ta, a, 16384) == []  # rank 1 has not even started
    tb = begin(core, 1, b)
    assert arrive(core, tb, b, 1000) == []  # less than a piece from rank 1
    (piece,) = pieces_of(arrive(core, tb, b, 6000))
    assert (piece.offset, piece.count) == (0, 1500)  # all whole elements both ranks have
    assert np.frombuffer(bytes(piece.payload), np.float32).tolist() == [3.0] * 1500
    assert core.finish_push(ta, 0.0) == []
    (last,) = pieces_of(arrive(core, tb, b, 16384))  # the rest, however short
    assert (last.offset, last.count) == (1500, 4096 - 1500)
    assert core.open_chunks("j") == 1  # closed when the push ends, not when its bytes are in
    assert core.finish_push(tb, 0.0) == []
    assert core.open_chunks("j") == 0 and core.bytes_held("j") == 0


def test_whole_chunks_only_when_pieces_are_off() -> None:
    core = make_core(2)
    core.piece_bytes = 0
    values = [np.full(1000, r + 1, np.float32) for r in range(2)]
    tickets = [begin(core, r, values[r]) for r in range(2)]
    for r in range(2):
        assert arrive(core, tickets[r], values[r], 3000) == []
    assert core.finish_push(tickets[0], 0.0) == []
    assert arrive(core, tickets[1], values[1], 4000) == []
    (whole,) = pieces_of(core.finish_push(tickets[1], 0.0))
    assert (whole.offset, whole.count) == (0, 1000)
    assert core.bytes_held("j") == 0


def test_a_mismatch_is_refused_at_the_header_before_any_piece_leaves() -> None:
    core = make_core(2)
    core.piece_bytes = 64
    x = np.ones(1000, np.float32)
    t0 = begin(core, 0, x)
    arrive(core, t0, x, 4000)
    wrong = wire.Push(1, INC, 1000, 0, 1000, 0, wire.DType.FLOAT16)
    refused = core.begin_push(conn_id("j", 1), wrong, 2000, 0.0)
    assert isinstance(refused, list)
    errs = errors(refused)
    assert {e.conn for e in errs} == {conn_id("j", 0), conn_id("j", 1)}
    assert errs[0].frame.code is wire.ErrorCode.CONTRIBUTION_MISMATCH and "float16[1000]" in errs[0].frame.message
    assert core.finish_push(t0, 0.0) == []  # told already; no result ever leaves
    assert core.bytes_held("j") == 0


def test_a_chunk_failing_mid_payload_keeps_the_memory_a_push_still_writes_into() -> None:
    core = make_core(3)
    core.piece_bytes = 1024
    values = [np.full(4096, r + 1, np.float32) for r in range(3)]
    tickets = [begin(core, r, values[r]) for r in range(3)]
    sent: list = []  # type: ignore[type-arg]
    for r in range(3):
        sent += arrive(core, tickets[r], values[r], 8192)
    assert [(p.offset, p.count) for p in pieces_of(sent)] == [(0, 2048)]
    # Rank 2's connection fails mid-payload: the daemon aborts its push, then the rank leaves.
    core.abort_push(tickets[2])
    failed = core.leave(conn_id("j", 2), "connection reset", 1.0)
    errs = errors(failed)
    assert {e.conn for e in errs} == {conn_id("j", 0), conn_id("j", 1)}
    assert all(e.frame.code is wire.ErrorCode.PEER_LOST and "rank 2" in e.frame.message for e in errs)
    # Ranks 0 and 1 are still receiving into their buffers: the pool must not hand them out.
    assert tickets[0].part is not None and tickets[1].part is not None
    live = [tickets[0].part.shared.buffer, tickets[1].part.shared.buffer]
    fresh = [core.pool.take(values[0].nbytes) for _ in range(4)]
    assert not any(np.shares_memory(f, b) for f in fresh for b in live)
    for f in fresh:
        core.pool.give(f)
    for r in range(2):
        arrive(core, tickets[r], values[r], values[r].nbytes)
        assert core.finish_push(tickets[r], 1.0) == []
    assert core.open_chunks("j") == 0 and core.bytes_held("j") == 0


def test_a_cut_through_chunk_that_times_out_names_the_ranks_still_sending() -> None:
    core = make_core(2, op_timeout_ms=1000)
    x = np.ones(1000, np.float32)
    t0, t1 = begin(core, 0, x), begin(core, 1, x)
    arrive(core, t0, x, 4000)
    core.finish_push(t0, 0.0)
    arrive(core, t1, x, 100)
    errs = errors(core.tick(2.0))
    assert errs and all("waiting for rank(s) 1" in e.frame.message for e in errs)
    assert core.bytes_held("j") > 0  # rank 1's buffer: its push is still arriving
    arrive(core, t1, x, 4000)
    core.finish_push(t1, 2.0)
    assert core.bytes_held("j") == 0


_OP_REFERENCE = {
    wire.ReduceOp.MIN: np.minimum, wire.ReduceOp.MAX: np.maximum, wire.ReduceOp.PRODUCT: np.multiply,
    wire.ReduceOp.BAND: np.bitwise_and, wire.ReduceOp.BOR: np.bitwise_or, wire.ReduceOp.BXOR: np.bitwise_xor,
}


@settings(max_examples=40, deadline=None)
@given(st.permutations(range(3)), st.sampled_from(sorted(_OP_REFERENCE)), st.sampled_from(["float32", "int32", "int64", "uint8"]),
       st.booleans())
def test_every_op_combines_in_rank_order_whatever_the_arrival_order(order: list[int], op: wire.ReduceOp, dtype: str,
                                                                     pieces: bool) -> None:
    if op in wire.BITWISE_OPS and dtype == "float32":
        return  # refused at the header; see the next test
    core = ReducerCore(INC, piece_bytes=64 if pieces else 0)
    for r in range(3):
        assert core.join(conn_id("j", r), hello(r, 3)) == []
    rng = np.random.default_rng(len(order) + op)
    data = [(rng.standard_normal(257) * 50).astype(dtype) for _ in range(3)]
    actions: list = []  # type: ignore[type-arg]
    for rank in order:
        actions = push(core, rank, data[rank], op=op)
    results = [a for a in actions if isinstance(a, SendResult)]
    assert results, actions
    got = np.concatenate([result_of([res], np.dtype(dtype))[0] for res in results])
    expected = _OP_REFERENCE[op](_OP_REFERENCE[op](data[0], data[1]), data[2])
    assert got.tobytes() == expected.tobytes()


def test_a_bitwise_op_on_floats_is_refused_at_the_header() -> None:
    header = wire.push_header(wire.Push(1, INC, 4, 0, 4, 0, wire.DType.FLOAT32, wire.ReduceOp.BXOR), 16)
    decoder = wire.FrameDecoder()
    decoder.receive_data(header + bytes(16))
    with pytest.raises(RemoteProtocolError, match="bitwise"):
        decoder.next_frame()


def test_ranks_that_disagree_on_the_op_fail_the_chunk_for_both() -> None:
    core = make_core(2)
    assert push(core, 0, np.ones(4, np.float32), op=wire.ReduceOp.MAX) == []
    actions = push(core, 1, np.ones(4, np.float32), op=wire.ReduceOp.MIN)
    errs = errors(actions)
    assert {e.conn for e in errs} == {conn_id("j", 0), conn_id("j", 1)}
    assert all(e.frame.code is wire.ErrorCode.CONTRIBUTION_MISMATCH and "MAX" in e.frame.message for e in errs)


def test_float16_products_are_taken_in_float32_and_rounded_once() -> None:
    core = make_core(3)
    data = [np.full(8, v, np.float16) for v in (np.float16(1.001), np.float16(3.3), np.float16(0.7))]
    actions: list = []  # type: ignore[type-arg]
    for rank in (2, 0, 1):
        actions = push(core, rank, data[rank], op=wire.ReduceOp.PRODUCT)
    out, _, _ = result_of(actions, np.dtype(np.float16))
    expected = (data[0].astype(np.float32) * data[1].astype(np.float32) * data[2].astype(np.float32)).astype(np.float16)
    assert out.tobytes() == expected.tobytes()


def test_the_pool_releases_sizes_nobody_used_for_a_while_even_those_given_back_late() -> None:
    from redsrv.core.reducer import BufferPool

    pool = BufferPool(max_free_bytes=10 * 1024)
    pool.release_idle(0.0)
    held = [pool.take(1024) for _ in range(3)]
    assert pool.release_idle(100.0, idle=5) == 0  # nothing free yet (held elsewhere)
    for buffer in held:
        pool.give(buffer)  # given back long after the take: idle counts from here
    assert pool.free_bytes == 3 * 1024
    assert pool.release_idle(102.0, idle=5) == 0
    assert pool.release_idle(105.0, idle=5) == 3 * 1024 and pool.free_bytes == 0
    for _ in range(20):
        pool.give(np.empty(1024, np.uint8))
    assert pool.free_bytes == 10 * 1024, "the free list is capped in bytes"


def test_safe_is_sent_once_every_rank_acknowledged_a_result() -> None:
    from redsrv.core.reducer import SendSafe

    core = recovering_core(2, piece_bytes=0)
    assert push(core, 0, np.ones(8, np.float32)) == []
    assert [a for a in push(core, 1, np.ones(8, np.float32)) if isinstance(a, SendResult)]
    assert core.ack(conn_id("j", 0), 1) == [], "rank 1 has not said it has the result yet"
    safes = core.ack(conn_id("j", 1), 1)
    assert sorted((a.conn, a.frames) for a in safes if isinstance(a, SendSafe)) == sorted(
        [(conn_id("j", 0), 1), (conn_id("j", 1), 1)])
    assert core.ack(conn_id("j", 1), 1) == [], "said once"


def test_a_restarted_reducer_answers_every_rank_from_a_result_one_rank_settles() -> None:
    """After a restart the reducer has nothing; a rank that already had a chunk's result pushes it
    as SETTLED, and the ranks that lacked it are answered with it, bitwise, whether they pushed
    their contribution before or after."""
    core = recovering_core(3, piece_bytes=0)
    result = (np.arange(16, dtype=np.float32) * 3).view(np.uint8)
    assert push(core, 1, np.arange(16, dtype=np.float32)) == []  # rank 1 lacks the result: it pushes again
    settled = wire.Push(1, INC, 16, 0, 16, 0, wire.DType.FLOAT32, wire.ReduceOp.SETTLED)
    ticket = core.begin_push(conn_id("j", 0), settled, result.nbytes, 0.0)
    assert isinstance(ticket, PushTicket) and ticket.buffer is not None
    ticket.buffer[:] = result
    answered = [a for a in core.finish_push(ticket, 0.0) if isinstance(a, SendResult)]
    assert answered and answered[0].conns == [conn_id("j", 1)] and bytes(answered[0].data) == result.tobytes()
    late = [a for a in push(core, 2, np.arange(16, dtype=np.float32)) if isinstance(a, SendResult)]
    assert late and late[0].conns == [conn_id("j", 2)] and bytes(late[0].data) == result.tobytes()
    again = errors(push(core, 1, np.arange(16, dtype=np.float32)))
    assert again and again[0].frame.code is wire.ErrorCode.STALE, "a rank answered once is not answered twice"


def test_results_kept_for_a_reconnect_give_way_when_a_new_chunk_needs_the_budget() -> None:
    """A worker's ACK can be queued behind the very push that waits for memory: the results kept
    for it are insurance, and must not block the job."""
    core = ReducerCore(INC, job_budget_bytes=1000, piece_bytes=0, rejoin_grace=5.0)
    core.join(conn_id("j", 0), hello(0, 1, **RECONNECT))
    for key in range(3):  # each result (800 B) is kept until acknowledged, and nobody acknowledges
        actions = push(core, 0, np.ones(200, np.float32), key=key + 1)
        for result in (a for a in actions if isinstance(a, SendResult)):
            for _ in result.conns:
                result.release()  # the daemon sent it
    assert core.bytes_held("j") <= 1000


# --- fair shares of the reducer-wide budget, pushes funded as they arrive, slow pushes reclaimed ---

MIB = 1 << 20
ONE_MIB_F32 = MIB // 4


def shared_core(budget_mib: float, jobs: dict[str, int], **kw) -> ReducerCore:  # type: ignore[no-untyped-def]
    """A reducer with a reducer-wide budget of ``budget_mib`` MiB and the jobs ``{name: world}``."""
    core = ReducerCore(INC, memory_budget_bytes=int(budget_mib * MIB), job_budget_bytes=int(budget_mib * MIB), **kw)
    for job, world in jobs.items():
        for r in range(world):
            assert core.join(conn_id(job, r), hello(r, world, job)) == []
    return core


def open_push(core: ReducerCore, job: str, rank: int, nbytes: int, *, key: int, now: float = 0.0):  # type: ignore[no-untyped-def]
    """A push header of ``nbytes`` (float32) for ``key``: the ticket, refusal, or None (it waits)."""
    count = nbytes // 4
    return core.begin_push(conn_id(job, rank), wire.Push(key, INC, count, 0, count, 0, wire.DType.FLOAT32), nbytes, now)


def land(core: ReducerCore, ticket: PushTicket, data: np.ndarray, upto: int, now: float) -> list:  # type: ignore[type-arg]
    """What the daemon does as the payload arrives up to ``upto`` bytes: copy within what is
    funded, report progress, ask for the next step when the funded part is full."""
    assert ticket.buffer is not None
    raw = data.view(np.uint8).reshape(-1)
    actions: list = []  # type: ignore[type-arg]
    done = ticket.received
    while done < upto:
        if done == ticket.limit:
            actions += core.progress(ticket, done, now)
            assert core.extend(ticket, now) > done, "the next step was not funded"
        stop = min(upto, ticket.limit)
        ticket.buffer[done:stop] = raw[done:stop]
        done = stop
        actions += core.progress(ticket, done, now)
    return actions


def test_a_push_announcing_more_than_a_step_is_funded_as_its_bytes_arrive() -> None:
    """Memory backs the bytes that arrived and the step being received, not the announced size:
    two 6 MiB headers (more than is ever funded whole) hold 2 MiB of a 12 MiB budget, so another
    job's chunk still fits, and the sums of the pieces are exact."""
    assert 6 * MIB > C.WHOLE_FUNDING_MAX_BYTES
    core = shared_core(12, {"big": 2, "small": 1})
    data = [np.full(6 * ONE_MIB_F32, r + 1.5, np.float32) for r in range(2)]
    tickets = [open_push(core, "big", r, 6 * MIB, key=1) for r in range(2)]
    assert all(isinstance(t, PushTicket) and t.limit == MIB for t in tickets) and core.bytes_held("big") == 2 * MIB
    assert isinstance(tickets[0].buffer.base.obj, mmap.mmap), "fresh memory, whose pages exist once written"
    other = open_push(core, "small", 0, MIB // 2, key=7)
    assert isinstance(other, PushTicket), "two whole 6 MiB charges for the headers would have left no room"
    other.buffer[:] = np.ones(MIB // 8, np.float32).view(np.uint8)
    result_of(core.finish_push(other, 0.0), np.dtype(np.float32))
    core.tick(6.0)  # job small is idle: job big may have the whole budget again
    land(core, tickets[0], data[0], 2 * MIB + 100, 6.0)
    assert core.bytes_held("big") == 4 * MIB  # rank 0: 2 MiB and 100 bytes in, with the step being received
    actions = land(core, tickets[0], data[0], 6 * MIB, 6.0) + core.finish_push(tickets[0], 6.0)
    actions += land(core, tickets[1], data[1], 6 * MIB, 6.0) + core.finish_push(tickets[1], 6.0)
    got = np.concatenate([np.frombuffer(bytes(piece.payload), np.float32) for piece in pieces_of(actions)])
    assert got.tobytes() == (data[0] + data[1]).tobytes()
    assert core.bytes_held("big") == 0 and core.bytes_held_total == 0


def test_a_push_of_up_to_a_few_steps_is_funded_whole_at_its_header_or_waits_there() -> None:
    """A push of up to constants.WHOLE_FUNDING_MAX_BYTES (a 4 MiB chunk) is funded whole at its
    header, in pooled memory (fresh memory costs a fault per page), where it fits; where it does
    not, it waits at its header with none of its payload read, never funded step by step: a push
    paused mid-payload at its job's share is dropped under pressure, and with 4 MiB chunks that
    failed an honest job under the fair-share attack. A push joining an open chunk is funded
    whole whatever the budgets, as any push to an open chunk proceeds (it is what closes it)."""
    def fresh(ticket: PushTicket) -> bool:
        return isinstance(getattr(ticket.buffer.base, "obj", None), mmap.mmap)

    core = shared_core(6, {"c": 3})
    whole = open_push(core, "c", 0, 4 * MIB, key=1)
    assert isinstance(whole, PushTicket) and whole.limit == 4 * MIB and not fresh(whole)
    assert open_push(core, "c", 1, 4 * MIB, key=2) is None, "a new chunk: 8 MiB would not fit the 6 MiB budget"
    assert core.bytes_held("c") == 4 * MIB and core.memory().waiting == 1
    join = open_push(core, "c", 2, 4 * MIB, key=1)
    assert isinstance(join, PushTicket) and join.limit == 4 * MIB and core.bytes_held("c") == 8 * MIB
    actions: list = []  # type: ignore[type-arg]
    for rank, ticket in ((0, whole), (2, join)):
        ticket.buffer[:] = np.full(4 * ONE_MIB_F32, rank + 0.5, np.float32).view(np.uint8)
        actions += core.progress(ticket, 4 * MIB, 0.0) + core.finish_push(ticket, 0.0)
    # rank 1 has not pushed key 1 yet (its connection waits at key 2's header): the chunk stays open
    assert core.open_chunks("c") == 1
    assert open_push(core, "c", 1, 4 * MIB, key=2) is None, "still no room while key 1 holds 8 MiB"
    assert not any(isinstance(a, SendError) for a in actions)


def test_a_job_within_its_fair_share_gets_memory_a_job_over_it_waits_for() -> None:
    core = shared_core(8, {"a": 2, "b": 1})
    for key in range(6):  # alone, job a may use the whole budget: 6 MiB of chunks waiting for rank 1
        assert isinstance(open_push(core, "a", 0, MIB, key=key), PushTicket)
    assert core.fair_share() == 8 * MIB
    first_b = open_push(core, "b", 0, MIB, key=1)  # b is active now: shares are 4 MiB each
    assert isinstance(first_b, PushTicket) and core.fair_share() == 4 * MIB
    assert open_push(core, "a", 0, MIB, key=99) is None, "a holds 6 MiB, over its share, with b's share kept for b"
    (wait,) = core._waiting.values()
    assert "past its fair share of 4194304" in wait.why and not wait.within_share
    assert isinstance(open_push(core, "b", 0, MIB, key=2), PushTicket), "b is within its share: it is served first"
    assert core.stats("a").memory_waits == 1 and core.stats("b").memory_waits == 0


def test_the_fair_share_is_never_below_one_chunk() -> None:
    core = shared_core(8, {f"job-{i}": 1 for i in range(20)})
    for i in range(20):
        assert isinstance(open_push(core, f"job-{i}", 0, 4096, key=1), PushTicket)
    assert core.memory().active_jobs == 20 and core.fair_share() == MIB  # not 8 MiB / 20


def test_a_new_job_waits_within_its_operation_timeout_before_it_is_refused_naming_the_budget() -> None:
    core = shared_core(2, {"a": 2}, min_push_rate=0)  # nothing reclaimed: only the wait's bound is left
    core.join(conn_id("late", 0), hello(0, 1, "late", op_timeout_ms=30_000))
    for key in range(2):
        assert isinstance(open_push(core, "a", 0, MIB, key=key), PushTicket)
    assert open_push(core, "late", 0, MIB, key=1, now=1.0) is None
    assert errors(core.tick(20.0)) == [], "the send-stall bound (10 s) no longer refuses a job that may wait"
    assert open_push(core, "late", 0, MIB, key=1, now=20.0) is None
    (refusal,) = errors(core.tick(31.5))
    assert refusal.conn == conn_id("late", 0) and refusal.close_after and refusal.frame.code is wire.ErrorCode.OVERLOADED
    assert "waiting 30.5s" in refusal.frame.message and "memory budget of 2097152 (--memory-budget)" in refusal.frame.message
    assert core.stats("late").memory_refusals == 1


def slow_setup(core: ReducerCore) -> tuple[PushTicket, np.ndarray]:
    """Job a: rank 1's 1 MiB contribution is in, rank 0's push of it delivered 1000 bytes at t=0."""
    data = [np.full(ONE_MIB_F32, r + 1, np.float32) for r in range(2)]
    t1 = open_push(core, "a", 1, MIB, key=1)
    assert isinstance(t1, PushTicket)
    land(core, t1, data[1], MIB, 0.0)
    assert core.finish_push(t1, 0.0) == []
    t0 = open_push(core, "a", 0, MIB, key=1)
    assert isinstance(t0, PushTicket)
    land(core, t0, data[0], 1000, 0.0)
    return t0, data[0]


def test_without_memory_pressure_a_slow_push_is_never_dropped() -> None:
    core = shared_core(2.5, {"a": 2}, slow_push_grace=1.0)
    t0, data = slow_setup(core)
    for now in (1.0, 5.0, 60.0):
        assert errors(core.tick(now)) == []
    actions = land(core, t0, data, MIB, 60.0) + core.finish_push(t0, 60.0)
    out, _, _ = result_of([a for a in actions if isinstance(a, SendResult)][-1:], np.dtype(np.float32))
    assert out.tolist()[-3:] == [3.0, 3.0, 3.0]  # the tail piece of the exact sum


def test_under_pressure_a_push_slower_than_the_minimum_rate_is_dropped_and_its_job_told() -> None:
    core = shared_core(2.5, {"a": 2, "b": 1}, slow_push_grace=1.0)
    t0, _ = slow_setup(core)
    assert open_push(core, "b", 0, MIB, key=1, now=0.5) is None  # within its share; the budget is held by a
    assert errors(core.tick(0.6)) == [], "no push has been slow for a whole grace yet"
    actions = core.tick(1.05)
    errs = errors(actions)
    dropped = next(e for e in errs if e.conn == conn_id("a", 0) and e.close_after)
    assert dropped.frame.code is wire.ErrorCode.OVERLOADED and dropped.frame.fatal
    assert "arrived at 952 B/s over the last 1.0s, under the minimum of 65536 B/s (REDSRV_MIN_PUSH_RATE)" in dropped.frame.message
    told = [e for e in errs if e.conn == conn_id("a", 1)]
    assert told and told[0].frame.code is wire.ErrorCode.OVERLOADED and "rank 0 of job 'a'" in told[0].frame.message
    core.abort_push(t0)  # the daemon closes the connection ...
    core.leave(conn_id("a", 0), dropped.frame.message, 1.05)  # ... and its rank keeps no place
    assert core.bytes_held("a") == 0 and core.stats("a").pushes_dropped == 1
    assert isinstance(open_push(core, "b", 0, MIB, key=1, now=1.1), PushTicket)


def test_under_pressure_a_slow_but_honest_push_above_the_minimum_rate_is_kept() -> None:
    """A link far slower than the cluster's but above the minimum rate (128 KiB/s against 64) keeps
    its push under pressure, window after window, and its sum is exact."""
    core = shared_core(2.5, {"a": 2, "b": 1}, slow_push_grace=1.0)
    t0, data = slow_setup(core)
    assert open_push(core, "b", 0, MIB, key=1, now=0.5) is None  # pressure from now on
    for second in range(1, 8):
        land(core, t0, data, 1000 + second * 128 * 1024, float(second))
        assert errors(core.tick(second + 0.01)) == [], f"dropped after {second}s"
    actions = land(core, t0, data, MIB, 8.0) + core.finish_push(t0, 8.0)
    out, _, _ = result_of([a for a in actions if isinstance(a, SendResult)][-1:], np.dtype(np.float32))
    assert out.tolist()[-3:] == [3.0, 3.0, 3.0] and core.stats("a").pushes_dropped == 0


def test_under_pressure_a_stalled_chunk_of_a_job_over_its_share_is_failed_not_one_within_it() -> None:
    """A rank that hangs leaves its job's chunks holding memory; a job over its fair share gives
    it back while a job within its share waits, oldest chunk first, until it is within its share."""
    core = shared_core(4, {"a": 2, "c": 2}, slow_push_grace=1.0)
    for key in range(3):  # a's rank 0 contributes, its rank 1 hangs: 3 MiB held
        t = open_push(core, "a", 0, MIB, key=key)
        land(core, t, np.ones(ONE_MIB_F32, np.float32), MIB, 0.0)
        core.finish_push(t, 0.0)
    t = open_push(core, "c", 0, MIB // 2, key=1, now=0.2)  # c's rank 1 is late too, but c is within its share
    land(core, t, np.ones(ONE_MIB_F32 // 2, np.float32), MIB // 2, 0.2)
    core.finish_push(t, 0.2)
    assert open_push(core, "c", 0, MIB, key=2, now=0.5) is None  # 2 MiB shares: c within its, the budget full
    errs = errors(core.tick(1.5))
    assert {e.conn for e in errs} == {conn_id("a", 0)}, errs
    (err,) = errs
    assert err.frame.code is wire.ErrorCode.OVERLOADED and not err.frame.fatal and err.frame.key == 0
    assert "over its fair share of 2097152" in err.frame.message and "waiting for rank(s) 1" in err.frame.message
    assert core.bytes_held("a") == 2 * MIB and core.open_chunks("c") == 1
    assert core.stats("a").chunks_reclaimed == 1 and core.stats("a").bytes_reclaimed == MIB
    assert isinstance(open_push(core, "c", 0, MIB, key=2, now=1.6), PushTicket)


def test_a_push_paused_over_its_share_under_pressure_is_dropped_after_the_grace() -> None:
    core = shared_core(4, {"a": 1, "b": 1}, slow_push_grace=1.0)
    t = open_push(core, "a", 0, 8 * MIB, key=1)  # alone, a's push may fill the budget as it arrives
    pieces_of(land(core, t, np.ones(8 * ONE_MIB_F32, np.float32), 4 * MIB, 0.0))  # sent (a has one rank)
    assert open_push(core, "b", 0, MIB // 2, key=1, now=0.1) is None  # b within its share: the budget is full
    assert core.fair_share() == 2 * MIB
    assert core.extend(t, 0.2) == WAIT_FOR_MEMORY, "a holds 4 MiB, over its share of 2 MiB"
    assert errors(core.tick(1.0)) == [], "paused for less than the grace"
    (dropped,) = errors(core.tick(1.3))
    assert dropped.conn == conn_id("a", 0) and dropped.close_after and dropped.frame.code is wire.ErrorCode.OVERLOADED
    assert ("waited 1.1s for memory while its job held 4194304 bytes, so that its next step would take it past its "
            "fair share of 2097152") in dropped.frame.message
    core.abort_push(t)
    core.leave(conn_id("a", 0), dropped.frame.message, 1.3)
    assert core.bytes_held("a") == 0
    assert isinstance(open_push(core, "b", 0, MIB // 2, key=1, now=1.4), PushTicket)


def test_a_job_a_fraction_of_a_claim_below_its_share_is_owed_its_next_claim() -> None:
    """Two jobs on a 7 MiB budget: each share is 3.5 MiB, not a whole number of 1 MiB claims.
    Each holds 3 MiB in chunks that wait for their second rank. A fourth claim takes a job past
    its share, yet a job below its share is owed it: it declares pressure while it waits. With
    "within its share after the claim" neither job counted as within it: the free megabyte sat
    idle and, no job being within its share, no pressure was declared and nothing slow was
    reclaimed until the waits timed out (under the fair-share attack with 16 MiB steps a new
    job's first step took 236 s). The half megabyte past a's share is b's while b may still
    claim it; once both wait past their shares, the first to wait is served."""
    core = shared_core(7, {"a": 2, "b": 2})
    for job in ("a", "b"):
        for key in range(3):
            ticket = open_push(core, job, 0, MIB, key=key)
            assert isinstance(ticket, PushTicket)
            ticket.buffer[:] = np.ones(ONE_MIB_F32, np.float32).view(np.uint8)
            core.progress(ticket, MIB, 0.0)
            core.finish_push(ticket, 0.0)
    assert core.fair_share() == 7 * MIB // 2 and core.bytes_held_total == 6 * MIB and core.open_chunks("a") == 3
    assert open_push(core, "a", 0, MIB, key=3, now=0.1) is None, "half of it would be b's share"
    assert core.memory().pressure, "a waits below its share: pressure, under which slow pushes are reclaimed"
    assert "524288 bytes are kept for the other jobs' shares" in core._waiting[conn_id("a", 0)].why
    assert open_push(core, "b", 0, MIB, key=3, now=0.2) is None, "a waited first"
    fourth = open_push(core, "a", 0, MIB, key=3, now=0.2)  # asked again: b waits past its share too
    assert isinstance(fourth, PushTicket) and core.bytes_held("a") == 4 * MIB
    assert open_push(core, "b", 0, MIB, key=3, now=0.3) is None and core._waiting[conn_id("b", 0)].within_share
    assert open_push(core, "a", 1, MIB, key=9) is None
    assert not core._waiting[conn_id("a", 1)].within_share, "a, past its share, waits as a job over it"


def step_of(core: ReducerCore, job: str, world: int, nbytes: int, key: int, now: float) -> float:
    """Every rank of ``job`` pushes ``nbytes`` for ``key``; each result is sent (its memory
    freed). Returns the sum's value (rank r pushes r + 1)."""
    actions: list = []  # type: ignore[type-arg]
    for rank in range(world):
        got = push(core, rank, np.full(nbytes // 4, rank + 1, np.float32), key=key, job=job, now=now)
        assert isinstance(got, list) and not errors(got), got
        actions += got
    results = [a for a in actions if isinstance(a, SendResult)]
    values = {float(np.frombuffer(bytes(r.data), np.float32)[0]) for r in results}
    for result in results:
        for _ in result.conns:
            result.release()
    (value,) = values
    return value


def test_slow_pushes_of_a_chunk_larger_than_their_share_leave_the_other_jobs_shares_free() -> None:
    """The fair-share smoke's attack (``redsrv bench sessions --only fair_share --attack-announce
    4MiB --memory-budget 8MiB``): eight slow pushes, each a job of its own, announce a whole
    4 MiB chunk, funded whole at its header, against a 1 MiB share of an 8 MiB budget. A push
    below its share opening a chunk is owed it, but the part past the share leaves the other
    jobs room for theirs: one slow push holds 4 MiB, the others wait (declaring pressure), and
    job j's next step is served at once. Before, such a push took memory whatever the other
    shares, two of them held the whole budget and each of j's steps waited for one to be judged
    slow (10 s in the smoke, which failed CI when a step waited longer still)."""
    core = shared_core(8, {"j": 2, **{f"x{i}": 1 for i in range(8)}}, piece_bytes=0)
    assert step_of(core, "j", 2, 64 * 1024, key=1, now=0.0) == 3.0
    funded = [x for x in range(8) if isinstance(open_push(core, f"x{x}", 0, 4 * MIB, key=1, now=0.1), PushTicket)]
    assert funded == [0] and core.fair_share() == MIB and core.bytes_held_total == 4 * MIB
    assert core.memory().pressure and all(w.within_share for w in core._waiting.values())
    assert "kept for the other jobs' shares" in core._waiting[conn_id("x1", 0)].why
    assert step_of(core, "j", 2, 64 * 1024, key=2, now=0.2) == 3.0, "j's share was kept for it"


def test_jobs_whose_chunks_exceed_their_shares_do_not_keep_the_memory_for_one_another() -> None:
    """Three jobs each open 4 MiB chunks against 1.7 MiB shares of a 5 MiB budget: each claim
    is past its share and each job lacks its share. Were every job kept its share against the
    others, each claim would wait for the others' shares and the free budget would sit idle until
    the waits were refused; the job that waited first is served, and the others wait for it."""
    core = shared_core(5, {"a": 2, "b": 2, "c": 2}, piece_bytes=0)
    for key, job in enumerate("abc"):
        assert step_of(core, job, 2, 64 * 1024, key=key, now=0.0) == 3.0
    for when, job in enumerate("abc"):
        assert open_push(core, job, 0, 4 * MIB, key=10, now=0.1 + when / 10) is None, f"{job}: the others' shares are kept"
    assert core.memory().pressure
    for job in "cba":  # asked again, in any order: a waited first
        got = open_push(core, job, 0, 4 * MIB, key=10, now=0.5)
        assert isinstance(got, PushTicket) == (job == "a"), job
    assert core.bytes_held("a") == 4 * MIB and core.memory().waiting == 2


def test_a_paused_push_does_not_take_a_step_past_its_share_and_gives_way_to_a_job_within_it() -> None:
    """A push funded as it arrives stays within its share only where its next step ends within
    it. a's 6 MiB push holds 2 MiB, its share is 2.33 MiB (7 MiB over three jobs): its next step
    waits, although two megabytes are free. When c waits within its share, a's paused push is
    dropped after the grace. A paused push was judged only at or over its share before, so one
    paused a fraction of a step below its share held its memory for as long as it liked."""
    core = shared_core(7, {"a": 1, "b": 2, "c": 2}, slow_push_grace=1.0)
    a = open_push(core, "a", 0, 6 * MIB, key=1)
    assert isinstance(a, PushTicket) and a.limit == MIB
    pieces_of(land(core, a, np.ones(6 * ONE_MIB_F32, np.float32), 2 * MIB, 0.0))

    def pushed(job: str, rank: int, nbytes: int, key: int, now: float) -> None:  # all in; its chunk waits for the other rank
        ticket = open_push(core, job, rank, nbytes, key=key, now=now)
        assert isinstance(ticket, PushTicket), ticket
        ticket.buffer[:] = np.ones(nbytes // 4, np.float32).view(np.uint8)
        core.progress(ticket, nbytes, now)
        core.finish_push(ticket, now)

    pushed("b", 0, 2 * MIB, 1, 0.0)
    pushed("c", 0, MIB, 1, 0.0)
    assert core.bytes_held("a") == 2 * MIB and core.bytes_held_total == 5 * MIB and core.fair_share() == 7 * MIB // 3
    assert core.extend(a, 0.1) == WAIT_FOR_MEMORY, "its step would take a past its share"
    assert not core.memory().pressure, "a's step is not owed to it"
    assert open_push(core, "c", 1, 3 * MIB, key=2, now=0.3) is None and core.memory().pressure
    assert errors(core.tick(1.0)) == [], "paused for less than the grace"
    (dropped,) = errors(core.tick(1.2))
    assert dropped.conn == conn_id("a", 0) and dropped.frame.code is wire.ErrorCode.OVERLOADED
    assert "held 2097152 bytes, so that its next step would take it past its fair share" in dropped.frame.message


def test_a_job_over_its_share_only_by_its_own_unacknowledged_results_is_not_left_waiting_on_itself() -> None:
    """A worker acknowledges results on the connection that carries its next push, and a push
    waiting for memory is not read: the acknowledgement waits behind it. Job a (one rank, kept
    results for a reconnect) holds its 4 MiB share in four results its worker has not
    acknowledged; its next chunk is beyond its share, and job b's share is kept. Before, a waited
    (over its share, so without pressure: nothing was reclaimed) until the wait timed out; the
    fair-share attack with 16 MiB steps showed it as a 236 s first step. Now the results kept
    for a's own reconnect give way, as they do when the budget itself is short."""
    core = ReducerCore(INC, memory_budget_bytes=8 * MIB, job_budget_bytes=8 * MIB, piece_bytes=0)
    core.join(conn_id("a", 0), hello(0, 1, "a", **RECONNECT))
    core.join(conn_id("b", 0), hello(0, 2, "b"))
    assert isinstance(open_push(core, "b", 0, MIB // 2, key=1), PushTicket)  # b is active: shares are 4 MiB
    for key in range(4):
        for result in (a for a in push(core, 0, np.ones(ONE_MIB_F32, np.float32), key=key + 1, job="a")
                       if isinstance(a, SendResult)):
            for _ in result.conns:
                result.release()  # the daemon sent it; the worker's ACK is behind its next push
    assert core.bytes_held("a") == 4 * MIB and core.fair_share() == 4 * MIB
    ticket = open_push(core, "a", 0, MIB, key=9, now=0.1)
    assert isinstance(ticket, PushTicket), "a's unacknowledged results gave way"
    assert core.bytes_held("a") == 4 * MIB, "one of them, the oldest, was enough"


def test_pushes_paused_at_exactly_their_share_give_way_to_a_new_job_where_the_floor_overcommits() -> None:
    """Three active jobs on a 2 MiB budget: a share is the 1 MiB floor, so the shares add up to
    more than the budget. a and b each hold exactly their share, paused for their next MiB (a
    slow pusher looks just so: it is not read, so it shows no rate); c, holding nothing, waits.
    After the grace one of the paused pushes is dropped and c is served. With the paused rule
    at "over its share" only, nobody was ever dropped and c waited for its operation timeout."""
    core = shared_core(2, {"a": 1, "b": 1, "c": 1}, slow_push_grace=1.0)
    tickets = {}
    for job in ("a", "b"):
        t = tickets[job] = open_push(core, job, 0, 6 * MIB, key=1)  # above WHOLE_FUNDING_MAX_BYTES: in steps
        pieces_of(land(core, t, np.ones(6 * ONE_MIB_F32, np.float32), MIB, 0.0))
    assert open_push(core, "c", 0, MIB // 2, key=1, now=0.1) is None  # c within its share; the budget is full
    assert core.fair_share() == MIB and core.bytes_held("a") == core.bytes_held("b") == MIB
    for job in ("a", "b"):
        assert core.extend(tickets[job], 0.2) == WAIT_FOR_MEMORY, f"{job} is at its share"
    assert errors(core.tick(1.0)) == [], "paused for less than the grace"
    dropped = errors(core.tick(1.3))
    assert dropped and {e.conn for e in dropped} <= {conn_id("a", 0), conn_id("b", 0)}, dropped
    assert all(e.frame.code is wire.ErrorCode.OVERLOADED and "past its fair share" in e.frame.message for e in dropped)
    for e in dropped:
        job = "a" if e.conn == conn_id("a", 0) else "b"
        core.abort_push(tickets[job])
        core.leave(e.conn, e.frame.message, 1.3)
    assert isinstance(open_push(core, "c", 0, MIB // 2, key=1, now=1.4), PushTicket)


def test_memory_contention_is_logged_naming_who_holds_the_memory() -> None:
    core = shared_core(2, {"a": 2, "b": 1}, min_push_rate=0)
    for key in range(2):
        open_push(core, "a", 0, MIB, key=key)
    assert open_push(core, "b", 0, MIB, key=1) is None
    logs = [a.message for a in core.tick(0.1) if isinstance(a, Log)]
    assert any("memory contended" in m and "job 'a' holds 2.0 MiB" in m and "1 push(es) waiting" in m for m in logs), logs
    state = core.memory()
    assert state.pressure and state.waiting == 1 and state.held == 2 * MIB and state.fair_share == MIB


def test_a_late_push_to_a_closed_chunk_takes_no_memory() -> None:
    core = make_core(1)
    result_of(push(core, 0, np.ones(4, np.float32)), np.dtype(np.float32))
    late = core.begin_push(conn_id("j", 0), wire.Push(1, INC, 4, 0, 4, 0, wire.DType.FLOAT32), 16, 0.0)
    assert isinstance(late, PushTicket) and late.buffer is None and late.skip == 16 and core.bytes_held("j") == 0
    assert errors(core.finish_push(late, 0.0))[0].frame.code is wire.ErrorCode.STALE


# --- chunk states (core/reducer_chunks.py: CHUNK_TRANSITIONS) ---


def test_each_chunk_state_allows_exactly_the_events_of_the_transition_table() -> None:
    from redsrv.core.reducer import CHUNK_TRANSITIONS, ChunkState, ChunkStateError
    from redsrv.core.reducer_chunks import _Closed, _RankOrderChunk, _Shape

    assert set(CHUNK_TRANSITIONS) == set(ChunkState), "every state has its row"
    assert CHUNK_TRANSITIONS[ChunkState.OPEN] == {"contribute": ChunkState.OPEN, "close": ChunkState.CLOSED,
                                                   "fail": ChunkState.FAILED}
    assert not {"contribute", "close", "fail"} & (set(CHUNK_TRANSITIONS[ChunkState.CLOSED])
                                                  | set(CHUNK_TRANSITIONS[ChunkState.FAILED])), "an ended chunk stays ended"
    events = {event for row in CHUNK_TRANSITIONS.values() for event in row}
    shape = _Shape(4, 0, 4, wire.DType.FLOAT32, wire.ReduceOp.SUM, 0)
    for state in ChunkState:
        for event in sorted(events):
            chunk = _RankOrderChunk(1, 0, shape, 0, 0.0, state=state)
            allowed = CHUNK_TRANSITIONS[state].get(event)
            if allowed is not None:
                assert chunk.transition(event) is allowed and chunk.state is allowed
                continue
            with pytest.raises(ChunkStateError, match=f"is {state.value}: it cannot {event}"):
                chunk.transition(event)
            assert chunk.state is state, "a refused event leaves the chunk as it was"
            closed = _Closed(state) if state is not ChunkState.OPEN else None
            if closed is not None:
                with pytest.raises(ChunkStateError):
                    closed.expect(event)


def test_a_closed_chunk_refuses_a_payload_and_a_repeat_push_is_stale_as_before() -> None:
    """Cut-through: the chunk a push joined at its header ends CLOSED once every rank is in;
    feeding it another payload is a bug the state table refuses, and the wire answer to a repeat
    push is STALE, never a second sum."""
    from redsrv.core.reducer import ChunkState, ChunkStateError

    core = make_core(2)
    data = np.arange(8, dtype=np.float32)
    tickets = [begin_on(core, conn_id("j", r), data) for r in range(2)]
    assert all(isinstance(t, PushTicket) and t.part is not None for t in tickets)
    chunk = tickets[0].part.chunk
    assert chunk is not None and chunk.state is ChunkState.OPEN
    actions: list = []  # type: ignore[type-arg]
    for ticket in tickets:
        ticket.buffer[:] = data.view(np.uint8)
        actions += core.finish_push(ticket, 0.0)
    out, _, _ = result_of(actions, np.dtype(np.float32))
    assert out.tolist() == (2 * data).tolist()
    assert chunk.state is ChunkState.CLOSED and tickets[0].part.chunk is None
    with pytest.raises(ChunkStateError, match="is closed: it cannot contribute"):
        chunk.attach(tickets[0].part, conn_id("j", 0), 0.0)
    with pytest.raises(ChunkStateError, match="is closed: it cannot fail"):
        chunk.transition("fail")
    assert chunk.state is ChunkState.CLOSED
    again = push(core, 0, data)
    assert [e.frame.code for e in errors(again)] == [wire.ErrorCode.STALE] and not [
        a for a in again if isinstance(a, SendResult)], "a push to a closed chunk is answered, not summed"
    assert core.open_chunks("j") == 0 and core.bytes_held("j") == 0


def test_a_whole_payload_chunk_takes_no_payload_once_closed_or_failed() -> None:
    """Straggler modes and broadcasts: the chunk that took whole payloads refuses one after it
    closed; a failed chunk answers a later push with its own error."""
    from redsrv.core.reducer import ChunkState, ChunkStateError

    core = make_core(3, mode=wire.StragglerMode.FIRST_M, min_contributors=2)
    data = np.ones(4, np.float32)
    assert push(core, 1, data) == []
    job = core._jobs["j"]
    (chunk,) = job.open.values()
    assert type(chunk).__name__ == "_RankOrderChunk" and chunk.state is ChunkState.OPEN
    result_of(push(core, 2, data), np.dtype(np.float32))
    assert chunk.state is ChunkState.CLOSED
    with pytest.raises(ChunkStateError, match="is closed: it cannot contribute"):
        chunk.add(core, job, 0, np.ones(16, np.uint8))
    assert chunk.contributors == 0b110 and chunk.state is ChunkState.CLOSED

    assert push(core, 0, np.ones(4, np.float32), key=2) == []
    failing = job.open[(2, 0)]
    errs = errors(push(core, 1, np.ones(4, np.float64), key=2))
    assert errs and errs[0].frame.code is wire.ErrorCode.CONTRIBUTION_MISMATCH
    assert failing.state is ChunkState.FAILED and job.closed[(2, 0)].state is ChunkState.FAILED
    with pytest.raises(ChunkStateError, match="is failed: it cannot close"):
        failing.transition("close")
    later = errors(push(core, 2, np.ones(4, np.float32), key=2))
    assert [e.frame for e in later] == [errs[0].frame], "a failed chunk answers with the error it failed with"


def test_each_accumulation_mode_is_its_own_type() -> None:
    from redsrv.core.reducer_chunks import _BroadcastChunk, _CutThroughChunk, _RankOrderChunk

    core = make_core(2)
    assert push(core, 1, np.ones(4, np.float32), key=1, op=wire.ReduceOp.BROADCAST, root=0) == []
    assert isinstance(begin_on(core, conn_id("j", 0), np.ones(4, np.float32), key=2), PushTicket)
    straggling = make_core(2, mode=wire.StragglerMode.DEADLINE, min_contributors=1, deadline_ms=1000)
    assert push(straggling, 0, np.ones(4, np.float32)) == []
    kinds = {key: type(chunk) for (key, _), chunk in core._jobs["j"].open.items()}
    assert kinds == {1: _BroadcastChunk, 2: _CutThroughChunk}
    assert [type(c) for c in straggling._jobs["j"].open.values()] == [_RankOrderChunk]
