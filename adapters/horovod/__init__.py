"""The implementation of Horovod's API on the reduction server. Users import it as
``redsrv.horovod.torch`` (or ``redsrv.horovod.tensorflow``, ``redsrv.horovod.keras``): thin
modules in ``api/horovod/`` that re-export each module's ``__all__`` from here.

Every collective goes through :class:`redsrv.Client`; :mod:`redsrv.adapters.horovod.common`
holds what the framework modules share (initialisation, process sets, operation keys, handles,
errors) and the process-wide state between ``hvd.init()`` and ``hvd.shutdown()``. See
``docs/horovod.md`` for what changes when migrating and what is not supported.
"""
