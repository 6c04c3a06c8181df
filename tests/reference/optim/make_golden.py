#!/usr/bin/env python3
"""Golden numbers for tests/optim: PyTorch's AdamW and SGD trajectories and
learning-rate schedules, written to tests/data/optim/golden.safetensors.

Run from the repository root:  python3 tests/reference/optim/make_golden.py

Every trajectory starts from fixed parameters and feeds fixed gradients (stored
in the file), so the C++ test needs no autograd to reproduce it.

Tensors (f32 unless noted):
  init.w [4, 3], init.b [3]           starting parameters
  grad.{k}.w, grad.{k}.b              gradient fed at step k (k = 0..STEPS-1)
  adamw.{k}.w, adamw.{k}.b            AdamW parameters after step k
  adamw.lrs [STEPS, 2] f64            lr of each group used at step k
  adamw.norms [STEPS] f64             total grad norm returned by clip_grad_norm_
  sgd.{k}.w / .b, sgd_nesterov.{k}.w / .b   SGD trajectories
  sched.warmup_constant, sched.warmup_cosine, sched.cosine_annealing [n] f64
                                      lr at steps 0..n-1 (base lr 1.0 / 0.5)
"""
import math
import os

import torch
from safetensors.torch import save_file

STEPS = 8
ROOT = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(ROOT, "..", "..", "data", "optim", "golden.safetensors")

# AdamW configuration (mirrored in tests/optim/test_optim.cpp)
ADAM_LR = (1e-2, 5e-3)  # group 0 (w, with schedule), group 1 (b, constant)
ADAM_WD = (0.1, 0.0)
BETAS = (0.9, 0.95)
EPS = 1e-8
WARMUP, TOTAL, MIN_RATIO = 2, 8, 0.1
MAX_NORM = 1.0
GRAD_SCALE = [0.1, 2.0, 0.5, 3.0, 0.05, 1.0, 0.2, 4.0]  # some steps clip, some do not


def warmup_constant(w):
    # transformers.get_constant_schedule_with_warmup
    return lambda s: s / max(1.0, w) if s < w else 1.0


def warmup_cosine(w, total, min_ratio):
    # transformers.get_cosine_with_min_lr_schedule_with_warmup (one half cycle),
    # held at the minimum after `total` steps
    def f(s):
        if s < w:
            return s / max(1, w)
        progress = min(1.0, (s - w) / max(1, total - w))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return f


def main():
    g = torch.Generator().manual_seed(1234)
    out = {}
    w0 = torch.randn(4, 3, generator=g)
    b0 = torch.randn(3, generator=g)
    out["init.w"], out["init.b"] = w0.clone(), b0.clone()
    grads = []
    for k in range(STEPS):
        gw = torch.randn(4, 3, generator=g) * GRAD_SCALE[k]
        gb = torch.randn(3, generator=g) * GRAD_SCALE[k]
        grads.append((gw, gb))
        out[f"grad.{k}.w"], out[f"grad.{k}.b"] = gw.clone(), gb.clone()

    # ---- AdamW: two groups, schedule on group 0, global-norm clipping ----
    w = w0.clone().requires_grad_()
    b = b0.clone().requires_grad_()
    opt = torch.optim.AdamW(
        [{"params": [w], "lr": ADAM_LR[0], "weight_decay": ADAM_WD[0]},
         {"params": [b], "lr": ADAM_LR[1], "weight_decay": ADAM_WD[1]}],
        betas=BETAS, eps=EPS, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, [warmup_cosine(WARMUP, TOTAL, MIN_RATIO), lambda s: 1.0])
    lrs, norms = [], []
    for k in range(STEPS):
        w.grad, b.grad = grads[k][0].clone(), grads[k][1].clone()
        norms.append(torch.nn.utils.clip_grad_norm_([w, b], MAX_NORM).item())
        lrs.append([grp["lr"] for grp in opt.param_groups])
        opt.step()
        sched.step()
        out[f"adamw.{k}.w"], out[f"adamw.{k}.b"] = w.detach().clone(), b.detach().clone()
    out["adamw.lrs"] = torch.tensor(lrs, dtype=torch.float64)
    out["adamw.norms"] = torch.tensor(norms, dtype=torch.float64)

    # ---- SGD with momentum (dampening, weight decay) and Nesterov ----
    for tag, kw in [("sgd", dict(momentum=0.9, dampening=0.1, weight_decay=0.01)),
                    ("sgd_nesterov", dict(momentum=0.9, nesterov=True, weight_decay=0.01))]:
        w = w0.clone().requires_grad_()
        b = b0.clone().requires_grad_()
        opt = torch.optim.SGD([w, b], lr=0.1, foreach=False, **kw)
        for k in range(STEPS):
            w.grad, b.grad = grads[k][0].clone(), grads[k][1].clone()
            opt.step()
            out[f"{tag}.{k}.w"], out[f"{tag}.{k}.b"] = w.detach().clone(), b.detach().clone()

    # ---- schedules through torch's own schedulers ----
    def trace(make, n, base):
        p = torch.zeros(1, requires_grad=True)
        o = torch.optim.SGD([p], lr=base)
        s = make(o)
        vals = []
        for _ in range(n):
            vals.append(o.param_groups[0]["lr"])
            o.step()
            s.step()
        return torch.tensor(vals, dtype=torch.float64)

    L = torch.optim.lr_scheduler
    out["sched.warmup_constant"] = trace(lambda o: L.LambdaLR(o, warmup_constant(4)), 9, 1.0)
    out["sched.warmup_cosine"] = trace(lambda o: L.LambdaLR(o, warmup_cosine(3, 10, 0.1)), 13, 1.0)
    # closed-form cosine to eta_min = 0.05 = 0.1 * base over T_max = 10, no warm-up
    out["sched.cosine_annealing"] = trace(lambda o: L.CosineAnnealingLR(o, T_max=10, eta_min=0.05), 11, 0.5)

    out = {k: v.contiguous() for k, v in out.items()}
    save_file(out, OUT, metadata={"generator": "tests/reference/optim/make_golden.py",
                                  "torch": torch.__version__})
    print(f"wrote {len(out)} tensors to {os.path.normpath(OUT)} ({os.path.getsize(OUT)} bytes)")
    print("adamw norms:", [round(x, 4) for x in norms])
    print("adamw lrs:", lrs)


if __name__ == "__main__":
    main()
