#!/usr/bin/env python3
"""Mutual TLS on the internal plane, end to end with the `tandem` binary.

- A prefill and a decode worker serve their control plane over mutual TLS and register in an etcd
  that requires client certificates (https, --client-cert-auth); a router given the workers'
  addresses and a router discovering them through that etcd both serve a request.
- A router whose certificate comes from another CA cannot read etcd and exits with the reason.
- Incomplete or unusable TLS flags exit 1 with one line.
Certificates are made at test time by tests/tls/make-certs.sh (openssl).

usage: tls_e2e_test.py TANDEM_BINARY [unittest args]
"""
import os
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.error

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "disagg"))
sys.path.insert(0, os.path.join(HERE, "..", "chaos"))
import disagg_e2e_test as cluster  # noqa: E402  (process helpers)
import chaos_test  # noqa: E402  (free_port)

ETCD = "/usr/bin/etcd"
CERTS = None


def tls_flags(leaf):
    return ["--tls-ca", os.path.join(CERTS, "ca.pem"), "--tls-cert",
            os.path.join(CERTS, f"{leaf}.pem"), "--tls-key", os.path.join(CERTS, f"{leaf}.key")]


class TlsEtcd:
    """A one-member etcd serving clients on https and requiring a certificate of the test CA."""

    def __init__(self, data_dir):
        client_port, peer_port = chaos_test.free_port(), chaos_test.free_port()
        self.endpoint = f"https://127.0.0.1:{client_port}"
        peer = f"http://127.0.0.1:{peer_port}"
        self.log = os.path.join(data_dir, "etcd.log")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [ETCD, "--name", "tls", "--data-dir", os.path.join(data_dir, "data"),
                 "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"tls={peer}",
                 "--client-cert-auth", "--trusted-ca-file", os.path.join(CERTS, "ca.pem"),
                 "--cert-file", os.path.join(CERTS, "server.pem"),
                 "--key-file", os.path.join(CERTS, "server.key")],
                stdout=log, stderr=log)
        deadline = time.time() + 60  # only a hung etcd takes this long
        while time.time() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", client_port), timeout=1):
                    return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("etcd did not start")

    def stop(self):
        self.proc.kill()
        self.proc.wait()


def serve_one(url, timeout=60):
    """One greedy request, retried while the router has no worker up yet (etcd discovery, the
    first stats poll); `timeout` only catches a router that never gets one."""
    body = {"model": "tiny", "prompt": "the quiet harbor keeps its lamps lit", "max_tokens": 8,
            "ignore_eos": True, "temperature": 0}
    deadline = time.time() + timeout
    while True:
        try:
            return cluster.post(url, body, timeout=60)
        except urllib.error.HTTPError as e:
            if e.code not in (503, 529) or time.time() > deadline:
                raise
            time.sleep(0.2)


