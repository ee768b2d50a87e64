"""Exercise checks: run the learner's function on real ranks, compare with a reference, and say what
differed and the likely cause. A failed check raises ``CheckFailed`` (an AssertionError), so the check
cell fails under nbval and in ``lablib grade``."""
from __future__ import annotations

import torch

from .cluster import Cluster, RankError


class CheckFailed(AssertionError):
    pass


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
            raise CheckFailed(f"{task} is not done yet: your code still raises NotImplementedError({str(exc)!r}). "
                              "Replace the `raise` line with your code.") from None
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
        raise CheckFailed(f"{task} is not done yet: {fn.__name__} still raises NotImplementedError. "
                          "Replace the `raise` line with your code.") from None
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
    ("Timed out", "one rank skipped a collective the others called: every rank must call the same "
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
