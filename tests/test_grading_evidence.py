"""Lab 08's recomputation graded from a fresh release: the evidence its judge reads ("each stage keeps its input
only") is lablib's, out of the learner's reach. Two routes once scored Task 8.3 without recomputing: writing
that evidence, a public list on the kit handed to the learner's step; and shadowing the hook that fills it with
the learner's own saved-tensor hooks. Each must score 0 on Task 8.3, beside an honest learner who scores."""
import json

import pytest

from lablib.course.grade import grade
from lablib.course.release import release
from lablib.paths import SOURCES

LAB = "08_composition"
# A checkpointed forward that keeps every activation, and in the backward runs the forward again only for the
# collectives a recomputation issues (the judge counts them): the same gradients, the same messages, no saving.
KEEPS_ALL = ("def again(forward, h, grad):\n    with torch.no_grad():\n        forward(h)\n    return grad\n\n\n"
             "def checkpointed(forward):\n    def run(h):\n        out = forward(h)\n        held = h.detach()\n"
             "        out.register_hook(lambda grad: again(forward, held, grad))\n        return out\n    return run\n")
# 4a: and the step rewrites what the stages kept, a public list on the kit it is handed
WRITES_EVIDENCE = {
    "def checkpointed(": KEEPS_ALL,
    "def train_step(": "\nhonest_step = train_step\n\n\ndef train_step(kit, x, y, groups, micro_batches):\n"
                       "    loss = honest_step(kit, x, y, groups, micro_batches)\n    kit.kept.clear()\n"
                       "    kit.kept.extend([0] * micro_batches)\n    return loss\n",
}
# 4b: the learner's own saved-tensor hooks take the tensors that lablib's hook would have counted
SHADOWS_HOOK = {
    "def checkpointed(": KEEPS_ALL.replace("def checkpointed(forward):\n    def run(h):\n        out = forward(h)\n",
                                           "def keep(t):\n    return t\n\n\ndef checkpointed(forward):\n"
                                           "    def run(h):\n        with torch.autograd.graph.saved_tensors_hooks("
                                           "keep, keep):\n            out = forward(h)\n"),
}
# and the same checkpointed forward alone, its evidence left as lablib recorded it
KEEPS_ALL_ONLY = {"def checkpointed(": KEEPS_ALL}


def _learner(folder, changes: dict):
    """The solved source with the cell defining each key replaced (or, for train_step, added to)."""
    nb = json.loads((SOURCES / f"{LAB}.ipynb").read_text())
    for cell in nb["cells"]:
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        for marker, code in changes.items():
            if cell["cell_type"] == "code" and marker in source and "### BEGIN SOLUTION" in source:
                cell["source"] = source + code if marker == "def train_step(" else code
    folder.mkdir(parents=True)
    (folder / f"{LAB}.ipynb").write_text(json.dumps(nb))


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("evidence")
    (root / "source").mkdir()
    (root / "source" / f"{LAB}.ipynb").write_text((SOURCES / f"{LAB}.ipynb").read_text())
    release(root / "source", root / "release")
    for name, changes in (("honest", {}), ("writes_evidence", WRITES_EVIDENCE), ("shadows_hook", SHADOWS_HOOK),
                          ("keeps_all", KEEPS_ALL_ONLY)):
        _learner(root / "subs" / name, changes)
    results = grade(root / "subs", root / "release", root / "gb.csv", root / "source", check_timeout=120,
                    time_limit=600, jobs=2)
    return {(lab.learner, it.item): it for lab in results for it in lab.items if it.kind == "check"}


def _task_83(graded, learner):
    (item,) = [it for (who, gid), it in graded.items() if who == learner and gid.startswith("check-8.3")]
    return item


def test_an_honest_recomputation_scores(graded):
    item = _task_83(graded, "honest")
    assert item.status == "passed", item.detail


@pytest.mark.parametrize("learner, reason", [
    ("writes_evidence", "'Kit' object has no attribute 'kept'"),
    ("shadows_hook", "grading refused torch.autograd.graph"),
    ("keeps_all", "recomputation keeps the stage's input only"),
])
def test_evidence_out_of_the_learners_reach_scores_nothing_without_the_work(graded, learner, reason):
    item = _task_83(graded, learner)
    assert (item.status, item.points) == ("failed", 0), item.detail
    assert reason in item.detail, item.detail
