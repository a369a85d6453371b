"""``redsrv.jax`` is :mod:`redsrv.adapters.jax` under a shorter name (it imports JAX)."""

import sys

from redsrv.adapters import jax as _adapter

# The same module object under both names, so there is one default communicator, not two.
sys.modules[__name__] = _adapter
