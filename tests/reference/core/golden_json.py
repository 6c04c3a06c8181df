"""Writes small tensors as the JSON golden format read by tests/core/golden.h:
{"meta": {...}, "tensors": {name: {"shape": [...], "dtype": "f64", "data": [...]}}}
"""
import json

import torch

_DTYPES = {torch.float64: "f64", torch.float32: "f32", torch.int64: "i64", torch.bool: "bool"}


class GoldenWriter:
    def __init__(self, meta):
        self.meta = meta
        self.tensors = {}

    def add(self, name, t):
        t = t.detach().cpu()
        if name in self.tensors:
            raise ValueError(f"duplicate golden tensor {name}")
        data = t.reshape(-1).tolist()
        if t.dtype == torch.bool:
            data = [1 if v else 0 for v in data]
        elif t.is_floating_point():
            # 12 significant digits: far below the tests' 1e-10 bounds, and
            # keeps the committed files small.
            data = [float(f"{v:.12g}") for v in data]
        self.tensors[name] = {"shape": list(t.shape), "dtype": _DTYPES[t.dtype], "data": data}

    def write(self, path):
        with open(path, "w") as f:
            json.dump({"meta": self.meta, "tensors": self.tensors}, f, separators=(",", ":"))
            f.write("\n")
