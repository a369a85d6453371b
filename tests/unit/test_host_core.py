"""Host-level reduction's state machine (core/host.py) driven without sockets, threads or
processes: H hosts of L workers, each worker a HostCore over in-memory slots, the messages
between the workers of a host delivered in an order the test (or Hypothesis) picks, and the
reducers replaced by an exact model that combines each share across hosts in host order."""

from __future__ import annotations

import random

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from redsrv.core import host, wire
from redsrv.core.client_ops import Contributors, ReduceFuture
from redsrv.core.combine import Combiner
from redsrv.core.errors import ContributionMismatchError, PeerLostError, PeerTimeoutError, RemoteProtocolError


class Cluster:
    """``hosts`` x ``local`` workers. Messages wait in per-link queues until :meth:`run` delivers
    them; shares wait at the model reducers until every host submitted theirs."""

    def __init__(self, hosts: int, local: int, *, slot_bytes: int = 1 << 16, frame_bytes: int = 1 << 12,
                 block: bool = True, seed: int = 0, whole_piece_bytes: int = host.WHOLE_PIECE_BYTES) -> None:
        self.hosts, self.local = hosts, local
        self.placement = host.Placement(local, hosts, block)
        self.slots = {h: [np.zeros(slot_bytes, dtype=np.uint8) for _ in range(local)] for h in range(hosts)}
        self.cores = {(h, lr): host.HostCore(local_rank=lr, placement=self.placement, host=h, slots=self.slots[h],
                                             frame_bytes=frame_bytes, job="t", rank=self.placement.rank(h, lr),
                                             peers={r: f"rank {self.placement.rank(h, r)}" for r in range(local)},
                                             all_mode=True, whole_piece_bytes=whole_piece_bytes)
                      for h in range(hosts) for lr in range(local)}
        self.links: dict[tuple[int, int, int], list[host.Message]] = {}  # (host, from, to) -> messages in flight
        self.shares: dict[tuple[int, int, int], dict[int, host.SubmitShare]] = {}  # (local rank, key, piece) -> host -> share
        self.poisoned: list[host.SubmitShare] = []
        self.submitted: list[host.SubmitShare] = []  # every cross-host submission, poisoned ones too
        self.mismatched: set[tuple[int, int, int]] = set()
        self.settled: dict[tuple[int, int], dict[int, host.Settle]] = {}  # worker -> key -> settle
        self.rng = random.Random(seed)
        self.now = 0.0
        self.fail_share: set[tuple[int, int, int]] = set()  # (local rank, key, piece) whose cross-host reduction fails
        self.sent: list[host.Message] = []  # every message between workers, in the order sent

    def submit(self, h: int, lr: int, key: int, x: np.ndarray, *, op: wire.ReduceOp = wire.ReduceOp.SUM, root: int = 0,
               mean: bool = False, timeout: float = 100.0, in_place: bool = False) -> None:
        future = ReduceFuture()
        out = x if in_place else np.empty_like(x)
        hop = host.HostOp(key, key, x, out, x.dtype, op, root, mean, future, self.now + timeout, self.now, x.shape)
        self._apply((h, lr), self.cores[(h, lr)].submit(hop))

    def _apply(self, worker: tuple[int, int], actions: list[host.Action]) -> None:
        h, lr = worker
        for action in actions:
            if isinstance(action, host.SendToPeers):
                encoded = host.encode(action.message)
                self.sent.append(action.message)
                for peer in range(self.local):
                    if peer != lr:
                        self.links.setdefault((h, lr, peer), []).append(host.decode(encoded))
                if action.then_here:
                    self._apply(worker, self.cores[worker].receive(lr, action.message))
            elif isinstance(action, host.SubmitShare):
                self.submitted.append(action)
                place = (lr, action.key, action.piece)
                if action.poison:
                    # the reducers: a contribution of another shape fails the chunk for every host in it, now and later
                    self.poisoned.append(action)
                    self.mismatched.add(place)
                    for other in self.shares.pop(place, {}):
                        self._mismatch(other, lr, action.key, action.piece)
                elif place in self.mismatched:
                    self._mismatch(h, lr, action.key, action.piece)
                else:
                    self.shares.setdefault(place, {})[h] = action
            else:
                assert action.key not in self.settled.get(worker, {}), "an operation settled twice"
                self.settled.setdefault(worker, {})[action.key] = action

    def _mismatch(self, h: int, lr: int, key: int, piece: int) -> None:
        error = ContributionMismatchError("ranks disagree")
        self._apply((h, lr), self.cores[(h, lr)].share_finished(key, piece, self.now, error=error))

    def step(self) -> bool:
        """Deliver one message or finish one share's cross-host reduction, chosen at random;
        False when nothing is left to do."""
        ready = [k for k, v in self.links.items() if v]
        complete = [k for k, v in self.shares.items() if len(v) == self.hosts]
        staging = [k for k, core in self.cores.items() if core.can_stage]
        choices = [("link", k) for k in ready] + [("share", k) for k in complete] + [("stage", k) for k in staging]
        if not choices:
            return False
        kind, k = self.rng.choice(choices)
        if kind == "stage":
            self._apply(k, self.cores[k].stage())
            return True
        if kind == "link":
            h, sender, to = k
            message = self.links[k].pop(0)
            self._apply((h, to), self.cores[(h, to)].receive(sender, message))
            return True
        lr, key, piece = k
        shares = self.shares.pop(k)
        if k in self.fail_share:
            for h in range(self.hosts):
                lost = PeerLostError("reducer gone")
                self._apply((h, lr), self.cores[(h, lr)].share_finished(key, piece, self.now, error=lost))
            return True
        first = shares[0]
        if first.op is wire.ReduceOp.BROADCAST:
            result = shares[first.root].x.copy()
        else:
            result = shares[0].x.copy()
            Combiner().combine_into_first([result.view(np.uint8)] + [shares[h].x.view(np.uint8) for h in range(1, self.hosts)],
                                          wire.DType(wire.dtype_code(result.dtype)), first.op)
        for h in range(self.hosts):
            shares[h].out[...] = result
            contributors = Contributors(self.hosts, self.hosts, tuple(range(self.hosts)))
            self._apply((h, lr), self.cores[(h, lr)].share_finished(key, piece, self.now, contributors=contributors))
        return True

    def run(self, limit: int = 100_000) -> None:
        for _ in range(limit):
            if not self.step():
                return
        raise AssertionError("the cluster did not settle")

    def result(self, h: int, lr: int, key: int) -> host.Settle:
        return self.settled[(h, lr)][key]

    def quiet(self) -> None:
        """Every worker's operations retired and every frame is free again."""
        for (h, lr), core in self.cores.items():
            assert not core.ops, f"worker {(h, lr)} still holds {list(core.ops)}"
            assert len(core.free_frames) == len(self.slots[h][lr]) // core.frame_bytes


