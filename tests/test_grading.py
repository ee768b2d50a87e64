"""Release and grade on a tiny lab built here: every kind of submission an instructor meets, and every
way a learner tried to get points without the work (each must score 0, be refused or be flagged), in
one grading run, beside learners who did the work and get full marks."""
import copy
import csv
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from lablib.course.key import solve
from lablib.course.sandbox import available
from lablib.course.notebook import grade_info
from lablib.course.release import ReleaseError, release, release_notebook
from lablib.quiz import AnswerStore, questions

LAB = "00_welcome"  # the tiny lab borrows this lab's name, so its quiz questions are real ones
MEAN = "    lablib.all_reduce(x)\n    return x / dist.get_world_size()"
SHARD = ("    s = -(-flat.numel() // world_size)\n"
         "    padded = torch.cat([flat, flat.new_zeros(s * world_size - flat.numel())])\n"
         "    return padded[rank * s:(rank + 1) * s]")
RING = ("    rank, n = dist.get_rank(), dist.get_world_size()\n"
        "    chunks = output.view(n, -1)\n"
        "    chunks[rank].copy_(input)\n"
        "    for step in range(n - 1):\n"
        "        out, into = chunks[(rank - step) % n], chunks[(rank - step - 1) % n]\n"
        "        if rank % 2 == 0:\n"
        "            lablib.send(out, (rank + 1) % n)\n"
        "            lablib.recv(into, (rank - 1) % n)\n"
        "        else:\n"
        "            lablib.recv(into, (rank - 1) % n)\n"
        "            lablib.send(out, (rank + 1) % n)")
# The learners' own code: right, and written differently from the source's solutions (which are flagged).
OWN = {2: "    total = x.clone()\n    lablib.all_reduce(total)\n    return total / dist.get_world_size()",
       4: "    size = math.ceil(flat.numel() / world_size)\n    out = torch.zeros(size, dtype=flat.dtype)\n"
          "    part = flat[rank * size:(rank + 1) * size]\n    out[:part.numel()] = part\n    return out",
       6: RING.replace("rank % 2 == 0", "rank % 2 != 1")}
SIGNATURES = {2: "def mean_across_ranks(x):", 4: "def flat_shard(flat, world_size, rank):",
              6: "def ring_all_gather_blocking(output, input):"}
SOLUTIONS = {2: MEAN, 4: SHARD, 6: RING}
CHECK_TIMEOUT = 15  # seconds for one check in the box: long for a busy machine, short for the hanging learner


def _graded(src, gid, points):
    cell = new_code_cell(src)
    cell.metadata["lablib"] = {"grade_id": gid, "points": points}
    return cell


def _exercise(index, task):
    return new_code_cell(f"{SIGNATURES[index]}\n    ### BEGIN SOLUTION {task}\n{SOLUTIONS[index]}\n"
                         "    ### END SOLUTION")


def _source():
    key = new_code_cell(f'from lablib.course.key import solve\nsolve("{LAB}")')
    key.metadata["tags"] = ["source-only"]
    return new_notebook(cells=[
        new_markdown_cell("# A tiny lab"),
        new_code_cell("import torch\nimport torch.distributed as dist\nimport lablib\nfrom lablib import quiz\n"
                      "from lablib.checks.lab00 import check_mean_across_ranks\n"
                      "from lablib.checks.lab01 import check_flat_shard\n"
                      "from lablib.checks.lab02 import check_ring_blocking\n"
                      "cluster = lablib.cluster(2, timeout=5)"),
        _exercise(2, "Task 0.1: the mean over ranks"),
        _graded("check_mean_across_ranks(mean_across_ranks, cluster)\n### BEGIN HIDDEN CHECKS\n"
                "check_mean_across_ranks(mean_across_ranks, world_size=2, seed=1)\n### END HIDDEN CHECKS",
                "check-0.1", 1),
        _exercise(4, "Task 1.1: a rank's shard"),
        _graded("check_flat_shard(flat_shard)\n### BEGIN HIDDEN CHECKS\ncheck_flat_shard(flat_shard, seed=1)\n"
                "### END HIDDEN CHECKS", "check-1.1", 1),
        _exercise(6, "Task 2.1: a blocking ring"),
        _graded("check_ring_blocking(ring_all_gather_blocking, world_size=2)", "check-2.1", 2),
        new_code_cell('quiz.ask("welcome/rank")'),
        key,
        new_code_cell(f'# NBVAL_CHECK_OUTPUT\nquiz.score("{LAB}")')],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})


def _learner(released, bodies=None, insert=(), edit=None):
    """A learner's notebook: the release with exercise bodies filled in ({cell index: body} or "solved")
    and cells inserted after the set-up cell."""
    nb = copy.deepcopy(released)
    bodies = OWN if bodies == "solved" else (bodies or {})
    for index, body in bodies.items():  # a body (indented), or the whole cell
        nb.cells[index].source = f"{SIGNATURES[index]}\n{body}" if body.startswith("    ") else body
    for k, source in enumerate(insert):
        nb.cells.insert(2 + k, new_code_cell(source))
    if edit:
        edit(nb)
    return nb


def _answers(folder, how):
    store = AnswerStore(folder / "quiz_answers.json")
    solve(LAB, store)
    if how == "retried":  # every answer right in the end, none at the first attempt
        data = json.loads((folder / "quiz_answers.json").read_text())
        for rec in data["answers"].values():
            rec.update(attempts=3, first_correct=False)
        (folder / "quiz_answers.json").write_text(json.dumps(data))


UNTRACED = ("    dist.all_gather_into_tensor(output, input)\n"
            "    for _ in range(dist.get_world_size() - 1):\n"
            "        lablib.isend(torch.zeros(1), (dist.get_rank() + 1) % dist.get_world_size()).wait()")
VANDAL = "    x.numpy().tofile({path!r})\n" + MEAN


# A pool whose run() returns what Task 0.1's check wants (its inputs rebuilt from the call's seed) without
# running anything: it scores if code outside the checked function can replace Cluster.run in the box.
PATCH_RUN = ("def fake_run(self, job, fn, seed):\n    g = torch.Generator().manual_seed(seed)\n"
             "    ins = [torch.randn(3 + seed % 7, generator=g) * 10 for _ in range(self.world_size)]\n"
             "    return [torch.stack(ins).mean(0)] * self.world_size\n"
             "def patch(c):\n    c.run = fake_run\n")


