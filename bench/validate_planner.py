#!/usr/bin/env python3
"""Validates `tandem plan simulate` against real runs on this machine.

For each serving mode (colocated and/or disaggregated) it starts `tandem serve` with a step trace
and, rate by rate, alternates calibration loads (`tandem bench`, seeds of their own) with
validation loads (other requests, other seeds) in `--chunks` short chunks, so that both sample
the same stretches of time on a machine whose speed drifts. The simulator's latency model is fitted on the
steps the server measured during the calibration loads only (`tandem plan calibrate --trace
--bench`: step coefficients, the gap between steps, the spread of step times and each request's
overhead beyond the engine), and the validation requests (send times, prompt and output tokens
from their bench reports) are replayed through the simulator. Prints
predicted against measured TTFT and TPOT p50/p90 with relative errors, and writes everything as
JSON. `--calibration-source engine` instead times an engine alone (`tandem plan calibrate`).

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


def start_server(tandem, model, mode, threads, trace=None):
    cmd = [tandem, "serve", "--model", model, "--port", "0", "--threads", str(threads)]
    if trace:
        cmd += ["--step-trace", trace]
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


def percentile(values, q):
    """Linear interpolation between closest ranks, as numpy's default and `tandem bench`."""
    v = sorted(values)
    if not v:
        return float("nan")
    pos = (len(v) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def rel(pred, meas):
    return (pred - meas) / meas if meas else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tandem", default="build/bin/tandem")
    ap.add_argument("--workdir", default=None, help="model, calibration and reports (default: tmp)")
    ap.add_argument("--calibration", default=None, help="reuse this calibration file")
    ap.add_argument("--calibration-source", choices=("trace", "engine"), default="trace",
                    help="trace: steps the server measured under a calibration load (default); "
                         "engine: an engine timed alone")
    ap.add_argument("--calibration-requests", type=int, default=20,
                    help="trace: calibration requests per rate")
    ap.add_argument("--calibration-seed", type=int, default=1001)
    ap.add_argument("--chunks", type=int, default=5,
                    help="calibration and validation loads alternate in this many chunks per rate")
    ap.add_argument("--calibrate-reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="engine threads, the same for calibration and serving (default 1: "
                         "spinning thread pools degrade badly on an oversubscribed machine)")
    ap.add_argument("--modes", default="colocated", help="colocated,disagg")
    ap.add_argument("--rates", default="1,2,4")
    ap.add_argument("--num-requests", type=int, default=40)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--overhead-ms", type=float, default=None,
                    help="per-request overhead for the simulator (default: the calibration's)")
    ap.add_argument("--kv-link-gbps", type=float, default=2.0,
                    help="loopback KV bandwidth assumed for the disaggregated simulation")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--replicas", type=int, default=20,
                    help="simulations of each trace, pooled (different draws of the step spread)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    work = args.workdir or tempfile.mkdtemp(prefix="tandem-plan-")
    os.makedirs(work, exist_ok=True)
    model = os.path.join(work, "small")
    if not os.path.exists(os.path.join(model, "config.json")):
        run([args.tandem, "synth-model", "--preset", "small", "--out", model],
            stdout=subprocess.DEVNULL)
    engine_cal = args.calibration or os.path.join(work, "calibration-engine.json")
    if args.calibration_source == "engine" and not args.calibration:
        run([args.tandem, "plan", "calibrate", "--model", model, "--out", engine_cal,
             "--reps", str(args.calibrate_reps), "--threads", str(args.threads),
             "--max-context", "256"])

    def bench(url, name, rate, seed, num, out):
        flags = ["--request-rate-sweep", rate] if "," in rate else ["--request-rate", rate]
        run([args.tandem, "bench", "--url", url, "--model", name, "--num-requests", str(num),
             *flags, "--input-len", str(args.input_len), "--output-len", str(args.output_len),
             "--seed", str(seed), "--no-progress", "--json", out], stdout=subprocess.DEVNULL)

    rows = []
    calibrations = {}
    for mode in args.modes.split(","):
        trace = None
        if args.calibration_source == "trace" and not args.calibration:
            trace = os.path.join(work, f"steps-{mode}.jsonl")
        proc, name, url = start_server(args.tandem, model, mode, args.threads, trace)
        try:
            cal = engine_cal
            rates = args.rates.split(",")
            windows, cal_runs = [], []
            for i, rate in enumerate(rates):
                # Calibration and validation loads alternate in short chunks, so both sample the
                # same stretches of time (a shared machine drifts by 10% and more over minutes);
                # the calibration never sees a validation request.
                val_runs = []
                for k in range(args.chunks):
                    if trace:
                        cal_bench = os.path.join(work, f"calibration-bench-{mode}-{rate}-{k}.json")
                        begin = time.time()
                        bench(url, name, rate, args.calibration_seed + 100 * i + k,
                              max(1, args.calibration_requests // args.chunks), cal_bench)
                        windows.append((begin, time.time()))
                        with open(cal_bench) as f:
                            cal_runs.append(json.load(f))
                    chunk = os.path.join(work, f"bench-{mode}-{rate}-{k}.json")
                    bench(url, name, rate, args.seed + 100 * i + k,
                          max(1, args.num_requests // args.chunks), chunk)
                    with open(chunk) as f:
                        val_runs.append(json.load(f))
                # One report of the chunks, each shifted 1000 s after the previous, so the
                # simulator replays them one after another with the system idle in between.
                merged = {"requests": []}
                for k, run_k in enumerate(val_runs):
                    for r in run_k["requests"]:
                        r = dict(r)
                        r["start_s"] = r.get("start_s", 0) + 1000.0 * k
                        merged["requests"].append(r)
                with open(os.path.join(work, f"bench-{mode}-{rate}.json"), "w") as f:
                    json.dump(merged, f)
            if trace:
                # The steps and first tokens of the calibration loads only.
                cal_trace = os.path.join(work, f"calibration-steps-{mode}.jsonl")
                with open(trace) as src, open(cal_trace, "w") as dst:
                    for line in src:
                        t = json.loads(line)["t"]
                        if any(b <= t <= e for b, e in windows):
                            dst.write(line)
                cal_bench = os.path.join(work, f"calibration-bench-{mode}.json")
                with open(cal_bench, "w") as f:
                    json.dump({"runs": cal_runs}, f)
                cal = os.path.join(work, f"calibration-{mode}.json")
                run([args.tandem, "plan", "calibrate", "--trace", cal_trace, "--bench", cal_bench,
                     "--model", model, "--out", cal])
            calibrations[mode] = cal
            for rate in rates:
                bench_json = os.path.join(work, f"bench-{mode}-{rate}.json")
                sim_json = os.path.join(work, f"sim-{mode}-{rate}.json")
                sim = [args.tandem, "plan", "simulate", "--model", model, "--calibration", cal,
                       "--config", "colocated" if mode == "colocated" else "disagg",
                       "--trace", bench_json, "--replicas", str(args.replicas),
                       "--json", sim_json]
                if args.overhead_ms is not None:
                    sim += ["--overhead-ms", str(args.overhead_ms)]
                if mode != "colocated":
                    sim += ["--kv-link-gbps", str(args.kv_link_gbps)]
                run(sim, stdout=subprocess.DEVNULL)
                with open(bench_json) as f:
                    records = json.load(f)["requests"]
                with open(sim_json) as f:
                    predicted = json.load(f)
                ok = [r for r in records if r["success"]]
                row = {"mode": mode, "rate": float(rate), "requests": len(ok),
                       "failed": len(records) - len(ok)}
                for metric in ("ttft_ms", "tpot_ms"):
                    values = [r[metric] for r in ok if metric != "tpot_ms" or
                              r["output_tokens"] > 1]
                    for q in ("p50", "p90"):
                        m = percentile(values, 50 if q == "p50" else 90)
                        p = predicted[metric][q]
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
            json.dump({"rows": rows, "calibrations": calibrations, "workdir": work,
                       "workload": {"input_len": args.input_len, "output_len": args.output_len,
                                    "num_requests": args.num_requests, "seed": args.seed}},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
