#!/usr/bin/env python3
"""The table of bench/peers/llama_server.sh: reads bench/serve/load.py's JSON
report of each point (areno-DT-cC.json, llama-DT-cC.json in --out-dir),
prints a markdown table (aggregate output tokens/s and the ratio
areno/llama-server, time to first token and inter-token latency p50 / p99,
failed requests, the server's peak RSS) and the three checks of issue 16's
must-show 6 (areno >= 1.0x at every point, areno's inter-token p99 no worse
than llama-server's, no point where more clients give areno less
throughput), and with --write-docs FILE puts it between
`<!-- llama_server.sh begin -->` and `<!-- llama_server.sh end -->`
(table.py's atomic write). With --loras K (llama_server.sh --loras) the
line says what adapters both servers held and the table goes between
`<!-- llama_server.sh:lora begin -->` and `<!-- llama_server.sh:lora end -->`.
"""
import argparse
import datetime
import json
import math
from pathlib import Path

from table import write_section


def load(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def num(x, fmt="{:.1f}"):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def pair(a, b, key, fmt="{:.0f}"):
    return f"{num(a.get(key) if a else None, fmt)} / {num(b.get(key) if b else None, fmt)}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--dtypes", required=True)
    ap.add_argument("--clients", required=True)
    ap.add_argument("--threads", required=True)
    ap.add_argument("--duration", required=True)
    ap.add_argument("--prompt-words", required=True)
    ap.add_argument("--max-tokens", required=True)
    ap.add_argument("--commit", required=True)
    ap.add_argument("--cpu", default="")
    ap.add_argument("--llama", default="")
    ap.add_argument("--areno-args", default="")
    ap.add_argument("--llama-args", default="")
    ap.add_argument("--load-before", default="")
    ap.add_argument("--load-after", default="")
    ap.add_argument("--loras", type=int, default=0)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--write-docs", type=Path)
    a = ap.parse_args()

    clients = [int(c) for c in a.clients.split(",")]
    rows, prompt_tokens = [], {}
    below, itl_worse, drops, failed = [], [], [], 0
    for dt in a.dtypes.split(","):
        prev = None
        for c in clients:
            o, p = load(a.out_dir / f"areno-{dt}-c{c}.json"), load(a.out_dir / f"llama-{dt}-c{c}.json")
            if o is None and p is None:
                continue
            ot, pt = (o or {}).get("throughput_tok_s"), (p or {}).get("throughput_tok_s")
            ratio = ot / pt if ot is not None and pt else None
            for name, r in (("areno", o), ("llama-server", p)):
                if r and r.get("prompt_tokens_mean") is not None:
                    prompt_tokens.setdefault(name, []).append(r["prompt_tokens_mean"])
                failed += (r or {}).get("requests_failed", 0) if r else 1
            if ratio is not None and ratio < 1.0:
                below.append(f"{dt} {c}")
            if o and p and o.get("itl_p99_ms", 0) > p.get("itl_p99_ms", 0):
                itl_worse.append(f"{dt} {c}")
            if prev is not None and ot is not None and ot < prev:
                drops.append(f"{dt} {c}")
            prev = ot if ot is not None else prev
            rows.append(
                f"| {dt} | {c} | {num(ot)} | {num(pt)} | {num(ratio, '{:.2f}x')} | "
                f"{pair(o, p, 'ttft_p50_ms')} | {pair(o, p, 'ttft_p99_ms')} | "
                f"{pair(o, p, 'itl_p50_ms', '{:.1f}')} | {pair(o, p, 'itl_p99_ms', '{:.1f}')} | "
                f"{pair(o, p, 'requests_ok')} | {pair(o, p, 'requests_failed')} | {pair(o, p, 'rss_mb_peak_hwm')} |")

    def mean_tokens(name):
        xs = prompt_tokens.get(name)
        return f"{sum(xs) / len(xs):.0f}" if xs else "-"

    today = datetime.date.today().isoformat()
    out = [
        f"Run {today}, areno {a.commit}, {a.llama}; `small` preset (seed 1), {a.threads} threads each, one server "
        f"at a time; CPU {a.cpu}. Streaming `/v1/completions`, {a.duration} s per point (requests started before "
        f"the deadline finish; tokens/s over the whole time), distinct {a.prompt_words}-word prompts (prompt tokens "
        f"as the servers counted them: areno {mean_tokens('areno')}, llama-server {mean_tokens('llama-server')}), "
        f"`max_tokens` {a.max_tokens}, `ignore_eos`, temperature 1. areno serve {a.areno_args}; "
        f"llama-server {a.llama_args}."
        + (f" Served LoRAs: both servers hold {a.loras} random rank-{a.lora_rank} adapters (scaling 2) on every "
           f"decoder linear (bench/peers/random_lora.py, the same numbers in both), areno by `--lora-modules a0=DIR "
           f"...`, llama-server by `--lora FILE ... --lora-init-without-apply`; client i's requests go through "
           f"adapter i mod {a.loras} (areno: `\"model\": \"a<j>\"`; llama-server: `\"lora\": [{{\"id\": j, "
           f"\"scale\": 1}}]`)." if a.loras else "")
        + f" Load average before: {a.load_before or '-'}; after: {a.load_after or '-'}.",
        "",
        "| dtype | clients | areno tok/s | llama-server tok/s | areno/llama-server | TTFT p50 ms (areno / llama) "
        "| TTFT p99 ms | ITL p50 ms | ITL p99 ms | requests | failed | peak RSS MB (VmHWM) |",
        "|---|---:|---:|---:|---:|---|---|---|---|---|---|---|",
        *rows,
        "",
        ("Must-show 6" if not a.loras else "Must-show 6's checks with served LoRAs")
        + ": areno >= 1.0x at every point: "
        + ("yes" if not below else "no (" + ", ".join(below) + " clients)")
        + "; areno's inter-token p99 no worse than llama-server's: "
        + ("yes" if not itl_worse else "no (" + ", ".join(itl_worse) + " clients)")
        + "; more clients never give areno less throughput: "
        + ("yes" if not drops else "no (at " + ", ".join(drops) + " clients)")
        + f"; failed requests: {failed}.",
    ]
    table = "\n".join(out)
    print(table)
    if a.write_docs:
        tag = "llama_server.sh:lora" if a.loras else "llama_server.sh"
        write_section(a.write_docs, f"<!-- {tag} begin -->", f"<!-- {tag} end -->", table)
        print(f"wrote the table into {a.write_docs}")


if __name__ == "__main__":
    main()
