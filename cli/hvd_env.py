"""``python -m redsrv.cli.hvd_env COUNTS -- COMMAND``: what ``redsrv run -H`` has mpirun start on
every host. mpirun gives each process its rank only in its own variables (``OMPI_COMM_WORLD_*``,
``PMI_*``); this sets the ``HOROVOD_*`` variables horovodrun exports, from that rank and the
workers per host (``COUNTS``, e.g. ``2,2``, known to the launcher), then becomes ``COMMAND``
(exec: same process, signals and exit status). The rank is read by :class:`Config`, which
alone reads the environment and knows every launcher's variables."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from redsrv.cli.hosts import horovod_variables
from redsrv.core.config import Config

__all__ = ["main", "wrap"]


def wrap(counts: Sequence[int], command: Sequence[str]) -> list[str]:
    """``command`` started through this module, with this interpreter (the same path on every
    host, as mpirun's workers need generally)."""
    return [sys.executable, "-m", "redsrv.cli.hvd_env", ",".join(map(str, counts)), "--", *command]


def main(argv: Sequence[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit("usage: python -m redsrv.cli.hvd_env COUNTS -- COMMAND (as redsrv run -H writes it)")
    counts = [int(c) for c in argv[0].split(",")]
    config = Config.from_env()
    os.environ.update(horovod_variables(counts, config.rank))
    try:
        os.execvp(argv[2], list(argv[2:]))
    except OSError as exc:
        print(f"redsrv run: cannot start {argv[2]!r}: {exc.strerror}", file=sys.stderr)
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
