"""A table of measured numbers in the docs is the benchmark's own table of committed records
(``<!-- records: FILE BENCHMARK [MODE] -->`` on the line before it): a number changed by
hand, or records that no longer hold it, fail here."""

from __future__ import annotations

import shutil

from bench import docs_tables
from bench.core import ROOT

STUDIES = ("scaling strong", "scaling weak", "cnn", "granularity", "batch_regimes",
           "parallel_modes")  # fmt: skip


def test_every_cited_table_is_its_records():
    assert docs_tables.problems() == []


def test_the_benchmarks_page_cites_every_study_it_shows():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    cited = [m.group(2) + (f" {m.group(3)}" if m.group(3) else "")
             for line in text.splitlines() if (m := docs_tables.MARK.match(line))]  # fmt: skip
    assert set(STUDIES) <= set(cited), cited
    for line in text.splitlines():
        if m := docs_tables.MARK.match(line):
            assert m.group(1).startswith("bench/recorded/"), line


def test_a_number_changed_by_hand_is_found_and_rebuilt(tmp_path):
    page = tmp_path / "benchmarks.md"
    shutil.copy(ROOT / "docs" / "benchmarks.md", page)
    text = page.read_text()
    assert "| 3.07 (2.87–3.41, n=3) |" in text
    page.write_text(text.replace("| 3.07 (2.87–3.41, n=3) |", "| 9.99 (2.87–3.41, n=3) |"))
    (problem,) = docs_tables.problems(files=[page])
    assert "benchmarks.md" in problem and "scaling" in problem
    docs_tables.problems(write=True, files=[page])
    assert page.read_text() == text