def reference(inputs: dict[tuple[int, int], np.ndarray], hosts: int, local: int, op: wire.ReduceOp) -> np.ndarray:
    """Inside each host in local-rank order, then across hosts in host order, through the
    reducers' own combining rule."""
    combine = Combiner()
    host_sums = []
    for h in range(hosts):
        acc = inputs[(h, 0)].copy()
        code = wire.DType(wire.dtype_code(acc.dtype))
        combine.combine_into_first([acc.view(np.uint8)] + [inputs[(h, lr)].view(np.uint8) for lr in range(1, local)], code, op)
        host_sums.append(acc)
    total = host_sums[0].copy()
    combine.combine_into_first([total.view(np.uint8)] + [s.view(np.uint8) for s in host_sums[1:]],
                               wire.DType(wire.dtype_code(total.dtype)), op)
    return total


def _inputs(hosts: int, local: int, size: int, dtype: np.dtype, seed: int) -> dict[tuple[int, int], np.ndarray]:
    rng = np.random.default_rng(seed)
    floating = dtype.kind == "f" or dtype == ml_dtypes.bfloat16
    return {(h, lr): rng.standard_normal(size).astype(np.float32).astype(dtype) if floating
            else rng.integers(-50, 50, size).astype(dtype) for h in range(hosts) for lr in range(local)}


@pytest.mark.parametrize("hosts,local,size,dtype", [
    (2, 2, 5000, np.dtype(np.float32)), (3, 2, 1, np.dtype(np.float64)), (2, 3, 0, np.dtype(np.float32)),
    (2, 4, 3001, np.dtype(ml_dtypes.bfloat16)), (1, 2, 700, np.dtype(np.int64)), (3, 1, 999, np.dtype(np.float16)),
])
def test_sums_are_bitwise_equal_everywhere_and_follow_the_host_order(hosts, local, size, dtype):
    c = Cluster(hosts, local, seed=size)
    inputs = _inputs(hosts, local, size, dtype, seed=size)
    for (h, lr), x in inputs.items():
        c.submit(h, lr, 7, x)
    c.run()
    expected = reference(inputs, hosts, local, wire.ReduceOp.SUM)
    for h in range(hosts):
        for lr in range(local):
            got = c.result(h, lr, 7)
            assert got.error is None, got.error
            assert got.result is not None and got.result.tobytes() == expected.tobytes()
            assert got.contributors == Contributors(hosts * local, hosts * local, tuple(range(hosts * local)))
    c.quiet()


