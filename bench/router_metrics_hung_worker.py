#!/usr/bin/env python3
"""How long a scrape of the router's /metrics takes while one of its listed decode workers is
hung (SIGSTOP: its port still accepts connections, nothing answers), against the same router
with every worker answering, measured in the same run.

usage: router_metrics_hung_worker.py TANDEM_BINARY [--scrapes N] [--json FILE]
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "disagg"))
import disagg_e2e_test as cluster  # noqa: E402


def scrape_seconds(url, n):
    times = []
    for _ in range(n):
        start = time.perf_counter()
        with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
            r.read()
        times.append(time.perf_counter() - start)
        time.sleep(0.02)
    return sorted(times)


def percentile(sorted_values, p):
    k = min(len(sorted_values) - 1, max(0, round(p / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


def summary(times):
    return {"p50_ms": 1000 * percentile(times, 50), "p99_ms": 1000 * percentile(times, 99),
            "max_ms": 1000 * times[-1]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("tandem")
    parser.add_argument("--scrapes", type=int, default=200)
    parser.add_argument("--json")
    args = parser.parse_args()
    cluster.TANDEM = args.tandem
    with tempfile.TemporaryDirectory() as tmp:
        cluster.MODEL = os.path.join(tmp, "tiny")
        subprocess.run([args.tandem, "synth-model", "--preset", "tiny", "--out", cluster.MODEL],
                       check=True, stdout=subprocess.DEVNULL)
        prefill = cluster.start_worker("prefill")
        decodes = [cluster.start_worker("decode") for _ in range(2)]
        router = cluster.start_router(prefill.address, ",".join(d.address for d in decodes))
        try:
            cluster.post(router.url, {"model": "tiny", "prompt": "warm up", "max_tokens": 4})
            healthy = scrape_seconds(router.url, args.scrapes)
            decodes[1].proc.send_signal(signal.SIGSTOP)
            time.sleep(2)  # let the poller's round with the hung worker begin
            hung = scrape_seconds(router.url, args.scrapes)
            decodes[1].proc.send_signal(signal.SIGCONT)
        finally:
            for p in [router, prefill] + decodes:
                p.stop()
    result = {"scrapes": args.scrapes, "all_workers_answering": summary(healthy),
              "one_decode_worker_hung": summary(hung)}
    result["p99_ratio_hung_vs_healthy"] = (result["one_decode_worker_hung"]["p99_ms"] /
                                           result["all_workers_answering"]["p99_ms"])
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
