"""One rank of the DDP recovery tests (tests/adapters/torch/test_recovery_ddp.py).

    python ddp_recovery_worker.py SPEC_JSON OUT_PREFIX

SPEC: {"rank", "world_size", "reducers", "store" (FileStore path for DDP's own process group),
       "steps", "config": {Config fields for the hook's client}}

Trains a small model with DDP and the redsrv hook twice from the same seed: first while the test
injects a fault into a reducer ("faulted"), then again with a fresh client and nothing injected
("clean"). Writes OUT_PREFIX.progress ("<run> <step>") after every step and, at the end,
OUT_PREFIX.json: whether the two runs' parameters are bitwise equal, or the error.
"""

from __future__ import annotations

import json
import sys
import traceback

import torch
import torch._dynamo  # noqa: F401 - DDP imports it on first use; before any client exists
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import redsrv.torch


def train(spec: dict, run: str, out_prefix: str) -> list[torch.Tensor]:  # type: ignore[type-arg]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    ddp = DDP(model, bucket_cap_mb=0.05)  # several buckets per step
    state = redsrv.torch.HookState(spec["reducers"], rank=spec["rank"], world_size=spec["world_size"],
                                   job=f"ddp-recovery-{run}", **spec["config"])
    ddp.register_comm_hook(state, redsrv.torch.redsrv_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    try:
        for step in range(spec["steps"]):
            data = torch.Generator().manual_seed(1000 * step + spec["rank"])
            x, y = torch.randn(32, 64, generator=data), torch.randn(32, 64, generator=data)
            optimizer.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            optimizer.step()
            with open(out_prefix + ".progress", "w") as f:
                f.write(f"{run} {step}")
    finally:
        state.close()
    return [p.detach().clone() for p in model.parameters()]


def main() -> int:
    spec = json.loads(sys.argv[1])
    out_prefix = sys.argv[2]
    report: dict = {"rank": spec["rank"], "error": None}  # type: ignore[type-arg]
    dist.init_process_group("gloo", store=dist.FileStore(spec["store"], spec["world_size"]), rank=spec["rank"],
                            world_size=spec["world_size"])
    try:
        faulted = train(spec, "faulted", out_prefix)
        clean = train(spec, "clean", out_prefix)
        report["equal"] = all(torch.equal(a, b) for a, b in zip(faulted, clean, strict=True))
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    finally:
        dist.destroy_process_group()
    with open(out_prefix + ".json", "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
