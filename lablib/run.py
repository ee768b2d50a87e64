"""A lab's core under torchrun: the same checks and the same exercise code as the notebook, on ranks that
torchrun starts, on one machine or several.

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        -m lablib.run LAB [LAB ...] [--notebook NOTEBOOK] [--trace FILE] [--timeout SECONDS]

LAB is a lab's name (welcome, sharding, collectives, prefetch, tensor, pipeline) or number, or ``all``;
several labs run one after the other on the same ranks (one rendezvous, one start), each with its own
trace, ``lablib-LAB-trace.json`` (or in the folder ``--trace`` names). Each rank reads
the notebook (the lab's solved source by default, or a learner's ``--notebook``), takes its exercise code
as ``lablib grade`` does (definitions only, under the lab's rules), and runs the lab's visible checks at
the world size torchrun gives: every rank runs each check's job, rank 0 judges it against the
single-process reference and prints the result. Checks written for another world size are skipped
with a note. Rank 0 then writes one Chrome trace of every rank's spans on rank 0's clock, those
of the last check's job (``Timeline.load(FILE).figure()`` draws it; https://ui.perfetto.dev opens it).
Exit status 0 when every check ran and passed.

Clocks: ranks on one machine share its monotonic clock; across machines they do not. Before the checks,
rank 0 measures each rank's offset by ping-pong (the round trip with the smallest time of 8; offset = the
peer's clock - the midpoint of the round trip, error at most half of it) and shifts that rank's spans by
it; an offset within its round trip is taken as 0.

NCCL with one GPU per rank when every rank of the node has one (``LOCAL_WORLD_SIZE`` GPUs), else Gloo on
the CPU.
"""
from __future__ import annotations

import argparse
import datetime
import linecache
import os
import sys
import time
from pathlib import Path

from .labs import LABS


def lab_names() -> dict[str, object]:
    """{name: Lab}: "pipeline", "05" and "05_pipeline_bubbles" for lab 05."""
    out = {}
    for lab in LABS:
        number, word = lab.notebook.split("_")[:2]
        out.update({word: lab, number: lab, lab.notebook: lab})
    return out


class RankPool:
    """What a check's ``collect`` needs of a ``Cluster``, on the ranks torchrun started: ``run(fn, *args)``
    runs ``fn`` on this rank, and every rank gets every rank's value, in rank order (a ``RankError``,
    as from a Cluster, when any rank raised). Like a Cluster's timeline, the spans kept are the last
    job's."""

    def __init__(self, backend: str, timeout: float):
        import torch.distributed as dist

        from .comm import device

        self.world_size, self.backend, self.timeout = dist.get_world_size(), backend, timeout
        self.device = device().type
        self.spans, self.origin_ns = [], 0  # the last job's spans on this rank, and when it started

    def run(self, fn, *args, **kwargs):
        import torch.distributed as dist

        from . import flight
        from .pool import RankError, groups
        from .pool import protocol as P
        from .pool.failures import failure_message
        from .pool.worker import describe
        from .gputime import timed_on_device
        from .timeline import RECORDER

        args, kwargs = P.for_rank(args, kwargs, dist.get_rank(), self.world_size)  # this rank's share of each PerRank
        dist.barrier()
        groups.job_started()
        flight.started()
        self.origin_ns = time.perf_counter_ns()
        RECORDER.start()
        try:  # shipped as a Cluster's ranks ship their values: tensors come back on the CPU
            value, failure = P.ship(timed_on_device(fn, args, kwargs), to_cpu=True), None
        except Exception as exc:  # noqa: BLE001 - it goes to rank 0's report, as from a Cluster
            value, failure = None, describe(exc)
        self.spans = RECORDER.stop()
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, (value, failure, flight.entries()))
        values = [None if v is None else P.unship(v) for v, _, _ in everyone]
        failures = {r: f for r, (_, f, _) in enumerate(everyone) if f is not None}
        if failures:
            done = [r for r in range(self.world_size) if r not in failures]
            flights = {r: entries for r, (_, _, entries) in enumerate(everyone)}
            raise RankError(failure_message(failures, done, "", self.world_size, self.timeout, flights=flights),
                            failures, results=values, flights=flights)
        return values


