"""Helpers shared by test modules (importable because tests/ is on sys.path via conftest)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import numpy as np

import redsrv
from redsrv.core import wire

from worker_main import make_input

__all__ = ["make_input", "rank_order_sum", "read_frames", "why_no_namespaces"]


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


def why_no_namespaces() -> str | None:
    """Why the emulated-cluster benchmarks cannot run here (a skip reason), or None when they can:
    Linux, root, iproute2, and ``ip netns add`` actually working (containers may forbid it)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    for binary in ("ip", "tc"):
        if shutil.which(binary) is None:
            return f"`{binary}` (iproute2) is not installed"
    probe = f"rsprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None
