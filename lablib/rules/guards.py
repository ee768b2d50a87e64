"""Exercise code as grading runs it: compiled with RestrictedPython's guards, so that the rules hold on the
objects the code actually reaches, not on how it spells them.

``compile_exercise(source, filename)`` compiles a cell with ``Transformer``: every attribute read becomes
``_getattr_(obj, "name")``, every item or attribute written goes through ``_write_(obj)``, every loop and
unpacking through ``_getiter_``, every ``x += y`` through ``_inplacevar_`` (truly in place: a tensor view
updated with ``+=`` updates what it views). At run time (``GUARDS``, in the exercise builtins):

- an attribute beginning with ``_`` is refused (a learner's own local ``_helper`` names are fine);
- an attribute of a module must be on that module's allow-list (``allowed.MODULES``), and a module reached
  any other way must be one of those modules: a name that holds a module is that module, whatever it is
  called; frames, code objects and tracebacks are refused wherever they are reached;
- only the exercise code's own objects, and the objects a check hands it, may be written to: no module, no
  class or function it did not define;
- ``import`` takes the allowed modules, and ``from m import x`` only the allowed names of ``m``.

RestrictedPython is not a sandbox by itself (its README says so): these guards keep exercise code off what the
judge trusts and off the task's rules; the box (course/sandbox.py) holds what the code could do past them.
"""
from __future__ import annotations

import ast
import functools
import operator
import sys
import types

from RestrictedPython import compile_restricted
from RestrictedPython.Guards import guarded_iter_unpack_sequence, guarded_unpack_sequence
from RestrictedPython.transformer import ALLOWED_FUNC_NAMES, RestrictingNodeTransformer

from .allowed import MODULES
from .policy import DENIED, MODULES as IMPORTS

NAME = "__exercise__"  # the module name exercise code runs under (namespace.NAME)
# Methods an exercise class may define (and reach through super()), besides plain ones: none runs when the
# class is defined or when torch dispatches.
DUNDERS = ALLOWED_FUNC_NAMES | {"__call__", "__len__", "__iter__", "__next__", "__getitem__", "__setitem__",
                                "__repr__", "__str__", "__hash__", "__bool__"}
_UNREACHABLE = (types.FrameType, types.CodeType, types.TracebackType)
GROUP_QUERIES = {"rank", "size", "name", "group_name", "group_desc"}  # what exercise code may ask a process group


@functools.cache
def _c10d() -> tuple:
    """The types of torch.distributed's own objects whose methods move data: process groups and stores."""
    import torch.distributed as dist

    return (dist.ProcessGroup, dist.Store) if dist.is_available() else ()


class Refused(RuntimeError):
    """What exercise code reached for, where, and what to write instead."""


class Transformer(RestrictingNodeTransformer):
    """RestrictedPython's transformer, with what honest exercise code here is written with allowed:
    augmented assignment of items and attributes (``acc[c] += incoming``), ``nonlocal``, annotated
    assignments (a NamedTuple's fields), ``super().__init__()`` and the methods in ``DUNDERS``, a learner's
    own ``_helper`` names, and ``print`` as Python's own."""

    def check_name(self, node, name, allow_magic_methods=False):
        if name and name.startswith("_") and not name.endswith("_") and name not in ("_print", "_"):
            return  # the learner's own private name: not one of Python's (__x__) or the guards' (_getattr_)
        if allow_magic_methods and name in DUNDERS:
            return
        super().check_name(node, name, allow_magic_methods)

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load) and node.id in ("print", "printed"):
            return node  # Python's print (the notebook's output), not RestrictedPython's collector
        return super().visit_Name(node)

    def visit_Nonlocal(self, node):
        return self.node_contents_visit(node)

    def visit_AnnAssign(self, node):
        return self.node_contents_visit(node)

    def visit_AugAssign(self, node):
        if isinstance(node.target, (ast.Attribute, ast.Subscript)):
            return self.node_contents_visit(node)  # its target becomes _write_(obj).name / _write_(obj)[key]
        return super().visit_AugAssign(node)

    def visit_Attribute(self, node):
        if (node.attr in DUNDERS and isinstance(node.ctx, ast.Load) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name) and node.value.func.id == "super"):
            node = self.node_contents_visit(node)  # super().__init__(...)
            call = ast.Call(func=ast.Name("_getattr_", ast.Load()), args=[node.value, ast.Constant(node.attr)],
                            keywords=[])
            return ast.fix_missing_locations(ast.copy_location(call, node))
        return super().visit_Attribute(node)


def compile_exercise(source: str, filename: str):
    """``source`` compiled with the guards; a SyntaxError naming each line the transformer refuses."""
    try:
        return compile_restricted(source, filename, "exec", policy=Transformer)
    except SyntaxError as exc:
        if exc.args and isinstance(exc.args[0], tuple):  # the transformer's refusals, one per line
            raise SyntaxError(f"grading refused {filename.strip('<>')}: " + "; ".join(exc.args[0])) from None
        raise


