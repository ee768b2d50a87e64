"""``%%ranks N``: run a notebook cell's body on N ranks of the shared pool.

    %load_ext lablib

    %%ranks 4
    x = torch.ones(2, device=lablib.device()) * rank
    dist.all_reduce(x)
    print(x)

Inside the cell ``rank``, ``world_size``, ``dist``, ``torch`` and ``lablib`` are defined, and every
notebook variable the body names is sent along (by value). If the last line is an expression, its
value on each rank is shown as a list in rank order. ``--timeline`` shows the timeline afterwards.
"""
from __future__ import annotations

import argparse
import ast
import itertools
import linecache
import shlex
import types

_SKIP = {"rank", "world_size", "dist", "torch", "lablib", "In", "Out", "get_ipython", "exit", "quit"}
_counter = itertools.count(1)


def _names(code: types.CodeType) -> set[str]:
    out = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out |= _names(const)
    return out


def _run_body(source: str, filename: str, names: dict):
    """Runs on each rank: the cell body, with the notebook's variables it uses."""
    import torch
    import torch.distributed as dist

    import lablib

    ns = dict(names, rank=dist.get_rank(), world_size=dist.get_world_size(), dist=dist, torch=torch,
              lablib=lablib, __name__="__main__")
    tree = ast.parse(source, filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), ns)
    if last is not None:
        return eval(compile(ast.Expression(last.value), filename, "eval"), ns)
    return None


def _parser():
    p = argparse.ArgumentParser(prog="%%ranks", add_help=False)
    p.add_argument("world_size", type=int)
    p.add_argument("--timeline", action="store_true", help="show the per-rank timeline after the run")
    p.add_argument("--timeout", type=float, default=None)
    return p


def ranks(line: str, cell: str, shell=None):
    import cloudpickle

    from .pool import cluster

    try:
        args = _parser().parse_args(shlex.split(line))
    except SystemExit:
        raise ValueError(f"usage: %%ranks N [--timeline] [--timeout SECONDS]  (got: %%ranks {line})") from None
    filename = f"<%%ranks cell {next(_counter)}>"
    lines = cell.splitlines(keepends=True)
    linecache.cache[filename] = (len(cell), None, lines, filename)
    code = compile(cell, filename, "exec")  # a syntax error shows here, before any rank runs
    user_ns = shell.user_ns if shell is not None else {}
    names, unsent = {}, []
    for name in sorted(_names(code) - _SKIP):
        if name in user_ns and not name.startswith("_"):
            try:
                cloudpickle.dumps(user_ns[name])
                names[name] = user_ns[name]
            except Exception as exc:
                unsent.append(f"{name} ({type(exc).__name__})")
    if unsent:
        print("lablib: not sent to the ranks (cannot be pickled): " + ", ".join(unsent))
    kwargs = {"timeout": args.timeout} if args.timeout else {}
    c = cluster(args.world_size, **kwargs)
    values = c.run(_run_body, cell, filename, names)
    if args.timeline:
        from IPython.display import display

        display(c.timeline())
    if any(v is not None for v in values):
        return values
    return None


def load_ipython_extension(ipython):
    def _magic(line, cell):
        return ranks(line, cell, ipython)

    ipython.register_magic_function(_magic, magic_kind="cell", magic_name="ranks")
