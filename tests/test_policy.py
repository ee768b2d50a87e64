"""The exercise rules (lablib/rules/policy.py) and how grading applies them (course/exercises.py): what a
learner may write passes, what reaches for the answers is refused with the reason. No processes here."""
import ast

import pytest
import torch

from lablib.checks.lab02 import check_ring_blocking
from lablib.rules.policy import COLLECTIVES, function_problems, problems, reachable_problems
from lablib.course.exercises import Call, exercise_code, refusal


def _problems(source, forbidden=None):
    return problems(ast.parse(source), forbidden)


@pytest.mark.parametrize("source", [
    "def f(x):\n    import torch.nn.functional as F\n    return F.relu(x) + math.pi + torch.ones(1)",
    "def f(unit, ctx):\n    unit.grad /= ctx.world_size\n    lablib.all_reduce(unit.grad)\n    unit.flat = unit.grad",
    "def f(out, inp):\n    for h in [lablib.isend(inp, 1), lablib.irecv(out, 0)]:\n        h.wait()",
    "def f(x):\n    return sorted(range(len(x)), key=lambda i: -i)",
    "def f(flat):\n    out = torch.zeros(4)\n    out[:2] = flat[:2]\n    return out",
])
def test_what_a_learner_writes_passes(source):
    assert _problems(source) == []
    assert _problems("def f(out, inp):\n    lablib.isend(inp, 1).wait()\n    lablib.recv(out, 0)", COLLECTIVES) == []


@pytest.mark.parametrize("source, found", [
    ("def f(x):\n    return getattr(dist, 'all_' + 'reduce')(x)", "uses getattr"),
    ("def f(x):\n    import os\n    return x", "imports os"),
    ("def f(x):\n    from lablib.strategies import ring\n    return x", "imports from lablib.strategies"),
    ("def f(x):\n    return lablib.strategies.ring.ring_all_gather(x, x)", "uses lablib.strategies"),
    ("def f(x):\n    return x.__class__", "private attribute .__class__"),
    ("def f(x):\n    torch.allclose = lambda *a: True", "changes torch.allclose"),
    ("def f(x):\n    dist.all_gather_into_tensor(x, x)", "uses dist.all_gather_into_tensor: build it from"),
    ("def f(x):\n    torch.save(x, 'x.pt')", "uses torch.save"),
    ("def f(x):\n    return open('x').read()", "uses open"),
    ("def f(x):\n    return zero.zero1_step", "uses zero, which is neither yours"),
    ("def f(u, c):\n    torch.sys.modules['lablib.strategies.zero'].zero1_step(u, c)", "uses .sys"),
    ("import operator\ndef f(x):\n    return operator.attrgetter('Flat' + 'Layout')", "imports operator"),
    ("import lablib as L\ndef f(u, c):\n    L.strategies.zero.zero1_step(u, c)", "uses lablib.strategies"),
    ("def f(o, i):\n    L = lablib\n    L.strategies.ring.ring_all_gather(o, i)", "uses lablib.strategies"),
    ("def f(o, i):\n    dist.group.WORLD.allgather([list(o.chunk(2))], [i]).wait()", "uses .group"),
    ("def f(o, i):\n    dist.all_gather_coalesced([o], [i])", "uses dist.all_gather_coalesced: build it"),
    ("import torch.distributed as D\ndef f(o, i):\n    D.send(i, 1)", "uses dist.send: build it"),
])
def test_what_reaches_for_the_answers_is_named(source, found):
    assert any(found in p for p in _problems(source, COLLECTIVES)), _problems(source, COLLECTIVES)


def _nb(*sources, tag=0):
    cells = [{"cell_type": "code", "source": s, "metadata": {}} for s in sources]
    cells[tag]["metadata"]["lablib"] = {"exercise": ["Task 2.1"]}
    return {"cells": cells}


