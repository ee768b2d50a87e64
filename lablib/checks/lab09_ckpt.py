"""Lab 09's Task 9.4: a sharded checkpoint, saved by each rank and loaded at other world sizes.

The ranks of the check's pool save; then each loads for one or more ranks of another world size (rank r of
the pool plays ranks r, r + n, ... of the new one): a load needs no message, only the rank and world size it
loads for, which ``load_shard`` is given. Judged from what each wrote (its own values, no padding, no message)
and read (only the ranges that overlap the new shard), and the loaded shards against a fresh sharding."""
from __future__ import annotations

import shutil
import tempfile

import torch

from ..pool import PerRank
from ..strategies.checkpoint import Folder
from ..toy import generator
from . import Check, CheckFailed, max_error, run_on_ranks

FORBIDDEN = {
    "dist.*": "exercises move data with lablib's traced collectives only (lablib.all_reduce, lablib.all_gather, "
              "...); of torch.distributed they may ask get_rank and get_world_size, and use ReduceOp",
}
HINTS = (("checkpoint key", "name each file from the tensor's name and where its values start, "
          "f\"{name}.{start}\"."),
         ("metadata values", "metadata are ints or strings."),
         ("holds values", "a file holds only what its writer wrote: read within each file's count."),)


def tensors(seed) -> dict:
    """The training state a check saves: {name: the whole flat fp32 tensor}, of lengths that leave padding at
    most world sizes, and one shorter than the ranks."""
    g = generator(41 + (seed or 0))
    lengths = {"unit0.params": 130 + (seed or 0) % 7, "unit0.momentum": 130 + (seed or 0) % 7, "unit1.params": 45,
               "bias": 2}
    return {name: torch.randn(m, generator=g) for name, m in lengths.items()}


def shard(full: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """Rank ``rank``'s shard at world size ``n``: ceil(numel / n) values, zeros past the end."""
    size = -(-full.numel() // n)
    out = torch.zeros(size)
    part = full[rank * size:(rank + 1) * size]
    out[:part.numel()] = part
    return out


def _targets(n: int) -> tuple:
    return {4: (2, 3), 2: (3, 4), 3: (2, 4)}.get(n, (2, 3))


def ckpt_job(save_shard, load_shard, path, share, targets) -> dict:
    """On the ranks: save this rank's shards, wait for every rank, load for the ranks of each target world
    size this rank plays."""
    import torch.distributed as dist

    from ..comm import barrier, to_device, watched
    from ..timeline import span

    r, n = dist.get_rank(), dist.get_world_size()
    folder = Folder(path)
    ops = []
    for name, (values, start, numel) in share.items():
        with span(f"save {name}", op="checkpoint"):
            _, sent = watched(save_shard, folder, name, to_device(values), start, numel)
        ops += sent
    written = folder.written
    barrier(name="every rank saved")
    loads = {}
    for m in targets:
        for q in range(r, -(-m // n) * n, n):  # as many loads on every rank: a collective in one cannot hang
            got, reads = {}, Folder(path)
            with span(f"load for rank {q % m} of {m}", op="checkpoint"):
                _, sent = watched(lambda: got.update({name: load_shard(reads, name, q % m, m) for name in share}))
            ops += sent
            if q < m:
                loads[f"{q}/{m}"] = {"got": {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in got.items()},
                                     "read": reads.read_bytes}
    return {"written": written, "ops": ops, "loads": loads}


def collect_checkpoint(fns, pool, seed):
    n = pool.world_size
    state = tensors(seed)
    share = PerRank([{name: (shard(full, r, n), r * -(-full.numel() // n), full.numel()) for name, full in state.items()}
                     for r in range(n)])
    paths = pool.run(_folder)  # rank 0's is the checkpoint's: under torchrun every rank must see it (TMPDIR)
    try:
        return run_on_ranks(pool, "Task 9.4", ckpt_job, *fns, paths[0], share, _targets(n), hints=HINTS)
    finally:
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)


def _folder() -> str:
    return tempfile.mkdtemp(prefix="lablib-ckpt-")


def judge_checkpoint(data, world_size, seed) -> str:
    task, n, state = "Task 9.4", world_size, tensors(seed)
    for r, res in enumerate(data):
        if res["ops"]:
            raise CheckFailed(f"{task}: rank {r} sent {res['ops']} while saving or loading: each rank writes its own "
                              "shard and reads its new one from the files; nothing is gathered.")
        own = sum(max(0, min(-(-f.numel() // n), f.numel() - r * -(-f.numel() // n))) * 4 for f in state.values())
        if res["written"] != own:
            raise CheckFailed(f"{task}: rank {r} wrote {res['written']} bytes; its own values are {own} bytes"
                              + (": leave the padding past numel out (it depends on the world size that saved)."
                                 if res["written"] > own else ": write every value of its shard that lies before "
                                 "numel.") )
    for m in _targets(n):
        for q in range(m):
            got = data[q % n]["loads"][f"{q}/{m}"]
            for name, full in state.items():
                want = shard(full, q, m)
                value = got["got"].get(name)
                if max_error(value, want, f"{task}: {name} loaded for rank {q} of {m}") > 0:
                    raise CheckFailed(f"{task}: {name} loaded for rank {q} of {m} is not that rank's shard at world size "
                                      f"{m}: values {q * want.numel()} .. {(q + 1) * want.numel() - 1} of the saved "
                                      "tensor, zeros past its end. Take them from every file that overlaps that range.")
            need = sum(max(0, min((q + 1) * -(-f.numel() // m), f.numel()) - q * -(-f.numel() // m)) * 4
                       for f in state.values())
            if got["read"] != need:
                raise CheckFailed(f"{task}: loading for rank {q} of {m} read {got['read']} bytes; its shards need "
                                  f"{need}: read only the range of each file that overlaps the new shard "
                                  "(folder.read(key, start, count)), and no file that does not.")
    return f": saved on {n} ranks (no message, no padding), loaded at {' and '.join(map(str, _targets(n)))} ranks " \
           "reading only what overlaps"


check_checkpoint = Check("Task 9.4", ("save_shard", "load_shard"), collect_checkpoint, judge_checkpoint,
                         world_sizes=(4,), forbidden=FORBIDDEN)
"""Task 9.4: a sharded checkpoint loaded at another world size."""
