"""``ElasticSampler``, as Horovod's ``horovod.torch.elastic.sampler``; implemented in
:mod:`redsrv.adapters.horovod.torch.sampler`."""

from redsrv.adapters.horovod.torch.sampler import *  # noqa: F403 - exactly the names in its __all__
from redsrv.adapters.horovod.torch.sampler import __all__ as __all__
