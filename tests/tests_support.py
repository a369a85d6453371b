"""Helpers shared by test modules (importable because tests/ is on sys.path via conftest)."""

from __future__ import annotations

import socket

import numpy as np

import redsrv
from redsrv.core import wire

from worker_main import make_input

__all__ = ["make_input", "rank_order_sum", "read_frames"]


def read_frames(sock: socket.socket, timeout: float = 5.0) -> list[wire.Frame]:
    """Every frame a raw peer receives until the other side closes or goes quiet (one decoder:
    several frames may arrive in one read)."""
    sock.settimeout(timeout)
    decoder = wire.FrameDecoder()
    frames: list[wire.Frame] = []
    while True:
        try:
            data = sock.recv(65536)
        except OSError:
            return frames
        try:
            decoder.receive_data(data)
            while (frame := decoder.next_frame()) is not None:
                frames.append(frame)
        except redsrv.RemoteProtocolError:
            return frames
        if not data:
            return frames


def rank_order_sum(arrays: list[np.ndarray]) -> np.ndarray:
    """((x0 + x1) + x2) + ... in the arrays' own dtype: what the reducer computes."""
    total = arrays[0].copy()
    for x in arrays[1:]:
        total += x
    return total
