#!/usr/bin/python3
"""Independent float64 NumPy forward pass of a Hugging Face decoder checkpoint.

The engine's numerical tests compare against this script. It shares no code with Tandem: it
parses config.json and the safetensors files (single or sharded) itself and follows the
transformers implementations of LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and
Qwen3ForCausalLM.

  reference_forward.py --model DIR --tokens 1,2,3 [--greedy-steps N] [--kv-dtype TYPE] --out FILE.json

writes {"logits": [[vocab floats] per prompt position], "greedy_tokens": [N ids], "embedding":
[hidden floats]}, where the greedy tokens continue the prompt by argmax (recomputing the whole
sequence each step) and the embedding is the last prompt token's final hidden state (after the
final norm, before the LM head), L2-normalised: what an embeddings request returns. An --out
ending in .npy saves the logits array instead and prints the greedy tokens.
"""

import argparse
import json
import math
import os
import struct
import sys

import numpy as np

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def fail(message):
    sys.exit("reference_forward.py: " + message)


# ---------------------------------------------------------------------------------------------
# Checkpoint reading.


def read_safetensors(path):
    """Returns {name: float64 array} for every tensor in one .safetensors file."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        fail(f"{path}: truncated")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > len(data) - 8:
        fail(f"{path}: header length {header_len} beyond file size {len(data)}")
    header = json.loads(data[8 : 8 + header_len])
    body = memoryview(data)[8 + header_len :]
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        if not 0 <= begin <= end <= len(body):
            fail(f"{path}: tensor {name}: data_offsets out of range")
        raw = body[begin:end]
        dtype = entry["dtype"]
        if dtype == "F32":
            array = np.frombuffer(raw, dtype="<f4")
        elif dtype == "F16":
            array = np.frombuffer(raw, dtype="<f2")
        elif dtype == "BF16":
            # bf16 is the top half of an fp32: widen the bits and reinterpret.
            array = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif dtype in ("I8", "I32"):
            # Integer tensors of quantised checkpoints stay integers (dequantize.py reads them).
            array = np.frombuffer(raw, dtype="<i1" if dtype == "I8" else "<i4")
        else:
            fail(f"{path}: tensor {name}: unsupported dtype {dtype}")
        shape = tuple(entry["shape"])
        if array.size != math.prod(shape):
            fail(f"{path}: tensor {name}: {array.size} elements for shape {shape}")
        if dtype in ("I8", "I32"):
            tensors[name] = array.astype(array.dtype.newbyteorder("=")).reshape(shape)
        else:
            tensors[name] = array.astype(np.float64).reshape(shape)
    return tensors


def read_weights(model_dir):
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return read_safetensors(single)
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if not os.path.exists(index_path):
        fail(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
    with open(index_path) as f:
        weight_map = json.load(f)["weight_map"]
    weights = {}
    for shard in sorted(set(weight_map.values())):
        tensors = read_safetensors(os.path.join(model_dir, shard))
        for name, file in weight_map.items():
            if file == shard:
                if name not in tensors:
                    fail(f"{index_path}: tensor {name} is not in {shard}")
                weights[name] = tensors[name]
    return weights


class Config:
    def __init__(self, model_dir):
        with open(os.path.join(model_dir, "config.json")) as f:
            c = json.load(f)
        self.arch = c["architectures"][0]
        if self.arch not in ARCHITECTURES:
            fail(f"unsupported architecture {self.arch}")
        self.vocab_size = c["vocab_size"]
        self.hidden = c["hidden_size"]
        self.layers = c["num_hidden_layers"]
        self.heads = c["num_attention_heads"]
        self.kv_heads = c.get("num_key_value_heads") or self.heads
        self.head_dim = c.get("head_dim") or self.hidden // self.heads
        self.eps = c.get("rms_norm_eps", 1e-6)
        self.theta = c.get("rope_theta", 10000.0)
        self.rope_scaling = c.get("rope_scaling")
        self.tie = c.get("tie_word_embeddings", False)
        # transformers: Qwen2 biases q/k/v always; Llama and Qwen3 bias q/k/v and o under
        # attention_bias; Mistral has no attention biases.
        if self.arch == "Qwen2ForCausalLM":
            self.bias, self.o_bias = True, False
        elif self.arch == "MistralForCausalLM":
            self.bias, self.o_bias = False, False
        else:
            self.bias = self.o_bias = bool(c.get("attention_bias", False))
        self.qk_norm = self.arch == "Qwen3ForCausalLM"


# ---------------------------------------------------------------------------------------------
# Forward pass.


def rope_inverse_frequencies(cfg):
    """transformers' default RoPE frequencies, with the Llama 3.1 scaling when configured."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = cfg.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return inv_freq
    if kind != "llama3":
        fail(f"unsupported rope_scaling type {kind}")
    factor = scaling["factor"]
    low = scaling["low_freq_factor"]
    high = scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low
    high_freq_wavelen = old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled)


