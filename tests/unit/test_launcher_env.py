"""Rank and world size from the launchers' own variables (Open MPI, MPICH, SLURM, torchrun),
with the conflict rule every other source follows."""

from __future__ import annotations

import pytest

from redsrv.core.config import Config
from redsrv.core.errors import ConfigError

BASE = {"REDSRV_REDUCERS": "127.0.0.1:7000"}


@pytest.mark.parametrize(("env", "rank", "size"), [
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3"}, 2, 3),
    ({"PMI_RANK": "1", "PMI_SIZE": "4"}, 1, 4),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}, 5, 8),
    ({"RANK": "1", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, 1, 2),  # agree: fine
    # mpirun inside a SLURM batch script: every rank inherits the batch step's SLURM_PROCID=0.
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, 1, 2),
])
def test_rank_and_size_from_launchers(env: dict[str, str], rank: int, size: int) -> None:
    config = Config.from_env({**BASE, **env})
    assert (config.rank, config.world_size) == (rank, size)


@pytest.mark.parametrize(("env", "message"), [
    ({"RANK": "0", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"},
     "conflicting rank: RANK gives 0 but OMPI_COMM_WORLD_RANK gives 1"),
    ({"REDSRV_WORLD_SIZE": "4", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"},
     "conflicting world_size: REDSRV_WORLD_SIZE gives 4 but SLURM_NTASKS gives 2"),
    ({"PMI_RANK": "x", "PMI_SIZE": "2"}, "PMI_RANK='x' is not a valid int"),
])
def test_launchers_that_disagree_are_a_config_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Config.from_env({**BASE, **env})


def test_explicit_arguments_win_over_launchers() -> None:
    config = Config.from_env({**BASE, "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, rank=0, world_size=1)
    assert (config.rank, config.world_size) == (0, 1)
