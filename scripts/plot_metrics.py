#!/usr/bin/env python3
"""Plots keys of an `areno train` metrics.jsonl against the step (dev tool; needs matplotlib).

    python3 scripts/plot_metrics.py RUN/metrics/metrics.jsonl --keys reward_mean --out curve.png [--title T]
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("metrics")
    ap.add_argument("--keys", default="reward_mean", help="comma-separated metric names")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="")
    args = ap.parse_args()
    rows = [json.loads(line) for line in open(args.metrics) if line.strip()]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    for key in args.keys.split(","):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if not pts:
            raise SystemExit(f"{args.metrics}: no metric named {key}")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=key)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend()
    if args.title:
        ax.set_title(args.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out)


if __name__ == "__main__":
    main()
