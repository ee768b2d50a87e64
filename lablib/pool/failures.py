"""How a failed job is reported: ``RankError``, with the root cause first and one line per other rank."""
from __future__ import annotations

import pickle
import re
import signal

from .groups import RULE
from .protocol import Failure

NCCL_RULES = "(NCCL's rules)"  # marks strict mode's timeouts (lablib.p2p writes it, the checks' hints read it)
_GROUP_OPS = {"new_group", "new_subgroups", "new_subgroups_by_enumeration", "split_group", "init_device_mesh"}


class RankError(RuntimeError):
    """One or more ranks failed or did not finish.

    ``failures`` maps rank -> ``Failure`` (type, message, traceback, ...); ``unfinished`` lists the ranks
    that were stopped; ``results`` holds the values of the ranks that finished (None elsewhere);
    ``flights`` each rank's flight recorder, {rank: entries} (``flight``).
    """

    def __init__(self, message, failures=None, unfinished=(), results=None, flights=None):
        super().__init__(message)
        self.failures: dict[int, Failure] = failures or {}
        self.unfinished = list(unfinished)
        self.results = results
        self.flights = flights or {}

    @property
    def ranks(self):
        return sorted(set(self.failures) | set(self.unfinished))

    def flight(self, rank) -> list:
        """What ``rank`` last issued of lablib's collectives and messages in the job, oldest first: entries
        ``(seq, op, nbytes, dtype, shape, group, peer)`` (``lablib.flight``), whether it failed, finished,
        died or was killed."""
        return list(self.flights.get(rank, ()))

    def exception(self, rank):
        """The exception object raised on ``rank`` (None when it could not be sent back)."""
        f = self.failures.get(rank)
        try:
            return pickle.loads(f.exception) if f and f.exception else None
        except Exception:
            return None


def signal_name(returncode) -> str:
    if returncode is not None and returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            pass
    return f"exit code {returncode}"


def clean(message: str) -> str:
    """Gloo/c10d messages without their C++ source paths and option dumps."""
    message = re.sub(r"\[[^\]]*\.(?:cc|cpp|h):\d+\] ", "", message)
    message = re.sub(r"TensorOptions\(dtype=.*?device=([\w:]+).*?memory_format=\([^)]*\)\)", r"\1", message)
    return message.strip()


def category(f: Failure) -> str:
    if f.type in ("Stuck", "WorkerDied"):
        return f.type
    if f.interrupted:
        return "stopped"
    if "Connection closed by peer" in f.message or "Connection reset by peer" in f.message:
        return "lost peer"
    if "Timed out" in f.message or "timed out" in f.message:
        return "timeout"
    return "error"


_ORDER = ["error", "WorkerDied", "timeout", "stopped", "Stuck", "lost peer"]
def _send_recv_hint(ops: set) -> str:
    """What a send/recv deadlock means, for what the blocked ranks were doing (isend/irecv: waiting on the
    handle of a message posted without blocking)."""
    if ops & {"isend", "irecv"}:
        return ("Hint: a rank waited on a message it had posted (lablib.isend/irecv) whose other side never came: "
                "its peer did not post the matching irecv/isend (it skipped a step, sent to another rank), or posted "
                "it only after waiting on one of its own. Post every send and receive of a step before waiting on "
                "any (as one lablib.exchange), and give each send a receive on its peer, in the same order.")
    if ops == {"recv"}:
        lead = ("every rank is blocked in recv, each waiting for a message its peer sends only after its own recv "
                "returns: nobody sends.")
    elif ops == {"send"}:
        lead = ("every rank is blocked in send, and a blocking send waits until its peer receives: all ranks "
                "send first, nobody receives.")
    else:
        lead = "a blocking send waits until its peer receives, and a recv until its peer sends."
    return (f"Hint: {lead} Alternate the order (even ranks send first, odd ranks receive first), or post "
            "the send and the receive together as one lablib.exchange and wait on it.")