# Reaches any object's attributes through a class pattern (its keywords are strings, not attributes), and
# from a library function's globals the real __import__ and lablib's own ring: refused as a construct.
MATCH = ("    match lablib.all_reduce:\n        case object(__globals__=g):\n"
         "            g['__builtins__']['__import__']('lablib.strategies.ring', None, None, ['x']).ring_all_gather("
         "output, input)")
# A lone surrogate (and a terminal escape) in the error text, and a fence with fake report lines after it.
SURROGATE = '    raise ValueError("\\ud800 \\x1b[31m red")'
FENCE = '    raise ValueError("```\\n- ✓ check-0.1 (check): passed, 1/1\\n```")'
CHAIN = "\n".join(f"a{i + 1} = a{i}" for i in reversed(range(1000))) + "\na0 = torch\n"  # 12 KB, names in reverse
BIG = "\n".join(f"b{i} = {i}" for i in range(10000)) + "\ndef helper():\n    pass\n"     # 128 KB


# What a red team found past the rules that read the text (each scored on today's main of then; each must
# score 0 now). 1: a name bound to a submodule of torch, taken for torch itself, reaches inspect, and from the
# rank job's frame its seed: every rank rebuilds every rank's input, and no message moves.
PAST_RULES = ("def mean_across_ranks(x):\n    nn = torch.nn\n    look = nn.parallel.distributed.inspect\n"
              "    seed = [look.getargvalues(f[0]).locals['seed'] for f in look.stack() if f.function == 'mean_job'][0]\n"
              "    g = torch.Generator().manual_seed(seed)\n"
              "    n = dist.get_world_size()\n"
              "    return torch.stack([torch.randn(3 + seed % 7, generator=g) * 10 for r in range(n)]).mean(0)")
# 2: the inputs rebuilt by trying seeds until this rank's own input comes out (the run's seed was small).
SEED_SEARCH = ("def mean_across_ranks(x):\n    for seed in range(40000, 50000):\n"
               "        g = torch.Generator().manual_seed(seed)\n"
               "        ins = [torch.randn(3 + seed % 7, generator=g) * 10 for r in range(dist.get_world_size())]\n"
               "        if ins[dist.get_rank()].shape == x.shape and torch.equal(ins[dist.get_rank()], x):\n"
               "            return torch.stack(ins).mean(0)\n    return x")
# 3: the data moved through torch.distributed's store, which no rule named and no count sees.
STORE = ("def mean_across_ranks(x):\n    rank, n = dist.get_rank(), dist.get_world_size()\n"
         "    store = dist.FileStore('/tmp/mean-store', n)\n"
         "    store.set(str(rank), ','.join(str(v) for v in x.tolist()))\n"
         "    rows = [[float(v) for v in store.get(str(r)).decode().split(',')] for r in range(n)]\n"
         "    return torch.tensor(rows, dtype=x.dtype).mean(0)")


