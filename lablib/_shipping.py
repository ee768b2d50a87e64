"""How functions, arguments and results travel between the notebook and the ranks: cloudpickle,
by value for anything defined in the notebook, with two changes.

- Code objects keep their file name (cloudpickle 3 replaces it with "<dynamic-code>"), so a rank's
  traceback can quote the notebook cell it came from.
- Results come home on the CPU, whatever device they were on: the notebook kernel should not have to
  initialise CUDA to read them.
"""
from __future__ import annotations

import io
import pickle
import types
from collections import ChainMap

import cloudpickle


def _code_reduce_keeping_filename(code):
    ctor, args = cloudpickle.cloudpickle._code_reduce(code)
    return ctor, tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)


class _Pickler(cloudpickle.Pickler):
    dispatch_table = ChainMap({types.CodeType: _code_reduce_keeping_filename}, cloudpickle.Pickler.dispatch_table)
    to_cpu = False

    def reducer_override(self, obj):
        if self.to_cpu and type(obj).__module__.startswith("torch") and _is_device_tensor(obj):
            return (_identity, (obj.detach().cpu(),))
        return super().reducer_override(obj)


def _is_device_tensor(obj):
    import torch

    return isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta")


def _identity(x):
    return x


def dumps(obj, to_cpu: bool = False) -> bytes:
    buf = io.BytesIO()
    pickler = _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.to_cpu = to_cpu
    pickler.dump(obj)
    return buf.getvalue()
