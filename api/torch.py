"""``redsrv.torch``: the PyTorch adapter's public names under a short name: the DDP comm hook
and its compression wrappers, and the ``redsrv`` c10d backend. They are implemented in
:mod:`redsrv.adapters.torch`, and these are the same objects (``redsrv.torch.HookState is
redsrv.adapters.torch.HookState``), so the backend's registration and every other piece of state
exist once, in the adapter module. None of the names is rebound after import, so a copy here
cannot go stale."""

from redsrv.adapters.torch import (
    BACKEND_NAME,
    HookState,
    RedsrvProcessGroup,
    bf16_compress_wrapper,
    fp16_compress_wrapper,
    redsrv_hook,
    register_backend,
)

__all__ = [
    "HookState",
    "redsrv_hook",
    "fp16_compress_wrapper",
    "bf16_compress_wrapper",
    "register_backend",
    "RedsrvProcessGroup",
    "BACKEND_NAME",
]
