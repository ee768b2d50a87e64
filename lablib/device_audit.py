"""The device rule, held on a machine without a GPU: a mode a rank job can run under (``LABLIB_DEVICE_AUDIT=1``
in the pool's environment) that fails where the job computes with a tensor that never went through the
device rule, the bug a GPU would find (``Expected all tensors to be on the same device``).

On the CPU every tensor is on the one device, so the mode tracks where each came from instead:
- a tensor made by a factory with no ``device=`` (``torch.zeros(3)``, ``torch.randn(..., generator=g)``, a
  module's parameters at construction) is *off the rule*, and so is whatever is computed from it;
- ``t.to(device)`` (``lablib.to_device``, ``module.to(device)``), ``t.cpu()``, a factory given ``device=``
  and a ``*_like`` factory of a tensor on the rule put it back on the rule; ``dst.copy_(src)``, which
  copies across devices, leaves ``dst`` where it was.

The mode fails at once when an operation mixes tensors on and off the rule (on a GPU: a CPU tensor meeting
a CUDA one), when a tensor off the rule goes into a lablib collective (on a GPU, a collective of CPU
tensors never touches the GPU), and when the job returns one (``check_result``). Models and data built on
the CPU from a seed and then moved, as the labs build them, pass. Gradients, which autograd makes in
C++, are on the rule.
"""
from __future__ import annotations

import os

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

_MARK = "_lablib_off_device"
_FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.rand, torch.randn, torch.randint,
              torch.randperm, torch.arange, torch.linspace, torch.eye, torch.tensor, torch.as_tensor,
              torch.empty_strided}
_LIKE = {torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like, torch.randn_like,
         torch.randint_like}
_MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu}
_METHOD_FACTORIES = {torch.Tensor.new_empty, torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_full,
                     torch.Tensor.new_tensor}


def enabled() -> bool:
    return os.environ.get("LABLIB_DEVICE_AUDIT") == "1"


def off(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _MARK, False)


def _set(t, value: bool) -> None:
    if not isinstance(t, torch.Tensor):
        return
    if value:
        setattr(t, _MARK, True)
    elif getattr(t, _MARK, False):
        delattr(t, _MARK)


class DeviceRuleBroken(RuntimeError):
    pass


def _name(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


class Audit(TorchFunctionMode):
    """The mode. A Parameter wraps its data outside any torch function, so while the mode is on a new
    Parameter takes its data's mark (a module built here and never moved stays off the rule)."""

    def __enter__(self):
        self._new = torch.nn.Parameter.__new__
        new = self._new

        def parameter(cls, data=None, requires_grad=True):
            p = new(cls, data, requires_grad)
            _set(p, off(data))
            return p

        torch.nn.Parameter.__new__ = parameter
        return super().__enter__()

    def __exit__(self, *exc):
        torch.nn.Parameter.__new__ = self._new
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _FACTORIES:
            for t in tree_leaves(out):
                _set(t, kwargs.get("device") is None)
            return out
        if func in _MOVES:
            moves = func is not torch.Tensor.to or any(
                isinstance(a, (torch.device, str)) or (isinstance(a, torch.Tensor) and not off(a))
                for a in list(args[1:]) + [kwargs.get("device")] if a is not None)
            if moves:
                for t in tree_leaves(out):
                    _set(t, False)
                return out
        if func is torch.Tensor.copy_:  # copies across devices are fine: the destination stays where it is
            return out
        if func in _METHOD_FACTORIES:  # x.new_empty(...): x's device, unless device= says otherwise
            for t in tree_leaves(out):
                _set(t, off(args[0]) and kwargs.get("device") is None)
            return out
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func in _LIKE and kwargs.get("device") is not None:
            inputs = []
        bad = [t for t in inputs if off(t)]
        if bad and len(bad) < len(inputs):
            raise DeviceRuleBroken(
                f"{_name(func)} computed with a tensor made without a device (shape {tuple(bad[0].shape)}) and one on "
                "this rank's device: on a GPU this fails (tensors on different devices). Make it with "
                "device=lablib.device(), or build it on the CPU and move it: lablib.to_device(t).")
        for t in tree_leaves(out):
            _set(t, bool(bad))
        return out


def audited(fn, args, kwargs):
    """``fn(*args, **kwargs)``: as it is, or under LABLIB_DEVICE_AUDIT=1 (a test's pool) under the audit, and
    with what it returns checked too."""
    if not enabled():
        return fn(*args, **kwargs)
    with Audit():
        result = fn(*args, **kwargs)
    check_result(result)
    return result


def check_collective(tensor, what: str) -> None:
    """Under the audit: a collective's tensor must be on the rule (on a GPU it would be a CPU tensor)."""
    if enabled() and off(tensor):
        raise DeviceRuleBroken(f"lablib.{what} got a tensor made without a device (shape {tuple(tensor.shape)}): on a "
                               "GPU it would be a CPU tensor, and the collective would never touch the GPU. Make it "
                               "with device=lablib.device(), or move it first: lablib.to_device(t).")


def check_result(result) -> None:
    """Under the audit: what a job returns was computed on the device (the pool copies it to the CPU)."""
    for t in tree_leaves(result):
        if off(t):
            raise DeviceRuleBroken(f"the job returned a tensor (shape {tuple(t.shape)}) computed from tensors made without "
                                   "a device: on a GPU it would have been computed on the CPU. Build models and data "
                                   "on the CPU from the seed and move them with lablib.to_device (or module.to(...)).")
