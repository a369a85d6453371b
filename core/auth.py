"""Mutual challenge-response over the handshake (HMAC-SHA256), pure functions.

Both sides contribute a fresh random nonce, so a recorded handshake cannot be replayed: the
reducer proves it knows the secret before the worker sends anything of value, then the worker
proves it. Proofs bind the job, rank, session and reducer incarnation, so a proof for one
connection is useless on another.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

from .wire import NONCE_BYTES, PROOF_BYTES, Hello

__all__ = ["new_nonce", "server_proof", "client_proof", "proofs_equal", "NO_PROOF"]

NO_PROOF = bytes(PROOF_BYTES)


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def _transcript(label: bytes, hello: Hello, server_nonce: bytes, incarnation: int) -> bytes:
    job = hello.job.encode("utf-8")
    return b"".join(
        (label, struct.pack("<IIQQH", hello.rank, hello.world_size, hello.session, incarnation, len(job)),
         job, hello.nonce, server_nonce)
    )


def server_proof(secret: bytes, hello: Hello, server_nonce: bytes, incarnation: int) -> bytes:
    return hmac.new(secret, _transcript(b"redsrv-reducer-v1", hello, server_nonce, incarnation), hashlib.sha256).digest()


def client_proof(secret: bytes, hello: Hello, server_nonce: bytes, incarnation: int) -> bytes:
    return hmac.new(secret, _transcript(b"redsrv-worker-v1", hello, server_nonce, incarnation), hashlib.sha256).digest()


def proofs_equal(a: bytes, b: bytes) -> bool:
    """Constant-time comparison."""
    return hmac.compare_digest(a, b)
