"""``redsrv bench train`` without a cluster: option checks, the model's shape, the report maths,
the bucket recorder, and the command line's refusals (which must create nothing)."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from redsrv.bench import train
from redsrv.bench.netns import EmulationError
from redsrv.bench.train import Options, format_summary, model_shape, summarise

G = 0.1196  # GB/s, TCP goodput at 1 Gbit/s


def test_unknown_framework_is_refused():
    with pytest.raises(EmulationError, match="--framework mxnet: implemented are torch, jax, tf"):
        Options(framework="mxnet").validate()


@pytest.mark.parametrize("framework", train.FRAMEWORKS)
def test_every_framework_has_labels_a_module_and_a_title(framework):
    Options(framework=framework).validate()
    assert set(train.LABELS[framework]) == set(train.MODES)
    assert framework in train.FRAMEWORK_MODULES
    title = train._title({"framework": framework, "workers": 4, "reducers": None, "rate_bps": 10**9, "wire_dtype": None},
                         {"params": 25_178_112, "layers": 6, "width": 2048}, "2026-11-25", 2)
    assert "25.2M params (6 x 2048^2 dense), n=4 m=4, 1 Gbit/s per host" in title


def test_table_names_the_frameworks_own_blocks():
    s = summarise(_blocks(), n=4, m=4, grad_bytes=10**8, goodput=G, framework="jax")
    table = format_summary(s)
    assert "jax gloo pmean" in table and "redsrv.jax pmean over jax gloo pmean: 1.25x" in table
    assert "DDP" not in table
    assert s.as_dict()["framework"] == "jax"


@pytest.mark.parametrize("change,message", [
    ({"workers": 1}, "at least 2 worker hosts"),
    ({"reducers": 0}, "--reducers must be >= 1"),
    ({"params": 100}, "--params: at least"),
    ({"steps": 0}, "--steps must be >= 1"),
    ({"rounds": 0}, "--rounds must be >= 1"),
    ({"batch": 0}, "--batch must be >= 1"),
    ({"warmup": 0}, "rebuilds its buckets"),
    ({"bucket_cap_mb": 0}, "--bucket-cap-mb must be positive"),
    ({"wire_dtype": "int8"}, "use bf16 or fp16"),
    ({"result_piece_bytes": -1}, "--piece-kib must be >= 0"),
    ({"params": 10**12}, "GiB of memory"),
])
def test_options_validation(change, message):
    with pytest.raises(EmulationError, match=message):
        Options(**change).validate()


def test_defaults_are_valid_and_place_reducers_on_their_own_hosts():
    opts = Options()
    opts.validate()
    assert (opts.workers, opts.m, opts.hosts) == (4, 4, 8)
    assert Options(workers=4, reducers=2).hosts == 6
    assert opts.modes == ("gloo", "hook", "raw", "compute")
    assert Options(baseline=False).modes == ("hook", "raw", "compute")


@pytest.mark.parametrize("params", [25_000_000, 2_000_000, 50_000_000, 100_000])
def test_model_shape_comes_close_to_the_asked_size(params):
    layers, width = model_shape(params)
    assert layers >= train.MIN_LAYERS and width <= train.DEFAULT_WIDTH and width % 16 == 0
    assert layers * width * (width + 1) == pytest.approx(params, rel=0.15)


def test_default_model_is_six_wide_layers():
    assert model_shape(25_000_000) == (6, 2048)


def _block(mode, rnd, times, busy=0.5, correct=True):
    return {"round": rnd, "mode": mode, "times": times, "correct": correct, "cpu_busy": busy, "cpu_s": 1.0,
            "wall_s": sum(times), "cores": 2}


def _blocks():
    return [_block("gloo", 0, [1.3, 1.3, 1.3]), _block("hook", 0, [1.0, 1.0, 1.0]), _block("raw", 0, [0.9, 0.9, 0.9]),
            _block("compute", 0, [0.1, 0.1, 0.1]),
            _block("gloo", 1, [1.2, 1.2, 1.2]), _block("hook", 1, [1.0, 1.0, 1.0]), _block("raw", 1, [0.95, 0.95, 0.95]),
            _block("compute", 1, [0.1, 0.1, 0.1])]


def test_summary_ratios_of_medians_and_per_round_spread():
    grad = 100 * 10**6
    s = summarise(_blocks(), n=4, m=4, grad_bytes=grad, goodput=G)
    rows = {r.mode: r for r in s.rows}
    assert [r.mode for r in s.rows] == ["gloo", "hook", "raw", "compute"]
    assert rows["gloo"].median_s == pytest.approx(1.25) and rows["gloo"].steps == 6
    assert rows["hook"].steps_per_s == pytest.approx(1.0)
    assert s.speedup == pytest.approx(1.25)
    assert s.speedup_rounds == [pytest.approx(1.3), pytest.approx(1.2)]
    assert s.theory == pytest.approx(1.5)
    assert s.overhead == pytest.approx(1.0 / 0.925 - 1)
    assert s.overhead_rounds == [pytest.approx(1 / 0.9 - 1), pytest.approx(1 / 0.95 - 1)]
    assert s.compute_s == pytest.approx(0.1)
    assert rows["hook"].grad_gbps == pytest.approx(0.1)
    assert rows["hook"].of_goodput == pytest.approx(0.1 / G)
    assert rows["compute"].grad_gbps is None and rows["compute"].of_goodput is None
    assert s.overhead_floor == pytest.approx((1.0 - 0.925 - 0.1) / 0.925)
    assert s.overhead_floor_rounds == [pytest.approx(0.0), pytest.approx((1.0 - 0.95 - 0.1) / 0.95)]
    assert s.correct and s.speedup_met is False
    assert s.overhead_met is None  # the upper bound misses 5%, the lower bound meets it


def test_overhead_missed_when_even_the_lower_bound_misses():
    blocks = [_block("hook", 0, [1.5]), _block("raw", 0, [1.0]), _block("compute", 0, [0.3])]
    s = summarise(blocks, n=4, m=4, grad_bytes=10**8, goodput=G)
    assert s.overhead == pytest.approx(0.5) and s.overhead_floor == pytest.approx(0.2)
    assert s.overhead_met is False
    assert "Target <= 5%: NOT met" in format_summary(s)


def test_targets_met_and_wire_compression_in_the_theory():
    blocks = [_block("gloo", 0, [1.5]), _block("hook", 0, [1.0]), _block("raw", 0, [0.97]), _block("compute", 0, [0.1])]
    s = summarise(blocks, n=4, m=4, grad_bytes=10**8, goodput=G, compression=2.0)
    assert s.theory == pytest.approx(3.0)
    assert s.speedup_met and s.overhead_met
    table = format_summary(s)
    assert "1.50x" in table and "Target >= 1.3x: met" in table and "Target <= 5%: met" in table


def test_table_names_the_modes_the_bound_and_the_misses():
    table = format_summary(summarise(_blocks(), n=4, m=4, grad_bytes=10**8, goodput=G))
    for text in ("gloo DDP", "redsrv hook DDP", "raw allreduce", "compute only", "1.25x (theory 1.50x", "NOT met",
                 "at most +8.1%", "at least -2.7%", "100.0 ms compute-only step", "not decided"):
        assert text in table, text


def test_without_baseline_there_is_no_speedup():
    blocks = [b for b in _blocks() if b["mode"] != "gloo"]
    s = summarise(blocks, n=4, m=4, grad_bytes=10**8, goodput=G)
    assert s.speedup is None and s.speedup_met is None and s.overhead is not None
    assert "speedup" not in format_summary(s)


def test_unlimited_rate_has_no_fraction_of_g():
    s = summarise(_blocks(), n=4, m=4, grad_bytes=10**8, goodput=0.0)
    assert all(r.of_goodput is None for r in s.rows)


def test_a_wrong_block_makes_the_run_wrong_and_busy_machines_are_flagged():
    blocks = _blocks()
    blocks[1] = _block("hook", 0, [1.0, 1.0, 1.0], busy=0.95, correct=False)
    blocks[5] = _block("hook", 1, [1.0, 1.0, 1.0], busy=0.9)
    s = summarise(blocks, n=4, m=4, grad_bytes=10**8, goodput=G)
    hook = next(r for r in s.rows if r.mode == "hook")
    assert not s.correct and not hook.correct and hook.cpu_bound
    table = format_summary(s)
    assert "WRONG RESULTS" in table and "CPU-bound (max 95%)" in table
    assert s.as_dict()["rows"][1]["cpu_bound"] is True


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "t.png"
    train.plot(summarise(_blocks(), n=4, m=4, grad_bytes=10**8, goodput=G), str(path), title="t")
    assert path.read_bytes()[:4] == b"\x89PNG"


class _Bucket:
    def __init__(self, index, numel, last):
        self._index, self._last = index, last
        self._buffer = SimpleNamespace(numel=lambda: numel, dtype="torch.float32")

    def index(self):
        return self._index

    def is_last(self):
        return self._last

    def buffer(self):
        return self._buffer


def test_bucket_recorder_keeps_the_last_complete_step_and_passes_through():
    recorder = train._BucketRecorder()
    calls = []
    hook = recorder.wrap(lambda state, bucket: calls.append((state, bucket.index())) or "future")
    assert hook("s", _Bucket(0, 10, False)) == "future"
    assert recorder.layout == []  # the step is not complete yet
    hook("s", _Bucket(1, 20, True))
    assert recorder.layout == [(10, "float32"), (20, "float32")]
    hook("s", _Bucket(0, 30, True))  # DDP rebuilt its buckets: one bucket now
    assert recorder.layout == [(30, "float32")]
    assert calls == [("s", 0), ("s", 1), ("s", 0)]


def _cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "redsrv", "bench", "train", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args,message", [
    (["--framework", "mxnet"], "--framework mxnet: implemented are torch, jax, tf"),
    (["--rate", "fast"], "bad rate 'fast'"),
    (["--workers", "1"], "at least 2 worker hosts"),
])
def test_cli_refusals_exit_2_and_create_nothing(tmp_path, args, message):
    proc = _cli(*args, "--prefix", "rsbad", "--out", str(tmp_path))
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_cli_report_reprints_an_earlier_run(tmp_path):
    pytest.importorskip("matplotlib")
    doc = {"started": "2026-11-22T10:00:00", "machine": {"cpus": 2}, "goodput_gbps": G, "blocks": _blocks(),
           "model": {"layers": 6, "width": 2048, "params": 25_178_112, "grad_bytes": 100_712_448},
           "options": {"workers": 4, "reducers": None, "rate_bps": 10**9, "wire_dtype": None}}
    path = tmp_path / "train-x.json"
    path.write_text(json.dumps(doc))
    proc = _cli("--report", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "redsrv hook DDP" in proc.stdout and "1.25x" in proc.stdout
    assert (tmp_path / "train-x.png").exists()


def test_rounds_shared_with_other_processes_are_named():
    blocks = _blocks()
    blocks[7] = dict(_block("compute", 1, [0.1, 0.1, 0.1], busy=1.0), cpu_s=0.3)  # ours: 0.3 / (0.3 s x 2 cores) = 50%
    s = summarise(blocks, n=4, m=4, grad_bytes=10**8, goodput=G)
    assert s.other_load_rounds == [pytest.approx(0.0), pytest.approx(0.5)]
    assert "round 2: 50%" in format_summary(s) and "round 1:" not in format_summary(s)


def test_jax_workers_get_one_device_and_one_thread():
    from redsrv.bench.train_jax import XLA_THREAD_FLAGS, worker_env

    env = worker_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=2 --xla_dump_to=/x", "PATH": "/bin"})
    flags = env["XLA_FLAGS"].split()
    assert "--xla_dump_to=/x" in flags and not any("device_count" in f for f in flags)
    assert all(flags.count(f) == 1 for f in XLA_THREAD_FLAGS)
    assert env["JAX_PLATFORMS"] == "cpu" and env["PATH"] == "/bin"
    assert worker_env(env)["XLA_FLAGS"] == env["XLA_FLAGS"]  # idempotent


def test_jax_model_starts_identically_at_torchs_scale():
    import numpy as np

    from redsrv.bench.train import init_params

    a, b = init_params(np, 3, 64), init_params(np, 3, 64)
    assert [p.shape for p in a] == [(64, 64), (64,)] * 3 and all(p.dtype == np.float32 for p in a)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    bound = 1 / np.sqrt(64)  # torch's nn.Linear default, for which LEARNING_RATE was chosen
    assert max(float(np.abs(p).max()) for p in a) <= bound
    assert max(float(np.abs(p).max()) for p in a) > 0.9 * bound
    assert not np.array_equal(a[0], a[2])  # layers differ from each other


def test_tf_workers_get_their_cluster_only_from_the_benchmark():
    from redsrv.bench.train_tf import worker_env

    env = worker_env({"TF_CONFIG": '{"cluster": {}}', "PATH": "/bin"})
    assert "TF_CONFIG" not in env and env["PATH"] == "/bin" and env["TF_CPP_MIN_LOG_LEVEL"] == "2"
    assert worker_env({"TF_CPP_MIN_LOG_LEVEL": "0"})["TF_CPP_MIN_LOG_LEVEL"] == "0"


def test_tf_recorder_notes_what_the_strategy_sends_and_passes_through():
    import numpy as np

    from redsrv.bench.train_tf import _Recorder

    recorder = _Recorder()
    calls = []
    host = recorder.wrap(lambda site, timeout, *arrays: calls.append((site, timeout, len(arrays))) or list(arrays))
    a, b = np.zeros(5, np.float32), np.zeros(3, np.int32)
    assert host("s", 1.0, a, b) == [a, b]
    assert recorder.layout == [(5, "float32"), (3, "int32")] and calls == [("s", 1.0, 2)]
    host("s", None, a)
    assert recorder.layout == [(5, "float32")]


@pytest.mark.parametrize("framework,key", [("torch", "ddp"), ("jax", "training"), ("tf", "training")])
def test_result_file_says_how_each_framework_trains(framework, key):
    setup = train._setup(Options(framework=framework))
    assert list(setup) == [key]
    assert setup[key]["learning_rate"] == train.LEARNING_RATE
    if framework != "torch":
        assert {"baseline", "redsrv", "optimizer"} <= set(setup[key])


def _torch_data_parallel(torch, initial, batches, steps, reduce):  # type: ignore[no-untyped-def]
    """SGD on ``batches`` (one per rank) with torch's autograd, the ranks' gradients combined by
    ``reduce``: what DDP computes when its all-reduce is ``reduce``."""
    params = [torch.tensor(p, requires_grad=True) for p in initial]
    for _ in range(steps):
        grads = []
        for x, y in batches:
            h = torch.tensor(x)
            for i in range(0, len(params), 2):
                h = h @ params[i].T + params[i + 1]
                if i + 2 < len(params):
                    h = torch.tanh(h)
            loss = ((h - torch.tensor(y)) ** 2).sum() / h.shape[0]
            grads.append(torch.autograd.grad(loss, params))
        with torch.no_grad():
            for k, p in enumerate(params):
                p -= train.LEARNING_RATE * reduce([g[k] for g in grads])
    return [p.detach().numpy() for p in params]


def test_the_reference_replay_is_data_parallel_sgd_and_catches_an_all_reduce_wrong_on_every_rank():
    import numpy as np

    torch = pytest.importorskip("torch")
    initial = train.init_params(np, 3, 16)
    rng = np.random.default_rng(5)
    batches = [(rng.standard_normal((4, 16), dtype=np.float32), rng.standard_normal((4, 16), dtype=np.float32))
               for _ in range(3)]
    ref = train.ReferenceModel(initial)
    ref.advance_to(5, np.concatenate([x for x, _ in batches]), np.concatenate([y for _, y in batches]))
    tolerance = train.MATCH_TOLERANCE[None]

    def check(reduce):  # type: ignore[no-untyped-def]
        return train.agreement("vs_reference", _torch_data_parallel(torch, initial, batches, 5, reduce), ref.params,
                               initial, tolerance)

    assert check(lambda gs: sum(gs) / len(gs))["match"]  # the mean over ranks: DDP's all-reduce
    # Wrong the same way on every rank, so every rank's model is identical and only the reference sees it:
    assert not check(lambda gs: sum(gs))["match"]  # a sum, not a mean
    assert not check(lambda gs: sum(gs[:-1]) / len(gs))["match"]  # a rank's contribution lost


def test_a_compute_block_is_checked_against_its_local_steps():
    import numpy as np

    initial = train.init_params(np, 2, 8)
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((3, 8), dtype=np.float32), rng.standard_normal((3, 8), dtype=np.float32)
    meter = SimpleNamespace(fields=lambda: {})
    ref = train.ReferenceModel(initial)
    ref.advance_to(4, x, y)
    trained = [p.astype(np.float32) for p in ref.params]
    assert train.local_block([0.1], meter, trained, initial, x, y, 4, train.MATCH_TOLERANCE[None])["correct"]
    assert not train.local_block([0.1], meter, initial, initial, x, y, 4, train.MATCH_TOLERANCE[None])["correct"]
