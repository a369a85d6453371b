"""The PyTorch adapter in this process: tensor views, the hook's bookkeeping, its acceptance by
DDP's checks, wrappers, configuration, the backend on a one- or two-rank group, and the canary
for the private torch APIs the backend needs. The multi-process behaviour is tested against gloo
in test_ddp_differential.py. ``daemon`` (an in-process reducer) comes from tests/adapters/conftest.py."""

from __future__ import annotations

import inspect
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import redsrv  # noqa: E402
import redsrv.torch  # noqa: E402
from redsrv.adapters import _torch_c10d  # noqa: E402
from redsrv.adapters import torch as adapter  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.timeout(60)]


@pytest.fixture
def fresh_env(monkeypatch):  # type: ignore[no-untyped-def]
    """No REDSRV_* or torchrun variables from the outer environment."""
    import os

    for name in list(os.environ):
        if name.startswith("REDSRV_") or name in ("RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name)
    return monkeypatch


class FakeBucket:
    """What the hook uses of ``dist.GradBucket`` (which cannot be built from Python)."""

    def __init__(self, buffer: torch.Tensor, index: int, last: bool) -> None:
        self._buffer, self._index, self._last = buffer, index, last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last


# reconnect_window=0: the error tests check that a lost reducer is raised, not ridden through (R22).
FAST = {"op_timeout": 2.0, "heartbeat_interval": 0.2, "close_timeout": 3.0, "reconnect_window": 0.0}


def test_redsrv_torch_reexports_the_adapters_public_names() -> None:
    # api/torch.py imports them by name: exactly the adapter's __all__, each the same object.
    assert redsrv.torch is not adapter and list(redsrv.torch.__all__) == list(adapter.__all__)
    for name in adapter.__all__:
        assert getattr(redsrv.torch, name) is getattr(adapter, name), name


def test_private_torch_apis_have_not_moved() -> None:
    # The canary: when a torch upgrade moves one of these, this names it (see _torch_c10d).
    # test_backend_collectives_on_one_rank checks that they still behave.
    _torch_c10d.check()


def test_canary_names_what_moved(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from torch._C import _distributed_c10d

    monkeypatch.delattr(_distributed_c10d, "_DistributedBackendOptions")
    with pytest.raises(ImportError, match="_DistributedBackendOptions.*hook.*still works"):
        _torch_c10d.check()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64])
def test_tensor_views_share_memory(dtype: torch.dtype) -> None:
    t = (torch.arange(12) - 5).to(dtype).reshape(3, 4)
    array = adapter._numpy(adapter._host(t))
    assert array.shape == (12,) and np.shares_memory(array, t.numpy() if dtype != torch.bfloat16 else t.view(torch.int16).numpy())
    if dtype == torch.bfloat16:
        assert array.dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(array.astype(np.float64), t.double().reshape(-1).numpy())
    back = adapter._tensor(array)
    assert back.dtype == dtype and back.data_ptr() == t.data_ptr()


def test_non_contiguous_tensors_are_copied_not_misread() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    np.testing.assert_array_equal(adapter._numpy(adapter._host(t)), t.contiguous().reshape(-1).numpy())


@pytest.mark.parametrize("tensor", [torch.tensor([True, False, True]), torch.arange(7, dtype=torch.int8),
                                    torch.tensor([1 + 2j, -0.0 + 3j]), torch.tensor([-0.0, float("nan")]),
                                    torch.zeros(0)])
def test_raw_bytes_round_trip_any_dtype(tensor: torch.Tensor) -> None:
    raw = adapter._bytes(tensor)
    assert raw.dtype == np.uint8 and raw.nbytes == tensor.numel() * tensor.element_size()
    back = adapter._from_bytes(raw, tensor)
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert back.contiguous().view(torch.uint8).tolist() == tensor.contiguous().view(torch.uint8).tolist()


def test_ddp_accepts_the_hooks() -> None:
    # DDP's own check, run without building a DDP (which needs a process group).
    def refuse(error_type, message):  # type: ignore[no-untyped-def]
        raise error_type(message)

    fake_ddp = SimpleNamespace(_log_and_throw=refuse)
    hooks = [redsrv.torch.redsrv_hook, redsrv.torch.fp16_compress_wrapper(redsrv.torch.redsrv_hook),
             redsrv.torch.bf16_compress_wrapper(redsrv.torch.redsrv_hook)]
    for hook in hooks:
        DDP._check_comm_hook(fake_ddp, hook)
        assert list(inspect.signature(hook).parameters) == ["state", "bucket"]
        # torch refuses its own bf16 hook names without NCCL; ours must not collide with them.
        assert hook.__name__ not in ("bf16_compress_hook", "bf16_compress_wrapper_hook")


