"""Which backend a pool uses: NCCL with one GPU per rank, Gloo on the CPU otherwise."""
from __future__ import annotations

BACKENDS = ("auto", "gloo", "nccl")


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_backend(backend: str, world_size: int) -> str:
    """'auto' -> 'nccl' when there is one GPU per rank, else 'gloo'. Raises ValueError on bad input."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use 'auto' (NCCL with one GPU per rank, else Gloo), "
                         f"'gloo' (CPU) or 'nccl' (GPUs)")
    gpus = _gpu_count()
    if backend == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size} but this machine has "
                         f"{gpus} GPU(s). Use backend='gloo' (CPU) or at most {gpus} ranks.")
    return backend


def describe_backend(backend, world_size, threads):
    if backend == "nccl":
        return f"NCCL on {world_size} GPU(s), one per rank"
    gpus = _gpu_count()
    why = "no GPU found" if gpus == 0 else f"{gpus} GPU(s) for {world_size} ranks: NCCL needs one per rank"
    return f"Gloo on CPU ({why}), {threads} torch thread(s) per rank"
