#!/usr/bin/env python3
"""End-to-end test of `tandem bench` against `tandem serve` with a tiny synthetic model.

usage: bench_e2e_test.py TANDEM_BINARY
"""
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import urllib.request


def check(cond, message):
    if not cond:
        print("FAIL:", message, file=sys.stderr)
        sys.exit(1)


def main():
    tandem = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "tiny")
        subprocess.run([tandem, "synth-model", "--preset", "tiny", "--out", model_dir],
                       check=True, stdout=subprocess.DEVNULL)
        server = subprocess.Popen([tandem, "serve", "--model", model_dir, "--port", "0"],
                                  stdout=subprocess.PIPE, text=True)
        try:
            url = None
            for line in server.stdout:
                m = re.search(r"serving \S+ on (http://127\.0\.0\.1:\d+)", line)
                if m:
                    url = m.group(1)
                    break
            check(url is not None, "server did not print its URL")
            with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
                name = json.load(r)["data"][0]["id"]

            out = os.path.join(tmp, "out.json")
            run = subprocess.run([tandem, "bench", "--url", url, "--model", name,
                                  "--num-requests", "20", "--input-len", "16", "--output-len", "8",
                                  "--request-rate", "50", "--json", out],
                                 capture_output=True, text=True, timeout=120)
            print(run.stdout)
            check(run.returncode == 0, f"bench exited {run.returncode}: {run.stderr}")
            with open(out) as f:
                report = json.load(f)
            check(report["requests_sent"] == 20, "requests_sent")
            check(report["requests_succeeded"] == 20, f"succeeded: {report['requests_succeeded']}")
            check(report["requests_failed"] == 0, "requests_failed")
            check(report["output_tokens"] == 160, f"output_tokens: {report['output_tokens']}")
            check(len(report["requests"]) == 20, "per-request records")
            for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
                m = report[metric]
                check(m["p50"] <= m["p90"] <= m["p99"], f"{metric} percentiles out of order: {m}")
            for r in report["requests"]:
                check(r["success"] and r["output_tokens"] == 8, f"record: {r}")
                check(0 < r["ttft_ms"] <= r["e2e_ms"], f"ttft > e2e: {r}")
            check(report["ttft_ms"]["p99"] <= report["e2e_ms"]["p99"] + 1e-9, "ttft p99 > e2e p99")
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()

    # Nothing listening: non-zero exit with exactly one line on stderr.
    run = subprocess.run([tandem, "bench", "--url", "http://127.0.0.1:1", "--model", "x",
                          "--num-requests", "3", "--input-len", "4", "--output-len", "4"],
                         capture_output=True, text=True, timeout=60)
    check(run.returncode != 0, "bench against a closed port exited 0")
    lines = run.stderr.strip().splitlines()
    check(len(lines) == 1 and "tandem bench" in lines[0], f"stderr: {run.stderr!r}")
    check(run.stdout == "", f"stdout: {run.stdout!r}")
    print("ok")


if __name__ == "__main__":
    main()
