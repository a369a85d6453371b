"""``redsrv.tf`` is :mod:`redsrv.adapters.tf` (the TensorFlow adapter) under a short name."""

import sys

from redsrv.adapters import tf as _adapter

# One module object under both names, so `redsrv.tf.ReductionServerStrategy is
# redsrv.adapters.tf.ReductionServerStrategy` and isinstance checks agree.
sys.modules[__name__] = _adapter
