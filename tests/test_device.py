"""The device rule (lablib/pool/backend.py): where each rank computes, decided in one place, and every lab's
rank jobs computing there. Without a GPU the rule is held by lablib/device_audit.py: the jobs run under a
mode that fails on a tensor that never went through the rule (a factory with no device, a model built and
never moved), the bug a GPU would find."""
import importlib

import pytest
import torch
import torch.distributed as dist

import lablib
from lablib import comm
from lablib.checks import Check
from lablib.labs import LABS
from lablib.device_audit import Audit, DeviceRuleBroken, check_result
from lablib.timeline import RECORDER
from lablib.pool import backend
from lablib.answers import lab03 as fsdp_hooks, lab04 as tp_answers, lab05 as pp_answers, lab06, lab07, lab08, lab09, \
    registered
from lablib.strategies import compose, context_parallel as cp, experts, fsdp, pp_reference, prefetch, tensor_parallel as tp
from lablib.strategies import accumulate, checkpoint, mixed, tp_reference


@pytest.mark.parametrize("gpus, world_size, device, want", [
    (0, 2, "auto", ("cpu", "gloo", "Gloo on CPU (no GPU found)")),
    (1, 2, "auto", ("cuda", "gloo", "2 ranks share 1 GPU(s) for compute")),
    (1, 1, "auto", ("cuda", "nccl", "NCCL on 1 GPU(s), one per rank")),
    (4, 2, "auto", ("cuda", "nccl", "NCCL on 2 GPU(s), one per rank")),
    (4, 2, "cpu", ("cpu", "gloo", "Gloo on CPU (device='cpu')")),
])
def test_one_rule_decides_where_ranks_compute_and_how_they_talk(monkeypatch, gpus, world_size, device, want):
    monkeypatch.setattr(backend, "_gpu_count", lambda: gpus)
    b = backend.resolve_backend("auto", world_size, device)
    d = backend.resolve_device(device, b)
    assert (d, b) == want[:2]
    assert backend.describe_backend(b, world_size, 1, d).startswith(want[2])
    assert [backend.gpu_of(r) for r in range(3)] == ([r % gpus for r in range(3)] if gpus else [0, 0, 0])


def test_a_device_that_cannot_be_had_is_refused(monkeypatch):
    monkeypatch.setattr(backend, "_gpu_count", lambda: 0)
    with pytest.raises(ValueError, match="device='cuda' but this machine has no GPU"):
        backend.resolve_device("cuda")
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        backend.resolve_device("gpu")
    monkeypatch.setattr(backend, "_gpu_count", lambda: 1)
    with pytest.raises(ValueError, match="backend='nccl' needs one GPU per rank: world_size=2"):
        backend.resolve_backend("nccl", 2)
    with pytest.raises(ValueError, match="backend='nccl' runs on GPUs"):
        backend.resolve_backend("nccl", 1, "cpu")


def test_the_audit_tells_a_tensor_made_on_the_rule_from_one_that_never_went_through_it():
    with Audit():
        model = torch.nn.Linear(3, 4)
        x = torch.randn(2, 3)                       # made on the CPU from a seed...
        with pytest.raises(DeviceRuleBroken, match="linear computed with a tensor made without a device"):
            model(comm.to_device(x))                # ...the data moved, the model not
        model = comm.to_device(model)
        y = model(comm.to_device(x))
        y.sum().backward()
        assert model.weight.grad is not None        # gradients, made by autograd, are on the rule
        with pytest.raises(DeviceRuleBroken, match="add computed with a tensor made without a device"):
            y + torch.zeros(4)
        y + torch.zeros(4, device=comm.device()) + torch.zeros_like(y)
        check_result({"ok": [y.detach()]})
        with pytest.raises(DeviceRuleBroken, match="the job returned a tensor"):
            check_result([torch.ones(2) * 3])


