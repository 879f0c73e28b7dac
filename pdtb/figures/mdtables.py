"""Markdown blocks and tables as data: a document split into blocks, tables read and written, rows grouped.

The helpers the results document's dense forms are built with (condense.py, condense_systems.py) and
its summary reads its figures through (headline.py).

    blocks(lines) -> [[heading], [paragraph], [| table |], ...]   (blank lines between blocks)
    table(block) -> (header, rows) | None;  md(header, rows) -> block
"""
from __future__ import annotations

import re

Block = list[str]


def blocks(lines: list[str]) -> list[Block]:
    """Lines split at blank lines; a heading is always a block of its own."""
    out: list[Block] = []
    cur: Block = []
    for line in lines:
        if not line.strip() or line.startswith("#"):
            if cur:
                out.append(cur)
            cur = []
            if line.startswith("#"):
                out.append([line])
            continue
        cur.append(line)
    if cur:
        out.append(cur)
    return out


def join(bs: list[Block]) -> list[str]:
    """The blocks as lines again, a blank line after each."""
    out: list[str] = []
    for b in bs:
        out += [*b, ""]
    return out


def cells(line: str) -> list[str]:
    """A table row's cells, stripped."""
    return [c.strip() for c in line.strip()[1:-1].split("|")]


def table(b: Block) -> tuple[list[str], list[list[str]]] | None:
    """A markdown table block's header and rows; None for any other block."""
    if len(b) < 2 or not all(x.startswith("|") for x in b) or not set(b[1]) <= set("|-: "):
        return None
    return cells(b[0]), [cells(x) for x in b[2:]]


def md(head: list[str], rows: list[list[str]]) -> Block:
    """A markdown table block."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(r) + " |" for r in rows)]


def find(bs: list[Block], head0: list[str]) -> int | None:
    """The index of the first table whose header starts with `head0`."""
    for i, b in enumerate(bs):
        t = table(b)
        if t and t[0][:len(head0)] == head0:
            return i
    return None


def transpose_claims(bs: list[Block]) -> list[Block]:
    """Every `| claim | this run | essay |`-shaped table (or `| figure | ...`) as one row per column."""
    out = []
    for b in bs:
        t = table(b)
        if t and t[0][0] in ("claim", "figure") and len(t[0]) == 3 and len(t[1]) > 2:
            head, rows = t
            b = md(["", *(r[0] for r in rows)], [[h, *(r[i] for r in rows)] for i, h in enumerate(head[1:], 1)])
        out.append(b)
    return out


def prose(b: Block) -> bool:
    """A one-line paragraph: not a heading, table, list or code."""
    return len(b) == 1 and not b[0].startswith(("#", "|", "- ", "```", "!["))


def lead_ins(bs: list[Block]) -> list[Block]:
    """Each "### " heading followed by a one-line paragraph as that paragraph's bold lead-in."""
    out: list[Block] = []
    for b in bs:
        if out and out[-1][0].startswith("### ") and prose(b):
            title = out[-1][0][4:].rstrip(".")
            out[-1] = [f"**{title}.** {b[0]}"]
            continue
        out.append(b)
    return out


def ratio(cell: str) -> str:
    """"4,321.7 (0.84x)" -> "0.84"; a cell without a ratio as it is."""
    m = re.search(r"\(([\d.,]+)x\)", cell)
    return m.group(1) if m else cell


def grouped(head: list[str], rows: list[list[str]], vary: tuple[str, ...]) -> Block:
    """Rows equal but for the first column and the `vary` columns as one row: the first column's names
    joined, each `vary` cell a list in the same order."""
    idx = [head.index(v) for v in vary if v in head]
    groups: dict[tuple, list[list[str]]] = {}
    for r in rows:
        groups.setdefault(tuple(c for k, c in enumerate(r) if k and k not in idx), []).append(r)
    return md(head, [[", ".join(r[0] for r in rs), *(", ".join(r[k] for r in rs) if k in idx else rs[0][k]
                                                      for k in range(1, len(head)))] for rs in groups.values()])
