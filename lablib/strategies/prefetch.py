"""FSDP as PyTorch's FSDP2 runs it: hooks around each unit's forward and backward gather, free and
reduce-scatter its parameters; prefetching issues the next units' all-gathers while this one computes,
and each gradient's reduce-scatter runs under the backward of the units before it (PyTorch FSDP, Zhao
et al. 2023, https://arxiv.org/abs/2304.11277, section 3.3: backward and forward prefetching).

Per unit i and step, ``train`` calls five moments, each ``fn(units, i, ctx)`` (``finish(units, ctx)``):

    pre_forward    its parameters must be whole  (prefetching: also issue the gathers of i+1..i+depth)
    post_forward   free them again
    pre_backward   whole again                   (prefetching: also issue those of i-1..i-depth)
    post_backward  reduce-scatter its gradient to the owners; free the parameters
    finish         after the whole backward: wait for reduce-scatters still in flight

then the sharded optimizer step on each rank's shard. Unlike lab 01's loop (fsdp.py), which recomputes
each unit's forward, this keeps autograd's saved activations, as FSDP does: freeing a unit's flat buffer
after its forward empties the storage its saved weights point to, and the gather before its backward
fills the same storage again. The hooks are the learner's (lablib's answers are in ``lablib.answers.lab03``).
"""
from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .. import comm
from ..memory import held_bytes
from ..profiling import steps_begin, steps_end
from ..timeline import RECORDER, RawSpan, _now, span
from ..toy import batch, build_model, loss_fn
from .flat import Unit, setup
from .fsdp import sum_then_divide_on_gloo
from .harness import Context, Optimizer, gather_full, rank_data


def no_finish(units, ctx):
    pass


@dataclass(frozen=True)
class Hooks:
    """The five moments of an FSDP unit (see the module's docstring): a learner's functions, or
    ``lablib.answers.lab03``'s (``PLAIN``, ``PREFETCH``)."""
    pre_forward: Callable
    post_forward: Callable
    pre_backward: Callable
    post_backward: Callable
    finish: Callable = no_finish


# -- running them ----------------------------------------------------------------------------------------
class Record:
    """What the units hold after each moment: the first step's log (for the checks), the peak bytes of
    gathered parameters (every step), and the forward and backward compute spans."""

    def __init__(self, units):
        self.units, self.log, self.peak, self.open_span = units, [], 0, None

    @property
    def logging(self) -> bool:
        return comm.WATCH[0] is not None

    @logging.setter
    def logging(self, on: bool):
        comm.WATCH[0] = [] if on else None

    def _unit_of(self, op, target, i=None) -> int:
        """The unit a collective writes into: an all-gather into its flat buffer, a reduce-scatter into
        its gradient shard (or, in the unit's own post_backward, into a shard-sized tensor); else -1."""
        for j, u in enumerate(self.units):
            if target is not None and target is (u.flat if op == "all_gather" else u.grad):
                return j
        if op == "reduce_scatter" and i is not None and isinstance(target, torch.Tensor) \
                and target.numel() == self.units[i].layout.shard_numel:
            return i
        return -1

    def after(self, moment: str, i):
        gathered = [j for j, u in enumerate(self.units) if u.flat.untyped_storage().nbytes()]
        self.peak = max(self.peak, sum(self.units[j].flat.untyped_storage().nbytes() for j in gathered))
        if self.logging:
            pending, stale = [], []
            for j, u in enumerate(self.units):
                if isinstance(u.work, comm.Work) and u.work.waited:
                    stale.append(j)
                elif isinstance(u.work, comm.Work):
                    pending.append([j, u.work.op, u.work.nbytes, self._unit_of(u.work.op, u.work.target) == j])
                elif u.work is not None:
                    pending.append([j, type(u.work).__name__, 0, False])
            issued = [[op, self._unit_of(op, target, i)] for op, target, *_ in comm.WATCH[0]]
            comm.WATCH[0].clear()
            self.log.append({"moment": moment, "unit": i, "gathered": gathered, "pending": pending, "stale": stale,
                             "issued": issued})

    def open(self, name: str, unit: int):
        self.open_span = (name, unit, _now())

    def close(self):
        if self.open_span is not None and RECORDER.spans is not None:
            name, unit, t0 = self.open_span
            RECORDER.spans.append(RawSpan(name, "compute", t0, _now(), 0, None, False, {"unit": unit}))
        self.open_span = None


