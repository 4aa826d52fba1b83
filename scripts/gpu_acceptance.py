#!/usr/bin/env python3
"""Issue 16's acceptance (and issue 13's router goal) judged from one `scripts/gpu-check run`.

    python3 scripts/gpu_acceptance.py OUT_DIR

Reads the figures that run wrote under OUT_DIR (hf_compare.json, decode_8b.json, kernels.json,
baselines.json, router-light.json, router-busy.json, and nccl_link_test.xml, the gtest report
of the nccl KV transfer test) and prints a Markdown table: each goal, what
was measured, the bound, and pass, FAIL or "not measured" (a file or row missing). Every ratio
is between figures of the same run. Exits 0 whatever it finds (the report says); 2 when
OUT_DIR is not a directory.
"""

import json
import os
import sys
import xml.etree.ElementTree as ElementTree

# The bounds of issue 16's acceptance and issue 13's router goal.
MAX_FP32_REL_ERROR = 1e-4
GREEDY_TOKENS = 64
MAX_BF16_TOP5_DIFF = 2e-2
MIN_DECODE_OF_COPY = 0.85
MIN_ATTENTION_OF_COPY = 0.80
MIN_ATTENTION_TOKENS = 65536  # batch x context
MIN_PREFILL_VS_SDPA = 1.0
MAX_TTFT_OVER_FLOOR = 1.3
MIN_GEMM_VS_TORCH = 0.9
MAX_ROUTER_P99_MS = 0.2
# nccl_link_test's transfer between two devices (skipped where the machine has one GPU).
NCCL_TWO_GPU_TEST = "RangesPushedBetweenTwoDevicesLandExactly"


def load(out, name):
    path = os.path.join(out, name)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def sci(value):
    return "-" if value is None else f"{value:.2e}"


def verdict(ok):
    return "pass" if ok else "FAIL"


def benchmark_rows(doc, prefix):
    """Google Benchmark entries named prefix/<format>/<arg>..., as {arg: entry} (iterations only)."""
    rows = {}
    for b in (doc or {}).get("benchmarks", []):
        if b.get("run_type", "iteration") != "iteration" or not b.get("name", "").startswith(prefix):
            continue
        if b.get("error_occurred"):
            continue
        args = [p for p in b["name"].split("/") if p.isdigit()]
        if args:
            rows[int(args[0])] = b
    return rows


def gtest_case(out, report, name):
    """'passed', 'failed', 'skipped' or None (no report, or no such case) from a gtest XML."""
    try:
        root = ElementTree.parse(os.path.join(out, report)).getroot()
    except (OSError, ElementTree.ParseError):
        return None
    for case in root.iter("testcase"):
        if case.get("name") != name:
            continue
        if case.find("failure") is not None:
            return "failed"
        if case.get("result") == "skipped" or case.find("skipped") is not None:
            return "skipped"
        return "passed"
    return None