def test_grading_keeps_definitions_and_the_learners_own_names():
    nb = _nb("import math as m\nCHUNK = 4\nprint('testing my ring')\nx = lablib.cluster(2).run(print)\n"
             "def ring_all_gather_blocking(output, input):\n    return helper(output) * CHUNK * m.pi",
             "def helper(t):\n    return t", "cluster = lablib.cluster(2)\nresults = cluster.run(print)")
    ex = exercise_code(nb)
    assert set(ex.functions) == {"ring_all_gather_blocking", "helper"}
    assert [n.split(": left out: ")[1][:30] for n in ex.notes] == ["it runs code when defined (onl"] * 2
    assert "print(" not in ex.cells[0]["source"] and ex.cells[0]["source"].count("\n") == 5  # lines kept
    assert len(ex.cells) == 2  # the third cell runs code: not exercise code
    call = Call("check-2.1#0", "check-2.1", "lab02", "check_ring_blocking", ("ring_all_gather_blocking",), 2, None,
                False)
    assert refusal(call, ex) == ""


def test_a_helper_that_breaks_the_rules_refuses_the_check_that_reaches_it():
    ex = exercise_code(_nb("def ring_all_gather_blocking(output, input):\n    helper(output, input)",
                           "def helper(output, input):\n    lablib.isend(input, 1).wait()"))
    call = Call("check-2.1#0", "check-2.1", "lab02", "check_ring_blocking", ("ring_all_gather_blocking",), 2, None,
                False)
    assert "helper line 2: uses lablib.isend: Task 2.1 asks for blocking" in refusal(call, ex)


def test_the_notebook_applies_the_same_rules_to_a_function_it_is_given():
    namespace = {}
    exec(compile("import lablib\ndef ring(output, input):\n    lablib.all_gather(output, input)\n", "<cell>", "exec"),
         namespace)
    assert "has no source lablib can read" in function_problems(namespace["ring"], check_ring_blocking.forbidden)[0]
    assert "has no source lablib can read" in function_problems(lambda o, i: None)[0]

    def ring(output, input):
        lablib.all_gather(output, input)  # noqa: F821

    assert any("uses lablib.all_gather" in p for p in function_problems(ring, check_ring_blocking.forbidden))


def test_what_runs_in_the_box_is_exactly_what_was_read():
    """A dropped statement on the line where a string starts must not turn the string into code."""
    evil = ('def zero1_step(unit, ctx):\n    pass\nprint(1); s = """\ndef zero1_step(unit, ctx):\n'
            '    torch.sys.modules["lablib.strategies.zero"].zero1_step(unit, ctx)\n#"""')
    ex = exercise_code(_nb(evil))
    ran = ast.parse(ex.cells[0]["source"])
    assert [type(n).__name__ for n in ran.body] == ["FunctionDef", "Assign"]
    assert ast.dump(ran.body[0].body[0]) == ast.dump(ast.Pass())


@pytest.mark.parametrize("cell", [
    "class P:\n    m = torch.sys.modules['importlib']\n    def go(self):\n        pass",
    "class P(object.__class__('X', (), {})):\n    pass",
    "def f(x, y=print('runs when defined')):\n    return x",
    "@print\ndef f(x):\n    return x",
])
def test_definitions_that_run_code_when_made_are_left_out(cell):
    ex = exercise_code(_nb(cell))
    assert ex.notes and not ex.cells[0]["source"].strip()


def test_the_task_rules_follow_every_name_the_function_reaches():
    table = ("def helper(output, input):\n    dist.all_gather_into_tensor(output, input)\n"
             "TABLE = {'go': helper}\nclass H:\n    def go(output, input):\n        lablib.isend(input, 1).wait()\n"
             "def ring_all_gather_blocking(output, input):\n    TABLE['go'](output, input)\n    H.go(output, input)")
    call = Call("check-2.1#0", "check-2.1", "lab02", "check_ring_blocking", ("ring_all_gather_blocking",), 2, None,
                False)
    why = refusal(call, exercise_code(_nb(table)))
    assert "uses dist.all_gather_into_tensor" in why or "uses lablib.isend" in why, why


@pytest.mark.parametrize("source", [
    "def f(t):\n    dist.all_gather_into_tensor(t, t)",
    "def f(t):\n    torch.distributed.all_gather_into_tensor(t, t)",
    "def f(t):\n    d = torch.distributed\n    d.all_gather_into_tensor(t, t)",
    "def f(t):\n    import torch.distributed as d\n    d.all_gather_into_tensor(t, t)",
])
def test_a_rule_on_dist_holds_however_torch_distributed_is_spelled(source):
    rule = {"dist.all_gather_into_tensor": "use lablib.all_gather"}
    assert any("use lablib.all_gather" in p for p in problems(ast.parse(source), rule)), source


