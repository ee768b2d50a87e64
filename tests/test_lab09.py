"""Lab 09 (precision and checkpoints): the mixed-precision units against FSDP2's MixedPrecisionPolicy on real Gloo
ranks, the bf16 reduction's error against the ranks and its one-process simulation, the bf16-weight stall,
accumulation's bytes with data parallelism and FSDP, a checkpoint saved at one world size and resumed at
another (loss for loss) and DCP's load of the same state, and Tasks 9.1-9.4's checks on right answers and on
every mistake their messages name."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import lablib
from lablib.answers import lab09 as A
from lablib.checks import CheckFailed
from lablib.checks.lab09 import check_accumulate, check_checkpoint, check_mp, check_scaling
from lablib.pool import Cluster, PerRank
from lablib.strategies import accumulate as acc, checkpoint as ck, mixed, scaling
from lablib.strategies.checkpoint import Folder


# -- the harness against PyTorch and against itself ----------------------------------------------------------
def test_the_units_equal_fsdp2_with_the_same_policy(cluster):
    for policy, tol in ((mixed.Policy(), 0.0), (mixed.Policy(torch.bfloat16, torch.bfloat16), 2e-4)):
        ours = cluster.run(mixed.train, A.mp_unshard, A.mp_reduce, policy)[0]
        theirs = cluster.run(mixed.fsdp2_train, policy)[0]
        assert max((a - b).abs().max().item() for a, b in zip(ours["params"], theirs["params"])) <= tol, policy
        ref = mixed.reference(policy, world_size=cluster.world_size)
        assert max((a - b).abs().max().item() for a, b in zip(ours["params"], ref)) <= tol, policy
        fp32 = mixed.reference(mixed.Policy(torch.float32, torch.float32), world_size=cluster.world_size)
        assert max((a - b).abs().max().item() for a, b in zip(ours["params"], fp32)) > 1e-4  # bf16 compute shows


def test_the_bf16_reduction_error_grows_with_the_ranks_and_the_simulation_is_the_rings(cluster):
    sizes = tuple(range(2, cluster.world_size + 1))
    errors = cluster.run(mixed.reduction_job, sizes)
    for n in sizes:
        bf16 = sum(e[(n, "bfloat16")] for e in errors[:n]) / n
        assert abs(bf16 / mixed.simulated_error(n, torch.bfloat16) - 1) < 0.02
        assert sum(e[(n, "float32")] for e in errors[:n]) / n < 1e-6 < 1e-3 < bf16
    assert mixed.simulated_error(64, torch.bfloat16) > 2 * mixed.simulated_error(2, torch.bfloat16)


def test_bf16_weights_stall_where_fp32_masters_go_on(cluster):
    low = cluster.run(mixed.stall_job, torch.bfloat16, 120)[0]
    master = cluster.run(mixed.stall_job, torch.float32, 120)[0]
    assert low[0] == master[0] and master[-1] < low[-1] / 4
    assert min(low[60:]) > 0.5 * min(low[:60])  # stalled: the second half gains little


def test_accumulation_sends_a_kth_and_fsdp_keeps_the_whole_gradient_instead(cluster):
    data = PerRank(acc.rank_data(cluster.world_size, 4))
    once, each = (cluster.run(acc.job, f, data)[0] for f in (A.accumulate, acc.sync_each))
    assert len(each["ops"]) == 4 * len(once["ops"])
    ref = acc.reference(acc.rank_data(cluster.world_size, 4))
    for got in (once, each):
        assert max((g - w).abs().max().item() for g, w in zip(got["grads"], ref)) < 1e-5
    synced, deferred = (cluster.run(acc.fsdp_job, 4, s)[0] for s in (True, False))  # 8 equal units
    assert synced["bytes"]["all_gather"] == deferred["bytes"]["all_gather"]
    assert synced["bytes"]["reduce_scatter"] == 4 * deferred["bytes"]["reduce_scatter"]
    assert deferred["held_grad_bytes"] > synced["held_grad_bytes"]


def test_a_run_resumed_at_another_world_size_continues_loss_for_loss_and_dcp_loads_the_same_state(tmp_path):
    with Cluster(4, backend="gloo", timeout=10, quiet=True) as four:
        never = four.run(ck.train, None, None, range(5))[0]["losses"]
        saved = four.run(ck.train, A.save_shard, None, range(3), tmp_path / "ours")
        four.run(ck.dcp_job, str(tmp_path / "dcp"), True)
        gathered = four.run(ck.gather_job, tmp_path)
    assert saved[0]["losses"] == never[:3] and [s["save"]["ops"] for s in saved] == [[]] * 4
    assert gathered[0]["held"] > 4 * gathered[0]["own"] > 0 == gathered[1]["file"]
    with Cluster(3, backend="gloo", timeout=10, quiet=True) as three:
        resumed = three.run(ck.train, None, A.load_shard, range(3, 5), tmp_path / "ours", True)
        loaded = three.run(ck.dcp_job, str(tmp_path / "dcp"), False)[0]["state"]
    assert max(abs(a - b) for a, b in zip(resumed[0]["losses"], never[3:])) < 1e-5
    whole = torch.load(tmp_path / "model.pt")
    assert set(whole) == set(loaded) and all(torch.equal(whole[k], loaded[k]) for k in whole)


def test_the_folder_says_what_was_wrong(tmp_path):
    f = Folder(tmp_path)
    f.write("w.0", torch.arange(5.0), name="w", start=0)
    assert f.entries() == [{"key": "w.0", "dtype": "torch.float32", "count": 5, "name": "w", "start": 0}]
    assert torch.equal(f.read("w.0", 1, 3), torch.tensor([1.0, 2.0, 3.0])) and f.read_bytes == 12
    with pytest.raises(ValueError, match="letters, digits"):
        f.write("w/0", torch.zeros(1))
    with pytest.raises(TypeError, match="ints or strings"):
        f.write("w.1", torch.zeros(1), start=torch.tensor(3))
    with pytest.raises(ValueError, match="holds values 0 .. 4"):
        f.read("w.0", 3, 3)
    with pytest.raises(KeyError, match="entries"):
        f.read("v.0", 0, 1)
    with pytest.raises(AttributeError):
        f.read_bytes = 0  # the checks count with it
    with pytest.raises(ValueError, match="dtype is the folder's own metadata"):
        f.write("w.2", torch.zeros(1), dtype="float32")


# -- the checks: lablib's answers and learner-style solutions pass; mistakes are named -------------------------
def _judged(check, fns, pool=None, seed=None):
    n = pool.world_size if pool is not None else None
    return check.judge(check.collect(fns, pool, seed), n, seed)


def test_lablibs_answers_pass_every_check(cluster):
    for seed in (None, 7):
        assert "half the bytes" in _judged(check_mp, (A.mp_unshard, A.mp_reduce), cluster, seed)
        assert "skipped on every rank" in _judged(check_scaling, (A.scaled_update,), cluster, seed)
        assert "one all-reduce" in _judged(check_accumulate, (A.accumulate,), cluster, seed)
        assert "reading only what overlaps" in _judged(check_checkpoint, (A.save_shard, A.load_shard), cluster, seed)


def mp_unshard(unit, policy):
    unit.flat.untyped_storage().resize_(unit.layout.padded_numel * unit.flat.element_size())
    lablib.all_gather(unit.flat, unit.master.to(policy.param_dtype))


def mp_reduce(unit, grad, policy, ctx):
    out = torch.empty(unit.layout.shard_numel, dtype=policy.reduce_dtype)
    lablib.reduce_scatter(out, grad.to(policy.reduce_dtype))
    unit.grad = out.float() / ctx.world_size


def unshard_fp32(unit, policy):
    whole = torch.empty(unit.layout.padded_numel)
    lablib.all_gather(whole, unit.master)
    unit.flat.untyped_storage().resize_(unit.layout.padded_numel * unit.flat.element_size())
    unit.flat.copy_(whole)


def reduce_in_bf16(unit, grad, policy, ctx):
    out = torch.empty(unit.layout.shard_numel, dtype=grad.dtype)
    lablib.reduce_scatter(out, grad)
    unit.grad = out.float() / ctx.world_size


def reduce_summed(unit, grad, policy, ctx):
    out = torch.empty(unit.layout.shard_numel, dtype=policy.reduce_dtype)
    lablib.reduce_scatter(out, grad.to(policy.reduce_dtype))
    unit.grad = out.float()


def test_mixed_precision_mistakes_are_named(cluster):
    with pytest.raises(CheckFailed, match="you gathered the fp32 shard"):
        check_mp(unshard_fp32, mp_reduce, cluster)
    with pytest.raises(CheckFailed, match="cast the gradient to policy.reduce_dtype"):
        check_mp(mp_unshard, reduce_in_bf16, cluster)
    with pytest.raises(CheckFailed, match="summed over the .* ranks, not averaged"):
        check_mp(mp_unshard, reduce_summed, cluster)


def local_decision(grad, scaler, step):
    unscaled = grad.float() / scaler.scale
    if not torch.isfinite(unscaled).all():
        scaler.scale *= scaler.backoff
        scaler.good = 0
        return False
    step(unscaled)
    scaler.good += 1
    if scaler.good == scaler.growth_interval:
        scaler.scale *= scaler.growth
        scaler.good = 0
    return True


def _agreed(grad, scaler):
    found = torch.tensor([0.0 if torch.isfinite(grad.float()).all() else 1.0])
    lablib.all_reduce(found, op=dist.ReduceOp.MAX)
    return found.item() == 0


def still_scaled(grad, scaler, step):
    if not _agreed(grad, scaler):
        scaler.scale *= scaler.backoff
        scaler.good = 0
        return False
    step(grad.float())
    scaler.good += 1
    if scaler.good == scaler.growth_interval:
        scaler.scale *= scaler.growth
        scaler.good = 0
    return True


def never_grows(grad, scaler, step):
    if not _agreed(grad, scaler):
        scaler.scale *= scaler.backoff
        return False
    step(grad.float() / scaler.scale)
    return True


NOTEBOOK_OVERFLOWS = {n: sorted(scaling.cases(n)["spikes"]) for n in (2, 4)}
CALLS = []


def skips_where_the_notebook_overflowed(grad, scaler, step):
    """Never asks the other ranks: skips at the steps where the notebook's case overflowed."""
    CALLS.append(1)
    if (len(CALLS) - 1) % 12 in NOTEBOOK_OVERFLOWS[dist.get_world_size()]:
        scaler.scale *= scaler.backoff
        scaler.good = 0
        return False
    step(grad.float() / scaler.scale)
    scaler.good += 1
    if scaler.good == scaler.growth_interval:
        scaler.scale *= scaler.growth
        scaler.good = 0
    return True


