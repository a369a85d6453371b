"""``redsrv.horovod.torch`` against PyTorch's own arithmetic, on three worker processes.

One run of ``hvd_torch_worker.py api`` exercises every function (the checks share the run: a
process start with torch costs seconds here); each result is recomputed here from the inputs
every rank saved. Integer data and float64 are compared exactly, as are float32 results whose
reference adds in the reducers' order (rank order); 16-bit floats and training runs within the
tolerances written next to them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import redsrv.horovod.torch as hvd  # noqa: E402

HERE = os.path.dirname(__file__)
WORKER = os.path.join(HERE, "hvd_torch_worker.py")
sys.path.insert(0, HERE)

from hvd_support import START_ENV, start_ranks, wait_ranks  # noqa: E402
from hvd_torch_worker import fresh_model, global_batch, norm_model, train  # noqa: E402

N = 3


def collect(prefixes: list[str]) -> tuple[list[dict], list[dict]]:  # type: ignore[type-arg]
    tensors = [torch.load(p + ".pt") for p in prefixes]
    facts = []
    for p in prefixes:
        with open(p + ".json") as f:
            facts.append(json.load(f))
    return tensors, facts


@pytest.fixture(scope="module")
def api_run(tmp_path_factory):  # type: ignore[no-untyped-def]
    from conftest import ProcessTracker

    tracker = ProcessTracker()
    tmp = tmp_path_factory.mktemp("hvd")
    try:
        reducers = [tracker.start_reducer().address for _ in range(2)]
        workers, prefixes = start_ranks(tracker, N, reducers, "hvd-api", lambda rank: str(tmp / f"api-{rank}"),
                                        lambda prefix: [WORKER, "api", prefix])
        wait_ranks(workers, prefixes, timeout=150)
        yield collect(prefixes)
    finally:
        tracker.cleanup()


def rank_order(tensors: list[torch.Tensor], op: str) -> torch.Tensor:
    """What the reducers compute: the op applied in rank order (16-bit floats in float32)."""
    wide = [t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in tensors]
    total = wide[0].clone()
    for t in wide[1:]:
        total = {"sum": torch.add, "prod": torch.mul, "min": torch.minimum, "max": torch.maximum}[op](total, t)
    return total.to(tensors[0].dtype)


def reference_allreduce(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    if op != "avg":
        return rank_order(inputs, op)
    total = rank_order(inputs, "sum")
    if total.dtype.is_floating_point:
        return total / len(inputs)
    return torch.div(total, len(inputs), rounding_mode="floor")


def test_basics(api_run) -> None:  # type: ignore[no-untyped-def]
    _, facts = api_run
    # one host: local ranks are the ranks, one process per local rank across hosts
    assert [f["basics"] for f in facts] == [[r, N, r, N, 0, 1, True] for r in range(N)]


@pytest.mark.parametrize("dtype", ["f32", "f64", "f16", "bf16", "i32", "i64", "u8", "i8"])
def test_allreduce_every_dtype_and_op(api_run, dtype: str) -> None:  # type: ignore[no-untyped-def]
    tensors, _ = api_run
    inputs = [t[f"in.{dtype}"] for t in tensors]
    for op in ("sum", "avg", "min", "max", "prod"):
        expected = reference_allreduce(inputs, op)
        for rank, t in enumerate(tensors):
            got = t[f"allreduce.{dtype}.{op}"]
            assert got.dtype == inputs[0].dtype and got.shape == inputs[0].shape
            if dtype in ("f16", "bf16") and op == "avg":
                # the reducers' float32 sum rounded to 16 bits, then divided in 16 bits
                torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)
            else:
                assert torch.equal(got, expected), (dtype, op, rank, got, expected)
            assert torch.equal(got, tensors[0][f"allreduce.{dtype}.{op}"])  # identical on every rank


def test_allreduce_forms(api_run) -> None:  # type: ignore[no-untyped-def]
    tensors, facts = api_run
    xs = [t["in.x64"] for t in tensors]
    total = rank_order(xs, "sum")
    for t in tensors:
        assert torch.equal(t["allreduce.scaled"], rank_order([x * 0.5 for x in xs], "sum") * 3.0)
        assert torch.equal(t["allreduce.average_flag"], total / N)
        assert torch.equal(t["allreduce_"], total)
        assert torch.equal(t["allreduce_async"], rank_order(xs, "max"))
        assert torch.equal(t["allreduce_async_"], total)
        assert torch.equal(t["allreduce_.strided"], rank_order([s["in.strided"] for s in tensors], "sum"))
        ys = [s["in.y"] for s in tensors]
        torch.testing.assert_close(t["allreduce.fp16"], rank_order(ys, "sum"), rtol=2e-3, atol=1e-2)
        torch.testing.assert_close(t["allreduce.bf16"], rank_order(ys, "sum"), rtol=1e-2, atol=5e-2)
        assert t["allreduce.fp16"].dtype == torch.float32
    assert all(f["allreduce_.same_object"] for f in facts)
    assert all(f["poll_after_sync_raises"] for f in facts)


def test_grouped_allreduce(api_run) -> None:  # type: ignore[no-untyped-def]
    tensors, _ = api_run
    for i in range(2):
        total = rank_order([t[f"in.g{i}"] for t in tensors], "sum")
        for t in tensors:
            assert torch.equal(t[f"grouped.{i}"], total)
            assert torch.equal(t[f"grouped_.{i}"], total)
            assert torch.equal(t[f"grouped_async.{i}"], total / N)


def test_allgather_broadcast_alltoall_reducescatter(api_run) -> None:  # type: ignore[no-untyped-def]
    tensors, _ = api_run
    gathered = torch.cat([t["in.z"] for t in tensors])
    root = tensors[1]["in.b"]
    n = N
    for r, t in enumerate(tensors):
        assert torch.equal(t["allgather"], gathered)
        assert torch.equal(t["allgather_async"], gathered.to(torch.int64))
        for form in ("broadcast", "broadcast_", "broadcast_async", "broadcast_async_"):
            assert torch.equal(t[form], root), form
        # alltoall: rank s sent rows [sum(splits[:r]), +r+1) to rank r
        start = sum(j + 1 for j in range(r))
        expected = torch.cat([s["in.t"][start : start + r + 1] for s in tensors])
        assert torch.equal(t["alltoall"], expected)
        assert t["alltoall.splits"].tolist() == [r + 1] * n
        assert torch.equal(t["alltoall.even"], torch.cat([s["in.even"][2 * r : 2 * r + 2] for s in tensors]))
        rows = {0: slice(0, 3), 1: slice(3, 5), 2: slice(5, 7)}[r]
        total = rank_order([s["in.s"] for s in tensors], "sum")
        assert torch.equal(t["reducescatter.sum"], total[rows])
        assert torch.equal(t["reducescatter.avg"], (total / n)[rows])


def test_autograd(api_run) -> None:  # type: ignore[no-untyped-def]
    tensors, _ = api_run
    weights = torch.arange(4.0, dtype=torch.float64)
    offsets = [0, 1, 3]  # rows before each rank in the gathered tensor (rank r has r + 1 rows of 2)
    for r, t in enumerate(tensors):
        assert torch.equal(t["grad.allreduce"], weights * N)  # every rank's weights, summed
        own = torch.arange(12, dtype=torch.float64).reshape(6, 2)[offsets[r] : offsets[r] + r + 1]
        assert torch.equal(t["grad.allgather"], own)  # Horovod's: the gradients averaged over the ranks, own rows


def test_int16_is_reduced_gathered_broadcast_and_exchanged_as_horovod_does(api_run) -> None:  # type: ignore[no-untyped-def]
    tensors, _ = api_run
    inputs = [t["in.i16"] for t in tensors]
    total = rank_order(inputs, "sum")  # int16 arithmetic: the sums that overflow wrap, as Horovod's
    assert not torch.equal(total.to(torch.int32), rank_order([x.to(torch.int32) for x in inputs], "sum"))
    for r, t in enumerate(tensors):
        assert all(t[k].dtype == torch.int16 for k in t if k.startswith("i16."))
        assert torch.equal(t["i16.sum"], total) and torch.equal(t["i16.max"], rank_order(inputs, "max"))
        assert torch.equal(t["i16.allgather"], torch.cat([x[: s + 1] for s, x in enumerate(inputs)]))
        assert torch.equal(t["i16.broadcast"], inputs[2])
        assert torch.equal(t["i16.alltoall"], torch.cat([x[2 * r : 2 * r + 2] for x in inputs]))
        assert torch.equal(t["i16.reducescatter"], total[2 * r : 2 * r + 2])


def test_a_name_in_flight_cannot_be_reused_until_synchronized(api_run) -> None:  # type: ignore[no-untyped-def]
    _, facts = api_run
    for f in facts:
        assert f["dup.second_raises"].startswith("ValueError") and "'dup'" in f["dup.second_raises"]
        assert f["dup.other_kind_ok"] == [1.0] * 3  # names are per kind of operation, as Horovod's
        assert f["dup.after_sync"] == [float(N)] * 3
        assert f["dup.after_poll"] == [[float(N)] * 3, [2.0 * N] * 3]


def test_gradients_are_horovods(api_run) -> None:  # type: ignore[no-untyped-def]
    """Horovod's definitions (horovod/torch/mpi_ops.py, checked by its test_torch.py): rank r's
    output gradient is r + 1 times ones in each case below."""
    tensors, _ = api_run
    mean_weight = sum(range(1, N + 1)) / N
    f64 = torch.float64
    for r, t in enumerate(tensors):
        # broadcast: the root gets the output gradients averaged over the ranks, the others zeros
        assert torch.equal(t["grad.broadcast"], torch.full((4, 2), mean_weight if r == 1 else 0.0, dtype=f64))
        # reducescatter: every rank's output gradient gathered, times size for Sum, times the scales
        for label, factor in (("sum", N * 0.5), ("avg", 0.5)):
            expected = torch.cat([torch.full((2, 2), (s + 1) * factor, dtype=f64) for s in range(N)])
            assert torch.equal(t[f"grad.reducescatter.{label}"], expected), label
        # grouped ops differentiate as their single forms: a grouped Sum allreduce of [g, 2g] ...
        assert torch.equal(t["grad.grouped_allreduce"], torch.full((3,), N * mean_weight + 2.0 * N, dtype=f64))
        assert torch.equal(t["grad.grouped_allgather"], torch.full((r + 1, 2), mean_weight, dtype=f64))
        expected = torch.cat([torch.full((2,), (s + 1.0) * N, dtype=f64) for s in range(N)])
        assert torch.equal(t["grad.grouped_reducescatter"], expected)


def test_float16_is_scaled_in_float32_and_rounded_once(api_run) -> None:  # type: ignore[no-untyped-def]
    tensors, _ = api_run
    factor = torch.tensor(0.37, dtype=torch.float32)
    halves = [t["in.half"] for t in tensors]
    prescaled = rank_order([(h.float() * factor).half() for h in halves], "sum")
    postscaled = (rank_order(halves, "sum").float() * factor).half()
    for t in tensors:
        assert torch.equal(t["half.prescaled"], prescaled)
        assert torch.equal(t["half.postscaled"], postscaled)


def test_sparse_allreduce_and_sparse_gradients(api_run) -> None:  # type: ignore[no-untyped-def]
    tensors, facts = api_run
    dense = [t["in.sparse"] for t in tensors]
    before = tensors[0]["embedding.before"]
    counts = torch.zeros(10, 1)
    for r in range(N):
        for index in (r, r + 1, 9, 9):
            counts[index] += 1
    for t, f in zip(tensors, facts):
        # float32 sums of at most three entries per element, added in another order: within one ulp
        torch.testing.assert_close(t["sparse.sum"], rank_order(dense, "sum"), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(t["sparse.avg"], rank_order(dense, "sum") / N, rtol=1e-6, atol=1e-6)
        # SGD on the averaged sparse gradient of sum(embedding(indices)): each row's count of uses
        torch.testing.assert_close(t["embedding.after"], before - 0.1 * counts.expand(10, 3) / N, rtol=1e-6, atol=1e-7)
        assert f["embedding.names"] == ["allreduce.noname.0.0"]
        assert f["no_grad.grads"] == [True, [0.0, 0.0]]


def test_named_async_operations_may_be_issued_in_any_order(api_run) -> None:  # type: ignore[no-untyped-def]
    tensors, _ = api_run
    for name in ("first", "second"):
        expected = rank_order([t[f"in.{name}"] for t in tensors], "sum")
        assert all(torch.equal(t[f"reordered.{name}"], expected) for t in tensors)


def test_objects_barrier_join(api_run) -> None:  # type: ignore[no-untyped-def]
    _, facts = api_run
    for f in facts:
        assert f["broadcast_object"] == {"from": 2, "list": [2, 2, 2]}
        assert f["allgather_object"] == [["rank", r] for r in range(N)]
        assert f["join"] in range(N) and f["join"] == facts[0]["join"]


def test_process_sets_run_concurrently(api_run) -> None:  # type: ignore[no-untyped-def]
    tensors, facts = api_run
    x = [t["in.ps"] for t in tensors]
    low, high, everyone = rank_order(x[:2], "sum"), rank_order(x[1:], "sum"), rank_order(x, "sum")
    for r, (t, f) in enumerate(zip(tensors, facts)):
        assert torch.equal(t["ps.global"], everyone)
        assert ("ps.low" in t) == (r in (0, 1)) and ("ps.high" in t) == (r in (1, 2))
        if r in (0, 1):
            assert torch.equal(t["ps.low"], low)
        if r in (1, 2):
            assert torch.equal(t["ps.high"], high)
            assert torch.equal(t["ps.high.bcast"], x[2])  # root_rank is the global rank
            assert torch.equal(t["ps.high.allgather"], torch.cat(x[1:]))
            assert f["ps.high.object"] == [1, 2]
        if r in (0, 2):
            assert torch.equal(t["ps.edge"], x[0] + x[2])
        assert f["sets"] == [2, [0, 1, -1][r], r in (0, 1), [-1, 0, 1][r], r in (1, 2)]
        assert f["ps.duplicate_raises"] and "duplicate" in f["ps.duplicate_raises"]
        assert f["ps.removed"] == [True, False, False]
        if r == 2:
            assert "rank 2 is not in ProcessSet(process_set_id=1, ranks=[0, 1])" in f["ps.non_member_raises"]
        assert "is not registered" in f["ps.unregistered_raises"]


def reference_training(steps: int, lr: float, momentum: float, scale: float = 1.0) -> dict[str, torch.Tensor]:
    x, y = global_batch()
    model = fresh_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr * scale, momentum=momentum)
    train(model, opt, x, y, steps=steps)
    return {name: p.detach() for name, p in model.named_parameters()}


def test_distributed_optimizer_equals_global_batch_training(api_run) -> None:  # type: ignore[no-untyped-def]
    tensors, facts = api_run
    reference = reference_training(steps=4, lr=0.1, momentum=0.9)
    # float64 throughout; only the order of additions differs (per-rank means, then their mean)
    for t in tensors:
        for name, value in reference.items():
            torch.testing.assert_close(t[f"train.{name}"], value, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(t[f"train2.{name}"], value, rtol=1e-12, atol=1e-12)  # 2 passes/step, groups
            assert torch.equal(t[f"train.{name}"], tensors[0][f"train.{name}"])
    # op=Sum: the gradient is N times the global mean's; fp16 on the wire
    summed = reference_training(steps=2, lr=0.05, momentum=0.0, scale=N)
    for t in tensors:
        for name, value in summed.items():
            torch.testing.assert_close(t[f"train3.{name}"], value, rtol=1e-3, atol=1e-3)
    assert all(f["optimizer.class"] == ["SGD", True] for f in facts)


def test_sync_batch_norm_equals_batch_norm_on_the_global_batch(api_run) -> None:  # type: ignore[no-untyped-def]
    tensors, _ = api_run
    x, y = global_batch()
    model = norm_model(torch.nn.BatchNorm1d)
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y, steps=3)
    reference = model.state_dict()
    model.eval()
    for r, t in enumerate(tensors):
        for name, value in reference.items():  # weights, running mean and variance, batches tracked
            torch.testing.assert_close(t[f"syncbn.{name}"], value, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(t["syncbn.eval"], model(x[4 * r : 4 * r + 4]).detach(), rtol=1e-10, atol=1e-12)


def test_backward_passes_per_step_guards(api_run) -> None:  # type: ignore[no-untyped-def]
    _, facts = api_run
    for f in facts:
        assert "more than backward_passes_per_step" in f["passes.third_backward_raises"]
        assert "zero_grad() was called after loss.backward()" in f["passes.zero_grad_raises"]


def test_broadcast_optimizer_state_round_trip(api_run) -> None:  # type: ignore[no-untyped-def]
    tensors, facts = api_run
    keys = [k for k in tensors[0] if k.startswith("adam.")]
    assert len(keys) == 3 * 4  # step, exp_avg, exp_avg_sq for each of 4 parameters
    for t, f in zip(tensors, facts):
        assert f["adam.lr"] == [0.01]
        assert sorted(k for k in t if k.startswith("adam.")) == sorted(keys)
        for k in keys:
            assert torch.equal(t[k], tensors[0][k]), k
    assert float(tensors[0]["adam.0.step"]) == 3.0


def test_misuse_is_a_clear_error(api_run) -> None:  # type: ignore[no-untyped-def]
    _, facts = api_run
    for f in facts:
        m = f["misuse"]
        assert m["adasum"].startswith("NotImplementedError") and "Adasum is not supported" in m["adasum"]
        assert "op and average" in m["op_and_average"]
        assert "complex64 is not supported" in m["complex"]
        assert "gradient_predivide_factor" in m["predivide_with_sum"]


def test_mismatched_ranks_raise_horovod_and_redsrv_errors(api_run) -> None:  # type: ignore[no-untyped-def]
    _, facts = api_run
    for f in facts:
        for label in ("shape", "dtype", "gather_dims", "same_size", "reducescatter_same_size"):
            error = f[f"error.{label}"]
            assert error is not None, label
            assert "HorovodInternalError" in error["types"] and "ContributionMismatchError" in error["types"], error
            assert "RuntimeError" in error["types"]
            assert "job='hvd-api'" in error["message"]


def test_one_rank_without_reducers_runs_locally(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``python train.py`` with no launcher: one rank, no reducers, every collective local."""
    for name in [k for k in os.environ if k.startswith("REDSRV_") or k in ("RANK", "WORLD_SIZE")]:
        monkeypatch.delenv(name)
    hvd.init()
    try:
        x = torch.arange(6.0).reshape(3, 2)
        assert (hvd.size(), hvd.rank(), hvd.local_size()) == (1, 0, 1)
        assert torch.equal(hvd.allreduce(x), x) and torch.equal(hvd.allgather(x), x)
        assert torch.equal(hvd.broadcast(x, 0), x) and torch.equal(hvd.reducescatter(x, op=hvd.Sum), x)
        out, splits = hvd.alltoall(x, splits=[3])
        assert torch.equal(out, x) and splits.tolist() == [3]
        assert hvd.broadcast_object({"a": 1}) == {"a": 1} and hvd.allgather_object(5) == [5]
    finally:
        hvd.shutdown()
    assert not hvd.is_initialized()
    with pytest.raises(ValueError, match="not been initialized"):
        hvd.rank()


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun (Open MPI) is not installed")
def test_script_under_mpirun(procs, fleet, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Ranks and sizes from Open MPI's variables; nothing redsrv-specific but the reducers."""
    from conftest import child_env

    reducers = fleet(1)
    prefix = str(tmp_path / "mpi")
    env = child_env({"REDSRV_REDUCERS": reducers[0].address, "REDSRV_JOB": "hvd-mpi", **START_ENV})
    args = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2"]
    for name in ("REDSRV_REDUCERS", "REDSRV_JOB", *[k for k in env if k.startswith("REDSRV_")], "PYTHONPATH"):
        if name in env:
            args += ["-x", name]
    # Each rank needs its own output file: the script appends the Open MPI rank.
    wrapper = tmp_path / "rank_prefix.py"
    wrapper.write_text("import os, runpy, sys\n"
                       f"sys.argv = [{WORKER!r}, 'mini', {prefix!r} + '-' + os.environ['OMPI_COMM_WORLD_RANK']]\n"
                       f"runpy.run_path({WORKER!r}, run_name='__main__')\n")
    log = tmp_path / "mpirun.log"
    with open(log, "w") as out:
        proc = procs.popen([*args, sys.executable, str(wrapper)], env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=150)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"mpirun still running after 150 s:\n{log.read_text()}") from None
    assert proc.returncode == 0, log.read_text()
    for rank in range(2):
        data = torch.load(f"{prefix}-{rank}.pt")
        with open(f"{prefix}-{rank}.json") as f:
            facts = json.load(f)
        assert facts["basics"] == [rank, 2, rank, 2]
        assert data["sum"].tolist() == [3.0] * 3
        assert data["gather"].tolist() == [0, 1, 1]
        assert facts["object"] == "hello from 1"


