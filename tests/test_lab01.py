"""Lab 01 (sharding): the library on real Gloo ranks (flat layout, every ZeRO stage against the
single-process reference and PyTorch's FSDP2, bytes held against the ZeRO formulas, bytes sent per
step), and Tasks 1.1-1.5's checks on right answers and typical mistakes."""
import random

import pytest
import torch

import lablib
from lablib import comm, memory
from lablib.checks import CheckFailed
from lablib.checks.lab01 import check_flat_shard, check_shard_slices, check_zero1, check_zero2, check_zero3
from lablib.answers import lab01 as answers
from lablib.strategies import fsdp
from lablib.strategies.flat import FlatLayout, setup
from lablib.strategies.harness import Context, Optimizer, reference, train
from lablib.toy import build_model

STAGES = answers.STAGES


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_flat_layout_against_element_by_element_ownership(world_size):
    rng = random.Random(world_size)
    for _ in range(20):
        shapes = tuple((rng.randint(1, 5), rng.randint(1, 4)) if rng.random() < 0.5 else (rng.randint(1, 9),)
                       for _ in range(rng.randint(1, 4)))
        layout = FlatLayout(shapes, world_size)
        assert layout.padded_numel % world_size == 0 and layout.padded_numel - layout.numel < world_size
        owner = [(i, k) for i, n in enumerate(layout.numels) for k in range(n)]  # element -> (param, index)
        for rank in range(world_size):
            start, end = layout.shard_bounds(rank)
            expected = [(pos - start, owner[pos]) for pos in range(start, min(end, layout.numel))]
            got = [(shard_start + k, (param, param_start + k)) for param, param_start, shard_start, length
                   in answers.shard_slices(layout.numels, world_size, rank) for k in range(length)]
            assert got == expected, (shapes, rank)


def test_flatten_and_views_round_trip():
    params = [torch.randn(3, 5), torch.randn(7), torch.randn(2, 2)]
    layout = FlatLayout.of(params, 4)
    flat = layout.flatten(params)
    assert flat.numel() == 28 and flat[26:].eq(0).all()  # 15 + 7 + 4 = 26, padded to 4 shards of 7
    for p, v in zip(params, layout.views(flat)):
        assert torch.equal(p, v) and v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


@pytest.mark.parametrize("model", ["mlp", "transformer"])
@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s.name)
def test_every_stage_matches_the_single_process_reference(cluster, stage, model):
    ref = reference(model, 3, cluster.world_size)
    out = cluster.run(train, stage, model, 3)
    for rank, result in enumerate(out):
        for got, want in zip(result["params"], ref):
            assert (got - want).abs().max().item() <= 1e-6, (stage, model, rank)
    assert len({tuple(r["losses"]) for r in out}) == cluster.world_size  # each rank saw its own data


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "fp32"])
def test_bytes_held_are_the_zero_formulas(cluster, mixed):
    n = cluster.world_size
    for stage in STAGES:
        out = cluster.run(train, stage, "transformer", 2, Optimizer("adam", lr=1e-3), mixed)
        for result in out:
            assert result["memory"] == memory.zero_formula(stage.name, result["psi"], n, mixed), stage


def test_fit_separates_what_is_kept_whole_from_what_is_split():
    psi = 7224
    measured = {(stage, n): (sum(memory.zero_formula(stage, psi, n).values()), psi)
                for stage in ("dp", "zero1", "zero2", "zero3") for n in (2, 4)}
    fit = memory.fit_per_parameter(measured)
    assert fit["dp"] == pytest.approx((16, 0)) and fit["zero1"] == pytest.approx((4, 12))
    assert fit["zero2"] == pytest.approx((2, 14)) and fit["zero3"] == pytest.approx((0, 16))
    with pytest.raises(ValueError, match="at least two world sizes"):
        memory.fit_per_parameter({("dp", 2): (16.0, 1)})


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_fsdp2_matches_the_reference_and_holds_torch_chunk_shards(cluster, model):
    n = cluster.world_size
    ref = fsdp.unflatten(model, reference(model, 3, n))
    out = cluster.run(fsdp.fsdp2_train, model, 3)
    for rank, result in enumerate(out):
        for name, local, full in result["params"]:
            assert (full - ref[name]).abs().max().item() <= 1e-6, name
            chunks = torch.chunk(ref[name], n, dim=0)
            want = chunks[rank] if rank < len(chunks) else ref[name][:0]
            assert local.shape == want.shape and (local - want).abs().max().item() <= 1e-6, (name, rank)