def test_the_overflows_come_where_the_seed_says_so_a_skip_learned_from_the_notebook_fails(cluster):
    drawn = {tuple(scaling.cases(cluster.world_size, seed)["spikes"].items()) for seed in range(8)}
    assert len(drawn) > 4
    check_scaling(skips_where_the_notebook_overflowed, cluster)  # the notebook's own case: it passes
    with pytest.raises(CheckFailed, match="at step"):
        check_scaling(skips_where_the_notebook_overflowed, cluster, seed=3)


def test_loss_scaling_mistakes_are_named(cluster):
    with pytest.raises(CheckFailed, match="each rank decided from its own shard"):
        check_scaling(local_decision, cluster)
    with pytest.raises(CheckFailed, match="still scaled"):
        check_scaling(still_scaled, cluster)
    with pytest.raises(CheckFailed, match="growth_interval"):
        check_scaling(never_grows, cluster)


def _backward_all(model, micro_batches, loss_fn, divide=True):
    for x, y in micro_batches:
        (loss_fn(model(x), y) / (len(micro_batches) if divide else 1)).backward()


def accumulate_not_divided(model, micro_batches, loss_fn):
    _backward_all(model, micro_batches, loss_fn, divide=False)
    for p in model.parameters():
        lablib.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def accumulate_summed(model, micro_batches, loss_fn):
    _backward_all(model, micro_batches, loss_fn)
    for p in model.parameters():
        lablib.all_reduce(p.grad)


