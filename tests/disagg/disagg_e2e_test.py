#!/usr/bin/env python3
"""Disaggregated serving end to end: `tandem prefill`, `tandem decode` and `tandem router` as
separate processes, KV pages over UCX, driven through the OpenAI API.

- Output equals `tandem serve --colocated` token for token (greedy and seeded sampling, n=2,
  1..32 concurrent requests, prompts longer than one prefill chunk).
- Abort storm: 300 concurrent streams with long prompts, cut mid-prefill and mid-decode, four
  times, with prefix caching on (the prompts share cached blocks on both workers); afterwards a
  request succeeds and every worker's /metrics shows 0 KV blocks in use (referenced; blocks
  still cached but free are allowed).
  The decode worker runs with --step-delay-ms, so a stream cut after its first tokens still
  has seconds of generation left on any machine: the cuts are mid-decode (the router counts
  them as aborts), not after a stream that already ended.
- Prefill and decode in two network namespaces joined by a veth pair, so the KV crosses a real
  TCP link (needs CAP_NET_ADMIN; skipped, and said so, without it).

usage: disagg_e2e_test.py TANDEM_BINARY [unittest args]
"""
import ctypes
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.error
import urllib.request

TANDEM = None
MODEL = None
# Prompts span several prefill chunks of this many tokens.
CHUNK = 64
ENGINE_FLAGS = ["--threads", "1", "--max-num-batched-tokens", str(CHUNK),
                "--kv-cache-bytes", str(32 << 20)]


class ProcessesTestCase(unittest.TestCase):
    """A test case whose processes (started through `start`) stop after each test, last first."""

    def setUp(self):
        self.processes = []

    def tearDown(self):
        for p in reversed(self.processes):
            p.stop()

    def start(self, process):
        self.processes.append(process)
        return process


class Process:
    """A `tandem` subcommand whose stdout announces where it listens."""

    def __init__(self, args, pattern, netns=None, env=None):
        command = ([] if netns is None else ["ip", "netns", "exec", netns]) + [TANDEM] + args
        full_env = dict(os.environ, UCX_LOG_LEVEL="error")
        full_env.update(env or {})
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=full_env)
        self.match = None
        deadline = time.time() + 120
        lines = []
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            self.match = re.search(pattern, line)
            if self.match:
                break
        if self.match is None:
            self.stop()
            raise RuntimeError(f"{args[0]} did not start: {''.join(lines)}"
                               f"{self.proc.stderr.read()}")
        # Keep draining stderr so a chatty process never blocks on a full pipe; with
        # $TANDEM_TEST_LOGS set, into a file there per process, for debugging a failed run.
        log_dir = os.environ.get("TANDEM_TEST_LOGS")
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
            log = open(os.path.join(log_dir, f"{args[0]}-{self.proc.pid}.log"), "w")

            def copy(src=self.proc.stderr, dst=log):
                for line in src:
                    dst.write(line)
                    dst.flush()
            threading.Thread(target=copy, daemon=True).start()
        else:
            threading.Thread(target=self.proc.stderr.read, daemon=True).start()
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_worker(role, netns=None, host="127.0.0.1", extra=()):
    p = Process([role, "--model", MODEL, "--listen", f"{host}:0", "--kv-host", host,
                 "--metrics-listen", f"{host}:0"] + ENGINE_FLAGS + list(extra),
                r"listening on (\S+) \(metrics on port (\d+)\)", netns=netns)
    p.address = p.match.group(1)
    p.metrics_url = f"http://{host}:{p.match.group(2)}/metrics"
    return p


def start_router(prefill, decode, netns=None, host="127.0.0.1", extra=()):
    p = Process(["router", "--model", MODEL, "--prefill", prefill, "--decode", decode,
                 "--host", host, "--port", "0"] + list(extra), r"on (http://\S+:\d+)",
                netns=netns)
    p.url = p.match.group(1)
    return p


def start_colocated(extra=()):
    p = Process(["serve", "--colocated", "--model", MODEL, "--port", "0"] + ENGINE_FLAGS +
                list(extra), r"on (http://127\.0\.0\.1:\d+)")
    p.url = p.match.group(1)
    return p


def post(url, body, timeout=300):
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.load(r)


