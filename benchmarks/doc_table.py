"""A benchmark's table in a docs/ file, replaced in place at each measurement instead of appended to.

Each table lives between two marker lines that name it, `<!-- table: KEY -->` and `<!-- end: KEY -->`; the key says
what was measured and where (the machine kind, the configuration), so that a measurement on another machine or of
another configuration adds its own table, and a new one of the same replaces the old.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from engine.cpu import cpu

DOCS = Path(__file__).resolve().parent.parent / "docs"


def machine() -> str:
    """The machine in a benchmark's header: "2 cores, AMD EPYC"."""
    return f"{os.cpu_count()} cores, {cpu().model}"


def machine_kind() -> str:
    """The CPU's model and the widest vector instructions it runs: "AMD EPYC, AVX-512 (VNNI)"."""
    model, flags = cpu().model, cpu().flag_set
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{model}, {isa}" + (" (VNNI)" if "avx512_vnni" in flags else "")


HERE = "<!-- the tables follow -->"  # where a doc wants its new tables (else they go at its end)


def write_table(doc: str, key: str, text: str) -> Path:
    """Put `text` (a heading line, then markdown) between the markers of `key` in docs/`doc`: in place of the
    table there, or, where there is none yet, after the doc's HERE line (or at its end)."""
    path = DOCS / doc
    begin, end = f"<!-- table: {key} -->", f"<!-- end: {key} -->"
    block = f"{begin}\n{text.strip()}\n{end}"
    old = path.read_text(encoding="utf-8")
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(old):
        new = pattern.sub(lambda _: block, old, count=1)
    elif HERE in old:
        new = old.replace(HERE, f"{HERE}\n\n{block}", 1)
    else:
        new = old.rstrip("\n") + "\n\n" + block
    path.write_text(new + ("" if new.endswith("\n") else "\n"), encoding="utf-8")
    return path
