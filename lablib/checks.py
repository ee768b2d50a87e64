"""Exercise checks: run the learner's function on real ranks, compare with a reference, and say what
differed and the likely cause. A failed check raises ``CheckFailed`` (an AssertionError), so the check
cell fails under nbval and in ``lablib grade``."""
from __future__ import annotations

import torch

from .cluster import Cluster, RankError


class CheckFailed(AssertionError):
    pass


def _not_done(task: str, what: str) -> CheckFailed:
    return CheckFailed(f"{task} is not done yet: {what} still raises NotImplementedError. "
                       "Replace the `raise` line with your code.")


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
            raise _not_done(task, f"your code ({exc})") from None
        likely = [hint for text, hint in hints if text in str(err)]
        raise CheckFailed(f"{task}: your function failed on the ranks." + (f" Likely: {likely[0]}" if likely else "")
                          + f"\n\n{err}") from None


def _mean_inputs(world_size):
    return [torch.arange(4, dtype=torch.float32) * (r + 1) + r for r in range(world_size)]


def _mean_job(fn):
    import torch.distributed as dist

    return fn(_mean_inputs(dist.get_world_size())[dist.get_rank()].clone())


def check_mean_across_ranks(fn, cluster: Cluster) -> None:
    """Task 0.1: every rank must return the element-wise mean of all ranks' tensors."""
    __tracebackhide__ = True
    task = "Task 0.1"
    n = cluster.world_size
    results = run_on_ranks(cluster, task, _mean_job, fn)
    inputs = _mean_inputs(n)
    expected = torch.stack(inputs).mean(0)  # the single-process reference
    for rank, out in enumerate(results):
        if out is None:
            raise CheckFailed(f"{task}: rank {rank} returned None. Return the averaged tensor.")
        if not isinstance(out, torch.Tensor) or out.shape != expected.shape:
            raise CheckFailed(f"{task}: rank {rank} returned {type(out).__name__} "
                              f"{getattr(out, 'shape', '')}, expected a tensor of shape {tuple(expected.shape)}.")
        if torch.allclose(out, expected * n):
            raise CheckFailed(f"{task}: rank {rank} holds the sum over ranks, {out.tolist()}, not the mean "
                              f"{expected.tolist()}. Did you divide by the world size after the all-reduce?")
        if torch.allclose(out, inputs[rank]) or torch.allclose(out, inputs[rank] / n):
            raise CheckFailed(f"{task}: rank {rank} returned only its own data, {out.tolist()}. "
                              "Did the all-reduce run, on the tensor you return?")
        if not torch.allclose(out, expected, atol=1e-6):
            raise CheckFailed(f"{task}: rank {rank} returned {out.tolist()}, expected {expected.tolist()}.")
    error = max((out - expected).abs().max().item() for out in results)
    print(f"✓ {task} passed on {n} ranks: every rank holds the mean; max error vs the single-process "
          f"reference {error:.1e}")


# -- Lab 01: sharding --------------------------------------------------------------------------------
def _call_local(task, fn, what, hint, *args):
    """``fn(*args)`` in this process; ``what`` describes the call, ``hint`` follows an exception."""
    __tracebackhide__ = True
    try:
        return fn(*args)
    except NotImplementedError:
        raise _not_done(task, fn.__name__) from None
    except Exception as exc:
        raise CheckFailed(f"{task}: {fn.__name__}({what}) raised {type(exc).__name__}: {exc}. {hint}") from None


