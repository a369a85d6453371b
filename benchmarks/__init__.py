"""Benchmarks behind ``redsrv bench``: ``local`` (loopback CPU efficiency)."""
