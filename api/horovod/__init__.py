"""Horovod's API on the reduction server: ``import redsrv.horovod.torch as hvd`` (or
``redsrv.horovod.tensorflow``, ``redsrv.horovod.keras``) runs a Horovod training script
unchanged, launched with ``redsrv run -np N python train.py`` or under ``mpirun`` / SLURM /
torchrun with ``REDSRV_REDUCERS`` set. See ``docs/horovod.md``.

Only the public names live here: the implementation is :mod:`redsrv.adapters.horovod`. Each
module below re-exports its counterpart's ``__all__``, the same objects (so ``isinstance`` holds
and ``hvd.init()``'s process-wide state is one), and Horovod's submodules stay importable
(``redsrv.horovod.torch.mpi_ops``, ``redsrv.horovod.keras.callbacks``, ...).
"""
