"""Lab 05's references, on the ranks: PyTorch's own pipeline schedules (``torch.distributed.pipelining``:
``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``) on the
lab's model, the checks' job (an executor run on every schedule, its gradients returned beside
PyTorch's), and the measured runs behind the notebook's timelines, bubble table and memory counts."""
from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import comm, p2p
from .pipeline import data, model, stages_of
from .prefetch import start_recording

# The check's model: 8 blocks of width 32, 4 micro-batches of 4 rows; its four schedules (name, v).
WIDTH, ROWS, M = 32, 16, 4
CHECKED = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))
TORCH = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
         "zb-h1": "ScheduleInterleavedZeroBubble"}
# What the measurements run: real compute (width 512, micro-batches of 64 rows: a block's forward is a
# millisecond or two on one core) or simulated (each block's F, B and W wait COST seconds).
REAL = dict(width=768, rows_per_mb=128)
COST = 0.002


def _grads(params: dict) -> dict:
    return {str(s): [p.grad.detach().clone() if p.grad is not None else None for p in ps] for s, ps in params.items()}


def _torch_schedule(name: str, m: int, v: int, seed: int, width: int, rows: int):
    """PyTorch's schedule ``name`` (TORCH) on this rank's stages of the lab's model: (schedule, its
    step's arguments, {stage: module})."""
    from torch.distributed import pipelining

    r, p = dist.get_rank(), dist.get_world_size()
    dev = comm.torch_device()
    blocks = list(model(width, seed=seed).to(dev))
    xs, ys = ([t.to(dev) for t in ts] for ts in data(width, rows, m, seed))
    n = p * v
    per = len(blocks) // n
    mods = {s: nn.Sequential(*blocks[s * per:(s + 1) * per]) for s in range(r, n, p)}
    stages = [pipelining.PipelineStage(mods[s], s, n, dev) for s in sorted(mods)]
    cls = getattr(pipelining, TORCH[name])
    single = issubclass(cls, pipelining.schedules.PipelineScheduleSingle)
    schedule = cls(stages[0] if single else stages, m, loss_fn=F.mse_loss)
    args = (torch.cat(xs),) if 0 in mods else ()
    kwargs = {"target": torch.cat(ys)} if n - 1 in mods else {}
    return schedule, args, kwargs, mods


def torch_job(name: str, m: int, v: int, seed: int = 0) -> dict:
    """PyTorch's schedule ``name`` on the check's model: this rank's stages' gradients, and the actions
    PyTorch planned for this rank, where it plans them ("0F1": stage 0, forward, micro-batch 1)."""
    schedule, args, kwargs, mods = _torch_schedule(name, m, v, seed, WIDTH, ROWS)
    schedule.step(*args, **kwargs)
    order = getattr(schedule, "pipeline_order", {}).get(dist.get_rank())
    return {"grads": {str(s): [q.grad.detach().clone() for q in mods[s].parameters()] for s in mods},
            "order": [str(a) for a in order if a is not None] if order else None}