def test_hook_keys_steps_and_mean(daemon: str) -> None:
    with redsrv.torch.HookState([daemon], rank=0, world_size=1, job="hook-local", **FAST) as state:
        for step in range(3):
            buckets = [FakeBucket(torch.arange(5, dtype=torch.float32) + step, 0, False),
                       FakeBucket(torch.ones(3, dtype=torch.bfloat16) * 3, 1, False),
                       FakeBucket(torch.full((4,), 2.0, dtype=torch.float64), 2, True)]
            futures = [redsrv.torch.redsrv_hook(state, b) for b in buckets]
            assert state.step == step + 1  # advanced by the bucket DDP marks last
            for bucket, future in zip(buckets, futures, strict=True):
                result = future.wait()
                assert result.dtype == bucket.buffer().dtype and result.shape == bucket.buffer().shape
                torch.testing.assert_close(result, bucket.buffer(), rtol=0, atol=0)  # mean over one rank
        assert state.client.bytes_pushed > 0


def test_wrappers_ask_the_core_for_16_bit_wire_formats(daemon: str) -> None:
    x = torch.tensor([1.0 + 2**-12, 3.14159, -2.71828, 1e-3])
    with redsrv.torch.HookState([daemon], rank=0, world_size=1, job="hook-wire", **FAST) as state:
        plain = redsrv.torch.redsrv_hook(state, FakeBucket(x.clone(), 0, True)).wait()
        bf16 = redsrv.torch.bf16_compress_wrapper(redsrv.torch.redsrv_hook)(state, FakeBucket(x.clone(), 0, True)).wait()
        fp16 = redsrv.torch.fp16_compress_wrapper(redsrv.torch.redsrv_hook)(state, FakeBucket(x.clone(), 0, True)).wait()
        assert state.step == 3  # the wrappers share the state's step counter
        assert state.wire_dtype is None  # and leave the state itself alone
    torch.testing.assert_close(plain, x, rtol=0, atol=0)
    torch.testing.assert_close(bf16, x.bfloat16().float(), rtol=0, atol=0)
    torch.testing.assert_close(fp16, x.half().float(), rtol=0, atol=0)
    assert bf16.dtype == fp16.dtype == torch.float32


def test_wrapper_refuses_a_foreign_state() -> None:
    hook = redsrv.torch.fp16_compress_wrapper(redsrv.torch.redsrv_hook)
    with pytest.raises(TypeError, match="HookState"):
        hook(object(), FakeBucket(torch.ones(2), 0, True))


def test_hook_fails_its_future_instead_of_raising(daemon: str) -> None:
    state = redsrv.torch.HookState([daemon], rank=0, world_size=1, job="hook-closed", **FAST)
    state.close()
    future = redsrv.torch.redsrv_hook(state, FakeBucket(torch.ones(4), 0, True))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="ClientClosedError"):
        future.wait()
    assert time.monotonic() - started < 1.0


def test_hook_times_out_when_a_rank_never_contributes(daemon: str) -> None:
    with redsrv.torch.HookState([daemon], rank=0, world_size=2, job="hook-timeout", timeout=0.5, **FAST) as state:
        started = time.monotonic()
        future = redsrv.torch.redsrv_hook(state, FakeBucket(torch.ones(4), 0, True))
        with pytest.raises(RuntimeError, match="PeerTimeoutError"):
            future.wait()
        assert 0.4 < time.monotonic() - started < 0.5 + 2.0


def test_state_from_the_environment(daemon: str, fresh_env) -> None:  # type: ignore[no-untyped-def]
    fresh_env.setenv("REDSRV_REDUCERS", daemon)
    fresh_env.setenv("REDSRV_JOB", "from-env")
    fresh_env.setenv("RANK", "0")
    fresh_env.setenv("WORLD_SIZE", "1")
    with redsrv.torch.HookState(op_timeout=5.0) as state:
        cfg = state.client.config
        assert (cfg.reducers, cfg.job, cfg.rank, cfg.world_size, cfg.op_timeout) == ((daemon,), "from-env", 0, 1, 5.0)
        assert "from-env" in repr(state)


def test_state_configuration_errors_are_immediate(daemon: str, fresh_env) -> None:  # type: ignore[no-untyped-def]
    fresh_env.setenv("REDSRV_NO_SUCH_SETTING", "1")
    with pytest.raises(redsrv.ConfigError, match="REDSRV_NO_SUCH_SETTING"):
        redsrv.torch.HookState([daemon], rank=0, world_size=1)
    fresh_env.delenv("REDSRV_NO_SUCH_SETTING")
    with redsrv.Client([daemon], rank=0, world_size=1, job="shared") as client:
        with pytest.raises(TypeError, match="rank"):
            redsrv.torch.HookState(client=client, rank=0)
        state = redsrv.torch.HookState(client=client, key_prefix="model-b")
        state.close()  # not its client: stays open
        client.check()
    with pytest.raises(ValueError, match="timeout"):
        redsrv.torch.HookState([daemon], rank=0, world_size=1, timeout=0)