def checks(out):
    rows = []  # (goal, measured, bound, result)

    hf = load(out, "hf_compare.json")
    if not hf:
        rows.append(("transformers: fp32 logits, greedy tokens, bf16 top-5", "-", "-",
                     "not measured"))
    for r in hf or []:
        arch = r.get("arch", "?")
        err = r.get("fp32_max_rel_error")
        rows.append((f"{arch}: fp32 logits max relative error vs transformers",
                     sci(err), f"<= {MAX_FP32_REL_ERROR:g}",
                     verdict(err is not None and err <= MAX_FP32_REL_ERROR)))
        same, total = r.get("greedy_identical", 0), r.get("greedy_tokens", 0)
        rows.append((f"{arch}: greedy tokens identical", f"{same}/{total}",
                     f"{GREEDY_TOKENS}/{GREEDY_TOKENS}",
                     verdict(total == GREEDY_TOKENS and same == total)))
        diff = r.get("bf16_top5_logprob_max_diff_vs_fp64")
        rows.append((f"{arch}: bf16 top-5 logprobs vs the float64 reference",
                     sci(diff), f"<= {MAX_BF16_TOP5_DIFF:g}",
                     verdict(diff is not None and diff <= MAX_BF16_TOP5_DIFF)))

    decode = load(out, "decode_8b.json")
    step = benchmark_rows(decode, "BM_DecodeStep/").get(1)
    if step and "of_copy" in step:
        rows.append(("decode step, 8B shape, bf16, batch 1, of copy bandwidth",
                     f"{step['of_copy']:.3f} ({step.get('step_ms', 0):.2f} ms)",
                     f">= {MIN_DECODE_OF_COPY}", verdict(step["of_copy"] >= MIN_DECODE_OF_COPY)))
    else:
        rows.append(("decode step, 8B shape, bf16, batch 1, of copy bandwidth", "-",
                     f">= {MIN_DECODE_OF_COPY}", "not measured"))

    kernels = load(out, "kernels.json") or {}
    krows = kernels.get("rows", [])
    attention = []
    for r in krows:
        if not r["op"].startswith("PagedAttention decode"):
            continue
        words = r["shape"].split()  # "batch B x context C"
        try:
            batch, context = int(words[1]), int(words[4])
        except (IndexError, ValueError):
            continue
        if batch * context >= MIN_ATTENTION_TOKENS:
            attention.append((r["of_copy"], r["shape"]))
    if attention:
        worst = min(attention)
        rows.append(("paged decode attention, batch x context >= 64k, GQA 4:1, of copy (worst)",
                     f"{worst[0]:.3f} ({worst[1]})", f">= {MIN_ATTENTION_OF_COPY}",
                     verdict(worst[0] >= MIN_ATTENTION_OF_COPY)))
    else:
        rows.append(("paged decode attention, batch x context >= 64k, of copy", "-",
                     f">= {MIN_ATTENTION_OF_COPY}", "not measured"))

    baselines = load(out, "baselines.json") or {}
    prefill = next((r for r in krows if r["op"].startswith("PagedAttention prefill")), None)
    sdpa = next((s for s in baselines.get("sdpa", []) if s.get("tokens") == 4096), None)
    if prefill and sdpa and sdpa.get("tflops"):
        ratio = prefill["tflops"] / sdpa["tflops"]
        rows.append(("prefill attention, causal, hd 128, 4k tokens, vs SDPA (flash)",
                     f"{ratio:.2f}x ({prefill['tflops']:.0f} vs {sdpa['tflops']:.0f} TFLOP/s)",
                     f">= {MIN_PREFILL_VS_SDPA}x", verdict(ratio >= MIN_PREFILL_VS_SDPA)))
    else:
        rows.append(("prefill attention vs SDPA", "-", f">= {MIN_PREFILL_VS_SDPA}x",
                     "not measured"))

    matmul = {(m["m"], m["k"], m["n"]): m for m in baselines.get("matmul", [])}
    square = matmul.get((8192, 8192, 8192))
    ttft = benchmark_rows(decode, "BM_Prefill/").get(2048)
    if ttft and square and square.get("tflops") and "TFLOP" in ttft:
        floor_ms = ttft["TFLOP"] / square["tflops"] * 1e3
        ratio = ttft["ttft_ms"] / floor_ms
        rows.append(("TTFT of a 2k prompt over its compute floor (FLOPs at torch.matmul "
                     "8192^3's rate)",
                     f"{ratio:.2f}x ({ttft['ttft_ms']:.2f} vs {floor_ms:.2f} ms)",
                     f"<= {MAX_TTFT_OVER_FLOOR}x", verdict(ratio <= MAX_TTFT_OVER_FLOOR)))
    else:
        rows.append(("TTFT of a 2k prompt over its compute floor", "-",
                     f"<= {MAX_TTFT_OVER_FLOOR}x", "not measured"))

    gemm = []
    for r in krows:
        if r["op"] != "Linear bf16":
            continue
        words = r["shape"].split()  # "torch_shape m8 n14336 k4096"
        if words[0] not in ("torch_shape", "torch_square"):
            continue
        m, n, k = (int(w[1:]) for w in words[1:4])
        torch = matmul.get((m, k, n))
        if torch and torch.get("tflops"):
            gemm.append((r["tflops"] / torch["tflops"], f"m {m}"))
    if gemm:
        worst = min(gemm)
        listed = ", ".join(f"{label} {ratio:.2f}x" for ratio, label in gemm)
        rows.append(("bf16 GEMM vs torch.matmul, same shapes (worst)",
                     f"{worst[0]:.2f}x ({listed})", f">= {MIN_GEMM_VS_TORCH}x",
                     verdict(worst[0] >= MIN_GEMM_VS_TORCH)))
    else:
        rows.append(("bf16 GEMM vs torch.matmul", "-", f">= {MIN_GEMM_VS_TORCH}x",
                     "not measured"))

    for load_name in ("light", "busy"):
        router = load(out, f"router-{load_name}.json")
        goal = f"issue 13: router p99 per token at 1,000 streams ({load_name} load)"
        p99 = (router or {}).get("router_write_ms_p99_at_most")
        if p99 is None:
            rows.append((goal, "-", f"<= {MAX_ROUTER_P99_MS} ms", "not measured"))
            continue
        failed = router.get("failed", 0)
        rows.append((goal, f"at most {p99:g} ms in the router ({failed} failed streams)",
                     f"<= {MAX_ROUTER_P99_MS} ms",
                     verdict(p99 <= MAX_ROUTER_P99_MS and failed == 0)))

    nccl = gtest_case(out, "nccl_link_test.xml", NCCL_TWO_GPU_TEST)
    goal = "KV between two GPUs over nccl (nccl_link_test)"
    if nccl in (None, "skipped"):
        rows.append((goal, "skipped: one GPU" if nccl else "-", "ranges land exactly",
                     "not measured"))
    else:
        rows.append((goal, nccl, "ranges land exactly", verdict(nccl == "passed")))
    return rows


def main():
    if len(sys.argv) != 2 or not os.path.isdir(sys.argv[1]):
        print("usage: gpu_acceptance.py OUT_DIR (the directory gpu-check run wrote)",
              file=sys.stderr)
        return 2
    print("| goal | measured | bound | result |")
    print("| --- | --- | --- | --- |")
    for goal, measured, bound, result in checks(sys.argv[1]):
        print(f"| {goal} | {measured} | {bound} | {result} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
