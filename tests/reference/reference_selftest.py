#!/usr/bin/python3
"""Self-test of `tandem synth-model` and reference_forward.py, run by ctest.

For each architecture it writes a tiny fp32 synthetic checkpoint, runs the NumPy reference on
it and checks that the logits are finite and informative and that greedy decoding does not
collapse onto one token: the synthetic weight scaling has to keep a random network sane for the
engine's comparison tests to mean anything. It also checks what a user of synth-model would
notice: the same seed gives the same bytes, sharding and bf16 change the files but not the
model, and bad flags fail with a one-line reason.

  reference_selftest.py --tandem build/bin/tandem --work DIR
"""

import argparse
import json
import os
import shutil
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REFERENCE = os.path.join(HERE, "reference_forward.py")
ARCHS = ("llama", "mistral", "qwen2", "qwen3")
PROMPT = [3, 17, 101, 256, 42, 7, 300, 5, 88, 260, 11, 150]
GREEDY_STEPS = 24

failures = []


def check(condition, message):
    if not condition:
        failures.append(message)
        print("FAIL:", message)


def synth(tandem, out, *flags):
    return subprocess.run(
        [tandem, "synth-model", "--out", out, *flags], capture_output=True, text=True
    )


def reference(model, out, steps=GREEDY_STEPS):
    subprocess.run(
        [
            sys.executable,
            REFERENCE,
            "--model",
            model,
            "--tokens",
            ",".join(map(str, PROMPT)),
            "--greedy-steps",
            str(steps),
            "--out",
            out,
        ],
        check=True,
    )
    with open(out) as f:
        result = json.load(f)
    return np.array(result["logits"]), result["greedy_tokens"]


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tandem", required=True)
    parser.add_argument("--work", required=True)
    args = parser.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    work = args.work

    for arch in ARCHS:
        model = os.path.join(work, f"tiny-{arch}")
        run = synth(args.tandem, model, "--preset", "tiny", "--arch", arch, "--dtype", "f32",
                    "--seed", "3")
        check(run.returncode == 0, f"{arch}: synth-model failed: {run.stderr.strip()}")
        if run.returncode != 0:
            continue
        print(run.stdout.strip())
        check(run.stdout.startswith("wrote ") and "parameters" in run.stdout,
              f"{arch}: synth-model did not report what it wrote: {run.stdout!r}")
        with open(os.path.join(model, "config.json")) as f:
            config = json.load(f)
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            check(os.path.exists(os.path.join(model, name)), f"{arch}: no {name}")
        with open(os.path.join(model, "tokenizer_config.json")) as f:
            check("chat_template" in json.load(f), f"{arch}: tokenizer_config has no chat_template")

        logits, greedy = reference(model, os.path.join(work, f"{arch}.json"))
        check(logits.shape == (len(PROMPT), config["vocab_size"]),
              f"{arch}: logits shape {logits.shape}")
        check(np.all(np.isfinite(logits)), f"{arch}: non-finite logits")
        stds = logits.std(axis=1)
        # Informative: neither flat (std ~0) nor saturated (std in the hundreds).
        check(stds.min() > 0.3 and stds.max() < 30, f"{arch}: logit std per position {stds}")
        top = logits.argmax(axis=1)
        check(len(set(top.tolist())) >= len(PROMPT) // 3,
              f"{arch}: argmax barely depends on the input: {top.tolist()}")
        check(len(greedy) == GREEDY_STEPS, f"{arch}: {len(greedy)} greedy tokens")
        distinct = len(set(greedy))
        check(distinct >= GREEDY_STEPS // 4,
              f"{arch}: greedy decoding collapsed ({distinct} distinct): {greedy}")
        print(f"{arch}: logit std {stds.min():.2f}..{stds.max():.2f}, "
              f"{distinct} distinct of {GREEDY_STEPS} greedy tokens")

    # The same seed writes the same bytes; another seed writes another model.
    again = os.path.join(work, "tiny-llama-again")
    other = os.path.join(work, "tiny-llama-seed4")
    synth(args.tandem, again, "--preset", "tiny", "--arch", "llama", "--dtype", "f32", "--seed", "3")
    synth(args.tandem, other, "--preset", "tiny", "--arch", "llama", "--dtype", "f32", "--seed", "4")
    weights = read_bytes(os.path.join(work, "tiny-llama", "model.safetensors"))
    check(read_bytes(os.path.join(again, "model.safetensors")) == weights,
          "same seed gave different weights")
    check(read_bytes(os.path.join(other, "model.safetensors")) != weights,
          "different seeds gave the same weights")

    # Sharding changes the files, not the model.
    sharded = os.path.join(work, "tiny-qwen3-sharded")
    run = synth(args.tandem, sharded, "--preset", "tiny", "--arch", "qwen3", "--dtype", "f32",
                "--seed", "3", "--max-shard-bytes", "100000")
    check(run.returncode == 0, f"sharded synth-model failed: {run.stderr.strip()}")
    shards = sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))
    check(len(shards) > 1 and not os.path.exists(os.path.join(sharded, "model.safetensors")),
          f"expected several shards, got {shards}")
    check(os.path.exists(os.path.join(sharded, "model.safetensors.index.json")), "no shard index")
    if run.returncode == 0:
        logits, greedy = reference(sharded, os.path.join(work, "sharded.json"))
        base_logits, base_greedy = reference(
            os.path.join(work, "tiny-qwen3"), os.path.join(work, "qwen3.json"))
        check(np.array_equal(logits, base_logits) and greedy == base_greedy,
              "sharded checkpoint computes different logits")

    # bf16 rounds the same weights: close to fp32, not identical.
    bf16 = os.path.join(work, "tiny-qwen2-bf16")
    run = synth(args.tandem, bf16, "--preset", "tiny", "--arch", "qwen2", "--seed", "3")
    check(run.returncode == 0, f"bf16 synth-model failed: {run.stderr.strip()}")
    if run.returncode == 0:
        logits, _ = reference(bf16, os.path.join(work, "bf16.json"), steps=0)
        base, _ = reference(os.path.join(work, "tiny-qwen2"), os.path.join(work, "f32.json"), 0)
        rel = np.abs(logits - base).max() / np.abs(base).max()
        check(0 < rel < 0.05, f"bf16 vs f32 relative logit difference {rel}")

    # Bad flags and values fail with one line naming the problem.
    for flags, needle in [
        (["--preset", "huge"], "huge"),
        (["--arch", "gpt2"], "gpt2"),
        (["--dtype", "int8"], "int8"),
        (["--seed", "abc"], "seed"),
        (["--max-shard-bytes", "-1"], "max-shard-bytes"),
        (["--bogus", "1"], "bogus"),
        (["--tokenizer", os.path.join(work, "missing.json")], "missing.json"),
    ]:
        run = synth(args.tandem, os.path.join(work, "bad"), *flags)
        lines = run.stderr.strip().splitlines()
        check(run.returncode != 0 and len(lines) == 1 and needle in lines[0],
              f"synth-model {flags}: rc {run.returncode}, stderr {run.stderr!r}")
    run = subprocess.run([args.tandem, "synth-model", "--preset", "tiny"], capture_output=True,
                         text=True)
    check(run.returncode != 0 and "--out" in run.stderr, f"missing --out: {run.stderr!r}")

    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
