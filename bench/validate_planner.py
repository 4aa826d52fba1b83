#!/usr/bin/env python3
"""Validates `tandem plan simulate` against real runs on this machine.

Calibrates the step-time model on the CPU with the synthetic `small` model (`tandem plan
calibrate`), then for each arrival rate runs `tandem bench` against `tandem serve` (colocated,
and/or disaggregated) and replays the very same requests (send times, prompt and output tokens
from the bench report) through the simulator with the measured calibration. Prints predicted
against measured TTFT and TPOT p50/p90 with relative errors, and writes everything as JSON.

  bench/validate_planner.py --tandem build/bin/tandem --rates 1,2,4 --json out.json
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time


def run(cmd, **kw):
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, **kw)


def start_server(tandem, model, mode, threads):
    cmd = [tandem, "serve", "--model", model, "--port", "0", "--threads", str(threads)]
    if mode == "colocated":
        cmd.append("--colocated")
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        m = re.search(r"serving (\S+) on (http://\S+)", line)
        if m:
            return proc, m.group(1), m.group(2)
    proc.kill()
    raise RuntimeError(f"serve ({mode}) did not start")


def rel(pred, meas):
    return (pred - meas) / meas if meas else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tandem", default="build/bin/tandem")
    ap.add_argument("--workdir", default=None, help="model, calibration and reports (default: tmp)")
    ap.add_argument("--calibration", default=None, help="reuse this calibration file")
    ap.add_argument("--calibrate-reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="engine threads, the same for calibration and serving (default 1: "
                         "spinning thread pools degrade badly on an oversubscribed machine)")
    ap.add_argument("--modes", default="colocated", help="colocated,disagg")
    ap.add_argument("--rates", default="1,2,4")
    ap.add_argument("--num-requests", type=int, default=40)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--overhead-ms", type=float, default=0.0)
    ap.add_argument("--kv-link-gbps", type=float, default=2.0,
                    help="loopback KV bandwidth assumed for the disaggregated simulation")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    work = args.workdir or tempfile.mkdtemp(prefix="tandem-plan-")
    os.makedirs(work, exist_ok=True)
    model = os.path.join(work, "small")
    if not os.path.exists(os.path.join(model, "config.json")):
        run([args.tandem, "synth-model", "--preset", "small", "--out", model],
            stdout=subprocess.DEVNULL)
    cal = args.calibration or os.path.join(work, "calibration.json")
    if not args.calibration:
        run([args.tandem, "plan", "calibrate", "--model", model, "--out", cal,
             "--reps", str(args.calibrate_reps), "--threads", str(args.threads),
             "--max-context", "256"])

    rows = []
    for mode in args.modes.split(","):
        proc, name, url = start_server(args.tandem, model, mode, args.threads)
        try:
            for rate in args.rates.split(","):
                bench_json = os.path.join(work, f"bench-{mode}-{rate}.json")
                run([args.tandem, "bench", "--url", url, "--model", name, "--num-requests",
                     str(args.num_requests), "--request-rate", rate, "--input-len",
                     str(args.input_len), "--output-len", str(args.output_len), "--seed",
                     str(args.seed), "--no-progress", "--json", bench_json],
                    stdout=subprocess.DEVNULL)
                sim_json = os.path.join(work, f"sim-{mode}-{rate}.json")
                sim = [args.tandem, "plan", "simulate", "--model", model, "--calibration", cal,
                       "--config", "colocated" if mode == "colocated" else "disagg",
                       "--trace", bench_json, "--overhead-ms", str(args.overhead_ms),
                       "--json", sim_json]
                if mode != "colocated":
                    sim += ["--kv-link-gbps", str(args.kv_link_gbps)]
                run(sim, stdout=subprocess.DEVNULL)
                with open(bench_json) as f:
                    measured = json.load(f)
                with open(sim_json) as f:
                    predicted = json.load(f)
                row = {"mode": mode, "rate": float(rate),
                       "requests": measured["requests_succeeded"],
                       "failed": measured["requests_failed"]}
                for metric in ("ttft_ms", "tpot_ms"):
                    for q in ("p50", "p90"):
                        m, p = measured[metric][q], predicted[metric][q]
                        row[f"{metric[:4]}_{q}"] = {"measured": m, "predicted": p,
                                                    "error": rel(p, m)}
                rows.append(row)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()

    header = (f"{'mode':10} {'rate':>5} | " +
              " | ".join(f"{k:>26}" for k in ("TTFT p50 ms", "TTFT p90 ms", "TPOT p50 ms",
                                               "TPOT p90 ms")))
    print(header)
    print(f"{'':10} {'':>5} | " + " | ".join(f"{'meas   pred   err':>26}" for _ in range(4)))
    worst = 0.0
    for r in rows:
        cells = []
        for k in ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90"):
            c = r[k]
            worst = max(worst, abs(c["error"]))
            cells.append(f"{c['measured']:8.1f} {c['predicted']:8.1f} {c['error'] * 100:+7.1f}%")
        print(f"{r['mode']:10} {r['rate']:5g} | " + " | ".join(cells))
    print(f"worst |error| {worst * 100:.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "calibration": cal, "workdir": work,
                       "workload": {"input_len": args.input_len, "output_len": args.output_len,
                                    "num_requests": args.num_requests, "seed": args.seed}},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
