#!/usr/bin/env python3
"""Load generator for `areno serve` (issue 7, must show 5; benchmarks).

N concurrent clients each send streaming chat completions back to back for a
duration. Reports throughput (generated tokens/s), time to first token and
inter-token latency (p50/p99), failed requests, the server's memory (RSS at
start and end, when this script started the server) and checks that /metrics
returns to zero running sequences and zero used KV blocks at the end.

Standard library only. Either point it at a running server or let it start one:

    python3 bench/serve/load.py --areno build/app/areno --clients 32 --duration 120
    python3 bench/serve/load.py --url http://127.0.0.1:8000 --clients 8 --duration 30

With --disconnect-fraction F the first F of the clients close their
connection mid-stream (after a few content chunks) on every request, as
impatient users do; their requests are counted apart, and the others must
still all succeed without connection resets. The resident memory after the
warm-up (--warmup seconds) and until the deadline must stay within
--rss-tolerance of its first value (the drain after the deadline is reported
apart) (issue 13's soak: 128 clients, 10 minutes, a quarter disconnecting --
`ninja -C build bench-serve-soak`).

Exit status 0 only when no request failed, the metrics returned to zero and
the memory stayed flat.
"""
import argparse
import http.client
import json
import os
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


def rss_mb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.ttft, self.itl = [], []
        self.tokens = 0
        self.ok = 0
        self.failed = 0
        self.resets = 0
        self.disconnected = 0
        self.errors = []

    def add(self, ttft, gaps, tokens):
        with self.lock:
            self.ok += 1
            if ttft is not None:
                self.ttft.append(ttft)
            self.itl.extend(gaps)
            self.tokens += tokens

    def hung_up(self):
        with self.lock:
            self.disconnected += 1

    def fail(self, why, reset=False):
        with self.lock:
            self.failed += 1
            self.resets += reset
            if len(self.errors) < 10:
                self.errors.append(why)


def one_request(host, port, headers, body, stats, hang_up_after=0):
    conn = http.client.HTTPConnection(host, port, timeout=120)
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
        r = conn.getresponse()
        if r.status != 200:
            stats.fail(f"HTTP {r.status}: {r.read()[:200]!r}")
            return
        first, last, gaps, tokens, done = None, None, [], 0, False
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
            for ch in chunk.get("choices", []):
                if ch.get("delta", {}).get("content"):
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
        stats.add(first, gaps, tokens)
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
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--disconnect-fraction", type=float, default=0.0,
                    help="this fraction of the clients hang up mid-stream on every request")
    ap.add_argument("--warmup", type=float, default=60.0, help="seconds before the memory must stay flat")
    ap.add_argument("--rss-tolerance", type=float, default=0.10, help="allowed RSS growth after the warm-up")
    ap.add_argument("--json", default="", help="write the report here as JSON")
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

    stats = Stats()
    rss_start = rss_mb(proc.pid) if proc else float("nan")
    rss_samples = []
    t_start = time.perf_counter()
    deadline = t_start + args.duration

    n_hangup = int(round(args.clients * args.disconnect_fraction))

    def client(i):
        k = 0
        hang_up_after = 3 + (i % 5) if i < n_hangup else 0
        while time.perf_counter() < deadline:
            body = json.dumps({
                "model": model,
                "messages": [{"role": "user", "content": PROMPTS[(i + k) % len(PROMPTS)]}],
                "max_tokens": args.max_tokens, "temperature": args.temperature, "seed": i * 1000 + k,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
            one_request(host, port, headers, body, stats, hang_up_after)
            k += 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    rss_after_warmup = []
    while any(t.is_alive() for t in threads):
        time.sleep(1.0)
        if proc:
            rss_samples.append(rss_mb(proc.pid))
            # Flat under steady load: from the warm-up to the deadline (the
            # drain after it, as the batch shrinks to nothing, is reported apart).
            if args.warmup <= time.perf_counter() - t_start <= args.duration:
                rss_after_warmup.append(rss_samples[-1])
    elapsed = time.perf_counter() - t_start

    # The engine must return to idle with every KV block free.
    idle = False
    m = {}
    for _ in range(100):
        m = metrics(base)
        if (m.get("areno_requests_running", 1) == 0 and m.get("areno_requests_waiting", 1) == 0
                and m.get("areno_kv_blocks_used", 1) == 0):
            idle = True
            break
        time.sleep(0.1)
    rss_end = rss_mb(proc.pid) if proc else float("nan")

    report = {
        "clients": args.clients, "duration_s": round(elapsed, 2), "max_tokens": args.max_tokens,
        "requests_ok": stats.ok, "requests_failed": stats.failed, "connection_resets": stats.resets,
        "clients_hanging_up": n_hangup, "requests_hung_up": stats.disconnected,
        "generated_tokens": stats.tokens, "throughput_tok_s": round(stats.tokens / elapsed, 1),
        "ttft_p50_ms": round(1e3 * percentile(stats.ttft, 50), 1),
        "ttft_p99_ms": round(1e3 * percentile(stats.ttft, 99), 1),
        "itl_p50_ms": round(1e3 * percentile(stats.itl, 50), 2),
        "itl_p99_ms": round(1e3 * percentile(stats.itl, 99), 2),
        "metrics_idle_at_end": idle,
        "kv_blocks_used_end": m.get("areno_kv_blocks_used"), "running_end": m.get("areno_requests_running"),
        "rss_mb_start": round(rss_start, 1), "rss_mb_end_after_drain": round(rss_end, 1),
        "rss_mb_max": round(max(rss_samples), 1) if rss_samples else float("nan"),
        # RSS every ~10 s: flat after the warm-up means no growth under load.
        "rss_mb_trace": [round(x, 1) for x in rss_samples[::10]],
        "errors": stats.errors,
    }
    flat = True
    if rss_after_warmup:
        growth = max(rss_after_warmup) / rss_after_warmup[0] - 1
        report["rss_growth_after_warmup"] = round(growth, 4)
        flat = growth <= args.rss_tolerance
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
    ok = stats.failed == 0 and idle and stats.ok > 0 and flat and report.get("server_exit_code", 0) == 0
    print("load test:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
