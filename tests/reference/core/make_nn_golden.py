"""Golden values for tests/nn/: torch.nn layers (f64) with their state_dict
tensors, inputs, outputs and parameter gradients, and F.scaled_dot_product_attention
with GQA, causal masking, additive bias and a key padding mask.

    python3 tests/reference/core/make_nn_golden.py   # writes tests/data/core/nn_golden.json

Names: "<case>.<state_dict name>" for parameters, "<case>.x" input, "<case>.y"
output, "<case>.w" the weight of the scalar loss sum(y * w), "<case>.grad.<param>"
parameter gradients and "<case>.grad.x" the input gradient.
"""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from golden_json import GoldenWriter

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
g = GoldenWriter({"torch": torch.__version__, "script": "tests/reference/core/make_nn_golden.py"})


def layer(name, module, x, randomize=False):
    if randomize:  # norms start at ones/zeros; random values test the affine part
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(torch.randn(p.shape))
    for k, v in module.state_dict().items():
        g.add(f"{name}.{k}", v)
    g.add(f"{name}.x", x)
    x = x.clone().requires_grad_(x.is_floating_point())
    y = module(x)
    g.add(f"{name}.y", y)
    w = torch.randn(y.shape)
    g.add(f"{name}.w", w)
    (y * w).sum().backward()
    for k, p in module.named_parameters():
        g.add(f"{name}.grad.{k}", p.grad)
    if x.is_floating_point():
        g.add(f"{name}.grad.x", x.grad)


layer("linear", nn.Linear(5, 3), torch.randn(2, 4, 5))
layer("linear_nobias", nn.Linear(5, 3, bias=False), torch.randn(4, 5))
layer("embedding", nn.Embedding(10, 4), torch.tensor([[1, 9, 1], [0, 3, 7]]))
layer("rmsnorm", nn.RMSNorm(6, eps=1e-6), torch.randn(3, 6), randomize=True)
layer("layernorm", nn.LayerNorm(6, eps=1e-5), torch.randn(2, 3, 6), randomize=True)
layer("conv1d", nn.Conv1d(4, 6, 3, stride=2, padding=1, groups=2), torch.randn(2, 4, 9))
layer("conv2d", nn.Conv2d(3, 6, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2), groups=3),
      torch.randn(1, 3, 7, 6))
layer("conv2d_depthwise", nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False), torch.randn(1, 4, 5, 5))
x = torch.randn(3, 8) * 2
layer("gelu", nn.GELU(), x)
layer("gelu_tanh", nn.GELU(approximate="tanh"), x)
layer("silu", nn.SiLU(), x)
layer("glu", nn.GLU(dim=-1), x)


class Block(nn.Module):
    """norm -> proj -> silu, with nested names like a transformer layer."""

    def __init__(self, d):
        super().__init__()
        self.norm = nn.RMSNorm(d, eps=1e-6)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        return x + F.silu(self.proj(self.norm(x)))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.layers = nn.ModuleList([Block(6), Block(6)])
        self.final_norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 11, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for b in self.layers:
            h = b(h)
        return self.head(self.final_norm(h))


layer("tiny", Tiny(), torch.tensor([[3, 1, 4, 1], [5, 9, 2, 6]]), randomize=True)


# ---- attention ----
def sdpa_case(name, B, Hq, Hkv, Tq, Tk, D, causal=False, bias=False, kpm=False, scale=None):
    q, k, v = torch.randn(B, Hq, Tq, D), torch.randn(B, Hkv, Tk, D), torch.randn(B, Hkv, Tk, D)
    mask = torch.zeros(B, Hq, Tq, Tk)
    if bias:
        b = torch.randn(1, Hq, Tq, Tk)
        g.add(f"{name}.bias", b)
        mask = mask + b
    if causal:  # the last query sees the last key (bottom-right aligned)
        allowed = torch.ones(Tq, Tk, dtype=torch.bool).tril(diagonal=Tk - Tq)
        mask = mask.masked_fill(~allowed, float("-inf"))
    if kpm:
        pad = torch.rand(B, Tk) > 0.6
        pad[:, 0] = False  # no fully masked rows
        g.add(f"{name}.key_padding_mask", pad)
        mask = mask.masked_fill(pad[:, None, None, :], float("-inf"))
    for t_name, t in (("q", q), ("k", k), ("v", v)):
        g.add(f"{name}.{t_name}", t)
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=Hq != Hkv)
    g.add(f"{name}.y", y)
    w = torch.randn(y.shape)
    g.add(f"{name}.w", w)
    (y * w).sum().backward()
    for t_name, t in (("q", q), ("k", k), ("v", v)):
        g.add(f"{name}.grad.{t_name}", t.grad)


sdpa_case("sdpa_plain", 1, 2, 2, 4, 4, 8)
sdpa_case("sdpa_causal", 1, 2, 2, 5, 5, 4, causal=True)
sdpa_case("sdpa_causal_kv_cache", 1, 2, 2, 2, 6, 4, causal=True)  # Tq < Tk: decode with a cache
sdpa_case("sdpa_gqa", 1, 4, 2, 3, 5, 4)
sdpa_case("sdpa_bias", 2, 2, 1, 3, 4, 4, bias=True, scale=0.3)
sdpa_case("sdpa_key_padding", 2, 2, 2, 3, 6, 4, kpm=True)
sdpa_case("sdpa_all", 2, 4, 2, 3, 5, 4, causal=True, bias=True, kpm=True)

here = os.path.dirname(os.path.abspath(__file__))
out = os.path.normpath(os.path.join(here, "..", "..", "data", "core", "nn_golden.json"))
g.write(out)
print("wrote", out)
