"""No learner costs another a point: graded two at a time (``--jobs 2``) beside a learner who fills the disk or
one who spins on every core, a solved learner's gradebook rows are exactly its rows graded alone. On the tiny
lab of test_grading.py, with small limits, so the machine running the tests is not harmed."""
import csv
import json

import nbformat
import pytest

from lablib.course import box
from lablib.course import grade as grading
from lablib.course import sandbox
from lablib.course.release import release
from test_grading import LAB, OWN, _learner, _source

# Both run in the box's ranks, inside the first check (its function is called there): the filler then returns the
# right mean; the spinner spins until the check's time limit.
FILL = ("    for k in range(10 ** 4):\n"
        "        for where in ('/tmp', '/proc/1/cwd', '.'):\n"
        "            try:\n"
        "                torch.save(torch.zeros(1 << 18), f'{where}/fill-{dist.get_rank()}-{k}.pt')\n"
        "            except Exception:\n"
        "                pass\n")
SPIN = ("    torch.set_num_threads(8)\n"
        "    a = torch.randn(256, 256)\n"
        "    while True:\n"
        "        a = torch.tanh(a @ a)\n")


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("isolation")
    (root / "source").mkdir()
    nbformat.write(_source(), root / "source" / f"{LAB}.ipynb")
    release(root / "source", root / "release")
    return root


def _grade(root, name, learners, jobs):
    released = nbformat.read(root / "release" / f"{LAB}.ipynb", as_version=4)
    subs = root / name
    for learner, bodies in learners.items():
        (subs / learner).mkdir(parents=True)
        (subs / learner / f"{LAB}.ipynb").write_text(json.dumps(_learner(released, bodies)))
    out = root / f"{name}.csv"
    grading.grade(subs, root / "release", out, root / "source", check_timeout=10, time_limit=60, secret="07" * 16, jobs=jobs)
    return [r for r in csv.DictReader(open(out)) if r["learner"] == "solved"]


@pytest.fixture(scope="module")
def alone(release_dir):
    rows = _grade(release_dir, "alone", {"solved": "solved"}, 1)
    assert {r["status"] for r in rows if r["kind"] == "check"} == {"passed"}, rows
    return rows


def _require_box():
    if not sandbox.available()[0]:
        pytest.skip("no sandbox here: install bubblewrap (apt-get install bubblewrap) to run this test")


def test_a_learner_who_fills_the_disk_costs_the_one_beside_them_nothing(release_dir, alone, monkeypatch):
    _require_box()
    monkeypatch.setattr(box, "SCRATCH_BYTES", 16 << 20)
    filler = {**OWN, 2: FILL + "    total = x.clone()\n    lablib.all_reduce(total)\n    return total / dist.get_world_size()"}
    assert _grade(release_dir, "filled", {"filler": filler, "solved": "solved"}, 2) == alone


@pytest.mark.parametrize("cpu", ["cgroup", "no cpu controller"])
def test_a_learner_who_spins_on_every_core_costs_the_one_beside_them_nothing(release_dir, alone, monkeypatch, cpu):
    """With a CPU share per box where the cgroup controller is there; without one (common in containers),
    what holds is that a learner who reached a time limit beside others is graded again alone."""
    _require_box()
    if cpu == "no cpu controller":
        make = sandbox._Cgroup.make.__func__
        monkeypatch.setattr(sandbox._Cgroup, "make", classmethod(lambda cls, m, p, cpus=None: make(cls, m, p)))
    assert _grade(release_dir, f"spun-{cpu.replace(' ', '-')}", {"solved": "solved", "spinner": {**OWN, 2: SPIN}},
                  2) == alone


def test_a_time_limit_reached_beside_others_is_graded_again_alone(release_dir, alone, monkeypatch):
    """Beside another learner, the box is stopped before any check ran (its time limit made 1 s while boxes
    share the machine: torch alone takes longer to import): the solved learner is then graded again alone,
    with the real limit, and its rows are its rows alone."""
    _require_box()
    real = box.run_box
    shares = []

    def beside_others(request, course, held=()):
        shares.append(course.cpus)
        return real(request, course if course.cpus is None else grading.dataclasses.replace(course, time_limit=1),
                    held)

    monkeypatch.setattr(box, "run_box", beside_others)
    assert _grade(release_dir, "again", {"other": "solved", "solved": "solved"}, 2) == alone
    assert shares.count(None) == 2 and len(shares) == 4  # each learner once beside the other, then once alone
