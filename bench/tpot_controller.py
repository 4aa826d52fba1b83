#!/usr/bin/env python3
"""TPOT with and without the decode worker's SLO controller, at one load.

Runs `tandem serve` (disaggregated: router, prefill and decode worker in one process, KV over
UCX on loopback) twice with the same engine flags, once with a fixed running batch of
--max-num-seqs and once with `--tpot-slo TARGET` (the decode worker then caps its running batch
at the largest size whose predicted step time fits the target, and refuses reservations beyond
it, so excess requests wait before their prefill). Each time it drives the same `tandem bench`
workload (Poisson arrivals, fixed prompt and output lengths) and reports TPOT percentiles,
TTFT, throughput and goodput (requests meeting both --ttft-slo and the TPOT target).

usage: bench/tpot_controller.py --tandem build/bin/tandem [--tpot-slo 0.04] [--ttft-slo 5]
          [--max-num-seqs 64] [--threads 1] [--request-rate 8] [--num-requests 80]
          [--input-len 16] [--output-len 128] [--json out.json]
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading


def start_serve(tandem, flags):
    proc = subprocess.Popen([tandem, "serve", "--port", "0"] + flags, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, UCX_LOG_LEVEL="error"))
    for line in proc.stdout:
        m = re.search(r"serving (\S+) on (http://\S+)", line)
        if m:
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, m.group(1), m.group(2)
    raise RuntimeError("tandem serve did not start")


def percentile(report, metric, p):
    """Reads report[...] for `metric` (ttft, tpot, ...) at percentile p, in ms."""
    for key in (f"{metric}_ms", metric):
        if isinstance(report.get(key), dict):
            d = report[key]
            for k in (f"p{p}", f"p{p}_ms", str(p)):
                if k in d:
                    return d[k]
    raise KeyError(f"{metric} p{p} not in report: {sorted(report)}")


def run(args, label, extra):
    engine = ["--max-num-seqs", str(args.max_num_seqs), "--threads", str(args.threads)]
    proc, model, url = start_serve(args.tandem, engine + extra)
    try:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            cmd = [args.tandem, "bench", "--url", url, "--model", model, "--no-progress",
                   "--num-requests", str(args.num_requests), "--request-rate",
                   str(args.request_rate), "--input-len", str(args.input_len), "--output-len",
                   str(args.output_len), "--ttft-slo", str(args.ttft_slo), "--tpot-slo",
                   str(args.tpot_slo), "--seed", "1", "--json", out.name]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            report = json.load(open(out.name))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    report["label"] = label
    report["serve_flags"] = engine + extra
    return report


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tandem", default="build/bin/tandem")
    ap.add_argument("--tpot-slo", type=float, default=0.04)
    ap.add_argument("--ttft-slo", type=float, default=5.0)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--request-rate", type=float, default=8)
    ap.add_argument("--num-requests", type=int, default=80)
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--json")
    args = ap.parse_args()

    runs = [run(args, f"fixed batch {args.max_num_seqs}", []),
            run(args, f"--tpot-slo {args.tpot_slo}", ["--tpot-slo", str(args.tpot_slo)])]
    print(f"TPOT target {args.tpot_slo * 1000:.0f} ms, TTFT target {args.ttft_slo:.1f} s; "
          f"{args.num_requests} requests at {args.request_rate}/s, prompt {args.input_len} "
          f"words, {args.output_len} output tokens")
    print("| run | TPOT p50 ms | TPOT p90 ms | TPOT p99 ms | TTFT p50 ms | TTFT p90 ms | "
          "succeeded | throughput req/s | goodput req/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['label']} | {percentile(r, 'tpot', 50):.1f} | {percentile(r, 'tpot', 90):.1f} | "
              f"{percentile(r, 'tpot', 99):.1f} | {percentile(r, 'ttft', 50):.0f} | "
              f"{percentile(r, 'ttft', 90):.0f} | {r['requests_succeeded']}/{r['requests_sent']} | "
              f"{r['request_throughput']:.2f} | {r['slo']['goodput']:.2f} |")
    ok = percentile(runs[1], "tpot", 90) <= args.tpot_slo * 1000 < percentile(runs[0], "tpot", 90)
    print("controller holds TPOT p90 under the target where the fixed batch breaks it:",
          "yes" if ok else "no")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
