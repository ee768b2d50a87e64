"""Mixed precision on FSDP's flat units: fp32 master shards, the all-gather and the compute in a low
precision, the gradients reduce-scattered in the dtype a policy names, the optimizer on the fp32 shards
(Micikevicius et al. 2018, https://arxiv.org/abs/1710.03740; FSDP2's ``MixedPrecisionPolicy``, whose
``param_dtype`` is the all-gather's and the compute's dtype and ``reduce_dtype`` the reduce-scatter's).

``train`` runs a step whose two collectives are the learner's (``unshard(unit, policy)``, ``reduce(unit, grad,
policy, ctx)``); the step recomputes each unit's forward in its backward, as ``fsdp.forward_backward`` does, so
the order of the collectives is plain to read. ``reference`` is the same arithmetic in one process, rank by
rank (what the checks compare with); ``fsdp2_train`` is PyTorch's FSDP2 with the same policy on the same model
and batches. ``reduction_error`` and ``stall_run`` measure why the reduction's dtype and the fp32 master
weights matter. The lab's answers are in ``lablib.answers.lab09``.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from .. import comm
from ..timeline import span
from ..toy import batch, build_model, generator, loss_fn
from .flat import setup
from .fsdp import forward_backward
from .harness import Context, Optimizer, gather_full


@dataclass(frozen=True)
class Policy:
    """What FSDP2's MixedPrecisionPolicy says: the dtype of the all-gather and the compute, and of the
    gradients' reduce-scatter. The master parameters and the optimizer stay fp32."""
    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32

    def __str__(self) -> str:
        return f"param_dtype={_name(self.param_dtype)}, reduce_dtype={_name(self.reduce_dtype)}"


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


SGD = Optimizer("sgd", lr=0.05, momentum=0.9)


def units_for(model: nn.Sequential, rank: int, n: int, optimizer: Optimizer, policy: Policy) -> list:
    """FSDP units whose shard is the fp32 master (``unit.master`` is ``unit.shard``) and whose gather buffer
    ``unit.flat`` is in ``policy.param_dtype``, freed: the module's parameters are views into it."""
    units = setup(model, rank, n, optimizer.init_state, sharded=True, frees_params=True)
    for u in units:
        flat = torch.zeros(u.layout.padded_numel, dtype=policy.param_dtype, device=u.master.device)
        for p, view in zip(u.module.parameters(), u.layout.views(flat)):
            p.data = view
        flat.untyped_storage().resize_(0)
        u.flat = flat
    return units


def free(unit) -> None:
    unit.flat.untyped_storage().resize_(0)


def step(units, x, y, ctx, policy: Policy, unshard, reduce, checked: bool = True):
    """One forward and backward in ``policy.param_dtype`` (the loss in fp32), each unit's gradient shard left in
    ``unit.grad`` by ``reduce`` (``checked``: or an error says what it left); returns the loss and the dtype each
    unit's parameters had as it computed."""
    dtypes = []

    def gather(u, ctx):
        unshard(u, policy)
        dtypes.append(str(next(u.module.parameters()).dtype))

    loss = forward_backward(units, x.to(policy.param_dtype), y, ctx, gather, free,
                            lambda u, grad, ctx: reduce(u, grad, policy, ctx))
    for i, u in enumerate(units if checked else ()):
        if not isinstance(u.grad, torch.Tensor) or u.grad.numel() != u.layout.shard_numel:
            got = "nothing" if not isinstance(u.grad, torch.Tensor) else f"{u.grad.numel()} numbers"
            raise RuntimeError(f"after reduce, unit {i}'s unit.grad holds {got}; it must hold this rank's shard of the "
                               f"averaged gradient, {u.layout.shard_numel} numbers (unit.layout.shard_numel)")
    return loss, dtypes[:len(units)]


