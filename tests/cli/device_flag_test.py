#!/usr/bin/env python3
"""--device, --cpu-isa, --sampling-device and --kv-backend refusals: a non-zero exit with one line saying why.

usage: device_flag_test.py TANDEM CUDA_BUILT(ON|OFF)
`--device cuda` must fail only where it cannot run: in a build without CUDA, or on a machine
with no GPU (then the reason names the missing device).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

TANDEM, CUDA_BUILT = sys.argv[1], sys.argv[2] == "ON"
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def run(*args):
    return subprocess.run([TANDEM, *args], capture_output=True, text=True, timeout=300)


def refused(r, *needles):
    lines = r.stderr.strip().splitlines()
    return (r.returncode != 0 and len(lines) == 1 and
            all(n in lines[0] for n in needles)), r.stderr


def has_gpu():
    smi = shutil.which("nvidia-smi")
    return smi is not None and subprocess.run([smi, "-L"], capture_output=True).returncode == 0


with tempfile.TemporaryDirectory() as tmp:
    model = os.path.join(tmp, "tiny")
    r = run("synth-model", "--out", model, "--preset", "tiny")
    check(r.returncode == 0, f"synth-model failed: {r.stderr}")
    gen = ["generate", "--model", model, "--prompt", "Hi", "--max-tokens", "2"]

    ok, err = refused(run(*gen, "--device", "tpu"), "--device must be cuda or cpu, got tpu")
    check(ok, f"--device tpu: {err}")

    r = run(*gen, "--device", "cpu")
    check(r.returncode == 0, f"--device cpu runs: {r.stderr}")

    if not CUDA_BUILT:
        for cmd in (gen, ["decode", "--model", model]):
            ok, err = refused(run(*cmd, "--device", "cuda"), "--device cuda: this build has no CUDA")
            check(ok, f"{cmd[0]} --device cuda without CUDA: {err}")
    elif not has_gpu():
        ok, err = refused(run(*gen, "--device", "cuda"), "--device cuda: no CUDA device")
        check(ok, f"--device cuda without a GPU: {err}")
        # Tensor parallelism on CUDA is not refused as such: only the missing device is named.
        ok, err = refused(run(*gen, "--device", "cuda", "--tp", "2"), "--device cuda: no CUDA device")
        check(ok, f"--device cuda --tp 2 without a GPU: {err}")
    else:
        print("skipped: --device cuda can run here")

    # --cpu-isa: auto is the widest set that keeps activations exact to about fp32 (avx512-bf16
    # where the CPU has it, never avx512-bf16-round); avx512-bf16 carries activations as two bf16
    # halves, within 1e-4 of avx512; avx512-bf16-round rounds the bf16 checkpoint's activations,
    # visibly but slightly; a set this CPU lacks, or an unknown one, is refused in one line.
    ok, err = refused(run(*gen, "--device", "cpu", "--cpu-isa", "sse9"),
                      "--cpu-isa must be auto, portable, avx2, avx512, avx512-bf16 or "
                      "avx512-bf16-round, got sse9")
    check(ok, f"--cpu-isa sse9: {err}")
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    avx512 = {"avx512f", "avx512vl", "avx512dq", "avx512bw", "avx2", "fma", "f16c"} <= flags
    bf16 = avx512 and "avx512_bf16" in flags
    greedy = ["generate", "--model", model, "--prompt", "Hi there", "--max-tokens", "4", "--json",
              "--logprobs", "1", "--temperature", "0", "--device", "cpu"]

    def logprobs(isa):
        r = run(*greedy, "--cpu-isa", isa)
        check(r.returncode == 0, f"--cpu-isa {isa} runs: {r.stderr}")
        return json.loads(r.stdout.splitlines()[0])["logprobs"] if r.returncode == 0 else None

    def apart(a, b):
        return max(abs(x - y) for x, y in zip(a, b))

    auto = logprobs("auto")
    portable = logprobs("portable")
    if auto and portable:
        check(apart(auto, portable) < 1e-4, f"portable {portable} against auto {auto}")
    if avx512:
        check(logprobs("avx512-bf16" if bf16 else "avx512") == auto,
              f"auto is not {'avx512-bf16' if bf16 else 'avx512'} on this CPU")
    if bf16:
        exact = logprobs("avx512")
        rounded = logprobs("avx512-bf16-round")
        if auto and exact:
            check(apart(auto, exact) < 1e-4, f"avx512-bf16 {auto} against avx512 {exact}")
        if exact and rounded:
            diff = apart(exact, rounded)
            check(1e-6 < diff < 0.05, f"avx512-bf16-round {rounded} against avx512 {exact}")
    else:
        for isa in ("avx512-bf16", "avx512-bf16-round"):
            ok, err = refused(run(*gen, "--device", "cpu", "--cpu-isa", isa),
                              f"--cpu-isa {isa}: this CPU lacks it")
            check(ok, f"--cpu-isa {isa} without AVX-512 BF16: {err}")

    # --sampling-device: backend draws the same tokens as host (seeded sampling with
    # truncation, penalties and log-probabilities); an unknown value is refused in one line.
    sampled = ["generate", "--model", model, "--prompt", "Once there", "--max-tokens", "12",
               "--json", "--logprobs", "2", "--temperature", "0.8", "--top-p", "0.9",
               "--top-k", "20", "--repetition-penalty", "1.2", "--seed", "5", "--n", "2",
               "--ignore-eos", "--device", "cpu"]
    outs = {}
    for where in ("host", "backend"):
        r = run(*sampled, "--sampling-device", where)
        check(r.returncode == 0, f"--sampling-device {where} runs: {r.stderr}")
        outs[where] = r.stdout
    check(outs["host"] == outs["backend"] and outs["host"].count("\n") == 2,
          f"--sampling-device backend {outs['backend']!r} against host {outs['host']!r}")
    # --enforce-eager is accepted wherever an engine runs; on the CPU (no step graphs) the
    # output is the same.
    r = run(*sampled, "--sampling-device", "host", "--enforce-eager")
    check(r.returncode == 0 and r.stdout == outs["host"], f"--enforce-eager: {r.stderr}")
    ok, err = refused(run(*gen, "--enforce-eager=yes"), "enforce-eager")
    check(ok, f"--enforce-eager=yes: {err}")
    ok, err = refused(run(*gen, "--sampling-device", "gpu"),
                      "--sampling-device must be auto, host or backend, got gpu")
    check(ok, f"--sampling-device gpu: {err}")

    # A host KV cache cannot go over cuda_ipc or nccl; an unknown backend is named.
    for role in ("prefill", "decode"):
        for device_backend in ("cuda_ipc", "nccl"):
            ok, err = refused(run(role, "--model", model, "--device", "cpu",
                                  "--kv-backend", device_backend),
                              f"--kv-backend {device_backend}", "--device cuda")
            check(ok, f"{role} {device_backend} on cpu: {err}")
        ok, err = refused(run(role, "--model", model, "--device", "cpu", "--kv-backend", "rdma"),
                          "--kv-backend must be ucx, local, cuda_ipc or nccl, got rdma")
        check(ok, f"{role} --kv-backend rdma: {err}")
    ok, err = refused(run("serve", "--model", model, "--device", "cpu", "--kv-backend", "cuda_ipc"),
                      "--kv-backend cuda_ipc")
    check(ok, f"serve cuda_ipc on cpu: {err}")

sys.exit(1 if failures else 0)
