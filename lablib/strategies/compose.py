"""Data, tensor and pipeline parallelism together, on a mesh of ranks.

The ranks form a mesh of sizes (pp, dp, tp), tensor-parallel innermost (consecutive ranks, as within a
node: ``init_device_mesh``'s order, torchtitan's); each 2×2 slice of it runs on 4 ranks (``MESHES``). A rank
holds its pipeline stage's blocks, each block's MLP split over its tensor-parallel group (lab 04's
``tp_mlp``), and runs its data-parallel share of the global batch through the pipeline in micro-batches
(lab 05's executor, 1F1B). ``Kit`` is lablib's part on one rank; the learner's step wires it, each
collective on its axis's group and the loss scaled for the global batch; ``step_job`` runs that step and
returns what the checks judge, ``reference`` the single process it must equal. Lab 04's and lab 05's
answers are this lab's harness (``labs.builds_on``): the kit is handed them (``harness``), never imports them at
the top; in a grading box they come as data (course/executor.load_harness).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import comm, p2p
from ..toy import generator
from ..timeline import _now, span

AXES = ("pp", "dp", "tp")
MESHES = {"DP×TP": (1, 2, 2), "DP×PP": (2, 2, 1), "TP×PP": (2, 1, 2)}  # (pp, dp, tp) on 4 ranks
SIZE = dict(width=16, hidden=32, layers=4, rows=16, micro_batches=4)
BIG = dict(width=256, hidden=1024, layers=8, rows=256, micro_batches=8)  # the measured step
RANKED = dict(width=256, hidden=1024, layers=4, rows=128, micro_batches=4)  # the meshes ranked over TOY_LINK
LR = 0.05
TOL = 1e-5


def size_for(seed) -> dict:
    """A check's model and batch: ``SIZE``, or for a seed another width, depth (so other stage cuts), rows
    and number of micro-batches."""
    if not seed:
        return dict(SIZE)
    rng = generator(7 + seed)
    pick = lambda *xs: xs[int(torch.randint(len(xs), (1,), generator=rng))]  # noqa: E731
    return dict(width=pick(8, 12, 24), hidden=pick(16, 24, 40), layers=pick(2, 4, 6), rows=pick(8, 16, 24),
                micro_batches=pick(1, 2, 4))


def coords(rank: int, shape) -> dict[str, int]:
    """Rank ``rank``'s place on the mesh of sizes ``shape`` = (pp, dp, tp): {axis: index}, row-major."""
    _, dp, tp = shape
    return {"pp": rank // (dp * tp), "dp": rank // tp % dp, "tp": rank % tp}


def axis_ranks(rank: int, shape, axis: str) -> list[int]:
    """The ranks of ``rank``'s group along ``axis``: those that differ from it on that axis only."""
    sizes, me = dict(zip(AXES, shape)), coords(rank, shape)
    stride = {"pp": sizes["dp"] * sizes["tp"], "dp": sizes["tp"], "tp": 1}[axis]
    first = rank - me[axis] * stride
    return [first + i * stride for i in range(sizes[axis])]


_GROUPS: dict = {}


def mesh_groups(shape) -> dict:
    """{axis: this rank's process group on it}, from ``init_device_mesh`` (made once per shape per process)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if shape in _GROUPS:
        try:
            dist.get_process_group_ranks(_GROUPS[shape]["tp"])
        except (KeyError, ValueError, RuntimeError):  # made before the pool's process group was started again
            del _GROUPS[shape]
    if shape not in _GROUPS:
        mesh = init_device_mesh(comm.torch_device().type, tuple(shape), mesh_dim_names=AXES)
        _GROUPS[shape] = {a: mesh.get_group(a) for a in AXES}
    assert dist.get_world_size() == math.prod(shape)
    return _GROUPS[shape]


# -- the model and its data --------------------------------------------------------------------------------
def model(width: int, hidden: int, layers: int, seed: int = 0) -> list[list[torch.Tensor]]:
    """``layers`` blocks x + W2 gelu(W1 x + b1) + b2, each [w1 (hidden, width), b1, w2 (width, hidden), b2]. W2
    is scaled by 1/sqrt(layers), so the residual stack starts near the identity at every depth: SGD at ``LR``
    then converges for every seed's size (unscaled, 4 seeds in 100 diverged within 6 steps, and a check's
    6-step losses, compared within 1e-4, then told valid orders of summation apart)."""
    g = generator(100 + seed)
    out = []
    for _ in range(layers):
        out.append([torch.randn(hidden, width, generator=g) / width ** 0.5, torch.randn(hidden, generator=g) * 0.1,
                    torch.randn(width, hidden, generator=g) / (hidden * layers) ** 0.5,
                    torch.randn(width, generator=g) * 0.1])
    return out


def batch(rows: int, width: int, step: int = 0, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch (rows, width) and its targets: the same on every rank."""
    g = generator(1000 * seed + step)
    return torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)


