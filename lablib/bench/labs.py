"""The labs' claims, each against what it is compared with on the same ranks: the learner's rings
against Gloo's collectives (P3, lab 02), FSDP with prefetching against FSDP2 (P4) and what it hides
(P5, lab 03), the pipeline executor and its bubbles (P6, lab 05), the tensor-parallel block against
DTensor (P9, lab 04), ring attention against single-process SDPA and the memory it keeps per rank (P10, lab 06), the
expert-parallel layer against the dense layer and the all-gather dispatcher (P11, lab 07), the composed step with
recomputation against keeping the activations (P12, lab 08), mixed precision against FSDP2's and a sharded
checkpoint against DCP's (P14, lab 09)."""
from __future__ import annotations

import contextlib
import io
import statistics
import time

import torch

from .rows import Row, Settings, side_by_side


def p3_collectives(s: Settings) -> list[Row]:
    from .. import bandwidth
    from ..pool import Cluster

    size = 16 << 20
    rows = []
    for n in (2, 4):
        runs = []
        with Cluster(n, backend=s.backend, timeout=120, quiet=True) as c:
            for _ in range(s.reps):
                runs.append(bandwidth.sweep(c, [size], iters=3 if s.quick else 5))

        def busbw(op, impl):
            return [next(r["busbw"] for r in rows_ if (r["op"], r["impl"]) == (op, impl)) for rows_ in runs]

        for op in bandwidth.OPS:
            rows.append(Row("P3", f"ring {op.replace('_', '-')} busbw, 16 MiB, {n} ranks", "GB/s", busbw(op, "ring"),
                            busbw(op, "torch"), "torch.distributed (Gloo or NCCL)"))
        rows.append(Row("P3", f"ring all-gather busbw vs a memory copy, 16 MiB, {n} ranks", "GB/s",
                        busbw("all_gather", "ring"), busbw("memcpy", "torch"), "memory copy (one rank)"))
    return rows


def p4_fsdp(s: Settings) -> list[Row]:
    from ..answers.lab03 import PREFETCH
    from ..strategies import prefetch

    rows = []
    for n in (2, 4):
        ours, theirs = side_by_side(
            s, n, lambda c: prefetch.step_seconds(c.run(prefetch.train, PREFETCH, "wide8", 3, depth=1,
                                                        warmup=1)) * 1e3,
            lambda c: prefetch.step_seconds(c.run(prefetch.fsdp2_train, "wide8", 3, 1, 1)) * 1e3)
        row = Row("P4", f"FSDP step with prefetch (lab 03's solution), wide8, {n} ranks", "ms", ours, theirs,
                  "FSDP2 fully_shard, depth 1", "<= 1.25 x")
        row.met = row.ratio <= 1.25
        rows.append(row)
    return rows


def p5_hidden(s: Settings) -> list[Row]:
    from .. import comm
    from ..answers.lab03 import PREFETCH
    from ..strategies import prefetch

    link = comm.LINKS["2.5GbE"]
    rows = []
    for n in (2, 4):
        sim, real = side_by_side(s, n, lambda c: prefetch.measure(c, PREFETCH, 1, link, steps=3)["hidden"] * 100,
                                  lambda c: prefetch.measure(c, PREFETCH, 1, None, steps=3)["hidden"] * 100)
        row = Row("P5", f"communication hidden under compute, prefetch depth 1, wide8, {n} ranks, simulated "
                  f"{link.name}", "%", sim, real, "the same on raw Gloo (measured)", ">= 80 % (simulated link)")
        row.met = statistics.median(sim) >= 80
        rows.append(row)
    return rows + _p5_on_gpus(s)


def _p5_on_gpus(s: Settings) -> list[Row]:
    """Lab 03's hidden share on this machine's GPUs, from the GPU-timed timeline (compute spans are their kernels'
    times), beside the same step with the ranks on the CPU; nothing without a GPU."""
    from ..answers.lab03 import PREFETCH
    from ..pool import Cluster
    from ..pool.backend import _gpu_count
    from ..strategies import prefetch

    gpus = _gpu_count()
    rows = []
    for n in (2, 4) if gpus and s.backend != "nccl" else ():
        on_gpus, on_cpu = [], []
        with Cluster(n, timeout=60, quiet=True) as g, Cluster(n, device="cpu", timeout=60, quiet=True) as c:
            for _ in range(s.reps):
                on_gpus.append(prefetch.measure(g, PREFETCH, 1, None, steps=3)["hidden"] * 100)
                on_cpu.append(prefetch.measure(c, PREFETCH, 1, None, steps=3)["hidden"] * 100)
            backend = g.backend
        note = ("the ranks take turns on the GPU: a rank's compute spans are its own kernels, so this is the part "
                "of its Gloo transfers (through host memory) that ran while its own kernels did, not what a GPU per "
                "rank would hide") if n > gpus else "a GPU per rank"
        rows.append(Row("P5", f"communication hidden under compute, prefetch depth 1, wide8, {n} ranks on {gpus} "
                        f"GPU(s) ({backend}), GPU-timed", "%", on_gpus, on_cpu, "the same step with the ranks on the CPU",
                        note=note))
    return rows


