#!/usr/bin/env python3
"""Tandem's GPU logits and greedy tokens against Hugging Face transformers, on the device.

usage: gpu_hf_compare.py EXPORT_DIR OUT_JSON

EXPORT_DIR is what gpu_runner_test's GpuHfExport test wrote (TANDEM_HF_EXPORT_DIR): one
folder per architecture with the checkpoint's path, a prompt, Tandem's last-row logits with fp32
and bf16 weights, and 64 greedy tokens (fp32). transformers loads the same checkpoint files
(no download) and computes:
  fp32   the reference in float64 on the CPU: max|tandem - ref| / max|ref| <= 1e-4, and the
         64 greedy tokens identical
  bf16   Tandem's bf16 log-probabilities of the reference's top-5 tokens within 2e-2 of the
         float64 reference. Also reported, not judged: the same against transformers' own
         bfloat16 run on the GPU, which is itself about 2e-2 off the reference (it rounds the
         residual stream, norms and attention to bf16; Tandem keeps those in fp32), so a bound
         against it would mostly measure transformers' rounding.
Exits 1 when a check fails; prints one line per architecture and check.
"""
import json
import os
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM

MAX_FP32_ERROR = 1e-4
MAX_BF16_LOGPROB_DIFF = 2e-2


def load(model_dir, dtype, device):
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    except TypeError:  # transformers before the dtype argument
        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=dtype)
    return model.to(device).eval()


@torch.no_grad()
def greedy(model, prompt, steps):
    ids = torch.tensor([prompt])
    out = model(ids, use_cache=True)
    tokens = []
    for _ in range(steps):
        nxt = int(out.logits[0, -1].argmax())
        tokens.append(nxt)
        out = model(torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def main():
    root, out_json = sys.argv[1], sys.argv[2]
    results, ok = [], True
    for arch in sorted(os.listdir(root)):
        d = os.path.join(root, arch)
        model_dir = open(os.path.join(d, "model_dir")).read().strip()
        prompt = [int(t) for t in open(os.path.join(d, "prompt")).read().split()]
        tandem_f32 = torch.from_numpy(
            np.fromfile(os.path.join(d, "logits_float32.f32"), dtype="float32"))
        tandem_bf16 = torch.from_numpy(
            np.fromfile(os.path.join(d, "logits_bfloat16.f32"), dtype="float32"))
        tandem_greedy = [int(t) for t in open(os.path.join(d, "greedy_float32")).read().split()]

        ref = load(model_dir, torch.float64, "cpu")
        with torch.no_grad():
            ref_logits = ref(torch.tensor([prompt])).logits[0, -1]
        err = float((tandem_f32.double() - ref_logits).abs().max() / ref_logits.abs().max())
        ref_greedy = greedy(ref, prompt, len(tandem_greedy))
        same = sum(a == b for a, b in zip(ref_greedy, tandem_greedy))
        first_diff = next((i for i, (a, b) in enumerate(zip(ref_greedy, tandem_greedy)) if a != b),
                          None)
        ref_lp = torch.log_softmax(ref_logits, -1)
        del ref

        bf = load(model_dir, torch.bfloat16, "cuda")
        with torch.no_grad():
            bf_logits = bf(torch.tensor([prompt], device="cuda")).logits[0, -1].float().cpu()
        del bf
        bf_lp = torch.log_softmax(bf_logits, -1)
        tandem_lp = torch.log_softmax(tandem_bf16, -1)
        top5 = torch.topk(ref_lp, 5).indices
        lp_diff = float((tandem_lp[top5] - bf_lp[top5]).abs().max())
        lp_diff_ref = float((tandem_lp[top5] - ref_lp[top5].float()).abs().max())
        hf_bf16_vs_ref = float((bf_lp[top5] - ref_lp[top5].float()).abs().max())

        r = {"arch": arch, "fp32_max_rel_error": err, "greedy_tokens": len(tandem_greedy),
             "greedy_identical": same, "greedy_first_difference": first_diff,
             "bf16_top5_logprob_max_diff_vs_hf_bf16": lp_diff,
             "bf16_top5_logprob_max_diff_vs_fp64": lp_diff_ref,
             "hf_bf16_top5_logprob_max_diff_vs_fp64": hf_bf16_vs_ref}
        r["pass"] = (err <= MAX_FP32_ERROR and same == len(tandem_greedy) and
                     lp_diff_ref <= MAX_BF16_LOGPROB_DIFF)
        ok = ok and r["pass"]
        results.append(r)
        print(f"{arch}: fp32 max rel error {err:.2e} (<= {MAX_FP32_ERROR:g}); greedy "
              f"{same}/{len(tandem_greedy)} identical; bf16 top-5 logprob diff {lp_diff_ref:.2e} "
              f"vs fp64 (<= {MAX_BF16_LOGPROB_DIFF:g}), {lp_diff:.2e} vs transformers bf16 "
              f"(transformers bf16 itself vs fp64: {hf_bf16_vs_ref:.2e}) "
              f"{'pass' if r['pass'] else 'FAIL'}")
    with open(out_json, "w") as f:
        json.dump(results, f, indent=1)
    return 0 if ok and results else 1


if __name__ == "__main__":
    sys.exit(main())