@pytest.fixture
def redsrv_group(daemon: str):  # type: ignore[no-untyped-def]
    """``start(rank, world_size, timeout, **config)`` makes the default process group a redsrv one."""

    def start(rank: int = 0, world_size: int = 1, timeout=None, **config) -> None:  # type: ignore[no-untyped-def]
        redsrv.torch.register_backend([daemon], job=f"local-{world_size}", **{**FAST, **config})
        dist.init_process_group("redsrv", store=dist.HashStore(), rank=rank, world_size=world_size, timeout=timeout)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def test_backend_collectives_on_one_rank(redsrv_group) -> None:  # type: ignore[no-untyped-def]
    redsrv_group()
    assert dist.get_backend() == "redsrv"
    assert "job='local-1.pg0'" in repr(dist.group.WORLD)
    t = torch.arange(6, dtype=torch.float32)
    dist.all_reduce(t)
    assert t.tolist() == list(range(6))
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    out = [torch.empty(3, dtype=torch.bool)]
    dist.all_gather(out, torch.tensor([True, False, True]))
    assert out[0].tolist() == [True, False, True]
    b = torch.tensor([7], dtype=torch.int8)
    dist.broadcast(b, src=0)
    assert b.tolist() == [7]
    dist.barrier()
    work = dist.all_reduce(torch.ones(2), async_op=True)
    assert work.wait() and work.is_completed()


def test_backend_refuses_what_reducers_cannot_do(redsrv_group) -> None:  # type: ignore[no-untyped-def]
    redsrv_group()
    with pytest.raises(ValueError, match="redsrv backend's all_reduce does not support ReduceOp.PREMUL_SUM"):
        dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0))
    with pytest.raises(TypeError, match="redsrv all_reduce supports .*; got a uint64 tensor"):
        dist.all_reduce(torch.ones(2, dtype=torch.uint64))
    with pytest.raises(TypeError, match="AVG needs floating-point"):
        dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist.ReduceOp.AVG)
    with pytest.raises(TypeError, match="BAND needs integer or bool"):
        dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND)
    with pytest.raises(ValueError, match="redsrv backend's reduce_scatter_tensor does not support ReduceOp.PREMUL_SUM"):
        dist.reduce_scatter_single(torch.ones(2), torch.ones(2), op=dist._make_nccl_premul_sum(2.0))
    with pytest.raises(TypeError, match="complex tensors supports SUM and AVG only, got MAX"):
        dist.reduce(torch.ones(2, dtype=torch.complex64), dst=0, op=dist.ReduceOp.MAX)


