"""The README and the pages in docs/ keep their promises: every relative link points at a file (and a
heading) that is there, and every `./lab.sh` or `lablib` command they name, with its options, exists."""
import re
import shlex
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", page.read_text(), re.M)}


def test_the_readme_is_what_a_newcomer_reads_in_two_minutes():
    assert len((ROOT / "README.md").read_text().splitlines()) < 150


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_something_that_is_there(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(f"{target}: no {where.relative_to(ROOT) if where.is_relative_to(ROOT) else where}")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(f"{target}: {where.name} has no heading #{anchor}")
    assert not broken, broken


def _help(*command) -> str:
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


@lru_cache(maxsize=None)
def options(*command) -> set[str]:
    """The long options and subcommands ``command --help`` names."""
    text = _help(*command, "--help")
    found = set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", text))
    choices = re.search(r"\{([\w,-]+)\}", text)  # argparse lists subcommands as {a,b,c}
    return found | (set(choices.group(1).split(",")) if choices else set())


LAB_SH = {"lab", "test", "doctor", "bench", "--help", "-h"}


def commands(text: str):
    """(program, words) of each `./lab.sh ...`, `lablib ...` or `python -m lablib.X ...` a page shows, in a
    code block or inline code."""
    spans = re.findall(r"```[a-z]*\n(.*?)```", text, re.S) + re.findall(r"`([^`\n]+)`", text)
    for span in spans:
        for line in span.splitlines():
            line = line.split(" #", 1)[0]
            # a command starts a line (or follows && or ;); `from lablib import ...` is Python, not one
            for m in re.finditer(r"(?:^\s*[!$]?\s*|&&\s*|;\s*|\s)(\./lab\.sh|(?<![\w.])lablib(?= [a-z-])|"
                                 r"python -m lablib\.\w+|-m lablib\.\w+)((?: [^\s;&|]+)*)", line):
                if m.group(1) == "lablib" and re.search(r"(from|import)\s*$", line[:m.start(1)]):
                    continue
                try:
                    words = shlex.split(m.group(2))
                except ValueError:
                    words = m.group(2).split()
                yield m.group(1).replace("python ", ""), [w for w in words if not w.startswith("<")]


def problems(program, words) -> list[str]:
    if program == "./lab.sh":
        if not words or words[0].startswith("-") and words[0] not in LAB_SH:
            return []  # options for jupyter lab
        if words[0] not in LAB_SH:
            return [f"./lab.sh {words[0]}: lab.sh has no such command"]
        rest = {"bench": (sys.executable, "-m", "lablib.bench"), "doctor": (sys.executable, "-m", "lablib", "doctor")}
        return problems_of(rest.get(words[0]), words[1:], f"./lab.sh {words[0]}")
    if program == "lablib":
        if not words or words[0].startswith("-"):
            return []
        known = options(sys.executable, "-m", "lablib")
        if words[0] not in known:
            return [f"lablib {words[0]}: no such command (lablib has {sorted(known)})"]
        command = (sys.executable, "-m", "lablib", words[0])
        if words[0] == "quiz" and len(words) > 1:
            return problems_of(command + (words[1],), words[2:], f"lablib quiz {words[1]}")
        return problems_of(command, words[1:], f"lablib {words[0]}")
    module = program.split()[-1]
    return problems_of((sys.executable, "-m", module), words, program)


def problems_of(command, words, name) -> list[str]:
    if command is None:
        return []
    known = options(*command)
    return [f"{name} {w}: no such option" for w in words if w.startswith("--") and w.split("=")[0] not in known]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_a_page_names_exists(page):
    found = [p for program, words in commands(page.read_text()) for p in problems(program, words)]
    assert not found, found


def test_a_command_that_does_not_exist_is_caught():
    text = "Run `./lab.sh bench --fastest` or `lablib grade subs --parallel 2` or `./lab.sh frobnicate`."
    found = [p for program, words in commands(text) for p in problems(program, words)]
    assert found == ["./lab.sh bench --fastest: no such option", "lablib grade --parallel: no such option",
                     "./lab.sh frobnicate: lab.sh has no such command"]
