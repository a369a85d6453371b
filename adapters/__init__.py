"""Thin framework adapters: translate tensors to contiguous NumPy views and call
:class:`redsrv.Client`. Each module imports its framework; import only the one you use."""
