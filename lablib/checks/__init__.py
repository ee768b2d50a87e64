"""Exercise checks, one module per lab (lab00.py, lab01.py, ...), each check owning its task id.

Every check has the same shape:
- a *job* that runs the learner's function (on the ranks, or in this process for single-process tasks)
  and returns plain data: tensors, numbers, lists of them;
- a pure *judge* that compares that data with the reference and returns the success line, or raises
  ``CheckFailed`` with what differed and the likely cause.
So the same check runs in the notebook, in a grader's clean process and under torchrun. A failed check
raises ``CheckFailed`` (an AssertionError), so the check cell fails under nbval and ``lablib grade``.
"""
from __future__ import annotations

from contextlib import contextmanager

from ..pool import Cluster, RankError


class CheckFailed(AssertionError):
    def _render_traceback_(self):
        # IPython shows these lines instead of a traceback: what differed and why, not lablib's own
        # source lines (the learner's frames on the ranks are quoted in the message itself).
        return [f"\x1b[0;31mCheckFailed\x1b[0m: {self}"]


def not_done(task: str, what: str) -> CheckFailed:
    return CheckFailed(f"{task} is not done yet: {what} still raises NotImplementedError. "
                       "Replace the `raise` line with your code.")


def passed(task: str, message: str) -> None:
    print(f"✓ {task} passed{message}")


def run_on_ranks(cluster: Cluster, task: str, job, *args, hints=()):
    """``cluster.run(job, *args)``, turning "not done yet" and rank errors into teaching messages.

    ``hints``: (text in the error, what it likely means) pairs, added to the message when they match."""
    __tracebackhide__ = True  # IPython shows the message, not this file's frames
    try:
        return cluster.run(job, *args)
    except RankError as err:
        first = err.ranks[0] if err.ranks else 0
        exc = err.exception(first)
        if isinstance(exc, NotImplementedError):
            raise not_done(task, f"your code ({exc})") from None
        likely = [hint for text, hint in hints if text in str(err)]
        raise CheckFailed(f"{task}: your function failed on the ranks." + (f" Likely: {likely[0]}" if likely else "")
                          + f"\n\n{err}") from None


def call_local(task: str, fn, what: str, hint: str, *args):
    """``fn(*args)`` in this process; ``what`` describes the call, ``hint`` follows an exception."""
    __tracebackhide__ = True
    try:
        return fn(*args)
    except NotImplementedError:
        raise not_done(task, fn.__name__) from None
    except Exception as exc:
        raise CheckFailed(f"{task}: {fn.__name__}({what}) raised {type(exc).__name__}: {exc}. {hint}") from None


@contextmanager
def pools(cluster: Cluster, sizes=(2, 3, 4)):
    """The notebook's pool plus pools of the other sizes, like it; the extra ones are closed after the
    check, so a notebook does not keep idle ranks (each holds a few hundred MB)."""
    extra = {n: Cluster(n, backend=cluster.backend, timeout=cluster.timeout, quiet=True)
             for n in sizes if n != cluster.world_size}
    try:
        yield [cluster if n == cluster.world_size else extra[n] for n in sizes]
    finally:
        for pool in extra.values():
            pool.close()