def test_fsdp2_and_our_zero3_hold_the_same_bytes_when_rows_divide_evenly(cluster):
    ours = cluster.run(train, STAGES[3], "transformer", 3)
    theirs = cluster.run(fsdp.fsdp2_train, "transformer", 3)
    assert [o["memory"] for o in ours] == [t["memory"] for t in theirs]


def test_reshard_frees_the_full_parameters_between_uses(cluster):
    def check():
        import torch.distributed as dist
        units = setup(build_model("mlp"), dist.get_rank(), dist.get_world_size(), Optimizer().init_state,
                      frees_params=True)
        ctx = Context(dist.get_rank(), dist.get_world_size(), Optimizer())
        before = [u.flat.untyped_storage().nbytes() for u in units]
        answers.unshard(units[0], ctx)
        during = units[0].flat.untyped_storage().nbytes()
        values = units[0].module[0].weight.detach().clone()
        answers.reshard(units[0])
        return before, during, units[0].flat.untyped_storage().nbytes(), values
    ref = build_model("mlp")[0][0].weight
    for before, during, after, values in cluster.run(check):
        assert before == [0, 0, 0] and after == 0 and during > 0
        assert torch.equal(values, ref.detach())


@pytest.mark.parametrize("stage, units_of_psi", list(zip(STAGES, (2, 3, 2, 3))), ids=lambda s: getattr(s, "name", s))
def test_bytes_sent_per_step(cluster, stage, units_of_psi):
    n = cluster.world_size
    out = cluster.run(train, stage, "transformer", 1)
    sent = comm.bytes_sent(cluster.timeline())
    psi_bytes = 4 * (out[0]["psi"] if stage.sharded else sum(p.numel() for p in build_model("transformer").parameters()))
    assert sent == pytest.approx(units_of_psi * (n - 1) / n * psi_bytes)


def test_model_names_are_checked():
    with pytest.raises(ValueError, match="unknown model 'cnn'"):
        build_model("cnn")


def test_toy_models_split_as_the_labs_need():
    # tensor parallelism splits heads and the feed-forward over 2 and 4 ranks; pipelines need 8+ layers
    from lablib import toy
    assert toy.HEADS % 4 == 0 and toy.FFN % 4 == 0 and toy.WIDTH % toy.HEADS == 0
    assert len(build_model("transformer8")) >= 8
    # the MLP is the padding model: no unit divides by 3 or 4
    assert all(sum(p.numel() for p in u.parameters()) % k for u in build_model("mlp") for k in (3, 4))


def test_optimizer_update_on_a_shard_is_the_slice_of_the_full_update():
    for name in ("sgd", "adam"):
        opt = Optimizer(name, lr=0.01)
        full, grad = torch.randn(10), torch.randn(10)
        a, b = full.clone(), full[4:8].clone()
        sa, sb = opt.init_state(a), opt.init_state(b)
        for _ in range(3):
            opt.update(a, grad, sa)
            opt.update(b, grad[4:8], sb)
        assert torch.equal(a[4:8], b)
        ref = torch.nn.Parameter(full.clone())
        torch_opt = (torch.optim.SGD([ref], lr=0.01, momentum=0.9) if name == "sgd"
                     else torch.optim.Adam([ref], lr=0.01))
        for _ in range(3):
            ref.grad = grad.clone()
            torch_opt.step()
        assert torch.allclose(a, ref.detach(), atol=1e-7), name


