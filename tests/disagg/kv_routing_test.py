#!/usr/bin/env python3
"""KV-aware routing end to end: `tandem prefill` x2, `tandem decode` and `tandem router` as
processes, the router following each worker's KV events (docs/protocol.md, "KV events").

- Requests that repeat a prefix land on the prefill worker that holds it (its prefix-cache hits
  grow, the other worker never sees them), although the other one is listed first and just as
  idle, which is where `--routing load` sends them.
- A worker's entries in the router's index (tandem_router_kv_index_blocks) go when its KV events
  stream is lost (the series shows 0), and come back once it runs again (the router subscribes
  again); the series goes when the worker leaves the pool (etcd membership), and comes for a
  worker that joins.

Every wait has a generous bound that only a hang reaches; nothing depends on machine speed.

usage: kv_routing_test.py TANDEM_BINARY [unittest args]
"""
import os
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "chaos"))
import disagg_e2e_test as cluster  # noqa: E402  (process helpers shared with the disagg tests)
import chaos_test  # noqa: E402  (the etcd helper)

# About 260 tokens of the tiny model: 16 full blocks of 16.
PREFIX = " ".join(["the quiet harbor keeps its lamps lit for the boats coming home"] * 20)


def body(prompt):
    return {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}


def metric(url, name):
    return cluster.metric(url, name) or 0


def wait_until(condition, what, limit=120):
    deadline = time.time() + limit
    while True:
        value = condition()
        if value:
            return value
        if time.time() > deadline:
            raise AssertionError(f"no {what} within {limit} s")
        time.sleep(0.05)


def index_blocks(router, worker):
    return metric(router.url + "/metrics", f'tandem_router_kv_index_blocks{{worker="{worker}"}}')


def index_series(router, worker):
    """The worker's index series, None when the router shows none."""
    return cluster.metric(router.url + "/metrics",
                          f'tandem_router_kv_index_blocks{{worker="{worker}"}}')


def decisions(router, pool, reason):
    return metric(router.url + "/metrics",
                  f'tandem_router_routing_decisions_total{{pool="{pool}",reason="{reason}"}}')


QUERIES = "tandem_prefix_cache_queries_tokens_total"
HITS = "tandem_prefix_cache_hits_tokens_total"


