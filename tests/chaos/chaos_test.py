#!/usr/bin/env python3
"""Chaos runs: a router with two prefill and two decode workers under steady streaming load,
and one failure per scenario. Workers are listed on the router's command line, and again
discovered through etcd (registered on leases), where etcd and the router are also restarted
and the router must follow workers that join and leave. Every request must still finish, with the exact tokens an
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

ETCD = "/usr/bin/etcd"
LEASE_TTL = 5  # seconds, for the etcd runs


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Etcd:
    """A one-member etcd on loopback ports with its own data directory."""

    def __init__(self, data_dir):
        self.data_dir = data_dir
        self.client_port, self.peer_port = free_port(), free_port()
        self.endpoint = f"http://127.0.0.1:{self.client_port}"
        self.start()

    def start(self):
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.proc = subprocess.Popen(
            [ETCD, "--name", "chaos", "--data-dir", self.data_dir,
             "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"chaos={peer}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.client_port), timeout=1):
                    return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("etcd did not start")

    def stop(self):
        self.proc.kill()
        self.proc.wait()


PROMPT = " ".join(["the quiet harbor keeps its lamps lit"] * 12)
MAX_TOKENS = 48


def stream_once(url, timeout=120, n=1):
    """One streamed greedy completion; returns (ok, text, error). A refused connection, or one
    reset before any answer (a router restarting), is retried for up to 10 s, as a client behind
    a load balancer would."""
    give_up = time.time() + 10
    while True:
        result = stream_attempt(url, timeout, n)
        if result[2] != "refused" or time.time() > give_up:
            return result
        time.sleep(0.1)


def stream_attempt(url, timeout, n):
    host, port = re.match(r"http://([^:]+):(\d+)", url).groups()
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "n": n,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    raw = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
           f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    try:
        s = socket.create_connection((host, int(port)), timeout=timeout)
    except ConnectionRefusedError:
        return False, "", "refused"
    except OSError as e:
        return False, "", f"socket: {e}"
    data = b""
    try:
        s.sendall(raw)
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        s.close()
    except ConnectionResetError as e:
        # A connection the stopping router had not yet accepted is reset unanswered; like a
        # refused one, a load balancer sends it again. A reset mid-response is a failure.
        return False, "", "refused" if not data else f"socket: {e}"
    except OSError as e:
        return False, "", f"socket: {e}"
    head, _, body = data.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        return False, "", head.split(b"\r\n")[0].decode(errors="replace")
    texts, finishes, error = {}, {}, None
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
            texts[c["index"]] = texts.get(c["index"], "") + c.get("text", "")
            finishes[c["index"]] = c.get("finish_reason") or finishes.get(c["index"])
    if error is not None or sorted(finishes) != list(range(n)) or any(
            f != "length" for f in finishes.values()):
        return False, "", error or f"finish_reasons {finishes}"
    # Greedy samples are all the same text: each must equal the undisturbed output.
    distinct = set(texts.values())
    return True, distinct.pop() if len(distinct) == 1 else " | ".join(texts.values()), None


class Load:
    """`clients` threads streaming back to back until stopped."""

    def __init__(self, url, clients):
        self.url = url
        self.records = []  # (start, end, ok, text, error)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        # Every third client asks for two samples, so multi-sample streams are moved too.
        self.threads = [threading.Thread(target=self.client, args=(2 if i % 3 == 2 else 1,))
                        for i in range(clients)]
        for t in self.threads:
            t.start()

    def client(self, n):
        while not self.stop.is_set():
            start = time.time()
            ok, text, error = stream_once(self.url, n=n)
            with self.lock:
                self.records.append((start, time.time(), ok, text, error))

    def finish(self, timeout):
        self.stop.set()
        deadline = time.time() + timeout
        for t in self.threads:
            t.join(max(0.1, deadline - time.time()))
        return sum(t.is_alive() for t in self.threads)  # clients still stuck: lost requests


def start_etcd_worker(role, etcd, index, ttl=LEASE_TTL, extra=()):
    return cluster.Process(
        [role, "--model", cluster.MODEL, "--listen", "127.0.0.1:0", "--metrics-listen",
         "127.0.0.1:0", "--etcd", etcd.endpoint, "--cluster", "chaos", "--lease-ttl",
         str(ttl), "--worker-id", f"{role}-{index}"] + cluster.ENGINE_FLAGS + list(extra),
        r"listening on (\S+) \(metrics on port (\d+)\)")


def with_metrics(p):
    p.address = p.match.group(1)
    p.metrics_url = f"http://127.0.0.1:{p.match.group(2)}/metrics"
    return p


def start_etcd_router(etcd, port):
    p = cluster.Process(["router", "--model", cluster.MODEL, "--etcd", etcd.endpoint,
                         "--cluster", "chaos", "--port", str(port)], r"on (http://\S+:\d+)")
    p.url = p.match.group(1)
    return p


def metric(url, name):
    """A metric of a process that may be (re)starting: connection errors are retried for 10 s."""
    deadline = time.time() + 10
    while True:
        try:
            return cluster.metric(url, name)
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.1)


def router_capacity(url):
    return metric(url + "/metrics", "tandem_kv_cache_blocks_capacity")


def run_scenario(name, action, reference, seconds, clients, etcd=None, ttl=LEASE_TTL,
                 decode_extra=()):
    """One topology, steady load, `action` halfway; etcd: workers register, the router
    discovers them, and the action may also restart etcd or the router. `decode_extra`: more
    flags for the decode workers."""
    topology = {"etcd": etcd}
    if etcd is None:
        decodes = [cluster.start_worker("decode", extra=decode_extra) for _ in range(2)]
        prefills = [cluster.start_worker("prefill") for _ in range(2)]
        router = cluster.start_router(",".join(p.address for p in prefills),
                                      ",".join(d.address for d in decodes))
    else:
        decodes = [with_metrics(start_etcd_worker("decode", etcd, i, ttl, decode_extra))
                   for i in range(2)]
        prefills = [with_metrics(start_etcd_worker("prefill", etcd, i, ttl)) for i in range(2)]
        router = start_etcd_router(etcd, free_port())
        # Both decode workers counted in the router's capacity: discovery is complete.
        full = 2 * metric(decodes[0].metrics_url, "tandem_kv_cache_blocks_capacity")
        deadline = time.time() + 10
        while router_capacity(router.url) != full and time.time() < deadline:
            time.sleep(0.1)
    topology.update(router=router, prefills=prefills, decodes=decodes)
    victim = None
    try:
        load = Load(router.url, clients)
        time.sleep(seconds / 2)
        event = time.time()
        victim = action(prefills, decodes, topology)
        time.sleep(seconds / 2)
        lost = load.finish(timeout=120)
        records = list(load.records)
        survivors = [w for w in prefills + decodes if w is not victim]
        leaked = {}
        for w in survivors:
            if w.proc.poll() is not None:
                leaked[w.address] = f"exited with {w.proc.returncode}"
                continue
            used = cluster.wait_for_zero(w.metrics_url, "tandem_kv_cache_blocks_used")
            if used != 0:
                leaked[w.address] = used
        router_metrics = topology["router"].url + "/metrics"
        retries = sum(metric(router_metrics, f'tandem_request_retries_total{{phase="{p}"}}')
                      or 0 for p in ("prefill", "decode", "kv_handoff"))
        handoffs = metric(router_metrics, 'tandem_request_retries_total{phase="kv_handoff"}') or 0
        in_flight = [r for r in records if r[0] < event]
        recovery = max([r[1] for r in in_flight if r[1] >= event] + [event]) - event
        wrong = [r for r in records if r[2] and r[3] != reference]
        failed = [r for r in records if not r[2]]
        return {
            "scenario": name, "sent": len(records) + lost,
            "succeeded": sum(1 for r in records if r[2]) - len(wrong),
            "failed": len(failed), "wrong_output": len(wrong), "lost": lost,
            "recovery_seconds": round(recovery, 2), "leaked_blocks": leaked,
            "retries": int(retries), "kv_handoffs": int(handoffs),
            "errors": sorted({str(r[4]) for r in failed})[:3],
        }
    finally:
        for p in [topology["router"]] + prefills + decodes:
            if p is not victim:
                p.stop()


def restart_etcd(prefills, decodes, topology):
    """etcd down for less than the lease TTL, then back with its data: nobody loses a lease."""
    topology["etcd"].stop()
    time.sleep(1)
    topology["etcd"].start()
    return None


def restart_router(prefills, decodes, topology):
    """The router drains (SIGTERM) and a new one takes its port, finding the workers in etcd."""
    old = topology["router"]
    port = int(old.url.rsplit(":", 1)[1])
    old.stop()
    topology["router"] = start_etcd_router(topology["etcd"], port)
    return old


def kill(role, sig):
    def action(prefills, decodes, topology):
        victim = (prefills if role == "prefill" else decodes)[0]
        victim.proc.send_signal(sig)
        if sig == signal.SIGTERM:
            # A draining worker finishes what it has, then exits on its own.
            threading.Thread(target=victim.proc.wait, daemon=True).start()
        return victim
    return action


def two_sample_migration(reference_url):
    """A 2-sample greedy stream whose decode worker is killed mid-generation: both samples must
    go on elsewhere and end with exactly the undisturbed text."""
    long_tokens = 240
    global MAX_TOKENS
    saved, MAX_TOKENS = MAX_TOKENS, long_tokens
    try:
        ok, reference, error = stream_once(reference_url)
        if not ok:
            raise RuntimeError(f"reference run failed: {error}")
        decodes = [cluster.start_worker("decode") for _ in range(2)]
        prefill = cluster.start_worker("prefill")
        router = cluster.start_router(prefill.address, ",".join(d.address for d in decodes))
        victim = None
        try:
            result = {}
            t = threading.Thread(target=lambda: result.update(r=stream_once(router.url, n=2)))
            t.start()
            # Kill whichever decode worker holds the request once it is decoding.
            deadline = time.time() + 60
            while victim is None and time.time() < deadline:
                for d in decodes:
                    if (cluster.metric(d.metrics_url, "tandem_num_requests_running") or 0) > 0:
                        victim = d
                        break
                time.sleep(0.02)
            killed_at = time.time()
            victim.proc.kill()
            t.join(120)
            ok, text, error = result.get("r", (False, "", "no result"))
            retries = cluster.metric(router.url + "/metrics",
                                     'tandem_request_retries_total{phase="decode"}') or 0
            survivor = [d for d in decodes if d is not victim][0]
            leaked = cluster.wait_for_zero(survivor.metrics_url, "tandem_kv_cache_blocks_used")
            good = ok and text == reference and retries >= 1 and leaked == 0
            return {"scenario": "2-sample stream, its decode worker killed", "sent": 1,
                    "succeeded": int(good), "failed": int(not ok),
                    "wrong_output": int(ok and text != reference), "lost": int(t.is_alive()),
                    "recovery_seconds": round(time.time() - killed_at, 2),
                    "retries": int(retries), "leaked_blocks": {} if leaked == 0 else
                    {survivor.address: leaked}, "errors": [] if ok else [str(error)]}
        finally:
            for p in [router, prefill] + decodes:
                if p is not victim:
                    p.stop()
    finally:
        MAX_TOKENS = saved


def drain_handoff(tmp):
    """A 1-sample and a 2-sample greedy stream whose decode worker drains (SIGTERM, no grace)
    mid-generation: it parks them, the router moves their KV to the other decode worker
    (Handoff) instead of recomputing, and both end with exactly the undisturbed text. Checks
    the router's handoff counter, that the draining worker exits on its own, and that no KV
    block stays in use. Runs the `small` synthetic model (under the name the clients use): the
    tiny one generates 240 tokens in a few milliseconds, too fast to drain mid-stream."""
    long_tokens = 240
    global MAX_TOKENS
    saved, MAX_TOKENS = MAX_TOKENS, long_tokens
    saved_model = cluster.MODEL
    cluster.MODEL = os.path.join(tmp, "slow", os.path.basename(saved_model))
    subprocess.run([cluster.TANDEM, "synth-model", "--preset", "small", "--out", cluster.MODEL],
                   check=True, stdout=subprocess.DEVNULL)
    try:
        colocated = cluster.start_colocated()
        try:
            ok, reference, error = stream_once(colocated.url)
        finally:
            colocated.stop()
        if not ok:
            raise RuntimeError(f"reference run failed: {error}")
        decodes = [cluster.start_worker("decode", extra=["--drain-grace", "0"])
                   for _ in range(2)]
        prefill = cluster.start_worker("prefill")
        router = cluster.start_router(prefill.address, ",".join(d.address for d in decodes))
        victim = None
        try:
            results = [{}, {}]
            threads = [threading.Thread(target=lambda r=r, n=n: r.update(r=stream_once(
                router.url, n=n))) for r, n in zip(results, (1, 2))]
            for t in threads:
                t.start()
            # Drain the decode worker that holds both requests' samples once they decode (the
            # router puts them on one worker when the other is busier; retry until so).
            deadline = time.time() + 60
            while victim is None and time.time() < deadline:
                for d in decodes:
                    if (cluster.metric(d.metrics_url, "tandem_num_requests_running") or 0) >= 3:
                        victim = d
                        break
                running = sum(cluster.metric(d.metrics_url, "tandem_num_requests_running") or 0
                              for d in decodes)
                if victim is None and running >= 3:
                    victim = max(decodes, key=lambda d: cluster.metric(
                        d.metrics_url, "tandem_num_requests_running") or 0)
                time.sleep(0.02)
            if victim is None:
                raise RuntimeError("the streams never ran on a decode worker together")
            drained_at = time.time()
            victim.proc.send_signal(signal.SIGTERM)
            for t in threads:
                t.join(120)
            exited = victim.proc.wait(timeout=30)
            outcomes = [r.get("r", (False, "", "no result")) for r in results]
            metrics = router.url + "/metrics"
            handoffs = cluster.metric(
                metrics, 'tandem_request_retries_total{phase="kv_handoff"}') or 0
            recomputed = cluster.metric(
                metrics, 'tandem_request_retries_total{phase="decode"}') or 0
            moved_bytes = cluster.metric(metrics, "tandem_kv_handoff_bytes_total") or 0
            survivor = [d for d in decodes if d is not victim][0]
            leaked = cluster.wait_for_zero(survivor.metrics_url, "tandem_kv_cache_blocks_used")
            good = [ok and text == reference for ok, text, _ in outcomes]
            errors = [str(e) for ok, _, e in outcomes if not ok]
            if handoffs < 1:
                errors.append(f"no KV handoff counted (recomputed: {recomputed})")
            if exited != 0:
                errors.append(f"the drained worker exited with {exited}")
            print(f"    drain by KV handoff: {int(handoffs)} samples moved, {int(moved_bytes)} "
                  f"bytes, {int(recomputed)} recomputed", flush=True)
            return {"scenario": "drain: 1+2-sample streams, KV handoff", "sent": 2,
                    "succeeded": sum(good) if not errors else 0,
                    "failed": sum(1 for ok, _, _ in outcomes if not ok) or int(bool(errors)),
                    "wrong_output": sum(1 for ok, text, _ in outcomes if ok and text != reference),
                    "lost": sum(t.is_alive() for t in threads),
                    "recovery_seconds": round(time.time() - drained_at, 2),
                    "retries": int(handoffs + recomputed), "kv_handoffs": int(handoffs),
                    "kv_handoff_bytes": int(moved_bytes), "recomputed": int(recomputed),
                    "leaked_blocks": {} if leaked == 0 else {survivor.address: leaked},
                    "errors": errors}
        finally:
            for p in [router, prefill] + decodes:
                if p is not victim:
                    p.stop()
    finally:
        MAX_TOKENS = saved
        cluster.MODEL = saved_model


def membership_scenario(tmp):
    """Workers joining and leaving are picked up by the router within one lease TTL."""
    etcd = Etcd(os.path.join(tmp, "etcd-membership"))
    procs = []
    try:
        procs.append(with_metrics(start_etcd_worker("prefill", etcd, 0)))
        router = start_etcd_router(etcd, free_port())
        procs.append(router)
        # Join: a decode worker registers; the router serves with it.
        joined = time.time()
        decode = with_metrics(start_etcd_worker("decode", etcd, 0))
        procs.append(decode)
        capacity = metric(decode.metrics_url, "tandem_kv_cache_blocks_capacity")
        while router_capacity(router.url) != capacity and time.time() < joined + 30:
            time.sleep(0.05)
        join_s = time.time() - joined
        ok, _, error = stream_once(router.url)
        # Leave: SIGKILL, so only the lease's expiry tells.
        decode.proc.kill()
        left = time.time()
        while router_capacity(router.url) != 0 and time.time() < left + 30:
            time.sleep(0.05)
        leave_s = time.time() - left
        within = join_s <= LEASE_TTL and leave_s <= LEASE_TTL + 1
        return {"scenario": f"etcd: join picked up in {join_s:.2f} s, leave in {leave_s:.2f} s "
                            f"(TTL {LEASE_TTL} s)",
                "sent": 1, "succeeded": int(ok), "failed": int(not ok), "wrong_output": 0,
                "lost": 0, "recovery_seconds": round(max(join_s, leave_s), 2), "retries": 0,
                "leaked_blocks": {} if within else {"over TTL": 1},
                "errors": [] if ok else [str(error)]}
    finally:
        for p in reversed(procs):
            p.stop()
        etcd.stop()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("tandem")
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--json")
    a = parser.parse_args()
    cluster.TANDEM = a.tandem
    scenarios = [
        ("SIGKILL decode worker", kill("decode", signal.SIGKILL), False),
        ("SIGKILL prefill worker", kill("prefill", signal.SIGKILL), False),
        ("SIGTERM (drain) decode worker", kill("decode", signal.SIGTERM), False),
        # No grace: the streams running at SIGTERM move to the other decode worker by KV
        # handoff at once (with the default 30 s grace these short streams all finish first).
        ("SIGTERM (drain, no grace) decode", kill("decode", signal.SIGTERM), False,
         ["--drain-grace", "0"]),
        ("etcd: SIGKILL decode worker", kill("decode", signal.SIGKILL), True),
        ("etcd: SIGTERM (drain) decode worker", kill("decode", signal.SIGTERM), True),
        ("etcd: SIGTERM (drain, no grace) decode", kill("decode", signal.SIGTERM), True,
         ["--drain-grace", "0"]),
        # The outage (1 s, plus etcd's start-up, slow on a loaded machine) must stay under the
        # lease TTL, or the workers rightly consider their leases lost and stop.
        ("etcd: restart etcd", restart_etcd, True),
        ("etcd: restart the router", restart_router, True),
    ]
    if not os.path.exists(ETCD):
        print(f"FAIL: {ETCD} is missing (scripts/install-deps installs etcd-server)")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        cluster.MODEL = os.path.join(tmp, "tiny")
        subprocess.run([a.tandem, "synth-model", "--preset", "tiny", "--out", cluster.MODEL],
                       check=True, stdout=subprocess.DEVNULL)
        # The undisturbed output every request must reproduce.
        colocated = cluster.start_colocated()
        try:
            ok, reference, error = stream_once(colocated.url)
            migration_row = two_sample_migration(colocated.url) if ok else None
            handoff_row = drain_handoff(tmp) if ok else None
        finally:
            colocated.stop()
        if not ok:
            print(f"FAIL: reference run failed: {error}")
            return 1
        rows = []
        for name, action, with_etcd, *decode_extra in scenarios:
            print(f"running: {name}", flush=True)
            etcd = Etcd(os.path.join(tmp, f"etcd-{len(rows)}")) if with_etcd else None
            ttl = 3 * LEASE_TTL if action is restart_etcd else LEASE_TTL
            try:
                rows.append(run_scenario(name, action, reference, a.seconds, a.clients, etcd,
                                         ttl, decode_extra[0] if decode_extra else ()))
            finally:
                if etcd is not None:
                    etcd.stop()
        rows.append(migration_row)
        rows.append(handoff_row)
        rows.append(membership_scenario(tmp))

    print(f"{'scenario':40} {'sent':>5} {'ok':>5} {'failed':>6} {'wrong':>5} {'lost':>4} "
          f"{'recovery s':>10} {'retries':>7} {'kv hand':>7}  leaked blocks")
    for r in rows:
        print(f"{r['scenario']:40} {r['sent']:5d} {r['succeeded']:5d} {r['failed']:6d} "
              f"{r['wrong_output']:5d} {r['lost']:4d} {r['recovery_seconds']:10.2f} {r['retries']:7d} "
              f"{r.get('kv_handoffs', 0):7d}  {r['leaked_blocks'] or 0}")
        for e in r["errors"]:
            print(f"    error: {e}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)
    bad = [r for r in rows if r["failed"] or r["wrong_output"] or r["lost"] or r["leaked_blocks"]
           or r["sent"] == 0 or r["succeeded"] != r["sent"]]
    if bad:
        print("FAIL:", ", ".join(r["scenario"] for r in bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
