"""Every c10d operation of the redsrv backend against gloo's result, and FSDP over redsrv
against FSDP over gloo, at world sizes 2 and 3.

One launch of real worker processes per world size (``ddp_worker.py``, configurations "ops",
"fsdp2") runs every operation twice, through the gloo default group and through a
redsrv group, on the same inputs. Results must agree **bitwise**, at every world size:

* reductions with MAX, MIN and the bitwise ops do not depend on the order of combination, and
  integer sums and products wrap the same way in any order;
* float32 PRODUCT and SUM (reduce, complex all-reduce) are order-dependent in general; with world size 3
  the reducers multiply in rank order and gloo's ring in an order of its own, so those two
  get float32's rounding tolerance there (the same argument as the DDP tests: 1e-6 relative);
* point-to-point, gather, scatter, all-to-all, all-gather and reduce-scatter travel over the
  group's peer links, which are a gloo group: the same bytes as gloo's own. The ``relay_*``
  ops run on a group without peer links, where all-gather and reduce-scatter go through the
  reducers: all-gathers bitwise, the float32 reduce-scatter SUM with the tolerance above.

FSDP2 moves parameters with all-gather and gradients with reduce-scatter, which both
travel over the peer links, so their losses and final parameters equal gloo's bitwise too.
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("torch")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from test_ddp_differential import Run, check_training, relative_error, run_workers  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(300)]

from ddp_worker import FSDP, OPS  # noqa: E402

#: Order-dependent float results at world size 3 (see the module docstring), and their tolerance.
ORDER_DEPENDENT = {"all_reduce_product_fp32": (np.float32, 1e-6), "all_reduce_sum_complex64": (np.float32, 1e-6),
                   "reduce_sum": (np.float32, 1e-6), "all_reduce_coalesced_product": (np.float32, 1e-6),
                   "all_reduce_coalesced_sum": (np.float32, 1e-6), "relay_reduce_scatter": (np.float32, 1e-6)}
#: DDP over the redsrv group with gradient accumulation (torch's suite reserves its own versions
#: of these for backends it names); checked like the other DDP configurations.
DDP_CONFIGS = ["backend_ddp_no_sync", "backend_ddp_no_sync_grad_view", "backend_ddp_allreduce_hook"]
CONFIGS = ["ops", *FSDP, *DDP_CONFIGS]


def _detail(_rank: int) -> dict[str, str]:
    """The peer-link collectives are checked across ranks as PyTorch checks its own backends':
    under TORCH_DISTRIBUTED_DEBUG=DETAIL (docs/torch_backend.md, "Mismatched collectives")."""
    return {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> Run:  # type: ignore[no-untyped-def]
    return run_workers(2, CONFIGS, str(tmp_path_factory.mktemp("ops2")), env_of=_detail)


@pytest.fixture(scope="module")
def world3(tmp_path_factory) -> Run:  # type: ignore[no-untyped-def]
    return run_workers(3, CONFIGS, str(tmp_path_factory.mktemp("ops3")), env_of=_detail)


@pytest.fixture(params=["world2", "world3"])
def run(request: pytest.FixtureRequest) -> Run:
    return request.getfixturevalue(request.param)  # type: ignore[no-any-return]


def _checked(run: Run, config: str) -> None:
    for rank, report in enumerate(run.reports):
        assert report["errors"].get(config, "not run") is None, f"rank {rank} failed {config}:\n{report['errors'].get(config)}"


@pytest.mark.parametrize("name", OPS)
def test_op_matches_gloo(run: Run, name: str) -> None:
    _checked(run, "ops")
    for rank in range(run.world_size):
        errors = {k: v for k, v in run.reports[rank]["op_errors"].items() if k.startswith(name + "/")}
        assert not errors, f"rank {rank}: {errors}"
        gloo = run.results[rank][f"ops/{name}/gloo"]
        ours = run.results[rank][f"ops/{name}/redsrv"]
        if run.world_size > 2 and name in ORDER_DEPENDENT and gloo.size:
            dtype, tolerance = ORDER_DEPENDENT[name]
            error = relative_error(gloo.view(dtype), ours.view(dtype))
            assert error <= tolerance, f"{name}: rank {rank} off by {error:.3g}"
        else:
            assert gloo.tobytes() == ours.tobytes(), f"{name}: rank {rank} differs from gloo"


def test_mismatched_contributions_fail_on_every_rank(run: Run) -> None:
    _checked(run, "ops")
    for rank, report in enumerate(run.reports):
        assert report["mismatch"].startswith("ContributionMismatchError"), f"rank {rank}: {report['mismatch']}"


#: Peer-link collectives made to disagree across ranks by ``ddp_worker.run_ops``, and what the
#: message must name.
PEER_MISMATCHES = {"gather": "redsrv gather #", "gather_dtype": "rank 0 passed float32 tensors, rank 1 float64",
                   "scatter": "redsrv scatter #", "all_to_all": "sends 2 elements to rank 0, which expects 1",
                   "all_to_all_single": "redsrv all_to_all_single #", "all_to_all_single_splits": "expects 1 from it",
                   "all_gather": "redsrv all_gather #", "all_gather_into_tensor": "the first of 2 elements",
                   "reduce_scatter": "redsrv reduce_scatter #", "reduce_scatter_tensor": "redsrv reduce_scatter_tensor #",
                   "reduce_scatter_op": "rank 0 reduces with sum, rank 1 with max",
                   "op": "rank 0 called gather, rank 1 called scatter", "broadcast": ""}


@pytest.mark.parametrize("name", PEER_MISMATCHES)
def test_mismatched_peer_collectives_fail_on_every_rank(run: Run, name: str) -> None:
    _checked(run, "ops")
    for rank, report in enumerate(run.reports):
        result = report["peer_mismatch"][name]
        assert result["outcome"].startswith("ContributionMismatchError: "), f"rank {rank}: {result['outcome']}"
        assert PEER_MISMATCHES[name] in result["outcome"], f"rank {rank}: {result['outcome']}"
        assert result["seconds"] < 5.0, f"rank {rank} took {result['seconds']:.1f}s"
        # the group stays in step after every mismatch
        assert report["after_mismatch"] == [float(r) for r in range(run.world_size)], report["after_mismatch"]


def test_peer_link_timeout_is_a_redsrv_error(run: Run) -> None:
    _checked(run, "ops")
    outcome = run.reports[0]["peer_timeout"]
    assert outcome.startswith("PeerTimeoutError after "), outcome
    assert "redsrv recv over peer links" in outcome and "timeout=1.000s" in outcome, outcome
    assert float(outcome.split()[2].rstrip("s:")) < 1.0 + 3.0, outcome


@pytest.mark.parametrize("config", FSDP)
def test_fsdp_trains_like_gloo(run: Run, config: str) -> None:
    _checked(run, config)
    for rank in range(run.world_size):
        data = run.results[rank]
        for what in ("losses", "params"):
            gloo, ours = data[f"{config}/gloo/{what}"], data[f"{config}/redsrv/{what}"]
            assert gloo.tobytes() == ours.tobytes(), f"{config} {what}: rank {rank} differs from gloo ({gloo} vs {ours})"


@pytest.mark.parametrize("config", DDP_CONFIGS)
def test_ddp_with_gradient_accumulation_matches_gloo(run: Run, config: str) -> None:
    check_training(run, config)
