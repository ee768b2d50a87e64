"""Task 8.3's first look at the learner's recomputation, in this process before any rank runs it: one block through
``checkpointed``, forward and backward, against plain autograd. The two commonest mistakes get their own names
here (a backward that hands back the incoming gradient, skipping the recomputed forward's backward; a
recomputation run where grad mode is off), instead of what they break later on the ranks (a gradient None in
Task 8.2's step, a raw autograd error)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..toy import generator
from . import CheckFailed, not_done

TOL = 1e-5


def _block(seed: int):
    g = generator(11 + seed)
    w1, w2 = torch.randn(8, 4, generator=g) / 2, torch.randn(4, 8, generator=g) / 3
    return w1, w2, torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)


def probe(task: str, checkpointed, seed) -> dict:
    """``checkpointed(forward)`` on a block ``h + W2 gelu(W1 h)``, its output's backward given the incoming
    gradient: plain data, {"error": text} or the gradients of the weights and the input (None where none came)
    beside plain autograd's and the incoming gradient."""
    w1, w2, x, up = _block(seed or 0)
    want = [t.clone().requires_grad_() for t in (w1, w2, x)]
    torch.autograd.backward(want[2] + F.linear(F.gelu(F.linear(want[2], want[0])), want[1]), up)
    mine = [t.clone().requires_grad_() for t in (w1, w2, x)]

    def forward(h):
        return h + F.linear(F.gelu(F.linear(h, mine[0])), mine[1])

    try:
        out = checkpointed(forward)(mine[2])
        torch.autograd.backward(out, up)
    except NotImplementedError as exc:
        raise not_done(task, f"your code ({exc})") from None
    except Exception as exc:  # noqa: BLE001 (what the learner's code raised is the data)
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": None, "got": [None if t.grad is None else t.grad.detach() for t in mine],
            "want": [t.grad.detach() for t in want], "up": up}


def judge_probe(task: str, data: dict) -> None:
    """CheckFailed naming the mistake ``probe``'s data shows, if any."""
    how = ("in backward, run ctx's forward again on the saved input (detached, requires_grad_()) under "
           "torch.enable_grad(), call torch.autograd.backward(its output, grad), which fills the weights' .grad, "
           "and return None, the input's .grad")
    if data["error"]:
        if "does not require grad" in data["error"]:
            raise CheckFailed(f"{task}: your recomputation's backward raised {data['error']!r}. The recomputation runs "
                              "inside backward, where grad mode is off, so the forward it runs again records nothing "
                              "to backpropagate through: wrap it in torch.enable_grad().")
        raise CheckFailed(f"{task}: checkpointed(forward) on one block in this process, forward and backward, raised "
                          f"{data['error']}. Recomputation: {how}.")
    (w1, w2, x), (v1, v2, vx), up = data["got"], data["want"], data["up"]
    if w1 is None or w2 is None:
        if x is not None and x.shape == up.shape and torch.allclose(x, up, atol=TOL):
            raise CheckFailed(f"{task}: your backward returned the incoming gradient unchanged: it skipped the "
                              "recomputed forward's backward, so the block's weights got no gradient and its input "
                              f"the gradient of an identity. {how[0].upper() + how[1:]}.")
        raise CheckFailed(f"{task}: with your checkpointed forward the block's weights got no gradient: {how}.")
    for name, got, want in (("weights", w1, v1), ("weights", w2, v2), ("input", x, vx)):
        if got is None or got.shape != want.shape or not torch.allclose(got, want, atol=TOL):
            raise CheckFailed(f"{task}: with your checkpointed forward the block's {name} get another gradient than "
                              f"plain autograd's: {how}.")
