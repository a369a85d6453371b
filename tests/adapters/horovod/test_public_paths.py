"""Users import ``redsrv.horovod.torch`` (``.tensorflow``, ``.keras`` and Horovod's submodules such
as ``.torch.mpi_ops``); the implementation lives in ``redsrv.adapters.horovod``. Every module of the
implementation has its public path, re-exporting exactly its ``__all__`` as the same objects. A
module added to the implementation without a public path fails here. TensorFlow's and Keras's
modules are checked where TensorFlow is installed (also in test_hvd_tf.py, which the tf env runs)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from hvd_support import IMPLEMENTATION, assert_reexported, implementation_modules  # noqa: E402

FRAMEWORK = {"torch": "torch", "tensorflow": "tensorflow", "keras": "tensorflow"}


@pytest.mark.parametrize("implementation", implementation_modules())
def test_the_public_path_reexports_the_implementation(implementation: str) -> None:
    parts = implementation.removeprefix(IMPLEMENTATION + ".").split(".")
    if parts[0] in FRAMEWORK:
        pytest.importorskip(FRAMEWORK[parts[0]])
    assert_reexported(implementation)


def test_the_search_finds_every_framework_package() -> None:
    found = set(implementation_modules())
    assert {IMPLEMENTATION + suffix for suffix in ("", ".common", ".torch", ".torch.mpi_ops", ".tensorflow",
                                                   ".keras", ".keras.callbacks")} <= found


def test_hvd_init_state_is_shared_between_the_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    # One rank without reducers: init() needs no fleet. The public path's is_initialized() reads
    # the implementation's state, as any re-exported function does.
    for name in list(os.environ):
        if name.startswith("REDSRV_") or name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            monkeypatch.delenv(name)
    import redsrv.horovod.common as public
    from redsrv.adapters.horovod import common

    public.init()
    try:
        assert public.is_initialized() and common.is_initialized() and common.size() == public.size() == 1
    finally:
        public.shutdown()
    assert not common.is_initialized()
