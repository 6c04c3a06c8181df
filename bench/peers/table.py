#!/usr/bin/env python3
"""The table of bench/peers/llama_cpp.sh: reads the JSON lines of each round
(areno-DT-R.jsonl from bench_llm, llama-DT-R.jsonl from llama-bench -o jsonl,
batched-DT-R.txt from llama-batched-bench --output-format jsonl), keeps the best
of each measure over rounds and repetitions (both engines alike), prints a
markdown table, and with --write-docs FILE replaces the section between
`<!-- llama_cpp.sh:SECTION begin -->` and `<!-- llama_cpp.sh:SECTION end -->`
(SECTION: --section, default the preset)
(appended when absent; written to a temp file, synced, renamed).

Decode bound: a decode step reads every weight once (the tied head included),
so single-sequence decode cannot beat read_bw_step / weight_bytes tokens/s; the
last column gives measured tok/s over that bound. Prefill: GFLOP/s (bench_llm
counts the FLOPs; llama.cpp's rate is the same FLOPs at its tok/s) over the
best rate of the matmul op on the decoder's own weight shapes at 512 rows
(bench_llm's gemm_peak).
"""
import argparse
import datetime
import json
import os
from pathlib import Path


def lines(path: Path):
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def best(d, key, value):
    if value is not None and (key not in d or value > d[key]):
        d[key] = value


def write_section(path: Path, begin: str, end: str, body: str):
    """Replaces the text between the markers begin and end in path (appended
    when absent), written to a temp file, synced and renamed over it."""
    text = path.read_text() if path.is_file() else ""
    block = f"{begin}\n{body}\n{end}"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    write_atomic(path, text.encode())


def write_atomic(path: Path, data: bytes):
    """path's new contents: a temp file beside it, synced, renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--dtypes", required=True)
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--preset", required=True)
    ap.add_argument("--section", help="the docs markers' name (default: the preset)")
    ap.add_argument("--threads", required=True)
    ap.add_argument("--commit", required=True)
    ap.add_argument("--cpu", default="")
    ap.add_argument("--flags", default="")
    ap.add_argument("--llama", default="")
    ap.add_argument("--write-docs", type=Path)
    a = ap.parse_args()

    rows = []
    bw = None
    step_bw = {}  # dtype -> (GB/s over one decode step's bytes, those bytes)
    peak = {}
    for dt in a.dtypes.split(","):
        ours, peer, wbytes = {}, {}, None
        for r in range(1, a.rounds + 1):
            for j in lines(a.out_dir / f"areno-{dt}-{r}.jsonl"):
                if j["bench"] == "read_bw":
                    bw = max(bw or 0, j["gbps"])
                elif j["bench"] == "read_bw_step":
                    if j["gbps"] > step_bw.get(dt, (0, 0))[0]:
                        step_bw[dt] = (j["gbps"], j["bytes"])
                elif j["bench"] == "load":
                    wbytes = j["decode_read_bytes"]
                elif j["bench"] == "gemm_peak":
                    best(peak, dt, j["gflops"])
                elif "tok_s" in j:
                    best(ours, j["bench"], j["tok_s"])
                    if "gflops" in j:
                        best(ours, j["bench"] + ":gflops", j["gflops"])
            for j in lines(a.out_dir / f"llama-{dt}-{r}.jsonl"):
                name = f"pp{j['n_prompt']}" if j["n_gen"] == 0 else f"tg{j['n_gen']}"
                best(peer, name, max(j.get("samples_ts") or [j["avg_ts"]]))
            for j in lines(a.out_dir / f"batched-{dt}-{r}.txt"):
                if "speed_tg" in j:
                    best(peer, f"tg{j['tg']}_b{j['pl']}", j["speed_tg"])
        names = [n for n in ours if ":" not in n]
        for name in sorted(names, key=lambda n: (not n.startswith("pp"), len(n), n)):
            o, p = ours[name], peer.get(name)
            bound = ""
            sbw = step_bw.get(dt, (bw, 0))[0]
            if name == "tg128" and sbw and wbytes:
                limit = sbw * 1e9 / wbytes
                bound = f"{o / limit:.0%} / {p / limit:.0%} of the read bound" if p else f"{o / limit:.0%} / -"
            elif name.startswith("pp") and peak.get(dt) and ours.get(name + ":gflops"):
                g = ours[name + ":gflops"]
                pg = g * p / o if p else None  # same FLOPs per token for both engines
                bound = (f"{g:.0f} / {pg:.0f} GFLOP/s = {g / peak[dt]:.0%} / {pg / peak[dt]:.0%} of the "
                         f"{peak[dt]:.0f} GFLOP/s GEMM peak" if pg else f"{g / peak[dt]:.0%}")
            rows.append((dt, name, o, p, bound))

    today = datetime.date.today().isoformat()
    out = [
        f"Run {today}, areno {a.commit}, {a.llama}; `{a.preset}` preset (seed 1), {a.threads} threads; "
        f"CPU {a.cpu}; flags {a.flags.strip() or '-'}; read bandwidth (streaming sum) over 1 GiB "
        f"{bw:.1f} GB/s, over the bytes one decode step reads (the read bound's): "
        + ", ".join(f"{dt} {g:.1f} GB/s ({b / 1e6:.0f} MB)" for dt, (g, b) in step_bw.items())
        + f". Best of {a.rounds} interleaved rounds x repetitions, both engines.",
        "",
        "| dtype | measure | areno tok/s | llama.cpp tok/s | areno/llama.cpp | against the machine (areno / llama.cpp) |",
        "|---|---|---:|---:|---:|---|",
    ]
    for dt, name, o, p, bound in rows:
        ratio = f"{o / p:.2f}x" if p else "-"
        ps = f"{p:.1f}" if p else "-"
        out.append(f"| {dt} | {name} | {o:.1f} | {ps} | {ratio} | {bound} |")
    table = "\n".join(out)
    print(table)

    if a.write_docs:
        section = a.section or a.preset
        write_section(a.write_docs, f"<!-- llama_cpp.sh:{section} begin -->", f"<!-- llama_cpp.sh:{section} end -->",
                      table)
        print(f"wrote the table into {a.write_docs}")


if __name__ == "__main__":
    main()
