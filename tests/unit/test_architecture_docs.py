"""docs/architecture.md's tables of a sans-IO core's events, queries, actions and state
transitions say what the code says.

Each core whose tables the document keeps is one :class:`CoreDocs` in :data:`CORES`: the heading
its tables sit under, the class, and the code's own lists (its ``EVENTS`` and ``QUERIES``, its
``Action`` union, its transition table). A table is found by the text of its first header cell,
so adding the client core's tables is one more entry here, with ``transitions=None`` if it keeps
none. Any drift fails with the file, section and table to fix and what the code has instead.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest

from redsrv.core import client_core, reducer

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


@dataclass(frozen=True)
class CoreDocs:
    name: str
    section: str  # the start of the heading the tables are under
    core: type
    events: tuple[str, ...]
    queries: tuple[str, ...]
    actions: tuple[type, ...]
    transitions: dict[typing.Any, dict[str, typing.Any]] | None  # state -> event -> next state

    def __str__(self) -> str:  # the test ids
        return self.name


CORES = [
    CoreDocs("reducer", "## The reducer's state machine", reducer.ReducerCore, reducer.EVENTS, reducer.QUERIES,
             typing.get_args(reducer.Action), reducer.CHUNK_TRANSITIONS),
    CoreDocs("client", "## The client's state machine", client_core.ClientCore, client_core.EVENTS, client_core.QUERIES,
             typing.get_args(client_core.Action), None),
]


def section(docs: CoreDocs) -> str:
    text = DOC.read_text()
    start = next((m.start() for m in re.finditer(r"^## .*$", text, re.MULTILINE) if m.group().startswith(docs.section)), None)
    assert start is not None, f"{DOC.name} has no section headed {docs.section!r}"
    following = re.search(r"^## ", text[start + 3:], re.MULTILINE)
    return text[start:] if following is None else text[start:start + 3 + following.start()]


def table(docs: CoreDocs, first_header: str) -> list[list[str]]:
    """The rows (cells stripped) of the table in ``docs``'s section whose header row's first cell
    is ``first_header``."""
    lines = section(docs).splitlines()
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first_header:
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append([c.strip() for c in row.strip().strip("|").split("|")])
            return rows
    raise AssertionError(f"{DOC.name}, section {docs.section!r}: no table whose first column is headed {first_header!r}")


def code_spans(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def method_signature(cls: type, name: str) -> str:
    """``name(a, b, *, c)``, as the tables write a method: parameter names, no defaults."""
    params = list(inspect.signature(getattr(cls, name)).parameters.values())[1:]  # self
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keyword = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
    return f"{name}({', '.join(positional + (['*'] + keyword if keyword else []))})"


def check_methods(docs: CoreDocs, first_header: str, expected: tuple[str, ...]) -> None:
    where = f"{DOC.name}, section {docs.section!r}, table {first_header!r}"
    documented = [code_spans(row[0])[0] if code_spans(row[0]) else row[0] for row in table(docs, first_header)]
    names = [d.split("(")[0] for d in documented]
    missing = [n for n in expected if n not in names]
    extra = [n for n in names if n not in expected]
    assert not missing and not extra, (f"{where} lists {names}; {docs.core.__name__} has {list(expected)}: "
                                       f"add {missing}, remove {extra}")
    assert names == list(expected), f"{where} lists {names}; keep the code's order, {list(expected)}"
    for written in documented:
        actual = method_signature(docs.core, written.split("(")[0])
        assert written == actual, f"{where} writes `{written}`, but {docs.core.__name__} has `{actual}`"


@pytest.mark.parametrize("docs", CORES, ids=str)
def test_every_public_method_is_an_event_or_a_query(docs: CoreDocs) -> None:
    public = sorted(name for name, _ in inspect.getmembers(docs.core, inspect.isfunction) if not name.startswith("_"))
    declared = set(docs.events) | set(docs.queries)
    assert set(public) == declared, (
        f"{docs.core.__name__}'s public methods {public} are not its EVENTS and QUERIES: add "
        f"{sorted(set(public) - declared)} to one of them, drop {sorted(declared - set(public))}")
    assert not set(docs.events) & set(docs.queries), "a method is an event or a query, not both"


@pytest.mark.parametrize("docs", CORES, ids=str)
def test_the_events_table_is_the_code_s(docs: CoreDocs) -> None:
    check_methods(docs, "event (method)", docs.events)


@pytest.mark.parametrize("docs", CORES, ids=str)
def test_the_queries_table_is_the_code_s(docs: CoreDocs) -> None:
    check_methods(docs, "query (method)", docs.queries)


@pytest.mark.parametrize("docs", CORES, ids=str)
def test_the_actions_table_is_the_code_s(docs: CoreDocs) -> None:
    where = f"{DOC.name}, section {docs.section!r}, table 'action'"
    documented = {code_spans(row[0])[0] for row in table(docs, "action")}
    actual = {f"{a.__name__}({', '.join(f.name for f in dataclasses.fields(a))})" for a in docs.actions}
    assert documented == actual, (f"{where} differs from the Action union: the docs have {sorted(documented - actual)} "
                                  f"where the code has {sorted(actual - documented)}")


@pytest.mark.parametrize("docs", [d for d in CORES if d.transitions is not None], ids=str)
def test_the_transitions_table_is_the_code_s(docs: CoreDocs) -> None:
    assert docs.transitions is not None
    where = f"{DOC.name}, section {docs.section!r}, table 'state'"
    documented = {tuple(row[:3]) for row in table(docs, "state")}
    actual = {(state.name, event, new.name) for state, events in docs.transitions.items() for event, new in events.items()}
    assert documented == actual, (f"{where} differs from the code's transition table: the docs have "
                                  f"{sorted(documented - actual)} where the code has {sorted(actual - documented)}")


def test_signatures_are_written_as_the_tables_write_them() -> None:
    """Parameter names in order, ``*`` before the keyword-only ones, no defaults."""
    assert method_signature(reducer.ReducerCore, "leave") == "leave(conn, reason, now, *, for_good)"
    assert method_signature(reducer.ReducerCore, "abort_push") == "abort_push(ticket)"
