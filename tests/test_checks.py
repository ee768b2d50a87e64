"""Exercise checks: a right answer passes, and each typical mistake gets a message that says what
differed and the likely cause (instead of a bare assert or a hang)."""
import pytest
import torch
from procs import HUNG

import lablib
from lablib import sharding
from lablib.checks import CheckFailed, check_flat_shard, check_mean_across_ranks, check_shard_slices, check_zero_stage


def test_mean_across_ranks(cluster, capsys):
    def right(x):
        lablib.all_reduce(x)
        return x / torch.distributed.get_world_size()

    def summed(x):
        lablib.all_reduce(x)
        return x

    def local(x):
        return x

    def stub(x):
        raise NotImplementedError("Task 0.1: average x")

    check_mean_across_ranks(right, cluster)
    assert "✓ Task 0.1 passed" in capsys.readouterr().out
    for fn, message in [(summed, "holds the sum over ranks"), (local, "returned only its own data"),
                        (stub, "Task 0.1 is not done yet"), (lambda x: None, "returned None")]:
        with pytest.raises(CheckFailed, match=message):
            check_mean_across_ranks(fn, cluster)


def test_flat_shard_mistakes():
    def right(flat, n, rank):
        s = -(-flat.numel() // n)
        return torch.cat([flat, flat.new_zeros(s * n - flat.numel())])[rank * s:(rank + 1) * s]

    check_flat_shard(right)
    with pytest.raises(CheckFailed, match="pad first, then slice"):
        check_flat_shard(lambda flat, n, rank: flat.chunk(n)[rank])
    with pytest.raises(CheckFailed, match="Did you pad the flat buffer to a multiple of world_size"):
        check_flat_shard(lambda flat, n, rank: flat[rank * (flat.numel() // n):(rank + 1) * (flat.numel() // n)])


def test_shard_slices_mistakes():
    def right(numels, n, rank):
        return [(s.param, s.param_start, s.shard_start, s.length)
                for s in sharding.FlatLayout(tuple((k,) for k in numels), n).shard_slices(rank)]

    def first_owner_only(numels, n, rank):  # a parameter straddling two shards goes to one of them only
        layout = sharding.FlatLayout(tuple((k,) for k in numels), n)
        start, _ = layout.shard_bounds(rank)
        return [t for t in right(numels, n, rank) if layout.offsets[t[0]] >= start]

    def swapped_offsets(numels, n, rank):
        return [(p, b, a, k) for p, a, b, k in right(numels, n, rank)]

    check_shard_slices(right)
    with pytest.raises(CheckFailed, match="appears in both shards"):
        check_shard_slices(first_owner_only)
    with pytest.raises(CheckFailed, match="param_start counts from the start of the parameter"):
        check_shard_slices(swapped_offsets)


def _gather(unit, ctx):
    lablib.all_gather(unit.flat, unit.shard)


def test_zero_stage_mistakes(cluster):
    def no_divide(unit, ctx):
        lablib.all_reduce(unit.grad)
        start, end = unit.layout.shard_bounds(ctx.rank)
        ctx.update(unit, unit.grad[start:end])
        _gather(unit, ctx)

    def full_update(unit, ctx):
        lablib.all_reduce(unit.grad)
        unit.grad /= ctx.world_size
        ctx.update(unit, unit.grad)

    def zero2_keeps_full_grad(unit, ctx):
        shard = torch.empty(unit.layout.shard_numel)
        lablib.reduce_scatter(shard, unit.grad)
        unit.grad /= ctx.world_size  # the full gradient is kept
        ctx.update(unit, shard / ctx.world_size)
        _gather(unit, ctx)

    def keep_everything(unit):
        pass

    with pytest.raises(CheckFailed, match="differ from the single-process reference.*divide the all-reduced"):
        check_zero_stage("Task 1.3", "zero1", cluster, step_fn=no_divide)
    with pytest.raises(CheckFailed, match="ctx.update got a gradient of \\d+ elements"):
        check_zero_stage("Task 1.3", "zero1", cluster, step_fn=full_update)
    with pytest.raises(CheckFailed, match="holds \\d+ bytes of grads.*keeps only this rank's shard of the gradient"):
        check_zero_stage("Task 1.4", "zero2", cluster, step_fn=zero2_keeps_full_grad)
    with pytest.raises(CheckFailed, match="storage reshard freed: resize it back"):
        check_zero_stage("Task 1.5", "zero3", cluster, unshard=_gather, reshard=lambda u: u.flat.untyped_storage().resize_(0))
    if cluster.world_size > 1:
        with pytest.raises(CheckFailed, match="bytes of params.*reshard must free the full flat buffer"):
            check_zero_stage("Task 1.5", "zero3", cluster, unshard=lablib.fsdp.unshard, reshard=keep_everything)
    check_zero_stage("Task 1.4", "zero2", cluster, step_fn=sharding.zero2_step)


def test_ring_checks_teach(fragile):
    import time

    import torch.distributed as dist

    from lablib import collectives
    from lablib.checks import check_ring

    def everyone_sends_first(output, input):
        rank, n = dist.get_rank(), dist.get_world_size()
        chunks = output.view(n, -1)
        chunks[rank].copy_(input)
        for step in range(n - 1):
            lablib.send(chunks[(rank - step) % n], (rank + 1) % n)
            lablib.recv(chunks[(rank - step - 1) % n], (rank - 1) % n)

    def forgets_own_chunk(output, input):
        rank, n = dist.get_rank(), dist.get_world_size()
        chunks = output.view(n, -1)
        for step in range(n - 1):
            for h in [lablib.isend(chunks[(rank - step) % n], (rank + 1) % n),
                      lablib.irecv(chunks[(rank - step - 1) % n], (rank - 1) % n)]:
                h.wait()

    def library_call(output, input):
        lablib.all_gather(output, input)

    t = time.perf_counter()
    with pytest.raises(CheckFailed, match="(?s)deadlock.*Hint: a blocking send waits until its peer receives"):
        check_ring("Task 2.1", everyone_sends_first, "all_gather", fragile)
    assert time.perf_counter() - t < fragile.timeout + HUNG
    with pytest.raises(CheckFailed, match="differs from dist.all_gather_into_tensor.*copy your own input"):
        check_ring("Task 2.2", forgets_own_chunk, "all_gather", fragile)
    with pytest.raises(CheckFailed, match="called all_gather"):
        check_ring("Task 2.2", library_call, "all_gather", fragile)
    check_ring("Task 2.3", collectives.ring_reduce_scatter, "reduce_scatter", fragile)