@given(seed=st.integers(0, 10_000), sizes=st.lists(st.integers(0, 9000), min_size=1, max_size=4),
       hosts=st.integers(1, 3), local=st.integers(1, 4), block=st.booleans())
@settings(max_examples=60, deadline=None)
def test_any_interleaving_completes_every_operation_once_with_the_reference(seed, sizes, hosts, local, block):
    """Many operations at once, bigger in total than the staging area (frames are reused), each
    worker submitting in its own random order... of time, never of keys (the staging order of
    a host is the submission order, as the adapters' keys are)."""
    c = Cluster(hosts, local, slot_bytes=1 << 14, frame_bytes=1 << 12, block=block, seed=seed)
    ops = [wire.ReduceOp.SUM, wire.ReduceOp.MAX, wire.ReduceOp.PRODUCT]
    all_inputs = {}
    for key, size in enumerate(sizes):
        inputs = _inputs(hosts, local, size, np.dtype(np.float32), seed=seed + key)
        all_inputs[key] = inputs
        for (h, lr), x in inputs.items():
            c.submit(h, lr, key, x, op=ops[key % len(ops)])
        for _ in range(c.rng.randrange(0, 50)):
            c.step()
    c.run()
    for key, inputs in all_inputs.items():
        expected = reference(inputs, hosts, local, ops[key % len(ops)])
        for h in range(hosts):
            for lr in range(local):
                got = c.result(h, lr, key)
                assert got.error is None and got.result is not None
                assert got.result.tobytes() == expected.tobytes()
    c.quiet()


def test_mean_divides_by_the_world_size_once():
    c = Cluster(2, 2)
    inputs = {(h, lr): np.full(10, float(2 * h + lr + 1), dtype=np.float32) for h in range(2) for lr in range(2)}
    for (h, lr), x in inputs.items():
        c.submit(h, lr, 1, x, mean=True)
    c.run()
    for worker in inputs:
        np.testing.assert_array_equal(c.result(*worker, 1).result, np.full(10, 2.5, dtype=np.float32))


@pytest.mark.parametrize("block", [True, False])
def test_broadcast_from_a_worker_of_another_host(block):
    c = Cluster(2, 2, block=block)
    root = c.placement.rank(1, 1)
    for h in range(2):
        for lr in range(2):
            r = c.placement.rank(h, lr)
            c.submit(h, lr, 3, np.full(5000, r, dtype=np.int64), op=wire.ReduceOp.BROADCAST, root=root)
    c.run()
    for h in range(2):
        for lr in range(2):
            assert (c.result(h, lr, 3).result == root).all()
    c.quiet()


def test_workers_of_a_host_that_disagree_fail_together_and_poison_the_other_hosts():
    c = Cluster(2, 2)
    for h in range(2):
        for lr in range(2):
            size = 1001 if (h, lr) == (0, 1) else 1000
            c.submit(h, lr, 9, np.ones(size, dtype=np.float32))
    c.run()
    for lr in range(2):
        error = c.result(0, lr, 9).error
        assert isinstance(error, ContributionMismatchError)
        assert "1000 x float32 sum" in str(error) and "1001 x float32 sum" in str(error)
        # host 1 fails too: the reducers met host 0's poisoned shares
        assert isinstance(c.result(1, lr, 9).error, ContributionMismatchError)
    # every worker of host 0 pushed a poisoned share under its piece keys, and only host 0 did
    assert {(p.key, p.piece) for p in c.poisoned} == {(9, 0)} and len(c.poisoned) >= 2
    assert all(p.op is wire.ReduceOp.BROADCAST and p.x.size == 1 for p in c.poisoned)
    c.quiet()


ONE_HOST_OPS = [wire.ReduceOp.SUM, wire.ReduceOp.PRODUCT, wire.ReduceOp.MAX, wire.ReduceOp.MIN]
ONE_HOST_DTYPES = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16),
                   np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.int8), np.dtype(np.uint8)]