def check_flat_shard(fn) -> None:
    """Task 1.1: pad a flat buffer to a multiple of world_size; rank r gets the r-th equal slice."""
    __tracebackhide__ = True
    from .sharding import FlatLayout

    task, cases = "Task 1.1", 0
    for numel in (1, 5, 7, 8, 13):
        for n in (1, 2, 3, 4):
            flat = torch.arange(1, numel + 1, dtype=torch.float32)
            layout = FlatLayout(((numel,),), n)
            padded = layout.flatten([flat])
            shards = []
            for rank in range(n):
                got = _call_local(task, fn, f"a flat buffer of {numel} elements, world_size={n}, rank={rank}",
                                  "Every rank gets a shard of the same size, even when there are fewer elements "
                                  "than ranks: pad first, then slice.", flat.clone(), n, rank)
                start, end = layout.shard_bounds(rank)
                want = padded[start:end]
                if not isinstance(got, torch.Tensor):
                    raise CheckFailed(f"{task}: return a tensor (the shard), got {type(got).__name__}")
                if got.numel() != want.numel():
                    raise CheckFailed(
                        f"{task}: with {numel} elements on {n} ranks, rank {rank}'s shard has {got.numel()} "
                        f"elements, expected {want.numel()}. Did you pad the flat buffer to a multiple of "
                        f"world_size ({layout.padded_numel}) before splitting it into equal shards?")
                if not torch.equal(got.flatten(), want):
                    raise CheckFailed(
                        f"{task}: with {numel} elements on {n} ranks, rank {rank}'s shard is {got.tolist()}, "
                        f"expected {want.tolist()}: rank r holds elements [r*s, (r+1)*s) of the padded buffer "
                        f"(s = {want.numel()}), and the padding is zeros at the very end.")
                shards.append(got.flatten())
                cases += 1
            assert torch.equal(torch.cat(shards), padded)
    print(f"✓ {task} passed: {cases} shards for 1-4 ranks and 1-13 elements, padding included")


def check_shard_slices(fn) -> None:
    """Task 1.2: which part of which parameter each rank's shard holds."""
    __tracebackhide__ = True
    import random

    from .sharding import FlatLayout, build_model

    task = "Task 1.2"
    rng = random.Random(1)
    cases = [[518, 1406, 266], [10, 2], [3], [4, 4], [1, 1, 1, 1, 1]]
    cases += [[p.numel() for p in unit.parameters()] for unit in build_model("transformer")]
    cases += [[rng.randint(1, 20) for _ in range(rng.randint(1, 5))] for _ in range(30)]
    checked = 0
    for numels in cases:
        for n in (1, 2, 3, 4):
            layout = FlatLayout(tuple((k,) for k in numels), n)
            for rank in range(n):
                got = _call_local(task, fn, f"numels={list(numels)}, world_size={n}, rank={rank}",
                                  "Parameters are laid out in order in the flat buffer; a rank's shard is "
                                  "[rank*s, (rank+1)*s) with s = ceil(total/world_size).", list(numels), n, rank)
                want = [(s.param, s.param_start, s.shard_start, s.length) for s in layout.shard_slices(rank)]
                try:
                    got = [tuple(int(v) for v in item) for item in got]
                except (TypeError, ValueError):
                    raise CheckFailed(f"{task}: return a list of (param, param_start, shard_start, length) "
                                      f"tuples, got {got!r}") from None
                if got != want:
                    hint = ""
                    if {w[0] for w in want} - {g[0] for g in got}:
                        hint = (" A parameter that crosses a shard boundary appears in both shards, each with its "
                                "own part; one that ends exactly at a boundary does not reach the next shard.")
                    elif [w[0] for w in want] == [g[0] for g in got]:
                        hint = (" The parameters are right; check the offsets: param_start counts from the start "
                                "of the parameter, shard_start from the start of this rank's shard.")
                    raise CheckFailed(f"{task}: for parameters of {numels} elements on {n} ranks (shard size "
                                      f"{layout.shard_numel}), rank {rank} should hold {want}, got {got}.{hint}")
                checked += 1
    print(f"✓ {task} passed: {checked} shards of {len(cases)} parameter lists on 1-4 ranks")


_STAGE_HINTS = {
    "zero1": "Did you divide the all-reduced gradient by the world size, update only this rank's slice "
             "(unit.grad[start:end]) with ctx.update, and all-gather unit.shard into unit.flat afterwards?",
    "zero2": "reduce_scatter leaves this rank the *sum* of its shard of the gradients: divide it by the world "
             "size, keep it as unit.grad, update with it, then all-gather the parameters.",
    "zero3": "unshard must make room for the full parameters again (resize the flat buffer's storage to "
             "padded_numel * element_size bytes) and all-gather every rank's unit.shard into unit.flat.",
}
_RANK_HINTS = (
    ("storage of size 0", "unshard gathers into unit.flat, whose storage reshard freed: resize it back to "
                          "unit.layout.padded_numel * unit.flat.element_size() bytes before the all-gather."),
    ("timed out", "one rank skipped a collective the others called: every rank must call the same "
                  "collectives, in the same order, for every unit."),
)
_MEMORY_HINTS = {
    ("zero1", "optimizer"): "ZeRO-1 keeps optimizer state for this rank's shard only: pass "
                            "unit.grad[start:end], not the whole gradient, to ctx.update.",
    ("zero2", "grads"): "ZeRO-2 keeps only this rank's shard of the gradient: set unit.grad to the "
                        "reduce-scattered shard so the full gradient is freed.",
    ("zero2", "optimizer"): "pass this rank's gradient shard, not the full gradient, to ctx.update.",
    ("zero3", "params"): "between uses ZeRO-3 keeps only the shard: reshard must free the full flat "
                         "buffer (unit.flat.untyped_storage().resize_(0)).",
}


