"""A sharded checkpoint: each rank writes its own shards of the parameters and the optimizer state, with the
metadata that places them (which tensor, its length, where the shard starts), and no rank gathers the
model; a run at another world size reads, on each rank, only the byte ranges that overlap its new shard
(``torch.distributed.checkpoint``, DCP, does this for DTensor and ShardedTensor state: each rank writes
its shards into its own file, one metadata file places them, and a load reshards to the loader's layout).

Exercise code opens no files, so a ``Folder`` writes and reads for it and counts what it wrote and read.
``save``/``load``/``train`` run a training state through a learner's ``save_shard`` and ``load_shard``;
``dcp_job`` and ``gather_job`` save the same state with DCP and by gathering it to rank 0, to compare.
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import torch

from .. import comm
from ..timeline import span

_KEY = re.compile(r"[A-Za-z0-9_.=-]{1,120}")
_DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32)}


class Folder:
    """A checkpoint folder that exercise code writes and reads through: ``write(key, tensor, **meta)``,
    ``entries()`` (every file's metadata), ``read(key, start, count)`` (``count`` values from value
    ``start``, read from the file's bytes and nothing more). Counts the bytes each rank wrote and read."""

    def __init__(self, path):
        self._path = Path(path)
        self._path.mkdir(parents=True, exist_ok=True)
        self._written = self._read = 0

    @property
    def written(self) -> int:
        """Bytes of values this folder object wrote (read-only: the checks count with it)."""
        return self._written

    @property
    def read_bytes(self) -> int:
        """Bytes of values this folder object read."""
        return self._read

    def write(self, key: str, tensor: torch.Tensor, **meta) -> None:
        """Write ``tensor`` (flat, its values as they are in memory) as file ``key``, with ``meta`` (ints and
        strings) beside it. A key is letters, digits and ``_ . = -``; writing a key twice replaces it."""
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise ValueError(f"checkpoint key {key!r}: use letters, digits and _ . = - only (up to 120), e.g. "
                             "f\"{name}.{start}\"")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"write({key!r}, ...) takes a tensor, got {type(tensor).__name__}")
        taken = sorted({"key", "dtype", "count"} & set(meta))
        if taken:
            raise ValueError(f"write({key!r}, ...): {', '.join(taken)} is the folder's own metadata (entries() gives "
                             "it); name yours otherwise")
        bad = [k for k, v in meta.items() if not isinstance(v, (int, str)) or isinstance(v, bool)]
        if bad:
            raise TypeError(f"write({key!r}, ...): metadata values are ints or strings; {', '.join(bad)} "
                            "is not (use int(...) on a number from a tensor)")
        data = tensor.detach().contiguous().cpu()
        (self._path / f"{key}.bin").write_bytes(data.view(-1).view(torch.uint8).numpy().tobytes())
        (self._path / f"{key}.json").write_text(json.dumps(
            {"key": key, "dtype": str(data.dtype), "count": data.numel(), **meta}))
        self._written += data.nbytes

    def entries(self) -> list[dict]:
        """Every file's metadata: ``key``, ``dtype``, ``count`` (values in it) and what its writer added."""
        return sorted((json.loads(p.read_text()) for p in self._path.glob("*.json")), key=lambda e: e["key"])

    def read(self, key: str, start: int, count: int) -> torch.Tensor:
        """Values ``start`` .. ``start + count - 1`` of file ``key`` (only those bytes are read), on this rank's
        device (``lablib.device()``)."""
        meta = next((e for e in self.entries() if e["key"] == key), None)
        if meta is None:
            raise KeyError(f"no file {key!r} in the checkpoint; entries() lists its files")
        start, count = int(start), int(count)
        if start < 0 or count < 0 or start + count > meta["count"]:
            raise ValueError(f"read({key!r}, {start}, {count}): file {key!r} holds values 0 .. {meta['count'] - 1}")
        dtype = _DTYPES[meta["dtype"]]
        size = dtype.itemsize
        with open(self._path / f"{key}.bin", "rb") as f:
            f.seek(start * size)
            raw = f.read(count * size)
        self._read += len(raw)
        return comm.to_device(torch.frombuffer(bytearray(raw), dtype=dtype) if count else torch.empty(0, dtype=dtype))


def state_of(units) -> dict:
    """A rank's training state: {name: (its shard, where the shard starts, the tensor's length)}, for each
    unit's fp32 parameters and its optimizer state."""
    import torch.distributed as dist

    out = {}
    for i, u in enumerate(units):
        start = u.layout.shard_bounds(dist.get_rank())[0]
        out[f"unit{i}.params"] = (u.master, start, u.layout.numel)
        for name, t in u.state.items():
            if isinstance(t, torch.Tensor):
                out[f"unit{i}.{name}"] = (t, start, u.layout.numel)
    return out


def save(save_shard, path, units) -> dict:
    """Each of this rank's shards through ``save_shard(folder, name, shard, start, numel)``."""
    folder = Folder(path)
    t = time.perf_counter()
    with span("save checkpoint", bytes=state_bytes(units), op="checkpoint"):
        _, ops = comm.watched(lambda: [save_shard(folder, name, *item) for name, item in state_of(units).items()])
    return {"written": folder.written, "ops": ops, "seconds": time.perf_counter() - t}


def load(load_shard, path, units) -> dict:
    """This rank's shards of every tensor, at this world size, through ``load_shard(folder, name, rank,
    world_size)``, copied into the units."""
    folder = Folder(path)
    t = time.perf_counter()
    with span("load checkpoint", op="checkpoint"):
        _load_into(load_shard, folder, units)
    return {"read": folder.read_bytes, "seconds": time.perf_counter() - t}