def block(h, w1, b1, w2, b2):
    return h + F.linear(F.gelu(F.linear(h, w1, b1)), w2, b2)


def reference(size: dict, seed: int = 0, steps: int = 1, lr: float = LR) -> dict:
    """One process, the whole batch: each step's loss (mean squared error), the first step's gradients
    (per block, [w1, b1, w2, b2]), SGD with ``lr`` between steps."""
    blocks = [[t.clone().requires_grad_() for t in b] for b in model(size["width"], size["hidden"], size["layers"], seed)]
    losses, grads = [], None
    for step in range(steps):
        x, y = batch(size["rows"], size["width"], step, seed)
        h = x
        for b in blocks:
            h = block(h, *b)
        loss = F.mse_loss(h, y)
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            if grads is None:
                grads = [[t.grad.clone() for t in b] for b in blocks]
            for t in (t for b in blocks for t in b):
                t -= lr * t.grad
                t.grad = None
    return {"losses": losses, "grads": grads}


def shard(blocks, rank: int, shape) -> list[list[torch.Tensor]]:
    """Rank ``rank``'s part of ``blocks``: its stage's blocks (the layers cut into pp equal stages), each
    block's w1 and b1 by rows and w2 by columns over the tensor-parallel ranks (b2 whole on each)."""
    pp, _, tp = shape
    me, per = coords(rank, shape), len(blocks) // pp
    t = me["tp"]
    return [[w1.chunk(tp, 0)[t], b1.chunk(tp, 0)[t], w2.chunk(tp, 1)[t], b2]
            for w1, b1, w2, b2 in blocks[me["pp"] * per:(me["pp"] + 1) * per]]


# -- lablib's part on one rank -----------------------------------------------------------------------------
def default_harness() -> tuple:
    """(lab 04's tp_mlp, lab 05's execute, lab 05's one_f_one_b): lablib's answers, what a kit runs."""
    from ..answers import lab04, lab05
    return lab04.tp_mlp, lab05.execute, lab05.one_f_one_b


_KEPT: dict[int, dict] = {}  # id(kit) -> {"bytes": kept by each micro-batch's forward, "peak": most held at once}


class Kit:
    """What lablib gives the learner's step on one rank:
    ``blocks``: this rank's stage's blocks, each [w1, b1, w2, b2], its tensor-parallel shards (leaves whose
      ``.grad`` the backward fills);
    ``tp_mlp(h, w1, b1, w2, b2, group)``: lab 04's MLP split over ``group`` (fc1 by columns, fc2 by rows, f and g),
      refusing a group that reaches into another pipeline stage (whose ranks are not running this block: a hang);
    ``pipeline(forward, batches, loss, group)``: lab 05's executor, 1F1B over ``group``; see its docstring;
    ``params()``: every tensor of ``blocks``.
    What its stages keep for their backwards is lablib's evidence, in ``_KEPT``: never on the kit, which is handed."""

    def __init__(self, blocks, pp_ranks: list[int], stage_ranks: list[int], checkpointed=None, harness=None):
        self.blocks, self._stage = blocks, stage_ranks
        self._pp, self._checkpointed = pp_ranks, checkpointed
        self._tp_mlp, self._execute, self._one_f_one_b = harness or default_harness()
        _KEPT[id(self)] = {"bytes": [], "peak": 0}

    def params(self) -> list[torch.Tensor]:
        return [t for b in self.blocks for t in b]

    def tp_mlp(self, h, w1, b1, w2, b2, group=None):
        import torch.distributed as dist

        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        if not set(ranks) <= set(self._stage):
            raise ValueError(f"kit.tp_mlp got the group of ranks {ranks}, which reaches into another pipeline stage "
                             f"(this stage's ranks are {self._stage}): those ranks are not running this block, so "
                             "its all-reduce would wait for them forever. A block's shards are on its tensor-parallel "
                             "ranks: pass groups['tp']")
        return self._tp_mlp(h, w1, b1, w2, b2, group)

    def pipeline(self, forward, batches, loss, group) -> torch.Tensor:
        """Run ``batches`` [(x, y), one per micro-batch] through the stages of the pipeline group ``group``,
        1F1B: ``forward(h)`` this stage's blocks on its input, ``loss(out, y)`` a micro-batch's loss on the
        last stage. The gradients accumulate in ``.grad`` of the blocks. Returns the sum of the micro-batches'
        losses, on every rank of the group (the last stage sends it back)."""
        import torch.distributed as dist

        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        if ranks != self._pp:
            raise ValueError(f"kit.pipeline got the group of ranks {ranks}; this rank's pipeline stages are on "
                             f"ranks {self._pp}, its group on the pp axis: pass groups['pp']")
        n, s = len(ranks), ranks.index(dist.get_rank())
        if self._checkpointed is not None:
            forward = self._checkpointed(forward)
        stage = _Stage(s, n, forward, loss, list(batches), self)
        p2p.prepare(group)  # under NCCL the group's first batch_isend_irecv needs all of it: made here
        self._execute({s: stage}, self._one_f_one_b(n, len(stage.batches))[s], group)
        total = sum(stage.losses.values()) if stage.last else torch.zeros((), device=batches[0][0].device)
        total = total.detach().reshape(1).clone()
        comm.broadcast(total, ranks[-1], group=group, name="loss to every stage")
        return total[0]


