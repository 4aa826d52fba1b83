#!/usr/bin/env python3
"""Many concurrent SSE streams through `tandem router`: does every stream complete, how many
threads does the router use, how much latency does it add per token, and how much CPU does it
spend per token relayed.

Two back ends:
- `standin` (default): tandem_bench_router_standin (bench/router_standin.cc), a decode and
  prefill worker stand-in that streams each request's tokens on a fixed schedule and writes into
  each token's text when it was due and when it handed it to gRPC.
- `tiny`: a real `tandem prefill` and `tandem decode` of the `tiny` synthetic preset.

Measured per run (one router process, fresh):
- completed / failed streams (a stream fails on a non-200 answer, an error event, a stream that
  ends without [DONE], or fewer tokens than asked for);
- the router's thread count, /proc/PID/status Threads sampled every 50 ms (max);
- added latency per token (standin only): client receive time minus the time the stand-in
  handed the token to gRPC ("w" in its text), both CLOCK_REALTIME on this machine. It covers
  the gRPC hop, the router and its HTTP write, and the client's own event loop; it does not
  include the stand-in's lateness against its schedule, reported apart as schedule lag (w - s);
- router CPU seconds (utime + stime from /proc/PID/stat, whole run incl. connection set-up)
  per 1,000 tokens relayed.

usage: router_streams.py TANDEM [--standin BIN] [--backend standin|tiny] --streams N
         [--tokens T] [--interval-ms X] [--ramp-seconds R] [--json FILE]
         [--router-cpus LIST]   (the router's threads on these cores, e.g. 0-3, and the clients
                                 and back end on the others, so neither waits for the other)
"""
import argparse
import asyncio
import json
import multiprocessing
import os
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "disagg"))
import disagg_e2e_test as cluster  # noqa: E402

STAMP = re.compile(rb"s(\d+)w(\d+)")
USAGE = re.compile(rb'"completion_tokens":(\d+)')
CLK_TCK = os.sysconf("SC_CLK_TCK")


def raise_fd_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


def threads(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return 0


class ThreadSampler:
    def __init__(self, pid, period=0.05):
        self.pid, self.period, self.max, self.samples = pid, period, 0, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop.is_set():
            try:
                self.max = max(self.max, threads(self.pid))
                self.samples += 1
            except OSError:
                return
            self.stop.wait(self.period)

    def finish(self):
        self.stop.set()
        self.thread.join()
        return self.max


class Stats:
    def __init__(self):
        self.completed = self.failed = self.tokens = self.active = self.max_active = 0
        self.spans = []  # (start, end) of each completed stream, wall clock
        self.added_us = []
        self.lag_us = []
        self.errors = {}

    def fail(self, why):
        self.failed += 1
        self.errors[why] = self.errors.get(why, 0) + 1


async def one_stream(host, port, body, want_tokens, stats, timestamps):
    stats.active += 1
    stats.max_active = max(stats.max_active, stats.active)
    began = time.time()
    writer = None
    try:
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
        writer.write((f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
                     .encode() + body)
        status = await reader.readline()
        if b" 200 " not in status:
            return stats.fail(status.decode(errors="replace").strip()[:60] or "no answer")
        # The SSE events are scanned as bytes, not parsed (the client must stay cheap next to
        # the router): only complete events (up to the last blank line) are looked at.
        buffer = b""
        tokens = 0
        done = False
        while not done:
            data = await reader.read(1 << 16)
            if not data:
                break
            now_us = time.time_ns() // 1000
            buffer += data
            cut = buffer.rfind(b"\n\n")
            if cut < 0:
                continue
            events, buffer = buffer[:cut], buffer[cut + 2:]
            if b'"error"' in events:
                for line in events.split(b"\n"):
                    if line.startswith(b"data: {") and b'"error"' in line:
                        message = json.loads(line[6:]).get("error", {}).get("message", "")
                        return stats.fail("error event: " + re.sub(r"\d+", "N", message)[:100])
                return stats.fail("error event")
            if timestamps:
                for s, w in STAMP.findall(events):
                    tokens += 1
                    stats.added_us.append(now_us - int(w))
                    stats.lag_us.append(int(w) - int(s))
            else:
                for used in USAGE.findall(events):
                    tokens = int(used)
            done = b"data: [DONE]" in events
        if not done:
            return stats.fail("stream ended without [DONE]")
        if tokens != want_tokens:
            return stats.fail(f"{tokens} of {want_tokens} tokens")
        stats.tokens += tokens
        stats.completed += 1
        stats.spans.append((began, time.time()))
    except (OSError, asyncio.IncompleteReadError, ValueError) as e:
        stats.fail(type(e).__name__ + ": " + str(e)[:60])
    finally:
        stats.active -= 1
        if writer is not None:
            writer.close()


async def run_streams(url, n, tokens, ramp_seconds, timestamps, model, offset=0.0):
    host, port = url.split("//")[1].split(":")
    port = int(port)
    stats = Stats()
    body = json.dumps({"model": model, "prompt": "hello", "max_tokens": tokens, "stream": True,
                       "ignore_eos": True,
                       "stream_options": {"include_usage": True}}).encode()
    tasks = []
    start = time.perf_counter()
    for i in range(n):
        # Streams start spread over the ramp, so the listen backlog never overflows.
        delay = start + ramp_seconds * (i + offset) / n - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one_stream(host, port, body, tokens, stats, timestamps)))
    await asyncio.gather(*tasks)
    return stats, time.perf_counter() - start