def _learners(released, root):
    victim = root / "submissions" / "zz_later" / f"{LAB}.ipynb"
    release_copy = root / "release" / f"{LAB}.ipynb"
    stub = {}

    def set_meta(index, value):
        return lambda nb: setattr(nb.cells[index], "metadata", value)

    return {
        # (notebook, answers): a notebook, None for a missing one, or text for a file that is no notebook
        "good": (_learner(released, "solved"), "solved"),
        "untouched": (_learner(released), None),
        # 1-4: changes outside the exercises
        "fake_check": (_learner(released, stub, insert=[
            "import lablib.checks.lab00 as m\nm.check_mean_across_ranks = lambda *a: print('✓ Task 0.1 passed')"]), None),
        "fake_allclose": (_learner(released, {2: "torch.allclose = lambda *a, **k: True\n"
                                                 "def mean_across_ranks(x):\n    return x"}), None),
        "swallow_errors": (_learner(released, stub, insert=[
            "get_ipython().set_custom_exc((BaseException,), lambda *a, **k: None)",
            "get_ipython().input_transformers_post.append(lambda lines: ['try:\\n'] + ['    ' + l for l in lines] "
            "+ ['\\nexcept BaseException:\\n    pass\\n'])"]), None),
        "fake_cluster": (_learner(released, stub, insert=[
            "class Fake:\n    def run(self, fn, *args):\n        return [torch.tensor([1.5, 3.5, 5.5, 7.5])] * 2\n"
            "cluster = Fake()"]), None),
        # code that runs when a class is defined, patching the grader's pool from inside the box
        "init_subclass": (_learner(released, {2: PATCH_RUN + "class Hook:\n    def __init_subclass__(cls):\n"
                                                 "        patch(lablib.Cluster)\nclass Copy(Hook):\n    pass\n"
                                                 "def mean_across_ranks(x):\n    return x"}), None),
        "metaclass": (_learner(released, {2: PATCH_RUN + "class Meta(torch.autograd.function.FunctionMeta):\n"
                                             "    def __init__(cls, *a):\n        patch(lablib.Cluster)\n"
                                             "class Copy(torch.autograd.Function, metaclass=Meta):\n    pass\n"
                                             "def mean_across_ranks(x):\n    return x"}), None),
        # 5-6: lablib's answers, library collectives
        "library": (_learner(released, {
            2: "mean_across_ranks = None",
            4: "def flat_shard(flat, world_size, rank):\n    from lablib.strategies.flat import FlatLayout\n"
               "    return FlatLayout(((flat.numel(),),), world_size).flatten([flat])[rank]",
            6: "ring_all_gather_blocking = lablib.strategies.ring.ring_all_gather"}), None),
        "calls_reference": (_learner(released, {
            6: "    return lablib.strategies.ring.ring_all_gather(output, input)"}), None),
        "untraced": (_learner(released, {6: UNTRACED}), None),
        "obfuscated": (_learner(released, {6: "    getattr(dist, 'all_gather_into_' + 'tensor')(output, input)"}), None),
        "nonblocking": (_learner(released, {6: RING.replace("lablib.send", "lablib.isend")}), None),
        "string_trick": (_learner(released, {6: 'def ring_all_gather_blocking(output, input):\n    pass\n'
                                                'print(1); s = """\ndef ring_all_gather_blocking(output, input):\n'
                                                '    torch.sys.modules["lablib.strategies.ring"].ring_all_gather('
                                                'output, input)\n#"""'}), None),
        "class_body": (_learner(released, {6: "class P:\n    m = torch.sys.modules['lablib.checks.lab02']\n"
                                              "    m.run_on_ranks = lambda *a, **k: []\n"
                                              "def ring_all_gather_blocking(output, input):\n    pass"}), None),
        # 7-8: the instructor's notebook, and the quiz without the work
        "submits_source": (None, None),
        "quiz_retried": (_learner(released, "solved"), "retried"),
        # 9: writes outside its box, to the gradebook and to a later learner's notebook
        "vandal": (_learner(released, {**OWN, 2: VANDAL.format(path=str(release_copy)),
                                       4: VANDAL.replace("x.numpy", "flat.numpy").format(path=str(victim))
                                       .replace(MEAN, SHARD)}), "solved"),
        "zz_later": (_learner(released, "solved"), "solved"),
        # 10: bad input
        "bad_unknown_grade_id": (_learner(released, "solved", insert=["print('pasted from another lab')"],
                                          edit=lambda nb: nb.cells[2].metadata.update(
                                              lablib={"grade_id": "check-9.9", "points": 1})), "solved"),
        "bad_metadata_string": (_learner(released, "solved", edit=set_meta(3, "oops")), "solved"),
        "bad_no_source": (_learner(released, "solved", edit=lambda nb: nb.cells[4].pop("source")), "solved"),
        "bad_no_cell_type": (_learner(released, "solved", edit=lambda nb: nb.cells[4].pop("cell_type")), "solved"),
        "bad_grade_id_list": (_learner(released, "solved", edit=lambda nb: nb.cells[3].metadata.update(
            lablib={"grade_id": ["check-0.1"], "points": 1})), "solved"),
        "bad_record_string": (_learner(released, "solved"), "record-string"),
        "bad_numeric_1e400": (_learner(released, "solved"), "1e400"),
        "bad_answers_folder": (_learner(released, "solved"), "folder"),
        "bad_result_folders": (_learner(released, "solved"), "result-folders"),
        "bad_symlink": ("symlink", None),
        "garbled": ("{ not a notebook", None),
        "empty": (None, None),
        # 12: what a second red team found: a match statement, text that breaks reports, analysis that
        # took minutes (a reversed chain of aliases; a cell of 10,000 statements)
        "match_route": (_learner(released, {**OWN, 6: MATCH}), "solved"),
        "surrogate": (_learner(released, {**OWN, 2: SURROGATE}), "surrogate"),
        "fence": (_learner(released, {**OWN, 2: FENCE}), "solved"),
        "alias_chain": (_learner(released, {**OWN, 2: CHAIN + SIGNATURES[2] + "\n" + OWN[2]}), "solved"),
        "big_cell": (_learner(released, "solved", insert=[BIG]), "solved"),
        # 13: past the rules that read the text (see PAST_RULES)
        "past_rules": (_learner(released, {**OWN, 2: PAST_RULES}), "solved"),
        "seed_search": (_learner(released, {**OWN, 2: SEED_SEARCH}), "solved"),
        "store": (_learner(released, {**OWN, 2: STORE}), "solved"),
        # 11: hangs in two checks, solves the third
        "hangs": (_learner(released, {2: "    while True:\n        pass", 4: "    while True:\n        pass",
                                      6: RING}), None),
    }


def _write(root, released, source_nb):
    subs = root / "submissions"
    for name, (nb, answers) in _learners(released, root).items():
        folder = subs / name
        folder.mkdir(parents=True)
        if name == "submits_source":
            nbformat.write(source_nb, folder / f"{LAB}.ipynb")
        elif nb == "symlink":  # to another learner's notebook
            (folder / f"{LAB}.ipynb").symlink_to(subs / "good" / f"{LAB}.ipynb")
        elif isinstance(nb, str):
            (folder / f"{LAB}.ipynb").write_text(nb)
        elif nb is not None:
            (folder / f"{LAB}.ipynb").write_text(json.dumps(nb))  # as saved, even when nbformat would refuse it
        if answers in ("solved", "retried", "record-string", "1e400", "result-folders", "surrogate"):
            _answers(folder, answers)
        path = folder / "quiz_answers.json"
        if answers == "record-string":
            data = json.loads(path.read_text())
            first = next(iter(data["answers"]))
            data["answers"][first] = "yes"
            path.write_text(json.dumps(data))
        elif answers == "1e400":
            data = json.loads(path.read_text())
            key = next(k for k in data["answers"] if isinstance(data["answers"][k]["response"], (int, float)))
            data["answers"][key]["response"] = 12345.0
            path.write_text(json.dumps(data).replace("12345.0", "1e400"))
        elif answers == "surrogate":  # a lone surrogate in an answer (JSON may hold one)
            data = json.loads(path.read_text())
            key = next(k for k in data["answers"] if isinstance(data["answers"][k]["response"], (int, float)))
            data["answers"][key]["response"] = "\ud800"
            path.write_text(json.dumps(data))
        elif answers == "folder":
            path.mkdir()
        elif answers == "result-folders":
            for name_ in (".junit.xml", "results.jsonl", "request.json"):
                (folder / name_).mkdir()
    return subs


