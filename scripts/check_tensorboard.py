#!/usr/bin/env python3
"""Dev check (issue 14, metrics): TensorBoard reads areno's event files.

Loads every event file in a --metrics-log-dir with TensorBoard's own
EventAccumulator (the reader behind `tensorboard --logdir`), prints each tag's
(step, value) pairs, and checks them against DIR/metrics.jsonl when it is
there: the same steps per tag and the same values at float32 (null = NaN).
After a resumed run this also shows that TensorBoard dropped the interrupted
run's steps past the resume step. Exits 1 on a mismatch. Not part of CI.

    pip install tensorboard
    python3 scripts/check_tensorboard.py METRICS_DIR
"""
import json
import math
import os
import struct
import sys

from tensorboard.backend.event_processing import event_accumulator


def f32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


def same(a, b):
    return (math.isnan(a) and math.isnan(b)) or a == b


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    logdir = sys.argv[1]
    acc = event_accumulator.EventAccumulator(logdir, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    seen = {}
    for tag in tags:
        seen[tag] = [(e.step, e.value) for e in acc.Scalars(tag)]
        print(tag, " ".join(f"{s}:{v:g}" for s, v in seen[tag]))
    if not tags:
        sys.exit("no scalars found in " + logdir)

    jsonl = os.path.join(logdir, "metrics.jsonl")
    if not os.path.exists(jsonl):
        return
    want = {}
    with open(jsonl) as f:
        for line in f:
            row = json.loads(line)
            for k, v in row.items():
                if k not in ("step", "time"):
                    want.setdefault(k, []).append((row["step"], f32(math.nan if v is None else v)))
    bad = [t for t in set(want) | set(seen)
           if len(want.get(t, [])) != len(seen.get(t, []))
           or not all(s1 == s2 and same(v1, v2) for (s1, v1), (s2, v2) in zip(want[t], seen[t]))]
    for t in sorted(bad):
        print(f"MISMATCH {t}: metrics.jsonl {want.get(t)} tensorboard {seen.get(t)}")
    if bad:
        sys.exit(1)
    print(f"tensorboard matches metrics.jsonl: {len(want)} tags")


if __name__ == "__main__":
    main()
