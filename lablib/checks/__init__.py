"""Exercise checks, one module per lab (lab00.py, lab01.py, ...), each a ``Check`` owning its task id.

Every check has the same shape:
- ``collect`` runs the learner's functions (on the ranks, or in this process for single-process tasks)
  and returns plain data: tensors, numbers, strings, lists and dicts of them;
- ``judge``, pure, compares that data with a reference it computes itself and returns the success
  line, or raises ``CheckFailed`` with what differed and the likely cause.
In the notebook a check does both (``check_zero1(zero1_step, cluster)``). ``lablib grade`` runs only
``collect``, in a box, with the learner's exercise code, and judges the data outside the box. A collect
step never runs lablib's answers (``lablib.answers``, which the box does not hold): what it needs of them
(a schedule to execute, a weight's shard) it is given as data, ``Check.given``, computed outside. Before
either, the learner's functions are read (policy.py): ``None``, lablib's own functions and code that
reaches for the answers are refused with a reason. A failed check raises ``CheckFailed`` (an
AssertionError), so the check cell fails under nbval too.
"""
from __future__ import annotations

import importlib
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Mapping

from .. import p2p
from ..pool import Cluster, RankError, spare


class CheckFailed(AssertionError):
    def _render_traceback_(self):
        # IPython shows these lines instead of a traceback: what differed and why, not lablib's own
        # source lines (the learner's frames on the ranks are quoted in the message itself).
        return [f"\x1b[0;31mCheckFailed\x1b[0m: {self}"]


PASSED: set[str] = set()  # tasks whose check passed in this process (a lab can then use the learner's code)
TRIED: set[str] = set()  # tasks whose check ran in this process, passed or not


def answers(lab: str):
    """lablib's answers to lab ``lab``'s tasks (``lablib.answers.<lab>``), for a judge or a notebook-side
    measurement: imported when called, as a collect step in the grading box would find no such module."""
    return importlib.import_module(f"lablib.answers.{lab}")


def whose(fns: Mapping, tasks: Mapping[str, str], doing: str = "Measuring") -> set[str]:
    """The names in ``fns`` whose task (``tasks[name]``) passed its check in this process: a lab's
    measurement runs the learner's function for those and lablib's for the others (a function not checked
    may be wrong, or hang). Prints which, and why lablib's: the check has not run yet, or failed."""
    unknown = set(fns) - set(tasks)
    if unknown:
        raise TypeError(f"yours() takes {', '.join(tasks)}; got {', '.join(sorted(unknown))}")
    mine = {k for k in fns if tasks[k] in PASSED}
    yours = sorted({tasks[k] for k in mine})
    others = sorted(set(tasks.values()) - set(yours))
    failed = [t for t in others if t in TRIED]
    unrun = [t for t in others if t not in TRIED]
    why = "; ".join(part for part in (
        f"{', '.join(unrun)}: check not run yet in this kernel" if unrun else "",
        f"{', '.join(failed)}: check failed" if failed else "") if part)
    print(f"{doing} " + (f"your functions of {', '.join(yours)}" if yours else "lablib's functions")
          + (f"; lablib's for {', '.join(others)} ({why})" if yours and others else f" ({why})" if others else ""))
    return mine


def yours_of(lab: str, fns: Mapping) -> dict:
    """``fns`` (the learner's functions, by name) as a lab's measurement runs them: the learner's where its
    task's check passed in this process, lablib's answer (``lab``'s) for the others (``whose``)."""
    A = answers(lab)
    tasks = {name: task for task, names in A.TASKS.items() for name in names if name in fns}
    mine = whose(fns, tasks)
    return {k: fns[k] if k in mine else getattr(A, k) for k in fns}


class NotDone(CheckFailed):
    """The exercise still raises NotImplementedError."""


def not_done(task: str, what: str) -> NotDone:
    return NotDone(f"{task} is not done yet: {what} still raises NotImplementedError. "
                   "Replace the `raise` line with your code.")


def strict() -> bool:
    """Whether a task not done yet fails its check cell: under nbval and in tests (``LABLIB_STRICT=1``,
    set by the repository's conftest.py), not in a learner's notebook, where Run All goes on to the rest
    of the lab and each open task prints one line."""
    return os.environ.get("LABLIB_STRICT", "") not in ("", "0")


