"""The elastic rendezvous (core/membership.py, core/rendezvous.py): which world forms when, who is
rank 0, that each epoch is its own job, and that only the job's workers are answered."""

from __future__ import annotations

import pytest

from redsrv.core.errors import PeerLostError
from redsrv.core.membership import Membership, epoch_job
from redsrv.core.rendezvous import RendezvousClient, RendezvousServer

SECRET = b"s" * 32


def started(*workers: str, min_size: int = 2, max_size: int = 3) -> Membership:
    world = Membership("run-x", min_size=min_size, max_size=max_size)
    for worker in workers:
        world.started(worker)
    return world


def test_the_first_world_waits_for_every_worker_started() -> None:
    world = started("w0", "w1", "w2")
    assert world.join("w0", -1) == (None, False) and world.join("w1", -1) == (None, False)
    assigned, formed = world.join("w2", -1)
    assert formed and assigned is not None and (assigned.epoch, assigned.rank, assigned.size) == (0, 2, 3)
    assert world.join("w0", -1)[0].rank == 0  # type: ignore[union-attr] - asked again: the same place


def test_a_lost_worker_ends_the_world_and_survivors_keep_their_order() -> None:
    world = started("w0", "w1", "w2")
    for worker in ("w0", "w1", "w2"):
        world.join(worker, -1)
    assert not world.exited("w0", -9)  # rank 0 died; w1 and w2 have not asked yet
    assert world.join("w2", 0) == (None, False)
    assigned, formed = world.join("w1", 0)
    assert formed and assigned is not None and (assigned.epoch, assigned.rank, assigned.size) == (1, 0, 2)
    assert world.assignments["w2"].rank == 1
    assert assigned.job == epoch_job("run-x", 1) != epoch_job("run-x", 0)  # a new job: sums never mix


def test_a_newcomer_joins_at_a_commit_and_after_the_survivors() -> None:
    world = started("w0", "w1", "w2")
    for worker in ("w0", "w1", "w2"):
        world.join(worker, -1)
    world.exited("w1", -9)
    world.join("w0", 0)
    world.join("w2", 0)
    world.started("w3")
    assert not world.hosts_updated(1)
    assert world.join("w3", -1) == (None, False)  # waits: the world of 2 is running
    assert world.hosts_updated(1) and not world.hosts_updated(0)  # told at the current world's commit only
    world.join("w0", 1)
    assigned, formed = world.join("w2", 1)
    assert formed and [world.assignments[w].rank for w in ("w0", "w2", "w3")] == [0, 1, 2]
    assert world.assignments["w3"].size == 3 and world.epoch == 2 and not world.hosts_updated(2)


def test_too_few_survivors_wait_for_a_newcomer_and_a_success_ends_the_job() -> None:
    world = started("w0", "w1")
    world.join("w0", -1)
    world.join("w1", -1)
    world.exited("w1", 1)
    assert world.join("w0", 0) == (None, False)  # 1 < min_size 2
    world.started("w2")
    assigned, formed = world.join("w2", -1)
    assert formed and assigned is not None and assigned.rank == 1 and world.assignments["w0"].rank == 0
    world.exited("w0", 0)
    assert world.finished and world.join("w2", 1) == (None, False)
    with pytest.raises(ValueError, match="not one the driver started"):
        world.join("w9", -1)


def test_the_rendezvous_answers_only_its_own_workers() -> None:
    world = started("w0", min_size=1, max_size=1)
    server = RendezvousServer(world, SECRET, poll=0.5)
    try:
        assigned = RendezvousClient(server.address, "w0", SECRET).join(-1, timeout=10)
        assert (assigned.epoch, assigned.rank, assigned.size) == (0, 0, 1)
        assert not RendezvousClient(server.address, "w0", SECRET).hosts_updated(0)
        with pytest.raises(PeerLostError, match="403"):
            RendezvousClient(server.address, "w0", b"t" * 32).join(-1, timeout=10)
    finally:
        server.close()
    with pytest.raises(PeerLostError, match="driver .* is gone"):
        RendezvousClient(server.address, "w0", SECRET, connect_timeout=1).hosts_updated(0)


def test_an_elastic_worker_needs_its_id_and_the_jobs_secret() -> None:
    from redsrv.core.config import Config
    from redsrv.core.errors import ConfigError

    env = {"REDSRV_RENDEZVOUS": "127.0.0.1:9", "REDSRV_SECRET": "s" * 32}
    assert Config.from_env({**env, "REDSRV_WORKER_ID": "w1"}).worker_id == "w1"
    with pytest.raises(ConfigError, match="REDSRV_WORKER_ID"):
        Config.from_env(env)
    with pytest.raises(ConfigError, match="secret"):
        Config.from_env({"REDSRV_RENDEZVOUS": "127.0.0.1:9", "REDSRV_WORKER_ID": "w1"})
