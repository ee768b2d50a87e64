"""Where each rank computes and how ranks talk, decided in one place.

- A GPU per rank: each rank computes on its own GPU, and collectives run on NCCL.
- Fewer GPUs than ranks: the ranks share the GPUs for compute (rank r on GPU r % gpus); NCCL refuses
  two ranks of one communicator on one GPU, so lablib's collectives go over Gloo, through host memory.
- No GPU (or ``device="cpu"``): every rank on the CPU, Gloo.
"""
from __future__ import annotations

BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(device: str, backend: str = "auto") -> str:
    """'auto' -> 'cuda' when this machine has a GPU, else 'cpu'. Raises ValueError on bad input."""
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}: use 'auto' (the GPUs where there are any, else the CPU), "
                         "'cpu' or 'cuda'")
    gpus = _gpu_count()
    if device == "cuda" and not gpus:
        raise ValueError("device='cuda' but this machine has no GPU that torch can use "
                         "(torch.cuda.is_available() is False): use device='cpu'")
    if device == "cpu" and backend == "nccl":
        raise ValueError("backend='nccl' runs on GPUs: with device='cpu', use backend='gloo' (or 'auto')")
    if device == "auto":
        return "cuda" if gpus else "cpu"
    return device


def resolve_backend(backend: str, world_size: int, device: str = "auto") -> str:
    """'auto' -> 'nccl' when the ranks compute on GPUs and there is one per rank, else 'gloo'. Raises
    ValueError on bad input."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use 'auto' (NCCL with one GPU per rank, else Gloo), "
                         f"'gloo' (CPU) or 'nccl' (GPUs)")
    gpus = _gpu_count()
    device = resolve_device(device, backend)
    if backend == "auto":
        return "nccl" if device == "cuda" and gpus >= world_size else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size} but this machine has "
                         f"{gpus} GPU(s). Use backend='gloo' (the ranks then share the GPUs for compute) or at "
                         f"most {gpus} ranks.")
    return backend


def torch_on_cpu(backend: str, device: str) -> bool:
    """Whether PyTorch's own parallel APIs (FSDP2, DTensor) compute on the CPU while the ranks compute on GPUs: ranks
    sharing GPUs talk over Gloo, which takes no CUDA tensors for all of their collectives (``comm.torch_device``)."""
    return device == "cuda" and backend == "gloo"


def gpu_of(rank: int) -> int:
    """The GPU rank ``rank`` computes on (its own under NCCL; shared round-robin otherwise)."""
    return rank % max(_gpu_count(), 1)


def describe_backend(backend, world_size, threads, device: str = "cpu"):
    """The pool's first line: where the ranks compute and how their collectives travel."""
    if backend == "nccl":
        return f"NCCL on {world_size} GPU(s), one per rank"
    gpus = _gpu_count()
    if device == "cuda":
        return (f"{world_size} ranks share {gpus} GPU(s) for compute (rank r on GPU r % {gpus}: ranks on one "
                f"GPU take turns on it); collectives over Gloo through host memory (NCCL needs a GPU per rank)")
    why = ("no GPU found" if gpus == 0 else "device='cpu'")
    return f"Gloo on CPU ({why}), {threads} torch thread(s) per rank"