def passed(task: str, message: str) -> None:
    print(f"✓ {task} passed{message}")


def run_on_ranks(cluster: Cluster, task: str, job, *args, hints=()):
    """``cluster.run(job, *args)``, turning "not done yet" and rank errors into teaching messages.

    ``hints``: (text in the error, what it likely means) pairs, the first that matches added to the message.
    The text may be a compiled regex, and its hint then a function of the match (to name what the error
    names: a shape, a peer)."""
    __tracebackhide__ = True  # IPython shows the message, not this file's frames
    try:
        return cluster.run(p2p.strictly(job) if p2p.CHECKS else job, *args)
    except RankError as err:
        # Any rank's NotImplementedError, not only the first failed rank's: a peer of a rank that raised it
        # may be the lowest-numbered failure, stopped while it waited for that rank.
        exc = next((e for e in map(err.exception, err.ranks or [0]) if isinstance(e, NotImplementedError)), None)
        if exc is not None:
            raise not_done(task, f"your code ({exc})") from None
        likely = None
        for text, hint in hints:
            found = text.search(str(err)) if isinstance(text, re.Pattern) else text in str(err)
            if found:
                likely = hint(found) if callable(hint) else hint
                break
        raise CheckFailed(f"{task}: your function failed on the ranks." + (f" Likely: {likely}" if likely else "")
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


def max_error(got, want, what: str) -> float:
    """The largest difference between ``got`` (data the learner's code returned) and the reference
    ``want``: CheckFailed, naming ``what``, unless ``got`` is a tensor of want's shape and a number dtype.
    A judge computes on nothing it has not checked (a returned shape that broadcasts against the
    reference could take the grader's memory)."""
    import torch

    if not isinstance(got, torch.Tensor) or got.dtype == torch.bool or got.is_complex():
        raise CheckFailed(f"{what} is {type(got).__name__ if not isinstance(got, torch.Tensor) else got.dtype}, "
                          f"expected a tensor of shape {tuple(want.shape)}.")
    if got.shape != want.shape:
        raise CheckFailed(f"{what} has shape {tuple(got.shape)}, expected {tuple(want.shape)}.")
    return (got.double() - want.double()).abs().max().item() if got.numel() else 0.0


def params_error(task: str, rank: int, what: str, params: list, ref: list, hint: str) -> float:
    """The largest difference between one rank's trained parameters (a tensor per unit) and the
    single-process reference; CheckFailed past 1e-6. ``what`` says what was trained."""
    if not isinstance(params, list) or len(params) != len(ref):
        raise CheckFailed(f"{task}: rank {rank} returned {len(params) if isinstance(params, list) else 'no'} units, "
                          f"expected {len(ref)}.")
    err = max(max_error(got, want, f"{task}: rank {rank}'s unit {k}")
              for k, (got, want) in enumerate(zip(params, ref)))
    if not err <= 1e-6:
        raise CheckFailed(f"{task}: after {what}, rank {rank}'s parameters differ from the single-process "
                          f"reference by {err:.2e} (tolerance 1e-6). {hint}")
    return err


@contextmanager
def pools(cluster: Cluster | None, sizes=(2, 3, 4)):
    """Yields a pool per size, started when reached: the notebook's own where its size matches, else an
    extra one like it (``lablib.pool.spare``: kept for the next check of that size; a check that fails at its first
    size starts no other). A size of None (a check that runs in this process) gets None."""
    # like it: its device, its timeout and (NCCL needing a GPU per rank, which another size may not have) Gloo
    like = dict(backend="gloo" if cluster.backend == "gloo" else "auto", timeout=cluster.timeout,
                device=cluster.device) if cluster is not None else {}

    def each():
        for n in sizes:
            if n is None or (cluster is not None and n == cluster.world_size):
                yield None if n is None else cluster
            else:
                yield spare(n, **like)
    yield each()


def vet(task: str, params: tuple, fns: tuple, forbidden: Mapping[str, str]) -> None:
    """Refuse what is not the learner's own code: None, something that is not a function, lablib's own
    functions (``ring_all_reduce = collectives.ring_all_reduce``), and code the rules forbid."""
    __tracebackhide__ = True
    from ..rules.policy import reachable_problems

    for name, fn in zip(params, fns):
        if fn is None:
            raise CheckFailed(f"{task}: {name} is None. Define {name} with `def` in the exercise cell, with your code.")
        if not callable(fn):
            raise CheckFailed(f"{task}: {name} is a {type(fn).__name__}, expected your function.")
        module = getattr(fn, "__module__", None) or ""
        if module == "lablib" or module.startswith("lablib."):
            raise CheckFailed(f"{task}: {name} is lablib's own {module}.{getattr(fn, '__qualname__', '')}. "
                              "The task is to write it yourself.")
        problems = reachable_problems(fn, forbidden)
        if problems:
            raise CheckFailed(f"{task}: {name} " + "; ".join(problems) + ".")


@dataclass(frozen=True)
class Check:
    """One graded check. Called in the notebook: ``check(*learner_functions, cluster)``, or with
    ``world_size=`` (a pool of that size is started) and ``seed=`` (other inputs; grading draws one)."""
    task: str
    params: tuple                          # the exercise's function names, e.g. ("unshard", "reshard")
    collect: Callable                      # collect(fns, pool, seed) -> plain data; pool is None if local
    judge: Callable                        # judge(data, world_size, seed) -> success text
    world_sizes: tuple = (4,)              # checked when no cluster is given; () runs in this process
    forbidden: Mapping[str, str] = field(default_factory=dict)
    every_size: bool = False               # with a cluster, check every one of world_sizes anyway
    given: Callable | None = None          # given(world_size, seed) -> plain data collect gets as its 4th
                                           # argument: what it needs of lablib's answers, computed outside the box
    after: tuple = ()                      # earlier tasks whose functions it runs too (lab 03's 3.2 runs 3.1's)
    pool_only: str = ""                    # why it runs on a lablib pool only, not under torchrun (lablib.run)

    def inputs(self, world_size, seed) -> tuple:
        """collect's arguments after (fns, pool, seed): the given data, if the check has any."""
        return () if self.given is None else (self.given(world_size, seed),)

    @property
    def local(self) -> bool:
        return not self.world_sizes

    def sizes(self, cluster=None, world_size=None) -> tuple:
        if self.local:
            return (None,)
        if world_size is not None:
            return (int(world_size),)
        if cluster is not None and not self.every_size:
            return (cluster.world_size,)
        if cluster is not None and cluster.world_size in self.world_sizes:  # its own size first: no new pool
            return (cluster.world_size,) + tuple(n for n in self.world_sizes if n != cluster.world_size)
        return self.world_sizes

    def __call__(self, *args, world_size=None, seed=None) -> None:
        __tracebackhide__ = True
        cluster = args[-1] if args and isinstance(args[-1], Cluster) else None
        fns = args[:-1] if cluster is not None else args
        if len(fns) != len(self.params):
            raise TypeError(f"{self.task}'s check takes {', '.join(self.params)} (and the cluster), "
                            f"got {len(fns)} function(s)")
        vet(self.task, self.params, fns, self.forbidden)
        sizes = self.sizes(cluster, world_size)
        try:
            PASSED.discard(self.task)
            TRIED.add(self.task)
            with pools(cluster, sizes) as ranks:
                for size, pool in zip(sizes, ranks):
                    data = self.collect(fns, pool, seed, *self.inputs(size, seed))
                    passed(self.task, self.judge(data, size, seed))
            PASSED.add(self.task)
        except NotDone as exc:
            if strict():
                raise
            print(f"\x1b[0;33m✗ {exc}\x1b[0m\n  (The rest of the lab still runs; this task scores when its check "
                  "passes.)")
        except CheckFailed as exc:
            unproven = [task for task in self.after if task not in PASSED]
            if not unproven:
                raise
            raise CheckFailed(f"{exc}\n\n{self.task}'s check runs your functions of {', '.join(unproven)} too, whose "
                              "check has not passed in this kernel: the difference may be theirs. Pass that check "
                              "first.") from None
