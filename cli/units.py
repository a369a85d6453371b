"""One unit convention for the command line.

- Sizes take a unit suffix everywhere (``4KiB``, ``64MiB``, ``1.5GiB``, ``512MB``, ``4096B``); a bare
  number is in the unit the flag's name or help gives (``--sizes 64`` in ``bench local`` is 64 MiB),
  so older command lines keep their meaning.
- Rates name their unit in the flag: ``-gbit`` is Gbit/s (NICs, as vendors quote them), ``-gbyte``
  is GB/s (data moved or reduced per second); JSON keys follow suit (``*_gbit``, ``*_gbps`` = GB/s).
- ``--json PATH`` writes the result to PATH (``-``: standard output).
- Help text is plain text: the reStructuredText of module docstrings (double backquotes, roles
  such as ``:func:``) is rewritten before argparse prints it.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

__all__ = ["BYTE_UNITS", "parse_size", "size_in", "plain_text", "plain_help"]

#: Suffixes, case-insensitive: SI (k, MB: powers of 1000) and binary (KiB, MiB: powers of 1024).
BYTE_UNITS = {"b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
              "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}

_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]+))?\s*([a-zA-Z]*)\s*")


def parse_size(text: str, *, bare_unit: str = "B") -> int:
    """Bytes in ``text``: a number with a unit suffix, or a bare number in ``bare_unit``.

    >>> parse_size("4KiB"), parse_size("64 MiB"), parse_size("1.5GiB"), parse_size("512MB"), parse_size("4096")
    (4096, 67108864, 1610612736, 512000000, 4096)
    >>> parse_size("0.00390625", bare_unit="MiB"), parse_size("4", bare_unit="KiB")
    (4096, 4096)
    """
    match = _SIZE.fullmatch(text)
    unit = (match.group(3) or bare_unit).lower() if match else ""
    if match is None or unit not in BYTE_UNITS:
        raise ValueError(f"not a size: {text!r} (a number with a unit, such as 4KiB, 64MiB or 2GB)")
    value = float(match.group(1)) * 10 ** int(match.group(2) or 0) * BYTE_UNITS[unit]
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(value)


def size_in(unit: str, *, whole: bool = False) -> Callable[[str], float]:
    """An argparse ``type`` for a size flag whose value the program uses in ``unit`` (its bare
    numbers are in ``unit`` too); ``whole``: the value must be a whole number of ``unit``, given
    back as an int.

    >>> size_in("MiB")("4KiB"), size_in("KiB", whole=True)("1MiB"), size_in("MiB")("16")
    (0.00390625, 1024, 16.0)
    """
    scale = BYTE_UNITS[unit.lower()]

    def parse(text: str) -> float:
        try:
            nbytes = parse_size(text, bare_unit=unit)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if whole:
            if nbytes % scale:
                raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of {unit}")
            return nbytes // scale
        return nbytes / scale

    parse.__name__ = f"size in {unit}"
    return parse


_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def plain_text(text: str) -> str:
    """reStructuredText markup as a terminal shows it best: literals and roles as their text.

    >>> plain_text("See :func:`redsrv.bench.train.run` and ``--framework jax``; :mod:`~redsrv.core.wire`.")
    'See redsrv.bench.train.run and --framework jax; redsrv.core.wire.'
    """
    return _LITERAL.sub(r"\1", _ROLE.sub(r"\1", text))


def plain_help(parser: argparse.ArgumentParser) -> None:
    """Rewrite ``parser``'s description, epilog and option help, and its subcommands', as plain text."""
    for attr in ("description", "epilog"):
        if getattr(parser, attr):
            setattr(parser, attr, plain_text(getattr(parser, attr)))
    for action in parser._actions:  # argparse keeps its actions here and offers no public accessor
        if action.help:
            action.help = plain_text(action.help)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                plain_help(sub)
            for choice in action._choices_actions:  # the one-line help listed under the parent
                if choice.help:
                    choice.help = plain_text(choice.help)
