"""lablib's shape: no import circles, rank-side code never pulls in the notebook side (plotly, ipywidgets),
and every lab is its five files."""
import ast
import subprocess
import sys
from pathlib import Path

from lablib.labs import LABS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lablib"
# What runs on the ranks: a rank imports these (and what they import) to run a job.
RANK_SIDE = ["lablib.pool.worker", "lablib.timeline", "lablib.overlap", "lablib.profiling", "lablib.comm", "lablib.work",
             "lablib.toy", "lablib.memory", "lablib.bandwidth", "lablib.strategies.flat", "lablib.strategies.harness",
             "lablib.strategies.zero", "lablib.strategies.fsdp", "lablib.strategies.ring", "lablib.strategies.prefetch",
             "lablib.strategies.tensor_parallel", "lablib.strategies.tp_reference", "lablib.strategies.schedules", "lablib.strategies.pipeline",
             "lablib.strategies.pp_reference"] + [f"lablib.checks.{lab.checks}" for lab in LABS]
NOTEBOOK_SIDE = ("plotly", "ipywidgets", "IPython", "lablib.views", "lablib.quiz", "lablib.course")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, top_level_only: bool) -> set[str]:
    """Modules ``name`` imports (absolute names), at import time only or anywhere in the file."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def _graph(top_level_only: bool) -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        graph[name] = {m for m in _imports(name, path, top_level_only)
                       if m in mods and m != name and not m.startswith(name + ".") and not name.startswith(m + ".")}
    return graph


def test_no_import_circles_even_through_imports_inside_functions():
    graph, circles, state = _graph(top_level_only=False), [], {}

    def visit(m, stack):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                circles.append(" -> ".join(stack[stack.index(n):] + [n]))
            elif n not in state:
                visit(n, stack)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not circles, circles


def test_rank_side_modules_never_import_the_notebook_side():
    mods = _modules()
    for root in RANK_SIDE:
        seen, todo = set(), [root]
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            for dep in _imports(m, mods[m], top_level_only=True):
                assert not dep.startswith(NOTEBOOK_SIDE), f"{root} imports {dep} (through {m}) at import time"
                if dep in mods:
                    todo.append(dep)
    # and for real, in a fresh process: what a rank has loaded after importing all of them
    code = (f"import sys, time; t = time.perf_counter(); import {', '.join(RANK_SIDE)}; "
            "print(time.perf_counter() - t); print(*sorted(m for m in sys.modules if m.split('.')[0] in "
            "('plotly', 'ipywidgets', 'IPython') or m.startswith(('lablib.views', 'lablib.quiz', 'lablib.course'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[1:] in ([], [""]), out.stdout


def test_every_lab_is_its_five_files_and_every_source_is_registered():
    for lab in LABS:
        assert (ROOT / "sources" / f"{lab.notebook}.ipynb").exists(), lab
        assert (ROOT / "labs" / f"{lab.notebook}.ipynb").exists(), f"{lab}: run `lablib release`"
        assert (PACKAGE / "checks" / f"{lab.checks}.py").exists(), lab
        assert (PACKAGE / "answers" / f"{lab.checks}.py").exists(), lab
        assert (ROOT / "tests" / f"test_{lab.checks}.py").exists(), lab
        for strategy in lab.strategies:
            assert (PACKAGE / "strategies" / f"{strategy}.py").exists(), (lab, strategy)
    assert sorted(p.stem for p in (ROOT / "sources").glob("*.ipynb")) == [lab.notebook for lab in LABS]


def test_nothing_but_the_answers_imports_them_when_imported():
    """lablib.answers is imported by no module at its top level but the answers themselves: a judge, a view or
    a measurement imports them when it runs (the grading box, which has none, imports the rest)."""
    for name, path in _modules().items():
        if name.startswith("lablib.answers"):
            continue
        tree = ast.parse(path.read_text())
        for node in tree.body:  # top-level statements only: imports inside functions run when called
            found = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [f"{node.module}"] + [a.name for a in node.names] if isinstance(node, ast.ImportFrom) and node.module else []
            assert not any("answers" in n for n in found), f"{name} imports lablib's answers at its top level"


def test_no_file_in_lablib_is_over_400_lines():
    """Small files: a module that grows past 400 lines is split where its code has seams."""
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"split these where their code has seams: {long}"