def _where() -> str:
    """``cell 3, line 12`` (or the rank job's file and line) of the exercise code that called a guard."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") != NAME:
        frame = frame.f_back
    if frame is None:
        return ""
    name = frame.f_code.co_filename.strip("<>")
    return f" ({name}, line {frame.f_lineno}, in {frame.f_code.co_name})"


def refuse(what: str, instead: str, kind: type = Refused):
    raise kind(f"grading refused {what}{_where()}: {instead}")


def _module_name(module) -> str:
    return getattr(module, "__name__", "?")


def _check_value(value, what: str):
    if isinstance(value, types.ModuleType) and _module_name(value) not in MODULES:
        refuse(f"{what}, the module {_module_name(value)}",
               f"exercises use {', '.join(sorted(MODULES))} and nothing past them")
    if isinstance(value, _UNREACHABLE) or (getattr(type(value), "__module__", None) or "").startswith("numpy"):
        refuse(f"{what}, a {type(value).__name__}", "exercise code computes with tensors and its own objects")
    return value


def _getattr_(obj, name: str, *default):
    if name.startswith("_") and not (isinstance(obj, super) and name in DUNDERS):
        refuse(f".{name}", "attributes beginning with _ belong to the library's internals")
    if isinstance(obj, types.ModuleType):
        module = _module_name(obj)
        if name not in MODULES.get(module, ()):
            moves = "; data moves between ranks through lablib's calls (lablib.all_reduce, lablib.send, ...), which " \
                    "the checks count"
            refuse(f"{module}.{name}", f"it is not one of the names of {module} that exercises use (lablib/rules/"
                   "allowed.py)" + (moves if module == "torch.distributed" else ""))
    elif isinstance(obj, _c10d()) and name not in GROUP_QUERIES:
        refuse(f"{type(obj).__name__}.{name}", "a process group is passed to lablib's calls as group= (which the "
               "checks count); its own methods move data no check sees")
    elif isinstance(obj, str) and name in ("format", "format_map"):
        refuse(f"str.{name}", "build text with f-strings")
    elif name in DENIED:
        refuse(f".{name}", "an exercise does not need it")
    return _check_value(getattr(obj, name, *default), f"{type(obj).__name__}.{name}")


def _write_(obj):
    if isinstance(obj, types.ModuleType) or (isinstance(obj, type) and obj.__module__ != NAME) or isinstance(
            obj, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial)):
        refuse(f"a change to {getattr(obj, '__qualname__', None) or _module_name(obj)}",
               "change only your own objects (tensors, lists, dicts, your classes' instances)")
    return obj


_INPLACE = {"+=": operator.iadd, "-=": operator.isub, "*=": operator.imul, "/=": operator.itruediv,
            "%=": operator.imod, "**=": operator.ipow, "<<=": operator.ilshift, ">>=": operator.irshift,
            "|=": operator.ior, "^=": operator.ixor, "&=": operator.iand, "//=": operator.ifloordiv,
            "@=": operator.imatmul}


def _inplacevar_(op: str, target, value):
    return _INPLACE[op](target, value)


# torch's C code imports its own modules through the calling frame's __import__, the exercise code's:
# torch.storage on a process's first torch.tensor(...).
_TORCH_OWN = {"torch.storage"}


def _guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
    if name in _TORCH_OWN and not level:
        return __import__(name, globals, locals, fromlist, level)
    if level or name not in IMPORTS:
        refuse(f"import {name}", f"exercise code may import only {', '.join(sorted(IMPORTS))}", ImportError)
    module = __import__(name, globals, locals, fromlist, level)
    for item in fromlist or ():
        if item not in MODULES[name] and f"{name}.{item}" not in MODULES:
            listed = ", ".join(sorted(MODULES[name])[:12])
            refuse(f"from {name} import {item}", f"an exercise uses {name}'s {listed}, ...", ImportError)
    return module


def _apply_(function, *args, **kwargs):
    return function(*args, **kwargs)


def _hasattr(obj, name: str) -> bool:
    try:
        _getattr_(obj, name)
    except (AttributeError, Refused):
        return False
    return True


GUARDS = {
    "_getattr_": _getattr_, "_getitem_": operator.getitem, "_write_": _write_, "_getiter_": iter,
    "_iter_unpack_sequence_": guarded_iter_unpack_sequence, "_unpack_sequence_": guarded_unpack_sequence,
    "_inplacevar_": _inplacevar_, "_apply_": _apply_, "__metaclass__": type,
    "__import__": _guarded_import, "hasattr": _hasattr,
}
