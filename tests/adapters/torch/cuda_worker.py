"""One rank of ``test_cuda_hook.py``: DDP on CUDA tensors, through the redsrv hook or through a
c10d backend's own all-reduce (gloo, nccl). Writes the final parameters to ``<prefix>.npz`` and
the step times (and any error) to ``<prefix>.json``."""

from __future__ import annotations

import json
import statistics
import sys
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import redsrv.torch


def main() -> int:
    spec = json.loads(sys.argv[1])
    prefix = sys.argv[2]
    rank, size, path = spec["rank"], spec["world_size"], spec["path"]
    report: dict = {"rank": rank, "path": path, "error": None}
    torch.cuda.set_device(spec["device"])
    device = torch.device("cuda", spec["device"])
    try:
        backend = "nccl" if path == "nccl" else "gloo"
        dist.init_process_group(backend, init_method="file://" + spec["store"], rank=rank, world_size=size)
        torch.manual_seed(0)
        width = spec["width"]
        model = nn.Sequential(*[layer for _ in range(spec["layers"]) for layer in (nn.Linear(width, width), nn.Tanh())],
                              nn.Linear(width, 1)).to(device)
        ddp = DDP(model, device_ids=[device])
        state = None
        if path.startswith("redsrv"):
            state = redsrv.torch.HookState(spec["reducers"], rank=rank, world_size=size, job=spec["job"])
            if path == "redsrv-unstaged":
                # The A of the A/B: the hook as it was before _CudaStaging, a blocking .cpu()
                # copy out and a copy back on the completion thread's default stream.
                state._staging.to_host = lambda buffer, index: None  # type: ignore[method-assign]
            ddp.register_comm_hook(state, redsrv.torch.redsrv_hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
        times = []
        for step in range(spec["steps"]):
            generator = torch.Generator().manual_seed(step * size + rank)
            x = torch.randn(64, width, generator=generator).to(device)
            torch.cuda.synchronize()
            started = time.perf_counter()
            loss = ddp(x).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        report["step_ms_median"] = 1000 * statistics.median(times[2:])
        report["gradient_mib"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        if state is not None:
            report["pinned_buffers"] = [int(t.is_pinned()) for t in state._staging._buffers.values()]
            state.close()
        np.savez(prefix + ".npz", params=torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().numpy())
        dist.destroy_process_group()
    except Exception:
        report["error"] = traceback.format_exc()
    with open(prefix + ".json", "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