def p9_tensor(s: Settings) -> list[Row]:
    from ..answers.lab04 import FNS
    from ..strategies import tensor_parallel as tp
    from ..strategies import tp_reference as ref
    from ..strategies.prefetch import step_seconds

    rows = []
    for n in (2, 4):
        ours, theirs = side_by_side(s, n, lambda c: step_seconds(c.run(tp.block_job, FNS, 3)) * 1e3,
                                     lambda c: step_seconds(c.run(ref.dtensor_block_job, 3)) * 1e3)
        row = Row("P9", f"tensor-parallel block forward+backward (lab 04's solution), width 256, 512 tokens, {n} ranks",
                  "ms", ours, theirs, "DTensor Colwise/RowwiseParallel, same block", "<= 1.2 x")
        row.met = row.ratio <= 1.2
        rows.append(row)
    return rows


def p6_pipeline(s: Settings) -> list[Row]:
    """Lab 05: lablib's executor running 1F1B against PyTorch's ``Schedule1F1B`` on the same model (real
    compute, 2 ranks); then the measured bubble of every schedule against the papers' formula, over m,
    at 2 ranks with real compute and at 4 with simulated compute (its step's breakdown, views.pipeline)."""
    from ..checks.lab05 import yours
    from ..answers import lab05 as sc
    from ..strategies import pp_reference as ref
    from ..views import pipeline as view

    m = 8
    one_f_one_b = lambda p, m, v=1: sc.one_f_one_b(p, m)  # noqa: E731
    ours, theirs = side_by_side(
        s, 2, lambda c: statistics.median(c.run(ref.step_job, sc.execute, one_f_one_b, m, 1, None, 3)[0]["seconds"]) * 1e3,
        lambda c: statistics.median(c.run(ref.torch_step_job, "1f1b", m)[0]) * 1e3)
    row = Row("P6", f"1F1B step (lab 05's executor), 8 blocks of width {ref.REAL['width']}, m={m} micro-batches of "
              f"{ref.REAL['rows_per_mb']} rows, 2 ranks", "ms", ours, theirs, "torch.distributed.pipelining Schedule1F1B",
              "<= 1.2 x")
    row.met = row.ratio <= 1.2
    rows = [row]
    with contextlib.redirect_stdout(io.StringIO()):
        fns = yours()
    from ..pool import Cluster

    for p, cost in ((2, None), (4, 0.005 if s.quick else 0.01)):
        with Cluster(p, backend=s.backend, timeout=60, quiet=True) as c:
            for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)):
                ms = [k for k in ((2, 8) if s.quick else (1, 2, 4, 8, 16))
                      if (name != "interleaved" or k % p == 0) and (name != "zb-h1" or k >= p)]
                runs = []
                for k in ms:
                    got = [view.measure(c, fns, name, k, v, cost) for _ in range(1 if s.quick else 3)]
                    runs.append((k, statistics.median(r["bubble"] for r in got), got[0]["theory"]))
                errors = [b - t for _, b, t in runs]
                rows.append(Row("P6", f"bubble, measured - theory, {view.TITLES[name]}{f' v={v}' if v > 1 else ''}, {p} ranks, "
                                f"{'real' if cost is None else f'simulated ({cost * 1e3:g} ms per block)'} compute",
                                "", errors, target="within +-0.05", met=max(abs(e) for e in errors) <= 0.05,
                                note="; ".join(f"m={k}: {b:.3f} vs {t:.3f}" for k, b, t in runs)))
    return rows


def _forward_backward(q, k, v, positions, causal):
    """Lab 06's ring attention forward, then its backward (lablib's answers), for ``ring_job`` to time."""
    from ..answers import lab06

    out, lse = lab06.ring_attention(q, k, v, positions, causal)
    lab06.ring_attention_backward(q, k, v, positions, out, lse, torch.ones_like(q), causal)


