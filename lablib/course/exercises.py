"""What of a notebook is graded: the learner's exercise code, and the check calls of the instructor's copy.

- Exercise code: the cells ``lablib release`` tagged as exercises (``{"lablib": {"exercise": [...]}}``)
  and any other code cell that only defines functions. Only definitions are kept (``def``, ``class``,
  imports, assignments without calls): a learner's test lines at the top level of a cell do not run
  when grading. Each function a check takes is read against policy.py before anything runs.
- Check calls: each graded cell of the release (and, with the source, its hidden checks) is read as
  calls like ``check_zero1(zero1_step, cluster)``; ``cluster`` means the check's own world sizes.
  Every call gets inputs drawn from a seed of its own, derived from the grading run's 128-bit secret
  (visible calls too: the notebook's own weights are known, so code could replay them instead of computing;
  and a seed of 62 bits that nothing in the box holds cannot be found by trying seeds until a rank's own
  data comes out).
"""
from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import io
from dataclasses import dataclass, field

from ..checks import Check
from ..rules.policy import GLOBALS, SAFE_BUILTINS, module_aliases, problems, top_names
from ..toy import draws
from .notebook import BEGIN_HIDDEN, END_HIDDEN, grade_info


MAX_CELL = 64 << 10  # characters of one graded cell: every exercise fits in a few KB


@dataclass(frozen=True)
class Call:
    id: str              # "check-1.3#0"
    grade_id: str
    module: str          # the checks module, e.g. "lab01"
    check: str           # its attribute, e.g. "check_zero1"
    params: tuple        # the learner's function names the call passes
    world_size: int | None
    seed: int | None
    hidden: bool

    def spec(self) -> Check:
        return getattr(importlib.import_module(f"lablib.checks.{self.module}"), self.check)

    def given(self) -> str | None:
        """The check's given data for this call (``Check.given``), encoded for the box; None without."""
        with draws():
            return _given(self.module, self.check, self.world_size, self.seed)

    def judge(self, data) -> str:
        """The check's judge on the data this call's ranks returned: one judge at a time in the grader's
        threads, as a judge may build layers from torch's global generator (``toy.draws``)."""
        with draws():
            return self.spec().judge(data, self.world_size, self.seed)


@functools.lru_cache(maxsize=256)  # the same calls for every learner of a grading run
def _given(module: str, check: str, world_size, seed) -> str | None:
    from .plain import dumps

    spec = getattr(importlib.import_module(f"lablib.checks.{module}"), check)
    inputs = spec.inputs(world_size, seed)
    return dumps(inputs[0]) if inputs else None


@dataclass
class Exercise:
    cells: list = field(default_factory=list)      # [{"name", "source"}] for the runner
    functions: dict = field(default_factory=dict)  # name -> ast.FunctionDef (the last definition)
    refused: dict = field(default_factory=dict)    # name -> why its definition was left out
    names: set = field(default_factory=set)        # every name the kept code binds at the top level
    nodes: dict = field(default_factory=dict)      # name -> the kept top-level statement that binds it
    notes: list = field(default_factory=list)      # what was left out, and why


def _parse(source: str):
    try:
        return ast.parse(source)
    except (SyntaxError, ValueError):
        return None


def _calls(*nodes) -> bool:
    return any(isinstance(n, ast.Call) for node in nodes if node is not None for n in ast.walk(node))


def _keep(node) -> bool:
    """Whether a top-level statement is a definition that runs no code of the learner's when executed:
    no decorators, and no calls in default values, annotations, base classes or class bodies."""
    if isinstance(node, (ast.Import, ast.ImportFrom, ast.Pass)):
        return True
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
        return True  # a docstring or a bare constant
    if isinstance(node, ast.FunctionDef):  # a decorator is a call, whatever it looks like; but a Function's
        a = node.args                        # forward and backward are @staticmethod, which runs no code of theirs
        plain = all(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)
        return plain and not _calls(*a.defaults, *a.kw_defaults, node.returns,
                                                      *(x.annotation for x in a.posonlyargs + a.args + a.kwonlyargs))
    if isinstance(node, ast.ClassDef):
        return (not node.decorator_list and not _calls(*node.bases, *node.keywords)
                and all(_keep(n) for n in node.body))
    return isinstance(node, (ast.Assign, ast.AnnAssign)) and not _calls(node)


