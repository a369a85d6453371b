"""A Horovod PyTorch training script; the import is the only redsrv line.

    redsrv run -np 2 python examples/horovod_torch.py
    mpirun -np 2 -x REDSRV_REDUCERS=host:port python examples/horovod_torch.py   # reducers started apart
    python examples/horovod_torch.py                                              # one process, no reducers

It trains a small classifier on a synthetic dataset (no downloads) the way Horovod's own
examples do: the learning rate scaled by the number of workers, a DistributedSampler shard per
worker, parameters and optimizer state broadcast from rank 0, a metric averaged over workers.
With W workers and batch size B it follows the same trajectory as one process with batch size
W x B and learning rate W x lr (it prints a parameter checksum to compare).
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import redsrv.horovod.torch as hvd  # was: import horovod.torch as hvd


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(20, 64)
        self.fc2 = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


def synthetic_dataset(samples: int = 512) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, 20, generator=g)
    labels = (x[:, :4].argmax(dim=1) + (x[:, 4] > 1).long()) % 4
    return TensorDataset(x, labels)


def main() -> None:
    parser = argparse.ArgumentParser(description="Horovod PyTorch example on synthetic data")
    parser.add_argument("--batch-size", type=int, default=16, help="input batch size per worker")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.01, help="learning rate for one worker (scaled by the worker count)")
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--fp16-allreduce", action="store_true", help="use fp16 compression during allreduce")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    dataset = synthetic_dataset()
    sampler = DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), compression=compression,
                                         op=hvd.Average)

    for epoch in range(1, args.epochs + 1):
        model.train()
        sampler.set_epoch(epoch)
        total, count = 0.0, 0
        for data, target in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            total, count = total + loss.item(), count + 1
        average = hvd.allreduce(torch.tensor(total / count), name="avg_loss")
        if hvd.rank() == 0:
            print(f"epoch {epoch}: loss {average.item():.4f}", flush=True)

    checksum = sum(p.detach().double().abs().sum().item() for p in model.parameters())
    if hvd.rank() == 0:
        print(f"parameter checksum {checksum:.10f}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
