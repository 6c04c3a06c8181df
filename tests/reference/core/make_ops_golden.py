"""Golden values for tests/core/test_ops_golden.cpp: PyTorch (f64, CPU) outputs
and input gradients of the ops whose formulas are easiest to get subtly wrong.

    python3 tests/reference/core/make_ops_golden.py   # writes tests/data/core/ops_golden.json

For each case "<name>": inputs "<name>.in<i>", output "<name>.out", and for
differentiable cases the gradients of sum(out * w) with w = "<name>.w" as
"<name>.grad<i>" (i = input index). Inputs are f64 so the C++ test compares at
1e-10.
"""
import math
import os

import torch
import torch.nn.functional as F

from golden_json import GoldenWriter

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
g = GoldenWriter({"torch": torch.__version__, "script": "tests/reference/core/make_ops_golden.py"})


def case(name, fn, inputs, grad=True):
    """inputs: list of tensors; float ones get gradients when grad is True."""
    ins = []
    for i, t in enumerate(inputs):
        t = t.clone()
        g.add(f"{name}.in{i}", t)
        if grad and t.is_floating_point():
            t.requires_grad_(True)
        ins.append(t)
    out = fn(*ins)
    g.add(f"{name}.out", out)
    if grad:
        w = torch.randn(out.shape)
        g.add(f"{name}.w", w)
        (out * w).sum().backward()
        for i, t in enumerate(ins):
            if t.is_floating_point():
                g.add(f"{name}.grad{i}", t.grad)


r = torch.randn
case("gelu", F.gelu, [r(13) * 3])
case("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"), [r(13) * 3])
case("silu", F.silu, [r(13) * 3])
case("sigmoid", torch.sigmoid, [r(13) * 3])
case("pow", torch.pow, [torch.rand(7) + 0.5, r(7)])
case("softmax", lambda x: F.softmax(x, dim=1), [r(2, 5, 3)])
case("log_softmax", lambda x: F.log_softmax(x, dim=-1), [r(3, 6) * 4])
case("var", lambda x: torch.var(x, dim=(0, 2), correction=1), [r(3, 4, 5)])
case("cumsum", lambda x: torch.cumsum(x, dim=0), [r(5, 3)])
case("matmul_broadcast", torch.matmul, [r(2, 1, 3, 4), r(3, 4, 5)])
case("layer_norm", lambda x, w, b: F.layer_norm(x, (6,), w, b, 1e-5), [r(4, 6), r(6), r(6)])
case("rms_norm", lambda x, w: F.rms_norm(x, (6,), w, 1e-6), [r(4, 6), r(6)])
case("conv1d", lambda x, w, b: F.conv1d(x, w, b, stride=2, padding=2, dilation=2, groups=2),
     [r(2, 4, 11), r(6, 2, 3), r(6)])
case("conv2d", lambda x, w, b: F.conv2d(x, w, b, stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=3),
     [r(2, 3, 7, 8), r(6, 1, 3, 2), r(6)])
case("avg_pool2d", lambda x: F.avg_pool2d(x, 3, stride=2, padding=1), [r(1, 2, 7, 6)])
case("cross_entropy", lambda x, t: F.cross_entropy(x, t, ignore_index=2),
     [r(7, 4), torch.tensor([0, 2, 3, 1, 2, 3, 0])])
case("cross_entropy_sum", lambda x, t: F.cross_entropy(x, t, reduction="sum"),
     [r(5, 3), torch.tensor([0, 2, -100, 1, 2])])
case("gather", lambda x, i: torch.gather(x, 1, i), [r(3, 5), torch.tensor([[0, 4], [2, 2], [1, 3]])])
case("scatter_add", lambda x, i, s: torch.scatter_add(x, 0, i, s),
     [r(3, 2), torch.tensor([[0, 2], [0, 0], [1, 2]]), r(3, 2)])
case("pad", lambda x: F.pad(x, (2, 1, 0, 2), value=-1.5), [r(2, 3)])
case("topk", lambda x: torch.topk(x, 3, dim=-1).values, [r(4, 7)])
case("masked_scatter", lambda x, m, s: x.masked_scatter(m, s),
     [r(3, 4), torch.rand(3, 4) > 0.5, r(12)])

here = os.path.dirname(os.path.abspath(__file__))
out = os.path.join(here, "..", "..", "data", "core", "ops_golden.json")
g.write(os.path.normpath(out))
print("wrote", os.path.normpath(out))
