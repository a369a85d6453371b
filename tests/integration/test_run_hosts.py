"""``redsrv run -np 4 -H h0:2,h1:2`` across two emulated hosts (network namespaces cabled to a
switch, benchmarks/netns.py): the reducers start on the launching host, mpirun starts two
workers on each host, a Horovod script with only its import changed reduces across both, and
every line comes back with its rank. Open MPI reaches the second host through an rsh agent that
enters its namespace, where a cluster would use ssh. Needs root, iproute2 and Open MPI's
mpirun; the unit tests (tests/unit/test_run_hosts.py) check the delegated line everywhere."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from conftest import child_env
from tests_support import why_no_namespaces

pytestmark = [pytest.mark.netns, pytest.mark.torch, pytest.mark.timeout(150)]


def _why_not() -> str | None:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        return "no mpirun on PATH: the delegated line is checked by tests/unit/test_run_hosts.py"
    shown = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    if "Open MPI" not in shown.stdout + shown.stderr:
        return "the emulated hosts are reached through Open MPI's rsh agent; this mpirun is not Open MPI"
    try:
        import torch  # noqa: F401
    except ImportError:
        return "needs PyTorch for the Horovod script"
    return why_no_namespaces()


REASON = _why_not()

# A Horovod script, import changed: an allreduce, and the address this worker reaches the reducers from.
WORKER = """
import os, socket, torch
import redsrv.horovod.torch as hvd
hvd.init()
total = hvd.allreduce(torch.full((3,), float(hvd.rank() + 1)), op=hvd.Sum)
host, port = os.environ["REDSRV_REDUCERS"].split(",")[0].rsplit(":", 1)
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
    probe.connect((host, int(port)))
    here = probe.getsockname()[0]
topology = [hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()]
exported = [os.environ["HOROVOD_" + n] for n in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")]
print("rank", hvd.rank(), "of", hvd.size(), "sum", int(total[0]), "from", here, "reducer", host,
      "local", *topology, "env", *exported, flush=True)
"""

# Open MPI starts its daemon on a remote host with `AGENT host command`: here, enter that host's namespace.
AGENT = """#!/bin/sh
host=$1; shift
exec ip netns exec {prefix}-h$(( ${{host##*.}} - 1 )) /bin/sh -c "$*"
"""


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_a_horovod_script_runs_across_two_emulated_hosts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from redsrv.bench.netns import Cluster, our_namespaces

    prefix = f"rsh{os.getpid() % 100000}"
    agent = tmp_path / "agent.sh"
    agent.write_text(AGENT.format(prefix=prefix))
    agent.chmod(0o755)
    with Cluster(2, 0, prefix=prefix) as cluster:
        h0, h1 = (h.ip for h in cluster.hosts)
        env = child_env({"OMPI_MCA_plm_rsh_agent": str(agent)})
        run = cluster.spawn(0, [sys.executable, "-m", "redsrv", "run", "-np", "4", "-H", f"{h0}:2,{h1}:2",
                                "--output-filename", str(tmp_path / "logs"), sys.executable, "-c", WORKER],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = run.communicate(timeout=120)
        finally:
            cluster.stop([run])
    assert our_namespaces(prefix) == []
    assert run.returncode == 0, out.decode() + err.decode()
    rows = sorted(line.split() for line in out.decode().splitlines() if " rank " in line)
    assert [row[0] for row in rows] == ["[0]", "[1]", "[2]", "[3]"]  # whole lines, each with its rank
    assert all(row[2] == row[0].strip("[]") and row[4] == "4" and row[6] == "10" for row in rows)  # 1+2+3+4 everywhere
    assert [row[8] for row in rows] == [h0, h0, h1, h1]  # ranks 0-1 on the first host, 2-3 on the second
    assert {row[10] for row in rows} == {h0}  # the reducers run on the launching host
    # local rank, local size, cross rank, cross size: two hosts of two
    assert [row[12:16] for row in rows] == [["0", "2", "0", "2"], ["1", "2", "0", "2"], ["0", "2", "1", "2"],
                                            ["1", "2", "1", "2"]]
    # horovodrun's variables, as each rank's shim set them: the rank and size, then the same topology
    assert [row[17:] for row in rows] == [[row[2], "4", *row[12:16]] for row in rows]
    # mpirun wrote each rank's stdout to a file of its own (Open MPI's layout: logs/<job>/rank.<n>/stdout).
    written = sorted(os.path.basename(folder) for folder, _, files in os.walk(tmp_path / "logs") if "stdout" in files)
    assert written == ["rank.0", "rank.1", "rank.2", "rank.3"]
