"""An elastic Horovod training script (import changed, as a user's would be) for
test_hvd_elastic.py, run under ``redsrv run -np 3 --min-np 2``. A linear model trained with SGD
and momentum on batches drawn from (step, rank); commits every COMMIT_EVERY steps. The worker
that is rank 2 of the first world kills itself (SIGKILL, nothing cleaned up) at step DOOMED_STEP,
two steps past a commit. Rank 0 prints every step it applies and the world size it applied it
at; every worker prints its final weights (float.hex, exact). The run ends at size 3: a world
of 3 trains to at least TOTAL steps and at least 10 steps after it formed."""

from __future__ import annotations

import os
import signal
import sys

import torch

import redsrv.horovod.torch as hvd

TOTAL, COMMIT_EVERY, DOOMED_STEP, FINAL_SIZE = 30, 5, 12, 3
LIMIT = 200_000  # a world of 2 that never grows fails the test instead of running forever
MARKER = os.path.join(sys.argv[1], "killed")


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(8, 4, generator=generator)
    # Noise the model cannot fit: the weights keep moving with each batch, so the final ones
    # depend on exactly which ranks' batches were averaged at which step.
    return x, x.sum(dim=1, keepdim=True) + 0.5 + 0.5 * torch.randn(8, 1, generator=generator)


def main() -> int:
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, step=0)

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        # Every rank enters here with the same (synced) step and the same size: the same end.
        end = max(TOTAL, state.step + 10) if hvd.size() == FINAL_SIZE else LIMIT
        while state.step < end:
            if hvd.rank() == 2 and hvd.size() == 3 and state.step == DOOMED_STEP and not os.path.exists(MARKER):
                open(MARKER, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = batch(state.step, hvd.rank())
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            if hvd.rank() == 0:
                print("applied", state.step, hvd.size(), flush=True)
            state.step += 1
            if state.step % COMMIT_EVERY == 0:
                state.commit()

    train(state)
    weights = [float(v).hex() for p in model.parameters() for v in p.detach().reshape(-1)]
    print("final", hvd.size(), state.step, " ".join(weights), flush=True)
    return 0 if state.step < LIMIT else 3


if __name__ == "__main__":
    sys.exit(main())