def attach(units, ctx, hooks: Hooks, record: Record) -> list:
    """Register the hooks on each unit's module; returns the handles (``.remove()`` them after)."""
    handles, left = [], {}  # left[i]: unit i's parameters whose gradient is still to come
    for i, unit in enumerate(units):

        def pre_fwd(module, args, i=i):
            hooks.pre_forward(units, i, ctx)
            record.after("pre_forward", i)
            record.open(f"fwd unit {i}", i)

        def post_fwd(module, args, out, i=i):
            record.close()
            hooks.post_forward(units, i, ctx)
            record.after("post_forward", i)
            if out.requires_grad:  # fires when the gradient of the unit's output is ready: its backward is next
                out.register_hook(lambda grad, i=i: pre_bwd(i))

        def pre_bwd(i):
            hooks.pre_backward(units, i, ctx)
            record.after("pre_backward", i)
            record.open(f"bwd unit {i}", i)
            left[i] = len(list(units[i].module.parameters()))

        def grad_ready(param, i=i):  # after each parameter's gradient is accumulated
            left[i] -= 1
            if left[i] == 0:  # the unit's backward is done
                record.close()
                hooks.post_backward(units, i, ctx)
                record.after("post_backward", i)

        handles.append(unit.module.register_forward_pre_hook(pre_fwd))
        handles.append(unit.module.register_forward_hook(post_fwd))
        handles += [p.register_post_accumulate_grad_hook(grad_ready) for p in unit.module.parameters()]
    return handles


def start_recording() -> None:
    """After the warm-up: every rank starts the recorded steps together (a barrier, untraced), with the
    span clock restarted, the timeline emptied and, under ``lablib.profiled``, the profile begun."""
    import torch.distributed as dist

    dist.barrier()
    comm.restart_clock()
    steps_begin()
    if RECORDER.spans is not None:
        RECORDER.spans.clear()