def client_process(args):
    """One client process's share of the streams; returns its Stats, wall time and CPU."""
    url, n, tokens, ramp_seconds, timestamps, model, offset = args
    stats, wall = asyncio.run(run_streams(url, n, tokens, ramp_seconds, timestamps, model, offset))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return stats, wall, usage.ru_utime + usage.ru_stime


def max_overlap(spans):
    """The most streams open at one moment, over every client process."""
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    open_now = peak = 0
    for _, step in edges:
        open_now += step
        peak = max(peak, open_now)
    return peak


def percentile(values, p):
    if not values:
        return None
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(p / 100 * (len(values) - 1))))
    return values[k]


def scrape_histogram(url, name):
    """The cumulative buckets [(le, count)] of histogram `name` in a /metrics scrape."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    buckets = []
    for m in re.finditer(r'^' + name + r'_bucket\{le="([^"]+)"\} (\S+)$', text, re.M):
        buckets.append((float("inf") if m.group(1) == "+Inf" else float(m.group(1)),
                        float(m.group(2))))
    return sorted(buckets)


def bucket_quantile(buckets, q):
    """The upper bound of the bucket holding quantile q: the quantile is at most this."""
    total = buckets[-1][1] if buckets else 0
    for le, count in buckets:
        if total and count >= q * total:
            return le
    return None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("tandem")
    parser.add_argument("--standin", help="tandem_bench_router_standin binary")
    parser.add_argument("--backend", choices=["standin", "tiny"], default="standin")
    parser.add_argument("--streams", type=int, required=True)
    parser.add_argument("--tokens", type=int, default=20)
    parser.add_argument("--interval-ms", type=int, default=100)
    parser.add_argument("--ramp-seconds", type=float, default=5.0)
    parser.add_argument("--http-threads", type=int, default=2)
    parser.add_argument("--clients", type=int, default=2, help="client processes")
    parser.add_argument("--engine-flags",
                        help="tiny backend: flags for `tandem prefill` and `tandem decode` "
                             "(default: one engine thread, and --max-num-seqs, "
                             "--max-num-batched-tokens and --kv-cache-bytes sized so every "
                             "stream is in the decode worker's batch at every step)")
    parser.add_argument("--decode-extra", default="",
                        help="tiny backend: more flags for `tandem decode` only (e.g. "
                             "--step-delay-ms 200 to keep streams open longer)")
    parser.add_argument("--json")
    parser.add_argument("--router-cpus",
                        help="cores for the router (taskset list); everything else runs on the rest")
    args = parser.parse_args()
    if args.engine_flags is None:
        # Below --streams, --max-num-seqs or --max-num-batched-tokens (the per-step token budget,
        # one token a decoding stream) leave streams open but waiting for a later step. The tiny
        # preset's cache takes 256 bytes a token: 64 KiB a stream covers 256 tokens of context.
        seqs = max(256, args.streams)
        args.engine_flags = (f"--threads 1 --kv-cache-bytes {max(256 << 20, args.streams << 16)} "
                             f"--max-num-seqs {seqs} --max-num-batched-tokens {seqs}")
    fd_limit = raise_fd_limit()
    if fd_limit < args.streams + 1000:
        sys.exit(f"router_streams: the open-file limit ({fd_limit}) is too low for "
                 f"{args.streams} streams")
    router_cpus = None
    if args.router_cpus:
        router_cpus = set()
        for part in args.router_cpus.split(","):
            lo, _, hi = part.partition("-")
            router_cpus.update(range(int(lo), int(hi or lo) + 1))
        rest = os.sched_getaffinity(0) - router_cpus
        if not rest or not router_cpus <= os.sched_getaffinity(0):
            sys.exit(f"router_streams: --router-cpus {args.router_cpus} must leave cores for the "
                     f"rest among {sorted(os.sched_getaffinity(0))}")
        os.sched_setaffinity(0, rest)  # the clients and the back end inherit it
    cluster.TANDEM = args.tandem
    processes = []
    with tempfile.TemporaryDirectory() as tmp:
        cluster.MODEL = os.path.join(tmp, "tiny")
        subprocess.run([args.tandem, "synth-model", "--preset", "tiny", "--out", cluster.MODEL],
                       check=True, stdout=subprocess.DEVNULL)
        try:
            if args.backend == "standin":
                standin = subprocess.Popen([args.standin, "--port", "0", "--interval-ms",
                                            str(args.interval_ms)], stdout=subprocess.PIPE,
                                           text=True)
                processes.append(standin)
                address = re.search(r"listening on (\S+),", standin.stdout.readline()).group(1)
                prefill = decode = address
            else:
                cluster.ENGINE_FLAGS = args.engine_flags.split()
                p = cluster.start_worker("prefill")
                d = cluster.start_worker("decode", extra=args.decode_extra.split())
                processes += [p.proc, d.proc]
                prefill, decode = p.address, d.address
            router = cluster.start_router(
                prefill, decode,
                extra=["--max-active-requests", str(args.streams + 100),
                       "--http-threads", str(args.http_threads)])
            processes.append(router.proc)
            pid = router.proc.pid
            if router_cpus:
                # Every thread the router has, and so every one it starts later.
                subprocess.run(["taskset", "-a", "-cp", args.router_cpus, str(pid)], check=True,
                               stdout=subprocess.DEVNULL)
            threads_idle = threads(pid)
            cpu_before = cpu_seconds(pid)
            sampler = ThreadSampler(pid)
            decode_sampler = ThreadSampler(d.proc.pid) if args.backend == "tiny" else None
            # Client processes share the streams (each an asyncio loop); their start times
            # interleave over the one ramp.
            k = args.clients
            shares = [(router.url, args.streams // k + (1 if i < args.streams % k else 0),
                       args.tokens, args.ramp_seconds, args.backend == "standin", "tiny", i / k)
                      for i in range(k)]
            with multiprocessing.Pool(k) as pool:
                parts = pool.map(client_process, shares)
            stats = Stats()
            for part, _, _ in parts:
                for name in ("completed", "failed", "tokens"):
                    setattr(stats, name, getattr(stats, name) + getattr(part, name))
                stats.spans += part.spans
                stats.added_us += part.added_us
                stats.lag_us += part.lag_us
                for why, count in part.errors.items():
                    stats.errors[why] = stats.errors.get(why, 0) + count
            wall = max(w for _, w, _ in parts)
            client_cpu = sum(c for _, _, c in parts)
            # What the router adds, measured inside it: from a token's output reaching its API
            # server (off the decode worker's stream) to its chunk in the client's socket.
            write_buckets = scrape_histogram(router.url, "tandem_stream_write_seconds")
            max_threads = sampler.finish()
            decode_threads = decode_sampler.finish() if decode_sampler else None
            cpu = cpu_seconds(pid) - cpu_before
        finally:
            for proc in reversed(processes):
                if proc.poll() is None:
                    proc.terminate()
                    try:
                        proc.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        proc.kill()
    cores = os.cpu_count()
    result = {
        "backend": args.backend, "streams": args.streams, "tokens_per_stream": args.tokens,
        "interval_ms": args.interval_ms if args.backend == "standin" else None,
        "completed": stats.completed, "failed": stats.failed, "errors": stats.errors,
        "max_concurrent_streams": max_overlap(stats.spans), "wall_seconds": round(wall, 2),
        "client_processes": args.clients, "client_cpu_seconds": round(client_cpu, 2),
        "router_cpus": args.router_cpus,
        "router_threads_idle": threads_idle, "router_threads_max": max_threads,
        "thread_budget": 4 * cores + 16, "cores": cores,
        "decode_worker_threads_max": decode_threads,
        "tokens_relayed": stats.tokens,
        "router_cpu_seconds": round(cpu, 2),
        "router_cpu_seconds_per_1000_tokens":
            round(1000 * cpu / stats.tokens, 4) if stats.tokens else None,
    }
    if write_buckets and write_buckets[-1][1] > 0:
        total = write_buckets[-1][1]
        within = dict(write_buckets).get(0.0002, 0)
        result.update({
            "router_write_outputs": int(total),
            "router_write_ms_p50_at_most": bucket_quantile(write_buckets, 0.5) * 1000,
            "router_write_ms_p99_at_most": bucket_quantile(write_buckets, 0.99) * 1000,
            "router_write_share_within_0_2_ms": round(within / total, 4),
        })
    if stats.added_us:
        result.update({
            "added_latency_ms_p50": percentile(stats.added_us, 50) / 1000,
            "added_latency_ms_p99": percentile(stats.added_us, 99) / 1000,
            "added_latency_ms_max": max(stats.added_us) / 1000,
            "schedule_lag_ms_p50": percentile(stats.lag_us, 50) / 1000,
            "schedule_lag_ms_p99": percentile(stats.lag_us, 99) / 1000,
        })
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if stats.failed == 0 and stats.completed == args.streams else 1


if __name__ == "__main__":
    sys.exit(main())
