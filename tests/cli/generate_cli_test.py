#!/usr/bin/env python3
"""`tandem generate` as a user runs it: output shape, determinism, and one-line refusals."""
import json
import os
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

    bad = [
        (["generate", "--prompt", "x"], "--model"),
        (["generate", "--model", model], "--prompt"),
        (["generate", "--model", model, "--prompt", "x", "--chat", "y"], "--prompt"),
        (["generate", "--model", model, "--prompt", "x", "--temperature", "9"], "temperature"),
        (["generate", "--model", model, "--prompt", "x", "--top-p", "abc"], "top-p"),
        (["generate", "--model", model, "--prompt", "x", "--bogus"], "--bogus"),
        (["generate", "--model", model, "--prompt", "x", "--max-tokens", "100000"], "context"),
        (["generate", "--model", os.path.join(tmp, "missing"), "--prompt", "x"], "config.json"),
        (["nonsense"], "nonsense"),
    ]
    for args, needle in bad:
        r = run(*args)
        err = r.stderr.strip().splitlines()
        check(r.returncode != 0, f"{args} exits non-zero")
        check(len(err) == 1 and needle in err[0], f"{args}: one line naming {needle!r}: {err}")

print("PASS" if not failures else f"{len(failures)} failures")
sys.exit(1 if failures else 0)
