"""A long history for the scale tests: 10,000 runs with 100-300 token events per engine (about 4 million token rows)
and the speculative engine's steps, written straight into SQLite in one transaction (the runs with executemany, the
events with INSERT ... SELECT, so that SQLite, not Python, makes the millions of rows). It is made once per test
session (about 12 s on the 2-core machine, 0.5 GB) and each test module works on its own copy."""

from __future__ import annotations

import atexit
import functools
import json
import random
import shutil
import sqlite3
import tempfile
from datetime import datetime, timedelta, timezone
from pathlib import Path

from specconsole.history import History

CATEGORIES = ("code", "json_sql", "summarization", "chat", "creative", "multiturn")
STATUSES = ["completed"] * 90 + ["cancelled"] * 4 + ["failed"] * 3 + ["interrupted"] * 3
# token texts as SmolLM2's tokenizer cuts them: words, code, whitespace, accents, emoji, right-to-left
PIECES = [" the", " a", " return", "def", "(", ")", ":", "\n", "    ", " x", " =", " 1", " print", "é", " 😀", " של",
          "ום", " مر", "حبا", " {", "\"", "name", "\":", " 漢", "字", ",", ".", " SELECT", " *", " FROM", "\u200b"]


def make_big_history(path: Path, runs: int = 10_000, seed: int = 0) -> dict:
    """Write `runs` finished runs into a new history file; returns how many of each row there are."""
    History(path)  # the schema, indexes included, as the console makes it
    rng = random.Random(seed)
    start = datetime(2025, 1, 1, tzinfo=timezone.utc)
    run_rows, engine_rows, lengths = [], [], []
    for i in range(runs):
        run_id = f"{rng.getrandbits(48):012x}"
        n = {e: rng.randint(100, 300) for e in ("baseline", "speculative")}
        lengths += [(run_id, e, n[e]) for e in n]
        speedup = rng.uniform(0.8, 3.0)
        metrics = {e: {"output_tokens": n[e], "ttft_ms": rng.uniform(50, 300), "tpot_ms": rng.uniform(20, 150),
                       "tokens_per_s": rng.uniform(3, 25), "target_passes": n[e] if e == "baseline" else n[e] // 3}
                   for e in n}
        run_rows.append((
            run_id, (start + timedelta(seconds=300 * i)).isoformat(timespec="seconds"), rng.choice(STATUSES),
            CATEGORIES[i % len(CATEGORIES)], f"Prompt {i}: " + " ".join(rng.choices(PIECES, k=40)), "local",
            "SmolLM2-135M-Instruct", "ngram", "fair", json.dumps({"max_new_tokens": 256, "temperature": 0.0, "k": 4}),
            json.dumps({"speedup": speedup}), speedup, rng.uniform(0.3, 0.9), rng.choice([0, 1]), rng.choice([0, 1]),
        ))
        engine_rows += [(run_id, e, e, "ngram" if e == "speculative" else "none",
                         "".join(rng.choices(PIECES, k=n[e])), json.dumps(metrics[e])) for e in n]
    conn = sqlite3.connect(path)
    with conn:  # one transaction
        conn.executemany(
            "INSERT INTO runs (id, created_at, status, category, prompt, backend, target_model, method, mode, "
            "settings, comparison, speedup, acceptance_rate, identical, noisy) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, "
            "?, ?, ?, ?, ?)", run_rows)
        conn.executemany("INSERT INTO engines (run_id, engine, label, method, settings, output, metrics) VALUES "
                         "(?, ?, ?, ?, '{}', ?, ?)", engine_rows)
        conn.execute("CREATE TEMP TABLE lengths (run_id TEXT, engine TEXT, n INTEGER)")
        conn.executemany("INSERT INTO temp.lengths VALUES (?, ?, ?)", lengths)
        conn.execute("CREATE TEMP TABLE pieces (i INTEGER PRIMARY KEY, text TEXT)")
        conn.executemany("INSERT INTO temp.pieces VALUES (?, ?)", enumerate(PIECES))
        conn.execute("CREATE TEMP TABLE seq (i INTEGER PRIMARY KEY)")
        conn.execute("INSERT INTO temp.seq WITH RECURSIVE c(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM c "
                     "WHERE i < 299) SELECT i FROM c")
        # speculative runs: steps of 3 tokens, the third one recovered, and one rejected draft after it
        conn.execute(
            f"""INSERT INTO tokens (run_id, engine, seq, kind, token_id, text, step, position, time_s, idx, p, q)
            SELECT l.run_id, l.engine, s.i,
                   CASE WHEN l.engine = 'baseline' THEN 'baseline' WHEN s.i % 4 = 3 THEN 'rejected'
                        WHEN s.i % 4 = 2 THEN 'recovered' ELSE 'accepted' END,
                   100 + (s.i * 37 + l.n) % 49000, p.text, s.i / 4, s.i % 4, 0.05 * s.i,
                   CASE WHEN l.engine = 'speculative' AND s.i % 4 = 3 THEN NULL ELSE s.i END, 0.9, 0.7
            FROM temp.lengths l JOIN temp.seq s ON s.i < l.n JOIN temp.pieces p ON p.i = (s.i * 7 + l.n) % {len(PIECES)}
            ORDER BY l.run_id, l.engine, s.i""")
        # the speculative engine's steps (the baseline's, one per token, would add 2 million rows that no test reads)
        conn.execute(
            """INSERT INTO steps (run_id, engine, step, drafted, accepted, emitted, draft_ms, verify_ms, time_s)
            SELECT l.run_id, l.engine, s.i, 3, 2, 3, 1.5, 40.0, 0.2 * s.i
            FROM temp.lengths l JOIN temp.seq s ON s.i < l.n / 4 WHERE l.engine = 'speculative'
            ORDER BY l.run_id, s.i""")
    counts = {t: conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("runs", "tokens", "steps")}
    conn.close()
    return counts


@functools.cache
def _template() -> tuple[Path, dict]:
    folder = Path(tempfile.mkdtemp(prefix="specconsole-big-history-"))
    atexit.register(shutil.rmtree, folder, True)
    path = folder / "history.db"
    return path, make_big_history(path)


def big_history_copy(path: Path) -> dict:
    """A copy of the session's long history at `path`; returns its row counts."""
    template, counts = _template()
    shutil.copyfile(template, path)
    return counts
