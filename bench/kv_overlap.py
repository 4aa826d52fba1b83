#!/usr/bin/env python3
"""How much of the KV transfer the prefill worker hides behind its own compute.

Starts `tandem decode`, `tandem prefill` and `tandem router` as processes (KV over UCX on
loopback), sends prompts of each length one at a time, and reads the prefill worker's counters
(tandem_kv_transfer_bytes_total, _seconds_total, _exposed_seconds_total) before and after each
length. In the same run it measures a raw TCP loopback stream of the same bytes, the ceiling a
TCP transport could reach here.

  hidden share  = 1 - exposed / transfer   (exposed: time between the end of the prefill and
                                            the last page landing at the decode worker)

usage: bench/kv_overlap.py --tandem build/bin/tandem [--preset small] [--lengths 512,1024,2048]
                           [--requests 4] [--json out.json]
"""
import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request


def start(tandem, args, pattern):
    proc = subprocess.Popen([tandem] + args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=dict(os.environ, UCX_LOG_LEVEL="error"))
    for line in proc.stdout:
        m = re.search(pattern, line)
        if m:
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, m
    raise RuntimeError(f"{args[0]} did not start")


def counters(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    out = {}
    for name in ("bytes", "seconds", "exposed_seconds"):
        m = re.search(rf"^tandem_kv_transfer_{name}_total (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def raw_tcp_gbps(total_bytes, chunk=1 << 20):
    """One loopback TCP stream of total_bytes, in GB/s (1e9 bytes per second)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    received = [0]

    def sink():
        conn, _ = server.accept()
        buf = bytearray(chunk)
        while True:
            n = conn.recv_into(buf)
            if n == 0:
                break
            received[0] += n
        conn.close()

    t = threading.Thread(target=sink)
    t.start()
    payload = b"\0" * chunk
    client = socket.create_connection(("127.0.0.1", port))
    begin = time.perf_counter()
    sent = 0
    while sent < total_bytes:
        client.sendall(payload)
        sent += chunk
    client.shutdown(socket.SHUT_WR)
    t.join()
    elapsed = time.perf_counter() - begin
    client.close()
    server.close()
    return received[0] / elapsed / 1e9


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tandem", required=True)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--lengths", default="512,1024,2048")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=512, help="max-num-batched-tokens")
    parser.add_argument("--json")
    a = parser.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, a.preset)
        subprocess.run([a.tandem, "synth-model", "--preset", a.preset, "--out", model],
                       check=True, stdout=subprocess.DEVNULL)
        engine = ["--model", model, "--max-num-batched-tokens", str(a.chunk),
                  "--kv-cache-bytes", str(1 << 30)]
        procs = []
        try:
            decode, d = start(a.tandem, ["decode", "--listen", "127.0.0.1:0", "--metrics-listen",
                                         "127.0.0.1:0"] + engine,
                              r"listening on (\S+) \(metrics on port (\d+)\)")
            procs.append(decode)
            prefill, p = start(a.tandem, ["prefill", "--listen", "127.0.0.1:0",
                                          "--metrics-listen", "127.0.0.1:0"] + engine,
                               r"listening on (\S+) \(metrics on port (\d+)\)")
            procs.append(prefill)
            router, r = start(a.tandem, ["router", "--model", model, "--prefill", p.group(1),
                                         "--decode", d.group(1), "--port", "0"],
                              r"on (http://\S+:\d+)")
            procs.append(router)
            metrics = f"http://127.0.0.1:{p.group(2)}/metrics"
            url = r.group(1) + "/v1/completions"
            rows = []
            for length in lengths:
                before = counters(metrics)
                begin = time.perf_counter()
                for i in range(a.requests):
                    prompt = [(7 * j + 13 * i) % 1000 + 5 for j in range(length)]
                    body = json.dumps({"model": a.preset, "prompt": prompt, "max_tokens": 1,
                                       "temperature": 0}).encode()
                    req = urllib.request.Request(url, data=body,
                                                 headers={"Content-Type": "application/json"})
                    with urllib.request.urlopen(req, timeout=600) as resp:
                        json.load(resp)
                wall = time.perf_counter() - begin
                after = counters(metrics)
                d_bytes = after["bytes"] - before["bytes"]
                d_sec = after["seconds"] - before["seconds"]
                d_exp = after["exposed_seconds"] - before["exposed_seconds"]
                rows.append({
                    "prompt_tokens": length,
                    "requests": a.requests,
                    "kv_bytes_per_request": d_bytes / a.requests,
                    "transfer_seconds_per_request": d_sec / a.requests,
                    "exposed_seconds_per_request": d_exp / a.requests,
                    "hidden_share": 1 - d_exp / d_sec if d_sec > 0 else None,
                    "wall_seconds_per_request": wall / a.requests,
                })
            total = int(max(row["kv_bytes_per_request"] for row in rows))
            tcp = raw_tcp_gbps(max(total, 64 << 20))
        finally:
            for proc in reversed(procs):
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)

    print(f"raw TCP loopback, one stream, same run: {tcp:.2f} GB/s")
    print("prompt  KV MB/req  transfer ms  exposed ms  hidden   wall ms/req")
    for row in rows:
        print(f"{row['prompt_tokens']:6d}  {row['kv_bytes_per_request'] / 1e6:9.1f}  "
              f"{row['transfer_seconds_per_request'] * 1e3:11.1f}  "
              f"{row['exposed_seconds_per_request'] * 1e3:10.3f}  {row['hidden_share']:7.2%}  "
              f"{row['wall_seconds_per_request'] * 1e3:11.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"raw_tcp_gbps": tcp, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
