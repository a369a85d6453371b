"""Small messages go whole to one reducer chosen by key; large ones are spread over the fleet.
Either way every rank gets the exact sum."""

from __future__ import annotations

import numpy as np
import pytest

import redsrv
from redsrv.core import constants as C

from tests_support import poll

pytestmark = pytest.mark.timeout(60)


def _bytes_in(daemons: list[redsrv.ReducerDaemon], job: str) -> list[int]:
    """Push payload bytes each reducer has received for ``job``."""
    counts = []
    for daemon in daemons:
        entry = daemon.snapshot().get(job)
        counts.append(0 if entry is None else entry["stats"].bytes_in)  # type: ignore[attr-defined]
    return counts


def test_small_messages_go_whole_to_the_reducer_their_key_names_and_large_ones_to_all() -> None:
    daemons = [redsrv.ReducerDaemon(redsrv.DaemonSettings(host="127.0.0.1", port=0, close_timeout=2)) for _ in range(3)]
    addresses = [f"{h}:{p}" for h, p in (d.start() for d in daemons)]
    clients: list[redsrv.Client] = []
    try:
        clients = [redsrv.Client(addresses, rank=r, world_size=2, job="placement") for r in range(2)]

        def reduce(size: int, key: int) -> None:
            futures = [c.allreduce_async(np.full(size, r + 1, dtype=np.float32), key=key) for r, c in enumerate(clients)]
            for c, f in zip(clients, futures):
                assert np.array_equal(c.wait(f), np.full(size, 3, dtype=np.float32))

        def counted(want: list[int]) -> list[int]:
            # A reducer's forwarder sends a chunk's sum as its last byte lands, and the state machine
            # counts that push's bytes at the end of the same read: wait for that read to end.
            poll(lambda: _bytes_in(daemons, "placement") == want, 5, f"bytes in {want}", every=0.01)
            return want

        seen = _bytes_in(daemons, "placement")
        for key in range(6):
            reduce(1000, key)  # 4000 bytes: one span, on the reducer its key names
            seen = counted([s + (2 * 4000 if i == key % 3 else 0) for i, s in enumerate(seen)])
        large = 3 * C.MIN_SPAN_BYTES // 4
        reduce(large, 100)  # spread over every reducer
        counted([s + 2 * C.MIN_SPAN_BYTES for s in seen])
    finally:
        for c in clients:
            c.close()
        for d in daemons:
            d.stop()


def _chunks_closed(daemons: list[redsrv.ReducerDaemon], job: str) -> int:
    return sum(d.snapshot()[job]["stats"].chunks_closed for d in daemons)  # type: ignore[attr-defined]