NOHUP = ("import runpy, signal, sys\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nsys.argv[0] = 'lablib'\n"
         "runpy.run_module('lablib', run_name='__main__', alter_sys=True)")


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    root = tmp_path_factory.mktemp("course")
    (root / "source").mkdir()
    source_nb = _source()
    nbformat.write(source_nb, root / "source" / f"{LAB}.ipynb")
    release(root / "source", root / "release")
    released = nbformat.read(root / "release" / f"{LAB}.ipynb", as_version=4)
    subs = _write(root, released, source_nb)
    victims = {p: p.read_bytes() for p in (subs / "zz_later" / f"{LAB}.ipynb", root / "release" / f"{LAB}.ipynb")}
    out = root / "gradebook.csv"
    (root / "tmp").mkdir()  # the boxes' folders go here, so the test finds what this run started
    # As `nohup lablib grade ... &` starts it: SIGINT ignored (which the boxes inherit, and a check's time
    # limit is SIGINT), two learners at once.
    proc = subprocess.run([sys.executable, "-c", NOHUP, "grade", str(subs), "--release", str(root / "release"),
                           "--source", str(root / "source"), "--out", str(out), "--check-timeout",
                           str(CHECK_TIMEOUT), "--secret", "42" * 16, "--jobs", "2"], capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "TMPDIR": str(root / "tmp")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = list(csv.DictReader(open(out)))
    if available()[0]:
        assert {p: p.read_bytes() for p in victims} == victims  # the vandal's writes did not reach them
    return root, released, rows, proc.stdout


def _row(rows, learner, item):
    (row,) = [r for r in rows if r["learner"] == learner and r["item"] == item]
    return float(row["points"]), float(row["max_points"]), row["status"]


def _checks(rows, learner):
    return {r["item"]: (float(r["points"]), r["status"]) for r in rows if r["learner"] == learner and r["kind"] == "check"}


def _report(root, learner):
    return (root / "gradebook-reports" / f"{learner}.md").read_text()


QUIZ = len(questions(LAB))
FULL = 1 + 1 + 2 + QUIZ


def test_release_stubs_solutions_tags_exercises_and_removes_hidden_checks_and_source_only_cells(course):
    _, released, _, _ = course
    src = "\n".join(c.source for c in released.cells)
    assert "raise NotImplementedError('Task 0.1: the mean over ranks')" in src
    assert "lablib.all_reduce(x)" not in src and "HIDDEN" not in src and "seed=1" not in src
    assert "solve(" not in src and "NBVAL_CHECK_OUTPUT" not in src
    assert all(c.outputs == [] for c in released.cells if c.cell_type == "code")
    assert grade_info(released.cells[3]) == {"grade_id": "check-0.1", "points": 1}
    assert released.cells[6].metadata["lablib"] == {"exercise": ["Task 2.1: a blocking ring"]}


def test_work_done_gets_full_marks_with_hidden_checks(course):
    root, _, rows, _ = course
    assert _checks(rows, "good") == {"check-0.1": (1, "passed"), "check-1.1": (1, "passed"),
                                     "check-2.1": (2, "passed")}
    assert _row(rows, "good", "TOTAL")[:2] == (FULL, FULL)
    # the report names the run's secret by its fingerprint, never the secret itself (learners read reports)
    from lablib.course.grade import fingerprint

    report = _report(root, "good")
    assert f"fingerprint {fingerprint(bytes.fromhex('42' * 16))}" in report and "42" * 16 not in report


def test_untouched_release_scores_zero_and_says_what_is_not_done(course):
    root, _, rows, _ = course
    assert _checks(rows, "untouched") == {"check-0.1": (0, "failed"), "check-1.1": (0, "failed"),
                                          "check-2.1": (0, "failed")}
    assert _row(rows, "untouched", "TOTAL")[:2] == (0, FULL)
    assert "Task 0.1 is not done yet" in _report(root, "untouched")


@pytest.mark.parametrize("learner", ["fake_check", "fake_allclose", "swallow_errors", "fake_cluster", "string_trick",
                                     "class_body", "init_subclass", "metaclass"])
def test_changes_outside_the_exercise_gain_nothing(course, learner):
    root, _, rows, _ = course
    assert _row(rows, learner, "TOTAL")[0] == 0
    if learner == "fake_allclose":
        report = _report(root, learner)
        assert "left out: line 1: changes torch.allclose" in report
        assert "returned only its own data" in report


@pytest.mark.parametrize("learner, task, reason", [
    ("library", "check-0.1", "no `def mean_across_ranks"),
    ("library", "check-1.1", "imports from lablib.strategies.flat"),
    ("library", "check-2.1", "no `def ring_all_gather_blocking"),
    ("calls_reference", "check-2.1", "uses lablib.strategies"),
    ("untraced", "check-2.1", "uses dist.all_gather_into_tensor: build it from point-to-point messages"),
    ("obfuscated", "check-2.1", "uses getattr"),
    ("nonblocking", "check-2.1", "Task 2.1 asks for blocking lablib.send and lablib.recv"),
])
def test_lablib_answers_and_library_collectives_are_refused_with_the_reason(course, learner, task, reason):
    root, _, rows, _ = course
    assert _row(rows, learner, task)[::2] == (0, "refused")
    assert reason in _report(root, learner)


@pytest.mark.parametrize("learner, reason", [
    ("past_rules", "grading refused torch.nn.parallel (00_welcome cell 2, line 3, in mean_across_ranks): it is not one of the "
                   "names of torch.nn that exercises use"),
    ("seed_search", "grading refused torch.Generator (00_welcome cell 2, line 3, in mean_across_ranks)"),
    ("store", "grading refused torch.distributed.FileStore (00_welcome cell 2, line 3, in mean_across_ranks): it is not one of "
              "the names of torch.distributed that exercises use (lablib/rules/allowed.py); data moves between ranks "
              "through lablib's calls"),
])
def test_code_past_the_rules_that_read_the_text_is_refused_as_it_runs_naming_the_line(course, learner, reason):
    """The guards (lablib/rules/guards.py) check each attribute on the object reached: a torch submodule under
    another name, a random generator to replay the check's seed, a store that moves data no check counts.
    Only the check each goes for scores 0; the learner's other, honest work scores in full."""
    root, _, rows, _ = course
    assert _row(rows, learner, "check-0.1")[::2] == (0, "failed")
    assert _row(rows, learner, "check-1.1")[::2] == (1, "passed")
    assert _row(rows, learner, "check-2.1")[::2] == (2, "passed")
    assert reason in _report(root, learner), _report(root, learner)


def test_a_submitted_solution_notebook_is_flagged_and_its_quiz_key_cell_does_not_run(course):
    _, _, rows, _ = course
    total = [r for r in rows if r["learner"] == "submits_source" and r["item"] == "TOTAL"][0]
    assert "matches the solution's code" in total["flags"]
    assert [r for r in rows if r["learner"] == "submits_source" and r["item"] == "check-2.1"][0]["flags"]
    assert {r["status"] for r in rows if r["learner"] == "submits_source" and r["kind"] == "quiz"} == {"unanswered"}
    assert not [r for r in rows if r["learner"] == "good" and r["flags"]]


def test_the_quiz_counts_first_attempts(course):
    _, _, rows, _ = course
    quiz = [r for r in rows if r["learner"] == "quiz_retried" and r["kind"] == "quiz"]
    assert len(quiz) == QUIZ and all(float(r["points"]) == 0 for r in quiz)


def test_code_cannot_write_outside_its_box(course):
    """The vandal wrote to the release and to a later learner's notebook, in its box only: the fixture
    finds both files unchanged, and the later learner gets full marks."""
    if not available()[0] and os.environ.get("LABLIB_REQUIRE_SANDBOX") != "1":
        pytest.skip("no sandbox here: install bubblewrap (apt-get install bubblewrap) to run this test")
    _, _, rows, _ = course
    assert _row(rows, "zz_later", "TOTAL")[:2] == (FULL, FULL)


@pytest.mark.parametrize("learner", ["bad_metadata_string", "bad_no_source", "bad_no_cell_type", "bad_grade_id_list",
                                     "bad_symlink"])
def test_an_unreadable_notebook_is_invalid_with_the_reason_and_grading_goes_on(course, learner):
    root, _, rows, _ = course
    assert {status for _, status in _checks(rows, learner).values()} == {"invalid"}
    assert _row(rows, learner, "TOTAL")[2].startswith("invalid: ")
    assert "invalid: " in _report(root, learner)


@pytest.mark.parametrize("learner, status", [("bad_record_string", "invalid answer"),
                                             ("bad_numeric_1e400", "invalid answer"),
                                             ("bad_answers_folder", "invalid")])
def test_a_bad_answers_file_invalidates_only_its_answers(course, learner, status):
    _, _, rows, _ = course
    assert _row(rows, learner, "check-2.1") == (2, 2, "passed")
    assert status in {r["status"] for r in rows if r["learner"] == learner and r["kind"] == "quiz"}


@pytest.mark.parametrize("learner", ["bad_unknown_grade_id", "bad_result_folders"])
def test_harmless_oddities_are_graded_normally(course, learner):
    _, _, rows, _ = course
    assert _row(rows, learner, "TOTAL")[:2] == (FULL, FULL)


def test_missing_and_garbled_notebooks(course):
    root, _, rows, _ = course
    assert _row(rows, "empty", "check-0.1")[2] == "missing notebook"
    assert _row(rows, "garbled", "check-0.1")[2] == "invalid"
    assert "is not valid JSON" in _report(root, "garbled")


def test_a_match_statement_is_refused_as_a_construct_whatever_it_reaches(course):
    root, _, rows, _ = course
    assert _row(rows, "match_route", "check-2.1")[::2] == (0, "refused")
    assert "uses a match statement, which exercise code may not be written with" in _report(root, "match_route")
    assert _row(rows, "match_route", "check-0.1")[::2] == (1, "passed")


def test_text_that_would_break_a_report_is_escaped_and_the_learners_after_it_are_graded(course):
    root, _, rows, _ = course
    report = (root / "gradebook-reports" / "surrogate.md").read_bytes().decode("utf-8")  # valid UTF-8
    assert "ValueError: \\ud800 \\u001b[31m red" in report and "\x1b" not in report
    assert _checks(rows, "surrogate") == {"check-0.1": (0, "failed"), "check-1.1": (1, "passed"),
                                          "check-2.1": (2, "passed")}
    assert "invalid answer" in {r["status"] for r in rows if r["learner"] == "surrogate" and r["kind"] == "quiz"}
    assert _row(rows, "zz_later", "TOTAL")[:2] == (FULL, FULL)
    lines = _report(root, "fence").splitlines()
    assert "- ✓ check-0.1 (check): passed, 1/1" not in lines  # the learner's fake line stays in its code block
    start = lines.index("  ````")  # one backtick longer than the learner's fences, so theirs end nothing
    inside = lines[start + 1:lines.index("  ````", start + 1)]
    assert "  - ✓ check-0.1 (check): passed, 1/1" in inside and "  ```" in inside


def test_analysis_that_once_took_minutes_is_linear_or_capped(course):
    root, _, rows, _ = course
    # 1,000 aliases named in reverse (read in one pass, where the rules once read them 1,000 times); run,
    # the cell stops at its first line, which is the learner's to hear
    assert _checks(rows, "alias_chain") == {"check-0.1": (0, "failed"), "check-1.1": (1, "passed"),
                                            "check-2.1": (2, "passed")}
    assert "cell 2 raised NameError: name 'a999' is not defined" in _report(root, "alias_chain")
    total = _row(rows, "big_cell", "TOTAL")
    assert total[2].startswith("invalid: cell 2 is too large to grade (124 KB; at most 64 KB)")
    assert _checks(rows, "big_cell") == _checks(rows, "good")  # its exercise cells are graded all the same


def test_a_hanging_check_is_stopped_and_the_others_still_count(course):
    root, _, rows, _ = course
    assert _checks(rows, "hangs") == {"check-0.1": (0, "failed"), "check-1.1": (0, "failed"),
                                      "check-2.1": (2, "passed")}
    assert f"stopped after {CHECK_TIMEOUT} s" in _report(root, "hangs")


def test_every_learner_is_graded_in_one_run_and_nothing_is_left_running(course):
    root, _, rows, _ = course
    assert len({r["learner"] for r in rows}) == 40
    assert [r["learner"] for r in rows] == sorted(r["learner"] for r in rows)  # graded two at a time, kept in order
    if os.environ.get("LABLIB_REQUIRE_SANDBOX"):
        assert "WITHOUT a sandbox" not in _report(root, "good")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        assert str(root / "tmp").encode() not in cmdline, f"process {pid} outlived its grading"
    assert not list((root / "tmp").iterdir())  # and the boxes' folders are gone


def test_a_time_limit_keeps_what_was_earned(tmp_path):
    """The box is stopped after the time limit; the checks that finished before it still count."""
    from lablib.course.grade import grade

    (tmp_path / "source").mkdir()
    nbformat.write(_source(), tmp_path / "source" / f"{LAB}.ipynb")
    release(tmp_path / "source", tmp_path / "release")
    released = nbformat.read(tmp_path / "release" / f"{LAB}.ipynb", as_version=4)
    (tmp_path / "subs" / "slow").mkdir(parents=True)
    nb = _learner(released, {**OWN, 6: "    while True:\n        pass"})
    (tmp_path / "subs" / "slow" / f"{LAB}.ipynb").write_text(json.dumps(nb))
    # 20 s: the two checks before the endless one finish in a few seconds (rank forks), even on a busy machine
    results = grade(tmp_path / "subs", tmp_path / "release", tmp_path / "gb.csv", check_timeout=600, time_limit=20)
    items = {it.item: it for it in results[0].items}
    assert items["check-0.1"].status == items["check-1.1"].status == "passed"
    assert items["check-2.1"].status == "not run" and "timed out" in items["check-2.1"].detail


@pytest.mark.parametrize("edit, message", [
    (lambda nb: setattr(nb.cells[2], "source", nb.cells[2].source.replace(" Task 0.1: the mean over ranks", "")),
     r"cell 2, line 2: name the task after BEGIN SOLUTION"),
    (lambda nb: setattr(nb.cells[2], "source", nb.cells[2].source.replace("### END SOLUTION", "")),
     r"cell 2, line 2: BEGIN SOLUTION without END SOLUTION"),
    (lambda nb: nb.cells[3].metadata.pop("lablib"), r"the exercise in cell 2 must be followed by a graded check cell"),
    (lambda nb: nb.cells.pop(), r"the last code cell must be the quiz score cell"),
    (lambda nb: nb.cells[8].metadata.update(lablib={"grade_id": "check-0.1", "points": 1}),
     r"grade_id 'check-0.1' is also used by cell 3"),
])
def test_release_rejects_bad_sources(edit, message):
    nb = _source()
    edit(nb)
    with pytest.raises(ReleaseError, match=message):
        release_notebook(nb, "fixture.ipynb")


def test_grade_fails_only_when_it_cannot_run(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lablib", "grade", str(tmp_path / "nope"), "--release", str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and re.search(r"no released notebooks", proc.stderr)


def test_a_check_cell_without_a_readable_check_call_is_the_instructors_error(tmp_path):
    nb = _source()
    nb.cells[3].source = "assert True"
    (tmp_path / "release").mkdir()
    nbformat.write(release_notebook(nb, "x"), tmp_path / "release" / f"{LAB}.ipynb")
    (tmp_path / "subs").mkdir()
    proc = subprocess.run([sys.executable, "-m", "lablib", "grade", str(tmp_path / "subs"), "--release",
                           str(tmp_path / "release")], capture_output=True, text=True)
    assert proc.returncode == 2 and "graded cell check-0.1 holds no check call" in proc.stderr


def test_copy_flags_leave_out_the_code_a_stub_dictates():
    """A copy of a solution is flagged only where the solution is more than its stub spells out: the tiny lab's
    three are of substance; a one-line body, or one of a few lines whose every name the stub's comment,
    docstring or task text gives, is what an honest learner writes too."""
    from lablib.course.exercises import dictated

    nb = _source()
    assert dictated(nb) == set()
    nb.cells[2].source = nb.cells[2].source.replace("Task 0.1: the mean over ranks",
                                                    "Task 0.1: lablib.all_reduce(x), then x / dist.get_world_size()")
    nb.cells[6].source = nb.cells[6].source.replace(  # every name the ring calls, but a loop of 11 statements
        "Task 2.1: a blocking ring", "Task 2.1: get_rank, get_world_size, view, copy_, then send and recv")
    nb.cells[7:7] = [
        new_code_cell("def world():\n    ### BEGIN SOLUTION Task 0.2: the number of ranks\n"
                      "    return dist.get_world_size()\n    ### END SOLUTION"),
        new_markdown_cell("**Task 0.3.** Write `doubled(x)`: `lablib.all_reduce(x)` and return `x.mul(2)`."),
        new_code_cell("def doubled(x):\n    ### BEGIN SOLUTION Task 0.3\n    lablib.all_reduce(x)\n"
                      "    return x.mul(2)\n    ### END SOLUTION"),
        new_code_cell("def tripled(x):\n    ### BEGIN SOLUTION Task 0.4: all_reduce, then times 3\n"
                      "    lablib.all_reduce(x)\n    return x.mul(3)\n    ### END SOLUTION")]  # mul: its own knowledge
    assert dictated(nb) == {"mean_across_ranks", "world", "doubled"}


def test_solved_sources_follow_the_exercise_rules():
    """Every solution in the course's sources passes the rules its check applies."""
    from lablib.course.exercises import Exercise, check_calls, refusal, solutions
    from lablib.course.notebook import read_notebook
    from lablib.paths import LABS, SOURCES

    for path in sorted(SOURCES.glob("*.ipynb")):
        source = read_notebook(path)
        calls, _ = check_calls(read_notebook(LABS / path.name), source)
        functions = solutions(source)
        ex = Exercise(functions=functions, names=set(functions), nodes=dict(functions))
        for call in (c for cs in calls.values() for c in cs):
            assert refusal(call, ex) == "", (path.name, call)


def test_the_course_itself(tmp_path):
    """The labs as released: the solved sources get every check (flagged as the solution), and so does every
    task solved again in another style (tests/other_style.py: the rules refuse no honest way of writing
    them); an untouched learner copy gets none, each with the reason."""
    from lablib.course.grade import grade
    from lablib.paths import LABS, SOURCES
    from other_style import CELLS

    for learner, folder in (("solved", SOURCES), ("untouched", LABS), ("other style", SOURCES)):
        (tmp_path / "subs" / learner).mkdir(parents=True)
        for path in SOURCES.glob("*.ipynb"):
            nb = json.loads((folder / path.name).read_text())
            for cell in nb["cells"] if learner == "other style" else ():
                cell["source"] = CELLS.get(cell.get("id"), cell["source"])
            (tmp_path / "subs" / learner / path.name).write_text(json.dumps(nb))
    results = grade(tmp_path / "subs", LABS, tmp_path / "gb.csv", SOURCES, jobs=2)
    checks = {(lab.learner, it.item): it for lab in results for it in lab.items if it.kind == "check"}
    notes = {(lab.learner, lab.lab): lab.notes for lab in results}
    assert len(checks) == 3 * 43 and len(CELLS) == 43
    for (learner, item), it in checks.items():
        if learner != "untouched":
            assert it.status == "passed", (learner, item, it.detail, notes[learner, it.lab])
        else:
            assert (it.status, it.points) == ("failed", 0) and "is not done yet" in it.detail, (item, it.detail)
    assert all(lab.flags for lab in results if lab.learner == "solved")
    # lab 07's route and autograd_all_to_all are what their stubs spell out: not flagged; its layer is
    experts = " ".join(f for lab in results if lab.learner == "solved" and lab.lab == "07_experts" for f in lab.flags)
    assert "moe_dense matches" in experts and "route matches" not in experts, experts
    assert "autograd_all_to_all matches" not in experts, experts


def _grade_cli(root, *args):
    proc = subprocess.run([sys.executable, "-m", "lablib", "grade", *map(str, args), "--release", str(root / "release"),
                           "--source", str(root / "source"), "--check-timeout", str(CHECK_TIMEOUT), "--secret", "42" * 16],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_one_learner_regraded_alone_and_shards_merged_give_the_same_gradebook(course, tmp_path):
    """--only regrades one learner, serially, into a copy of the fixture's gradebook (graded two at a time):
    the whole gradebook comes out the same. Two shards of a smaller class, merged, equal its rows too."""
    import shutil

    root, _, rows, _ = course
    gradebook = tmp_path / "gradebook.csv"
    shutil.copy(root / "gradebook.csv", gradebook)
    _grade_cli(root, root / "submissions", "--only", "good", "--out", gradebook)
    assert list(csv.DictReader(open(gradebook))) == rows
    class_ = tmp_path / "class"
    for learner in ("good", "library", "empty"):
        shutil.copytree(root / "submissions" / learner, class_ / learner)
    for k in (1, 2):
        _grade_cli(root, class_, "--shard", f"{k}/2", "--out", tmp_path / f"shard{k}.csv")
    assert {r["learner"] for r in csv.DictReader(open(tmp_path / "shard1.csv"))} == {"empty", "library"}
    out = _grade_cli(root, "--merge", tmp_path / "shard1.csv", tmp_path / "shard2.csv", "--out", tmp_path / "all.csv")
    assert "merged 2 gradebook(s)" in out
    assert list(csv.DictReader(open(tmp_path / "all.csv"))) == [r for r in rows if r["learner"] in ("good", "library", "empty")]
    assert sorted(p.name for p in (tmp_path / "all-reports").iterdir()) == ["empty.md", "good.md", "library.md"]


def test_the_gradebook_goes_to_an_lms_and_to_junit_from_the_command_line(course, tmp_path):
    root, _, rows, _ = course
    learners = sorted({r["learner"] for r in rows})
    roster = tmp_path / "roster.csv"
    roster.write_text("learner,Student,ID,Section\n" + "".join(f"{n},{n.title()},{k},A\n" for k, n in enumerate(learners)))
    out = _grade_cli(root, "--merge", root / "gradebook.csv", "--out", tmp_path / "gb.csv", "--lms", "canvas",
                     "--roster", roster, "--junit", tmp_path / "junit.xml")
    assert f"canvas gradebook import: {tmp_path / 'gb-canvas.csv'}" in out
    canvas = list(csv.reader(open(tmp_path / "gb-canvas.csv")))
    assert canvas[0] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", LAB, "Total"]
    good = next(r for r in canvas if r[0] == "Good")
    assert good[5] == good[6] == f"{FULL:g}"
    suites = {s.get("name"): s for s in ET.parse(tmp_path / "junit.xml").getroot()}
    assert set(suites) == set(learners) and suites["good"].get("failures") == "0"
    assert suites["untouched"].get("failures") == suites["untouched"].get("tests")
    roster.write_text("learner,Student\ngood,Good\n")
    proc = subprocess.run([sys.executable, "-m", "lablib", "grade", str(root / "submissions"), "--out",
                           str(tmp_path / "x.csv"), "--lms", "moodle", "--roster", str(roster)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "identity columns" in proc.stderr and not (tmp_path / "x.csv").exists()


def test_judges_in_threads_build_the_weights_the_ranks_built():
    """`--jobs N` judges learners in threads, and the judges (and a check's given data) build their layers
    from torch's global generator: seeding is one thread at a time (toy.seeded), else two learners' draws
    interleave and a right answer fails against another reference."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from lablib.strategies import pipeline, tp_reference
    from lablib.toy import build_model

    def weights(seed):
        ff, att = tp_reference.layers(seed)
        return [p.detach().clone() for m in (ff, att, build_model("mlp", seed), pipeline.model(seed=seed))
                for p in m.parameters()]

    alone = {seed: weights(seed) for seed in range(8)}
    with ThreadPoolExecutor(8) as pool:
        for _ in range(5):
            for seed, got in zip(range(8), pool.map(weights, range(8))):
                assert all(torch.equal(a, b) for a, b in zip(got, alone[seed])), seed


def test_the_grader_judges_one_at_a_time(monkeypatch):
    """A judge may draw from torch's global generator outside ``seeded`` (lab 04's judge built DTensor's
    layers with nn.Linear, whose initialisation draws): in threads, that draw landed between another
    judge's seeded ones, whose reference bias then differed from the ranks'. The grader runs every judge
    and every check's given data inside toy.draws, so no other thread draws meanwhile."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from lablib.course.exercises import Call
    from lablib.strategies import tp_reference

    inside, overlaps = [0], []
    lock = threading.Lock()

    def judge(data, world_size, seed):
        with lock:
            inside[0] += 1
            overlaps.append(inside[0])
        torch.nn.Linear(64, 64)  # a draw outside seeded
        time.sleep(0.01)
        with lock:
            inside[0] -= 1
        return "ok"

    monkeypatch.setattr(Call, "spec", lambda self: type("Spec", (), {"judge": staticmethod(judge)})())
    calls = [Call(f"check-1.1#{i}", "check-1.1", "lab01", "check", (), 2, i, False) for i in range(16)]
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda c: c.judge({}), calls)) == ["ok"] * 16
    assert max(overlaps) == 1

    ff, att = tp_reference.layers(0)  # and lab 04's DTensor layers draw nothing: they are loaded anyway
    torch.manual_seed(1)
    tp_reference.MLP(ff), tp_reference.SplitQKV(att)
    assert torch.equal(torch.rand(4), torch.manual_seed(1) and torch.rand(4))


def test_the_runner_takes_its_request_on_stdin_and_answers_over_a_pipe():
    """The request holds what checks are given (lablib's schedules for Task 5.4, say): it comes on standard
    input, which the runner reads whole and replaces with /dev/null, and is never a file; each result goes
    back over the pipe as a line as soon as it is known (here: a cell that tried to read the request)."""
    cell = "left = open('/proc/self/fd/0').read()"
    request = {"nonce": "n", "check_timeout": 30, "labs": [{"lab": "x", "cells": [{"name": "c", "source": cell}],
                                                            "calls": []}]}
    back = os.pipe()
    done = subprocess.run([sys.executable, "-m", "lablib.course.runner"], input=json.dumps(request).encode(),
                          env={**os.environ, "LABLIB_RESULTS_FD": str(back[1])}, pass_fds=back[1:], timeout=60)
    os.close(back[1])
    with os.fdopen(back[0]) as results:
        records = [json.loads(line) for line in results]
    assert done.returncode == 0 and records == [{"nonce": "n", "lab": "x", "cell": "c",
                                                 "error": "NameError: name 'open' is not defined"}]


def test_a_checks_data_keeps_tensors_of_every_shape_across_the_boxs_boundary():
    """A scalar (a loss, 0-dim) among them: its bytes are read flat, its shape kept apart."""
    import torch

    from lablib.course.plain import decode, encode

    for t in (torch.tensor(0.25), torch.tensor(3), torch.zeros(0, 2), torch.arange(6.0).view(2, 3).t()):
        back = decode(json.loads(json.dumps(encode(t))))
        assert back.shape == t.shape and torch.equal(back, t)


def test_exercise_code_starts_no_processes_while_graded(monkeypatch):
    """A rank pool of its own (lablib.cluster) or any process, from a cell in the box or a function on the
    ranks, is refused with the reason: spinning ranks of one learner took CPU from the boxes beside it. The
    guards refuse the names first; the audit hook holds even for code compiled without them (on the ranks)."""
    cells = {"pool": "lablib.cluster(3)", "fork": "torch.multiprocessing.Process(target=print).start()"}
    request = {"nonce": "n", "check_timeout": 30, "labs": [{"lab": "x", "calls": [], "cells": [
        {"name": name, "source": source} for name, source in cells.items()]}]}
    back = os.pipe()
    done = subprocess.run([sys.executable, "-m", "lablib.course.runner"], input=json.dumps(request).encode(),
                          env={**os.environ, "LABLIB_RESULTS_FD": str(back[1]), "LABLIB_GRADING": "1"},
                          pass_fds=back[1:], timeout=120)
    os.close(back[1])
    with os.fdopen(back[0]) as results:
        errors = {r["cell"]: r["error"] for r in map(json.loads, results)}
    assert done.returncode == 0 and sorted(errors) == ["fork", "pool"], errors
    # in the box, the guards refuse both before any process starts, naming the line
    assert errors["pool"].startswith("Refused: grading refused lablib.cluster (x pool, line 1, in <module>)")
    assert errors["fork"].startswith("Refused: grading refused torch.multiprocessing (x fork, line 1"), errors["fork"]

    from lablib import Cluster, RankError
    from lablib.rules.namespace import namespace

    monkeypatch.setenv("LABLIB_GRADING", "1")  # the ranks are started under grading; the harness may start them
    ns = namespace()
    exec(compile("def spawn():\n    torch.multiprocessing.Process(target=print).start()", "<x spawn>", "exec"), ns)
    with Cluster(2, timeout=10, quiet=True) as cluster:
        with pytest.raises(RankError, match="grading: exercise code may not start processes"):
            cluster.run(ns["spawn"])


def _seeds(secret):
    from lablib.course.exercises import check_calls

    calls, _ = check_calls(_source(), None, secret)
    return [c.seed for gid in sorted(calls) for c in calls[gid]]


def test_each_calls_inputs_come_from_the_runs_128_bit_secret():
    """A seed of 62 bits per call, keyed by the run's secret: the same secret gives the same inputs (a regrade),
    another gives others, and no small seed is left to try until a rank's own data comes out."""
    from lablib.course.grade import parse_secret

    one, two = parse_secret("42" * 16), parse_secret(None)
    assert len(two) == 16 and two != parse_secret(None)
    seeds = _seeds(one)
    assert seeds == _seeds(one) and len(set(seeds)) == len(seeds) == 3
    assert all(1 << 50 < s < 1 << 62 for s in seeds) and not set(seeds) & set(_seeds(two))
    for bad in ("42", "xyz" * 11, "42" * 17):
        with pytest.raises(ValueError, match="--secret takes 32 hex digits"):
            parse_secret(bad)


def test_no_rank_holds_the_boxs_records_pipe():
    """The executor's ranks fork from its fork server, which closes the pipe the executor writes its records to:
    a rank holds no way to the box's supervisor, let alone to grade.py."""
    code = ("import os\nr, w = os.pipe()\nos.close(r)\nos.environ['LABLIB_RECORDS_FD'] = str(w)\n"
            "from lablib.pool import Cluster, zygote\nzygote.start_here()\n"
            "def held(pipe):  # any open fd on that pipe (its number may be reused for another)\n"
            "    return any(os.stat(f'/proc/self/fd/{fd}').st_ino == pipe for fd in os.listdir('/proc/self/fd')\n"
            "               if os.path.exists(f'/proc/self/fd/{fd}'))\n"
            "pipe = os.fstat(w).st_ino\n"
            "with Cluster(2, quiet=True) as c:\n    print(held(pipe), c.run(held, pipe))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["True", "[False,", "False]"], done.stdout + done.stderr
