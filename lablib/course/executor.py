"""Inside the grading box, started by its supervisor (runner.py): run a learner's exercise code, compiled with
the guards (rules/guards.py), and the checks' ``collect`` step; write plain data.

    python -m lablib.course.executor < REQUEST      (records to the pipe whose fd is in LABLIB_RECORDS_FD)

The request (JSON on standard input, which is then closed: what checks are given is left nowhere for exercise
code to read) lists per lab the exercise cells' sources and the check calls; each call's outcome goes back to
the supervisor as one JSON line as soon as it is known, so what was collected before a time limit or a crash
is kept. This process holds neither the run's nonce nor the pipe to grade.py, and its ranks (forked from its
fork server, which closes the records pipe) hold not even the records pipe. Nothing here judges.
"""
from __future__ import annotations

import importlib
import json
import linecache
import os
import resource
import signal
import sys
import threading
import traceback

from ..rules.guards import compile_exercise
from ..rules.namespace import namespace

MAX_FILE = 256 << 20  # bytes of any file the box writes (results are a few MB)


class Deadline:
    """Presses the stop button (SIGINT to this process) when a check runs past ``seconds``."""

    def __init__(self, seconds: float):
        self.seconds, self.fired = seconds, False
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True

    def _fire(self):
        self.fired = True
        os.kill(os.getpid(), signal.SIGINT)

    def __enter__(self):
        self._timer.start()
        return self

    def __exit__(self, *exc):
        self._timer.cancel()


def load_harness(texts: dict[str, str]) -> None:
    """The answers modules a lab builds on (``labs.builds_on``: lab 08 runs lab 04's tensor-parallel MLP and lab
    05's executor), made from the text the request gives (the box's answers folder is empty): modules of this
    process only, which its checks hand to the ranks by value (cloudpickle), never files in the box."""
    import types

    import cloudpickle

    for name, text in texts.items():
        module = types.ModuleType(f"lablib.answers.{name}")
        module.__package__ = "lablib.answers"
        sys.modules[module.__name__] = module
        exec(compile(text, f"<lablib.answers.{name}>", "exec"), module.__dict__)
        cloudpickle.register_pickle_by_value(module)


def main() -> int:
    from ..checks import CheckFailed, vet
    from ..rules.namespace import guard_processes
    from ..pool import Cluster, zygote
    from .plain import NotPlain, dumps, loads

    zygote.start_here()  # one thread, no torch op yet: the ranks fork from a copy of this process
    guard_processes()  # exercise code starts no process, here or on the ranks (which set the same hook)
    # A check's time limit is SIGINT (Deadline): a grader started with SIGINT ignored (`nohup lablib grade
    # ... &`) passes that on, and a check looping in this process would then run to the box's time limit.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    request = json.loads(sys.stdin.buffer.read())
    out = os.fdopen(int(os.environ.pop("LABLIB_RECORDS_FD")), "w", encoding="utf-8")
    # what a check is given (lablib's schedules, say) is not left for exercise code to find
    sys.stdin.close()
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    # No file written here grows past what results need (where the box has no tmpfs of its own, its folder is
    # on the grader's disk).
    resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_FILE, MAX_FILE))
    limit = float(request["check_timeout"])
    load_harness(request.get("harness", {}))
    # Out of the box's writable folder, which is the ranks' working directory and on their import path.
    os.chdir("/")

    def emit(**record):
        out.write(json.dumps(record) + "\n")
        out.flush()

    pools: dict[int, Cluster] = {}
    try:
        for lab in request["labs"]:
            ns = namespace()
            for cell in lab["cells"]:
                filename = f"<{lab['lab']} {cell['name']}>"
                # inspect can read it back, so each check's rules apply here too (checks.vet)
                linecache.cache[filename] = (len(cell["source"]), None, cell["source"].splitlines(True), filename)
                try:
                    exec(compile_exercise(cell["source"], filename), ns)  # the rules, held as it runs
                except BaseException as exc:  # noqa: BLE001 - a learner's cell may raise anything
                    emit(lab=lab["lab"], cell=cell["name"],
                         error=f"{type(exc).__name__}: {exc}".strip()[:2000])
            failed = set()  # graded cells with a failed call: their later calls need not run
            for call in lab["calls"]:
                if call["group"] in failed:
                    continue
                check = getattr(importlib.import_module(f"lablib.checks.{call['module']}"), call["check"])
                fns = tuple(ns.get(name) for name in call["params"])
                size, seed = call["world_size"], call["seed"]
                try:
                    vet(check.task, check.params, fns, check.forbidden)
                    pool = None
                    if size is not None:
                        if size not in pools:
                            pools[size] = Cluster(size, timeout=min(30.0, limit), quiet=True)
                        pool = pools[size]
                    with Deadline(limit) as deadline:
                        try:
                            given = () if call.get("given") is None else (loads(call["given"]),)
                            data = check.collect(fns, pool, seed, *given)
                        except KeyboardInterrupt:
                            if not deadline.fired:
                                raise
                            raise CheckFailed(f"{check.task}: stopped after {limit:g} s (the time limit of one "
                                              "check). Does a loop never end, or a rank wait for a message "
                                              "nobody sends?") from None
                    emit(id=call["id"], data=dumps(data))
                    continue
                except CheckFailed as exc:
                    emit(id=call["id"], error=str(exc)[:4000])
                except NotPlain as exc:
                    emit(id=call["id"], error=f"{check.task}: your function returned {exc}; return tensors, "
                                              "numbers and lists of them.")
                except Exception as exc:  # noqa: BLE001
                    emit(id=call["id"], error=f"{check.task}: {type(exc).__name__}: {exc}"[:4000])
                failed.add(call["group"])
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        for pool in pools.values():
            pool.close()
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