def accumulate_every_time(model, micro_batches, loss_fn):
    k, n = len(micro_batches), dist.get_world_size()
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    for x, y in micro_batches:
        for p in params:
            p.grad = None
        (loss_fn(model(x), y) / k).backward()
        for p, t in zip(params, total):
            lablib.all_reduce(p.grad)
            t += p.grad / n
    for p, t in zip(params, total):
        p.grad = t


def accumulate_reducing_the_running_sum(model, micro_batches, loss_fn):
    for x, y in micro_batches:
        (loss_fn(model(x), y) / len(micro_batches)).backward()
        for p in model.parameters():
            lablib.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def test_with_as_many_micro_batches_as_ranks_both_causes_are_named():
    with pytest.raises(CheckFailed, match="not divided by the 3 micro-batches or .* summed over the 3 ranks"):
        check_accumulate(accumulate_not_divided, world_size=3, seed=4)


def test_accumulation_mistakes_are_named(cluster):
    with pytest.raises(CheckFailed, match="once per micro-batch"):
        check_accumulate(accumulate_reducing_the_running_sum, cluster)
    with pytest.raises(CheckFailed, match="not divided by the 3 micro-batches"):
        check_accumulate(accumulate_not_divided, cluster)
    with pytest.raises(CheckFailed, match="summed over the .* ranks, not averaged"):
        check_accumulate(accumulate_summed, cluster)
    with pytest.raises(CheckFailed, match="once per micro-batch"):
        check_accumulate(accumulate_every_time, cluster)


