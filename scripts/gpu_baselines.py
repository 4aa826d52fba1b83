#!/usr/bin/env python3
"""The device's own ceilings and PyTorch's figures, measured in the same gpu-check run.

usage: gpu_baselines.py OUT_JSON

Every figure is the median of CUDA-event-timed repeats after a warm-up, on random data (never
zeros). Tandem's own figures are judged as ratios against these:
  copy_gbs          device-to-device copy, bytes read plus bytes written, per second
  matmul            bf16 torch.matmul TFLOP/s at an 8192^3 product and at decode-shaped products
  sdpa              causal scaled_dot_product_attention (flash backend), head_dim 128, GQA 4:1
  decode_8b         one decode step of a Llama-3-8B-shaped stack in eager PyTorch (bf16, random
                    weights, no KV attention): the bytes of weights per step over the time
"""
import json
import sys

import torch


def median_ms(fn, warmup=5, reps=30):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth():
    n = 1 << 30  # 1 GiB each way: far over the 50-60 MB L2
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * n / (ms * 1e-3) / 1e9


def matmul_tflops(m, k, n, sets=4):
    # Several input sets, rotated, so small products do not time the L2.
    a = [torch.randn(m, k, dtype=torch.bfloat16, device="cuda") for _ in range(sets)]
    b = [torch.randn(k, n, dtype=torch.bfloat16, device="cuda") for _ in range(sets)]
    i = [0]

    def step():
        j = i[0] % sets
        i[0] += 1
        torch.matmul(a[j], b[j])

    ms = median_ms(step)
    return {"m": m, "k": k, "n": n, "ms": ms, "tflops": 2 * m * k * n / (ms * 1e-3) / 1e12,
            "gbs": 2 * (m * k + k * n + m * n) / (ms * 1e-3) / 1e9}


def sdpa_tflops(tokens, heads=32, kv_heads=8, head_dim=128):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q = torch.randn(1, heads, tokens, head_dim, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(1, kv_heads, tokens, head_dim, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(1, kv_heads, tokens, head_dim, dtype=torch.bfloat16, device="cuda")
    # The flash backend takes GQA through enable_gqa; expand where a build lacks it.
    k_full = k.repeat_interleave(heads // kv_heads, dim=1)
    v_full = v.repeat_interleave(heads // kv_heads, dim=1)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        ms = median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k_full, v_full, is_causal=True))
    # Causal: half of the 4 * T^2 * d * heads multiply-adds of full attention.
    flops = 4 * tokens * tokens * head_dim * heads / 2
    return {"tokens": tokens, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}


def decode_8b(batch, layers=32):
    hidden, inter, heads, kv_heads, head_dim, vocab = 4096, 14336, 32, 8, 128, 128256
    qkv = (heads + 2 * kv_heads) * head_dim
    dev, dt = "cuda", torch.bfloat16
    w = []
    for _ in range(layers):
        w.append((torch.randn(hidden, qkv, dtype=dt, device=dev) * 0.02,
                  torch.randn(heads * head_dim, hidden, dtype=dt, device=dev) * 0.02,
                  torch.randn(hidden, 2 * inter, dtype=dt, device=dev) * 0.02,
                  torch.randn(inter, hidden, dtype=dt, device=dev) * 0.02))
    lm_head = torch.randn(hidden, vocab, dtype=dt, device=dev) * 0.02
    x0 = torch.randn(batch, hidden, dtype=dt, device=dev)
    weight_bytes = 2 * (layers * (hidden * qkv + heads * head_dim * hidden + hidden * 2 * inter +
                                  inter * hidden) + hidden * vocab)

    def step():
        x = x0
        for wqkv, wo, wgu, wd in w:
            h = torch.nn.functional.rms_norm(x, (hidden,))
            a = h @ wqkv
            x = x + a[:, :heads * head_dim] @ wo
            h = torch.nn.functional.rms_norm(x, (hidden,))
            gu = h @ wgu
            x = x + (torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]) @ wd
        return torch.nn.functional.rms_norm(x, (hidden,)) @ lm_head

    ms = median_ms(step, warmup=3, reps=15)
    del w
    torch.cuda.empty_cache()
    return {"batch": batch, "ms": ms, "weight_gb": weight_bytes / 1e9,
            "gbs": weight_bytes / (ms * 1e-3) / 1e9}


def main():
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    out = {"device": props.name, "sms": props.multi_processor_count,
           "torch": torch.__version__, "cuda": torch.version.cuda}
    out["copy_gbs"] = copy_bandwidth()
    out["matmul"] = [matmul_tflops(8192, 8192, 8192)] + [
        matmul_tflops(m, 4096, 14336) for m in (1, 8, 64, 256, 2048)]
    out["sdpa"] = [sdpa_tflops(t) for t in (2048, 4096)]
    out["decode_8b"] = [decode_8b(b) for b in (1, 8, 64, 256)]
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)
    print(f"device {out['device']}  copy {out['copy_gbs']:.0f} GB/s")
    for r in out["matmul"]:
        print(f"torch.matmul {r['m']}x{r['k']}x{r['n']}: {r['ms']:.3f} ms "
              f"{r['tflops']:.0f} TFLOP/s {r['gbs']:.0f} GB/s")
    for r in out["sdpa"]:
        print(f"sdpa flash causal T={r['tokens']}: {r['ms']:.3f} ms {r['tflops']:.0f} TFLOP/s")
    for r in out["decode_8b"]:
        print(f"torch eager 8B decode batch {r['batch']}: {r['ms']:.2f} ms "
              f"{r['gbs']:.0f} GB/s ({r['gbs'] / out['copy_gbs']:.2f} of copy)")


if __name__ == "__main__":
    main()