#: On one host, small pieces are combined whole by every worker and larger ones shared out
#: (host.WHOLE_PIECE_BYTES); 0 makes every piece shared, so both paths are tested.
WHOLE_OR_SHARED = pytest.mark.parametrize("whole_piece_bytes", [host.WHOLE_PIECE_BYTES, 0], ids=["whole", "shared"])


@WHOLE_OR_SHARED
@pytest.mark.parametrize("local", [2, 3, 4])
def test_one_host_finishes_every_operation_inside_the_host(local, whole_piece_bytes):
    """A job of one host: the all-reduce across hosts of a share is the identity, so no share is
    submitted at all, and every worker gets the rank-order combination (the reducers' own rule,
    16-bit floats through float32 rounded once), bit for bit, for every op and dtype; frames are
    reused across operations bigger than the staging area."""
    c = Cluster(1, local, slot_bytes=1 << 14, frame_bytes=1 << 12, seed=local, whole_piece_bytes=whole_piece_bytes)
    cases = []
    for dtype in ONE_HOST_DTYPES:
        for op in ONE_HOST_OPS:
            key, size = len(cases), 3001 if dtype.itemsize > 1 else 257
            inputs = _inputs(1, local, size, dtype, seed=key)
            if dtype.kind in "iu" and op is wire.ReduceOp.PRODUCT:
                inputs = {w: np.clip(x, 0, 2).astype(dtype) for w, x in inputs.items()}
            cases.append((key, op, inputs))
            for (h, lr), x in inputs.items():
                c.submit(h, lr, key, x, op=op)
    for bitwise in (wire.ReduceOp.BAND, wire.ReduceOp.BOR, wire.ReduceOp.BXOR):
        key = len(cases)
        inputs = _inputs(1, local, 999, np.dtype(np.int64), seed=key)
        cases.append((key, bitwise, inputs))
        for (h, lr), x in inputs.items():
            c.submit(h, lr, key, x, op=bitwise)
    c.run()
    assert c.submitted == []  # nothing left the host
    for key, op, inputs in cases:
        expected = reference(inputs, 1, local, op)
        for lr in range(local):
            got = c.result(0, lr, key)
            assert got.error is None, (key, got.error)
            assert got.result is not None and got.result.tobytes() == expected.tobytes(), (key, op, lr)
            assert got.contributors == Contributors(local, local, tuple(range(local)))
    c.quiet()


@WHOLE_OR_SHARED
def test_one_host_mean_and_broadcast_finish_inside_the_host(whole_piece_bytes):
    c = Cluster(1, 3, whole_piece_bytes=whole_piece_bytes)
    for lr in range(3):
        c.submit(0, lr, 1, np.full(5000, float(lr + 1), dtype=np.float32), mean=True)
        c.submit(0, lr, 2, np.full(5000, lr, dtype=np.int64), op=wire.ReduceOp.BROADCAST, root=2)
    c.run()
    assert c.submitted == []
    for lr in range(3):
        np.testing.assert_array_equal(c.result(0, lr, 1).result, np.full(5000, 2.0, dtype=np.float32))
        assert (c.result(0, lr, 2).result == 2).all()
    c.quiet()


@WHOLE_OR_SHARED
def test_one_host_in_place_operations_leave_every_worker_the_result_in_its_own_array(whole_piece_bytes):
    # The root of an in-place broadcast copies nothing back (its frame holds its own bytes).
    c = Cluster(1, 3, whole_piece_bytes=whole_piece_bytes)
    arrays = {lr: (np.arange(70_000, dtype=np.float32) * (lr + 1), np.full(70_000, lr + 1, dtype=np.int32)) for lr in range(3)}
    for lr, (broadcast, summed) in arrays.items():
        c.submit(0, lr, 1, broadcast, op=wire.ReduceOp.BROADCAST, root=1, in_place=True)
        c.submit(0, lr, 2, summed, in_place=True)
    c.run()
    for lr, (broadcast, summed) in arrays.items():
        assert np.shares_memory(c.result(0, lr, 1).result, broadcast) and np.shares_memory(c.result(0, lr, 2).result, summed)
        np.testing.assert_array_equal(broadcast, np.arange(70_000, dtype=np.float32) * 2)
        np.testing.assert_array_equal(summed, np.full(70_000, 6, dtype=np.int32))
    c.quiet()


