"""Bytes per rank: counted from the tensors a rank holds, the ZeRO paper's formulas beside them, and
the per-parameter coefficients fitted from measurements (views/memory.py extrapolates with them)."""
from __future__ import annotations

import torch

KINDS = ("params", "grads", "optimizer")
STAGE_NAMES = {"dp": "replicated DP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3 / FSDP"}


def storage_bytes(tensors) -> dict[str, int]:
    """Bytes by kind of ``(kind, tensor)`` pairs, each storage counted once (for the first kind that
    names it): a view (a module parameter inside a flat buffer) costs nothing extra, a freed buffer 0.
    Non-tensors are skipped; a DTensor counts its local shard."""
    seen, out = set(), dict.fromkeys(KINDS, 0)
    for kind, t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        storage = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            out[kind] += storage.nbytes()
    return out


def held_bytes(units) -> dict[str, int]:
    """Bytes of the tensors a rank holds between steps in our strategies, by kind."""
    def tensors():
        for u in units:
            yield from (("params", u.flat), ("params", u.shard))
            for p in u.module.parameters():
                yield from (("params", p), ("grads", p.grad))
            yield from (("grads", u.grad), ("optimizer", u.master))
            yield from (("optimizer", t) for t in u.state.values())

    return storage_bytes(tensors())


def zero_formula(stage: str, psi: float, n: int, mixed: bool = True, state_bytes: int = 8) -> dict[str, float]:
    """The ZeRO paper's bytes per rank, by kind, for ``psi`` parameters on ``n`` ranks.

    Adam in mixed precision: 2 + 2 + 12 bytes per parameter (fp16/bf16 parameters and gradients; fp32
    master copy, momentum and variance): 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N. In fp32: 4 + 4 + 8.
    ``state_bytes``: the optimizer's fp32 state per parameter (Adam 8, SGD with momentum 4)."""
    p, g, o = (2, 2, state_bytes + 4) if mixed else (4, 4, state_bytes)
    split = {"dp": (1, 1, 1), "zero1": (1, 1, n), "zero2": (1, n, n), "zero3": (n, n, n)}[stage]
    return {"params": p * psi / split[0], "grads": g * psi / split[1], "optimizer": o * psi / split[2]}


def fit_per_parameter(measured: dict) -> dict[str, tuple[float, float]]:
    """From ``{(stage, n): (bytes, psi)}`` at two or more world sizes, fit bytes/Ψ = a + b/N per stage.

    ``a`` is what every rank keeps whole, ``b`` what is split; the calculator extrapolates with them."""
    out = {}
    for stage in sorted({s for s, _ in measured}, key=lambda s: list(STAGE_NAMES).index(s)):
        pts = [(n, b / psi) for (s, n), (b, psi) in measured.items() if s == stage]
        if len(pts) < 2:
            raise ValueError(f"{stage}: measure at least two world sizes to separate a from b/N")
        # least squares on y = a + b * (1/N)
        xs = [1 / n for n, _ in pts]
        ys = [y for _, y in pts]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        out[stage] = (my - b * mx, b)
    return out