def _sdpa_step(steps: int = 3) -> float:
    """Single-process SDPA forward and backward on the whole ``BIG`` sequence, causal: the median seconds."""
    import torch.nn.functional as F

    from ..strategies import context_parallel as cp

    s = cp.BIG
    q, k, v = (t.requires_grad_() for t in cp.qkv(s["batch"], s["heads"], s["tokens"], s["dim"]))
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def p10_context(s: Settings) -> list[Row]:
    """Lab 06: ring attention forward+backward against single-process SDPA on the same sequence, and the
    activation memory a rank keeps through the ring against one process's."""
    from ..answers import lab06
    from ..pool import Cluster
    from ..strategies import context_parallel as cp
    from ..strategies.prefetch import step_times

    rows = []
    single = cp.saved_single(1024)
    for n in (2, 4):
        ours, theirs = side_by_side(
            s, n, lambda c: statistics.median(step_times(c.run(cp.ring_job, _forward_backward, "zigzag", True, 3))) * 1e3,
            lambda c: _sdpa_step() * 1e3)
        rows.append(Row("P10", f"ring attention forward+backward (lab 06's solution), {cp.BIG['tokens']} tokens, causal, "
                        f"zig-zag, {n} ranks", "ms", ours, theirs, "single-process SDPA, same sequence", "",
                        note="informational: one CPU's cores shared by the ranks"))
        with Cluster(n, backend=s.backend, timeout=60, quiet=True) as c:
            held = max(c.run(cp.saved_job, lab06.ring_attention, 1024))
        row = Row("P10", f"activation memory per rank, autograd through the ring, 1024 tokens, {n} ranks", "MiB",
                  [held / 2**20], [single / 2**20], "one process (P = 1)", f"<= 1.1/{n} x")
        row.met = row.ratio <= 1.1 / n
        rows.append(row)
    return rows


def p11_experts(s: Settings) -> list[Row]:
    """Lab 07: the expert-parallel layer's forward (lab 07's solution) on 4 ranks against the dense layer in one
    process on the same tokens, and against the all-gather dispatcher on the same ranks, interleaved."""
    from ..answers import lab07
    from ..pool import Cluster
    from ..strategies import experts as ep
    from ..strategies.prefetch import step_seconds

    n, size = 4, ep.BIG
    ours, dense, gather = [], [], []
    with Cluster(n, backend=s.backend, timeout=60, quiet=True) as c:
        for _ in range(s.reps):
            for out, dispatcher in ((ours, "all_to_all"), (gather, "all_gather")):
                out.append(step_seconds(c.run(ep.moe_job, lab07.moe_layer, 0.0, 3, None, dispatcher, lab07.route)) * 1e3)
            dense.append(ep.dense_seconds(lab07.moe_dense, world_size=n) * 1e3)
    what = f"{size['tokens']} tokens of {size['dim']} per rank, {size['experts']} experts, top-{size['k']}, {n} ranks"
    against_gather = Row("P11", f"MoE layer forward, all-to-all against all-gather dispatch, {what}", "ms", ours, gather,
                         "the all-gather dispatcher, same ranks", "< 1 x")
    against_gather.met = against_gather.ratio < 1
    return [Row("P11", f"MoE layer forward, all-to-all dispatch (lab 07's solution), {what}", "ms", ours, dense,
                "the dense layer in one process, every rank's tokens", "",
                note="informational: one CPU's cores shared by the ranks"), against_gather]


def p12_composition(s: Settings) -> list[Row]:
    """Lab 08: the composed step on the TP×PP mesh (lab 08's solution), its stages recomputing their activations
    against keeping them, interleaved: the step's time and the activations the first stage holds at most."""
    from ..answers import lab08
    from ..pool import Cluster
    from ..strategies import compose as cp
    from ..strategies.prefetch import step_seconds

    shape, times, peaks = cp.MESHES["TP×PP"], {None: [], True: []}, {None: [], True: []}
    with Cluster(4, backend=s.backend, timeout=60, quiet=True) as c:
        for _ in range(s.reps):
            for wrap in (None, True):
                results = c.run(cp.step_job, lab08.train_step, shape, 0, 4, wrap and lab08.checkpointed, cp.BIG)
                times[wrap].append(step_seconds(results) * 1e3)
                peaks[wrap].append(results[0]["peak"] / 2**20)
    what = (f"TP×PP on 4 ranks, {cp.BIG['layers']} blocks of {cp.BIG['width']} (hidden {cp.BIG['hidden']}), "
            f"{cp.BIG['rows']} rows in {cp.BIG['micro_batches']} micro-batches")
    step = Row("P12", f"composed step, recomputed against kept activations, {what}", "ms", times[True], times[None],
               "the same step keeping its activations", "< 1.5 x", note="recomputation runs each forward again: 4/3 "
               "of the compute, and the forward's tensor-parallel all-reduces again")
    step.met = step.ratio is not None and step.ratio < 1.5
    held = Row("P12", f"activations the first stage holds at most, recomputed against kept, {what}", "MiB",
               peaks[True], peaks[None], "the same step keeping its activations", "< 0.25 x")
    held.met = held.ratio is not None and held.ratio < 0.25
    return [step, held, p12_ranking(s)]