def clock_offsets(rounds: int = 8) -> dict[int, tuple[int, int]]:
    """On rank 0: {rank: (offset ns, round trip ns)}, each rank's clock minus rank 0's, from the fastest
    of ``rounds`` ping-pongs; {} elsewhere. Every rank must call it."""
    import torch
    import torch.distributed as dist

    from .comm import torch_device

    rank, n = dist.get_rank(), dist.get_world_size()
    buf = torch.zeros(1, dtype=torch.int64, device=torch_device())  # raw send/recv: Gloo takes no CUDA tensors
    out = {0: (0, 0)} if rank == 0 else {}
    for peer in range(1, n):
        best = None
        for _ in range(rounds):
            if rank == 0:
                t0 = time.perf_counter_ns()
                dist.send(buf, peer)
                dist.recv(buf, peer)
                t1 = time.perf_counter_ns()
                if best is None or t1 - t0 < best[1]:
                    best = (int(buf.item()) - (t0 + t1) // 2, t1 - t0)
            elif rank == peer:
                dist.recv(buf, 0)
                buf.fill_(time.perf_counter_ns())
                dist.send(buf, 0)
        if rank == 0:
            out[peer] = best
    return out


def _say(text: str = "", file=None) -> None:
    print(text, file=file or sys.stdout, flush=True)


def run_checks(lab, notebook: Path, pool: RankPool) -> tuple[int, int]:
    """The lab's visible checks at this world size with the notebook's exercise code, on ``pool``:
    (passed, failed or skipped). Rank 0 prints each result."""
    import torch.distributed as dist

    from .checks import CheckFailed, vet
    from .course.exercises import check_calls, exercise_code
    from .course.grade import read_submission
    from .rules.namespace import namespace
    from .paths import LABS as RELEASES

    rank, n = dist.get_rank(), dist.get_world_size()
    ex = exercise_code(read_submission(notebook))
    calls, _ = check_calls(read_submission(RELEASES / f"{lab.notebook}.ipynb"))
    ns = namespace()
    for cell in ex.cells:
        filename = f"<{notebook.name} {cell['name']}>"
        # inspect reads it back, so the lab's rules (checks.vet) apply here as in the notebook and the grader
        linecache.cache[filename] = (len(cell["source"]), None, cell["source"].splitlines(True), filename)
        exec(compile(cell["source"], filename, "exec"), ns)
    if rank == 0:
        for note in ex.notes:
            _say(f"  note: {note}")
    passed, other = 0, 0
    for gid, group in calls.items():
        call = next((c for c in group if c.world_size in (None, n)), None)
        if call is None:
            if rank == 0:
                _say(f"- {gid}: skipped, its check runs at {', '.join(str(c.world_size) for c in group)} ranks, not {n}")
            other += 1
            continue
        check = call.spec()
        if check.pool_only:  # not a failure, nor a size this launch could have had
            if rank == 0:
                _say(f"- {gid}: not run under torchrun: {check.pool_only}")
            continue
        fns = tuple(ns.get(name) for name in call.params)
        line = ""
        try:
            vet(check.task, check.params, fns, check.forbidden)
            if call.world_size is None:  # a check in one process: rank 0's
                if rank == 0:
                    line = check.judge(check.collect(fns, None, None, *check.inputs(None, None)), None, None)
            else:
                data = check.collect(fns, pool, None, *check.inputs(n, None))
                if rank == 0:
                    line = check.judge(data, n, None)
            ok = True
        except CheckFailed as exc:
            ok, line = False, str(exc)
        dist.barrier()
        passed, other = passed + ok, other + (not ok)
        if rank == 0:
            _say(f"✓ {check.task} passed{line}" if ok else f"✗ {line}")
    return passed, other


def write_trace(raw, offsets: dict, origin_ns: int, path: Path, title: str) -> str:
    """Gather every rank's spans to rank 0 and write them there as one Chrome trace."""
    import torch.distributed as dist

    from .timeline import Timeline

    n = dist.get_world_size()
    everyone = [None] * n if dist.get_rank() == 0 else None
    dist.gather_object(raw, everyone, dst=0)
    if dist.get_rank() != 0:
        return ""
    shift = {r: 0 if abs(off) <= rtt else off for r, (off, rtt) in offsets.items()}
    timeline = Timeline.from_raw(dict(enumerate(everyone)), shift, origin_ns, n, title=title,
                                 clock_error=max(rtt for _, rtt in offsets.values()) / 2e9)
    return timeline.save_chrome_trace(path)


def main(argv=None) -> int:
    names = lab_names()
    ap = argparse.ArgumentParser(prog="torchrun ... -m lablib.run", description=__doc__.splitlines()[0])
    ap.add_argument("lab", nargs="+", help=f"one or more of {', '.join(n for n in names if n.isalpha())} (or the "
                                            "labs' numbers), or all")
    ap.add_argument("--notebook", type=Path, help="a notebook of the lab whose exercise code to run (default: the "
                                                   "lab's solved source, sources/LAB.ipynb); one lab only")
    ap.add_argument("--trace", type=Path, help="where rank 0 writes the Chrome trace (default: lablib-LAB-trace.json); "
                                               "with several labs, a folder for their traces")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a collective may wait for a peer")
    args = ap.parse_args(argv)
    rank0 = os.environ.get("RANK", "0") == "0"
    wanted = [lab.notebook.split("_")[1] for lab in LABS] if args.lab == ["all"] else args.lab
    unknown = [name for name in wanted if name not in names]
    if unknown:
        if rank0:
            _say(f"lablib.run: no lab {unknown[0]!r}. Labs: " + ", ".join(
                f"{n} ({names[n].notebook})" for n in names if n.isalpha()) + ", or all", sys.stderr)
        return 2
    labs = list(dict.fromkeys(names[name] for name in wanted))
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        _say("lablib.run: start it with torchrun, e.g. `torchrun --nproc-per-node 2 -m lablib.run "
             f"{' '.join(args.lab)}` (a notebook uses lablib.cluster(n) instead)", sys.stderr)
        return 2
    if args.notebook and len(labs) > 1:
        _say("lablib.run: --notebook is one lab's notebook: name one lab with it", sys.stderr)
        return 2
    from .paths import SOURCES

    notebooks = [args.notebook or SOURCES / f"{lab.notebook}.ipynb" for lab in labs]
    missing = next((nb for nb in notebooks if not nb.is_file()), None)
    if missing is not None:
        if rank0:
            _say(f"lablib.run: {missing} is not a file: pass the lab's notebook with --notebook", sys.stderr)
        return 2

    import torch
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl = gpus >= local > 0  # a GPU per rank on this node; fewer: the ranks share them, over Gloo
    os.environ["LABLIB_DEVICE"] = "cuda" if gpus else "cpu"  # lablib.device(), as in a notebook's pool
    if gpus:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % gpus)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    dist.init_process_group("cpu:gloo,cuda:nccl" if nccl else "gloo", timeout=datetime.timedelta(seconds=args.timeout))
    from .pool import groups

    groups.install(args.timeout)  # the checks' groups as on a pool's ranks: this timeout, and alike on every rank
    try:
        rank, n = dist.get_rank(), dist.get_world_size()
        offsets = clock_offsets()
        # torch's first backward from a given gradient imports sympy (half a second): not in a timed job
        x = torch.ones(2, requires_grad=True)
        torch.autograd.backward(x * 2, torch.ones(2))
        if rank == 0:
            _say("clock offsets to rank 0: " + ", ".join(f"rank {r} {off / 1e3:+.1f} us (round trip {rtt / 1e3:.1f} us)"
                                                          for r, (off, rtt) in sorted(offsets.items()) if r))
        pool, ok = RankPool("nccl" if nccl else "gloo", args.timeout), True
        for lab, notebook in zip(labs, notebooks):
            if rank == 0:
                how = "NCCL" if nccl else f"Gloo; {local} ranks a node share {gpus} GPU(s)" if gpus else "Gloo"
                _say(f"lablib.run {lab.notebook}: {n} ranks ({how}), {notebook}")
            pool.spans, pool.origin_ns = [], 0  # this lab's trace holds this lab's last job only
            passed, other = run_checks(lab, notebook, pool)
            name = Path(f"lablib-{lab.notebook}-trace.json")
            trace = (args.trace / name if len(labs) > 1 else args.trace) if args.trace else name
            if rank == 0 and len(labs) > 1 and args.trace:
                args.trace.mkdir(parents=True, exist_ok=True)
            path = write_trace(pool.spans, offsets, pool.origin_ns, trace,
                               f"{lab.notebook}: the last check's job, {n} ranks under torchrun")
            if rank == 0:
                _say(f"{passed} check(s) passed, {other} failed or skipped; trace: {path} "
                     "(lablib.Timeline.load(path).figure(), or https://ui.perfetto.dev)")
            ok = ok and other == 0 and passed > 0
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's and PyTorch's teardown: a rank torn down there was killed now and then by
    # "terminate called without an active exception" (SIGABRT) after every check had passed, and the other
    # node's agent then waited out torchrun's 300 s exit barrier. Everything is written and flushed by here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