@pytest.mark.parametrize("source, found", [
    ("def f(u, lib=lablib):\n    lib.strategies.prefetch.pre_forward(u, 0, None)", "uses the module lablib as a value"),
    ("def f(u):\n    for d in [dist]:\n        d.all_gather_into_tensor(u, u)", "uses the module dist as a value"),
    ("def f(u):\n    (m := lablib).all_gather(u, u)", "uses an assignment expression (:=)"),
    ("def f(u):\n    torch.serialization.pickle.loads(b'')", "reaches the module pickle"),
    ("def f(u):\n    from typing import get_type_hints", "exercise code may import only"),
    ("def f(u):\n    return type(u)", "uses type"),
    ("def f(u):\n    F.torch.save(u, 'x')", "reaches torch.save through torch.nn.functional.torch.save"),
    ("def f(u):\n    g = F\n    g.torch.load('x')", "reaches torch.load through"),
])
def test_modules_stay_where_the_rules_can_see_them(source, found):
    """A module passed as a value, or left through an attribute chain, would carry the answers past the
    rules: both are refused."""
    assert any(found in p for p in problems(ast.parse(source), {})), (source, problems(ast.parse(source), {}))


@pytest.mark.parametrize("source, found", [
    # functools' attribute copier hands a library function's globals (and real builtins) to the learner's
    ("import functools\ndef box():\n    pass\ndef f():\n    functools.update_wrapper(box, lablib.cluster)", ".update_wrapper"),
    ("import functools\ndef f(g):\n    return functools.wraps(lablib.cluster)(g)", ".wraps"),
    # a name bound anywhere no longer makes every use of it the learner's own
    ("def f():\n    def names(__import__):\n        pass\n    return __import__('lablib.strategies.pipeline')",
     "binds the name __import__"),
    ("def f(getattr=None):\n    return getattr", "binds the name getattr"),
    ("def f():\n    open = 1\n    return open", "binds the name open"),
])
def test_ways_to_the_real_builtins_are_refused(source, found):
    from lablib.rules.policy import problems

    assert any(found in p for p in problems(ast.parse(source), {})), problems(ast.parse(source), {})


def test_harmless_builtin_names_may_be_parameters():
    from lablib.rules.policy import problems

    assert problems(ast.parse("def ring(output, input, bytes=0, id=None):\n    return input"), {}) == []


def test_the_boxs_import_guard_lets_through_only_the_listed_modules_and_torchs_own_storage():
    from lablib.rules.namespace import namespace

    ns = namespace()
    guard = ns["__builtins__"]["__import__"]
    assert guard("torch.storage") is not None and guard("math") is not None
    for name in ("torch.serialization", "pickle", "lablib.strategies.pipeline"):
        with pytest.raises(ImportError, match="may import only"):
            guard(name)


@pytest.mark.parametrize("source, construct", [
    ("def f(x):\n    match x:\n        case object(__globals__=g):\n            return g", "a match statement"),
    ("def f(x):\n    try:\n        while True:\n            pass\n    except BaseException:\n        pass",
     "try/except"),  # would swallow the KeyboardInterrupt that ends a check at its time limit
    ("def f(x):\n    global torch\n    return x", "global"),
    ("def f(x):\n    yield x", "yield (a generator)"),
    ("async def f(x):\n    return x", "async def"),
    ("def f(x):\n    return (y := x)", "an assignment expression (:=)"),
])
def test_constructs_outside_the_allow_list_are_refused_by_name(source, construct):
    assert problems(ast.parse(source)) == [
        f"line {1 if construct == 'async def' else 2}: uses {construct}, which exercise code may not be written "
        "with (the exercises need only functions, classes, loops, if, with, comprehensions and lambdas)"]


SDPA_ALIAS = torch.nn.functional.scaled_dot_product_attention  # a library function under a name of the notebook's


def test_an_alias_of_a_library_function_is_refused_in_the_notebook_as_in_grading():
    def attention(q):
        return SDPA_ALIAS(q, q, q)

    def mine(q):
        return helper(q) * 2

    assert any("uses SDPA_ALIAS, which is neither yours" in p for p in reachable_problems(attention))
    assert reachable_problems(mine) == []  # a function of the notebook's own stays the learner's


def helper(q):
    return q
