#!/usr/bin/env python3
"""`tandem bench` refusals: a flag that cannot apply, or a value out of range, ends the command
with a non-zero exit and one line naming the flag, before any request is sent.

usage: bench_flags_test.py TANDEM
"""
import subprocess
import sys

TANDEM = sys.argv[1]
# Nothing listens there: a refusal must come before any connection is tried.
BASE = ["bench", "--url", "http://127.0.0.1:1", "--model", "m", "--num-requests", "2"]
failures = []

CASES = [
    (["--think-time", "0"], "--think-time needs --workload multi-turn"),
    (["--turns", "3"], "--turns needs --workload multi-turn"),
    (["--workload", "multi-turn", "--think-time", "-1"], "--think-time must be in [0, 3600]"),
    (["--workload", "multi-turn", "--think-time", "soon"], "think-time"),
    (["--workload", "multi-turn", "--turns", "0"], "--turns must be in [1, 1000]"),
    (["--max-concurrency", "0"], "--max-concurrency must be positive"),
    (["--workload", "chat-log"], "--workload must be synthetic or multi-turn"),
]

for extra, needle in CASES:
    r = subprocess.run([TANDEM, *BASE, *extra], capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    if r.returncode == 0 or len(lines) != 1 or needle not in lines[0]:
        failures.append(extra)
        print(f"FAIL: {extra}: exit {r.returncode}, stderr {r.stderr!r}, want one line with "
              f"{needle!r}")

print(f"{len(CASES) - len(failures)}/{len(CASES)} refusals as expected")
sys.exit(1 if failures else 0)
