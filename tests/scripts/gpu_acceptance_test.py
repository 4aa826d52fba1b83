#!/usr/bin/env python3
"""scripts/gpu_acceptance.py on figures written here in the formats gpu-check's programs write
(gpu_hf_compare.py, Google Benchmark JSON of tandem_bench_decode, tandem_bench_cuda_kernels,
gpu_baselines.py, router_streams.py): each goal judged pass or FAIL against its bound from
ratios of the same run, and "not measured" where a file or row is missing.

usage: gpu_acceptance_test.py SCRIPT
"""
import json
import os
import subprocess
import sys
import tempfile


def check(cond, message):
    if not cond:
        print("FAIL:", message, file=sys.stderr)
        sys.exit(1)


def write(out, name, doc):
    with open(os.path.join(out, name), "w") as f:
        json.dump(doc, f)


def write_text(out, name, text):
    with open(os.path.join(out, name), "w") as f:
        f.write(text)


def gtest_xml(two_gpu_result):
    """nccl_link_test's report as gtest writes it, its two-GPU case passed, failed or skipped."""
    inner = {"passed": "", "failed": '<failure message="bytes differ"/>',
             "skipped": '<skipped message="needs two CUDA devices"/>'}[two_gpu_result]
    result = "skipped" if two_gpu_result == "skipped" else "completed"
    return ('<?xml version="1.0" encoding="UTF-8"?>\n<testsuites tests="2">\n'
            '<testsuite name="NcclLinkTest" tests="2">\n'
            '<testcase name="RegistersDeviceMemoryOnly" status="run" result="completed"/>\n'
            f'<testcase name="RangesPushedBetweenTwoDevicesLandExactly" status="run" '
            f'result="{result}">{inner}</testcase>\n</testsuite>\n</testsuites>\n')


def run(script, out):
    result = subprocess.run([sys.executable, script, out], capture_output=True, text=True,
                            timeout=60)
    check(result.returncode == 0, f"exit {result.returncode}: {result.stderr}")
    rows = {}
    for line in result.stdout.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        check(len(cells) == 4, f"a row of 4 cells: {line!r}")
        rows[cells[0]] = cells
    return rows


def find(rows, start):
    hits = [cells for goal, cells in rows.items() if goal.startswith(start)]
    check(len(hits) == 1, f"one row starting {start!r}, got {len(hits)}: {list(rows)}")
    return hits[0]