@WHOLE_OR_SHARED
@pytest.mark.parametrize("what", ["size", "dtype", "op", "root"])
def test_one_host_workers_that_disagree_fail_together_and_nothing_leaves_the_host(what, whole_piece_bytes):
    c = Cluster(1, 2, whole_piece_bytes=whole_piece_bytes)
    for lr in range(2):
        odd = lr == 1
        size = 1001 if odd and what == "size" else 1000
        dtype = np.float64 if odd and what == "dtype" else np.float32
        op = wire.ReduceOp.MAX if odd and what == "op" else wire.ReduceOp.SUM
        if what == "root":
            op = wire.ReduceOp.BROADCAST
        c.submit(0, lr, 9, np.ones(size, dtype=dtype), op=op, root=1 if odd else 0)
    c.run()
    for lr in range(2):
        assert isinstance(c.result(0, lr, 9).error, ContributionMismatchError), c.result(0, lr, 9)
    assert c.submitted == []  # no poisoned share either: there is no other host to tell
    c.quiet()
    for lr in range(2):
        c.submit(0, lr, 10, np.ones(10, np.float32))  # and the host goes on
    c.run()
    assert c.result(0, 1, 10).result.tolist() == [2.0] * 10


def test_a_failed_share_fails_the_operation_on_every_worker_of_every_host_and_frees_the_frames():
    c = Cluster(2, 2)
    c.fail_share.add((1, 4, 0))  # local rank 1's share of piece 0
    for h in range(2):
        for lr in range(2):
            c.submit(h, lr, 4, np.ones(3000, dtype=np.float32))
    c.run()
    for h in range(2):
        for lr in range(2):
            assert isinstance(c.result(h, lr, 4).error, PeerLostError), c.result(h, lr, 4)
    c.quiet()
    for (h, lr), x in {(h, lr): np.ones(10, np.float32) for h in range(2) for lr in range(2)}.items():
        c.submit(h, lr, 5, x)  # and the host goes on
    c.run()
    assert c.result(1, 1, 5).result.tolist() == [4.0] * 10


@WHOLE_OR_SHARED
def test_a_lost_local_worker_fails_everything_now_and_later(whole_piece_bytes):
    c = Cluster(1, 3, whole_piece_bytes=whole_piece_bytes)
    c.submit(0, 0, 1, np.ones(100, np.float32))
    c.submit(0, 1, 1, np.ones(100, np.float32))
    c._apply((0, 0), c.cores[(0, 0)].peer_lost(2, "is gone"))
    error = c.result(0, 0, 1).error
    assert isinstance(error, PeerLostError) and "local rank 2 (rank 2)" in str(error)
    c.submit(0, 0, 2, np.ones(100, np.float32))
    assert isinstance(c.result(0, 0, 2).error, PeerLostError)


@WHOLE_OR_SHARED
def test_a_deadline_names_the_local_ranks_still_missing(whole_piece_bytes):
    c = Cluster(1, 3, whole_piece_bytes=whole_piece_bytes)
    c.submit(0, 0, 1, np.ones(100, np.float32), timeout=5)
    c.submit(0, 2, 1, np.ones(100, np.float32), timeout=5)
    c.run()
    actions = c.cores[(0, 0)].tick(5.0)
    c._apply((0, 0), actions)
    error = c.result(0, 0, 1).error
    assert isinstance(error, PeerTimeoutError) and "waits for local ranks [1] (rank 1)" in str(error)
    c.run()  # the FAIL reaches local rank 2 too
    assert isinstance(c.result(0, 2, 1).error, PeerTimeoutError)
    c.submit(0, 1, 1, np.ones(100, np.float32))  # the straggler's late submission fails at once
    c.run()
    assert isinstance(c.result(0, 1, 1).error, PeerTimeoutError)
    c.quiet()


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.int64])
@pytest.mark.parametrize("mean", [False, True])
def test_one_host_small_pieces_are_combined_whole_without_a_round_of_done(dtype, mean):
    """Combined whole by every worker, a small piece needs no DONE (one message round instead
    of two: INPUT, then RELEASED once read), and its bytes are those of the shared path. With
    a threshold between the full pieces and the last one, one operation takes both paths."""
    results = {}
    for whole_piece_bytes in (host.WHOLE_PIECE_BYTES, 0, 3 * 4000):  # 3 * 4000: the last piece only
        c = Cluster(1, 3, slot_bytes=1 << 15, frame_bytes=1 << 12, seed=7, whole_piece_bytes=whole_piece_bytes)
        inputs = _inputs(1, 3, 5000, np.dtype(dtype), seed=11)
        for (h, lr), x in inputs.items():
            c.submit(h, lr, 1, x, mean=mean and np.dtype(dtype).kind == "f")
        c.run()
        nbytes = 5000 * np.dtype(dtype).itemsize
        piece_sizes = [min(1 << 12, nbytes - start) for start in range(0, nbytes, 1 << 12)]
        shared = sum(size * 3 > whole_piece_bytes for size in piece_sizes)
        assert sum(isinstance(m, host.Done) for m in c.sent) == 3 * shared, (whole_piece_bytes, piece_sizes)
        if whole_piece_bytes == 3 * 4000:
            assert 0 < shared < len(piece_sizes)  # both paths in one operation
        results[whole_piece_bytes] = [c.result(0, lr, 1).result.tobytes() for lr in range(3)]
        assert len(set(results[whole_piece_bytes])) == 1  # every worker, the same bytes
        c.quiet()
    assert len({r[0] for r in results.values()}) == 1  # whole, shared and mixed: the same bytes
    assert results[0][0] == reference(inputs, 1, 3, wire.ReduceOp.SUM).tobytes() or mean


