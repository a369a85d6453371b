"""``hvd.elastic.ElasticSampler``: the split across ranks, progress kept through commit, restore
and sync, and the re-split after a world changes size, with every sample processed exactly once
per epoch. Worlds are simulated in one process (the sampler asks ``hvd.rank()``/``hvd.size()``
only at a reset); the run across a lost worker is tests/adapters/horovod/test_hvd_elastic.py."""

from __future__ import annotations

import collections
import os
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

import redsrv.horovod.torch as hvd  # noqa: E402
from redsrv.adapters.horovod import common  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.timeout(60)]


@pytest.fixture
def one_rank(monkeypatch) -> Iterator[None]:  # type: ignore[no-untyped-def]
    """A one-rank job without reducers: every collective (the sampler's sync) is local."""
    for name in [k for k in os.environ if k.startswith("REDSRV_") or k in ("RANK", "WORLD_SIZE")]:
        monkeypatch.delenv(name)
    hvd.init()
    yield
    hvd.shutdown()


def as_rank(monkeypatch, rank: int, size: int) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(common, "rank", lambda: rank)
    monkeypatch.setattr(common, "size", lambda: size)


def world(monkeypatch, dataset: list[int], size: int, state: dict | None = None,  # type: ignore[no-untyped-def, type-arg]
          **kwargs) -> list[hvd.elastic.ElasticSampler]:  # type: ignore[no-untyped-def]
    """One sampler per rank of a world of ``size``, each loaded with ``state`` (a sync's result)."""
    samplers = []
    for rank in range(size):
        as_rank(monkeypatch, rank, size)
        sampler = hvd.elastic.ElasticSampler(dataset, **kwargs)
        if state is not None:
            sampler.load_state_dict(state)
        samplers.append(sampler)
    return samplers


def test_ranks_split_one_shuffled_order_like_horovod(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    samplers = world(monkeypatch, list(range(12)), 3, seed=7)
    passes = [list(s) for s in samplers]
    assert [len(s) for s in samplers] == [4, 4, 4]
    assert sorted(i for p in passes for i in p) == list(range(12))
    assert passes[0] != [0, 3, 6, 9]  # shuffled, with seed + epoch
    again = world(monkeypatch, list(range(12)), 3, seed=7)
    assert [list(s) for s in again] == passes  # the same order on every rank and every run
    samplers[0].set_epoch(1)
    assert list(samplers[0]) != passes[0]
    plain = world(monkeypatch, list(range(12)), 3, shuffle=False)
    assert list(plain[1]) == [1, 4, 7, 10]
    assert plain[1].get_indices(1, 2) == [7, 10] and plain[1].get_indices(2, 2) == []


def test_a_world_that_shrinks_mid_epoch_processes_each_sample_once(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    dataset, batch = list(range(60)), 2
    seen: collections.Counter[int] = collections.Counter()
    samplers = world(monkeypatch, dataset, 3)
    for sampler in samplers:
        iter(sampler)
    for batch_idx in range(3):  # three batches on every rank, recorded and committed
        for sampler in samplers:
            seen.update(sampler.get_indices(batch_idx, batch))
            sampler.record_batch(batch_idx, batch)
    committed = samplers[0].state_dict()
    assert committed["processed_num"] == 18
    for sampler in samplers:  # a fourth batch, never committed: the restore forgets it
        sampler.record_batch(3, batch)
    # Rank 2 is lost; the survivors restore the commit and re-form at size 2.
    survivors = world(monkeypatch, dataset, 2, state=committed)
    assert [len(s) for s in survivors] == [21, 21]
    for sampler in survivors:
        seen.update(sampler)
    assert sorted(seen) == dataset and set(seen.values()) == {1}


def test_a_world_that_grows_at_a_commit_keeps_going_from_there(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    dataset, batch = list(range(30)), 3
    samplers = world(monkeypatch, dataset, 2)
    seen = [i for s in samplers for i in list(s)[:batch]]
    for sampler in samplers:
        sampler.record_batch(0, batch)
    grown = world(monkeypatch, dataset, 3, state=samplers[0].state_dict())
    seen += [i for s in grown for i in s]
    assert sorted(seen) == dataset


def test_samples_marked_one_by_one_are_left_out_after_a_reset(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    dataset = list(range(20))
    samplers = world(monkeypatch, dataset, 2, shuffle=False)
    samplers[0].record_indices([0, 2])
    samplers[1].record_indices([1])
    union = sorted(set(samplers[0].state_dict()["processed_indices"]) | set(samplers[1].state_dict()["processed_indices"]))
    state = {**samplers[0].state_dict(), "processed_indices": union}
    after = world(monkeypatch, dataset, 2, state=state, shuffle=False)
    firsts = [list(s) for s in after]
    assert sorted(firsts[0] + firsts[1]) == sorted([3, *range(3, 20)])  # 17 left: one repeated to even out
    # record_batch after record_indices marks the batch's samples by index, on every rank alike.
    after[0].record_batch(0, 2)
    assert set(after[0].state_dict()["processed_indices"]) == {0, 1, 2, 3, 4, 5, 6}


def test_horovod_028_state_dict_loads(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    sampler = world(monkeypatch, list(range(10)), 1, shuffle=False)[0]
    sampler.load_state_dict({"epoch": 3, "processed_num": 4})
    assert (sampler.epoch, list(sampler)) == (3, [4, 5, 6, 7, 8, 9])


def test_torch_state_commits_restores_and_syncs_the_sampler(one_rank) -> None:  # type: ignore[no-untyped-def]
    dataset = list(range(16))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=False)
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, sampler=sampler)
    state = hvd.elastic.TorchState(sampler=sampler, epoch=0)
    for batch_idx, values in enumerate(loader):
        assert values.tolist() == sampler.get_indices(batch_idx, 4)
        sampler.record_batch(batch_idx, 4)
        if batch_idx == 1:
            state.commit()
            committed = sampler.state_dict()
    assert sampler.processed_num == 16
    state.restore()
    assert sampler.state_dict() == committed and list(sampler) == list(range(8, 16))
    sampler.record_indices([9])
    state.sync()
    assert list(sampler) == [8, *range(10, 16)]
    state.on_reset()  # a new world: re-split without losing the progress
    assert list(sampler) == [8, *range(10, 16)]
    sampler.set_epoch(1)
    assert len(sampler) == 16 and sampler.state_dict()["processed_indices"] == []