def _audited(n: int):
    """A pool whose ranks run every job under the audit (the variable is set only while they start: the
    other pools of the session stay as they are)."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("LABLIB_DEVICE_AUDIT", "1")
        c = lablib.Cluster(n, backend="gloo", timeout=20, quiet=True)
    with c:
        yield c


@pytest.fixture(scope="module")
def audited():
    yield from _audited(2)


@pytest.fixture(scope="module")
def audited4():
    """For the checks that run on 4 ranks only (lab 08's 2 × 2 meshes)."""
    yield from _audited(4)


def _off_rule():
    x = torch.ones(4)  # no device: on a GPU, a CPU tensor
    lablib.all_reduce(x)


def test_a_job_that_breaks_the_rule_fails_under_the_audit(audited):
    with pytest.raises(lablib.RankError, match="lablib.all_reduce got a tensor made without a device"):
        audited.run(_off_rule)


# Every rank check of every lab, with lablib's answers (the registry's, by the check's parameters), through
# the very jobs that run a learner's
RANK_CHECKS = [(lab.checks, check) for lab in LABS
               for check in vars(importlib.import_module(f"lablib.checks.{lab.checks}")).values()
               if isinstance(check, Check) and not check.local]


def run_check(lab: str, check: Check, cluster) -> str:
    """``check`` on ``cluster`` with lab ``lab``'s registered answers, given what it is given."""
    answers = {name: fn for fns in registered(lab).values() for name, fn in fns.items()}
    data = check.collect(tuple(answers[name] for name in check.params), cluster, None,
                         *check.inputs(cluster.world_size, None))
    return check.judge(data, cluster.world_size, None)


@pytest.mark.parametrize("lab, check", RANK_CHECKS, ids=[c.task for _, c in RANK_CHECKS])
def test_every_labs_rank_jobs_keep_the_device_rule(audited, request, lab, check):
    run_check(lab, check, audited if audited.world_size in check.world_sizes else request.getfixturevalue("audited4"))


def test_the_labs_measurements_keep_the_device_rule(audited):
    audited.run(prefetch.train, fsdp_hooks.PREFETCH, "wide8", 1, depth=1)
    audited.run(prefetch.fsdp2_train, "mlp", 1, 1)
    audited.run(fsdp.fsdp2_train, "mlp", 1)
    audited.run(tp.block_job, tp_answers.FNS, 1, 0)
    audited.run(tp.activation_bytes, "sp", tp_answers.FNS)
    audited.run(tp_reference.dtensor_block_job, 1, 0)
    audited.run(pp_reference.step_job, pp_answers.execute, lambda p, m, v=1: pp_answers.one_f_one_b(p, m), 2, 1, None, 1)
    audited.run(pp_reference.torch_step_job, "1f1b", 2, 1, 1)
    small = dict(tokens=64, heads=4, dim=8)
    audited.run(cp.ring_job, lab06.ring_attention, "zigzag", True, 1, **small)
    audited.run(cp.ring_job, cp.allgather_attention, "zigzag", True, 1, output=True, **small)
    audited.run(cp.ring_job, lab06.ulysses_attention, "contiguous", True, 1, True, **small)
    for dispatcher in ("all_to_all", "all_gather"):
        audited.run(experts.moe_job, lab07.moe_layer, 0.5, 1, None, dispatcher, lab07.route, tokens=64, dim=16,
                    hidden=32)


def test_lab_08s_measurements_keep_the_device_rule(audited4):
    audited4.run(compose.step_job, lab08.train_step, compose.MESHES["TP×PP"], 0, 2, lab08.checkpointed)


def test_lab_09s_measurements_keep_the_device_rule(audited, tmp_path):
    audited.run(mixed.train, lab09.mp_unshard, lab09.mp_reduce, mixed.Policy(), "mlp", 1)
    audited.run(mixed.reduction_job, (2,), numel=64)
    audited.run(mixed.stall_job, torch.bfloat16, 2)
    audited.run(accumulate.fsdp_job, 2, False, "mlp")
    audited.run(checkpoint.train, lab09.save_shard, None, range(1), tmp_path)
    audited.run(checkpoint.train, None, lab09.load_shard, range(1, 2), tmp_path, True)


def _staged_collectives():
    """Every lablib collective through host copies (as CUDA tensors go over Gloo), sync and async."""
    r, n = dist.get_rank(), dist.get_world_size()
    comm.STAGE_CPU[0] = True
    try:
        dev = lablib.device()
        x = torch.full((4,), float(r + 1), device=dev)
        lablib.all_reduce(x)
        gathered = torch.empty(2 * n, device=dev)
        lablib.all_gather(gathered, torch.full((2,), float(r), device=dev), async_op=True).wait()
        mine = torch.empty(2, device=dev)
        lablib.reduce_scatter(mine, torch.ones(2 * n, device=dev) * (r + 1))
        got = torch.zeros(3, device=dev)
        works = [lablib.isend(torch.full((3,), float(r), device=dev), (r + 1) % n), lablib.irecv(got, (r - 1) % n)]
        for w in works:
            w.wait()
    finally:
        comm.STAGE_CPU[0] = False
    return x.tolist(), gathered.tolist(), mine.tolist(), got.tolist(), sorted({s.name for s in RECORDER.spans})


def test_collectives_staged_through_host_memory_give_the_same_results(cluster):
    n = cluster.world_size
    for r, (x, gathered, mine, got, names) in enumerate(cluster.run(_staged_collectives)):
        assert x == [n * (n + 1) / 2] * 4
        assert gathered == [float(k) for k in range(n) for _ in range(2)]
        assert mine == [n * (n + 1) / 2] * 2
        assert got == [float((r - 1) % n)] * 3
        assert {"copy to host", "copy from host"} <= set(names), names  # each staging copy on the timeline


def _freed_buffers(stage: bool):
    """A gather into a buffer whose storage was freed (a unit's flat buffer after reshard): before the call, and
    while an asynchronous gather was in flight; as CPU ranks run it, or staged through host memory as on a GPU."""
    n = dist.get_world_size()
    comm.STAGE_CPU[0] = stage
    errors = []
    try:
        dev = lablib.device()
        flat = torch.empty(2 * n, device=dev)
        flat.untyped_storage().resize_(0)
        try:
            lablib.all_gather(flat, torch.ones(2, device=dev))
        except RuntimeError as exc:
            errors.append(str(exc))
        flat = torch.empty(2 * n, device=dev)
        work = lablib.all_gather(flat, torch.ones(2, device=dev), async_op=True)
        flat.untyped_storage().resize_(0)
        try:
            work.wait()
        except RuntimeError as exc:
            errors.append(str(exc))
    finally:
        comm.STAGE_CPU[0] = False
    return errors


@pytest.mark.parametrize("stage", [False, True], ids=["cpu", "staged"])
def test_a_freed_buffer_is_named_alike_on_the_cpu_and_staged_through_host_memory(cluster, stage):
    """Labs 01 and 03 hint on PyTorch's words for a freed buffer ("storage of size 0") and on lablib's for a gather
    that lost its output: staged, where Gloo never sees the GPU tensor, lablib says the same."""
    for errors in cluster.run(_freed_buffers, stage):
        assert len(errors) == 2, errors
        assert "storage of size 0" in errors[0] and "lost its output" in errors[1], errors