class _Stage:
    """One pipeline stage for lab 05's executor, running the learner's forward and loss, counting the bytes
    autograd keeps between a micro-batch's forward and its backward (``tensor_parallel.saved_bytes``'s way)."""

    def __init__(self, index, stages, forward, loss, batches, kit):
        self.index, self.first, self.last = index, index == 0, index == stages - 1
        self.fn, self.loss, self.batches, self.kit = forward, loss, batches, kit
        self.held, self.losses, self.live = {}, {}, 0

    def buffer(self):
        return torch.empty_like(self.batches[0][0])

    def forward(self, mb, x=None):
        x = (self.batches[mb][0] if self.first else x).detach().requires_grad_()
        weights = {t.untyped_storage().data_ptr() for t in self.kit.params()}
        seen = {(x.untyped_storage().data_ptr(), x.storage_offset()): x.nbytes}

        def pack(t):
            if t.untyped_storage().data_ptr() not in weights:
                seen[(t.untyped_storage().data_ptr(), t.storage_offset())] = t.nbytes
            return t

        with span(f"F{mb}", "compute", op="forward", mb=mb, stage=self.index), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = self.fn(x)
            if self.last:
                out = self.loss(out, self.batches[mb][1])
                self.losses[mb] = out.detach()
        kept = sum(seen.values())
        self.held[mb] = (x, out, kept)
        record = _KEPT[id(self.kit)]
        record["bytes"].append(kept)
        self.live += kept
        record["peak"] = max(record["peak"], self.live)
        return None if self.last else out.detach()

    def backward(self, mb, grad=None, weights=True):
        x, out, kept = self.held.pop(mb)
        with span(f"B{mb}", "compute", op="backward", mb=mb, stage=self.index):
            torch.autograd.backward(out, None if self.last else grad)
        self.live -= kept
        return None if self.first else x.grad.detach()


# -- the learner's step on the ranks -----------------------------------------------------------------------
def rank_data(shape, rank: int, seed=0, steps: int = 1, size: dict | None = None) -> tuple:
    """(the model's sizes, rank ``rank``'s shards of its blocks, flat, the global batches of ``steps`` steps): what
    a rank of the mesh ``shape`` works on, which a check hands each rank (a PerRank) instead of the seed."""
    s = size or size_for(seed)
    mine = [t for b in shard(model(s["width"], s["hidden"], s["layers"], seed), rank, shape) for t in b]
    return s, mine, [batch(s["rows"], s["width"], step, seed) for step in range(steps)]