def test_chunks_per_span_sets_how_finely_a_large_message_is_cut() -> None:
    """``chunks_per_span`` (REDSRV_CHUNKS_PER_SPAN) is what the plan uses: twice as many full
    chunks per span give twice the full chunks (the ramps at both ends of a span stay), and the
    sums stay exact."""
    daemons = [redsrv.ReducerDaemon(redsrv.DaemonSettings(host="127.0.0.1", port=0, close_timeout=2)) for _ in range(2)]
    addresses = [f"{h}:{p}" for h, p in (d.start() for d in daemons)]
    size = 2 * 8 * 2**20 // 4  # 8 MiB of float32 per reducer span
    closed: dict[int, int] = {}
    try:
        for per_span in (8, 16):
            job = f"per-span-{per_span}"
            clients = [redsrv.Client(addresses, rank=r, world_size=2, job=job, chunks_per_span=per_span) for r in range(2)]
            try:
                futures = [c.allreduce_async(np.full(size, r + 1, dtype=np.float32), key=1) for r, c in enumerate(clients)]
                for c, f in zip(clients, futures):
                    assert np.array_equal(c.wait(f), np.full(size, 3, dtype=np.float32))
            finally:
                for c in clients:
                    c.close()
            closed[per_span] = _chunks_closed(daemons, job)
            full = 8 * 2**20 // per_span  # 1 MiB and 512 KiB: within MIN_FULL_CHUNK_BYTES..chunk_bytes
            assert 2 * (8 * 2**20 // full) <= closed[per_span] <= 2 * (8 * 2**20 // full + 8)  # plus the ramps
    finally:
        for d in daemons:
            d.stop()
    assert closed[16] - closed[8] >= 8  # 8 more full chunks per span, one ramp step fewer at each end


@pytest.mark.parametrize(("mode", "per_span"), [("all", 1), ("first_m", 32)])
def test_by_default_full_chunks_are_chunk_bytes_where_reducers_cut_through_and_32_per_span_elsewhere(
        mode: str, per_span: int) -> None:
    """With cut-through (straggler mode ``all``) a span has no one-chunk tail to bound, so a
    message of a few MiB goes in full chunks of ``chunk_bytes`` instead of 32 small ones per span
    (constants.CHUNKS_PER_SPAN); where results leave whole (first_m here) 32 per span stay."""
    daemons = [redsrv.ReducerDaemon(redsrv.DaemonSettings(host="127.0.0.1", port=0, close_timeout=2)) for _ in range(2)]
    addresses = [f"{h}:{p}" for h, p in (d.start() for d in daemons)]
    span_bytes = 4 * 2**20
    size = 2 * span_bytes // 4  # 4 MiB of float32 per reducer span
    job = f"auto-{mode}"
    options = {"min_contributors": 2} if mode == "first_m" else {}
    clients = [redsrv.Client(addresses, rank=r, world_size=2, job=job, straggler_mode=mode, **options) for r in range(2)]
    try:
        futures = [c.allreduce_async(np.full(size, r + 1, dtype=np.float32), key=1) for r, c in enumerate(clients)]
        for c, f in zip(clients, futures):
            assert np.array_equal(c.wait(f), np.full(size, 3, dtype=np.float32))
        closed = _chunks_closed(daemons, job)
    finally:
        for c in clients:
            c.close()
        for d in daemons:
            d.stop()
    full = min(2**20, max(256 * 2**10, span_bytes // per_span))  # within MIN_FULL_CHUNK_BYTES..chunk_bytes
    assert 2 * (span_bytes // full) <= closed <= 2 * (span_bytes // full + 8)  # plus the ramps


def test_where_reducers_cut_through_a_span_ramps_only_below_a_result_piece() -> None:
    """A reducer that cuts through sends a chunk's sums in pieces as every rank's bytes arrive, so
    a ramp chunk of a piece or more would start and end its results no sooner than a full chunk:
    an 8 MiB span goes as 64, 128 and 256 KiB, two full chunks and the mirror ramp (8 chunks), not
    as a ramp on to 1 MiB (12), and the sums stay exact."""
    daemons = [redsrv.ReducerDaemon(redsrv.DaemonSettings(host="127.0.0.1", port=0, close_timeout=2)) for _ in range(2)]
    addresses = [f"{h}:{p}" for h, p in (d.start() for d in daemons)]
    span_bytes = 8 * 2**20
    size = 2 * span_bytes // 4
    assert C.DEFAULT_RESULT_PIECE_BYTES == 512 * 2**10 and C.RAMP_FIRST_CHUNK_BYTES == 64 * 2**10
    clients = [redsrv.Client(addresses, rank=r, world_size=2, job="ramp") for r in range(2)]
    try:
        futures = [c.allreduce_async(np.full(size, r + 1, dtype=np.float32), key=1) for r, c in enumerate(clients)]
        for c, f in zip(clients, futures):
            assert np.array_equal(c.wait(f), np.full(size, 3, dtype=np.float32))
        poll(lambda: _chunks_closed(daemons, "ramp") == 2 * 8, 5, "16 chunks closed", every=0.01)
    finally:
        for c in clients:
            c.close()
        for d in daemons:
            d.stop()