def main():
    script = sys.argv[1]
    with tempfile.TemporaryDirectory() as out:
        # Nothing measured: every goal says so.
        rows = run(script, out)
        check(rows and all(cells[3] == "not measured" for cells in rows.values()),
              f"an empty run is not measured: {rows}")

        write(out, "hf_compare.json", [
            {"arch": "llama", "fp32_max_rel_error": 4.8e-7, "greedy_tokens": 64,
             "greedy_identical": 64, "bf16_top5_logprob_max_diff_vs_fp64": 5.5e-3},
            {"arch": "qwen3", "fp32_max_rel_error": 3e-4, "greedy_tokens": 64,
             "greedy_identical": 63, "bf16_top5_logprob_max_diff_vs_fp64": 2.5e-2}])
        bench = lambda name, **counters: dict(name=name, run_type="iteration", **counters)
        write(out, "decode_8b.json", {"benchmarks": [
            bench("BM_DecodeStep/bfloat16/1/real_time", of_copy=0.86, step_ms=0.98),
            bench("BM_DecodeStep/bfloat16/8/real_time", of_copy=0.5, step_ms=1.5),
            dict(name="BM_DecodeStep/bfloat16/1/real_time_mean", run_type="aggregate",
                 of_copy=0.1),
            bench("BM_Prefill/bfloat16/2048/real_time", ttft_ms=30.0, TFLOP=15.8)]})
        write(out, "kernels.json", {"copy_gbs": 2900, "rows": [
            {"op": "PagedAttention decode bf16 KV", "shape": "batch 1 x context 4096",
             "us": 1, "gbs": 1, "tflops": 0, "of_copy": 0.1},
            {"op": "PagedAttention decode bf16 KV", "shape": "batch 8 x context 8192",
             "us": 1, "gbs": 1, "tflops": 0, "of_copy": 0.83},
            {"op": "PagedAttention decode bf16 KV", "shape": "batch 64 x context 1024",
             "us": 1, "gbs": 1, "tflops": 0, "of_copy": 0.79},
            {"op": "PagedAttention prefill causal", "shape": "4096 tokens, 32/8 heads, hd 128",
             "us": 1, "gbs": 0, "tflops": 270.0, "of_copy": 0},
            {"op": "Linear bf16", "shape": "torch_shape m64 n14336 k4096", "us": 1, "gbs": 1,
             "tflops": 95.0, "of_copy": 0.8},
            {"op": "Linear bf16 GemmEx", "shape": "torch_shape m64 n14336 k4096", "us": 1,
             "gbs": 1, "tflops": 10.0, "of_copy": 0.1},
            {"op": "Linear bf16", "shape": "torch_square m8192 n8192 k8192", "us": 1, "gbs": 1,
             "tflops": 700.0, "of_copy": 0}]})
        write(out, "baselines.json", {
            "matmul": [{"m": 8192, "k": 8192, "n": 8192, "tflops": 790.0},
                       {"m": 64, "k": 4096, "n": 14336, "tflops": 100.0}],
            "sdpa": [{"tokens": 2048, "tflops": 200.0}, {"tokens": 4096, "tflops": 260.0}]})
        write(out, "router-light.json", {"router_write_ms_p99_at_most": 0.2, "failed": 0})
        write(out, "router-busy.json", {"router_write_ms_p99_at_most": 1.0, "failed": 0})
        # gtest's XML for nccl_link_test on a one-GPU machine: the two-GPU case skipped.
        write_text(out, "nccl_link_test.xml", gtest_xml("skipped"))
        rows = run(script, out)

        check(find(rows, "llama: fp32")[3] == "pass", "llama fp32 passes")
        check(find(rows, "qwen3: fp32")[3] == "FAIL", "qwen3 fp32 3e-4 > 1e-4 fails")
        check(find(rows, "qwen3: greedy")[1] == "63/64" and
              find(rows, "qwen3: greedy")[3] == "FAIL", "63 of 64 greedy tokens fail")
        check(find(rows, "qwen3: bf16")[3] == "FAIL", "bf16 2.5e-2 > 2e-2 fails")
        decode = find(rows, "decode step")
        check(decode[3] == "pass" and decode[1].startswith("0.860"),
              f"batch 1's iteration row, not the aggregate: {decode}")
        attention = find(rows, "paged decode attention")
        check(attention[3] == "FAIL" and "0.790" in attention[1] and "64 x context 1024"
              in attention[1], f"the worst shape of >= 64k tokens (1 x 4096 left out): "
              f"{attention}")
        prefill = find(rows, "prefill attention")
        check(prefill[3] == "pass" and prefill[1].startswith("1.04x"), f"270/260: {prefill}")
        ttft = find(rows, "TTFT")
        # Floor: 15.8 TFLOP at 790 TFLOP/s = 20 ms; 30 ms is 1.5x.
        check(ttft[3] == "FAIL" and ttft[1].startswith("1.50x"), f"TTFT: {ttft}")
        gemm = find(rows, "bf16 GEMM")
        # 95/100 at m 64, 700/790 square: the worst 0.89x; the GemmEx row (0.10x) left out.
        check(gemm[3] == "FAIL" and gemm[1].startswith("0.89x") and "m 64 0.95x" in gemm[1]
              and "m 8192 0.89x" in gemm[1], f"the default Linear rows, per m: {gemm}")
        light = find(rows, "issue 13: router p99 per token at 1,000 streams (light")
        busy = find(rows, "issue 13: router p99 per token at 1,000 streams (busy")
        check(light[3] == "pass" and busy[3] == "FAIL", f"router: {light} {busy}")
        nccl = find(rows, "KV between two GPUs over nccl")
        check(nccl[3] == "not measured" and "one GPU" in nccl[1], f"skipped: {nccl}")
        for result, verdict in (("passed", "pass"), ("failed", "FAIL")):
            write_text(out, "nccl_link_test.xml", gtest_xml(result))
            nccl = find(run(script, out), "KV between two GPUs over nccl")
            check(nccl[3] == verdict, f"{result}: {nccl}")

    bad = subprocess.run([sys.executable, script, "/nonexistent-dir"], capture_output=True,
                         text=True, timeout=60)
    check(bad.returncode == 2 and "usage" in bad.stderr, "a missing directory is refused")
    print("gpu_acceptance_test: ok")


if __name__ == "__main__":
    main()