def step_job(train_step, shape, seed=0, steps: int = 1, checkpointed=None, size: dict | None = None,
             link=None, harness=None, data=None) -> dict:
    """On each rank of a mesh of sizes ``shape``: ``steps`` steps of ``train_step(kit, x, y, groups,
    micro_batches)`` on the global batches (``data``: this rank's ``rank_data``, else drawn from ``seed``), SGD
    between them, the last on the timeline; ``link``: collectives over a simulated link; ``harness``: what the kit
    runs of labs 04 and 05 (``default_harness()``). Returns each step's loss as the step returned it, the first
    step's gradients of this rank's shards, the collectives it issued ("op bytes on ranks"), the bytes each
    micro-batch's forward kept and the most held at once, the bytes of weights and gradients the rank held after
    the first step, and each step's seconds on the timeline's clock (over ``link``, each collective lasting what
    the link's model says, Gloo's own time left out, as the timeline draws it)."""
    import torch.distributed as dist

    from ..comm import to_device, watched
    from ..memory import storage_bytes
    from .prefetch import start_recording

    rank, (s, mine, batches) = dist.get_rank(), data or rank_data(shape, dist.get_rank(), seed, steps, size)
    groups = mesh_groups(tuple(shape))
    flat = to_device(*mine)
    blocks = [[t.clone().requires_grad_() for t in flat[i:i + 4]] for i in range(0, len(flat), 4)]
    stage = [r for r in range(math.prod(shape)) if coords(r, shape)["pp"] == coords(rank, shape)["pp"]]
    kit = Kit(blocks, axis_ranks(rank, shape, "pp"), stage, checkpointed, harness)
    losses, grads, ops, seconds, states = [], None, None, [], 0
    for step in range(steps):
        x, y = to_device(*batches[step])
        start_recording() if step == steps - 1 else dist.barrier()  # the timeline holds the last step
        with comm.simulated(link):
            t0 = _now()  # the timeline's clock: over a simulated link, the link's time in place of Gloo's own
            loss, done = watched(train_step, kit, x, y, dict(groups), s["micro_batches"], groups=True)
            comm.synchronize()
            seconds.append((_now() - t0) / 1e9)
        losses.append(loss.detach().item() if isinstance(loss, torch.Tensor) and loss.numel() == 1 else loss)
        if grads is None:
            grads, ops = [[None if t.grad is None else t.grad.detach().clone() for t in b] for b in kit.blocks], done
            states = sum(storage_bytes([("params", t) for t in kit.params()] +
                                       [("grads", t.grad) for t in kit.params()]).values())
        with torch.no_grad():
            for t in kit.params():
                if t.grad is not None:
                    t -= LR * t.grad
                t.grad = None
    kept = _KEPT.pop(id(kit))
    return {"losses": losses, "grads": grads, "ops": ops, "kept": kept["bytes"][:s["micro_batches"]],
            "peak": kept["peak"], "states": states, "seconds": seconds}