def _text(nodes: list, source: str) -> str:
    """Source text of exactly ``nodes``, each at its own line where it can be (so errors name the
    learner's lines); checked to parse back to the same statements, else regenerated from them. Linear
    in the cell's size (``ast.get_source_segment`` splits the whole source at every call)."""
    raw = [line.encode() for line in io.StringIO(source, newline="").readlines()]  # as ast counts lines
    lines: list[str] = []
    for node in nodes:
        first, last = node.lineno - 1, node.end_lineno - 1
        head = raw[first][:node.col_offset]
        body = (raw[first][node.col_offset:node.end_col_offset] if first == last else
                raw[first][node.col_offset:] + b"".join(raw[first + 1:last]) + raw[last][:node.end_col_offset])
        segment = " " * len(head.decode(errors="replace")) + body.decode(errors="replace")
        lines += [""] * max(0, node.lineno - 1 - len(lines))
        lines += segment.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    text = "\n".join(lines)
    want = ast.dump(ast.Module(body=nodes, type_ignores=[]), annotate_fields=False)
    got = _parse(text)
    if got is None or ast.dump(got, annotate_fields=False) != want:
        text = ast.unparse(ast.Module(body=nodes, type_ignores=[]))
    return text


def exercise_code(nb) -> Exercise:
    """The graded code of a (validated) submission."""
    ex, included = Exercise(), []
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        info = cell["metadata"].get("lablib")
        tagged = isinstance(info, dict) and bool(info.get("exercise"))
        tree = _parse(cell["source"])
        defines = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))] if tree else []
        if not (tagged or (defines and all(_keep(n) for n in tree.body))):
            continue
        if len(cell["source"]) > MAX_CELL:  # the rules' reading grows with a cell's size: none is read past this
            ex.notes.append(f"invalid: cell {index} is too large to grade ({len(cell['source']) >> 10} KB; at most "
                            f"{MAX_CELL >> 10} KB): keep your exercise code in cells of its own")
            continue
        included.append((index, cell, tree))
    defined = {name for _, _, tree in included if tree for node in tree.body if _keep(node)
               for name in top_names(node)}
    outer = module_aliases(node for _, _, tree in included if tree for node in tree.body if _keep(node))
    for index, cell, tree in included:
        if tree is None:  # runs as it is, so the learner sees its SyntaxError in the report
            ex.cells.append({"name": f"cell {index}", "source": cell["source"]})
            continue
        kept = []
        for node in tree.body:
            dropped = not _keep(node)
            found = [] if dropped else problems(node, {}, defined, outer)
            if dropped or found:
                why = ("it runs code when defined (only definitions run when grading)" if dropped
                       else "; ".join(found))
                ex.notes.append(f"cell {index}, line {node.lineno}: left out: {why}")
                if isinstance(node, ast.FunctionDef):
                    ex.refused[node.name] = why
                    ex.functions.pop(node.name, None)
                continue
            kept.append(node)
            for name in top_names(node):
                ex.names.add(name)
                ex.nodes[name] = node
            if isinstance(node, ast.FunctionDef):
                ex.functions[node.name] = node
                ex.refused.pop(node.name, None)
        ex.cells.append({"name": f"cell {index}", "source": _text(kept, cell["source"])})
    return ex


def _reachable(fn: ast.FunctionDef, nodes: dict) -> list:
    """``fn`` and every top-level statement of the learner's it reaches by name, directly or through
    others (a helper, a table of functions, a class)."""
    seen, todo = {}, [fn]
    while todo:
        node = todo.pop()
        if id(node) not in seen:
            seen[id(node)] = node
            todo += [nodes[n.id] for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in nodes]
    return list(seen.values())


