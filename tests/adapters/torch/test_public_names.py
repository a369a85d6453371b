"""``redsrv.torch`` re-exports the adapter's public names (``api/torch.py``): exactly its
``__all__``, each the same object as in ``redsrv.adapters.torch``. A name added to the adapter's
``__all__`` without its re-export fails here."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")


def test_redsrv_torch_is_the_adapters_public_names() -> None:
    import redsrv.adapters.torch as adapter
    import redsrv.torch as public

    assert public is not adapter and public.__name__ == "redsrv.torch"
    assert list(public.__all__) == list(adapter.__all__)
    for name in adapter.__all__:
        assert getattr(public, name) is getattr(adapter, name), name