class MutualTls(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not os.path.exists(ETCD):
            raise RuntimeError(f"{ETCD} is missing: run scripts/install-deps (etcd-server)")
        cls.tmp = tempfile.TemporaryDirectory()
        cls.etcd = TlsEtcd(cls.tmp.name)
        cls.workers = {}
        try:
            for role in ("prefill", "decode"):
                address = f"127.0.0.1:{chaos_test.free_port()}"
                w = cluster.Process(
                    [role, "--model", cluster.MODEL, "--listen", address,
                     "--etcd", cls.etcd.endpoint, "--cluster", "tls", "--worker-id", f"{role}-0"]
                    + tls_flags("server") + cluster.ENGINE_FLAGS,
                    r"registered in etcd as (\S+)")
                w.address, w.key = address, w.match.group(1)
                cls.workers[role] = w
        except Exception:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        for w in cls.workers.values():
            w.stop()
        cls.etcd.stop()
        cls.tmp.cleanup()

    def test_workers_register_through_tls_etcd(self):
        self.assertEqual(self.workers["prefill"].key, "/tandem/tls/workers/prefill/prefill-0")
        self.assertEqual(self.workers["decode"].key, "/tandem/tls/workers/decode/decode-0")

    def serve_through(self, router):
        try:
            response = serve_one(router.match.group(1))
            self.assertEqual(response["usage"]["completion_tokens"], 8)
            self.assertEqual(response["choices"][0]["finish_reason"], "length")
        finally:
            self.assertEqual(router.stop(), 0)

    def test_router_with_listed_workers(self):
        self.serve_through(cluster.Process(
            ["router", "--model", cluster.MODEL, "--prefill", self.workers["prefill"].address,
             "--decode", self.workers["decode"].address, "--port", "0"] + tls_flags("client"),
            r"on (http://\S+:\d+)"))

    def test_router_discovering_workers_through_tls_etcd(self):
        self.serve_through(cluster.Process(
            ["router", "--model", cluster.MODEL, "--etcd", self.etcd.endpoint, "--cluster", "tls",
             "--port", "0"] + tls_flags("client"), r"on (http://\S+:\d+)"))

    def test_router_with_a_foreign_certificate_cannot_read_etcd(self):
        result = subprocess.run(
            [cluster.TANDEM, "router", "--model", cluster.MODEL, "--etcd", self.etcd.endpoint,
             "--cluster", "tls", "--port", "0",
             "--tls-ca", os.path.join(CERTS, "ca.pem"),
             "--tls-cert", os.path.join(CERTS, "rogue.pem"),
             "--tls-key", os.path.join(CERTS, "rogue.key")],
            capture_output=True, text=True, timeout=60)
        self.assertEqual(result.returncode, 1, result.stderr)
        last = result.stderr.strip().splitlines()[-1]
        self.assertTrue(last.startswith("tandem router: ") and "etcd" in last, last)


class BadFlags(unittest.TestCase):
    """Each exits 1 with one line on stderr, before serving anything."""

    def check(self, args, expected):
        result = subprocess.run([cluster.TANDEM] + args, capture_output=True, text=True,
                                timeout=60)
        self.assertEqual(result.returncode, 1, result.stderr)
        lines = result.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, result.stderr)
        self.assertIn(expected, lines[0])

    def test_incomplete_or_unusable_tls_flags(self):
        ca = os.path.join(CERTS, "ca.pem")
        cert = os.path.join(CERTS, "server.pem")
        key = os.path.join(CERTS, "server.key")
        model = ["--model", cluster.MODEL]
        for role in ("prefill", "decode"):
            self.check([role] + model + ["--tls-ca", ca],
                       "--tls-ca, --tls-cert and --tls-key go together (missing --tls-cert, "
                       "--tls-key)")
            self.check([role] + model + ["--tls-ca", ca, "--tls-cert", cert, "--tls-key",
                                         "/nonexistent.key"],
                       "TLS key file '/nonexistent.key' cannot be read")
            self.check([role] + model + ["--tls-ca", ca, "--tls-cert", key, "--tls-key", key],
                       f"TLS certificate file '{key}' is not a PEM CERTIFICATE")
            self.check([role] + model + ["--etcd", "https://127.0.0.1:2379"],
                       "needs TLS files (--tls-ca, --tls-cert, --tls-key)")
            self.check([role] + model + ["--etcd", "http://127.0.0.1:2379", "--tls-ca", ca,
                                         "--tls-cert", cert, "--tls-key", key],
                       "is plaintext but TLS is configured: use https://")
        router = ["router"] + model + ["--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"]
        self.check(router + ["--tls-cert", cert, "--tls-key", key], "(missing --tls-ca)")
        self.check(router + ["--tls-server-name", "tandem-internal"],
                   "--tls-server-name needs --tls-ca, --tls-cert and --tls-key")
        self.check(["router"] + model + ["--etcd", "https://127.0.0.1:2379"],
                   "needs TLS files")


class ListenerDefaults(unittest.TestCase):
    """Internal listeners bind loopback unless told otherwise (docs/operations.md)."""

    def test_defaults_are_loopback(self):
        for command, flags in (("prefill", {"listen": "127.0.0.1:7001", "kv-host": "127.0.0.1"}),
                               ("decode", {"listen": "127.0.0.1:7002", "kv-host": "127.0.0.1"}),
                               ("router", {"host": "127.0.0.1"}),
                               ("serve", {"host": "127.0.0.1"})):
            help_text = subprocess.run([cluster.TANDEM, command, "--help"], capture_output=True,
                                       text=True, timeout=30)
            text = help_text.stdout + help_text.stderr
            for flag, default in flags.items():
                line = next(l for l in text.splitlines() if l.strip().startswith(f"--{flag} "))
                self.assertIn(f"(default {default}", line, f"{command} --{flag}")
            if command in ("prefill", "decode"):
                line = next(l for l in text.splitlines()
                            if l.strip().startswith("--metrics-listen "))
                self.assertIn("(default: not served)", line)


def main():
    global CERTS
    cluster.TANDEM = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        CERTS = os.path.join(tmp, "certs")
        subprocess.run([os.path.join(HERE, "make-certs.sh"), CERTS], check=True)
        cluster.MODEL = os.path.join(tmp, "tiny")
        subprocess.run([cluster.TANDEM, "synth-model", "--preset", "tiny", "--out", cluster.MODEL],
                       check=True, stdout=subprocess.DEVNULL)
        unittest.main(argv=[sys.argv[0]] + sys.argv[2:], verbosity=2)


if __name__ == "__main__":
    main()