def p12_ranking(s: Settings) -> Row:
    """Lab 08: the three 2×2 meshes over the stated slow link, measured, against the planner's model of them: the
    order agrees, every neighbour told apart by its steps' times."""
    from ..answers import lab08
    from ..pool import Cluster
    from ..strategies import compose as cp

    agreed = []
    with Cluster(4, backend=s.backend, timeout=60, quiet=True) as c:
        for _ in range(s.reps):
            measured, planned, _ = cp.measure_meshes(c, lab08.train_step, 3)
            verdict, text = cp.ranking(measured, planned)
            agreed.append(1.0 if verdict else 0.0)
    row = Row("P12", f"the 2×2 meshes ranked by the planner's model against measured, over {cp.TOY_LINK}",
              "runs agreeing", agreed, target="the same order, every run", note=f"the last run: {text}")
    row.met = bool(agreed) and min(agreed) == 1.0
    return row


def p14_precision(s: Settings) -> list[Row]:
    """Lab 09: its mixed-precision FSDP units (lab 09's solution) against FSDP2 with the same MixedPrecisionPolicy,
    interleaved on one pool; its sharded save against DCP's on the same state; and the state bytes rank 0 holds
    while saving, sharded against gathered to rank 0."""
    import tempfile

    from ..answers import lab09
    from ..pool import Cluster
    from ..strategies import checkpoint as ck, mixed

    n, policy, params = 4, mixed.Policy(), {"ours": [], "theirs": []}

    def timed_run(who, job, *args):
        def run(c):
            t = time.perf_counter()
            params[who].append(c.run(job, *args, policy, "wide8", 3)[0]["params"])
            return (time.perf_counter() - t) * 1e3
        return run

    ours = timed_run("ours", mixed.train, lab09.mp_unshard, lab09.mp_reduce)
    theirs = timed_run("theirs", mixed.fsdp2_train)
    a, b = side_by_side(s, n, ours, theirs)
    diffs = [max((x - y).abs().max().item() for x, y in zip(p, q)) for p, q in zip(params["ours"], params["theirs"])]
    what = f"3 steps of 8 layers of 512 × 512, {policy}, {n} ranks"
    rows = [Row("P14", f"mixed-precision FSDP (lab 09's units) against FSDP2's MixedPrecisionPolicy, {what}", "ms", a, b,
                "FSDP2 fully_shard, same policy, model and batches", "",
                note=f"parameters after 3 steps differ by at most {max(diffs):.1e}; informational: one CPU's cores "
                     "shared by the ranks")]
    saves, dcps, held, own = [], [], [], []
    with Cluster(n, backend=s.backend, timeout=60, quiet=True) as c:
        for _ in range(s.reps):
            with tempfile.TemporaryDirectory() as ours_dir, tempfile.TemporaryDirectory() as dcp_dir, \
                    tempfile.TemporaryDirectory() as gather_dir:
                saves.append(max(r["save"]["seconds"] for r in c.run(ck.train, lab09.save_shard, None, range(3),
                                                                       ours_dir)) * 1e3)
                dcps.append(max(r["seconds"] for r in c.run(ck.dcp_job, dcp_dir, True)) * 1e3)
                g = c.run(ck.gather_job, gather_dir)[0]
                held.append(g["held"])
                own.append(g["own"])
    rows.append(Row("P14", f"checkpoint save, each rank its own shards (lab 09's solution), slowest of {n} ranks, the mlp's "
                    "parameters and momentum", "ms", saves, dcps, "torch.distributed.checkpoint.save, same state as "
                    "DTensors", "", note="informational: a few KB per rank, so both are mostly fixed costs"))
    row = Row("P14", f"state bytes rank 0 holds at most while saving, sharded against gathered to rank 0, {n} ranks",
              "bytes", own, held, "every tensor gathered whole to rank 0", f"<= 1.5/{n} x")
    row.met = row.ratio <= 1.5 / n
    rows.append(row)
    return rows
