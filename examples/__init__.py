"""Runnable examples, and the local launcher behind ``redsrv demo``."""
