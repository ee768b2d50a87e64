"""Where the course's folders are, computed once: the repository root and what lies in it."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LABS = ROOT / "labs"             # the learner copies: what learners open
SOURCES = ROOT / "sources"       # the solved notebooks the learner copies are released from
QUIZZES = ROOT / "quizzes"
SANITIZE = LABS / "nbval_sanitize.cfg"