def train(hooks: Hooks, model_name: str = "mlp", steps: int = 3, optimizer: Optimizer = Optimizer(),
          depth: int = 0, link: comm.Link | None = None, warmup: int = 0, seed: int = 0, data=None) -> dict:
    """Train on this rank (inside ``cluster.run``) with FSDP units driven by ``hooks``.

    ``depth``: how far ahead prefetching hooks gather (``ctx.depth``); ``link``: a simulated link
    (``comm.LINKS``) for every collective; ``warmup``: steps run, and not timed, before the ``steps``
    timed ones, of which the timeline records the last; ``seed``: other initial weights and batches
    (hidden checks); ``data``: this rank's ``harness.rank_data``, given instead.
    Returns the full parameters (gathered), the losses, the first step's log of what each unit held
    after each moment, the peak bytes of gathered parameters, the bytes held between steps, and the
    seconds of each recorded step."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    ctx = Context(rank, n, optimizer, depth)
    first, batches = copy.deepcopy(data) if data else rank_data(model_name, warmup + steps, rank, seed)
    units = setup(comm.to_device(first), rank, n, optimizer.init_state, sharded=True,
                  frees_params=True)
    model = nn.Sequential(*(u.module for u in units))
    record = Record(units)
    handles = attach(units, ctx, hooks, record)
    losses, seconds = [], []
    try:
        with comm.simulated(link):
            for step in range(warmup + steps):
                if step == warmup + steps - 1:
                    start_recording()
                record.logging = step == 0  # the first step's moments are logged
                t = _now()
                x, y = comm.to_device(*batches[step])
                out = model(x)
                with span("loss"):
                    loss = loss_fn(out, y)
                loss.backward()
                hooks.finish(units, ctx)
                record.after("finish", None)
                with span("optimizer step"):
                    for i, u in enumerate(units):
                        if not isinstance(u.grad, torch.Tensor):
                            raise RuntimeError(
                                f"unit {i} has no gradient shard after the backward pass: post_backward (or "
                                "finish) must leave this rank's shard of the averaged gradient in unit.grad")
                        if u.grad.numel() != u.layout.shard_numel:
                            whole = u.grad.numel() == u.layout.padded_numel
                            raise RuntimeError(
                                f"unit {i}'s unit.grad holds {u.grad.numel()} numbers after the backward pass"
                                + (", the whole (padded) gradient" if whole else "") + f"; a shard is "
                                f"{u.layout.shard_numel}: post_backward (or finish) must leave this rank's shard of "
                                "the averaged gradient there, reduce-scattered from unit.full_grad() into a tensor of "
                                "unit.layout.shard_numel")
                        ctx.update(u, u.grad)
                        u.grad = None
                losses.append(loss.item())  # waits for the GPU, if there is one
                if step >= warmup:
                    seconds.append((_now() - t) / 1e9)
    finally:
        record.logging = False
        for h in handles:
            h.remove()
    return {"params": gather_full(units, True), "losses": losses, "log": record.log, "peak": record.peak,
            "held": held_bytes(units), "unit_bytes": [u.layout.padded_numel * 4 for u in units],
            "seconds": seconds}


def timed_steps(steps: int, link, body) -> tuple[list, float, object]:
    """``body()`` a warm-up and then ``steps`` times, every rank starting each step together, the last one
    recorded (``start_recording``), each over ``link`` (``comm.LINKS``; None: the real one) and timed to the
    end of its GPU work: (each timed step's seconds, the CPU seconds of the last, what the last returned)."""
    import time

    import torch.distributed as dist

    seconds, cpu, out = [], 0.0, None
    for step in range(steps + 1):
        if step == steps:
            start_recording()
        else:
            dist.barrier()
        with comm.simulated(link):
            t0, cpu = time.perf_counter(), time.thread_time()
            out = body()
            comm.synchronize()
            seconds.append(time.perf_counter() - t0)
            cpu = time.thread_time() - cpu
    return seconds[1:], cpu, out


def step_times(results) -> list[float]:
    """Each timed step's seconds, on the slowest rank."""
    return [max(r["seconds"][k] for r in results) for k in range(len(results[0]["seconds"]))]


def step_seconds(results) -> float:
    """A step's time: the median over steps of the slowest rank."""
    return statistics.median(step_times(results))


def fsdp2_train(model_name: str = "wide8", steps: int = 3, depth: int = 1, warmup: int = 0,
                optimizer: Optimizer = Optimizer()) -> dict:
    """PyTorch's FSDP2 on the same model and batches, prefetching ``depth`` units ahead in both passes
    (``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``; 0: FSDP2's defaults).
    Returns the full parameters (named as in the model) and the seconds of each step after ``warmup``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dev = comm.torch_device()
    mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    model = build_model(model_name).to(dev)
    units = list(model)
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sum_then_divide_on_gloo(model)
    if depth:
        for i, unit in enumerate(units):
            unit.set_modules_to_forward_prefetch(units[i + 1:i + 1 + depth])
            unit.set_modules_to_backward_prefetch(units[max(i - depth, 0):i][::-1])
    opt = torch.optim.SGD(model.parameters(), lr=optimizer.lr, momentum=optimizer.momentum)
    seconds = []
    for step in range(warmup + steps):
        if step == warmup:
            start_recording()
        t = _now()
        x, y = (v.to(dev) for v in batch(model_name, step, dist.get_rank()))
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        comm.synchronize()
        if step >= warmup:
            seconds.append((_now() - t) / 1e9)
    steps_end()
    return {"params": [(name, p.full_tensor().detach().clone()) for name, p in model.named_parameters()],
            "seconds": seconds}


def measure(cluster, hooks: Hooks, depth: int = 0, link: comm.Link | None = None, model_name: str = "wide8",
            steps: int | None = None) -> dict:
    """Train ``steps`` timed steps (5, or 2 under LABLIB_QUICK) after one warm-up step on ``cluster``: the step time (median over
    steps of the slowest rank) and its range, the peak bytes of full parameters a rank held, the timeline
    of the last step and the fraction of its communication that ran under compute. On a real link the
    job runs under ``lablib.timed``, so time a collective spent queued behind others is not counted as
    communication."""
    from ..overlap import hidden_fraction
    from ..paths import quick
    from ..profiling import timed

    steps = steps or (2 if quick() else 5)
    args = (train, hooks, model_name, steps)
    results = cluster.run(*args, depth=depth, link=link, warmup=1) if link else \
        cluster.run(timed, *args, depth=depth, link=link, warmup=1)
    timeline = cluster.timeline()
    times = step_times(results)
    return {"depth": depth, "step": statistics.median(times), "range": (min(times), max(times)), "steps": steps,
            "peak": max(r["peak"] for r in results), "timeline": timeline, "hidden": hidden_fraction(timeline)}


def versus_fsdp2(cluster, hooks: Hooks, depth: int = 1, model_name: str = "wide8", steps: int | None = None) -> dict:
    """The step times of ``hooks`` and of FSDP2 (``fsdp2_train``), both prefetching ``depth`` units ahead,
    back to back on ``cluster`` with nothing traced (a profiler slows FSDP2's many small ops more than
    lablib's few): {name: median step, its range, the number of steps}. Where the ranks share GPUs over Gloo,
    FSDP2 computes on the CPU (``comm.torch_device``), and each name says where it ran."""
    from ..paths import quick
    from ..pool.backend import torch_on_cpu

    steps = steps or (2 if quick() else 5)
    yours, theirs = (", GPU", ", CPU") if torch_on_cpu(cluster.backend, cluster.device) else ("", "")
    runs = {f"yours, depth {depth}{yours}": cluster.run(train, hooks, model_name, steps, depth=depth, warmup=1),
            f"FSDP2, depth {depth}{theirs}": cluster.run(fsdp2_train, model_name, steps, depth, 1)}
    out = {}
    for name, results in runs.items():
        times = step_times(results)
        out[name] = {"step": statistics.median(times), "range": (min(times), max(times)), "steps": steps}
    return out
