"""``redsrv.torch`` is :mod:`redsrv.adapters.torch` (the PyTorch adapter) under a short name."""

import sys

from redsrv.adapters import torch as _adapter

# One module object under both names, so `redsrv.torch.HookState is redsrv.adapters.torch.HookState`
# and state such as a registered backend is never duplicated.
sys.modules[__name__] = _adapter