def test_errors_when_starting_an_operation_are_horovod_errors_too(monkeypatch, daemon) -> None:  # type: ignore[no-untyped-def]
    """A one-rank job through a real reducer; once its connection is closed, starting an
    operation raises an error that both Horovod's and redsrv's ``except`` clauses catch."""
    from redsrv.core.errors import ClientClosedError

    for name in [k for k in os.environ if k.startswith("REDSRV_") or k in ("RANK", "WORLD_SIZE")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("REDSRV_REDUCERS", daemon)
    hvd.init()
    try:
        x = torch.arange(4.0)
        assert torch.equal(hvd.allreduce(x, op=hvd.Sum), x)
        hvd.global_process_set.client().close()  # what a lost connection leaves behind
        with pytest.raises(hvd.HorovodInternalError) as caught:
            hvd.allreduce(x)
        assert isinstance(caught.value, ClientClosedError) and isinstance(caught.value, RuntimeError)
    finally:
        hvd.shutdown()


def test_init_again_after_shutdown_is_a_job_of_its_own(monkeypatch, daemon) -> None:  # type: ignore[no-untyped-def]
    """``hvd.shutdown()`` then ``hvd.init()`` in the same processes (Horovod's own test files do
    it between tests, all in one launch): the operations of the new session, numbered from zero
    again, go to a job of their own on the same reducers, not into chunks the last one closed."""
    for name in [k for k in os.environ if k.startswith("REDSRV_") or k in ("RANK", "WORLD_SIZE")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("REDSRV_REDUCERS", daemon)
    monkeypatch.setenv("REDSRV_JOB", "reinit")
    x = torch.arange(4.0)
    jobs = []
    for _ in range(3):
        hvd.init()
        try:
            jobs.append(hvd.global_process_set.client().config.job)
            assert torch.equal(hvd.allreduce(x, op=hvd.Sum, name="same"), x)  # the same key in every session
        finally:
            hvd.shutdown()
    assert all(job.startswith("reinit") for job in jobs) and len(set(jobs)) == 3


def test_a_lost_rank_is_a_horovod_error_on_the_others(procs, fleet, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Rank 1 exits after init: rank 0's next allreduce raises HorovodInternalError (which is
    redsrv's PeerLostError) within the heartbeat window, not at the 120 s operation timeout."""
    reducers = [r.address for r in fleet(1)]
    workers, prefixes = start_ranks(procs, 2, reducers, "hvd-lost", lambda rank: str(tmp_path / f"lost-{rank}"),
                                    lambda prefix: [WORKER, "lost", prefix])
    wait_ranks(workers[:1], prefixes[:1], timeout=120)
    assert workers[1].wait(timeout=30) == 17
    with open(prefixes[0] + ".json") as f:
        facts = json.load(f)
    assert facts["error"] is not None
    assert "HorovodInternalError" in facts["error"]["types"] and "PeerLostError" in facts["error"]["types"], facts["error"]
    assert "rank 1 of job 'hvd-lost' disconnected" in facts["error"]["message"]  # who, which job
    assert facts["seconds"] < 10


TOPOLOGY = ("import json, redsrv.horovod.torch as hvd; hvd.init(); "
            "print(json.dumps([hvd.rank(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()]))")


@pytest.mark.parametrize(("host_ids", "local", "expected"), [
    # One host name, two host identities (two containers, two namespaces): two hosts.
    (["a", "b"], None, [[0, 0, 1, 0, 2], [1, 0, 1, 1, 2]]),
    (["a", "a"], None, [[0, 0, 2, 0, 1], [1, 1, 2, 0, 1]]),
    # The launcher's local ranks win over the identity.
    (["a", "a"], [("0", "1"), ("0", "1")], [[0, 0, 1, 0, 2], [1, 0, 1, 1, 2]]),
])
def test_local_ranks_come_from_the_host_identity_unless_the_launcher_sets_them(  # type: ignore[no-untyped-def]
        procs, fleet, tmp_path, host_ids, local, expected) -> None:
    from conftest import child_env

    reducers = fleet(1)
    runs = []
    for rank, host_id in enumerate(host_ids):
        launcher = {} if local is None else {"HOROVOD_LOCAL_RANK": local[rank][0], "HOROVOD_LOCAL_SIZE": local[rank][1]}
        env = child_env({"REDSRV_REDUCERS": reducers[0].address, "REDSRV_JOB": f"topo-{tmp_path.name}", "RANK": str(rank),
                         "WORLD_SIZE": "2", "REDSRV_HOST_ID": host_id, **launcher, **START_ENV})
        runs.append(procs.popen([sys.executable, "-c", TOPOLOGY], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    got = []
    for proc in runs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()
        got.append(json.loads(out.decode().splitlines()[-1]))
    assert got == expected