def rms_norm(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def fp8_values(exp_bits, mant_bits, has_inf):
    """The finite non-negative values of an OCP 8-bit float, indexed by their bit patterns."""
    bias = (1 << (exp_bits - 1)) - 1
    values = []
    for code in range(1 << (exp_bits + mant_bits)):
        e, m = code >> mant_bits, code & ((1 << mant_bits) - 1)
        if e == (1 << exp_bits) - 1 and (has_inf or m == (1 << mant_bits) - 1):
            break  # infinities and NaNs (E4M3fn: only S.1111.111)
        if e == 0:
            values.append(m * 2.0 ** (1 - bias - mant_bits))
        else:
            values.append((1 + m / 2.0**mant_bits) * 2.0 ** (e - bias))
    return np.array(values)


FP8_VALUES = {"fp8_e4m3": fp8_values(4, 3, False), "fp8_e5m2": fp8_values(5, 2, True)}


def round_to(x, dtype):
    """x rounded to nearest even in `dtype` (8-bit floats saturate), returned as float64."""
    if dtype == "float32":
        return x.astype(np.float32).astype(np.float64)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float64)
    if dtype == "bfloat16":
        bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
        return bits.astype(np.uint32).view(np.float32).astype(np.float64)
    values = FP8_VALUES[dtype]
    a = np.minimum(np.abs(x), values[-1])
    hi = np.clip(np.searchsorted(values, a), 1, len(values) - 1)
    lo = hi - 1
    d_lo, d_hi = a - values[lo], values[hi] - a
    # Nearer value; on a tie the even bit pattern (the codes are the indices).
    pick = np.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
    return np.sign(x) * values[pick]


def silu(x):
    return x / (1.0 + np.exp(-x))


def forward(cfg, w, tokens, kv_dtype="float64"):
    """Logits [len(tokens), vocab] for a causal pass over `tokens`; see final_hidden."""
    head = w["model.embed_tokens.weight"] if cfg.tie else w["lm_head.weight"]
    return final_hidden(cfg, w, tokens, kv_dtype) @ head.T


def final_hidden(cfg, w, tokens, kv_dtype="float64"):
    """Hidden states [len(tokens), hidden] after the final norm for a causal pass over `tokens`;
    K (after RoPE) and V are rounded to `kv_dtype` as a KV cache of that type stores them
    ("float64": kept)."""
    t = len(tokens)
    x = w["model.embed_tokens.weight"][np.asarray(tokens)]  # [t, hidden]
    positions = np.arange(t, dtype=np.float64)
    freqs = np.outer(positions, rope_inverse_frequencies(cfg))  # [t, head_dim / 2]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]  # [t, 1, head_dim]
    group = cfg.heads // cfg.kv_heads
    mask = np.triu(np.full((t, t), -np.inf), k=1)
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], cfg.eps)

        def project(name, h=h, p=p):
            y = h @ w[p + f"self_attn.{name}.weight"].T
            if cfg.bias:
                y = y + w[p + f"self_attn.{name}.bias"]
            return y

        q = project("q_proj").reshape(t, cfg.heads, cfg.head_dim)
        k = project("k_proj").reshape(t, cfg.kv_heads, cfg.head_dim)
        v = project("v_proj").reshape(t, cfg.kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = rms_norm(q, w[p + "self_attn.q_norm.weight"], cfg.eps)
            k = rms_norm(k, w[p + "self_attn.k_norm.weight"], cfg.eps)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if kv_dtype != "float64":
            k, v = round_to(k, kv_dtype), round_to(v, kv_dtype)
        k = np.repeat(k, group, axis=1)  # query head j reads kv head j // group
        v = np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(cfg.head_dim) + mask
        scores = scores - scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs = probs / probs.sum(axis=-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(t, cfg.heads * cfg.head_dim)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        if cfg.o_bias:
            x = x + w[p + "self_attn.o_proj.bias"]

        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], cfg.eps)
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        up = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms_norm(x, w["model.norm.weight"], cfg.eps)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--tokens", required=True, help="comma-separated prompt token ids")
    parser.add_argument("--greedy-steps", type=int, default=0, help="tokens to decode by argmax")
    parser.add_argument("--out", help="FILE.json (logits and greedy tokens) or FILE.npy (logits)")
    parser.add_argument(
        "--kv-dtype",
        default="float64",
        choices=["float64", "float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"],
        help="round K and V as a KV cache of this type stores them (scale 1; default: keep)",
    )
    args = parser.parse_args()

    try:
        tokens = [int(s) for s in args.tokens.split(",") if s.strip()]
    except ValueError:
        fail(f"--tokens must be comma-separated integers, got {args.tokens!r}")
    if not tokens:
        fail("--tokens is empty")
    if args.greedy_steps < 0:
        fail("--greedy-steps must be >= 0")
    cfg = Config(args.model)
    if min(tokens) < 0 or max(tokens) >= cfg.vocab_size:
        fail(f"token ids must be in [0, {cfg.vocab_size})")
    weights = read_weights(args.model)
    # A quantised checkpoint runs on its dequantised weights (dequantize.py, float64).
    import dequantize

    weights, _ = dequantize.dequantize_weights(args.model, weights)

    hidden = final_hidden(cfg, weights, tokens, args.kv_dtype)
    head = weights["model.embed_tokens.weight"] if cfg.tie else weights["lm_head.weight"]
    logits = hidden @ head.T
    embedding = hidden[-1] / np.linalg.norm(hidden[-1])
    sequence = list(tokens)
    greedy = []
    for step in range(args.greedy_steps):
        step_logits = logits if step == 0 else forward(cfg, weights, sequence, args.kv_dtype)
        token = int(np.argmax(step_logits[-1]))
        greedy.append(token)
        sequence.append(token)

    if args.out and args.out.endswith(".npy"):
        np.save(args.out, logits)
        print(json.dumps({"greedy_tokens": greedy}))
        return
    result = {"logits": logits.tolist(), "greedy_tokens": greedy, "embedding": embedding.tolist()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)
    else:
        json.dump(result, sys.stdout)
        print()


if __name__ == "__main__":
    main()
