#!/usr/bin/python3
"""Independent NumPy dequantiser of weight-only quantised Hugging Face checkpoints.

Shares no code with Tandem. It reads config.json's quantization_config and the safetensors
files itself (through reference_forward.read_weights, which keeps integer tensors as integers)
and turns each quantised linear layer back into `<module>.weight` float64 [out, in]:

  - compressed-tensors int8 (format int-quantized / naive-quantized): weight I8 [out, in] times
    weight_scale [out, 1].
  - AWQ GEMM (AutoAWQ): qweight I32 [in, out/8], eight output columns per word with nibble p
    holding column [0, 2, 4, 6, 1, 3, 5, 7][p]; qzeros I32 [in/group, out/8] packed alike;
    scales F16 [in/group, out]. W^T = (q - zero) * scale.
  - GPTQ (AutoGPTQ's "gptq" format): qweight I32 [in/8, out], nibble p of row r being input
    8r + p; qzeros I32 [groups, out/8] packed sequentially, each the zero point minus 1; scales
    F16 [groups, out]; g_idx I32 [in] (default i // group_size). W^T[i] = (q[i] - (zero[g] + 1))
    * scale[g], g = g_idx[i].

  dequantize.py --model DIR --compare TANDEM.safetensors [--original FLOAT_DIR]

checks that every `<module>.weight` in TANDEM.safetensors (Tandem's dequantised fp32 weights)
equals this script's to fp32 rounding and that no quantised layer is missing; with --original,
that the dequantised weights lie within the quantisation step of the float checkpoint they were
rounded from (a packing-order mistake moves them by several steps). Exits non-zero on failure.
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference_forward  # noqa: E402

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def fail(message):
    sys.exit("dequantize.py: " + message)


def quantization_config(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f).get("quantization_config")


def unpack_nibbles(words):
    """int32 array [..., w] -> uint8 [..., w, 8], nibble p of each word at index p."""
    u = words.astype(np.int64) & 0xFFFFFFFF
    shifts = 4 * np.arange(8, dtype=np.int64)
    return ((u[..., None] >> shifts) & 15).astype(np.int64)


def ignored(module, qc):
    method = qc["quant_method"]
    names = qc.get("ignore" if method == "compressed-tensors" else "modules_to_not_convert") or []
    if module == "lm_head" or "embed_tokens" in module:
        return True
    for name in names:
        if module == name or module.endswith("." + name):
            return True
        if method != "compressed-tensors" and name in module:
            return True
    return False


def dequantize_weights(model_dir, tensors):
    """Returns (weights, steps): `tensors` with each quantised layer replaced by its float64
    `<module>.weight`, and per such weight the quantisation step of each element."""
    qc = quantization_config(model_dir)
    if qc is None:
        return tensors, {}
    method = qc["quant_method"]
    out = dict(tensors)
    steps = {}
    suffix = {"compressed-tensors": ".weight_scale", "awq": ".qweight", "gptq": ".qweight"}
    if method not in suffix:
        fail(f"unsupported quant_method {method}")
    modules = [n[: -len(suffix[method])] for n in tensors if n.endswith(suffix[method])]
    for module in modules:
        if ignored(module, qc):
            continue
        if method == "compressed-tensors":
            q = tensors[module + ".weight"]
            if q.dtype != np.int8:
                fail(f"{module}.weight is not I8")
            scale = tensors[module + ".weight_scale"].astype(np.float64)
            w = q.astype(np.float64) * scale
            step = np.broadcast_to(scale, w.shape)
            del out[module + ".weight_scale"]
        else:
            qweight = tensors[module + ".qweight"]
            qzeros = tensors[module + ".qzeros"]
            scales = tensors[module + ".scales"].astype(np.float64)
            groups, out_features = scales.shape
            if method == "awq":
                in_features = qweight.shape[0]
                q = np.empty((in_features, out_features), dtype=np.int64)
                q.reshape(in_features, out_features // 8, 8)[:, :, AWQ_ORDER] = unpack_nibbles(qweight)
                z = np.empty((groups, out_features), dtype=np.int64)
                z.reshape(groups, out_features // 8, 8)[:, :, AWQ_ORDER] = unpack_nibbles(qzeros)
                g_idx = np.arange(in_features) // (in_features // groups)
            else:
                in_features = qweight.shape[0] * 8
                # [in/8, out, 8] -> [in/8, 8, out] -> [in, out]
                q = unpack_nibbles(qweight).transpose(0, 2, 1).reshape(in_features, out_features)
                z = unpack_nibbles(qzeros).reshape(groups, out_features) + 1
                if module + ".g_idx" in tensors:
                    g_idx = tensors[module + ".g_idx"].astype(np.int64)
                else:
                    g_idx = np.arange(in_features) // (in_features // groups)
                out.pop(module + ".g_idx", None)
            w = ((q - z[g_idx]) * scales[g_idx]).T
            step = scales[g_idx].T
            for name in (".qweight", ".qzeros", ".scales"):
                del out[module + name]
        out[module + ".weight"] = w
        steps[module + ".weight"] = step
    return out, steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="quantised checkpoint directory")
    parser.add_argument("--compare", required=True, help="Tandem's dequantised weights (.safetensors)")
    parser.add_argument("--original", help="the float checkpoint the weights were quantised from")
    args = parser.parse_args()
    if quantization_config(args.model) is None:
        fail(f"{args.model}: config.json has no quantization_config")
    weights, steps = dequantize_weights(args.model, reference_forward.read_weights(args.model))
    tandem = reference_forward.read_safetensors(args.compare)
    if set(tandem) != set(steps):
        fail(
            f"layers differ: only Tandem {sorted(set(tandem) - set(steps))[:3]}, "
            f"only here {sorted(set(steps) - set(tandem))[:3]}"
        )
    worst = 0.0
    for name, ours in weights.items():
        if name not in steps:
            continue
        theirs = tandem[name]
        if theirs.shape != ours.shape:
            fail(f"{name}: Tandem shape {theirs.shape}, here {ours.shape}")
        # Tandem holds fp32: each element the product rounded once (half an ulp, 2^-24 relative).
        error = np.abs(theirs - ours)
        bound = np.abs(ours) * 2.0**-24
        if np.any(error > bound):
            i = np.unravel_index(np.argmax(error - bound), error.shape)
            fail(f"{name}{list(i)}: Tandem {theirs[i]!r}, here {ours[i]!r}")
        worst = max(worst, float(np.max(error)))
    print(f"{len(steps)} quantised layers equal to fp32 rounding (max |diff| {worst:.3g})")
    if args.original:
        original = reference_forward.read_weights(args.original)
        worst_steps = 0.0
        mean_steps = []
        for name, step in steps.items():
            error = np.abs(weights[name] - original[name]) / step
            worst_steps = max(worst_steps, float(np.max(error)))
            mean_steps.append(float(np.mean(error)))
        mean = float(np.mean(mean_steps))
        print(f"against {args.original}: mean |error| {mean:.3f} steps, max {worst_steps:.3f}")
        # Rounding to nearest leaves at most half a step (1.5 where GPTQ's zero point is clamped
        # to 1..15), about a quarter on average; a misplaced value is several steps off.
        if worst_steps > 1.51 or mean > 0.3:
            fail("dequantised weights are not the original weights rounded to the quantisation grid")


if __name__ == "__main__":
    main()