def metric(url, name):
    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return None if m is None else float(m.group(1))


def requests_for(count):
    """Long prompts (several chunks each), half greedy, half seeded with n=2."""
    rng = random.Random(count)
    words = ["alpha", "river", "stone", "quiet", "lamp", "orbit", "maple", "cinder", "harbor"]
    out = []
    for i in range(count):
        body = {"model": "tiny", "prompt": " ".join(rng.choice(words) for _ in range(90 + i % 7)),
                "max_tokens": 10 + i % 5, "ignore_eos": True, "logprobs": 1}
        if i % 2:
            body.update(temperature=0.8, seed=1000 + i, n=2)
        else:
            body["temperature"] = 0
        out.append(body)
    return out


def run_all(url, bodies):
    results = [None] * len(bodies)

    def one(i):
        results[i] = post(url, bodies[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def comparable(response):
    return [(c["index"], c["text"], c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"],
             c["finish_reason"]) for c in sorted(response["choices"], key=lambda c: c["index"])]


def children(pid):
    """Pids whose parent is `pid` (a tensor-parallel group's followers)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
        except OSError:
            pass
    return out


def storm(router_url, clients, prompt_words=200):
    """`clients` streams of 200 tokens at once, the even ones cut at a random moment soon after
    sending (while queued or in prefill, mostly; where it falls is not what the tests check),
    the odd ones after their first tokens; returns how many were cut mid-decode (after 3
    events). A decode worker's --step-delay-ms makes sure a stream cut after its first tokens
    still has most of its generation left."""
    host, port = re.match(r"http://([^:]+):(\d+)", router_url).groups()
    body = json.dumps({"model": "tiny", "prompt": " ".join(["storm"] * prompt_words),
                       "max_tokens": 200, "stream": True, "ignore_eos": True}).encode()
    raw = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
           f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
           ).encode() + body
    cut_mid_decode = []

    def client(i):
        s = socket.create_connection((host, int(port)), timeout=120)
        try:
            s.sendall(raw)
            if i % 2 == 0:
                time.sleep(random.uniform(0, 0.05))
                return
            data = b""
            while data.count(b"data: ") < 3:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
            if data.count(b"data: ") >= 3:
                cut_mid_decode.append(i)
        finally:
            s.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(cut_mid_decode)


def wait_for_zero(url, name, timeout=60):
    """Polls a gauge until it reads 0; returns the last value (`timeout` only catches a hang)."""
    deadline = time.time() + timeout
    value = None
    while time.time() < deadline:
        value = metric(url, name)
        if value == 0:
            return 0
        time.sleep(0.2)
    return value


class DisaggregatedServing(unittest.TestCase):
    # The decode worker's --step-delay-ms: a 200-token storm stream runs at least 4 s.
    DECODE_DELAY_MS = 20

    @classmethod
    def setUpClass(cls):
        cls.decode = start_worker("decode", extra=["--step-delay-ms", str(cls.DECODE_DELAY_MS)])
        cls.prefill = start_worker("prefill")
        cls.router = start_router(cls.prefill.address, cls.decode.address)
        cls.colocated = start_colocated()

    @classmethod
    def tearDownClass(cls):
        codes = [p.stop() for p in (cls.router, cls.colocated, cls.prefill, cls.decode)]
        assert codes == [0, 0, 0, 0], f"exit codes {codes}"

    def test_output_equals_colocated_token_for_token(self):
        for concurrency in (1, 8, 32):
            bodies = requests_for(concurrency)
            want = run_all(self.colocated.url, bodies)
            got = run_all(self.router.url, bodies)
            for i, (w, g) in enumerate(zip(want, got)):
                self.assertEqual(comparable(g), comparable(w), f"request {i} of {concurrency}")
                self.assertEqual(g["usage"], w["usage"])
        for worker in (self.prefill, self.decode):
            self.assertEqual(wait_for_zero(worker.metrics_url, "tandem_kv_cache_blocks_used"), 0)

    def test_prefix_cache_neither_computes_nor_moves_a_prompt_twice(self):
        """The same long prompt twice: the second time the prefill worker computes at most one
        block of it and the decode worker already holds (and so receives) all but its last
        block; another cache_salt shares nothing. Outputs equal the colocated server's."""
        rng = random.Random(17)
        words = ["zebra", "violet", "tundra", "saffron", "quartz", "nebula", "walnut", "fjord"]
        prompt = " ".join(rng.choice(words) for _ in range(300))
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "ignore_eos": True,
                "temperature": 0.8, "seed": 5, "logprobs": 1}
        names = ("tandem_prefix_cache_queries_tokens_total", "tandem_prefix_cache_hits_tokens_total")

        def counters():
            return {w: [metric(w.metrics_url, n) or 0 for n in names]
                    for w in (self.prefill, self.decode)}

        want = post(self.colocated.url, body)
        first = post(self.router.url, body)
        self.assertEqual(comparable(first), comparable(want))
        prompt_tokens = first["usage"]["prompt_tokens"]
        self.assertGreater(prompt_tokens, 4 * 16)
        before = counters()
        second = post(self.router.url, body)
        self.assertEqual(comparable(second), comparable(want))
        after = counters()
        for worker in (self.prefill, self.decode):
            queried = after[worker][0] - before[worker][0]
            hit = after[worker][1] - before[worker][1]
            self.assertEqual(queried, prompt_tokens, worker.metrics_url)
            self.assertLessEqual(queried - hit, 16, worker.metrics_url)

        salted = dict(body, cache_salt="another-tenant")
        before = counters()
        third = post(self.router.url, salted)
        self.assertEqual(comparable(third), comparable(want))
        after = counters()
        for worker in (self.prefill, self.decode):
            self.assertEqual(after[worker][0] - before[worker][0], prompt_tokens)
            self.assertEqual(after[worker][1] - before[worker][1], 0, worker.metrics_url)
        for worker in (self.prefill, self.decode):
            self.assertEqual(wait_for_zero(worker.metrics_url, "tandem_kv_cache_blocks_used"), 0)

    def test_abort_storm_leaks_no_kv_block(self):
        router_metrics = self.router.url + "/metrics"
        aborts = 'tandem_requests_total{finish_reason="abort"}'
        completed = 'tandem_requests_total{finish_reason="length"}'
        aborted_before = metric(router_metrics, aborts) or 0
        completed_before = metric(router_metrics, completed) or 0
        # The storm's prompts are all alike: with prefix caching on (the workers' default) they
        # share cached blocks, on both workers, while they are cut.
        hits = "tandem_prefix_cache_hits_tokens_total"
        hits_before = {w: metric(w.metrics_url, hits) or 0 for w in (self.prefill, self.decode)}
        mid_decode = sum(storm(self.router.url, 300, prompt_words=300) for _ in range(4))
        self.assertEqual(mid_decode, 600)
        # Every storm stream was cut while it ran: once the router is done with them all, each
        # one cut after its first tokens counts as an abort, and none ran to its end.
        self.assertEqual(wait_for_zero(router_metrics, "tandem_api_requests_in_flight"), 0)
        self.assertGreaterEqual((metric(router_metrics, aborts) or 0) - aborted_before, 600)
        self.assertEqual(metric(router_metrics, completed) or 0, completed_before,
                         "a storm stream ran to its end: its client's cut went unnoticed")
        # The next request is served in full.
        r = post(self.router.url, {"model": "tiny", "prompt": "after the storm", "max_tokens": 8,
                                   "ignore_eos": True, "temperature": 0})
        self.assertEqual(r["usage"]["completion_tokens"], 8)
        for worker in (self.prefill, self.decode):
            # No block is referenced any more (cached-but-free blocks are not "used").
            self.assertEqual(wait_for_zero(worker.metrics_url, "tandem_kv_cache_blocks_used"), 0,
                             worker.metrics_url)
            self.assertEqual(worker.proc.poll(), None, "a worker died in the storm")
            self.assertGreater((metric(worker.metrics_url, hits) or 0) - hits_before[worker], 0,
                               f"{worker.metrics_url}: the storm shared no cached block")
        self.assertEqual(wait_for_zero(self.decode.metrics_url, "tandem_kv_cache_blocks_reserved"),
                         0)


    def test_requests_predicted_to_miss_the_ttft_target_are_refused_at_once(self):
        # A target no request can meet on this machine: once the router has learned the
        # prefill worker's speed (8 requests), the next ones are refused before any work.
        strict = start_router(self.prefill.address, self.decode.address,
                              extra=["--ttft-slo", "0.000001"])
        lenient = start_router(self.prefill.address, self.decode.address,
                               extra=["--ttft-slo", "100"])
        try:
            body = {"model": "tiny", "prompt": " ".join(["harbor"] * 200), "max_tokens": 2,
                    "temperature": 0}
            for _ in range(8):
                post(strict.url, body)
            request = urllib.request.Request(
                strict.url + "/v1/completions", data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"})
            with self.assertRaises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=60)
            self.assertEqual(refused.exception.code, 529)
            self.assertEqual(refused.exception.headers["Retry-After"], "1")
            error = json.load(refused.exception)["error"]
            self.assertIn("predicted time to first token", error["message"])
            # Nothing was reserved or queued for it.
            self.assertEqual(wait_for_zero(self.decode.metrics_url,
                                           "tandem_kv_cache_blocks_reserved"), 0)
            # A reachable target admits everything.
            for _ in range(10):
                self.assertEqual(post(lenient.url, body)["usage"]["completion_tokens"], 2)
        finally:
            self.assertEqual(strict.stop(), 0)
            self.assertEqual(lenient.stop(), 0)


CLONE_NEWNET = 0x40000000


class AcrossNetworkNamespaces(unittest.TestCase):
    """Prefill (with the router) in one namespace, decode in another, joined by veth."""

    def setUp(self):
        suffix = str(os.getpid())
        self.ns_p, self.ns_d = f"tandem-p-{suffix}", f"tandem-d-{suffix}"
        self.made = []
        add = subprocess.run(["ip", "netns", "add", self.ns_p], capture_output=True, text=True)
        if add.returncode != 0:
            self.skipTest(f"cannot create network namespaces here: {add.stderr.strip()}")
        self.made.append(self.ns_p)
        commands = [
            ["ip", "netns", "add", self.ns_d],
            ["ip", "link", "add", f"tp{suffix}", "type", "veth", "peer", "name", f"td{suffix}"],
            ["ip", "link", "set", f"tp{suffix}", "netns", self.ns_p],
            ["ip", "link", "set", f"td{suffix}", "netns", self.ns_d],
            ["ip", "-n", self.ns_p, "addr", "add", "10.77.0.1/24", "dev", f"tp{suffix}"],
            ["ip", "-n", self.ns_d, "addr", "add", "10.77.0.2/24", "dev", f"td{suffix}"],
            ["ip", "-n", self.ns_p, "link", "set", f"tp{suffix}", "up"],
            ["ip", "-n", self.ns_d, "link", "set", f"td{suffix}", "up"],
            ["ip", "-n", self.ns_p, "link", "set", "lo", "up"],
            ["ip", "-n", self.ns_d, "link", "set", "lo", "up"],
        ]
        for c in commands:
            subprocess.run(c, check=True, capture_output=True)
            if c[:3] == ["ip", "netns", "add"]:
                self.made.append(c[3])
        self.processes = []

    def tearDown(self):
        for p in reversed(self.processes):
            p.stop()
        for ns in self.made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def test_kv_crosses_a_veth_link(self):
        decode = start_worker("decode", netns=self.ns_d, host="10.77.0.2")
        self.processes.append(decode)
        prefill = start_worker("prefill", netns=self.ns_p, host="10.77.0.1")
        self.processes.append(prefill)
        router = start_router(prefill.address, decode.address, netns=self.ns_p, host="10.77.0.1")
        self.processes.append(router)
        colocated = start_colocated()
        self.processes.append(colocated)
        bodies = requests_for(4)
        want = run_all(colocated.url, bodies)
        # This thread joins the prefill namespace to reach the router; the root namespace
        # cannot route to 10.77.0.0/24.
        libc = ctypes.CDLL(None, use_errno=True)
        own = os.open("/proc/self/ns/net", os.O_RDONLY)
        target = os.open(f"/run/netns/{self.ns_p}", os.O_RDONLY)
        try:
            self.assertEqual(libc.setns(target, CLONE_NEWNET), 0, os.strerror(ctypes.get_errno()))
            got = run_all(router.url, bodies)
            transferred = metric(prefill.metrics_url, "tandem_kv_transfer_bytes_total")
            decode_used = wait_for_zero(decode.metrics_url, "tandem_kv_cache_blocks_used")
        finally:
            libc.setns(own, CLONE_NEWNET)
            os.close(own)
            os.close(target)
        for w, g in zip(want, got):
            self.assertEqual(comparable(g), comparable(w))
        self.assertGreater(transferred, 0)
        self.assertEqual(decode_used, 0)


class SpeculativeDecodeWorker(unittest.TestCase):
    """A decode worker verifying n-gram proposals (--speculative-method ngram), or a draft
    model's (--speculative-model, which first computes its own KV of each prompt the prefill
    worker sent), streams the greedy output of a colocated server without speculation, token
    for token, with logprobs, and exports what it proposed and accepted, which the router's
    /metrics sums; a colocated server speculating alike gives the same output and exports its
    own."""

    def test_greedy_output_equals_colocated_without_speculation(self):
        # The model's first layer as a model of its own.
        draft = os.path.join(os.path.dirname(MODEL), "tiny-draft")
        subprocess.run([TANDEM, "synth-model", "--preset", "tiny", "--num-layers", "1", "--out",
                        draft], check=True, stdout=subprocess.DEVNULL)
        for method in (["--speculative-method", "ngram"], ["--speculative-model", draft]):
            with self.subTest(method=method[0]):
                self.check_speculating_decode_worker(method)

    def check_speculating_decode_worker(self, method):
        # A fixed draft length: the adaptive one follows measured step times.
        spec = method + ["--num-speculative-tokens", "4", "--no-speculative-adaptive"]
        decode = start_worker("decode", extra=spec)
        prefill = start_worker("prefill")
        router = start_router(prefill.address, decode.address)
        colocated = start_colocated()
        speculating = start_colocated(spec)
        try:
            bodies = [dict(b, temperature=0, max_tokens=24) for b in requests_for(8)]
            for b in bodies:
                b.pop("seed", None)
                b.pop("n", None)
            want = run_all(colocated.url, bodies)
            got = run_all(router.url, bodies)
            for i, (w, g) in enumerate(zip(want, got)):
                self.assertEqual(comparable(g), comparable(w), f"request {i}")
            accepted = metric(decode.metrics_url, "tandem_spec_accepted_tokens_total") or 0
            self.assertGreater(accepted, 0)
            # The router's /metrics sums its decode workers' (from their polled stats, so both
            # counters are waited for: a last step may propose and accept nothing). The worker's
            # own counters are read afresh each time too: its last steps may still be counted
            # after the responses have arrived.
            names = ("tandem_spec_accepted_tokens_total", "tandem_spec_proposed_tokens_total")
            deadline = time.time() + 60
            while True:
                on_worker = [metric(decode.metrics_url, n) for n in names]
                on_router = [metric(router.url + "/metrics", n) for n in names]
                if on_router == on_worker or time.time() >= deadline:
                    break
                time.sleep(0.05)
            self.assertEqual(on_router, on_worker)
            # A colocated server speculating the same way: the same output, and its /metrics
            # shows what its engine proposed and accepted.
            for i, (w, g) in enumerate(zip(want, run_all(speculating.url, bodies))):
                self.assertEqual(comparable(g), comparable(w), f"colocated, request {i}")
            self.assertGreater(
                metric(speculating.url + "/metrics", "tandem_spec_accepted_tokens_total") or 0, 0)
            self.assertEqual(wait_for_zero(decode.metrics_url, "tandem_kv_cache_blocks_used"), 0)
        finally:
            codes = [p.stop() for p in (router, colocated, speculating, prefill, decode)]
        self.assertEqual(codes, [0, 0, 0, 0, 0])


def main():
    global TANDEM, MODEL
    TANDEM = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        MODEL = os.path.join(tmp, "tiny")
        subprocess.run([TANDEM, "synth-model", "--preset", "tiny", "--out", MODEL], check=True,
                       stdout=subprocess.DEVNULL)
        unittest.main(argv=[sys.argv[0]] + sys.argv[2:], verbosity=2)


if __name__ == "__main__":
    main()
