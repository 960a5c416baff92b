"""docs/ARCHITECTURE.md stays true to the code: its reading orders cite files that exist,
at most 12 each, and names those files (or the files the same row cites) define or use;
every path the page cites exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"
MAX_FILES = 12
PATH = re.compile(r"^[\w./-]+\.(py|proto|md|sh|toml)$|^[\w-]+(/[\w.-]+)+/$")
NAME = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*$")


def reading_orders() -> dict[str, list[list[str]]]:
    """Each reading order's rows (file cell, names cell), by its heading."""
    text = DOC.read_text()
    section = text.split("## Read one request", 1)[1].split("\n## ", 1)[0]
    orders: dict[str, list[list[str]]] = {}
    heading = None
    for line in section.splitlines():
        if line.startswith("### "):
            heading = line[4:].strip()
            orders[heading] = []
        elif heading and re.match(r"^\| \d+ \|", line):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            orders[heading].append(cells[1:3])
    return orders


def cited(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_there_is_a_reading_order_for_each_door():
    orders = reading_orders()
    assert any("gRPC" in heading for heading in orders), orders.keys()
    assert any("REST" in heading for heading in orders), orders.keys()


@pytest.mark.parametrize("heading", sorted(reading_orders()))
def test_a_reading_order_cites_what_exists(heading):
    rows = reading_orders()[heading]
    files = [cited(file_cell)[0] for file_cell, _ in rows]
    assert len(set(files)) <= MAX_FILES, files
    for file_cell, names_cell in rows:
        file = cited(file_cell)[0]
        assert (ROOT / file).is_file(), file
        paths = [file] + [c for c in cited(names_cell) if PATH.match(c)]
        for path in paths:
            assert (ROOT / path).exists(), f"{heading}: {path}"
        text = "\n".join((ROOT / p).read_text() for p in paths if (ROOT / p).is_file())
        for name in cited(names_cell):
            if PATH.match(name) or not NAME.match(name):
                continue
            for part in name.split("."):
                assert re.search(rf"\b{re.escape(part)}\b", text), f"{heading}, {file}: {name}"


def test_every_path_the_page_cites_exists():
    for path in set(cited(DOC.read_text())):
        if PATH.match(path) and "/" in path:
            assert (ROOT / path).exists(), path
