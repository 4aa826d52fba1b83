#!/usr/bin/env python3
"""`tandem plan` as a user runs it: one-line refusals of bad flags, a small placement search,
one simulation (from a length distribution and from a bench report), and a calibration file."""
import json
import os
import subprocess
import sys
import tempfile

TANDEM = sys.argv[1]
failures = []


def tandem(*args):
    return subprocess.run([TANDEM, *args], capture_output=True, text=True, timeout=120)


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what, file=sys.stderr)


def refused(args, needle):
    r = tandem(*args)
    lines = r.stderr.strip().splitlines()
    check(r.returncode != 0, f"{args}: exit {r.returncode}, expected non-zero")
    check(len(lines) == 1, f"{args}: stderr should be one line, got {r.stderr!r}")
    check(needle in r.stderr, f"{args}: {needle!r} not in {r.stderr!r}")


SLO = ["--ttft-slo", "0.5", "--tpot-slo", "0.05"]
refused(["plan", "--tpot-slo", "0.05"], "--ttft-slo")
refused(["plan", *SLO, "--gpus", "0"], "--gpus")
refused(["plan", *SLO, "--hardware", "TPU"], "--hardware")
refused(["plan", *SLO, "--preset", "nope"], "--preset")
refused(["plan", *SLO, "--tp", "1,x"], "--tp")
refused(["plan", *SLO, "--attainment", "1.5"], "--attainment")
refused(["plan", *SLO, "--input-len", "0"], "--input-len")
refused(["plan", *SLO, "--input-len-range", "4"], "--input-len-range")
refused(["plan", *SLO, "--bogus", "1"], "bogus")
refused(["plan", *SLO, "--calibration", "/nonexistent.json"], "--calibration")
refused(["plan", "simulate", "--config", "mixed", "--rate", "1"], "--config")
refused(["plan", "simulate"], "--rate")
refused(["plan", "simulate", "--rate", "-1"], "--rate")
refused(["plan", "simulate", "--rate", "1", "--num-prefill", "2"], "--num-prefill")
refused(["plan", "calibrate", "--out", "x.json"], "--model")