def check_zero_stage(task: str, stage: str, cluster: Cluster, step_fn=None, unshard=None, reshard=None) -> None:
    """Tasks 1.3-1.5: the learner's step trains both models on every rank of ``cluster``; parameters must
    match the single-process reference and bytes held must be the stage's."""
    __tracebackhide__ = True
    from .memory import STAGE_NAMES, zero_formula
    from .sharding import Optimizer, reference, train

    n = cluster.world_size
    worst = 0.0
    for model in ("mlp", "transformer"):
        results = run_on_ranks(cluster, task, train, stage, model, 3, Optimizer(), False, step_fn, unshard, reshard,
                               hints=_RANK_HINTS)
        ref = reference(model, 3, n)
        for rank, result in enumerate(results):
            err = max((got - want).abs().max().item() for got, want in zip(result["params"], ref))
            worst = max(worst, err)
            if not err <= 1e-6:
                raise CheckFailed(f"{task}: after 3 steps of the {model}, rank {rank}'s parameters differ from "
                                  f"the single-process reference by {err:.2e} (tolerance 1e-6). {_STAGE_HINTS[stage]}")
            expected = zero_formula(stage, result["psi"], n, mixed=False, state_bytes=4)
            for kind in ("params", "grads", "optimizer"):
                if result["memory"][kind] != expected[kind]:
                    hint = _MEMORY_HINTS.get((stage, kind), _STAGE_HINTS[stage])
                    raise CheckFailed(f"{task}: the values are right, but rank {rank} holds "
                                      f"{result['memory'][kind]} bytes of {kind} after a step, expected "
                                      f"{expected[kind]:.0f}. {hint}")
    print(f"✓ {task} passed on {n} ranks: the MLP and the transformer block match the single-process "
          f"reference (max error {worst:.1e}), and each rank holds exactly what {STAGE_NAMES[stage]} keeps")


# -- Lab 02: collectives -----------------------------------------------------------------------------
_check_pools: dict[int, Cluster] = {}


def _pools(cluster: Cluster, sizes=(2, 3, 4)) -> list[Cluster]:
    """The notebook's pool plus pools of the other sizes, started once and kept for later checks."""
    out = []
    for n in sizes:
        if n == cluster.world_size:
            out.append(cluster)
            continue
        pool = _check_pools.get(n)
        if pool is None or pool._closed:
            pool = _check_pools[n] = Cluster(n, backend=cluster.backend, timeout=cluster.timeout, quiet=True)
        out.append(pool)
    return out


_RING_CASES = [(torch.float32, 1), (torch.float32, 7), (torch.float64, 1000), (torch.int64, 5), (torch.bfloat16, 64)]
_TORCH_NAME = {"all_gather": "dist.all_gather_into_tensor", "reduce_scatter": "dist.reduce_scatter_tensor",
               "all_reduce": "dist.all_reduce"}


def _ring_job(fn, op):
    """On each rank: the learner's ring and torch's collective on the same inputs, for every case."""
    import torch.distributed as dist

    from .comm import all_gather_single, reduce_scatter_single
    from .timeline import RECORDER

    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for dtype, chunk in _RING_CASES:
        g = torch.Generator().manual_seed(100 * rank + chunk)
        numel = chunk * n - (1 if op == "all_reduce" and n > 1 else 0)  # all-reduce: a size n does not divide
        x = (torch.randn(numel if op != "all_gather" else chunk, generator=g) * 8).to(dtype)
        before = len(RECORDER.spans)
        if op == "all_gather":
            got, want = torch.zeros(chunk * n, dtype=dtype), torch.empty(chunk * n, dtype=dtype)
            fn(got, x.clone())
            all_gather_single(want, x.clone())
        elif op == "reduce_scatter":
            got, want = torch.zeros(chunk, dtype=dtype), torch.empty(chunk, dtype=dtype)
            fn(got, x.clone())
            reduce_scatter_single(want, x.clone())
        else:
            got, want = x.clone(), x.clone()
            fn(got)
            dist.all_reduce(want)
        sends = sum(1 for s in RECORDER.spans[before:] if s[1] == "comm" and s[7].get("op") == "send")
        collectives = {s[7].get("op") for s in RECORDER.spans[before:] if s[1] == "comm"} & set(_TORCH_NAME)
        out.append((str(dtype).replace("torch.", ""), chunk, got, want, sends, sorted(collectives)))
    return out


