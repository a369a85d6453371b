"""What a Horovod-API test worker leaves for its test: its arrays (``PREFIX.npz``) and facts
(``PREFIX.json``), read back by ``tests_support.worker_results``."""

from __future__ import annotations

import json

import numpy as np


def save(prefix: str, arrays: dict[str, np.ndarray], facts: dict[str, object]) -> None:
    np.savez(prefix + ".npz", **arrays)  # type: ignore[arg-type]
    with open(prefix + ".json", "w") as f:
        json.dump(facts, f)
