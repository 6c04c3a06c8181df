#!/usr/bin/env python3
"""safetensors interoperability with the Python `safetensors` package.

Run from the repository root:

  python3 tests/reference/io/make_golden.py
      writes tests/data/io/golden.safetensors (by safetensors.torch.save_file)
      and tests/data/io/golden.json: per tensor dtype, shape, the raw
      little-endian bytes as hex and the values (finite numbers; null for
      non-finite ones), which tests/io/test_io.cpp checks bit for bit.

  python3 tests/reference/io/make_golden.py --verify
      loads tests/data/io/written_by_areno.safetensors (written by areno's
      save_safetensors; regenerate with ARENO_UPDATE_GOLDEN=1 build/tests/io/test_io)
      with the Python package, compares every tensor with the values the C++
      test wrote (formulas below, mirrored in tests/io/test_io.cpp) and writes
      the result to tests/data/io/written_by_areno.verify.txt.
"""
import json
import math
import os
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

DATA = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "data", "io"))


def golden_tensors():
    return {
        "f32": torch.arange(6, dtype=torch.float32).reshape(2, 3) * 0.5 - 1.0,
        "f64_scalar": torch.tensor(math.pi, dtype=torch.float64),
        "bf16": torch.tensor([1.0, -2.5, 3.140625, float("inf"), -0.0, 1e-40, float("nan")],
                             dtype=torch.bfloat16),
        "f16": torch.tensor([[0.1, -65504.0], [6e-8, 1.0]], dtype=torch.float16),
        "bool": torch.tensor([True, False, True, True, False]),
        "i64": torch.tensor([-(2 ** 62), 0, 2 ** 40 + 1], dtype=torch.int64),
        "i32": torch.tensor([[-7], [2 ** 31 - 1]], dtype=torch.int32),
        "empty": torch.zeros(0, 4, dtype=torch.float32),
        "empty_i64": torch.zeros(3, 0, dtype=torch.int64),
        "model.layers.0/weight": torch.tensor([42.0], dtype=torch.float32),
    }


GOLDEN_METADATA = {"source": "python safetensors", "format": "pt"}
ST_DTYPE = {torch.float32: "F32", torch.float64: "F64", torch.bfloat16: "BF16",
            torch.float16: "F16", torch.bool: "BOOL", torch.int64: "I64", torch.int32: "I32"}


def raw_hex(t):
    # bytes exactly as safetensors stores them (little-endian, row-major)
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes().hex() if t.numel() else ""


def make():
    ts = golden_tensors()
    path = os.path.join(DATA, "golden.safetensors")
    save_file(ts, path, metadata=GOLDEN_METADATA)
    expected = {"metadata": GOLDEN_METADATA, "tensors": {}}
    for name, t in ts.items():
        vals = []
        for x in t.flatten().tolist():
            x = float(x) if not isinstance(x, bool) else float(x)
            vals.append(x if math.isfinite(x) else None)
        if t.dtype in (torch.int64, torch.int32):
            vals = [int(x) for x in t.flatten().tolist()]  # exact for i64
        expected["tensors"][name] = {"dtype": ST_DTYPE[t.dtype], "shape": list(t.shape),
                                     "hex": raw_hex(t), "values": vals}
    with open(os.path.join(DATA, "golden.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
        f.write("\n")
    # the Python package must read its own file back (sanity)
    back = load_file(path)
    assert all(raw_hex(back[k]) == raw_hex(ts[k])
               for k in ts if ts[k].numel())
    print(f"wrote {path} ({os.path.getsize(path)} bytes) and golden.json")


def areno_expected():
    # mirrors write_areno_tensors() in tests/io/test_io.cpp
    return {
        "weight": (torch.arange(12, dtype=torch.float64).reshape(3, 4) - 5) * 0.25,
        "half": torch.arange(6, dtype=torch.float64).reshape(2, 3) * 0.5 - 1,
        "brain": torch.tensor([1.0, -2.5, 3.140625, 0.0]),
        "double": torch.tensor(2.718281828459045, dtype=torch.float64),
        "ids": torch.tensor([-1, 0, 1 << 40], dtype=torch.int64),
        "count": torch.tensor([7, -7], dtype=torch.int32),
        "mask": torch.tensor([i % 2 == 0 for i in range(5)]),
        "empty": torch.zeros(0, 2),
        # a transposed (non-contiguous) [2, 3] arange, written contiguous
        "transposed": torch.arange(6, dtype=torch.float64).reshape(2, 3).t(),
    }


ARENO_DTYPES = {"weight": torch.float32, "half": torch.float16, "brain": torch.bfloat16,
                "double": torch.float64, "ids": torch.int64, "count": torch.int32,
                "mask": torch.bool, "empty": torch.float32, "transposed": torch.float32}


def verify():
    path = os.path.join(DATA, "written_by_areno.safetensors")
    lines = [f"python safetensors {__import__('safetensors').__version__}, torch {torch.__version__}",
             f"file: tests/data/io/written_by_areno.safetensors ({os.path.getsize(path)} bytes)"]
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    lines.append(f"metadata: {json.dumps(meta, sort_keys=True)}")
    ok = meta == {"writer": "areno", "format": "pt"}
    loaded = load_file(path)
    exp = areno_expected()
    if sorted(loaded) != sorted(exp):
        ok = False
        lines.append(f"FAIL names {sorted(loaded)} != {sorted(exp)}")
    for name in sorted(exp):
        if name not in loaded:
            continue
        t = loaded[name]
        want = exp[name].to(ARENO_DTYPES[name])
        good = t.dtype == want.dtype and t.shape == want.shape and torch.equal(t, want)
        ok &= good
        lines.append(f"{'ok  ' if good else 'FAIL'} {name}: {t.dtype} {list(t.shape)}")
    lines.append("RESULT: " + ("PASS" if ok else "FAIL"))
    text = "\n".join(lines) + "\n"
    with open(os.path.join(DATA, "written_by_areno.verify.txt"), "w") as f:
        f.write(text)
    print(text, end="")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(verify() if "--verify" in sys.argv else make())