# -- the planner's model of these meshes -------------------------------------------------------------------
def modelled_memory(shape, size: dict) -> dict[str, int]:
    """Task 8.4's terms for this model on a mesh's first stage, in fp32 with SGD: states 4 + 4 bytes a parameter
    of the stage's shard (weights, gradients); activations min(pp, m) micro-batches × the stage's blocks × what a
    block keeps a micro-batch: its input (rows × width) and its hidden before and after GELU, split over tp
    (2 × rows × hidden / tp), 4 bytes each. A first stage that is also the last keeps the loss's output and
    targets too, uncounted: 5% more on DP×TP."""
    pp, dp, tp = shape
    m = size["micro_batches"]
    psi = sum(t.numel() for b in shard(model(size["width"], size["hidden"], size["layers"]), 0, shape) for t in b)
    per_block = size["rows"] // dp // m * (size["width"] + 2 * size["hidden"] // tp) * 4
    return {"states": 8 * psi, "activations": min(pp, m) * (size["layers"] // pp) * per_block}


TOY_LINK = comm.Link("a slow simulated link", 4e-3, 20e6, "stated: slow enough that the toy meshes' communication "
                     "outweighs this machine's noise and Gloo's own cost per call")


def single_seconds(size: dict, repeats: int = 3) -> float:
    """One process's forward and backward of the whole model on the whole batch: the median of ``repeats``."""
    import statistics
    import time

    blocks = [[t.requires_grad_() for t in b] for b in model(size["width"], size["hidden"], size["layers"])]
    x, y = batch(size["rows"], size["width"])
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        h = x
        for b in blocks:
            h = block(h, *b)
        F.mse_loss(h, y).backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def modelled(shape, size: dict, compute: float, link) -> dict[str, float]:
    """The planner's step time (``planner.combine``) for a mesh of sizes ``shape`` over ``link``: ``compute``
    (one process's seconds on the whole batch) shared out over the ranks; each block's two all-reduces a
    micro-batch (forward and backward) over tp; a send each way a micro-batch between stages; each gradient
    tensor's all-reduce over dp, after the pipeline (not overlapped)."""
    from .planner import combine

    pp, dp, tp = shape
    m, blocks = size["micro_batches"], size["layers"] // pp
    act = size["rows"] // dp // m * size["width"] * 4
    comm_ = {"tp": blocks * 2 * link.seconds("all_reduce", act, tp) if tp > 1 else 0.0,
             "pp": 2 * link.seconds("send", act, 2) if pp > 1 else 0.0}
    tensors = [t for b in shard(model(size["width"], size["hidden"], size["layers"]), 0, shape) for t in b]
    dp_comm = sum(link.seconds("all_reduce", t.numel() * 4, dp) for t in tensors) if dp > 1 else 0.0
    return combine(m, pp, compute / (dp * m * tp * pp), comm_, dp_comm, hidden=0.0)


def ranking(measured: dict[str, list[float]], planned: dict[str, float]) -> tuple[bool | None, str]:
    """The planner's order of the meshes (``planned``: {mesh: modelled seconds}) against the measured one
    (``measured``: {mesh: each timed step's seconds}), by median. Two meshes next in the measured order are told
    apart when the slower one's fastest step is slower than the faster one's slowest. (True, text) when the
    orders agree and every neighbour is told apart; (False, text) when they differ; (None, text) when a gap is
    within the noise, so there is no order to check."""
    import statistics

    order = sorted(measured, key=lambda k: statistics.median(measured[k]))
    theirs = sorted(planned, key=planned.get)
    shown = lambda names: " < ".join(names)  # noqa: E731
    close = [(a, b) for a, b in zip(order, order[1:]) if min(measured[b]) <= max(measured[a])]
    if close:
        return None, (f"{' and '.join(f'{a} and {b}' for a, b in close)} are within the noise of each other (their "
                      "steps' times overlap): no order to check; run it again on a quieter machine")
    if order != theirs:
        return False, f"the planner orders them {shown(theirs)}, the ranks measured {shown(order)}"
    return True, f"the planner orders them as the ranks measured: {shown(order)}"


def recompute_rounds(cluster, train_step, checkpointed, rounds: int | None = None) -> dict:
    """The TP×PP step on ``BIG`` with its activations kept and recomputed, one after the other, ``rounds`` times (3;
    1 under LABLIB_QUICK) of 4 timed steps: {"kept" | "recomputed": {"runs": the first round's results, "steps":
    each round's median step, slowest rank}}. Alternating them spreads a busy moment of the machine over both."""
    from ..paths import quick
    from .prefetch import step_seconds

    out = {"kept": {"runs": None, "steps": []}, "recomputed": {"runs": None, "steps": []}}
    for _ in range(rounds or (1 if quick() else 3)):
        for label, wrap in (("kept", None), ("recomputed", checkpointed)):
            results = cluster.run(step_job, train_step, MESHES["TP×PP"], 0, 4, wrap, BIG)
            out[label]["runs"] = out[label]["runs"] or results
            out[label]["steps"].append(step_seconds(results))
    return out


def measure_meshes(cluster, train_step, steps: int | None = None) -> tuple[dict, dict, float]:
    """``train_step`` on each 2×2 mesh over ``TOY_LINK`` on the model ``RANKED``, the last mesh's last step left
    on the cluster's timeline: ({mesh: each timed step's seconds in order, the slowest rank's on the timeline's
    clock, after a warm-up},
    {mesh: the planner's modelled seconds}, one process's measured seconds that the model shares out)."""
    from ..paths import quick

    steps = steps or (2 if quick() else 3)
    compute = single_seconds(RANKED)
    measured, planned = {}, {}
    for name, shape in MESHES.items():
        results = cluster.run(step_job, train_step, shape, 0, steps + 1, None, RANKED, TOY_LINK)
        measured[name] = [max(r["seconds"][k] for r in results) for k in range(1, steps + 1)]
        planned[name] = modelled(shape, RANKED, compute, TOY_LINK)["total"]
    return measured, planned, compute