def train(unshard, reduce, policy: Policy = Policy(), model_name: str = "mlp", steps: int = 3,
          optimizer: Optimizer = SGD, data=None, seed: int = 0) -> dict:
    """Mixed-precision FSDP on this rank (inside ``cluster.run``); ``data``: this rank's ``harness.rank_data``.
    Returns the full fp32 parameters, the losses, the collectives of the first step and the compute dtypes."""
    import torch.distributed as dist

    from .harness import rank_data

    rank, n = dist.get_rank(), dist.get_world_size()
    ctx = Context(rank, n, optimizer)
    model, batches = copy.deepcopy(data) if data else rank_data(model_name, steps, rank, seed)
    units = units_for(comm.to_device(model), rank, n, optimizer, policy)
    losses, ops, dtypes = [], [], []
    for k in range(steps):
        x, y = comm.to_device(*batches[k])
        (loss, dtypes), first = comm.watched(step, units, x, y, ctx, policy, unshard, reduce)
        ops = ops or first
        with span("optimizer step"):
            for u in units:
                ctx.update(u, u.grad)
                u.grad = None
        losses.append(loss.item())
    return {"params": gather_full(units, True), "losses": losses, "ops": ops, "dtypes": dtypes,
            "master": [str(u.master.dtype) for u in units]}


def reference(policy: Policy = Policy(), model_name: str = "mlp", steps: int = 3, world_size: int = 2,
              optimizer: Optimizer = SGD, seed: int = 0, data=None) -> list[torch.Tensor]:
    """The same arithmetic in one process: each rank's micro-batch through the parameters cast to
    ``param_dtype``, its gradient cast to ``reduce_dtype``, summed over the ranks in that dtype, averaged in
    fp32 and applied to the fp32 masters. ``data``: every rank's ``rank_data``, else drawn from ``seed``."""
    from .harness import rank_data

    data = data or [rank_data(model_name, steps, r, seed) for r in range(world_size)]
    model = copy.deepcopy(data[0][0])
    masters = [p.detach().clone().float() for p in model.parameters()]
    states = [optimizer.init_state(m) for m in masters]
    for k in range(steps):
        total = None
        for _, batches in data:
            low = copy.deepcopy(model).to(policy.param_dtype)
            for p, m in zip(low.parameters(), masters):
                p.data = m.to(policy.param_dtype)
            x, y = batches[k]
            loss_fn(low(x.to(policy.param_dtype)), y).backward()
            grads = [p.grad.to(policy.reduce_dtype) for p in low.parameters()]
            total = grads if total is None else [t + g for t, g in zip(total, grads)]
        for m, g, s in zip(masters, total, states):
            optimizer.update(m, g.float() / len(data), s)
    out, i = [], 0
    for unit in model:
        count = len(list(unit.parameters()))
        out.append(torch.cat([m.flatten() for m in masters[i:i + count]]))
        i += count
    return out


def fsdp2_train(policy: Policy = Policy(), model_name: str = "mlp", steps: int = 3,
                optimizer: Optimizer = SGD, seed: int = 0) -> dict:
    """PyTorch's FSDP2 (``fully_shard`` with ``MixedPrecisionPolicy``) on the same model, initial weights and
    batches (inside ``cluster.run``). Returns each unit's full fp32 parameters, flattened as ``train``'s, and
    the losses."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from .fsdp import sum_then_divide_on_gloo

    rank, dev = dist.get_rank(), comm.torch_device()
    mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    model = build_model(model_name, seed).to(dev)
    mp = MixedPrecisionPolicy(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype)
    for unit in model:
        fully_shard(unit, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    sum_then_divide_on_gloo(model)
    opt = torch.optim.SGD(model.parameters(), lr=optimizer.lr, momentum=optimizer.momentum)
    losses = []
    for k in range(steps):
        opt.zero_grad()
        x, y = (v.to(dev) for v in batch(model_name, k, rank, seed))
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = [torch.cat([p.full_tensor().detach().float().flatten() for p in unit.parameters()]) for unit in model]
    return {"params": params, "losses": losses}


# -- why the reduction's dtype and the master weights matter --------------------------------------------
def rank_gradients(world_size: int, numel: int, seed: int = 0) -> list[torch.Tensor]:
    """Gradients as ranks hold them before a reduction: a shared signal plus each rank's own noise (fp32)."""
    g = generator(7 + seed)
    signal = torch.randn(numel, generator=g) * 1e-2
    return [signal + torch.randn(numel, generator=g) * 1e-2 for _ in range(world_size)]