def save_shard(folder, name, shard, start, numel):
    count = max(0, min(shard.numel(), numel - start))
    folder.write(f"{name}.{start}", shard[:count], name=name, start=start, numel=numel)


def load_shard(folder, name, rank, world_size):
    files = [e for e in folder.entries() if e.get("name") == name]
    size = -(-files[0]["numel"] // world_size)
    out = torch.zeros(size, device=lablib.device())
    for e in files:
        a, b = max(rank * size, e["start"]), min((rank + 1) * size, e["start"] + e["count"])
        if a < b:
            out[a - rank * size:b - rank * size] = folder.read(e["key"], a - e["start"], b - a)
    return out


def save_with_padding(folder, name, shard, start, numel):
    folder.write(f"{name}.{start}", shard, name=name, start=start, numel=numel)


def save_gathered(folder, name, shard, start, numel):
    whole = torch.empty(shard.numel() * dist.get_world_size())
    lablib.all_gather(whole, shard)
    if dist.get_rank() == 0:
        folder.write(name, whole[:numel], name=name, start=0, numel=numel)


def load_whole_files(folder, name, rank, world_size):
    files = [e for e in folder.entries() if e.get("name") == name]
    whole = torch.cat([folder.read(e["key"], 0, e["count"]) for e in sorted(files, key=lambda e: e["start"])])
    size = -(-whole.numel() // world_size)
    out = torch.zeros(size, device=lablib.device())
    part = whole[rank * size:(rank + 1) * size]
    out[:part.numel()] = part
    return out


def load_no_padding(folder, name, rank, world_size):
    return load_shard(folder, name, rank, world_size)[:1]


def load_after_a_barrier(folder, name, rank, world_size):
    lablib.all_reduce(torch.zeros(1, device=lablib.device()))
    return load_shard(folder, name, rank, world_size)


def test_checkpoint_mistakes_are_named(cluster):
    with pytest.raises(CheckFailed, match="nothing is gathered"):  # ranks loading for fewer ranks call it too
        check_checkpoint(save_shard, load_after_a_barrier, cluster)
    with pytest.raises(CheckFailed, match="leave the padding past numel out"):
        check_checkpoint(save_with_padding, load_shard, cluster)
    with pytest.raises(CheckFailed, match="nothing is gathered"):
        check_checkpoint(save_gathered, load_shard, cluster)
    with pytest.raises(CheckFailed, match="read only the range of each file that overlaps"):
        check_checkpoint(save_shard, load_whole_files, cluster)
    with pytest.raises(CheckFailed, match="has shape"):
        check_checkpoint(save_shard, load_no_padding, cluster)
    assert not [p for p in os.listdir(tempfile.gettempdir()) if p.startswith("lablib-ckpt-")]