def refusal(call: Call, ex: Exercise) -> str:
    """Why ``call`` scores 0 before it runs ("" when it may run): a function not defined, or code it
    reaches that breaks the rules (policy.py), the task's own included."""
    spec = call.spec()
    outer = module_aliases(ex.nodes.values())
    for name in call.params:
        if name in ex.refused:
            return f"{spec.task}: {name} {ex.refused[name]}."
        if name not in ex.functions:
            return f"{spec.task}: your exercise code has no `def {name}(...)`, so there is nothing to check."
        for node in _reachable(ex.functions[name], ex.nodes):
            found = problems(node, spec.forbidden, ex.names, outer)
            if found:
                what = getattr(node, "name", None) or f"the statement at line {node.lineno}"
                return f"{spec.task}: {what} " + "; ".join(found) + "."
    return ""


def normalised(fn: ast.FunctionDef) -> str:
    """``fn``'s code with its docstring dropped and its own names numbered: equal for copies that only
    renamed things."""
    fn = ast.parse(ast.unparse(fn)).body[0]
    if fn.body and isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant):
        fn.body = fn.body[1:] or [ast.Pass()]
    names: dict[str, str] = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.arg):
            node.arg = names.setdefault(node.arg, f"v{len(names)}")
        elif isinstance(node, ast.Name) and node.id not in GLOBALS and node.id not in SAFE_BUILTINS:
            node.id = names.setdefault(node.id, f"v{len(names)}")
    fn.name = "f"
    return ast.dump(fn, annotate_fields=False)


def solutions(nb) -> dict[str, ast.FunctionDef | ast.ClassDef]:
    """The functions and classes a source notebook's exercise cells define (its solutions)."""
    out = {}
    for cell in nb["cells"]:
        if cell.get("cell_type") == "code" and "### BEGIN SOLUTION" in cell["source"]:
            tree = _parse("\n".join(line for line in cell["source"].split("\n")
                                    if "### BEGIN SOLUTION" not in line and "### END SOLUTION" not in line))
            out.update({n.name: n for n in (tree.body if tree else []) if isinstance(n, (ast.FunctionDef, ast.ClassDef))})
    return out


def _comments(source: str) -> list[str]:
    import tokenize

    out = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                out.append(tok.string)
    except (tokenize.TokenError, SyntaxError):
        pass
    return out


def _needs(node) -> tuple[set[str], int, int]:
    """What a solution's body takes knowing: the functions, methods and attributes it reads (not its own
    parameters and locals, the exercise namespace's modules or Python's builtins); its statements and nodes."""
    body = [s for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.ClassDef)) for s in n.body
            if not isinstance(s, (ast.FunctionDef, ast.ClassDef)) and not (isinstance(s, ast.Expr) and isinstance(
                s.value, ast.Constant))]
    inner = [n for s in body for n in ast.walk(s)]
    own = {n.arg for n in ast.walk(node) if isinstance(n, ast.arg)}
    own |= {n.id for n in inner if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    own |= {n.attr for n in inner if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)}
    used = {n.id for n in inner if isinstance(n, ast.Name)} | {n.attr for n in inner if isinstance(n, ast.Attribute)}
    statements = sum(isinstance(n, ast.stmt) for n in inner)
    return used - own - GLOBALS - SAFE_BUILTINS, statements, sum(not isinstance(n, ast.expr_context) for n in inner)