class KvAwareRouting(cluster.ProcessesTestCase):
    def test_repeated_prefixes_land_on_the_prefill_worker_holding_them(self):
        p0 = self.start(cluster.start_worker("prefill"))
        p1 = self.start(cluster.start_worker("prefill"))
        decode = self.start(cluster.start_worker("decode"))
        pools = f"{p0.address},{p1.address}"
        # A router that knows only p1 puts the prefix there.
        warm = self.start(cluster.start_router(p1.address, decode.address,
                                               extra=["--routing", "load"]))
        kv = self.start(cluster.start_router(pools, decode.address))  # kv-aware: the default
        load = self.start(cluster.start_router(pools, decode.address,
                                               extra=["--routing", "load"]))
        self.assertEqual(cluster.post(warm.url, body(PREFIX))["choices"][0]["finish_reason"],
                         "length")
        wait_until(lambda: index_blocks(kv, p1.address) >= 16, "index entries for p1")
        self.assertEqual(index_blocks(kv, p0.address), 0)
        wait_until(lambda: index_blocks(kv, decode.address) >= 16, "index entries for decode")
        hits_before = metric(p1.metrics_url, HITS)

        # Three requests repeating the prefix, each with its own ending: all on p1.
        for i in range(3):
            cluster.post(kv.url, body(f"{PREFIX} and then turn {i} begins"))
        self.assertEqual(metric(p0.metrics_url, QUERIES), 0, "a request went to p0")
        self.assertGreaterEqual(metric(p1.metrics_url, HITS) - hits_before, 3 * 16 * 16)
        self.assertEqual(decisions(kv, "prefill", "kv_hit"), 3)
        self.assertEqual(decisions(kv, "decode", "kv_hit"), 3)
        self.assertEqual(decisions(kv, "prefill", "load"), 0)

        # Load routing sends the same prompt to p0, listed first and as idle, which computes it.
        cluster.post(load.url, body(f"{PREFIX} and then turn 9 begins"))
        self.assertGreater(metric(p0.metrics_url, QUERIES), 0)
        self.assertEqual(metric(p0.metrics_url, HITS), 0)
        self.assertEqual(decisions(load, "prefill", "load"), 1)

    def test_a_lost_stream_drops_the_index_and_a_restarted_worker_is_followed_again(self):
        port = chaos_test.free_port()
        listen = ["--listen", f"127.0.0.1:{port}"]

        def start_prefill():
            return self.start(cluster.Process(
                ["prefill", "--model", cluster.MODEL, "--kv-host", "127.0.0.1",
                 "--metrics-listen", "127.0.0.1:0"] + listen + cluster.ENGINE_FLAGS,
                r"listening on (\S+) \(metrics on port (\d+)\)"))

        prefill = start_prefill()
        address = prefill.match.group(1)
        decode = self.start(cluster.start_worker("decode"))
        router = self.start(cluster.start_router(address, decode.address))
        cluster.post(router.url, body(PREFIX))
        wait_until(lambda: index_blocks(router, address) >= 16, "index entries for the worker")
        # The worker goes (its stream ends): the router forgets what it held.
        prefill.stop()
        wait_until(lambda: index_series(router, address) == 0, "the lost worker's index dropped")
        # Started again at the same address, with an empty cache: the router subscribes again
        # and follows what it computes from then on.
        start_prefill()
        wait_until(lambda: metric(router.url + "/metrics",
                                  'tandem_workers{role="prefill",state="up"}') == 1,
                   "the restarted worker up")
        cluster.post(router.url, body(PREFIX))
        wait_until(lambda: index_blocks(router, address) >= 16,
                   "index entries for the restarted worker")

    def test_a_workers_index_goes_when_it_leaves_and_comes_when_it_joins(self):
        with tempfile.TemporaryDirectory() as data:
            etcd = chaos_test.Etcd(data)
            self.addCleanup(etcd.stop)
            join = ["--etcd", etcd.endpoint, "--lease-ttl", "20"]  # outlasts etcd stalling under load
            prefill = self.start(cluster.start_worker("prefill",
                                                      extra=join + ["--worker-id", "kv-p0"]))
            self.start(cluster.start_worker("decode", extra=join + ["--worker-id", "kv-d0"]))
            router = self.start(cluster.Process(
                ["router", "--model", cluster.MODEL, "--etcd", etcd.endpoint, "--port", "0"],
                r"on (http://\S+:\d+)"))
            router.url = router.match.group(1)
            wait_until(lambda: metric(router.url + "/metrics",
                                      'tandem_workers{role="prefill",state="up"}') == 1,
                       "the prefill worker in the pool")
            wait_until(lambda: metric(router.url + "/metrics",
                                      'tandem_workers{role="decode",state="up"}') == 1,
                       "the decode worker in the pool")
            cluster.post(router.url, body(PREFIX))
            wait_until(lambda: index_blocks(router, "kv-p0") >= 16, "index entries for kv-p0")

            # It leaves (SIGTERM: drains, deregisters): its entries go with it.
            prefill.stop()
            wait_until(lambda: metric(router.url + "/metrics",
                                      'tandem_workers{role="prefill",state="up"}') == 0 and
                       metric(router.url + "/metrics",
                              'tandem_workers{role="prefill",state="down"}') == 0,
                       "kv-p0 out of the pool")
            wait_until(lambda: index_series(router, "kv-p0") is None, "kv-p0's series gone")
            self.assertGreaterEqual(index_blocks(router, "kv-d0"), 16)

            # Another joins and computes the prompt: the router indexes it.
            self.start(cluster.start_worker("prefill", extra=join + ["--worker-id", "kv-p1"]))
            wait_until(lambda: metric(router.url + "/metrics",
                                      'tandem_workers{role="prefill",state="up"}') == 1,
                       "kv-p1 in the pool")
            cluster.post(router.url, body(PREFIX))
            wait_until(lambda: index_blocks(router, "kv-p1") >= 16, "index entries for kv-p1")
            self.assertIsNone(index_series(router, "kv-p0"))


def main():
    cluster.TANDEM = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        cluster.MODEL = os.path.join(tmp, "tiny")
        subprocess.run([cluster.TANDEM, "synth-model", "--preset", "tiny", "--out", cluster.MODEL],
                       check=True, stdout=subprocess.DEVNULL)
        unittest.main(argv=[sys.argv[0]] + sys.argv[2:], verbosity=2)


if __name__ == "__main__":
    main()
