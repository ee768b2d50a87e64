"""The answers file: every answer a learner gives, kept next to the notebook.

``quiz_answers.json`` in the notebook's folder (the kernel's working directory; ``$LABLIB_ANSWERS``
names another file). One file serves every notebook in the folder, keyed by question (``fsdp/2``),
so a restarted kernel, Run All, nbval and ``lablib grade`` all read back what was answered.

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
VERSION = 1
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
        except ValueError as exc:
            aside = self.path.with_name(f"{self.path.stem}.damaged-{time.strftime('%Y%m%d-%H%M%S')}{self.path.suffix}")
            os.replace(self.path, aside)
            self.warning = (f"The answers file {self.path} could not be read ({exc}). It was kept as {aside.name} "
                            f"and new answers go to a fresh file; ask your instructor if you need the old ones.")
            print(f"lablib.quiz: {self.warning}", file=sys.stderr)
            return {}

    # -- writing ---------------------------------------------------------------------------------
    def record(self, ref: str, response, correct: bool) -> dict:
        """Store ``response`` as the answer to ``ref``; returns the record (with its attempt count)."""
        with self._locked():
            answers = self._read()
            old = answers.get(ref, {})
            rec = {"response": response, "correct": bool(correct), "attempts": int(old.get("attempts", 0)) + 1,
                   "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
            answers[ref] = rec
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
