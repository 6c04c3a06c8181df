"""The same benchmarks as bench_core.cpp, on PyTorch (CPU), 2 threads by default."""
import json
import os
import time

import torch

torch.set_num_threads(int(os.environ.get("THREADS", "2")))
torch.manual_seed(0)


def best_ms(f, reps):
    f()
    best = 1e30
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def emit(name, ms, **kw):
    print(json.dumps({"bench": name, "device": "cpu", "peer": "torch " + torch.__version__, "ms": round(ms, 3), **kw}))


with torch.no_grad():
    for m, n, k, reps in [(1024, 1024, 1024, 10), (4096, 4096, 512, 5)]:
        a, b = torch.randn(m, k), torch.randn(k, n)
        ms = best_ms(lambda: a @ b, reps)
        emit(f"gemm_f32_{m}x{n}x{k}", ms, gflops=round(2 * m * n * k / ms / 1e6, 1))
    n = 16 * 1024 * 1024
    x, y = torch.randn(n), torch.randn(n)
    ms = best_ms(lambda: x + y, 10)
    emit("add_f32_16M", ms, gbps=round(12 * n / ms / 1e6, 1))
    s = torch.randn(4096, 4096)
    ms = best_ms(lambda: torch.softmax(s, -1), 10)
    emit("softmax_f32_4096x4096", ms, gbps=round(8 * 4096 * 4096 / ms / 1e6, 1))
