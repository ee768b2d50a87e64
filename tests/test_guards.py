"""The guards grading compiles exercise code with (lablib/rules/guards.py): what honest exercise code is written
with runs as Python runs it, and what reaches past the rules is refused on the object reached, naming the line."""
import pytest
import torch

from lablib.rules.guards import Refused, compile_exercise
from lablib.rules.namespace import namespace


def _run(source: str, name: str, *args):
    ns = namespace()
    exec(compile_exercise(source, "<lab cell 3>"), ns)
    return ns[name](*args)


def test_honest_code_runs_as_python_runs_it():
    source = '''
import collections
from torch import autograd


class Pair(collections.namedtuple("Pair", ["a", "b"])):
    pass


class Scale(autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class Counter:
    def __init__(self, start: int):
        super().__init__()
        self.count = start
        self.count += 1

    def __call__(self):
        return self.count


def f(x):
    acc = [x.clone(), x.clone()]
    acc[0] += x                      # an item, in place
    view = acc[1][0:1]
    view += 10                       # a view: what it views changes too
    total = 0
    for a, b in zip(acc, acc):
        total += a.sum().item()

    def double():
        nonlocal total
        total = total * 2

    double()
    _helper = Pair(total, Counter(3)())
    y = Scale.apply(x.clone().requires_grad_())
    y.sum().backward()
    return acc, _helper, F.gelu(x).shape, dist.get_world_size
'''
    acc, pair, shape, fn = _run(source, "f", torch.ones(3))
    assert acc[0].tolist() == [2, 2, 2] and acc[1].tolist() == [11, 1, 1]
    assert pair == (38.0, 4) and shape == (3,) and fn is torch.distributed.get_world_size


@pytest.mark.parametrize("body, refused", [
    ("    nn = torch.nn\n    return nn.parallel", "torch.nn.parallel (lab cell 3, line 3, in f)"),
    ("    return torch.Generator()", "torch.Generator"),
    ("    return dist.FileStore", "torch.distributed.FileStore"),
    ("    return lablib.comm", "lablib.comm"),
    ("    return torch.serialization", "torch.serialization"),
    ("    return F.torch", "torch.nn.functional.torch"),
    ("    return x.numpy", ".numpy"),
    ("    return '{0.grad}'.format(x)", "str.format"),
    ("    torch.allclose = None", "a change to torch"),
    ("    torch.Tensor.add = None", "a change to Tensor"),
    ("    from torch import serialization\n    return serialization", "from torch import serialization"),
    ("    import os\n    return os", "import os"),
])
def test_what_reaches_past_the_rules_is_refused_on_the_object_reached(body, refused):
    with pytest.raises((Refused, ImportError), match="grading refused " + refused.replace("(", r"\(").replace(")", r"\)")
                       .replace(".", r"\.")):
        _run(f"def f(x):\n{body}\n", "f", torch.ones(2))


@pytest.mark.parametrize("source, error", [
    ("def f(x):\n    return (i for i in x).gi_frame", '"gi_frame" is a restricted name'),
    ("def f(x):\n    return x.__class__", '"__class__" is an invalid attribute name'),
    ("def f(x):\n    _getattr_ = None", '"_getattr_" is an invalid variable name'),
    ("class C:\n    def __torch_function__(self):\n        pass", '"__torch_function__" is an invalid variable name'),
])
def test_what_the_transformer_refuses_before_anything_runs(source, error):
    with pytest.raises(SyntaxError, match=error):
        compile_exercise(source, "<lab cell 3>")


def test_the_rank_job_frame_and_the_real_builtins_are_out_of_reach():
    """A generator's frame, the inputs a job was given: every way found to them goes through an attribute
    the guards check (f_back, gi_frame, __globals__), or a builtin the box does not have."""
    for body in ("    return getattr(x, 'grad')", "    return open('/proc/self/environ').read()",
                 "    return vars(x)", "    return type(x)"):
        with pytest.raises(NameError):
            _run(f"def f(x):\n{body}\n", "f", torch.ones(1))