def check_ring(task: str, fn, op: str, cluster: Cluster) -> None:
    """Tasks 2.1-2.4: the learner's ring against torch.distributed's own collective on 2, 3 and 4 ranks,
    several dtypes and sizes; it must send exactly the ring's messages."""
    __tracebackhide__ = True
    sizes = []
    for pool in _pools(cluster):
        n = pool.world_size
        per_rank = run_on_ranks(pool, task, _ring_job, fn, op, hints=_RING_HINTS)
        steps = (2 if op == "all_reduce" else 1) * (n - 1)
        for rank, cases in enumerate(per_rank):
            for dtype, chunk, got, want, sends, collectives in cases:
                where = f"{getattr(fn, '__name__', 'your function')} on {n} ranks, {dtype}, chunks of {chunk}"
                if collectives:
                    raise CheckFailed(f"{task}: {where}: rank {rank} called {', '.join(collectives)}. Build the ring "
                                      "from point-to-point messages only (lablib.send/recv/isend/irecv).")
                if sends != steps:
                    raise CheckFailed(
                        f"{task}: {where}: rank {rank} sent {sends} message(s) through lablib's send/isend, the ring "
                        f"sends {steps} ({'2 x ' if op == 'all_reduce' else ''}N-1 steps, one message each). "
                        "Use lablib.send/recv/isend/irecv (so the timeline can show the ring), one send per step.")
                if got.shape != want.shape:
                    raise CheckFailed(f"{task}: {where}: rank {rank}'s output has shape {tuple(got.shape)}, "
                                      f"expected {tuple(want.shape)}")
                tol = 0 if not want.is_floating_point() else \
                    (64 if want.dtype == torch.bfloat16 else 4) * torch.finfo(want.dtype).eps * n * 8 * 4
                diff = (got.double() - want.double()).abs()
                if diff.max().item() > tol:
                    bad = sorted({int(i) // max(chunk, 1) for i in (diff > tol).nonzero().flatten().tolist()})
                    raise CheckFailed(
                        f"{task}: {where}: rank {rank}'s result differs from {_TORCH_NAME[op]}'s "
                        f"(by up to {diff.max().item():.3g}) in chunk(s) {bad[:6]}. {_RING_OP_HINTS[op]}")
        sizes.append(n)
    print(f"✓ {task} passed: {op.replace('_', '-')} matches {_TORCH_NAME[op]} on {', '.join(map(str, sizes))} "
          f"ranks for {len(_RING_CASES)} dtype/size cases, with {'2(N-1)' if op == 'all_reduce' else 'N-1'} "
          f"messages per rank")


_DEADLOCK = "a deadlock: ranks are blocked in send or recv, waiting for each other (see the Hint below)."
_RING_HINTS = (("in send", _DEADLOCK), ("in recv", _DEADLOCK))
_RING_OP_HINTS = {
    "all_gather": "At step s rank r sends chunk (r - s) mod N to rank r+1 and receives chunk (r - s - 1) mod N "
                  "from rank r-1: the chunk it received at the step before. Did you copy your own input into "
                  "chunk r of the output first?",
    "reduce_scatter": "At step s rank r sends its partial sum of chunk (r - s - 1) mod N and adds the chunk "
                      "(r - s - 2) mod N it receives to its own partial sum; after N-1 steps it holds the full sum "
                      "of chunk r. Did you add what you received, and write chunk r to the output at the end?",
    "all_reduce": "Pad the tensor to a multiple of N, reduce-scatter it into your chunk, all-gather the chunks "
                  "back into the padded buffer, then copy the unpadded part back into the tensor (in place).",
}
