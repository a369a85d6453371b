"""A reducer on the native plane sums and sends its cut-through chunks from C once every rank's push
is in them (``native/forward.c``, ``ReducerCore._engage``): the same bytes as a reducer on the
Python plane, for chunks of one piece and of many, odd sizes, every combining op its loops take,
and dtypes it leaves to the state machine (16-bit floats)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import redsrv
from redsrv.core import plane

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(plane.native_unavailable() is not None, reason="the native plane is not built")]

#: (elements, dtype, op): one piece, many pieces, a size that is no multiple of anything.
OPS = [(1_000, np.float32, "sum"), (3_000_001, np.float32, "sum"), (700_003, np.float64, "product"),
       (500_000, np.int64, "max"), (400_001, np.float32, "min"), (300_000, np.float16, "sum")]
WORLD = 3


def _run(data_plane: str) -> tuple[list[list[bytes]], int]:
    daemons = [redsrv.ReducerDaemon(redsrv.DaemonSettings(host="127.0.0.1", port=0, close_timeout=2,
                                                          result_piece_bytes=64 * 1024, data_plane=data_plane))
               for _ in range(2)]
    addresses = [f"{host}:{port}" for host, port in (d.start() for d in daemons)]
    results: list[list[bytes]] = [[] for _ in range(WORLD)]
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            with redsrv.Client(addresses, rank=rank, world_size=WORLD, job=f"fwd-{data_plane}") as client:
                for key, (count, dtype, op) in enumerate(OPS):
                    rng = np.random.default_rng(key * WORLD + rank)
                    x = (rng.standard_normal(count) * 3).astype(dtype) if np.dtype(dtype).kind == "f" \
                        else rng.integers(-1000, 1000, count).astype(dtype)
                    results[rank].append(client.allreduce(x, op=op, key=key).tobytes())
        except BaseException as exc:  # the test thread reports it
            errors.append(exc)

    try:
        threads = [threading.Thread(target=worker, args=(rank,)) for rank in range(WORLD)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(90)
        assert not any(thread.is_alive() for thread in threads), "a worker did not finish"
        assert errors == []
        return results, sum(d.core.engaged_chunks for d in daemons)
    finally:
        for d in daemons:
            d.stop()


def test_native_forwarding_gives_the_python_planes_bytes() -> None:
    reference, none = _run("python")
    ours, engaged = _run("native")
    assert none == 0
    assert engaged > 0  # the forwarder did the work
    for rank in range(WORLD):
        assert ours[rank] == reference[0], f"rank {rank}"
        assert reference[rank] == reference[0]
