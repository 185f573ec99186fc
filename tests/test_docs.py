"""The README and docs/ stand on their own: no documents outside the repository, no one machine's paths, every
file they name exists, benchmarks.md keeps one current table per measurement with its command, and the
superseded figures it moved out are data in docs/results."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# a path of one particular machine: a home, the work tree, a venv outside the repository
MACHINE_PATH = re.compile(r"(?<![\w.])(/work/|/home/|/root/|/opt/|/Users/|C:\\\\)")
REPO_PATH = re.compile(r"`((?:docs|tests|benchmarks|scripts|hwkv|hwkv_\w+|\.ci|\.github)/[\w./-]+)`")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_no_documents_outside_the_repository(doc):
    text = doc.read_text()
    assert "DESIGN.md" not in text, f"{doc.name} sends readers to DESIGN.md, which the repository does not have"
    assert not MACHINE_PATH.search(text), f"{doc.name}: {MACHINE_PATH.search(text).group(0)!r} is one machine's path"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_files_the_docs_name_exist(doc):
    missing = []
    for path in REPO_PATH.findall(doc.read_text()):
        path = path.rstrip(".")
        if "{" in path or "*" in path or path.endswith("/"):
            continue
        if not (ROOT / path).exists() and not (ROOT / path).with_suffix(".py").exists():
            missing.append(path)
    assert not missing, f"{doc.name} names files the repository does not have: {missing}"


def _tables(text):
    """(line number, header) of every markdown table."""
    lines = text.split("\n")
    return [(i, ln) for i, ln in enumerate(lines)
            if ln.startswith("|") and i + 1 < len(lines) and re.match(r"\|\s*:?-{3}", lines[i + 1])]


def test_benchmarks_one_current_table_per_measurement_with_its_command():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    lines = text.split("\n")
    command = re.compile(r"(python3?|hwkv|pytest|/usr/bin/time)\b.*\b(bench|pytest|benchmarks/)|same command")
    sections = {}
    for i, header in _tables(text):
        heading = max((j for j in range(i) if lines[j].startswith("#")), default=0)
        section = "\n".join(lines[heading:i])
        assert command.search(section) or command.search(lines[heading]), \
            f"the table at line {i + 1} ({header[:60]}) has no command between its heading and itself"
        sections.setdefault(heading, []).append(header)
    for heading, headers in sections.items():  # a section may hold several measurements, never one twice
        assert len(headers) == len(set(headers)), f"{lines[heading]}: two tables of the same measurement"
    assert "before (us)" not in text and "AVX2, no AMX" not in text


def test_superseded_figures_are_data():
    for name in ("cpu-superseded.json", "h200-superseded.json"):
        data = json.loads((ROOT / "docs" / "results" / name).read_text())
        assert data["schema"] == "hwkv-superseded/1" and data["entries"]
        ids = [e["id"] for e in data["entries"]]
        assert len(ids) == len(set(ids))
        for e in data["entries"]:
            assert e["what"] and e["superseded_by"], e["id"]
            assert any(k in e for k in ("table", "values", "runs")), e["id"]
            for t in [e.get("table"), e.get("memory")]:
                if t:
                    assert t["rows"] and all(len(r) == len(t["columns"]) for r in t["rows"]), e["id"]
            if "raw" in e:
                assert (ROOT / e["raw"]).exists(), e["raw"]
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    for ref in re.findall(r"`((?:cpu|h200)-[\w.-]+)`", text):  # every entry the page cites is there
        if not ref.endswith((".json", ".jsonl")):
            pool = "cpu" if ref.startswith("cpu") else "h200"
            data = json.loads((ROOT / "docs" / "results" / f"{pool}-superseded.json").read_text())
            assert ref in {e["id"] for e in data["entries"]}, ref
    for path in sorted((ROOT / "docs" / "results").iterdir()):  # every results file parses
        if path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix == ".jsonl":
            [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def test_superseded_tables_are_copied_as_printed():
    """Spot checks against the page as it was: the 2026-11-30 decode table's first and last rows."""
    data = json.loads((ROOT / "docs" / "results" / "h200-superseded.json").read_text())
    entry = next(e for e in data["entries"] if e["id"] == "h200-decode-2026-11-30")
    assert entry["table"]["rows"][0] == ["1 x 4K", 4096, 32, 8.6, 0.23, 9.0, ""]
    assert entry["table"]["rows"][-1] == ["64 x 4K, random slots", 4096, 2, 163.1, 0.77, 140.9, ""]