def dictated(nb) -> set[str]:
    """The solutions of a source notebook that an honest learner's code may equal, since the stub dictates them
    (not flagged as copies): a body of one simple statement of a dozen nodes at most, or of at most 3 statements
    every name of which (beyond its own parameters and locals, the notebook's modules, builtins) is in the stub's
    text: its BEGIN SOLUTION comment, comments and docstrings, or the markdown just before the exercise cell. A
    solution of substance (a loop, more statements, a method the text never names) is flagged when copied."""
    import re

    out, prose = set(), []
    for cell in nb["cells"]:
        source = cell.get("source", "")
        if cell.get("cell_type") == "markdown":
            prose.append(source)
            continue
        tree = _parse(source) if "### BEGIN SOLUTION" in source else None
        lines = source.split("\n")
        for node in tree.body if tree else ():
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                continue
            segment = "\n".join(lines[node.lineno - 1:node.end_lineno])
            text = " ".join(_comments(segment) + prose + [ast.get_docstring(n) or "" for n in ast.walk(node)
                                                          if isinstance(n, (ast.FunctionDef, ast.ClassDef))])
            needs, statements, size = _needs(node)
            trivial = isinstance(node, ast.FunctionDef) and statements == 1 and size <= 12  # a loop has 2 or more
            if trivial or (statements <= 3 and needs <= set(re.findall(r"[A-Za-z_]\w*", text))):
                out.add(node.name)
        prose = []
    return out


def check_modules(nb) -> dict[str, str]:
    """{name: checks module} from the ``from lablib.checks.labNN import ...`` lines of a trusted notebook."""
    out = {}
    for cell in nb["cells"]:
        tree = _parse(cell["source"]) if cell.get("cell_type") == "code" else None
        for node in ast.walk(tree) if tree else ():
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lablib.checks."):
                for alias in node.names:
                    out[alias.asname or alias.name] = node.module.split(".")[-1]
    return out


def _hidden_text(source: str) -> str:
    lines, out, inside = source.split("\n"), [], False
    for line in lines:
        if BEGIN_HIDDEN.match(line):
            inside = True
        elif END_HIDDEN.match(line):
            inside = False
        elif inside:
            out.append(line)
    return "\n".join(out)


def _literal(node):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


def call_seed(secret: bytes, call_id: str) -> int:
    """The seed of one check call's inputs: 62 bits of a keyed hash of its id under the run's secret (62, so
    that the checks' own offsets, ``11 + seed``, stay within a torch generator's 64)."""
    digest = hashlib.blake2b(call_id.encode(), key=secret, digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2


def check_calls(release_nb, source_nb=None,
                secret: bytes = bytes(16)) -> tuple[dict[str, list[Call]], dict[str, float]]:
    """({grade_id: [Call, ...]}, {grade_id: points}) from a trusted release (and its source's hidden
    checks). Raises ValueError when a graded cell holds no check call it can read."""
    from .release import _strip_regions

    modules = check_modules(release_nb)
    hidden_src = {}
    if source_nb is not None:
        hidden_src = {grade_info(c)["grade_id"]: _hidden_text(c["source"]) for c in source_nb["cells"] if grade_info(c)}
    calls, points = {}, {}
    for cell in release_nb["cells"]:
        info = grade_info(cell)
        if not info:
            continue
        gid = info["grade_id"]
        points[gid] = float(info["points"])
        visible, _ = _strip_regions(cell["source"], gid, keep_hidden=False)
        out = []
        for text, hidden in ((visible, False), (hidden_src.get(gid, ""), True)):
            for node in (_parse(text) or ast.Module(body=[])).body:
                if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                        and isinstance(node.value.func, ast.Name) and node.value.func.id in modules):
                    continue
                name, module = node.value.func.id, modules[node.value.func.id]
                spec = getattr(importlib.import_module(f"lablib.checks.{module}"), name, None)
                if not isinstance(spec, Check):
                    continue
                args = [a.id for a in node.value.args if isinstance(a, ast.Name)]
                if args and args[-1] == "cluster":
                    args = args[:-1]
                keywords = {k.arg: _literal(k.value) for k in node.value.keywords}
                for size in spec.sizes(None, keywords.get("world_size")):
                    cid = f"{gid}#{len(out)}"  # every call, visible ones too: weights no code can replay
                    out.append(Call(cid, gid, module, name, tuple(args), size, call_seed(secret, cid), hidden))
        if not out:
            raise ValueError(f"graded cell {gid} holds no check call lablib can read (like check_x(fn, cluster))")
        calls[gid] = out
    return calls, points
