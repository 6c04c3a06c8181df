#!/usr/bin/env python3
"""Load generator for `areno serve` (issue 7, must show 5; benchmarks).

N concurrent clients each send streaming chat completions (or, with
--endpoint completions, streaming /v1/completions) back to back for a
duration; requests started before the deadline run to their end, and the
elapsed time includes that drain. Reports throughput (generated tokens/s over
the elapsed time), time to first token and inter-token latency (p50/p99; a
token is a stream chunk carrying text), failed requests, the server's memory
(RSS at start and end, and its peak VmHWM, when this script started the server
or got its --pid) and checks that /metrics returns to zero running sequences
and zero used KV blocks at the end (--no-metrics skips that for other
servers).

Standard library only. Either point it at a running server (any
OpenAI-compatible one) or let it start `areno serve`:

    python3 bench/serve/load.py --areno build/app/areno --clients 32 --duration 120
    python3 bench/serve/load.py --url http://127.0.0.1:8000 --clients 8 --duration 30

With --prompt-tokens N each request gets its own deterministic prompt of N
words drawn from a fixed list (about one token each; the mean prompt tokens the
server counted is reported), distinct per client and request, the same for
every server; without it the clients cycle through five short chat prompts.
With ignore_eos (the default; --no-ignore-eos turns it off) a request that
ends before max_tokens counts as failed. --warmup-requests N sends N requests
of 16 tokens at once (N clients, prompts apart from the measured ones) before
the clock starts.

With --disconnect-fraction F the first F of the clients close their
connection mid-stream (after a few content chunks) on every request, as
impatient users do; their requests are counted apart, and the others must
still all succeed without connection resets. The resident memory after the
warm-up (--warmup seconds) and until the deadline, less the KV pool's bytes
written so far (areno_kv_touched_bytes: the pool is committed as written), must
stay within --rss-tolerance of its first value (the drain after the deadline is
reported apart) (issue 13's soak: 128 clients, 10 minutes, a quarter disconnecting --
`ninja -C build bench-serve-soak`).

With --shared-prefix-tokens N every request starts with the same system
message of about N words (a shared prompt start, for the prefix cache), and
--n K asks for K samples per request (forked from one prompt prefill; the
usage's completion tokens then count all K). The report adds the server's
prefix-cache counters when it has them.

With --adapters K each client's requests go through one LoRA adapter, client
i's through adapter i mod K: named in the `model` field (`a0`, `a1`, ...: the
names of `areno serve --lora-modules a0=DIR ...`, as vLLM takes them), or with
--adapter-style llama as llama-server's per-request `lora` list (the j-th
`--lora` file at scale 1, the others at 0).

Exit status 0 only when no request failed, the metrics returned to zero and
the memory stayed flat.
"""
import argparse
import http.client
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

PROMPTS = [
    "Tell me a story about a lighthouse keeper.",
    "What is the capital of France? Answer briefly.",
    "Write a haiku about autumn leaves.",
    "Explain continuous batching in one paragraph.",
    "List three prime numbers and explain why they are prime.",
]


# Prompt words: common English words, one token each with their leading space
# in the o200k-style vocabularies (Phi-4's among them).
WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue side "
         "kind head house service friend father power hour game line end member law car city community name "
         "president team minute idea kid body information back parent face others level office door health person "
         "art war history party result change morning reason research girl guy moment air teacher force education").split()


def prompt_text(n_words, seed):
    """A deterministic prompt of n_words words, distinct for each seed."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(n_words)]
    return " ".join(words).capitalize() + "."


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100.0
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def metrics(base):
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(areno_[a-z_]+) ([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def rss_mb(pid, field="VmRSS"):
    """The process's resident memory (VmRSS) or its peak (VmHWM), in MB."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.ttft, self.itl = [], []
        self.tokens = 0
        self.prompt_tokens = []
        self.ok = 0
        self.failed = 0
        self.resets = 0
        self.disconnected = 0
        self.errors = []

    def add(self, ttft, gaps, tokens, prompt_tokens=None):
        with self.lock:
            self.ok += 1
            if ttft is not None:
                self.ttft.append(ttft)
            self.itl.extend(gaps)
            self.tokens += tokens
            if prompt_tokens is not None:
                self.prompt_tokens.append(prompt_tokens)

    def hung_up(self):
        with self.lock:
            self.disconnected += 1

    def fail(self, why, reset=False):
        with self.lock:
            self.failed += 1
            self.resets += reset
            if len(self.errors) < 10:
                self.errors.append(why)


