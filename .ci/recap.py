"""What failed in a tox log, short enough to survive CI keeping only the tail of the output.

Each environment's pytest report scrolls away under the environments that run after it, so
``.ci/run`` prints this at the end: every environment's outcome, each failed test's summary line,
and the assertion lines (``E   ...``) of each failure, capped per test and in all.
Usage: ``python3 .ci/recap.py LOG``.
"""

from __future__ import annotations

import re
import sys

TOTAL_LIMIT = 9000  # characters; the CI report keeps about the last 12,000
LINES_PER_FAILURE = 12

ENV_RESULT = re.compile(r"^\s+[\w.-]+: (OK|FAIL|SKIP)\b")
SUMMARY = re.compile(r"^(FAILED|ERROR) ")
FAILURE_TITLE = re.compile(r"^_{3,} (.+?) _{3,}$")
ENV_COMMAND = re.compile(r"^([\w.-]+): commands\[\d+\]> ")


def recap(lines: list[str]) -> list[str]:
    out: list[str] = []
    env = "?"
    title = None
    kept = 0
    for line in lines:
        match = ENV_COMMAND.match(line)
        if match:
            env, title = match.group(1), None
            continue
        match = FAILURE_TITLE.match(line)
        if match:
            title, kept = match.group(1), 0
            out.append(f"[{env}] failure: {title}")
            continue
        if line.startswith("=") and title is not None:  # the end of the FAILURES section
            title = None
        elif title is not None and line.startswith("E ") and kept < LINES_PER_FAILURE:
            out.append("    " + line[:300])
            kept += 1
        elif SUMMARY.match(line):
            out.append(f"[{env}] {line[:300]}")
    out += [line for line in lines if ENV_RESULT.match(line)]
    return out


def main() -> int:
    with open(sys.argv[1], errors="replace") as f:
        lines = f.read().splitlines()
    text = "\n".join(recap(lines))
    if len(text) > TOTAL_LIMIT:
        text = "... (recap cut at the front)\n" + text[-TOTAL_LIMIT:]
    print("==== recap of the tox run ====")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
