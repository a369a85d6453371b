"""A training script as torchrun runs it, for ``test_torchrun_elastic.py``: DDP on the redsrv
backend, a checkpoint after every step (rank 0 writes it), and a restart that resumes from it.

``argv``: the folder for the checkpoint and the progress files, the number of steps, and the
step at which rank 1 of the first attempt kills itself (SIGKILL: no goodbye to anyone), or -1.
Every rank appends one JSON line per finished step to ``rank<r>.jsonl``: the step, the restart
(torchrun's ``TORCHELASTIC_RESTART_COUNT``), the loss and the wall time; the last rank 0 line
of a run holds the final weights' checksum, and ``final.pt`` the weights.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import redsrv.torch


def main() -> int:
    folder, steps, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)
    redsrv.torch.register_backend()
    dist.init_process_group("redsrv")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    checkpoint = os.path.join(folder, "checkpoint.pt")
    first = 0
    if os.path.exists(checkpoint):
        state = torch.load(checkpoint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        first = state["step"] + 1
    ddp = DDP(model)
    progress = open(os.path.join(folder, f"rank{rank}.jsonl"), "a")
    for step in range(first, steps):
        if restart == 0 and rank == 1 and step == kill_at:
            progress.write(json.dumps({"killed": time.time(), "step": step}) + "\n")
            progress.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        generator = torch.Generator().manual_seed(step * size + rank)
        x = torch.randn(16, 8, generator=generator)
        loss = nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True).sin())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            partial = checkpoint + ".partial"
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, partial)
            os.replace(partial, checkpoint)  # a kill never leaves half a checkpoint
        progress.write(json.dumps({"step": step, "restart": restart, "loss": loss.item(), "time": time.time()}) + "\n")
        progress.flush()
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(folder, "final.pt"))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
