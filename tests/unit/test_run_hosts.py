"""``redsrv run -H`` / ``--hostfile`` (cli/hosts.py): Horovod's host syntax, the ranks each host
runs, and the exact command lines handed to mpirun, srun and torchrun."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from redsrv.cli.hosts import (
    HostSlots,
    MpiOutput,
    assign_ranks,
    exported_names,
    horovod_variables,
    is_local,
    manual_commands,
    mpi_flavour,
    mpirun_command,
    parse_hosts,
    read_hostfile,
)
from redsrv.core.errors import ConfigError

from conftest import child_env


def test_hosts_parse_as_horovod_writes_them() -> None:
    assert parse_hosts("a:4, b:2,c") == [HostSlots("a", 4), HostSlots("b", 2), HostSlots("c", 1)]
    assert parse_hosts("[fe80::1]:2,10.0.0.1:3") == [HostSlots("fe80::1", 2), HostSlots("10.0.0.1", 3)]
    for bad, said in (("a:0", "positive"), ("a:x", "positive"), ("a:2,a:2", "more than once"), (",", "names no host")):
        with pytest.raises(ConfigError, match=said):
            parse_hosts(bad)


def test_a_hostfile_is_host_slots_lines(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "hosts"
    path.write_text("# the cluster\nnode1 slots=4\n\nnode2   slots=2  # half\nnode3\n")
    assert read_hostfile(str(path)) == [HostSlots("node1", 4), HostSlots("node2", 2), HostSlots("node3", 1)]
    path.write_text("node1 4\n")
    with pytest.raises(ConfigError, match="line 1"):
        read_hostfile(str(path))
    with pytest.raises(ConfigError, match="cannot read hostfile"):
        read_hostfile(str(tmp_path / "missing"))


def test_ranks_fill_the_first_hosts_slots_first() -> None:
    hosts = parse_hosts("a:2,b:2,c:4")
    assert assign_ranks(hosts, 4) == [("a", 2), ("b", 2)]
    assert assign_ranks(hosts, 7) == [("a", 2), ("b", 2), ("c", 3)]
    with pytest.raises(ConfigError, match="does not fit the 8 slots"):
        assign_ranks(hosts, 9)
    assert is_local(parse_hosts("localhost:4")) and is_local(parse_hosts("me:2"), ["me"])
    assert not is_local(parse_hosts("localhost:2,b:2"))


def test_the_open_mpi_line_is_exactly_this() -> None:
    env = {"REDSRV_JOB": "j", "REDSRV_SECRET": "s" * 64, "MASTER_ADDR": "a", "HOME": "/root", "PATH": "/bin"}
    names = exported_names(env)
    assert names == ["MASTER_ADDR", "PATH", "REDSRV_JOB", "REDSRV_SECRET"]  # names only: no value on the line
    line = mpirun_command("openmpi", assign_ranks(parse_hosts("a:2,b:2"), 4), ["python", "train.py", "--lr", "0.1"],
                          exported=names, output_dir="logs", as_root=True, mpi_args=["--mca", "btl_tcp_if_include", "eth0"])
    assert line == ["mpirun", "--allow-run-as-root", "--tag-output", "-np", "4", "-H", "a:2,b:2", "-bind-to", "none",
                    "-map-by", "slot", "--output-filename", "logs", "-x", "MASTER_ADDR", "-x", "PATH", "-x", "REDSRV_JOB",
                    "-x", "REDSRV_SECRET", "--mca", "btl_tcp_if_include", "eth0", "python", "train.py", "--lr", "0.1"]
    assert "s" * 64 not in " ".join(line)


def test_the_mpich_line_is_exactly_this_and_needs_equal_hosts() -> None:
    line = mpirun_command("mpich", [("a", 2), ("b", 2)], ["python", "t.py"], exported=["REDSRV_JOB", "PATH"],
                          output_dir="logs")
    assert line == ["mpirun", "-l", "-np", "4", "-hosts", "a,b", "-ppn", "2", "-outfile-pattern", "logs/rank.%r/stdout",
                    "-errfile-pattern", "logs/rank.%r/stderr", "-genvlist", "REDSRV_JOB,PATH", "python", "t.py"]
    with pytest.raises(ConfigError, match="same number of workers"):
        mpirun_command("mpich", [("a", 2), ("b", 1)], ["python"], exported=[])
    assert mpi_flavour("mpirun (Open MPI) 4.1.4") == "openmpi" and mpi_flavour("HYDRA build details") == "mpich"
    assert mpi_flavour("IBM Spectrum MPI") is None


def test_open_mpis_tagged_pieces_become_whole_rank_lines() -> None:
    out = MpiOutput()
    # What an unbuffered print under --tag-output looks like: every write tagged, ranks interleaved.
    got = out.feed(b"[1,0]<stdout>:0[1,2]<stdout>:2[1,0]<stdout>: [1,0]<stdout>:ok\n")
    got += out.feed(b"[1,2]<stdout>: ok\n")
    assert got == [b"[0] 0 ok\n", b"[2] 2 ok\n"]


def test_manual_lines_pass_the_secret_by_file() -> None:
    lines = manual_commands([("a", 1), ("b", 2)], ["python", "t.py"], variables={"REDSRV_SECRET_FILE": "/s"}, master_port=1)
    assert lines == [("inside a SLURM allocation",
                      "srun --nodes=2 --ntasks=3 --nodelist=a,b --export=ALL,REDSRV_SECRET_FILE=/s python t.py")]


def test_without_mpirun_the_lines_to_run_are_printed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = child_env({"PATH": str(tmp_path)})  # no mpirun on it
    result = subprocess.run([sys.executable, "-m", "redsrv", "run", "-np", "2", "-H", "198.18.0.1:1,198.18.0.2:1",
                             "--reducer-host", "127.0.0.1", "python", "train.py"], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "no mpirun on PATH" in result.stderr
    assert "redsrv reducer --host 127.0.0.1 --port 29600" in result.stderr
    assert "srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --nodelist=198.18.0.1,198.18.0.2" in result.stderr
    assert "torchrun --nnodes=2 --nproc-per-node=1 --node-rank=1 --master-addr=198.18.0.1" in result.stderr


WORKER = "import os, sys; print('out', os.environ['RANK']); print('err', os.environ['RANK'], file=sys.stderr)"


def test_output_filename_writes_each_ranks_streams(tmp_path) -> None:  # type: ignore[no-untyped-def]
    logs = tmp_path / "logs"
    result = subprocess.run([sys.executable, "-m", "redsrv", "run", "-np", "2", "-H", "localhost:2", "--output-filename",
                             str(logs), sys.executable, "-c", WORKER], env=child_env(), capture_output=True, text=True,
                            timeout=90)
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(logs)) == ["rank.0", "rank.1"]
    for rank in range(2):
        assert (logs / f"rank.{rank}" / "stdout").read_text() == f"out {rank}\n"
        assert (logs / f"rank.{rank}" / "stderr").read_text() == f"err {rank}\n"
    assert sorted(result.stdout.splitlines()) == ["[0] out 0", "[1] out 1"]  # the console still gets them


@pytest.mark.parametrize(("counts", "rank", "expected"), [
    ([2, 2], 0, (0, 4, 0, 2, 0, 2)),
    ([2, 2], 3, (3, 4, 1, 2, 1, 2)),
    ([2, 1], 1, (1, 3, 1, 2, 0, 1)),  # the second host has no local rank 1
    ([2, 1], 2, (2, 3, 0, 1, 1, 2)),
    ([4], 2, (2, 4, 2, 4, 0, 1)),
])
def test_horovod_variables_are_horovodruns(counts: list[int], rank: int, expected: tuple) -> None:  # type: ignore[type-arg]
    v = horovod_variables(counts, rank)
    names = ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")
    assert tuple(int(v[f"HOROVOD_{n}"]) for n in names) == expected
    with pytest.raises(ValueError, match=f"rank {sum(counts)} is not one of the {sum(counts)} workers"):
        horovod_variables(counts, sum(counts))


@pytest.mark.parametrize("launcher", [{"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"},
                                      {"PMI_RANK": "3", "PMI_SIZE": "4"}])
def test_the_shim_mpirun_starts_sets_horovods_variables_then_runs_the_command(launcher: dict[str, str]) -> None:
    from redsrv.cli.hvd_env import wrap

    show = "import os; print(*(os.environ[n] for n in sorted(os.environ) if n.startswith('HOROVOD_')))"
    done = subprocess.run(wrap([2, 2], [sys.executable, "-c", show]), env=child_env(launcher), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    # CROSS_RANK, CROSS_SIZE, LOCAL_RANK, LOCAL_SIZE, RANK, SIZE (sorted by name)
    assert done.stdout.split() == ["1", "2", "1", "2", "3", "4"]
    missing = subprocess.run(wrap([1], ["no-such-command-here"]), env=child_env({"PMI_RANK": "0", "PMI_SIZE": "1"}),
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 127 and "cannot start 'no-such-command-here'" in missing.stderr
