#!/usr/bin/env python3
"""`--tensor-parallel-size` / `--tp` as a user runs it: `tandem generate` over 2 and 4 processes
gives the tokens of one process (logprobs within 1e-4, seeded sampling identical), flags that
cannot work are refused in one line, and a rank that dies takes its group down with a one-line
reason instead of a hang (`serve --colocated --tp 2`, a follower killed with SIGKILL; and the
leader killed: its followers go with it); a decode group started rank by rank meets on etcd
(`--tp-name`)."""
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "disagg"))
from disagg_e2e_test import children  # noqa: E402  (process helpers shared by the tests)

TANDEM = sys.argv[1]
failures = []
HANG_GUARD_S = 120  # a guard against hangs only; nothing here depends on how fast it runs


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def run(*args):
    return subprocess.run([TANDEM, *args], capture_output=True, text=True, timeout=HANG_GUARD_S)


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_serve(model, *extra):
    proc = subprocess.Popen([TANDEM, "serve", "--colocated", "--model", model, "--port", "0",
                             "--threads", "1", "--tp", "2", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    check("tensor-parallel over 2 ranks" in line, f"serve says it runs 2 ranks: {line!r}")
    url = line.split(" on ", 1)[1].split(" ", 1)[0] if " on " in line else None
    return proc, url


def complete(url, prompt):
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=HANG_GUARD_S) as r:
        return json.loads(r.read())


with tempfile.TemporaryDirectory() as tmp:
    model = os.path.join(tmp, "tiny")
    r = run("synth-model", "--out", model, "--preset", "tiny", "--arch", "qwen3", "--seed", "5",
            "--dtype", "float32")
    check(r.returncode == 0, f"synth-model failed: {r.stderr}")

    def generate(tp, *extra):
        r = run("generate", "--model", model, "--prompt", "Tensor parallel", "--max-tokens", "64",
                "--ignore-eos", "--json", "--threads", "1", "--tp", str(tp), *extra)
        check(r.returncode == 0, f"generate --tp {tp} {extra}: {r.stderr}")
        check(r.stderr == "", f"generate --tp {tp} prints nothing on stderr: {r.stderr!r}")
        lines = r.stdout.strip().splitlines()
        check(len(lines) == 1, f"generate --tp {tp}: one sample printed once: {r.stdout!r}")
        return json.loads(lines[0]) if lines else {"token_ids": [], "logprobs": []}

    greedy = ["--temperature", "0"]
    seeded = ["--temperature", "0.9", "--top-p", "0.9", "--seed", "17"]
    want = generate(1, *greedy)
    check(len(want["token_ids"]) == 64, "64 tokens")
    for tp in (2, 4):
        got = generate(tp, *greedy)
        check(got["token_ids"] == want["token_ids"], f"--tp {tp}: greedy tokens of --tp 1")
        diff = max((abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"])), default=1)
        check(diff <= 1e-4, f"--tp {tp}: logprobs within 1e-4 (max difference {diff})")
    check(generate(2, "--tensor-parallel-size", "2", *seeded)["token_ids"] ==
          generate(1, *seeded)["token_ids"], "seeded sampling: --tp 2 gives the tokens of --tp 1")

    qmodel = os.path.join(tmp, "gptq-act-order")
    r = run("synth-model", "--out", qmodel, "--preset", "tiny", "--quant", "gptq",
            "--group-size", "32", "--desc-act")
    check(r.returncode == 0, f"synth-model --quant gptq --desc-act: {r.stderr}")
    # Act-order checkpoints shard (their groups of unequal size per rank).
    r = run("generate", "--model", qmodel, "--prompt", "x", "--threads", "1", "--tp", "2",
            "--max-tokens", "4")
    check(r.returncode == 0, f"--tp 2 on an act-order GPTQ checkpoint runs: {r.stderr}")
    base = ["generate", "--model", model, "--prompt", "x", "--threads", "1"]
    bad = [
        (base + ["--tp", "3"], "does not divide the 4 attention heads"),
        (base + ["--tp", "0"], "--tensor-parallel-size must be in [1, 64]"),
        (base + ["--tp", "2", "--tensor-parallel-size", "4"], "differ"),
        (base + ["--tp", "2", "--tp-rank", "1"], "--tp-rank needs --tp-leader"),
        (base + ["--tp", "2", "--tp-rank", "2", "--tp-leader", "127.0.0.1:1"], "--tp-rank must be"),
        (base + ["--tp-leader", "127.0.0.1:1"], "need --tensor-parallel-size > 1"),
        (base + ["--tp", "2", "--tp-rank", "1", "--tp-leader", "127.0.0.1:1", "--tp-name", "g"],
         "give one of --tp-leader and --tp-name"),
        (base + ["--tp", "2", "--tp-name", "g"], "--tp-name needs --tp-rank"),
        (base + ["--tp", "2", "--tp-rank", "0", "--tp-name", "a/b"], "--tp-name"),
        (base + ["--tp", "2", "--tp-rank", "0", "--tp-name", "g"], "--tp-name needs --etcd"),
        (["serve", "--model", model, "--port", "0", "--tp", "2"],
         "give the workers theirs with --prefill-tp N and --decode-tp M"),
        (["serve", "--colocated", "--model", model, "--port", "0", "--decode-tp", "2"],
         "--decode-tp has no use with --colocated"),
        (["serve", "--model", model, "--port", "0", "--prefill-tp", "2", "--kv-backend",
          "local"], "use ucx with --prefill-tp / --decode-tp"),
        (["serve", "--model", model, "--port", "0", "--decode-tp", "3"],
         "does not divide the 4 attention heads"),
        (["decode", "--model", model, "--listen", "127.0.0.1:0", "--tp", "3"],
         "does not divide the 4 attention heads"),
        (base + ["--tp-group", "prefill"], "--tp-group is set by `serve"),
        (base + ["--tp", "2", "--speculative-method", "ngram", "--num-speculative-tokens", "2"],
         "--speculative-method does not run with --tensor-parallel-size > 1"),
    ]
    for args, needle in bad:
        r = run(*args)
        lines = r.stderr.strip().splitlines()
        check(r.returncode != 0, f"{args} fails")
        check(len(lines) == 1 and needle in r.stderr, f"{args}: one line naming {needle!r}: "
              f"{r.stderr!r}")

    # A decode group whose two ranks are started by hand (as on two nodes) and meet on etcd
    # (--tp-name): the follower first, then rank 0, which joins, registers and serves; SIGINT
    # to rank 0 ends both, exit 0.
    etcd_port, peer_port = free_port(), free_port()
    etcd_url = f"http://127.0.0.1:{etcd_port}"
    etcd = subprocess.Popen(
        ["/usr/bin/etcd", "--name", "tp", "--data-dir", os.path.join(tmp, "etcd"),
         "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
         "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
         "--initial-cluster", f"tp=http://127.0.0.1:{peer_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # etcd accepts connections before the ranks start (a worker gives up on an etcd it
        # cannot reach).
        for _ in range(HANG_GUARD_S * 10):
            try:
                with socket.create_connection(("127.0.0.1", etcd_port), timeout=1):
                    break
            except OSError:
                time.sleep(0.1)
        ranks = []
        for rank in (1, 0):
            ranks.append(subprocess.Popen(
                [TANDEM, "decode", "--model", model, "--listen", "127.0.0.1:0", "--threads", "1",
                 "--tp", "2", "--tp-rank", str(rank), "--tp-name", "decode-g0", "--etcd",
                 etcd_url, "--worker-id", "decode-g0", "--metrics-listen", "127.0.0.1:0"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        follower, leader = ranks
        # The follower answers its pod's probes (a LeaderWorkerSet worker pod has its own).
        line = follower.stdout.readline()
        check("tensor-parallel rank 1: health on port" in line, f"the follower's health: {line!r}")
        if "health on port" in line:
            port = int(line.rsplit(" ", 1)[1])
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health",
                                        timeout=HANG_GUARD_S) as r:
                check(r.status == 200, f"the follower's /health answers 200: {r.status}")
        lines = []
        for line in leader.stdout:
            lines.append(line)
            if "registered in etcd" in line:
                break
        check(any("registered in etcd" in l for l in lines),
              f"rank 0 of a --tp-name group joins and registers: {lines}")
        leader.send_signal(signal.SIGINT)
        for name, proc in (("rank 0", leader), ("rank 1", follower)):
            try:
                code = proc.wait(timeout=HANG_GUARD_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = None
            check(code == 0, f"--tp-name group {name} exits 0 after SIGINT to rank 0: {code}, "
                  f"{proc.stderr.read()[-500:]!r}")
    finally:
        etcd.kill()
        etcd.wait()

    # serve --colocated --tp 2 answers, then a follower killed with SIGKILL ends the group with
    # a one-line reason and a non-zero exit.
    proc, url = start_serve(model)
    if url:
        out = complete(url, "Hello")
        check(len(out["choices"][0]["text"]) > 0 or out["usage"]["completion_tokens"] == 8,
              f"a completion over 2 ranks: {out}")
        followers = children(proc.pid)
        check(len(followers) == 1, f"serve --tp 2 started one follower: {followers}")
        for pid in followers:
            os.kill(pid, signal.SIGKILL)
        try:
            code = proc.wait(timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = None
        err = proc.stderr.read()
        check(code not in (0, None), f"serve exits non-zero when a rank dies: {code}")
        check("tensor-parallel rank 1" in err and "killed by signal 9" in err,
              f"serve names the rank that died: {err!r}")
    else:
        proc.kill()
        proc.wait()

    # The leader killed: its follower goes with it (it never outlives the group).
    proc, url = start_serve(model)
    followers = children(proc.pid)
    check(len(followers) == 1, f"serve --tp 2 started one follower: {followers}")
    proc.kill()
    proc.wait()
    for pid in followers:
        try:
            os.waitpid(pid, 0)  # not our child: fails at once; the loop below watches it
        except ChildProcessError:
            pass
        import time
        deadline = time.monotonic() + HANG_GUARD_S
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        check(not alive(pid), "the follower dies with its leader")

    # /metrics counts collective time and bytes; SIGTERM: the leader shuts down in order, its
    # follower exits with it, status 0.
    proc, url = start_serve(model)
    if url:
        complete(url, "Bye")
        with urllib.request.urlopen(url + "/metrics", timeout=HANG_GUARD_S) as r:
            metrics = r.read().decode()
        values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                  if line.startswith("tandem_tensor_parallel_collective_")}
        check(values.get("tandem_tensor_parallel_collective_bytes_total", 0) > 0 and
              values.get("tandem_tensor_parallel_collective_seconds_total", 0) > 0,
              f"/metrics counts the collectives: {values}")
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=HANG_GUARD_S)
    err = proc.stderr.read()
    check(code == 0, f"serve --tp 2 exits 0 on SIGTERM: {code} {err!r}")

if failures:
    print(f"{len(failures)} failure(s)")
    sys.exit(1)
print("ok")
