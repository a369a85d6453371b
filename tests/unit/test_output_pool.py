"""Results a client allocates land in reused memory (``buffer_pool.OutputPool``): a block goes back
to the pool only once no array or view of the result is left, and the pool stays bounded."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import ml_dtypes
import numpy as np
import pytest

import redsrv
from redsrv.core import constants as C
from redsrv.core.buffer_pool import OutputPool

from tests_support import poll

pytestmark = pytest.mark.timeout(60)

COUNT = 1 << 18  # float32 elements: 1 MiB, the pool's smallest size


def _address(array: np.ndarray) -> int:
    return int(array.ctypes.data)


def test_a_dropped_result_is_reused_and_one_still_viewed_is_not() -> None:
    pool = OutputPool()
    first = pool.empty(COUNT, np.dtype(np.float32))
    first[:] = 7
    where = _address(first)
    tail = first[COUNT // 2 :].reshape(2, -1)  # a view keeps the whole block
    del first
    gc.collect()
    second = pool.empty(COUNT, np.dtype(np.float32))
    assert _address(second) != where
    assert not np.shares_memory(second, tail)
    second[:] = 1
    assert (tail == 7).all()  # nothing wrote into the block still viewed
    del tail
    gc.collect()
    third = pool.empty(COUNT, np.dtype(np.float32))
    assert _address(third) == where  # now it is free again: reused, pages already mapped
    assert (second == 1).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int32, np.int64,
                                   np.uint8, np.complex128])
def test_a_pooled_result_is_an_ordinary_writeable_flat_array_of_its_dtype(dtype: type) -> None:
    pool = OutputPool()
    itemsize = np.dtype(dtype).itemsize
    count = C.OUTPUT_POOL_MIN_BYTES // itemsize
    out = pool.empty(count, np.dtype(dtype))
    assert out.dtype == np.dtype(dtype) and out.shape == (count,)
    assert out.flags.c_contiguous and out.flags.writeable and out.flags.aligned
    values = (np.arange(count) % 251).astype(dtype)
    out[:] = values
    assert out.tobytes() == values.tobytes()
    assert not out.flags.owndata  # a pooled block's, not one of NumPy's own
    assert out.reshape(2, -1).tobytes() == values.tobytes()  # views work as on any array


def test_small_results_come_from_numpy_itself() -> None:
    pool = OutputPool()
    small = pool.empty(C.OUTPUT_POOL_MIN_BYTES // 4 - 1, np.dtype(np.float32))
    assert small.flags.owndata
    del small
    assert pool.free_bytes == 0


def test_the_pool_keeps_a_bounded_number_of_free_blocks_per_size() -> None:
    pool = OutputPool()
    blocks = [pool.empty(COUNT, np.dtype(np.float32)) for _ in range(C.OUTPUT_POOL_KEEP_PER_SIZE + 3)]
    del blocks
    gc.collect()
    assert pool.free_bytes == C.OUTPUT_POOL_KEEP_PER_SIZE * COUNT * 4


def test_free_blocks_nobody_took_for_a_while_go_back_to_the_system() -> None:
    pool = OutputPool()
    pool.release_idle(1000.0)
    dropped = pool.empty(COUNT, np.dtype(np.float32))
    del dropped
    gc.collect()
    assert pool.release_idle(1000.0 + C.POOL_IDLE_RELEASE_S / 2) == 0
    assert pool.free_bytes == COUNT * 4
    assert pool.release_idle(1000.0 + C.POOL_IDLE_RELEASE_S * 2) == COUNT * 4
    assert pool.free_bytes == 0


def test_a_result_dropped_while_its_pool_is_locked_does_not_deadlock() -> None:
    """As when a garbage collection, started by an allocation inside the pool's own critical
    section, collects the last reference to a result on the same thread."""
    pool = OutputPool()
    result = pool.empty(COUNT, np.dtype(np.float32))
    where = _address(result)
    with pool._blocks._lock:
        del result  # the lease's __del__ runs here, on the thread holding the lock
    assert pool.free_bytes == COUNT * 4
    assert _address(pool.empty(COUNT, np.dtype(np.float32))) == where


def test_results_dropped_on_other_threads_come_back_whole() -> None:
    pool = OutputPool()
    arrays = [pool.empty(COUNT, np.dtype(np.float32)) for _ in range(8)]
    addresses = {_address(a) for a in arrays}
    lock = threading.Lock()

    def drop() -> None:
        while True:
            with lock:
                if not arrays:
                    return
                victim = arrays.pop()
            del victim

    threads = [threading.Thread(target=drop) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    gc.collect()
    assert pool.free_bytes == C.OUTPUT_POOL_KEEP_PER_SIZE * COUNT * 4
    again = [pool.empty(COUNT, np.dtype(np.float32)) for _ in range(C.OUTPUT_POOL_KEEP_PER_SIZE)]
    assert {_address(a) for a in again} <= addresses


@pytest.fixture
def client() -> Iterator[redsrv.Client]:
    """A one-rank client of an in-process reducer."""
    daemon = redsrv.ReducerDaemon(redsrv.DaemonSettings(host="127.0.0.1", port=0, close_timeout=2))
    host, port = daemon.start()
    try:
        with redsrv.Client([f"{host}:{port}"], rank=0, world_size=1, job="outputs") as one_rank:
            yield one_rank
    finally:
        daemon.stop()


def test_a_client_reuses_a_dropped_result_and_never_one_the_caller_holds(client: redsrv.Client) -> None:
    inputs = [np.full(COUNT * 3, step, dtype=np.float32) for step in range(4)]
    held = client.allreduce(inputs[0])
    second = client.allreduce(inputs[1])
    assert not np.shares_memory(held, second)
    assert (held == 0).all() and (second == 1).all()
    where = _address(held)
    del held
    gc.collect()
    third = client.allreduce(inputs[2])
    assert _address(third) == where
    assert (third == 2).all() and (second == 1).all()
    fourth = client.allreduce(inputs[3])  # ``second`` and ``third`` are held: fresh memory
    assert not np.shares_memory(fourth, second) and not np.shares_memory(fourth, third)
    assert (fourth == 3).all() and (third == 2).all() and (second == 1).all()


def test_a_client_gives_free_result_memory_back_once_unused_for_a_while(client: redsrv.Client) -> None:
    dropped = client.allreduce(np.ones(COUNT, dtype=np.float32))
    assert (dropped == 1).all()
    del dropped
    gc.collect()
    pools = [client._engine.outputs, client._machine.chunk_buffers]
    assert pools[0].free_bytes == COUNT * 4
    poll(lambda: all(pool.free_bytes == 0 for pool in pools), C.POOL_IDLE_RELEASE_S + 5,
         "the client's tick giving idle result memory back")
