"""Horovod's API on the reduction server: ``import redsrv.horovod.torch as hvd`` (or
``redsrv.horovod.tensorflow``, ``redsrv.horovod.keras``) runs a Horovod training script
unchanged, launched with ``redsrv run -np N python train.py`` or under ``mpirun`` / SLURM /
torchrun with ``REDSRV_REDUCERS`` set.

Every collective goes through :class:`redsrv.Client`; :mod:`redsrv.horovod.common` holds what
the framework modules share (initialisation, process sets, operation keys, handles, errors).
See ``docs/horovod.md`` for what changes when migrating and what is not supported.
"""
