#!/usr/bin/env python3
"""Tensor-parallel prefill and decode workers of different degrees (`tandem prefill --tp N`,
`tandem decode --tp M`), as separate processes with KV over UCX, through the OpenAI API:

- For prefill/decode degrees 2/1, 1/2, 2/2 and 4/2, the output equals `tandem serve
  --colocated` on one rank token for token (greedy and seeded sampling with n=2, logprobs,
  prompts of several prefill chunks, 8 concurrent requests). Each rank of a group holds only
  its KV heads, so a page that went to the wrong rank, or a head taken from the wrong rank,
  changes the tokens.
- A storm of streams cut mid-prefill and mid-decode leaves 0 KV blocks in use on both workers
  (the leader's block manager is the group's) and the next request is served in full.
- Each group runs as one process per rank; `tandem serve --prefill-tp 2 --decode-tp 2` runs
  both workers in one process and starts their followers.

usage: tensor_parallel_disagg_test.py TANDEM_BINARY [unittest args]
"""
import os
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import disagg_e2e_test as e2e  # noqa: E402  (the processes and helpers of the e2e test)


class TensorParallelDisaggregated(e2e.ProcessesTestCase):
    # A storm stream of 200 tokens then runs at least 2 s on the decode group.
    DECODE_DELAY_MS = 10

    @classmethod
    def setUpClass(cls):
        cls.colocated = e2e.start_colocated()
        cls.bodies = e2e.requests_for(8)
        cls.want = e2e.run_all(cls.colocated.url, cls.bodies)

    @classmethod
    def tearDownClass(cls):
        assert cls.colocated.stop() == 0

    def assert_same(self, got, want, what):
        for (gi, gtext, gtokens, glogprobs, gfinish), (wi, wtext, wtokens, wlogprobs, wfinish) \
                in zip(e2e.comparable(got), e2e.comparable(want), strict=True):
            self.assertEqual((gi, gtext, gtokens, gfinish), (wi, wtext, wtokens, wfinish), what)
            # The ranks' partial sums are added in another order than one rank's.
            for a, b in zip(glogprobs, wlogprobs, strict=True):
                self.assertAlmostEqual(a, b, delta=1e-4, msg=what)
        self.assertEqual(got["usage"], want["usage"], what)

    def check_degrees(self, prefill_tp, decode_tp):
        decode = self.start(e2e.start_worker(
            "decode", extra=["--tp", str(decode_tp), "--step-delay-ms", str(self.DECODE_DELAY_MS)]))
        prefill = self.start(e2e.start_worker("prefill", extra=["--tp", str(prefill_tp)]))
        router = self.start(e2e.start_router(prefill.address, decode.address))
        for worker, tp in ((prefill, prefill_tp), (decode, decode_tp)):
            self.assertEqual(len(e2e.children(worker.proc.pid)), tp - 1,
                             f"{worker.address}: one process per follower rank")

        got = e2e.run_all(router.url, self.bodies)
        for i, (w, g) in enumerate(zip(self.want, got)):
            self.assert_same(g, w, f"request {i}, prefill tp {prefill_tp}, decode tp {decode_tp}")
        for worker, tp in ((prefill, prefill_tp), (decode, decode_tp)):
            moved = e2e.metric(worker.metrics_url, "tandem_tensor_parallel_collective_bytes_total")
            self.assertEqual(moved > 0, tp > 1, f"{worker.metrics_url}: collective bytes {moved}")

        self.assertEqual(e2e.storm(router.url, 40), 20, "every second stream was cut mid-decode")
        self.assertEqual(e2e.wait_for_zero(router.url + "/metrics",
                                           "tandem_api_requests_in_flight"), 0)
        r = e2e.post(router.url, {"model": "tiny", "prompt": "after the storm", "max_tokens": 8,
                                  "ignore_eos": True, "temperature": 0})
        self.assertEqual(r["usage"]["completion_tokens"], 8)
        for worker in (prefill, decode):
            self.assertEqual(e2e.wait_for_zero(worker.metrics_url, "tandem_kv_cache_blocks_used"),
                             0, worker.metrics_url)
        self.assertEqual(e2e.wait_for_zero(decode.metrics_url, "tandem_kv_cache_blocks_reserved"),
                         0)
        for p in (router, prefill, decode):
            self.assertEqual(p.stop(), 0)

    def test_serve_runs_both_groups(self):
        """`tandem serve --prefill-tp 2 --decode-tp 2`: the workers in one process, one more
        process per follower rank, the colocated tokens."""
        serve = self.start(e2e.Process(
            ["serve", "--model", e2e.MODEL, "--port", "0", "--prefill-tp", "2", "--decode-tp",
             "2"] + e2e.ENGINE_FLAGS, r"on (http://127\.0\.0\.1:\d+) \(prefill (.*)\)"))
        self.assertIn("over 2 ranks, decode", serve.match.group(2))
        self.assertEqual(len(e2e.children(serve.proc.pid)), 2, "one follower per group")
        got = e2e.run_all(serve.match.group(1), self.bodies[:4])
        for i, (w, g) in enumerate(zip(self.want, got)):
            self.assert_same(g, w, f"request {i}, serve --prefill-tp 2 --decode-tp 2")
        self.assertEqual(serve.stop(), 0)

    def test_prefill_2_decode_1(self):
        self.check_degrees(2, 1)

    def test_prefill_1_decode_2(self):
        self.check_degrees(1, 2)

    def test_prefill_2_decode_2(self):
        self.check_degrees(2, 2)

    def test_prefill_4_decode_2(self):
        # 4 ranks over the model's 2 KV heads: each head is held by two prefill ranks.
        self.check_degrees(4, 2)


def main():
    e2e.TANDEM = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        e2e.MODEL = os.path.join(tmp, "tiny")
        subprocess.run([e2e.TANDEM, "synth-model", "--preset", "tiny", "--out", e2e.MODEL],
                       check=True, stdout=subprocess.DEVNULL)
        unittest.main(argv=[sys.argv[0]] + sys.argv[2:], verbosity=2)


if __name__ == "__main__":
    main()
