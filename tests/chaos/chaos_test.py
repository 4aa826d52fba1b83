#!/usr/bin/env python3
"""Chaos runs: a router with two prefill and two decode workers under steady streaming load,
and one failure per scenario. Every request must still finish, with the exact tokens an
undisturbed run gives (greedy decoding, so a migrated stream that skipped or repeated a token
would differ), and no KV block may stay in use on the workers that are left.

Prints one table row per scenario: requests sent, succeeded, failed, lost (never finished),
and recovery time (from the failure until the last stream that was in flight at that moment
has finished).

usage: chaos_test.py TANDEM_BINARY [--seconds N] [--clients N] [--json FILE]
CI runs the short form (the defaults); raise --seconds and --clients for a long run.
"""
import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "disagg"))
import disagg_e2e_test as cluster  # noqa: E402  (process helpers shared with the disagg tests)

PROMPT = " ".join(["the quiet harbor keeps its lamps lit"] * 12)
MAX_TOKENS = 48


def stream_once(url, timeout=120):
    """One streamed greedy completion; returns (ok, text, error)."""
    host, port = re.match(r"http://([^:]+):(\d+)", url).groups()
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    raw = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
           f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    try:
        s = socket.create_connection((host, int(port)), timeout=timeout)
        s.sendall(raw)
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        s.close()
    except OSError as e:
        return False, "", f"socket: {e}"
    head, _, body = data.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        return False, "", head.split(b"\r\n")[0].decode(errors="replace")
    text, finish, error = "", None, None
    for line in body.decode(errors="replace").split("\n"):
        if line.startswith("event: error"):
            error = "error event"
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        try:
            event = json.loads(line[6:])
        except ValueError:
            continue  # a chunk-size line of the chunked encoding split a data line: not ours
        if "error" in event:
            error = event["error"].get("message")
            continue
        for c in event.get("choices", []):
            text += c.get("text", "")
            finish = c.get("finish_reason") or finish
    if error is not None or finish != "length":
        return False, text, error or f"finish_reason {finish}"
    return True, text, None


class Load:
    """`clients` threads streaming back to back until stopped."""

    def __init__(self, url, clients):
        self.url = url
        self.records = []  # (start, end, ok, text, error)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.client) for _ in range(clients)]
        for t in self.threads:
            t.start()

    def client(self):
        while not self.stop.is_set():
            start = time.time()
            ok, text, error = stream_once(self.url)
            with self.lock:
                self.records.append((start, time.time(), ok, text, error))

    def finish(self, timeout):
        self.stop.set()
        deadline = time.time() + timeout
        for t in self.threads:
            t.join(max(0.1, deadline - time.time()))
        return sum(t.is_alive() for t in self.threads)  # clients still stuck: lost requests


def run_scenario(name, action, reference, seconds, clients):
    decodes = [cluster.start_worker("decode") for _ in range(2)]
    prefills = [cluster.start_worker("prefill") for _ in range(2)]
    router = cluster.start_router(",".join(p.address for p in prefills),
                                  ",".join(d.address for d in decodes))
    victim = None
    try:
        load = Load(router.url, clients)
        time.sleep(seconds / 2)
        event = time.time()
        victim = action(prefills, decodes)
        time.sleep(seconds / 2)
        lost = load.finish(timeout=120)
        records = list(load.records)
        survivors = [w for w in prefills + decodes if w is not victim]
        leaked = {}
        for w in survivors:
            used = cluster.wait_for_zero(w.metrics_url, "tandem_kv_cache_blocks_used")
            if used != 0:
                leaked[w.address] = used
        in_flight = [r for r in records if r[0] < event]
        recovery = max([r[1] for r in in_flight if r[1] >= event] + [event]) - event
        wrong = [r for r in records if r[2] and r[3] != reference]
        failed = [r for r in records if not r[2]]
        return {
            "scenario": name, "sent": len(records) + lost,
            "succeeded": sum(1 for r in records if r[2]) - len(wrong),
            "failed": len(failed), "wrong_output": len(wrong), "lost": lost,
            "recovery_seconds": round(recovery, 2), "leaked_blocks": leaked,
            "errors": sorted({str(r[4]) for r in failed})[:3],
        }
    finally:
        for p in [router] + prefills + decodes:
            if p is not victim:
                p.stop()


def kill(role, sig):
    def action(prefills, decodes):
        victim = (prefills if role == "prefill" else decodes)[0]
        victim.proc.send_signal(sig)
        if sig == signal.SIGTERM:
            # A draining worker finishes what it has, then exits on its own.
            threading.Thread(target=victim.proc.wait, daemon=True).start()
        return victim
    return action


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("tandem")
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--json")
    a = parser.parse_args()
    cluster.TANDEM = a.tandem
    scenarios = [
        ("SIGKILL decode worker", kill("decode", signal.SIGKILL)),
        ("SIGKILL prefill worker", kill("prefill", signal.SIGKILL)),
        ("SIGTERM (drain) decode worker", kill("decode", signal.SIGTERM)),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        cluster.MODEL = os.path.join(tmp, "tiny")
        subprocess.run([a.tandem, "synth-model", "--preset", "tiny", "--out", cluster.MODEL],
                       check=True, stdout=subprocess.DEVNULL)
        # The undisturbed output every request must reproduce.
        colocated = cluster.start_colocated()
        try:
            ok, reference, error = stream_once(colocated.url)
        finally:
            colocated.stop()
        if not ok:
            print(f"FAIL: reference run failed: {error}")
            return 1
        rows = [run_scenario(name, action, reference, a.seconds, a.clients)
                for name, action in scenarios]

    print(f"{'scenario':32} {'sent':>5} {'ok':>5} {'failed':>6} {'wrong':>5} {'lost':>4} "
          f"{'recovery s':>10}  leaked blocks")
    for r in rows:
        print(f"{r['scenario']:32} {r['sent']:5d} {r['succeeded']:5d} {r['failed']:6d} "
              f"{r['wrong_output']:5d} {r['lost']:4d} {r['recovery_seconds']:10.2f}  "
              f"{r['leaked_blocks'] or 0}")
        for e in r["errors"]:
            print(f"    error: {e}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)
    bad = [r for r in rows if r["failed"] or r["wrong_output"] or r["lost"] or r["leaked_blocks"]
           or r["sent"] == 0]
    if bad:
        print("FAIL:", ", ".join(r["scenario"] for r in bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
