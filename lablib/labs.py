"""The course's labs, in order: one line registers a lab.

A lab is five files in known places, named from its line here:
    sources/<notebook>.ipynb          the solved source (labs/<notebook>.ipynb is released from it)
    lablib/checks/<checks>.py         its checks, each owning its task id
    lablib/answers/<checks>.py        lablib's answers to its tasks, registered per task (TASKS)
    lablib/strategies/<name>.py       the harness its tasks run in, one file per strategy (none for lab 00)
    tests/test_<checks>.py            its tests
tests/test_layout.py holds every registered lab to this, and every notebook in sources/ to a line here.

``builds_on``: the earlier labs whose answers (lablib's) a lab's rank jobs run as its harness, as lab 08
composes lab 04's tensor-parallel layer and lab 05's executor. The box that grades such a lab holds no answers
file either: their text comes in its request, is made into modules of its executor only and reaches the ranks
by value (``course.executor.load_harness``), and the learner's code cannot reach them (``rules.guards``).
"""
from typing import NamedTuple


class Lab(NamedTuple):
    notebook: str
    checks: str
    strategies: tuple = ()
    builds_on: tuple = ()


def builds_on(notebook: str) -> tuple:
    """The answers modules (e.g. ("lab04", "lab05")) the box grading ``notebook`` (its stem) holds."""
    return next((lab.builds_on for lab in LABS if lab.notebook == notebook), ())


LABS = (
    Lab("00_welcome", "lab00"),
    Lab("01_sharding", "lab01", ("flat", "harness", "zero", "fsdp")),
    Lab("02_collectives", "lab02", ("ring",)),
    Lab("03_prefetch_overlap", "lab03", ("prefetch",)),
    Lab("04_tensor_parallel", "lab04", ("tensor_parallel", "tp_reference")),
    Lab("05_pipeline_bubbles", "lab05", ("schedules", "pipeline", "pp_reference")),
    Lab("06_context_parallel", "lab06", ("context_parallel",)),
    Lab("07_experts", "lab07", ("experts",)),
    Lab("08_composition", "lab08", ("compose", "planner"), builds_on=("lab04", "lab05")),
    Lab("09_precision_checkpoints", "lab09", ("mixed", "scaling", "accumulate", "checkpoint")),
    Lab("10_finding_bugs", "lab10", ("bugs", "hangs", "probe")),
)
