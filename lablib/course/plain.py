"""Plain data across the grading box's wall: JSON with tensors as dtype, shape and raw bytes.

The judge outside the box reads only this: numbers, strings, booleans, None, lists, string-keyed
dicts and tensors of the standard type and the usual dtypes. Nothing in it can run code when read
(unlike pickle), and a tensor subclass or an object with its own ``__eq__`` cannot cross: ``encode``
refuses them, and ``decode`` builds every tensor itself.
"""
from __future__ import annotations

import base64
import json
import math

import torch

DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16,
                                                      torch.int64, torch.int32, torch.int16, torch.int8,
                                                      torch.uint8, torch.bool)}
MAX_BYTES = 256 << 20  # tensor bytes in one result; the checks' data is a few MB at most
MAX_DEPTH = 32


class NotPlain(ValueError):
    pass


def encode(obj, depth: int = 0):
    """``obj`` as JSON-ready data; raises NotPlain for anything else."""
    if depth > MAX_DEPTH:
        raise NotPlain("nested too deeply")
    if obj is None or type(obj) in (bool, int, str):
        return obj
    if type(obj) is float:
        return obj if math.isfinite(obj) else {"float": repr(obj)}
    if type(obj) in (list, tuple):
        return [encode(v, depth + 1) for v in obj]
    if type(obj) is dict:
        if not all(type(k) is str for k in obj):
            raise NotPlain("a dict with keys that are not strings")
        return {"dict": {k: encode(v, depth + 1) for k, v in obj.items()}}
    if type(obj) is torch.Tensor:
        name = str(obj.dtype).removeprefix("torch.")
        if name not in DTYPES:
            raise NotPlain(f"a tensor of dtype {name}")
        t = obj.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""  # a 0-dim one too
        return {"tensor": {"dtype": name, "shape": list(t.shape), "data": base64.b64encode(raw).decode()}}
    raise NotPlain(f"a {type(obj).__module__}.{type(obj).__qualname__}")


def decode(data, depth: int = 0, budget: list | None = None):
    """The value ``encode`` wrote; raises NotPlain for anything that is not exactly that format."""
    budget = budget if budget is not None else [MAX_BYTES]
    if depth > MAX_DEPTH:
        raise NotPlain("nested too deeply")
    if data is None or type(data) in (bool, int, str, float):
        return data
    if type(data) is list:
        return [decode(v, depth + 1, budget) for v in data]
    if type(data) is not dict or len(data) != 1:
        raise NotPlain(f"unexpected {type(data).__name__}")
    (kind, value), = data.items()
    if kind == "float" and value in ("inf", "-inf", "nan"):
        return float(value)
    if kind == "dict" and type(value) is dict:
        return {str(k): decode(v, depth + 1, budget) for k, v in value.items()}
    if kind == "tensor" and type(value) is dict and set(value) == {"dtype", "shape", "data"}:
        dtype = DTYPES.get(value["dtype"]) if type(value["dtype"]) is str else None
        shape = value["shape"]
        if dtype is None or type(shape) is not list or not all(type(k) is int and 0 <= k < 1 << 40 for k in shape):
            raise NotPlain("a tensor with a bad dtype or shape")
        if type(value["data"]) is not str:
            raise NotPlain("a tensor without data")
        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        budget[0] -= nbytes
        if budget[0] < 0:
            raise NotPlain(f"more than {MAX_BYTES >> 20} MB of tensors")
        raw = base64.b64decode(value["data"], validate=True)
        if len(raw) != nbytes:
            raise NotPlain(f"a tensor of shape {shape} with {len(raw)} bytes, not {nbytes}")
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(shape).clone() if numel else torch.empty(shape, dtype=dtype)
    raise NotPlain(f"unexpected {kind!r}")


def dumps(obj) -> str:
    return json.dumps(encode(obj), allow_nan=False)


def loads(text: str):
    return decode(json.loads(text))