def test_peer_link_errors_become_redsrv_errors() -> None:
    timed_out = _torch_c10d.translate(RuntimeError("[gloo] Timed out waiting 1000ms for recv operation"), "redsrv recv", 1.0)
    assert isinstance(timed_out, redsrv.PeerTimeoutError) and "redsrv recv: [gloo] Timed out" in str(timed_out)
    lost = _torch_c10d.translate(RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:4242"), "redsrv send", 1.0)
    assert isinstance(lost, redsrv.PeerLostError) and "4242" in str(lost)
    other = RuntimeError("ProcessGroupGloo::alltoall: invalid tensor size at index 1")
    assert _torch_c10d.translate(other, "redsrv all_to_all", 1.0) is other


def test_backend_without_peer_links_names_what_to_use(redsrv_group) -> None:  # type: ignore[no-untyped-def]
    redsrv_group(peer_links=False)
    assert "peer_links=False" in repr(dist.group.WORLD)
    with pytest.raises(ValueError, match="redsrv backend's send needs links between the workers.*peer_links=False.*gloo group"):
        dist.group.WORLD.send([torch.ones(1)], 0, 0)  # torch's dist.send refuses to send to oneself first
    with pytest.raises(ValueError, match="redsrv backend's gather needs links.*use all_gather"):
        dist.gather(torch.ones(1), [torch.ones(1)], dst=0)
    # Reductions and broadcasts need only the reducers.
    t = torch.tensor([3, 1, 2])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    dist.reduce(t, dst=0, op=dist.ReduceOp.PRODUCT)
    assert t.tolist() == [3, 1, 2]


@pytest.mark.parametrize(("debug", "setting", "checked"), [
    ("OFF", None, False), ("INFO", None, False), ("DETAIL", None, True),  # PyTorch's convention
    ("OFF", True, True), ("DETAIL", False, False)])  # REDSRV_VERIFY_COLLECTIVES / verify_collectives= wins
def test_peer_collectives_are_checked_as_pytorch_checks_its_own(redsrv_group, monkeypatch, debug: str, setting,  # type: ignore[no-untyped-def]
                                                               checked: bool) -> None:
    """The cross-rank check before a peer-link collective is one small all-reduce through the
    reducers: counted here by the group's client."""
    monkeypatch.setattr(dist, "get_debug_level", lambda: getattr(dist.DebugLevel, debug))
    redsrv_group(**({} if setting is None else {"verify_collectives": setting}))
    client = dist.group.WORLD.client
    before = client.ops_completed
    dist.all_gather([torch.empty(2)], torch.ones(2))
    assert client.ops_completed - before == (1 if checked else 0)


@pytest.mark.parametrize(("value", "checked"), [("1", True), ("on", True), ("0", False), ("auto", False)])
def test_verify_collectives_from_the_environment(redsrv_group, monkeypatch, value: str, checked: bool) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(dist, "get_debug_level", lambda: dist.DebugLevel.OFF)
    monkeypatch.setenv("REDSRV_VERIFY_COLLECTIVES", value)
    redsrv_group()
    client = dist.group.WORLD.client
    before = client.ops_completed
    dist.all_gather([torch.empty(2)], torch.ones(2))
    assert client.ops_completed - before == (1 if checked else 0)


def test_verify_collectives_refuses_a_word_it_does_not_know(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("REDSRV_VERIFY_COLLECTIVES", "sometimes")
    with pytest.raises(redsrv.ConfigError, match="REDSRV_VERIFY_COLLECTIVES='sometimes' is not a valid bool"):
        redsrv.torch.register_backend(["127.0.0.1:1"])


@pytest.mark.parametrize("peer_links", [True, False])
def test_functional_collectives(redsrv_group, peer_links: bool) -> None:  # type: ignore[no-untyped-def]
    """c10d calls the coalesced forms of all-gather and reduce-scatter from C++; before the group
    defined them, they failed with "No backend type associated with device type cpu"."""
    import torch.distributed._functional_collectives as funcol

    redsrv_group(peer_links=peer_links)
    x = torch.arange(4, dtype=torch.float32)
    assert funcol.all_gather_single(x, 0, dist.group.WORLD).tolist() == x.tolist()
    assert funcol.reduce_scatter_single(x, "sum", 0, dist.group.WORLD).tolist() == x.tolist()
    assert funcol.all_reduce(x, "sum", dist.group.WORLD).tolist() == x.tolist()
    assert funcol.broadcast(x, 0, dist.group.WORLD).tolist() == x.tolist()


def test_backend_group_name_and_destroying_a_subgroup(redsrv_group) -> None:  # type: ignore[no-untyped-def]
    redsrv_group()
    assert dist.group.WORLD.group_name == "0"
    sub = dist.new_group([0], backend="redsrv")
    assert sub.group_name and sub.group_name != "0"
    t = torch.ones(2)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=sub)
    dist.destroy_process_group(sub)
    with pytest.raises(redsrv.ClientClosedError):
        sub.client.check()
    dist.all_reduce(t)  # the world group is untouched


def test_backend_collective_raises_redsrv_error_on_timeout(redsrv_group) -> None:  # type: ignore[no-untyped-def]
    redsrv_group(rank=0, world_size=2, op_timeout=0.5, peer_links=False)  # rank 1 never comes
    started = time.monotonic()
    with pytest.raises(redsrv.PeerTimeoutError, match="local-2.pg0"):
        dist.all_reduce(torch.ones(3))
    assert time.monotonic() - started < 0.5 + 2.0
    work = dist.broadcast(torch.ones(3), src=0, async_op=True)
    with pytest.raises(redsrv.PeerTimeoutError, match="broadcast #1.*did not complete"):
        work.wait(timeout=timedelta(seconds=0.1))  # c10d's own bound on the wait
    with pytest.raises(RuntimeError, match="PeerTimeoutError"):
        work.get_future().wait()  # C++ consumers (DDP) see a failed future


@pytest.mark.parametrize(("group_timeout", "expected"), [(7.0, 7.0), (600.0, 30.0)])
def test_backend_uses_the_stricter_of_the_two_timeouts(redsrv_group, group_timeout: float, expected: float) -> None:  # type: ignore[no-untyped-def]
    redsrv_group(op_timeout=30.0, timeout=timedelta(seconds=group_timeout))
    assert dist.group.WORLD.client.config.op_timeout == expected
