#!/usr/bin/env python3
"""The router's pools with workers listed on the command line (`tandem router --prefill/--decode`)
when one of them does not answer:

- A listed decode worker that is down at start-up: the router starts anyway, names it on
  stderr, serves through the workers that answer, shows it down in `tandem_workers`, and takes
  it in (state up, requests routed to it) once a decode worker listens at that address.
- A listed decode worker that is hung (its port accepts connections and never answers): the
  router serves requests through the other one, and its own /metrics answers from the last
  Stats round without waiting for the hung worker, showing it down.

Every wait has a generous bound that only a hang reaches; nothing depends on machine speed.

usage: router_pool_test.py TANDEM_BINARY [unittest args]
"""
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import disagg_e2e_test as cluster  # noqa: E402  (process helpers shared with the disagg tests)

BODY = {"model": "tiny", "prompt": "the quiet harbor keeps its lamps lit", "max_tokens": 6,
        "temperature": 0, "ignore_eos": True}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workers_gauge(url, role, state):
    return cluster.metric(url + "/metrics", f'tandem_workers{{role="{role}",state="{state}"}}')


def wait_until(condition, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


class HungWorker:
    """A port that accepts TCP connections and never sends a byte (a wedged process)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.held = []
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self):
        self.closed = True
        self.sock.close()
        for conn in self.held:
            conn.close()


class RouterPoolTest(cluster.ProcessesTestCase):
    def test_a_listed_worker_down_at_start_is_taken_in_when_it_answers(self):
        prefill = self.start(cluster.start_worker("prefill"))
        decode = self.start(cluster.start_worker("decode"))
        later = f"127.0.0.1:{free_port()}"  # nothing listens there yet
        router = self.start(cluster.start_router(prefill.address, f"{decode.address},{later}"))
        url = router.url
        self.assertTrue(wait_until(lambda: workers_gauge(url, "decode", "down") == 1))
        self.assertEqual(workers_gauge(url, "decode", "up"), 1)
        # Served through the decode worker that answers.
        for _ in range(3):
            self.assertEqual(cluster.post(url, BODY)["choices"][0]["finish_reason"], "length")
        # A decode worker comes up at the listed address: the router takes it in.
        second = self.start(cluster.Process(
            ["decode", "--model", cluster.MODEL, "--listen", later, "--kv-host", "127.0.0.1",
             "--metrics-listen", "127.0.0.1:0"] + cluster.ENGINE_FLAGS,
            r"listening on (\S+) \(metrics on port (\d+)\)"))
        second_metrics = f"http://127.0.0.1:{second.match.group(2)}/metrics"
        self.assertTrue(wait_until(lambda: workers_gauge(url, "decode", "up") == 2),
                        "the router never took the new decode worker in")
        self.assertEqual(workers_gauge(url, "decode", "down"), 0)
        # Requests reach it: with the first worker's batch held busy, placement spreads work,
        # so send until the newcomer has started one (bounded: a hang only).
        started = lambda: (cluster.metric(second_metrics, "tandem_decode_requests_total") or 0) > 0
        deadline = time.time() + 120
        while not started() and time.time() < deadline:
            threads = [threading.Thread(target=cluster.post, args=(url, BODY)) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        self.assertTrue(started(), "no request was routed to the worker taken in")

    def test_a_hung_listed_worker_slows_neither_requests_nor_metrics(self):
        hung = HungWorker()
        self.addCleanup(hung.close)
        prefill = self.start(cluster.start_worker("prefill"))
        decode = self.start(cluster.start_worker("decode"))
        router = self.start(cluster.start_router(prefill.address,
                                                 f"{decode.address},{hung.address}"))
        url = router.url
        self.assertTrue(wait_until(lambda: workers_gauge(url, "decode", "down") == 1))
        for _ in range(3):
            self.assertEqual(cluster.post(url, BODY)["choices"][0]["finish_reason"], "length")
        # The router's scrape shows the last round: the hung worker down, the other up, and the
        # requests it served (counted just after each response, so wait for the third).
        finished = 'tandem_requests_total{finish_reason="length"}'
        self.assertTrue(wait_until(lambda: cluster.metric(url + "/metrics", finished) == 3))
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        self.assertRegex(text, r'(?m)^tandem_workers\{role="decode",state="up"\} 1$')
        self.assertRegex(text, r'(?m)^tandem_workers\{role="decode",state="down"\} 1$')


def main():
    cluster.TANDEM = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        cluster.MODEL = os.path.join(tmp, "tiny")
        subprocess.run([cluster.TANDEM, "synth-model", "--preset", "tiny", "--out", cluster.MODEL],
                       check=True, stdout=subprocess.DEVNULL)
        unittest.main(argv=[sys.argv[0]] + sys.argv[2:], verbosity=2)


if __name__ == "__main__":
    main()