def _load_into(load_shard, folder, units) -> None:
    import torch.distributed as dist

    for name, (target, _, _) in state_of(units).items():
        value = load_shard(folder, name, dist.get_rank(), dist.get_world_size())
        if not isinstance(value, torch.Tensor) or value.numel() != target.numel():
            raise ValueError(f"load_shard(folder, {name!r}, rank, world_size) returned "
                             f"{type(value).__name__}{tuple(value.shape) if isinstance(value, torch.Tensor) else ''}; "
                             f"this rank's shard at this world size is {target.numel()} values (zeros past the end)")
        target.copy_(value.to(target.dtype).view(-1))


def global_batch(step: int, rows: int = 12, seed: int = 0) -> tuple:
    """Step ``step``'s whole batch, the same whatever the world size: each rank takes its equal share."""
    from ..toy import generator

    g = generator(500 + step + 7919 * seed)
    return torch.randn(rows, 13, generator=g), torch.randn(rows, 7, generator=g)


def _units():
    import torch.distributed as dist

    from ..toy import build_model
    from .mixed import SGD, Policy, units_for

    return units_for(comm.to_device(build_model("mlp")), dist.get_rank(), dist.get_world_size(), SGD,
                     Policy(torch.float32, torch.float32))


def _train(units, steps) -> list[float]:
    """lablib's FSDP (fp32) steps on ``units``, each step's global batch split over the ranks; the whole batch's
    mean loss of each."""
    import torch.distributed as dist

    from ..answers.lab09 import mp_reduce, mp_unshard
    from .harness import Context
    from .mixed import SGD, Policy, step

    rank, n = dist.get_rank(), dist.get_world_size()
    policy, ctx, losses = Policy(torch.float32, torch.float32), Context(rank, n, SGD), []
    for k in steps:
        x, y = global_batch(k)
        rows = x.shape[0] // n
        x, y = comm.to_device(x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows])
        loss, _ = step(units, x, y, ctx, policy, mp_unshard, mp_reduce)
        for u in units:
            ctx.update(u, u.grad)
            u.grad = None
        total = loss.detach().reshape(1).clone()
        comm.all_reduce(total, name="loss")
        losses.append(total.item() / n)
    return losses


def train(save_shard=None, load_shard=None, steps=range(3), path=None, resume=False) -> dict:
    """On the ranks: lablib's FSDP (fp32) on the mlp, each step's global batch split over the ranks. ``resume``:
    the state is loaded from ``path`` first (``load_shard``); with ``save_shard`` it is saved there after the
    last step. Returns the losses (the mean over the whole batch), and what the save and load counted."""
    import torch.distributed as dist

    units, out = _units(), {}
    if resume:
        out["load"] = load(load_shard, path, units)
    out["losses"] = _train(units, steps)
    if save_shard is not None:
        dist.barrier()
        out["save"] = save(save_shard, path, units)
    return out


def state_bytes(units) -> int:
    return sum(t.nbytes for t, _, _ in state_of(units).values())


def _dtensors(units, mesh) -> dict:
    """The state as DTensors sharded on dim 0 (the padding left out), as DCP reshards them."""
    from torch.distributed.tensor import DTensor, Shard

    out = {}
    for name, (t, start, numel) in state_of(units).items():
        local = t[:max(0, min(t.numel(), numel - start))]
        out[name] = DTensor.from_local(local, mesh, [Shard(0)], shape=(numel,), stride=(1,), run_check=False)
    return out


def dcp_job(path, save: bool, steps=range(3)) -> dict:
    """On the ranks: lablib's FSDP trained ``steps`` steps, its state saved with DCP (``save``), or loaded with DCP
    at this world size into fresh units. Returns the seconds, the bytes of the files this rank wrote (save) and
    the loaded state, whole (load)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    if save:
        units = _units()
        _train(units, steps)
        state = _dtensors(units, mesh)
        t = time.perf_counter()
        dcp.save(state, checkpoint_id=path)
        seconds = time.perf_counter() - t
        dist.barrier()
        mine = {k: v for k, v in _files(path).items() if k.startswith(f"__{dist.get_rank()}_")
                or (k == ".metadata" and dist.get_rank() == 0)}
        return {"seconds": seconds, "files": mine, "state": state_bytes(units)}
    units = _units()
    state = _dtensors(units, mesh)
    t = time.perf_counter()
    dcp.load(state, checkpoint_id=path)
    seconds = time.perf_counter() - t
    return {"seconds": seconds, "state": {k: v.full_tensor() for k, v in state.items()}}


def _files(path) -> dict:
    return {p.name: p.stat().st_size for p in Path(path).glob("*")} if Path(path).exists() else {}


def gather_job(path, steps=range(3)) -> dict:
    """On the ranks: the same state saved by gathering every tensor whole to rank 0, which writes one file.
    Returns the seconds and the most bytes of state rank 0 held at once (its live tensors, counted)."""
    import torch.distributed as dist

    units = _units()
    _train(units, steps)
    rank, n = dist.get_rank(), dist.get_world_size()
    t = time.perf_counter()
    whole, held = {}, state_bytes(units)
    for name, (shard, _, numel) in state_of(units).items():
        out = torch.empty(shard.numel() * n, device=shard.device)
        comm.all_gather(out, shard.contiguous(), name="gather to rank 0")  # lablib traces no gather: every rank gets it
        if rank == 0:
            held = max(held, state_bytes(units) + sum(v.nbytes for v in whole.values()) + out.nbytes)
            whole[name] = out[:numel].cpu().clone()
        del out
    if rank == 0:
        torch.save(whole, os.path.join(path, "model.pt"))
    dist.barrier()
    return {"seconds": time.perf_counter() - t, "held": held, "own": state_bytes(units),
            "file": os.path.getsize(os.path.join(path, "model.pt")) if rank == 0 else 0}
