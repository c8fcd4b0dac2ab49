"""A benchmark's table replaces its own in a docs/ file (benchmarks.doc_table): a re-measurement never appends."""

from benchmarks import doc_table


def test_a_table_replaces_its_own_and_a_new_key_adds_one(tmp_path, monkeypatch):
    monkeypatch.setattr(doc_table, "DOCS", tmp_path)
    doc = tmp_path / "x.md"
    doc.write_text(f"# X\n\n{doc_table.HERE}\n\n## Older write-ups\n")
    doc_table.write_table("x.md", "page / CPU A / 128 tokens", "#### first\n| a | 1 |\n")
    doc_table.write_table("x.md", "page / CPU B / 128 tokens", "#### other machine\n")
    doc_table.write_table("x.md", "page / CPU A / 128 tokens", "#### again\n| a | 2 |\n")
    text = doc.read_text()
    assert "first" not in text and text.count("#### again") == 1 and "#### other machine" in text
    assert text.index("#### again") < text.index("## Older write-ups")  # in the doc's place for tables
    assert doc_table.machine_kind()  # the machine, named