def test_flat_shard_mistakes():
    def right(flat, n, rank):
        s = -(-flat.numel() // n)
        return torch.cat([flat, flat.new_zeros(s * n - flat.numel())])[rank * s:(rank + 1) * s]

    def chunked(flat, n, rank):
        return flat.chunk(n)[rank]

    def unpadded(flat, n, rank):
        return flat[rank * (flat.numel() // n):(rank + 1) * (flat.numel() // n)]

    check_flat_shard(right)
    with pytest.raises(CheckFailed, match="pad first, then slice"):
        check_flat_shard(chunked)
    with pytest.raises(CheckFailed, match="Did you pad the flat buffer to a multiple of world_size"):
        check_flat_shard(unpadded)
    with pytest.raises(CheckFailed, match="has no source lablib can read"):
        check_flat_shard(lambda flat, n, rank: flat.chunk(n)[rank])


def test_shard_slices_mistakes():
    def right(numels, n, rank):
        shard = -(-sum(numels) // n)
        start, end, out, offset = rank * shard, (rank + 1) * shard, [], 0
        for i, k in enumerate(numels):
            lo, hi = max(start, offset), min(end, offset + k)
            if lo < hi:
                out.append((i, lo - offset, lo - start, hi - lo))
            offset += k
        return out

    def first_owner_only(numels, n, rank):  # a parameter straddling two shards goes to one of them only
        start = rank * -(-sum(numels) // n)
        return [t for t in right(numels, n, rank) if sum(numels[:t[0]]) >= start]

    def uses_the_library(numels, n, rank):
        return FlatLayout(tuple((k,) for k in numels), n).shard_bounds(rank)

    def swapped_offsets(numels, n, rank):
        return [(p, b, a, k) for p, a, b, k in right(numels, n, rank)]

    check_shard_slices(right)
    with pytest.raises(CheckFailed, match="appears in both shards"):
        check_shard_slices(first_owner_only)
    with pytest.raises(CheckFailed, match="param_start counts from the start of the parameter"):
        check_shard_slices(swapped_offsets)
    with pytest.raises(CheckFailed, match="uses FlatLayout: it is lablib's answer"):
        check_shard_slices(uses_the_library)


def _gather(unit, ctx):
    lablib.all_gather(unit.flat, unit.shard)


def _free(u):
    u.flat.untyped_storage().resize_(0)


def _rebind(unit):
    unit.flat = torch.empty(0)


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

    def unshard(unit, ctx):
        unit.flat.untyped_storage().resize_(unit.layout.padded_numel * unit.flat.element_size())
        _gather(unit, ctx)

    def zero2_step(unit, ctx):
        shard_grad = torch.empty(unit.layout.shard_numel, dtype=unit.grad.dtype)
        lablib.reduce_scatter(shard_grad, unit.grad)
        unit.grad = shard_grad / ctx.world_size
        ctx.update(unit, unit.grad)
        _gather(unit, ctx)

    with pytest.raises(CheckFailed, match="differ from the single-process reference.*divide the all-reduced"):
        check_zero1(no_divide, cluster)
    with pytest.raises(CheckFailed, match="ctx.update got a gradient of \\d+ elements"):
        check_zero1(full_update, cluster)
    def zero2_by_all_reduce(unit, ctx):  # right values, right memory after the step: no reduce-scatter
        lablib.all_reduce(unit.grad)
        start, end = unit.layout.shard_bounds(ctx.rank)
        unit.grad = unit.grad[start:end] / ctx.world_size
        ctx.update(unit, unit.grad)
        _gather(unit, ctx)

    with pytest.raises(CheckFailed, match="holds \\d+ bytes of grads.*keeps only this rank's shard of the gradient"):
        check_zero2(zero2_keeps_full_grad, cluster)
    with pytest.raises(CheckFailed, match="issued all_gather, all_reduce. ZeRO-2 reduce-scatters the gradients"):
        check_zero2(zero2_by_all_reduce, cluster)
    with pytest.raises(CheckFailed, match="storage reshard freed: resize it back"):
        check_zero3(_gather, _free, cluster)
    if cluster.world_size > 1:
        with pytest.raises(CheckFailed, match="bytes of params.*reshard must free the full flat buffer"):
            check_zero3(unshard, keep_everything, cluster)
    with pytest.raises(CheckFailed, match="Likely: unit.flat is not the unit's full-size buffer any more"):
        check_zero3(unshard, _rebind, cluster)
    with pytest.raises(CheckFailed, match="zero2_step is lablib's own lablib.answers.lab01.zero2_step"):
        check_zero2(answers.zero2_step, cluster)
    with pytest.raises(CheckFailed, match="zero1_step is None"):
        check_zero1(None, cluster)
    check_zero2(zero2_step, cluster)