def reduction_job(sizes=(2, 3, 4), dtypes=(torch.bfloat16, torch.float32), numel: int = 1 << 14) -> dict:
    """On the ranks: for each group of the first n ranks (n in ``sizes``) and each dtype, the relative error of a
    reduce-scatter in that dtype against the fp64 sum of the same fp32 gradients (every rank makes every rank's
    gradients from one seed, so each knows the exact sum of its chunk). {(n, dtype name): this rank's error}."""
    import torch.distributed as dist

    r, out = dist.get_rank(), {}
    for n in sizes:
        group = dist.new_group(list(range(n)))
        if r >= n:
            continue
        chunk = numel // n
        grads = [g[:chunk * n] for g in rank_gradients(n, numel)]
        exact = comm.to_device(torch.stack(grads).double().sum(0)[r * chunk:(r + 1) * chunk])
        for dtype in dtypes:
            got = torch.empty(chunk, dtype=dtype, device=comm.device())
            comm.reduce_scatter(got, comm.to_device(grads[r].to(dtype)), group=group, name=f"reduce_scatter {_name(dtype)}")
            out[(n, _name(dtype))] = ((got.double() - exact).abs().mean() / exact.abs().mean()).item()
    return out


def simulated_error(world_size: int, dtype: torch.dtype, numel: int = 1 << 14) -> float:
    """The same error in one process, the sum made as a ring reduce-scatter makes it: each chunk is added to
    rank by rank in turn, rounded to ``dtype`` after every addition. For rank counts this machine cannot run."""
    grads = rank_gradients(world_size, numel)
    acc = grads[0].to(dtype)
    for g in grads[1:]:
        acc = (acc.float() + g.to(dtype).float()).to(dtype)
    exact = torch.stack(grads).double().sum(0)
    return ((acc.double() - exact).abs().mean() / exact.abs().mean()).item()


def stall_job(master_dtype: torch.dtype, steps: int = 200, lr: float = 0.05) -> list[float]:
    """On the ranks: a linear fit whose weights are near 1 and must move by a few hundredths, trained by
    data-parallel SGD, each rank on its own rows, the gradients all-reduced, the compute in bf16 and the weights
    kept in ``master_dtype``. bf16 holds numbers near 1 in steps of 2⁻⁷ (0.0078): with bf16 weights an update
    smaller than half of that is rounded away, and the loss stalls. Returns the losses of the whole batch."""
    import torch.distributed as dist

    r, n = dist.get_rank(), dist.get_world_size()
    g = generator(11)
    x = torch.randn(64 * n, 64, generator=g)
    target = x @ (torch.randn(64, 8, generator=g) * 0.05 + 1.0)
    x, target = comm.to_device(x[r * 64:(r + 1) * 64], target[r * 64:(r + 1) * 64])
    w = comm.to_device(torch.ones(64, 8, dtype=master_dtype))
    losses = []
    for _ in range(steps):
        low = w.to(torch.bfloat16).requires_grad_(True)
        loss = ((x.to(torch.bfloat16) @ low).float() - target).pow(2).mean()
        loss.backward()
        grad = low.grad.float()
        comm.all_reduce(grad, name="all_reduce grads")
        with torch.no_grad():
            w -= (lr * grad / n).to(master_dtype)
        total = loss.detach().reshape(1)
        comm.all_reduce(total, name="loss")
        losses.append(total.item() / n)
    return losses