def one_request(host, port, headers, body, stats, hang_up_after=0, path="/v1/chat/completions", timeout=600.0,
                expect_tokens=0):
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        t0 = time.perf_counter()
        conn.request("POST", path, body=body, headers=headers)
        r = conn.getresponse()
        if r.status != 200:
            stats.fail(f"HTTP {r.status}: {r.read()[:200]!r}")
            return
        first, last, gaps, tokens, chunks, prompt_tokens, done = None, None, [], None, 0, None, False
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            payload = line[6:]
            if payload == b"[DONE]":
                done = True
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                stats.fail(f"stream error: {chunk['error']}")
                return
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
                prompt_tokens = chunk["usage"].get("prompt_tokens")
            for ch in chunk.get("choices", []):
                if ch.get("text") or ch.get("delta", {}).get("content"):
                    chunks += 1
                    if hang_up_after and len(gaps) + 1 >= hang_up_after:
                        conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
                        stats.hung_up()
                        return
                    now = time.perf_counter()
                    if first is None:
                        first = now - t0
                    else:
                        gaps.append(now - last)
                    last = now
        if not done:
            stats.fail("stream ended without [DONE]")
            return
        if tokens is None:  # no usage chunk: count the chunks that carried text
            tokens = chunks
        if expect_tokens and tokens != expect_tokens:
            stats.fail(f"ignore_eos: {tokens} tokens generated, not max_tokens {expect_tokens}")
            return
        stats.add(first, gaps, tokens, prompt_tokens)
    except ConnectionResetError as e:
        stats.fail(f"connection reset: {e}", reset=True)
    except Exception as e:  # noqa: BLE001 - any failure counts
        stats.fail(f"{type(e).__name__}: {e}")
    finally:
        conn.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="", help="a running server (default: start one with --areno)")
    ap.add_argument("--areno", default="build/app/areno")
    ap.add_argument("--serve-args", default="", help="extra `areno serve` arguments, e.g. '--model-path DIR'")
    ap.add_argument("--api-key", default="")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=120.0, help="seconds")
    ap.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                    help="/v1/chat/completions (default) or /v1/completions")
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="a distinct deterministic prompt of about this many tokens per request (default: short prompts)")
    ap.add_argument("--shared-prefix-tokens", type=int, default=0,
                    help="a system message of about this many words, the same in every request")
    ap.add_argument("--n", type=int, default=1, help="samples per request (chat and completions `n`)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                    help="send ignore_eos (vLLM's extension: generate max_tokens past EOS; default on)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    ap.add_argument("--warmup-requests", type=int, default=0,
                    help="requests sent at once and waited for before the clock starts (not counted)")
    ap.add_argument("--pid", type=int, default=0, help="the server's process id (RSS) when --url is given")
    ap.add_argument("--no-metrics", action="store_true",
                    help="skip the check that areno's /metrics return to idle (other servers)")
    ap.add_argument("--disconnect-fraction", type=float, default=0.0,
                    help="this fraction of the clients hang up mid-stream on every request")
    ap.add_argument("--warmup", type=float, default=60.0, help="seconds before the memory must stay flat")
    ap.add_argument("--rss-tolerance", type=float, default=0.10, help="allowed RSS growth after the warm-up")
    ap.add_argument("--json", default="", help="write the report here as JSON")
    ap.add_argument("--adapters", type=int, default=0,
                    help="K > 0: client i's requests go through LoRA adapter i mod K (served LoRAs)")
    ap.add_argument("--adapter-style", choices=["model", "llama"], default="model",
                    help="how a request names its adapter: `model` A<j> (areno serve --lora-modules A<j>=DIR, "
                         "vLLM), or llama-server's per-request `lora` [{id j, scale 1}]")
    ap.add_argument("--adapter-prefix", default="a", help="the adapter names' prefix A for --adapter-style model")
    args = ap.parse_args()

    proc = None
    base = args.url.rstrip("/")
    if not base:
        port = free_port()
        cmd = [args.areno, "serve", "--port", str(port), "--max-running-prompts", str(max(args.clients, 1))]
        cmd += args.serve_args.split()
        if args.api_key:
            cmd += ["--api-key", args.api_key]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            if proc.poll() is not None:
                sys.exit(f"areno serve exited with {proc.returncode}")
            try:
                urllib.request.urlopen(base + "/health", timeout=2).read()
                break
            except OSError:
                if time.time() > deadline:
                    sys.exit("areno serve did not start")
                time.sleep(0.2)
    u = urllib.parse.urlparse(base)
    host, port = u.hostname, u.port or 80
    with urllib.request.urlopen(base + "/v1/models", timeout=10) as r:
        model = json.loads(r.read())["data"][0]["id"]
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = "Bearer " + args.api_key

    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    pid = proc.pid if proc else args.pid

    shared = prompt_text(args.shared_prefix_tokens, "shared") if args.shared_prefix_tokens > 0 else ""

    def request_body(prompt_seed, seed, max_tokens, client=0):
        if args.prompt_tokens > 0:
            text = prompt_text(args.prompt_tokens, prompt_seed)
        else:
            text = PROMPTS[prompt_seed % len(PROMPTS)]
        body = {"model": model, "max_tokens": max_tokens, "temperature": args.temperature, "seed": seed,
                "stream": True, "stream_options": {"include_usage": True}}
        if args.n > 1:
            body["n"] = args.n
        if args.adapters > 0:
            j = client % args.adapters
            if args.adapter_style == "model":
                body["model"] = f"{args.adapter_prefix}{j}"
            else:
                body["lora"] = [{"id": j, "scale": 1.0}]
        if args.ignore_eos:
            body["ignore_eos"] = True
        if args.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": text}]
            if shared:
                body["messages"].insert(0, {"role": "system", "content": shared})
        else:
            body["prompt"] = shared + "\n" + text if shared else text
        return json.dumps(body)

    if args.warmup_requests > 0:
        warm = Stats()
        ts = [threading.Thread(target=one_request, daemon=True,
                               args=(host, port, headers, request_body(f"warm-{i}", 10**9 + i, 16, i), warm, 0, path,
                                     args.timeout))
              for i in range(args.warmup_requests)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if warm.failed:
            sys.exit(f"warm-up: {warm.failed} of {args.warmup_requests} requests failed: {warm.errors[:3]}")

    stats = Stats()
    rss_start = rss_mb(pid) if pid else float("nan")
    rss_samples = []
    t_start = time.perf_counter()
    deadline = t_start + args.duration

    n_hangup = int(round(args.clients * args.disconnect_fraction))

    def client(i):
        k = 0
        hang_up_after = 3 + (i % 5) if i < n_hangup else 0
        while time.perf_counter() < deadline:
            prompt_seed = f"{i}-{k}" if args.prompt_tokens > 0 else i + k
            one_request(host, port, headers, request_body(prompt_seed, i * 1000 + k, args.max_tokens, i), stats,
                        hang_up_after, path, args.timeout, args.max_tokens * args.n if args.ignore_eos else 0)
            k += 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    rss_after_warmup = []
    kv_after_warmup = []  # MB of the KV pool written at least once, beside each RSS sample

    def kv_touched_mb():
        if args.no_metrics:
            return 0.0
        try:
            return metrics(base).get("areno_kv_touched_bytes", 0.0) / 2**20
        except OSError:
            return 0.0

    while any(t.is_alive() for t in threads):
        time.sleep(1.0)
        if pid:
            rss_samples.append(rss_mb(pid))
            # Flat under steady load: from the warm-up to the deadline (the
            # drain after it, as the batch shrinks to nothing, is reported apart).
            if args.warmup <= time.perf_counter() - t_start <= args.duration:
                rss_after_warmup.append(rss_samples[-1])
                kv_after_warmup.append(kv_touched_mb())
    elapsed = time.perf_counter() - t_start

    # The engine must return to idle with every KV block free.
    idle = None if args.no_metrics else False
    m = {}
    for _ in range(0 if args.no_metrics else 100):
        m = metrics(base)
        if (m.get("areno_requests_running", 1) == 0 and m.get("areno_requests_waiting", 1) == 0
                and m.get("areno_kv_blocks_used", 1) == 0):
            idle = True
            break
        time.sleep(0.1)
    rss_end = rss_mb(pid) if pid else float("nan")
    rss_peak = rss_mb(pid, "VmHWM") if pid else float("nan")

    report = {
        "clients": args.clients, "duration_s": round(elapsed, 2), "endpoint": path, "max_tokens": args.max_tokens,
        "ignore_eos": args.ignore_eos,
        "prompt_tokens_mean": round(statistics.mean(stats.prompt_tokens), 1) if stats.prompt_tokens else None,
        "requests_ok": stats.ok, "requests_failed": stats.failed, "connection_resets": stats.resets,
        "clients_hanging_up": n_hangup, "requests_hung_up": stats.disconnected,
        "generated_tokens": stats.tokens, "throughput_tok_s": round(stats.tokens / elapsed, 1),
        "ttft_p50_ms": round(1e3 * percentile(stats.ttft, 50), 1),
        "ttft_p99_ms": round(1e3 * percentile(stats.ttft, 99), 1),
        "itl_p50_ms": round(1e3 * percentile(stats.itl, 50), 2),
        "itl_p99_ms": round(1e3 * percentile(stats.itl, 99), 2),
        "metrics_idle_at_end": idle,
        "kv_blocks_used_end": m.get("areno_kv_blocks_used"), "running_end": m.get("areno_requests_running"),
        "shared_prefix_words": args.shared_prefix_tokens, "n": args.n, "adapters": args.adapters,
        "prefix_cache_hit_tokens": m.get("areno_prefix_cache_hits_total"),
        "prefix_cache_query_tokens": m.get("areno_prefix_cache_queries_total"),
        "kv_blocks_cached_end": m.get("areno_kv_blocks_cached"),
        "spec_draft_tokens": m.get("areno_spec_draft_tokens_total"),
        "spec_accepted_tokens": m.get("areno_spec_accepted_tokens_total"),
        "rss_mb_start": round(rss_start, 1), "rss_mb_end_after_drain": round(rss_end, 1),
        "rss_mb_max": round(max(rss_samples), 1) if rss_samples else float("nan"),
        "rss_mb_peak_hwm": round(rss_peak, 1),  # VmHWM: the process's peak since it started
        # RSS every ~10 s: flat after the warm-up means no growth under load.
        "rss_mb_trace": [round(x, 1) for x in rss_samples[::10]],
        "errors": stats.errors,
    }
    flat = True
    if rss_after_warmup:
        growth = max(rss_after_warmup) / rss_after_warmup[0] - 1
        report["rss_growth_after_warmup"] = round(growth, 4)
        # The KV pool is committed as its blocks are first written (the prefix
        # cache keeps freed blocks while fresh ones remain, so it fills over
        # minutes, bounded by --kv-cache-gb): what the pool added is not growth.
        other = [r - k for r, k in zip(rss_after_warmup, kv_after_warmup)]
        other_growth = max(other) / other[0] - 1
        report["kv_touched_mb_after_warmup"] = [round(kv_after_warmup[0], 1), round(kv_after_warmup[-1], 1)]
        report["rss_growth_after_warmup_less_kv"] = round(other_growth, 4)
        flat = other_growth <= args.rss_tolerance
    if proc:
        proc.send_signal(signal.SIGINT)
        try:
            report["server_exit_code"] = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            report["server_exit_code"] = None
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    ok = stats.failed == 0 and idle is not False and stats.ok > 0 and flat and report.get("server_exit_code", 0) == 0
    print("load test:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
