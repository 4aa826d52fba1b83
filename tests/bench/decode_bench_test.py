#!/usr/bin/env python3
"""tandem_bench_decode's paired mode on a one-layer synthetic checkpoint: each format's figures
count only a turn's timed steps (--turn-warmup leaves the first K of every turn untimed), and
flags that cannot apply are refused with one line and exit status 2.

usage: decode_bench_test.py TANDEM_BENCH_DECODE
"""
import json
import subprocess
import sys

TURN, WARMUP = 5, 2


def check(cond, message):
    if not cond:
        print("FAIL:", message, file=sys.stderr)
        sys.exit(1)


def run(binary, *flags):
    return subprocess.run([binary, *flags], capture_output=True, text=True, timeout=120)


def paired_run(binary, *extra):
    done = run(binary, "--preset=small", "--num-layers=1", "--batches=1",
               "--dtypes=float32,bfloat16", f"--paired={TURN}", "--bandwidth-mib=16",
               "--benchmark_min_time=0.01", "--benchmark_format=json", *extra)
    check(done.returncode == 0, f"paired run {extra} exited {done.returncode}: {done.stderr}")
    report = json.loads(done.stdout[done.stdout.index("{"):])
    (bench,) = report["benchmarks"]
    check(bench["name"].startswith("BM_DecodeStepPaired/float32,bfloat16/1"), bench["name"])
    for name in ("float32_ms", "bfloat16_ms", "bfloat16_speedup", "read_GB_per_s"):
        check(bench.get(name, 0) > 0, f"{name} missing or not positive in {bench}")
    return bench


def main():
    binary = sys.argv[1]

    bench = paired_run(binary, f"--turn-warmup={WARMUP}")
    check(bench["turn_steps"] == TURN and bench["turn_warmup"] == WARMUP, bench)
    check(bench["timed_steps"] == bench["iterations"] * (TURN - WARMUP),
          f"{bench['iterations']} turns of {TURN} steps, {WARMUP} untimed, "
          f"timed {bench['timed_steps']}")

    bench = paired_run(binary)
    check(bench["turn_warmup"] == 0, bench)
    check(bench["timed_steps"] == bench["iterations"] * TURN,
          f"{bench['iterations']} turns of {TURN} steps, timed {bench['timed_steps']}")

    for flags, says in [
        (["--turn-warmup=2"], "needs --paired=N"),
        ([f"--paired={TURN}", f"--turn-warmup={TURN}"], "needs --paired=N"),
        (["--paired=4", "--turn-warmup=-1"], "takes 0 to 999"),
        (["--paired=4", "--turn-warmup=two"], "takes 0 to 999"),
        (["--paired=0"], "takes 1 to 1000"),
    ]:
        done = run(binary, *flags)
        lines = done.stderr.strip().splitlines()
        check(done.returncode == 2, f"{flags}: exit {done.returncode}, stderr {done.stderr!r}")
        check(len(lines) == 1 and says in lines[0], f"{flags}: {done.stderr!r}")
        check("BM_" not in done.stdout, f"{flags} ran a benchmark: {done.stdout!r}")
    print("decode_bench_test: ok")


if __name__ == "__main__":
    main()
