"""An elastic Horovod script reading its data through ``hvd.elastic.ElasticSampler``, for
test_hvd_elastic.py, run under ``redsrv run -np 3 --min-np 2``. Each batch, the ranks gather the
samples they processed (the step's collective) into ``state.seen``, a plain object committed and
restored with the sampler, so at the end of an epoch it holds exactly the samples whose work was
kept. Rank 0 prints it per epoch. The worker that is rank 2 of the first world kills itself
(SIGKILL) one batch past a commit in epoch 0; the run ends at size 3 once EPOCHS epochs are done."""

from __future__ import annotations

import os
import signal
import sys

import torch

import redsrv.horovod.torch as hvd

SAMPLES, BATCH, COMMIT_EVERY, EPOCHS, DOOMED_BATCH, FINAL_SIZE = 60, 2, 3, 2, 4, 3
LIMIT = 400  # epochs: a world of 2 that never grows fails the test instead of running forever
MARKER = os.path.join(sys.argv[1], "killed")


def main() -> int:
    hvd.init()
    dataset = torch.utils.data.TensorDataset(torch.arange(SAMPLES))
    sampler = hvd.elastic.ElasticSampler(dataset, seed=3)
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    state = hvd.elastic.TorchState(sampler=sampler, epoch=0, seen=[])

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.epoch < LIMIT and not (state.epoch >= EPOCHS and hvd.size() == FINAL_SIZE):
            for batch_idx, (values,) in enumerate(loader):
                if (hvd.rank() == 2 and hvd.size() == 3 and state.epoch == 0 and batch_idx == DOOMED_BATCH
                        and not os.path.exists(MARKER)):
                    open(MARKER, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
                gathered = hvd.allgather_object(values.tolist())
                state.seen = state.seen + [i for part in gathered for i in part]  # a new list: commits keep the old
                sampler.record_batch(batch_idx, BATCH)
                if hvd.rank() == 0:
                    print("batch", state.epoch, hvd.size(), len(state.seen), flush=True)
                if (batch_idx + 1) % COMMIT_EVERY == 0:
                    state.commit()
            if hvd.rank() == 0:
                print("epoch", state.epoch, hvd.size(), " ".join(map(str, sorted(state.seen))), flush=True)
            state.seen = []
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    print("final", hvd.size(), state.epoch, flush=True)
    return 0 if state.epoch < LIMIT else 3


if __name__ == "__main__":
    sys.exit(main())
