#!/usr/bin/env python3
"""`tandem generate` as a user runs it: output shape, determinism, and one-line refusals."""
import json
import os
import shutil
import subprocess
import sys
import tempfile

TANDEM = sys.argv[1]
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def run(*args):
    return subprocess.run([TANDEM, *args], capture_output=True, text=True, timeout=300)


with tempfile.TemporaryDirectory() as tmp:
    model = os.path.join(tmp, "tiny")
    r = run("synth-model", "--out", model, "--preset", "tiny", "--seed", "3")
    check(r.returncode == 0, f"synth-model failed: {r.stderr}")
    # Its first layer as a model of its own: a draft for --speculative-model.
    draft = os.path.join(tmp, "tiny-draft")
    r = run("synth-model", "--out", draft, "--preset", "tiny", "--seed", "3", "--num-layers", "1")
    check(r.returncode == 0, f"synth-model --num-layers 1 failed: {r.stderr}")
    other_vocab = os.path.join(tmp, "tiny-vocab64")
    r = run("synth-model", "--out", other_vocab, "--preset", "tiny", "--vocab-size", "64")
    check(r.returncode == 0, f"synth-model --vocab-size 64 failed: {r.stderr}")

    r = run("generate", "--model", model, "--prompt", "Hello there", "--max-tokens", "12",
            "--temperature", "0", "--ignore-eos", "--json")
    check(r.returncode == 0, f"generate --json failed: {r.stderr}")
    out = json.loads(r.stdout)
    check(set(out) >= {"token_ids", "text", "logprobs", "finish_reason"}, f"keys: {sorted(out)}")
    check(len(out["token_ids"]) == 12, "12 tokens generated")
    check(len(out["logprobs"]) == 12 and all(lp <= 0 for lp in out["logprobs"]),
          "one non-positive logprob per token")
    check(out["finish_reason"] == "length", "finish_reason length")

    seeded = ["generate", "--model", model, "--prompt", "Once", "--max-tokens", "16",
              "--temperature", "1", "--seed", "99", "--json"]
    a, b = run(*seeded), run(*seeded)
    check(a.returncode == 0 and json.loads(a.stdout) == json.loads(b.stdout),
          "same seed, same output")

    r = run("generate", "--model", model, "--chat", "Hi", "--max-tokens", "4", "--n", "3",
            "--seed", "1", "--json")
    lines = r.stdout.strip().splitlines()
    check(r.returncode == 0 and len(lines) == 3, f"--n 3 prints 3 objects: {r.stderr}")
    check([json.loads(l)["index"] for l in lines] == [0, 1, 2], "indexes 0..2")

    # Speculative decoding (n-gram prompt lookup, early exit, a draft model) leaves greedy output
    # as it is: tokens, text, logprobs; n > 1 and stop strings included.
    code = "def f(x): return x + 1\ndef g(x): return x + 2\ndef h(x): return x + 3\ndef k(x):"
    for extra in ([], ["--n", "2", "--stop", "x)"], ["--logprobs", "3"]):
        greedy = ["generate", "--model", model, "--prompt", code, "--max-tokens", "48",
                  "--temperature", "0", "--json", *extra]
        plain = run(*greedy)
        for method in (["--speculative-method", "ngram", "--num-speculative-tokens", "5",
                        "--ngram-max", "4"],
                       ["--speculative-method", "early-exit", "--draft-layers", "1",
                        "--num-speculative-tokens", "3"],
                       ["--speculative-model", draft, "--num-speculative-tokens", "4"]):
            spec = run(*greedy, *method)
            check(plain.returncode == 0 and spec.returncode == 0,
                  f"generate with/without --speculative-method {method}: {spec.stderr}")
            check(plain.stdout == spec.stdout and plain.stdout.strip() != "",
                  f"greedy output changed by speculation ({method}, {extra})")

    # Weight-only quantised checkpoints generate; a quantization_config Tandem cannot serve stops
    # generate with one line naming the field.
    for quant in (["--quant", "int8"], ["--quant", "awq", "--group-size", "32"],
                  ["--quant", "gptq", "--group-size", "32", "--desc-act"]):
        qmodel = os.path.join(tmp, "model-" + quant[1])
        r = run("synth-model", "--out", qmodel, "--preset", "tiny", "--seed", "3", *quant)
        check(r.returncode == 0, f"synth-model {quant} failed: {r.stderr}")
        r = run("generate", "--model", qmodel, "--prompt", "Once", "--max-tokens", "6",
                "--temperature", "0", "--ignore-eos", "--json")
        check(r.returncode == 0 and len(json.loads(r.stdout or "{}").get("token_ids", [])) == 6,
              f"generate on {quant[1]} weights: {r.stderr}")
    bad_quant = os.path.join(tmp, "model-awq-8bit")
    shutil.copytree(os.path.join(tmp, "model-awq"), bad_quant)
    with open(os.path.join(bad_quant, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["bits"] = 8
    with open(os.path.join(bad_quant, "config.json"), "w") as f:
        json.dump(config, f)
    r = run("synth-model", "--out", os.path.join(tmp, "x"), "--quant", "nf4")
    check(r.returncode != 0 and "--quant" in r.stderr, f"synth-model --quant nf4: {r.stderr}")

    bad = [
        (["generate", "--model", bad_quant, "--prompt", "x"], "bits 8: Tandem reads 4-bit awq"),
        (["generate", "--prompt", "x"], "--model"),
        (["generate", "--model", model], "--prompt"),
        (["generate", "--model", model, "--prompt", "x", "--chat", "y"], "--prompt"),
        (["generate", "--model", model, "--prompt", "x", "--temperature", "9"], "temperature"),
        (["generate", "--model", model, "--prompt", "x", "--top-p", "abc"], "top-p"),
        (["generate", "--model", model, "--prompt", "x", "--bogus"], "--bogus"),
        (["generate", "--model", model, "--prompt", "x", "--max-tokens", "100000"], "context"),
        (["generate", "--model", os.path.join(tmp, "missing"), "--prompt", "x"], "config.json"),
        (["generate", "--model", model, "--prompt", "x", "--speculative-method", "eagle"],
         "--speculative-method"),
        (["generate", "--model", model, "--prompt", "x", "--num-speculative-tokens", "4"],
         "--speculative-method"),
        (["generate", "--model", model, "--prompt", "x", "--speculative-method", "ngram",
          "--num-speculative-tokens", "0"], "--num-speculative-tokens"),
        (["generate", "--model", model, "--prompt", "x", "--speculative-method", "ngram",
          "--ngram-min", "3", "--ngram-max", "2"], "--ngram-max"),
        (["generate", "--model", model, "--prompt", "x", "--speculative-method", "early-exit"],
         "--draft-layers"),
        (["generate", "--model", model, "--prompt", "x", "--speculative-method", "early-exit",
          "--draft-layers", "2"], "draft_layers"),
        (["generate", "--model", model, "--prompt", "x", "--draft-layers", "1"],
         "--speculative-method"),
        (["generate", "--model", model, "--prompt", "x", "--speculative-method", "draft-model"],
         "--speculative-model"),
        (["generate", "--model", model, "--prompt", "x", "--speculative-method", "ngram",
          "--speculative-model", draft], "--speculative-model"),
        (["generate", "--model", model, "--prompt", "x", "--speculative-model",
          os.path.join(tmp, "missing")], "draft model"),
        (["generate", "--model", model, "--prompt", "x", "--speculative-model", other_vocab],
         "vocabulary"),
        (["nonsense"], "nonsense"),
    ]
    for args, needle in bad:
        r = run(*args)
        err = r.stderr.strip().splitlines()
        check(r.returncode != 0, f"{args} exits non-zero")
        check(len(err) == 1 and needle in err[0], f"{args}: one line naming {needle!r}: {err}")

print("PASS" if not failures else f"{len(failures)} failures")
sys.exit(1 if failures else 0)
