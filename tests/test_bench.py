"""One command measures every performance claim: its table has a row per claim, each measured or left
out, and its JSON says the same (shapes only: timings are the benchmark's business)."""
import json
import subprocess
import sys
from pathlib import Path

from lablib import bench

ROOT = Path(__file__).resolve().parents[1]


def test_quick_run_of_a_reduced_set_gives_the_whole_table(tmp_path):
    out = subprocess.run([sys.executable, "-m", "lablib.bench", "--quick", "--only", "P1,P13,F", "--reps", "1",
                          "--json", str(tmp_path / "b.json")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "b.json").read_text())
    assert {"cores", "backend", "torch", "python"} <= set(result["machine"])
    by_item = {}
    for row in result["rows"]:
        by_item.setdefault(row["item"], []).append(row)
    assert set(by_item) == set(bench.ITEMS)
    p1 = by_item["P1"]
    assert len(p1) == 4 and all(r["ours"] and r["anchor"] and r["ratio"] > 0 for r in p1)
    assert all(r["ours"] and r["target"] and r["met"] in (True, False) for r in by_item["F"])
    assert len(by_item["P13"]) == 2 and all(r["ours"] and r["anchor"] and r["ratio"] > 0 for r in by_item["P13"])
    assert [r["note"] for r in by_item["P2"]] == ["left out by --quick (a whole-course run)"]
    assert [r["note"] for r in by_item["P6"]] == ["not run (--only)"]
    assert [r["note"] for r in by_item["P4"]] == ["not run (--only)"]
    lines = out.stdout.splitlines()
    assert lines[2].startswith("| item | measure | unit | course | anchor | ratio | target | met |")
    assert len([line for line in lines if line.startswith("| P1 |")]) == 4


def test_bad_items_are_named():
    out = subprocess.run([sys.executable, "-m", "lablib.bench", "--only", "P6,X,P99"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "unknown item(s) X, P99: choose from P1, P2" in out.stderr


def test_the_readme_table_is_replaced_between_its_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{bench.README_START}\nold table\n{bench.README_END}\nrest\n")
    bench.write_readme("| new |", readme)
    assert readme.read_text() == f"intro\n{bench.README_START}\n| new |\n{bench.README_END}\nrest\n"