def test_one_host_a_worker_that_finished_and_left_does_not_fail_the_others():
    """Combined whole, a worker may settle and leave before another worker has every INPUT
    (a third worker's INPUT still on its way): what the others need of it, its INPUT, is in,
    and its frame stays as staged (it never reused it), so they complete."""
    c = Cluster(1, 3)
    for lr in range(3):
        c.submit(0, lr, 1, np.full(100, lr + 1, np.float32))
    for _ in range(3):  # every worker stages
        for lr in range(3):
            if c.cores[(0, lr)].can_stage:
                c._apply((0, lr), c.cores[(0, lr)].stage())
    for sender in (0, 2):  # local rank 1 receives every INPUT and settles
        c._apply((0, 1), c.cores[(0, 1)].receive(sender, c.links[(0, sender, 1)].pop(0)))
    assert c.result(0, 1, 1).result.tolist() == [6.0] * 100
    c._apply((0, 0), c.cores[(0, 0)].receive(1, c.links[(0, 1, 0)].pop(0)))  # its INPUT
    c._apply((0, 0), c.cores[(0, 0)].peer_lost(1, "is gone"))  # then it left
    c._apply((0, 0), c.cores[(0, 0)].receive(2, c.links[(0, 2, 0)].pop(0)))  # the last INPUT
    assert c.result(0, 0, 1).error is None and c.result(0, 0, 1).result.tolist() == [6.0] * 100
    c.submit(0, 0, 2, np.ones(100, np.float32))  # later operations fail: its share of them is gone
    assert isinstance(c.result(0, 0, 2).error, PeerLostError)


def test_placement():
    assert host.Placement.of([4, 5, 6, 7], 8) == (host.Placement(4, 2, True), 1)
    assert host.Placement.of([1, 3, 5, 7], 8) == (host.Placement(4, 2, False), 1)
    assert host.Placement.of([0, 2, 4, 6], 8) == (host.Placement(4, 2, False), 0)
    assert host.Placement.of([5, 6], 8) is None
    assert host.Placement.of([0, 1, 2], 8) is None


MESSAGES = [host.Hello(1, 2, 3, 4, 5, 6, 7), host.Input(1, 2, 3, 4, 1, 0, 0, True, 1), host.Done(9, 1, 2, 2, b"\x03"),
            host.Released(5, 6), host.Fail(5, "PeerLostError", "gone \u00e9"), host.Bye()]


@pytest.mark.parametrize("message", MESSAGES)
def test_messages_round_trip(message):
    assert host.decode(host.encode(message)) == message


@given(st.binary(max_size=200))
@settings(max_examples=300, deadline=None)
def test_any_bytes_decode_to_a_message_or_a_protocol_error(packet):
    try:
        assert isinstance(host.decode(packet), (host.Hello, host.Input, host.Done, host.Released, host.Fail, host.Bye))
    except RemoteProtocolError:
        pass


@pytest.mark.parametrize("message", MESSAGES)
def test_truncated_and_padded_messages_are_refused(message):
    packet = host.encode(message)
    for cut in range(1, len(packet)):
        with pytest.raises(RemoteProtocolError):
            host.decode(packet[:cut])
    with pytest.raises(RemoteProtocolError):
        host.decode(packet + b"x")
