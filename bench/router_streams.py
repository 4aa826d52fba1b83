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
"""
import argparse
import asyncio
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "disagg"))
import disagg_e2e_test as cluster  # noqa: E402

STAMP = re.compile(r"s(\d+)w(\d+)")
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
        self.added_us = []
        self.lag_us = []
        self.errors = {}

    def fail(self, why):
        self.failed += 1
        self.errors[why] = self.errors.get(why, 0) + 1


async def one_stream(host, port, body, want_tokens, stats, timestamps):
    stats.active += 1
    stats.max_active = max(stats.max_active, stats.active)
    writer = None
    try:
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
        writer.write((f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
                     .encode() + body)
        status = await reader.readline()
        if b" 200 " not in status:
            return stats.fail(status.decode(errors="replace").strip()[:60] or "no answer")
        chunked = False
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b""):
                break
            if line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower():
                chunked = True
        buffer = b""
        tokens = 0
        done = False
        while not done:
            if chunked:
                size_line = await reader.readline()
                if not size_line:
                    break
                size = int(size_line.strip() or b"0", 16)
                if size == 0:
                    break
                data = await reader.readexactly(size + 2)
                data = data[:-2]
            else:
                data = await reader.read(65536)
                if not data:
                    break
            now_us = time.time_ns() // 1000
            buffer += data
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                if not event.startswith(b"data: "):
                    continue
                payload = event[6:]
                if payload == b"[DONE]":
                    done = True
                    break
                message = json.loads(payload)
                if "error" in message:
                    return stats.fail("error event: " + str(message["error"].get("message"))[:60])
                for choice in message.get("choices", []):
                    for s, w in STAMP.findall(choice.get("text", "")):
                        tokens += 1
                        if timestamps:
                            stats.added_us.append(now_us - int(w))
                            stats.lag_us.append(int(w) - int(s))
                usage = message.get("usage")
                if usage and not timestamps:
                    tokens = usage.get("completion_tokens", tokens)
        if not done:
            return stats.fail("stream ended without [DONE]")
        if tokens != want_tokens:
            return stats.fail(f"{tokens} of {want_tokens} tokens")
        stats.tokens += tokens
        stats.completed += 1
    except (OSError, asyncio.IncompleteReadError, ValueError) as e:
        stats.fail(type(e).__name__ + ": " + str(e)[:60])
    finally:
        stats.active -= 1
        if writer is not None:
            writer.close()


async def run_streams(url, n, tokens, ramp_seconds, timestamps, model):
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
        delay = start + ramp_seconds * i / n - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one_stream(host, port, body, tokens, stats, timestamps)))
    await asyncio.gather(*tasks)
    return stats, time.perf_counter() - start


def percentile(values, p):
    if not values:
        return None
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(p / 100 * (len(values) - 1))))
    return values[k]


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
    parser.add_argument("--decode-flags", default="", help="extra flags for `tandem decode`")
    parser.add_argument("--json")
    args = parser.parse_args()
    fd_limit = raise_fd_limit()
    if fd_limit < args.streams + 1000:
        sys.exit(f"router_streams: the open-file limit ({fd_limit}) is too low for "
                 f"{args.streams} streams")
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
                p = cluster.start_worker("prefill")
                d = cluster.start_worker("decode", extra=args.decode_flags.split())
                processes += [p.proc, d.proc]
                prefill, decode = p.address, d.address
            router = cluster.start_router(
                prefill, decode,
                extra=["--max-active-requests", str(args.streams + 100),
                       "--http-threads", str(args.http_threads)])
            processes.append(router.proc)
            pid = router.proc.pid
            threads_idle = threads(pid)
            cpu_before = cpu_seconds(pid)
            sampler = ThreadSampler(pid)
            stats, wall = asyncio.run(run_streams(router.url, args.streams, args.tokens,
                                                  args.ramp_seconds, args.backend == "standin",
                                                  "tiny"))
            max_threads = sampler.finish()
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
        "client_max_concurrent": stats.max_active, "wall_seconds": round(wall, 2),
        "router_threads_idle": threads_idle, "router_threads_max": max_threads,
        "thread_budget": 4 * cores + 16, "cores": cores,
        "tokens_relayed": stats.tokens,
        "router_cpu_seconds": round(cpu, 2),
        "router_cpu_seconds_per_1000_tokens":
            round(1000 * cpu / stats.tokens, 4) if stats.tokens else None,
    }
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
