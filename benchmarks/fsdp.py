"""``redsrv bench fsdp``: FSDP2 training steps on one host, the redsrv backend against gloo in
the same run.

Worker processes on 127.0.0.1 (default 2) each hold two identically initialised models, a stack
of square ``nn.Linear`` layers (tanh between them), each layer and the whole model
``fully_shard``-ed (FSDP2) over a device mesh of one group: a gloo group for the baseline, a
redsrv group for the other. Every step (forward, backward, SGD) is timed on every rank after a
barrier; a step takes as long as its slowest rank. The two models train on the same data in
alternating blocks of ``--steps`` steps, ``--rounds`` times, so load from elsewhere hits both
alike; reported: the median step of each, the ratio, and how many steps were timed.

On one host the redsrv group's all-gathers and reduce-scatters of 2 MiB a rank or more go
through its shared memory, smaller ones over its peer links (docs/torch_backend.md, "One
host"); FSDP2's parameter all-gathers and gradient reduce-scatters are one per layer, a
``width x width`` float32 matrix split across the ranks.

Checked after every block: each model's full parameters (``full_tensor()``) are identical on
every rank, and the redsrv-trained model equals the gloo-trained one (bit for bit with two
workers, where every sum has one order; within float32 rounding beyond). A wrong block makes the
command exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from redsrv.cli.fleet import free_port, run_local_workers, start_reducers, stop_processes


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    b = subparsers.add_parser("fsdp", help="FSDP2 training steps on one host: the redsrv backend against gloo",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    b.add_argument("--width", type=int, default=2048, help="features of each square layer (default 2048: 16 MiB of float32)")
    b.add_argument("--layers", type=int, default=4, help="layers (default 4)")
    b.add_argument("--steps", type=int, default=8, help="timed steps per block (default 8)")
    b.add_argument("--rounds", type=int, default=3, help="gloo/redsrv block alternations (default 3)")
    b.add_argument("--json", help="write the results and every step time here")
    b.set_defaults(func=lambda a: run(workers=a.workers, width=a.width, layers=a.layers, steps=a.steps,
                                      rounds=a.rounds, json_path=a.json))


def run(*, workers: int, width: int, layers: int, steps: int, rounds: int, json_path: str | None) -> int:
    """Run the comparison; 0 when every check held, 1 otherwise."""
    if workers < 2 or width < 1 or layers < 1 or steps < 1 or rounds < 1:
        raise SystemExit("redsrv bench fsdp: --workers at least 2, and --width, --layers, --steps, --rounds at least 1")
    # A one-host group never contacts the reducers; one is started so that REDSRV_HOST_REDUCE=flat works too.
    fleet = start_reducers(1)
    try:
        spec = {"reducers": fleet.addresses, "world_size": workers, "store": f"tcp://127.0.0.1:{free_port()}",
                "width": width, "layers": layers, "steps": steps, "rounds": rounds}
        result = run_local_workers("redsrv.bench.fsdp", spec, workers, json_path)
    finally:
        stop_processes(fleet.procs)
    if result is None:
        return 1
    print(f"{'backend':<8} {'median step ms':>15} {'min-max ms':>17} {'steps':>6}")
    for name in ("gloo", "redsrv"):
        times = result["step_ms"][name]
        print(f"{name:<8} {statistics.median(times):15.1f} {min(times):8.1f}-{max(times):<8.1f} {len(times):6d}")
    print(f"redsrv/gloo {result['ratio']:.3f} (median of the per-round ratios of median steps); "
          f"{result['parameters_mib']:.1f} MiB of parameters, {workers} workers")
    for problem in result["problems"]:
        print(f"redsrv bench fsdp: WRONG: {problem}", file=sys.stderr)
    return 1 if result["problems"] else 0


def _worker(spec: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    import redsrv.torch

    rank, n = spec["rank"], spec["world_size"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=spec["store"], rank=rank, world_size=n)
    redsrv.torch.register_backend(spec["reducers"], job=f"fsdp-{os.getppid()}")
    groups = {"gloo": dist.new_group(backend="gloo"), "redsrv": dist.new_group(backend="redsrv")}
    width, layers = spec["width"], spec["layers"]

    def model_on(group: Any) -> tuple[Any, Any]:
        torch.manual_seed(0)  # the same initial values in both models and on every rank
        model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())])
        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.SGD(model.parameters(), lr=0.01)

    models = {name: model_on(group) for name, group in groups.items()}
    data = torch.Generator().manual_seed(1000 + rank)
    times: dict[str, list[float]] = {name: [] for name in groups}
    ratios, problems = [], []
    for round_ in range(spec["rounds"]):
        batches = [torch.randn(8, width, generator=data) for _ in range(spec["steps"] + 1)]
        medians = {}
        for name, (model, opt) in (models.items() if round_ % 2 == 0 else reversed(models.items())):
            block = []
            for step, x in enumerate(batches):
                dist.barrier()
                started = time.perf_counter()
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
                if step:  # the first step of a block warms up
                    block.append(float(elapsed) * 1e3)
            times[name] += block
            medians[name] = statistics.median(block)
        ratios.append(medians["redsrv"] / medians["gloo"])
        full = {name: torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()]) for name, (model, _) in models.items()}
        for name, params in full.items():
            copies = [torch.empty_like(params) for _ in range(n)]
            dist.all_gather(copies, params)  # over the default gloo group
            if any(not torch.equal(c, params) for c in copies):
                problems.append(f"round {round_}: the {name}-trained parameters differ between ranks")
        same = torch.equal(full["redsrv"], full["gloo"]) if n == 2 else torch.allclose(full["redsrv"], full["gloo"],
                                                                                          rtol=1e-5, atol=1e-6)
        if not same:
            problems.append(f"round {round_}: the redsrv-trained model differs from the gloo-trained one "
                            f"(largest difference {float((full['redsrv'] - full['gloo']).abs().max())})")
    if rank == 0:
        parameters = sum(p.numel() * p.element_size() for p in models["gloo"][0].parameters())  # DTensors: global sizes
        with open(spec["out"], "w") as f:
            json.dump({"step_ms": times, "ratio": statistics.median(ratios), "ratios": ratios, "problems": problems,
                       "parameters_mib": parameters / 2**20, "spec": {k: v for k, v in spec.items() if k != "rank"}}, f)
    for group in groups.values():
        dist.destroy_process_group(group)
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]))