def failure_message(failures: dict[int, Failure], finished, stop_reason: str, world_size: int, timeout: float,
                    cells: dict | None = None, flights: dict | None = None) -> str:
    """Root cause first (the earliest real error), then one line per other rank, then tracebacks, in
    which a notebook cell's file is named as IPython names it (``cells``: {file: "Cell In[5]"})."""
    cats = {r: category(f) for r, f in failures.items()}
    ranks = sorted(failures, key=lambda r: (_ORDER.index(cats[r]), failures[r].time))
    head, others = _headline(failures, cats, ranks, stop_reason, world_size, timeout)
    lines = [head]
    for r in sorted(others, key=lambda r: (_ORDER.index(cats[r]), r)):
        same = cats[r] == "error" and (failures[r].type, failures[r].message) == (failures[ranks[0]].type,
                                                                                    failures[ranks[0]].message)
        lines.append(f"  rank {r}: " + (f"the same {failures[r].type}" if same else _one_line(failures[r], cats[r], timeout)))
    if finished:
        lines.append(f"  finished: rank(s) {_join(sorted(finished))}")
    blocked = {_op(failures[r]) for r in ranks if cats[r] == "timeout"}
    if any(NCCL_RULES in f.message for f in failures.values()):
        pass  # strict mode's own report says who waits for whom and the fix (lablib.p2p)
    elif blocked and blocked <= {"send", "recv", "isend", "irecv"}:
        lines.append(_send_recv_hint(blocked))
    elif "timeout" in cats.values():
        lines.append(f"Hint: a collective waited {timeout:g} s for a peer that never joined it. Every rank must call "
                     "the same collectives in the same order, with matching shapes, and every member of a group "
                     "(dist.new_group) must join each collective on it; lablib.cluster(n, debug=True) names the "
                     "first mismatch at once.")
    if {"timeout", "stopped", "Stuck", "WorkerDied", "lost peer"} & set(cats.values()):
        lines += _flight_lines(flights or {})
    broken = sorted(r for r in ranks if failures[r].restart)
    if broken:
        lines.append(f"Hint: rank(s) {_join(broken)} took a CUDA error that stays with the process (every later call "
                     "on its GPU would fail), so lablib restarted them. The GPU reports a kernel's error at a later "
                     "call, so the line named may not be the one at fault: an index out of range is the usual cause. "
                     "The same code on CPU ranks, lablib.cluster(n, device=\"cpu\"), fails at its line with an "
                     "IndexError.")
    making = sorted(r for r in ranks if _op(failures[r]) in _GROUP_OPS and cats[r] != "error")
    if making and not any(f.type == "GroupMismatch" for f in failures.values()):
        lines.append(f"Hint: rank(s) {_join(making)} did not get past making a process group: {RULE}.")
    text = "\n".join(lines + _tracebacks(failures, cats, ranks))
    for filename, name in (cells or {}).items():
        text = text.replace(f'File "{filename}", line', f"{name}, line")
    return text


def _flight_lines(flights: dict, last: int = 3) -> list[str]:
    """Each rank's last lablib calls (its flight recorder), for a report of a hang."""
    from ..flight import line

    kept = {r: entries for r, entries in sorted(flights.items()) if entries}
    if not kept:
        return []
    return ["What each rank last issued (lablib's flight recorder, oldest first; RankError.flight(rank) has "
            "more):"] + [f"  rank {r}: " + ", ".join(line(e) for e in entries[-last:]) for r, entries in kept.items()]


def _op(f: Failure) -> str:
    return f.op or "a collective"


def _headline(failures, cats, ranks, stop_reason, world_size, timeout):
    root = ranks[0]
    f = failures[root]
    if cats[root] in ("error", "WorkerDied"):
        what = clean(f.message) if cats[root] == "WorkerDied" else f"{f.type}: {clean(f.message)}"
        return f"rank {root} of {world_size} failed: {what}", ranks[1:]
    if cats[root] == "timeout":
        timed = sorted(r for r in ranks if cats[r] == "timeout")
        return (f"rank(s) {_join(timed)} of {world_size} timed out after {timeout:g} s waiting for a peer: "
                + ", ".join(f"rank {r} in {_op(failures[r])}" for r in timed)), [r for r in ranks if cats[r] != "timeout"]
    return f"rank(s) {_join(sorted(ranks))} of {world_size} did not finish ({stop_reason})", ranks


def _one_line(f: Failure, cat: str, timeout: float) -> str:
    return {
        "lost peer": f"left {_op(f)} because a peer had failed (Connection closed by peer)",
        "timeout": f"{_op(f)} timed out after {timeout:g} s waiting for a peer",
        "stopped": f"did not finish; stopped by lablib{' in ' + f.op if f.op else ''} (where it was: below)",
        "Stuck": "stuck inside a C++ call (usually a collective waiting for a peer) and did not respond to "
                 "SIGINT; killed and restarted",
        "WorkerDied": f.message,
        "error": f"{f.type}: {clean(f.message)[:200]}",
    }[cat]


def _tracebacks(failures, cats, ranks) -> list[str]:
    """Two tracebacks at most: the root cause, and where a stopped rank was (else a second view of it)."""
    with_tb = [r for r in ranks if failures[r].traceback and cats[r] in ("error", "timeout", "stopped")]
    stopped = [r for r in with_tb[1:] if cats[r] == "stopped"]
    second = [r for r in with_tb[1:] if _op(failures[r]) != _op(failures[with_tb[0]]) or cats[r] != cats[with_tb[0]]]
    out = []
    for r in with_tb[:1] + (stopped or second)[:1]:
        title = "where it was stopped" if cats[r] == "stopped" else "traceback"
        out.append(f"\n--- rank {r} {title} ---\n{clean(failures[r].traceback.rstrip())}")
    return out


def _join(ranks) -> str:
    return ", ".join(map(str, ranks))
