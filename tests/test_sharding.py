"""Lab 01's library on real Gloo ranks: flat layout, every ZeRO stage against the single-process
reference and PyTorch's FSDP2, bytes held against the ZeRO formulas, bytes sent per step."""
import random

import pytest
import torch

from lablib import comm, fsdp, memory, sharding
from lablib.sharding import FlatLayout, Optimizer


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
            got = [(sl.shard_start + k, (sl.param, sl.param_start + k)) for sl in layout.shard_slices(rank)
                   for k in range(sl.length)]
            assert got == expected, (shapes, rank)


def test_flatten_and_views_round_trip():
    params = [torch.randn(3, 5), torch.randn(7), torch.randn(2, 2)]
    layout = FlatLayout.of(params, 4)
    flat = layout.flatten(params)
    assert flat.numel() == 28 and flat[26:].eq(0).all()  # 15 + 7 + 4 = 26, padded to 4 shards of 7
    for p, v in zip(params, layout.views(flat)):
        assert torch.equal(p, v) and v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


@pytest.mark.parametrize("model", ["mlp", "transformer"])
@pytest.mark.parametrize("stage", sharding.STAGES)
def test_every_stage_matches_the_single_process_reference(cluster, stage, model):
    ref = sharding.reference(model, 3, cluster.world_size)
    out = cluster.run(sharding.train, stage, model, 3)
    for rank, result in enumerate(out):
        for got, want in zip(result["params"], ref):
            assert (got - want).abs().max().item() <= 1e-6, (stage, model, rank)
    assert len({tuple(r["losses"]) for r in out}) == cluster.world_size  # each rank saw its own data


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "fp32"])
def test_bytes_held_are_the_zero_formulas(cluster, mixed):
    n = cluster.world_size
    for stage in sharding.STAGES:
        out = cluster.run(sharding.train, stage, "transformer", 2, Optimizer("adam", lr=1e-3), mixed)
        for result in out:
            assert result["memory"] == memory.zero_formula(stage, result["psi"], n, mixed), stage


def test_fit_separates_what_is_kept_whole_from_what_is_split():
    psi = 7224
    measured = {(stage, n): (sum(memory.zero_formula(stage, psi, n).values()), psi)
                for stage in sharding.STAGES for n in (2, 4)}
    fit = memory.fit_per_parameter(measured)
    assert fit["dp"] == pytest.approx((16, 0)) and fit["zero1"] == pytest.approx((4, 12))
    assert fit["zero2"] == pytest.approx((2, 14)) and fit["zero3"] == pytest.approx((0, 16))
    with pytest.raises(ValueError, match="at least two world sizes"):
        memory.fit_per_parameter({("dp", 2): (16.0, 1)})


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_fsdp2_matches_the_reference_and_holds_torch_chunk_shards(cluster, model):
    n = cluster.world_size
    ref = fsdp.unflatten(model, sharding.reference(model, 3, n))
    out = cluster.run(fsdp.fsdp2_train, model, 3)
    for rank, result in enumerate(out):
        for name, local, full in result["params"]:
            assert (full - ref[name]).abs().max().item() <= 1e-6, name
            chunks = torch.chunk(ref[name], n, dim=0)
            want = chunks[rank] if rank < len(chunks) else ref[name][:0]
            assert local.shape == want.shape and (local - want).abs().max().item() <= 1e-6, (name, rank)


def test_fsdp2_and_our_zero3_hold_the_same_bytes_when_rows_divide_evenly(cluster):
    ours = cluster.run(sharding.train, "zero3", "transformer", 3)
    theirs = cluster.run(fsdp.fsdp2_train, "transformer", 3)
    assert [o["memory"] for o in ours] == [t["memory"] for t in theirs]


def test_reshard_frees_the_full_parameters_between_uses(cluster):
    def check():
        import torch.distributed as dist
        units = sharding.setup(sharding.build_model("mlp"), "zero3", dist.get_rank(), dist.get_world_size(),
                               Optimizer())
        ctx = sharding.Context(dist.get_rank(), dist.get_world_size(), Optimizer(), "zero3")
        before = [u.flat.untyped_storage().nbytes() for u in units]
        fsdp.unshard(units[0], ctx)
        during = units[0].flat.untyped_storage().nbytes()
        values = units[0].module[0].weight.detach().clone()
        fsdp.reshard(units[0])
        return before, during, units[0].flat.untyped_storage().nbytes(), values
    ref = sharding.build_model("mlp")[0][0].weight
    for before, during, after, values in cluster.run(check):
        assert before == [0, 0, 0] and after == 0 and during > 0
        assert torch.equal(values, ref.detach())


@pytest.mark.parametrize("stage, units_of_psi", [("dp", 2), ("zero1", 3), ("zero2", 2), ("zero3", 3)])
def test_bytes_sent_per_step(cluster, stage, units_of_psi):
    n = cluster.world_size
    out = cluster.run(sharding.train, stage, "transformer", 1)
    sent = comm.bytes_sent(cluster.timeline())
    psi_bytes = out[0]["psi"] * 4 if stage != "dp" else 7224 * 4
    assert sent == pytest.approx(units_of_psi * (n - 1) / n * psi_bytes)


def test_stage_and_model_names_are_checked():
    with pytest.raises(ValueError, match="unknown model 'cnn'"):
        sharding.build_model("cnn")
    with pytest.raises(ValueError, match="unknown stage 'zero4'"):
        sharding.setup(sharding.build_model("mlp"), "zero4", 0, 1, Optimizer())


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