with tempfile.TemporaryDirectory() as tmp:
    # A small search: llama3-8b on two H100s, TP 1 and 2.
    out = os.path.join(tmp, "plan.json")
    r = tandem("plan", "--preset", "llama3-8b", "--hardware", "H100", *SLO, "--gpus", "2",
               "--tp", "1,2", "--input-len", "512", "--output-len", "64", "--num-requests",
               "100", "--json", out)
    check(r.returncode == 0, f"plan failed: {r.stderr}")
    check("best disagg" in r.stdout and "colocated" in r.stdout, f"plan table: {r.stdout}")
    plan = json.load(open(out))
    check(len(plan["evaluated"]) == 4, f"4 configurations on 2 GPUs, got {len(plan['evaluated'])}")
    for key in ("best_disaggregated", "best_colocated"):
        best = plan[key]
        check(best is not None and best["max_rate"] > 0, f"{key}: {best}")
        if best:
            check(best["at_max_rate"]["attainment"] >= 0.9, f"{key} misses the target: {best}")
            check(abs(best["per_gpu_goodput"] - best["max_rate"] / best["gpus"]) < 1e-9,
                  f"{key}: per-GPU goodput")

    # One simulation from a distribution, and again from a bench-format report.
    sim = os.path.join(tmp, "sim.json")
    r = tandem("plan", "simulate", "--preset", "llama3-8b", "--hardware", "H100", "--config",
               "disagg", "--num-decode", "2", "--rate", "4", "--input-len", "256",
               "--input-len-dist", "lognormal", "--input-len-std", "128", "--output-len", "32",
               "--num-requests", "200", *SLO, "--json", sim)
    check(r.returncode == 0, f"simulate failed: {r.stderr}")
    s = json.load(open(sim))
    check(s["gpus"] == 3 and s["requests"] == 200, f"simulate json: {s}")
    check(0 < s["ttft_ms"]["p50"] <= s["ttft_ms"]["p90"], f"ttft: {s['ttft_ms']}")

    report = {"requests": [{"success": True, "start_s": 0.1 * i, "prompt_tokens": 50,
                            "output_tokens": 10} for i in range(20)]}
    trace = os.path.join(tmp, "bench.json")
    json.dump(report, open(trace, "w"))
    cal = {"model": "x", "device": "test", "max_num_batched_tokens": 512, "max_num_seqs": 64,
           "kv_bytes_per_token": 65536,
           "samples": [{"tokens": t, "prefill_tokens": t, "seqs": 1, "context": t,
                        "seconds": 0.001 + 1e-4 * t} for t in (16, 64, 256, 512)] +
                      [{"tokens": b, "prefill_tokens": 0, "seqs": b, "context": b * 64,
                        "seconds": 0.005 + 1e-4 * b} for b in (1, 4, 16, 64)]}
    cal_path = os.path.join(tmp, "cal.json")
    json.dump(cal, open(cal_path, "w"))
    r = tandem("plan", "simulate", "--calibration", cal_path, "--trace", trace, "--json", sim)
    check(r.returncode == 0, f"simulate --trace failed: {r.stderr}")
    s = json.load(open(sim))
    # Alone (arrivals 100 ms apart, each request far shorter): TTFT = one 50-token prefill step.
    check(abs(s["ttft_ms"]["p50"] - (1 + 0.1 * 50)) < 1e-6, f"trace ttft: {s['ttft_ms']}")
    check(abs(s["tpot_ms"]["p50"] - 5.1) < 1e-6, f"trace tpot: {s['tpot_ms']}")
    refused(["plan", "simulate", "--calibration", cal_path, "--trace", trace, "--input-len", "5"],
            "--trace")

    # A calibration from a served run: the server's step trace plus the bench report of the
    # same run, paired by response id.
    steps = os.path.join(tmp, "steps.jsonl")
    with open(steps, "w") as f:
        first = True
        for t in (16, 64, 256, 512):
            f.write(json.dumps({"role": "colocated", "t": 1.0, "step_s": 0.001 + 1e-4 * t,
                                "gap_s": -1 if first else 0.002, "tokens": t,
                                "prefill_tokens": t, "seqs": 1, "context": t}) + "\n")
            first = False
        for b in (1, 4, 16, 64):
            f.write(json.dumps({"role": "colocated", "t": 1.0, "step_s": 0.005 + 1e-4 * b,
                                "gap_s": 0.002, "tokens": b, "prefill_tokens": 0, "seqs": b,
                                "context": b * 64}) + "\n")
        for i in range(10):
            f.write(json.dumps({"role": "colocated", "t": 1.0, "request_id": f"cmpl-{i}",
                                "first_token_s": 0.020, "prompt_tokens": 50}) + "\n")
    served = {"requests": [{"success": True, "start_s": 0.1 * i, "prompt_tokens": 50,
                            "output_tokens": 10, "id": f"cmpl-{i}",
                            "ttft_ms": 20 + 5 + (10 if i == 9 else 0)} for i in range(10)] +
              [{"success": True, "start_s": 2.0, "prompt_tokens": 50, "output_tokens": 10,
                "id": "cmpl-unknown", "ttft_ms": 500}]}
    served_path = os.path.join(tmp, "served.json")
    json.dump(served, open(served_path, "w"))
    cal2 = os.path.join(tmp, "cal2.json")
    r = tandem("plan", "calibrate", "--trace", steps, "--bench", served_path, "--out", cal2)
    check(r.returncode == 0, f"calibrate --trace failed: {r.stderr}")
    c = json.load(open(cal2))
    check(len(c["samples"]) == 8, f"8 traced steps, got {len(c['samples'])}")
    check(abs(c["step_gap_seconds"] - 0.002) < 1e-12, f"step gap: {c['step_gap_seconds']}")
    # Ten requests paired (the unknown id is not), nine with 5 ms beyond the engine, one 15 ms.
    o = sorted(c["request_overhead_samples_seconds"])
    check(len(o) == 10 and abs(o[0] - 0.005) < 1e-9 and abs(o[-1] - 0.015) < 1e-9,
          f"overhead samples: {o}")
    check(abs(c["request_overhead_seconds"] - 0.005) < 1e-9, f"overhead: {c}")
    # Replayed: TTFT = 6 ms prefill + the drawn overhead (5 ms, or 15 ms for one in ten); each
    # decode step comes after the 2 ms serving gap.
    r = tandem("plan", "simulate", "--calibration", cal2, "--trace", trace, "--replicas", "50",
               "--json", sim)
    check(r.returncode == 0, f"simulate with the traced calibration failed: {r.stderr}")
    s = json.load(open(sim))
    check(abs(s["ttft_ms"]["p50"] - 11) < 1e-6, f"traced ttft p50: {s['ttft_ms']}")
    check(abs(s["ttft_ms"]["p99"] - 21) < 1e-6, f"traced ttft p99: {s['ttft_ms']}")
    check(abs(s["tpot_ms"]["p50"] - 7.1) < 1e-6, f"traced tpot: {s['tpot_ms']}")
    check(s["requests"] == 20 and s["replicas"] == 50, f"replicas: {s}")
    # With --model, the KV bytes per token are those of the cache the traced engine held: the
    # weight type by default (bf16 here: tiny llama, 2 layers x K,V x 2 KV heads x 16 x 2 bytes),
    # or --kv-cache-dtype.
    model = os.path.join(tmp, "model")
    r = tandem("synth-model", "--out", model, "--preset", "tiny", "--dtype", "bfloat16")
    check(r.returncode == 0, f"synth-model failed: {r.stderr}")
    for flags, expected in (([], 2 * 2 * 2 * 16 * 2), (["--kv-cache-dtype", "fp8_e4m3"], 128),
                            (["--kv-cache-dtype", "float32"], 512), (["--dtype", "float32"], 512)):
        r = tandem("plan", "calibrate", "--trace", steps, "--model", model, *flags, "--out", cal2)
        check(r.returncode == 0, f"calibrate --trace --model {flags} failed: {r.stderr}")
        if r.returncode == 0:
            got = json.load(open(cal2))["kv_bytes_per_token"]
            check(got == expected, f"kv_bytes_per_token with {flags}: {got}, expected {expected}")
    refused(["plan", "calibrate", "--trace", steps, "--model", model, "--kv-cache-dtype", "int3",
             "--out", cal2], "--kv-cache-dtype")
    refused(["plan", "calibrate", "--trace", "/nonexistent.jsonl", "--out", cal2], "--trace")
    refused(["plan", "calibrate", "--bench", served_path, "--out", cal2], "--bench")
    refused(["plan", "calibrate", "--trace", steps, "--out", cal2, "--threads", "1"], "--threads")
    refused(["plan", "calibrate", "--trace", served_path, "--out", cal2], served_path)
    refused(["plan", "simulate", "--rate", "1", "--no-step-noise"], "--no-step-noise")

if failures:
    print(f"{len(failures)} failure(s)", file=sys.stderr)
    sys.exit(1)
print("plan CLI: ok")
