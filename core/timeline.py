"""A Chrome-trace timeline of every all-reduce (``REDSRV_TIMELINE=path``).

Open the file in chrome://tracing or https://ui.perfetto.dev. Each worker process is a track
group (``pid`` = rank); each operation is one span named by its key, and each chunk shows its
push (bytes leaving), wait (pushed, result not yet arriving) and pull (result arriving) on the
track of the reducer stream it used.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

__all__ = ["Timeline", "merge"]

#: Events kept in memory before further ones are counted instead of recorded, so a forgotten
#: timeline on a week-long job costs bounded memory (~100 bytes an event).
MAX_EVENTS = 2_000_000


class Timeline:
    """Collects complete ("X") events; :meth:`write` saves them as Chrome trace JSON."""

    def __init__(self, path: str, *, rank: int, job: str) -> None:
        self.path = path.replace("{rank}", str(rank))
        self.rank = rank
        self.job = job
        self._events: list[dict[str, Any]] = []
        self._dropped = 0
        self._lock = threading.Lock()
        self._origin = time.monotonic()
        self._wall_origin = time.time()

    def now(self) -> float:
        return time.monotonic()

    def span(self, name: str, track: str, start: float, end: float, **args: Any) -> None:
        # Wall-clock microseconds, so the files of different ranks line up when merged.
        event = {"name": name, "ph": "X", "pid": self.rank, "tid": track, "ts": (start - self._origin + self._wall_origin) * 1e6,
                 "dur": max(0.0, end - start) * 1e6, "args": args}
        with self._lock:
            if len(self._events) < MAX_EVENTS:
                self._events.append(event)
            else:
                self._dropped += 1

    def write(self) -> None:
        """Write (or rewrite) the file atomically."""
        with self._lock:
            events = list(self._events)
            dropped = self._dropped
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"job {self.job} rank {self.rank}"}}]
        document = {"traceEvents": meta + events, "displayTimeUnit": "ms",
                    "otherData": {"job": self.job, "rank": self.rank, "wall_clock_origin": self._wall_origin,
                                  "events_dropped": dropped}}
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(document, f)
        os.replace(tmp, self.path)


def merge(paths: list[str], out: str) -> int:
    """Combine the timelines of several ranks into one file; returns the number of events."""
    events: list[dict[str, Any]] = []
    for path in paths:
        with open(path) as f:
            events.extend(json.load(f)["traceEvents"])
    with open(out, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return len(events)
