"""Where the course's folders are, computed once: the repository root and what lies in it."""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LABS = ROOT / "labs"             # the learner copies: what learners open
SOURCES = ROOT / "sources"       # the solved notebooks the learner copies are released from
QUIZZES = ROOT / "quizzes"
SANITIZE = LABS / "nbval_sanitize.cfg"


def quick() -> bool:
    """LABLIB_QUICK=1, which the test suite sets (conftest.py): the labs' long measurements repeat less
    (their numbers are not what a test compares)."""
    return os.environ.get("LABLIB_QUICK") == "1"
