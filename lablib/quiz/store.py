"""The answers file: every answer a learner gives, kept next to the notebook.

``quiz_answers.json`` in the notebook's folder (the kernel's working directory; ``$LABLIB_ANSWERS``
names another file). One file serves every notebook in the folder, so a restarted kernel, Run All,
nbval and ``lablib grade`` all read back what was answered. It holds one record per question and
place: the key is the question (``fsdp/2``) for an answer given in the question's own lab, and
``fsdp/2@quiz:fsdp`` for one given elsewhere (here: the whole-quiz view), so each place keeps its own
answer. A record::

    {"response": [1],             # the latest answer: choice indices in the bank's order (its a = 0), or a number
     "where": "02_collectives",   # the lab it was given in, or "quiz:<id>" for the whole-quiz view
     "attempts": 2,               # answers checked (practice) or saved (exam)
     "first_response": [0],       # practice: the first answer checked, and whether it was right
     "first_correct": false,
     "correct": true,             # practice: whether the latest answer was right
     "revealed": false,           # practice: the answer was shown ("Show answer"): no point
     "mode": "exam",              # only in exam mode, where nothing is judged
     "time": "2026-01-05T10:00:00"}

Records written before version 2 have only response, correct, attempts and time; they are read as
given in the question's own lab, and their first attempt is known only when attempts is 1.

- Each write is atomic (a temporary file, fsync, rename) and done under a lock, re-reading the file
  first: two widgets, or two notebooks, answering at once lose nothing.
- A file that cannot be read is never overwritten: it is renamed aside (``*.damaged-<time>.json``)
  with a message saying so, and new answers go to a fresh file.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

FILENAME = "quiz_answers.json"
VERSION = 2
_thread_lock = threading.Lock()


def default_path() -> Path:
    return Path(os.environ.get("LABLIB_ANSWERS") or Path.cwd() / FILENAME)


class AnswerStore:
    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else default_path()
        self.warning = ""  # set when a damaged file was moved aside

    # -- reading ---------------------------------------------------------------------------------
    def load(self) -> dict:
        """{question ref: record}; a damaged file is moved aside (with a warning), never reused."""
        with self._locked():
            return self._read()

    def get(self, ref: str) -> dict | None:
        return self.load().get(ref)

    def _read(self) -> dict:
        try:
            raw = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        try:
            data = json.loads(raw)
            if not isinstance(data, dict) or not isinstance(data.get("answers"), dict):
                raise ValueError("no 'answers' mapping")
            return data["answers"]
        except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep
            aside = self.path.with_name(f"{self.path.stem}.damaged-{time.strftime('%Y%m%d-%H%M%S')}{self.path.suffix}")
            os.replace(self.path, aside)
            self.warning = (f"The answers file {self.path} could not be read ({exc}). It was kept as {aside.name} "
                            f"and new answers go to a fresh file; ask your instructor if you need the old ones.")
            print(f"lablib.quiz: {self.warning}", file=sys.stderr)
            return {}

    # -- writing ---------------------------------------------------------------------------------
    def record(self, key: str, response, correct: bool | None, where: str | None = None) -> dict:
        """Store ``response`` as the latest answer under ``key`` (see ``Question.key``), given in
        ``where``; ``correct`` is None when nothing is judged (exam mode). The first answer of a record
        is kept as its first attempt. Returns the record."""
        def change(old):
            rec = dict(old)
            rec.update(response=response, attempts=_count(old.get("attempts")) + 1)
            if correct is None:
                rec["mode"] = "exam"
            else:
                rec["correct"] = bool(correct)
                if "response" not in old:  # nothing answered before: this is the first attempt
                    rec["first_response"], rec["first_correct"] = response, bool(correct)
            return rec

        return self._update(key, where, change)

    def reveal(self, key: str, where: str | None = None) -> dict:
        """Mark the answer under ``key`` as shown to the learner: it scores no point."""
        return self._update(key, where, lambda old: {**old, "revealed": True, "attempts": _count(old.get("attempts"))})

    def put(self, key: str, record: dict) -> None:
        """Replace the record under ``key`` as it is (the instructor's answer key uses this)."""
        with self._locked():
            answers = self._read()
            answers[key] = record
            self._write(answers)

    def _update(self, key, where, change) -> dict:
        with self._locked():
            answers = self._read()
            old = answers.get(key)
            rec = change(old if isinstance(old, dict) else {})
            if where is not None:
                rec["where"] = where
            rec["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
            answers[key] = rec
            self._write(answers)
        return rec

    def _write(self, answers: dict):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"version": VERSION, "answers": answers}, f, indent=1, sort_keys=True, ensure_ascii=False)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)  # atomic: readers see the old file or the new one, never half
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    @contextlib.contextmanager
    def _locked(self):
        """A lock shared by threads of this process and by other processes (a lock file)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with _thread_lock, open(self.path.with_name(f".{self.path.name}.lock"), "a+") as lockfile:
            try:
                import fcntl
            except ImportError:  # Windows: the thread lock still serialises this process
                yield
                return
            fcntl.flock(lockfile, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lockfile, fcntl.LOCK_UN)


def _count(value) -> int:
    """An attempt count read back from the file; anything but a whole number >= 0 counts as 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0
