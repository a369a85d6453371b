"""Framework-neutral parts of the Horovod API: topology from host names, op resolution, errors."""

from __future__ import annotations

import pytest

from redsrv.adapters.horovod.common import HorovodInternalError, ReduceOp, Topology, internal_error, resolve_op
from redsrv.core.errors import ContributionMismatchError, PeerLostError, PeerTimeoutError


@pytest.mark.parametrize(("hosts", "rank", "expected"), [
    ([7, 7, 9, 9], 2, (0, 2, 1, 2, True)),
    ([7, 9, 7, 9, 7], 4, (2, 3, 0, 1, False)),  # a third process on host 7 only
    ([7, 9, 7, 9, 7], 3, (1, 2, 1, 2, False)),
    ([5], 0, (0, 1, 0, 1, True)),
])
def test_topology_from_hosts(hosts: list[int], rank: int, expected: tuple) -> None:  # type: ignore[type-arg]
    t = Topology.from_hosts(hosts, rank)
    assert (t.local_rank, t.local_size, t.cross_rank, t.cross_size, t.homogeneous) == expected


def test_resolve_op_follows_horovod() -> None:
    assert resolve_op(None, None) is ReduceOp.AVERAGE
    assert resolve_op(None, False) is ReduceOp.SUM and resolve_op(None, True) is ReduceOp.AVERAGE
    assert resolve_op(4, None) is ReduceOp.MAX
    with pytest.raises(ValueError, match="op and average"):
        resolve_op(ReduceOp.SUM, True)
    with pytest.raises(NotImplementedError, match="Adasum"):
        resolve_op(ReduceOp.ADASUM, None)


@pytest.mark.parametrize("cls", [PeerTimeoutError, PeerLostError, ContributionMismatchError])
def test_internal_error_is_both_horovods_and_redsrvs(cls: type) -> None:
    original = cls("ranks disagree", job="j", rank=1, key=("allreduce", "w", 3), timeout=2.0)
    wrapped = internal_error(original)
    assert isinstance(wrapped, HorovodInternalError) and isinstance(wrapped, cls) and isinstance(wrapped, RuntimeError)
    assert str(wrapped) == str(original) and wrapped.__cause__ is original
    assert internal_error(ValueError("misuse")).__class__ is ValueError  # argument misuse passes unchanged


def test_a_launchers_local_ranks_win_over_the_hosts() -> None:
    # Hosts say one host of 3; the launcher says ranks 0-1 share a host and rank 2 is alone.
    t = Topology.from_hosts([7, 7, 7], 2, given=[(0, 2), (1, 2), (0, 1)])
    assert (t.local_rank, t.local_size, t.cross_rank, t.cross_size, t.homogeneous) == (0, 1, 1, 2, False)
