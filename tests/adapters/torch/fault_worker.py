"""A DDP worker whose reductions fail, for the error-propagation tests.

    python fault_worker.py SPEC_JSON OUT_PREFIX

DDP runs on a one-rank gloo group (its control traffic stays local) while the hook's job has
two ranks and the second never comes: every bucket waits on the reducer, which is what the test
needs to fail a step in the middle. Scenarios, in order:

* "timeout": reducer ``spec["timeout_reducer"]``, ``op_timeout`` of ``spec["op_timeout"]`` s:
  backward() must raise the timeout.
* "killed": reducer ``spec["killed_reducer"]``; writes OUT_PREFIX.waiting just before
  backward(), and the test kills that reducer while the step is open. Then one more step,
  which must fail at once (the client is broken), not hang.

OUT_PREFIX.json: per scenario the exception's text and the wall-clock times around backward().
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import redsrv.torch


def step(ddp: DDP) -> dict:
    started = time.time()
    try:
        ddp(torch.randn(4, 16)).sum().backward()
    except Exception as exc:
        return {"error": str(exc), "type": type(exc).__name__, "started": started, "raised": time.time()}
    return {"error": None, "started": started, "raised": time.time()}


def main() -> int:
    spec = json.loads(sys.argv[1])
    prefix = sys.argv[2]
    torch.set_num_threads(1)
    report: dict = {}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = DDP(nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4)))
        with redsrv.torch.HookState([spec["timeout_reducer"]], rank=0, world_size=2, job="fault-timeout",
                                    op_timeout=spec["op_timeout"]) as state:
            ddp.register_comm_hook(state, redsrv.torch.redsrv_hook)
            report["timeout"] = step(ddp)

        ddp = DDP(nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4)))
        with redsrv.torch.HookState([spec["killed_reducer"]], rank=0, world_size=2, job="fault-killed") as state:
            ddp.register_comm_hook(state, redsrv.torch.redsrv_hook)
            with open(prefix + ".waiting", "w") as f:
                f.write(str(time.time()))
            report["killed"] = step(ddp)
            report["after"] = step(ddp)
    finally:
        dist.destroy_process_group()
        with open(prefix + ".json", "w") as f:
            json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