def shares(p: int, seed=None):
    """Each of ``p`` ranks' share of the check's model and batch, per v of CHECKED (a ``PerRank``): its stages'
    blocks (None in place of the others'), the micro-batches' inputs where it holds the first stage and their
    targets where it holds the last (zeros otherwise, for their shapes), made here from the seed."""
    from ..pool import PerRank

    xs, ys = data(WIDTH, ROWS, M, seed or 0)
    blocks, out = list(model(WIDTH, seed=seed or 0)), []
    for r in range(p):
        mine = {}
        for v in sorted({v for _, v in CHECKED}):
            held, per = range(r, p * v, p), len(blocks) // (p * v)
            mine[v] = ([b if i // per in held else None for i, b in enumerate(blocks)],
                       xs if 0 in held else [torch.zeros_like(x) for x in xs],
                       ys if p * v - 1 in held else [torch.zeros_like(y) for y in ys])
        out.append(mine)
    return PerRank(out)


def execute_job(execute_fn, plans: dict, share: dict, compare: bool = True) -> dict:
    """The checks' job: the learner's executor on each CHECKED schedule (``plans``: {name: per rank its
    actions}, lablib's schedules given as data, as the grading box holds no answers; ``share``: this rank's
    part of ``shares``), and with ``compare`` PyTorch's schedule of the same name on the same model (the seed
    0's). Per schedule: this rank's stages' gradients, the messages it sent and received ("send 512": which,
    bytes), the actions its stages ran ("F2/0": forward of micro-batch 2 on stage 0; "B", "BW" or "W"), what they
    still hold, and PyTorch's gradients."""
    r, p = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, v in CHECKED:
        blocks, xs, ys = copy.deepcopy(share[v])  # each schedule starts from the same weights, no gradient
        blocks = [None if b is None else comm.to_device(b) for b in blocks]
        xs, ys = ([comm.to_device(t) for t in ts] for ts in (xs, ys))
        stages = stages_of(r, p, v, blocks, xs, ys)
        # what is judged is held here, out of reach of the executor (which may change the dict and the stages)
        mine = dict(stages)
        params = {s: [q for b in st.blocks for q in b.parameters()] for s, st in mine.items()}
        record = next(iter(mine.values())).rank_held
        works: list = []
        plan = [tuple(a) for a in plans[name][r]]
        p2p.prepare()
        try:
            _, ops = comm.watched(execute_fn, stages, plan, works=works)
        except Exception as exc:
            exc.add_note(f"(while running the {name} schedule)")  # which schedule: the checks' hints read it
            raise
        left = [f"stage {s} holds micro-batch {mb}" for s, st in mine.items() for mb in st._held]
        unwaited = [w.op for w in works if not w.waited]
        for w in works:  # a send left in flight must not meet the next schedule's messages
            w.wait()
        out[name] = {"grads": _grads(params), "ops": ops, "left": left, "unwaited": unwaited,
                     "ran": [f"{k}{mb}/{s}" for k, mb, s in record.actions()],
                     "torch": torch_job(name, M, v, 0)["grads"] if compare else None}
    return out


def step_job(execute_fn, schedule_fn, m: int, v: int = 1, cost: float | None = None, repeats: int = 3,
             rows: int | None = None) -> dict:
    """``repeats`` measured steps of ``schedule_fn(p, m, v)`` with ``execute_fn``, after a warm-up step; the
    timeline records the last. Real compute (REAL) or, with ``cost``, simulated. Returns per step its
    seconds and this rank's busy seconds (in F, B and W), and the peak bytes of activations this rank
    held and one micro-batch's. ``rows``: the batch's rows (default: m micro-batches of REAL's, or 4 rows
    each when simulated)."""
    r, p = dist.get_rank(), dist.get_world_size()
    width, per_mb = (32, 4) if cost else (REAL["width"], REAL["rows_per_mb"])
    blocks = list(comm.to_device(model(width)))
    xs, ys = ([comm.to_device(t) for t in ts] for ts in data(width, rows or per_mb * m, m))
    plan = schedule_fn(p, m, v)[r]
    seconds, busy, stages = [], [], None
    for i in range(repeats + 1):
        if i == repeats:
            start_recording()
        else:
            dist.barrier()
        for b in blocks:
            b.zero_grad(set_to_none=True)
        stages = stages_of(r, p, v, blocks, xs, ys, cost)
        t0 = time.perf_counter()
        p2p.prepare()
        execute_fn(stages, plan)
        comm.synchronize()
        dist.barrier()
        if i:
            seconds.append(time.perf_counter() - t0)
            busy.append(sum(st.busy for st in stages.values()))
    first = next(iter(stages.values()))
    # a micro-batch's activations through all of this rank's layers (v stages of 1/v of them)
    return {"seconds": seconds, "busy": busy, "peak": first.rank_held.peak,
            "per_mb": sum(st.per_mb for st in stages.values())}


def torch_step_job(name: str, m: int, v: int = 1, repeats: int = 3) -> list:
    """PyTorch's schedule on the REAL model: the seconds of ``repeats`` steps after a warm-up."""
    schedule, args, kwargs, mods = _torch_schedule(name, m, v, 0, REAL["width"], REAL["rows_per_mb"] * m)
    out = []
    for i in range(repeats + 1):
        for mod in mods.values():
            mod.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        schedule.step(*args, **kwargs)
        comm.synchronize()
        dist.barrier()
        if i:
            out.append(time.perf_counter() - t0)
    return out
