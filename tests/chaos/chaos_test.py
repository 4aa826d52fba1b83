#!/usr/bin/env python3
"""Chaos runs: a router with two prefill and two decode workers under steady streaming load,
and one failure per scenario. Workers are listed on the router's command line, and again
discovered through etcd (registered on leases), where etcd and the router are also restarted
and the router must follow workers that join and leave. Every request must still finish, with the exact tokens an
undisturbed run gives (greedy decoding, so a migrated stream that skipped or repeated a token
would differ), and no KV block may stay in use on the workers that are left. One scenario runs
decode workers of two tensor-parallel ranks and kills one rank: its group must go down, its
streams move, and it must leave etcd; another drains such a group, whose streams must move with
their KV (each rank pushing its heads).

Prints one table row per scenario: requests sent, succeeded, failed, lost (never finished),
and recovery time (from the failure until the last stream that was in flight at that moment
has finished).

Nothing here depends on how fast or how loaded the machine is: the workers run with
--step-delay-ms (every engine step waits first), so a stream takes at least a known time on any
machine; each failure is injected once its victim is seen holding work (its /metrics), and a
scenario fails if no request was in flight across the failure, or if a failure that must move
streams (a kill, a drain without grace) moved none. Times are reported, never asserted; the
waits are bounded only to catch a hang.

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
# Seconds, for the etcd runs. A worker whose lease goes unrenewed this long shuts itself down
# (the routers have dropped it), so the TTL must outlast etcd stalling on a saturated machine
# (make test-stress); only the membership scenario waits for a lease to expire.
LEASE_TTL = 20
# The membership scenario's, whose leave is the lease's expiry (it runs without load).
MEMBERSHIP_TTL = 5
# Bound on every wait for a condition (a process up, a metric reached): only a hang reaches it.
HANG_S = 60
# --step-delay-ms of the decode workers: a MAX_TOKENS stream decodes for at least
# MAX_TOKENS * 20 ms (about 1 s), a LONG_TOKENS one for at least 4.8 s, on any machine.
DECODE_DELAY = ["--step-delay-ms", "20"]
# And of the prefill workers where a prefill is to be caught mid-way: each prompt takes two
# 64-token chunks, so at least 0.4 s on the worker (more while others queue).
PREFILL_DELAY = ["--step-delay-ms", "200"]
LONG_TOKENS = 240


def wait_until(condition, what, limit=HANG_S):
    """Polls `condition` until it holds; raises after `limit` seconds (a hang)."""
    deadline = time.time() + limit
    while True:
        value = condition()
        if value:
            return value
        if time.time() > deadline:
            raise RuntimeError(f"no {what} within {limit} s")
        time.sleep(0.02)


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
        deadline = time.time() + HANG_S
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


def stream_once(url, timeout=120, n=1, max_tokens=MAX_TOKENS):
    """One streamed greedy completion; returns (ok, text, error). A refused connection, or one
    reset before any answer (a router restarting), is retried for up to HANG_S, as a client
    behind a load balancer would."""
    give_up = time.time() + HANG_S
    while True:
        result = stream_attempt(url, timeout, n, max_tokens)
        if result[2] != "refused" or time.time() > give_up:
            return result
        time.sleep(0.1)


def stream_attempt(url, timeout, n, max_tokens):
    host, port = re.match(r"http://([^:]+):(\d+)", url).groups()
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "n": n,
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
        # Daemon threads: a scenario that fails half-way cannot keep the test from exiting.
        self.threads = [threading.Thread(target=self.client, args=(2 if i % 3 == 2 else 1,),
                                         daemon=True) for i in range(clients)]
        for t in self.threads:
            t.start()

    def client(self, n):
        while not self.stop.is_set():
            start = time.time()
            ok, text, error = stream_once(self.url, n=n)
            with self.lock:
                self.records.append((start, time.time(), ok, text, error))

    def finished_since(self, t):
        """Requests that started at or after `t` and have finished."""
        with self.lock:
            return sum(1 for r in self.records if r[0] >= t)

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
    """A metric of a process that may be (re)starting: connection errors are retried for
    HANG_S."""
    deadline = time.time() + HANG_S
    while True:
        try:
            return cluster.metric(url, name)
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.1)


def router_capacity(url):
    return metric(url + "/metrics", "tandem_kv_cache_blocks_capacity")


def busy(w, role):
    """Whether worker `w` holds work a failure would hit: a decode worker streams (its running
    batch), a prefill worker has a prompt in prefill or queued for it."""
    running = metric(w.metrics_url, "tandem_num_requests_running") or 0
    if role == "decode":
        return running > 0
    return running + (metric(w.metrics_url, "tandem_num_requests_waiting") or 0) > 0


def generated(w):
    """Tokens a decode worker has generated (and streamed on to the router) so far."""
    return metric(w.metrics_url, "tandem_generation_tokens_total") or 0


# Tokens a long stream's decode worker must have generated before it is killed or drained: the
# router then holds some of the stream's text, so it is moved (migrated, or handed off), not
# started over; over 200 of its 20 ms steps remain.
STARTED_TOKENS = 16


def run_scenario(name, action, reference, seconds, clients, etcd=None, ttl=LEASE_TTL,
                 decode_extra=(), prefill_extra=()):
    """One topology, steady load, `action` halfway; etcd: workers register, the router
    discovers them, and the action may also restart etcd or the router. `decode_extra`,
    `prefill_extra`: more flags for the workers (the decode workers run DECODE_DELAY unless
    `decode_extra` sets its own --step-delay-ms).

    The load runs `seconds / 2` before the failure, which then waits until the worker it hits
    (a decode worker for etcd and router restarts) holds work; after it, the load goes on for
    `seconds / 2` and until every client has had a request start after the failure and finish,
    however long that takes on this machine."""
    decode_extra = list(decode_extra)
    if "--step-delay-ms" not in decode_extra:
        decode_extra = DECODE_DELAY + decode_extra
    prefill_extra = list(prefill_extra)
    topology = {"etcd": etcd}
    if etcd is None:
        decodes = [cluster.start_worker("decode", extra=decode_extra) for _ in range(2)]
        prefills = [cluster.start_worker("prefill", extra=prefill_extra) for _ in range(2)]
        router = cluster.start_router(",".join(p.address for p in prefills),
                                      ",".join(d.address for d in decodes))
    else:
        decodes = [with_metrics(start_etcd_worker("decode", etcd, i, ttl, decode_extra))
                   for i in range(2)]
        prefills = [with_metrics(start_etcd_worker("prefill", etcd, i, ttl, prefill_extra))
                    for i in range(2)]
        router = start_etcd_router(etcd, free_port())
        # Both decode workers counted in the router's capacity: discovery is complete.
        full = 2 * metric(decodes[0].metrics_url, "tandem_kv_cache_blocks_capacity")
        wait_until(lambda: router_capacity(router.url) == full,
                   "discovery of both decode workers by the router")
    topology.update(router=router, prefills=prefills, decodes=decodes)
    victim = None
    load = None
    try:
        load = Load(router.url, clients)
        time.sleep(seconds / 2)  # load before the failure (how much, not a synchronisation)
        # A kill or drain hits the first worker of its role; a restart of etcd or the router
        # comes while either decode worker streams.
        role = getattr(action, "role", "decode")
        watched = [(prefills if role == "prefill" else decodes)[0]] if hasattr(
            action, "role") else decodes
        wait_until(lambda: any(busy(w, role) for w in watched),
                   f"work in flight on the {role} worker(s) the failure hits")
        event = time.time()
        victim = action(prefills, decodes, topology)
        time.sleep(seconds / 2)
        wait_until(lambda: load.finished_since(event) >= clients,
                   f"{clients} requests started after the failure finishing", limit=2 * HANG_S)
        lost = load.finish(timeout=120)
        records = list(load.records)
        problems = []
        if getattr(action, "drains", False):
            # A draining worker finishes (or hands off) what it has, then exits on its own.
            try:
                code = victim.proc.wait(timeout=2 * HANG_S)
            except subprocess.TimeoutExpired:
                code = "nothing: still running"
            if code != 0:
                problems.append(f"the drained worker exited with {code}")
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
        across = [r for r in in_flight if r[1] >= event]
        recovery = max([r[1] for r in across] + [event]) - event
        # The failure must have hit something: a client stream open across it, and where the
        # failure takes streams from a worker (a kill, a drain without grace), some moved.
        if not across:
            problems.append("no request was in flight across the failure")
        if getattr(action, "moves", False) and retries < 1:
            problems.append("no stream was moved (no retry counted): the failure hit no work")
        if getattr(action, "hands_off", False) and handoffs < 1:
            problems.append("no stream was handed off with its KV")
        if getattr(action, "leaves_etcd", False):
            # The router's capacity is the decode workers' it discovers: once the victim's
            # lease expires, only the survivor's is left.
            left = metric(decodes[1].metrics_url, "tandem_kv_cache_blocks_capacity")
            try:
                wait_until(lambda: router_capacity(topology["router"].url) == left,
                           "leave of the killed group from etcd", limit=ttl + HANG_S)
            except RuntimeError as e:
                problems.append(str(e))
        wrong = [r for r in records if r[2] and r[3] != reference]
        failed = [r for r in records if not r[2]]
        return {
            "scenario": name, "sent": len(records) + lost,
            "succeeded": sum(1 for r in records if r[2]) - len(wrong),
            "failed": len(failed), "wrong_output": len(wrong), "lost": lost,
            "recovery_seconds": round(recovery, 2), "leaked_blocks": leaked,
            "retries": int(retries), "kv_handoffs": int(handoffs),
            "errors": problems + sorted({str(r[4]) for r in failed})[:3], "problems": problems,
        }
    finally:
        if load is not None:
            load.finish(timeout=0)  # a scenario that failed half-way stops its clients too
        for p in [topology["router"]] + prefills + decodes:
            if p is not victim:
                p.stop()
            elif p.proc.poll() is None:
                p.proc.kill()  # a drained victim that never exited
                p.proc.wait()


def restart_etcd(prefills, decodes, topology):
    """etcd down for a second, then back with its data: nobody loses a lease (the etcd
    scenario's TTL, RESTART_ETCD_TTL, is far longer than the outage however slow etcd starts)."""
    topology["etcd"].stop()
    time.sleep(1)  # the outage itself
    topology["etcd"].start()
    return None


RESTART_ETCD_TTL = 2 * HANG_S


def restart_router(prefills, decodes, topology):
    """The router drains (SIGTERM) and a new one takes its port, finding the workers in etcd."""
    old = topology["router"]
    port = int(old.url.rsplit(":", 1)[1])
    old.stop()
    topology["router"] = start_etcd_router(topology["etcd"], port)
    return old


def kill(role, sig, grace=True):
    """SIGKILL or SIGTERM (a drain) of the first worker of `role`, once it holds work; a kill,
    or a drain with no grace, must move the streams it held."""
    def action(prefills, decodes, topology):
        victim = (prefills if role == "prefill" else decodes)[0]
        victim.proc.send_signal(sig)
        return victim
    action.role = role
    action.drains = sig == signal.SIGTERM
    action.moves = sig == signal.SIGKILL or not grace
    return action


def handing_off(action):
    """`action`, which must move some stream with its KV (a KV handoff)."""
    action.hands_off = True
    return action


def kill_tp_rank(prefills, decodes, topology):
    """SIGKILL of one follower rank of the first decode worker's tensor-parallel group: rank 0
    must take the group down at once (its streams then move) and the group must leave etcd
    (its lease, unrenewed, expires)."""
    victim = decodes[0]
    followers = cluster.children(victim.proc.pid)
    if not followers:
        raise RuntimeError("the tensor-parallel decode worker runs no follower process")
    os.kill(followers[0], signal.SIGKILL)
    return victim


kill_tp_rank.role = "decode"
kill_tp_rank.moves = True
kill_tp_rank.leaves_etcd = True


def start_long_run_workers(decode_extra=()):
    """One prefill and two decode workers (DECODE_DELAY: a LONG_TOKENS stream decodes for at
    least 4.8 s) behind a router listing them."""
    decodes = [cluster.start_worker("decode", extra=DECODE_DELAY + list(decode_extra))
               for _ in range(2)]
    prefill = cluster.start_worker("prefill")
    router = cluster.start_router(prefill.address, ",".join(d.address for d in decodes))
    return router, prefill, decodes


def two_sample_migration(reference):
    """A 2-sample greedy stream whose decode worker is killed mid-generation: both samples must
    go on elsewhere and end with exactly the undisturbed text (`reference`, LONG_TOKENS)."""
    router, prefill, decodes = start_long_run_workers()
    victim = None
    t = None
    try:
        result = {}
        t = threading.Thread(target=lambda: result.update(
            r=stream_once(router.url, n=2, max_tokens=LONG_TOKENS)), daemon=True)
        t.start()
        # Kill whichever decode worker holds the request once it has streamed some tokens
        # (it goes on for seconds more: DECODE_DELAY).
        victim = wait_until(lambda: next((d for d in decodes if busy(d, "decode") and
                                          generated(d) >= STARTED_TOKENS), None),
                            "the 2-sample stream decoding")
        killed_at = time.time()
        victim.proc.kill()
        t.join(120)
        ok, text, error = result.get("r", (False, "", "no result"))
        retries = cluster.metric(router.url + "/metrics",
                                 'tandem_request_retries_total{phase="decode"}') or 0
        survivor = [d for d in decodes if d is not victim][0]
        leaked = cluster.wait_for_zero(survivor.metrics_url, "tandem_kv_cache_blocks_used")
        good = ok and text == reference and retries >= 1 and leaked == 0
        errors = [] if ok else [str(error)]
        if ok and retries < 1:
            errors.append("the stream was not moved (no decode retry counted)")
        return {"scenario": "2-sample stream, its decode worker killed", "sent": 1,
                "succeeded": int(good), "failed": int(not ok),
                "wrong_output": int(ok and text != reference), "lost": int(t.is_alive()),
                "recovery_seconds": round(time.time() - killed_at, 2),
                "retries": int(retries), "leaked_blocks": {} if leaked == 0 else
                {survivor.address: leaked}, "errors": errors}
    finally:
        for p in [router, prefill] + decodes:
            if p is not victim:
                p.stop()
        if t is not None:
            t.join(HANG_S)


def drain_handoff(reference):
    """A 1-sample and a 2-sample greedy stream whose decode worker drains (SIGTERM, no grace)
    mid-generation: it parks them, the router moves their KV to the other decode worker
    (Handoff) instead of recomputing, and both end with exactly the undisturbed text
    (`reference`, LONG_TOKENS). Checks the router's handoff counter, that the draining worker
    exits on its own, and that no KV block stays in use. The decode workers' DECODE_DELAY keeps
    the streams generating for seconds after the drain starts, on any machine."""
    router, prefill, decodes = start_long_run_workers(["--drain-grace", "0"])
    victim = None
    threads = []
    try:
        results = [{}, {}]
        threads = [threading.Thread(target=lambda r=r, n=n: r.update(r=stream_once(
            router.url, n=n, max_tokens=LONG_TOKENS)), daemon=True)
            for r, n in zip(results, (1, 2))]
        for t in threads:
            t.start()

        # Drain the decode worker that holds both requests' samples once they decode and it
        # has streamed some tokens (the router puts them on one worker when the other is
        # busier); if they are spread over both, the one holding more.
        def pick():
            running = {id(d): metric(d.metrics_url, "tandem_num_requests_running") or 0
                       for d in decodes}
            if sum(running.values()) < 3:
                return None
            busiest = max(decodes, key=lambda d: running[id(d)])
            return busiest if generated(busiest) >= STARTED_TOKENS else None
        victim = wait_until(pick, "the three samples decoding")
        drained_at = time.time()
        victim.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        try:
            exited = victim.proc.wait(timeout=2 * HANG_S)
        except subprocess.TimeoutExpired:
            exited = "nothing: still running"
        outcomes = [r.get("r", (False, "", "no result")) for r in results]
        metrics = router.url + "/metrics"
        # The router counts a handoff (and its bytes) when the continuation's stream on the
        # other worker ends, which can come just after the client has read its last event: the
        # count is read until it shows or 5 s pass, and the bytes after it.
        deadline = time.time() + 5
        while True:
            handoffs = cluster.metric(
                metrics, 'tandem_request_retries_total{phase="kv_handoff"}') or 0
            if handoffs >= 1 or time.time() > deadline:
                break
            time.sleep(0.05)
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
            elif p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()
        for t in threads:
            t.join(HANG_S)


def membership_scenario(tmp):
    """Workers joining and leaving are picked up by the router: a decode worker that registers
    is served with, and one killed (SIGKILL, so only its lease's expiry tells) is dropped. The
    times are reported; they are bounded only to catch a router that never follows (HANG_S,
    far beyond the lease TTL)."""
    etcd = Etcd(os.path.join(tmp, "etcd-membership"))
    procs = []
    try:
        procs.append(with_metrics(start_etcd_worker("prefill", etcd, 0, MEMBERSHIP_TTL)))
        router = start_etcd_router(etcd, free_port())
        procs.append(router)
        # Join: a decode worker registers; the router serves with it.
        joined = time.time()
        decode = with_metrics(start_etcd_worker("decode", etcd, 0, MEMBERSHIP_TTL))
        procs.append(decode)
        capacity = metric(decode.metrics_url, "tandem_kv_cache_blocks_capacity")
        problems = []
        try:
            wait_until(lambda: router_capacity(router.url) == capacity, "join seen by the router")
        except RuntimeError as e:
            problems.append(str(e))
        join_s = time.time() - joined
        ok, _, error = stream_once(router.url)
        # Leave: SIGKILL, so only the lease's expiry tells.
        decode.proc.kill()
        left = time.time()
        try:
            wait_until(lambda: router_capacity(router.url) == 0, "leave seen by the router")
        except RuntimeError as e:
            problems.append(str(e))
        leave_s = time.time() - left
        return {"scenario": f"etcd: join picked up in {join_s:.2f} s, leave in {leave_s:.2f} s "
                            f"(TTL {MEMBERSHIP_TTL} s)",
                "sent": 1, "succeeded": int(ok), "failed": int(not ok), "wrong_output": 0,
                "lost": 0, "recovery_seconds": round(max(join_s, leave_s), 2), "retries": 0,
                "leaked_blocks": {}, "problems": problems,
                "errors": problems + ([] if ok else [str(error)])}
    finally:
        for p in reversed(procs):
            p.stop()
        etcd.stop()


# Lines of a process's stderr that tell what happened to requests and workers.
LOG_PATTERN = re.compile(r"lost its etcd|handoff|goes on elsewhere|left|joined|received|error",
                         re.I)


def log_excerpt(log_dir, limit=40):
    """The telling lines of every process log a scenario left (TANDEM_TEST_LOGS), for a failed
    scenario's report."""
    lines = []
    if not os.path.isdir(log_dir):
        return lines
    for name in sorted(os.listdir(log_dir)):
        with open(os.path.join(log_dir, name), errors="replace") as f:
            hits = [line.rstrip() for line in f if LOG_PATTERN.search(line)]
        lines += [f"{name}: {line}" for line in hits[-limit // 4:]]
    return lines[-limit:]


def is_bad(r):
    return (r["failed"] or r["wrong_output"] or r["lost"] or r["leaked_blocks"] or
            r.get("problems") or r["sent"] == 0 or r["succeeded"] != r["sent"])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("tandem")
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--json")
    parser.add_argument("--only", help="run only the scenarios whose name contains this text")
    a = parser.parse_args()
    cluster.TANDEM = a.tandem
    # No grace, and streams that outlast the SIGTERM's path to the drain (with etcd the worker
    # unregisters first): a MAX_TOKENS stream decodes for at least 4.8 s at 100 ms a step, so
    # the streams the victim held when it was signalled are still running when it parks them.
    no_grace = ["--drain-grace", "0", "--step-delay-ms", "100"]
    # (name, action, with etcd, extra decode flags, extra prefill flags)
    scenarios = [
        ("SIGKILL decode worker", kill("decode", signal.SIGKILL), False, (), ()),
        # The prefill workers step slowly (PREFILL_DELAY), so the one killed holds prompts.
        ("SIGKILL prefill worker", kill("prefill", signal.SIGKILL), False, (), PREFILL_DELAY),
        ("SIGTERM (drain) decode worker", kill("decode", signal.SIGTERM), False, (), ()),
        # No grace: the streams running at SIGTERM move to the other decode worker by KV
        # handoff at once (with the default 30 s grace these streams all finish first).
        ("SIGTERM (drain, no grace) decode", kill("decode", signal.SIGTERM, grace=False), False,
         no_grace, ()),
        ("etcd: SIGKILL decode worker", kill("decode", signal.SIGKILL), True, (), ()),
        ("etcd: SIGTERM (drain) decode worker", kill("decode", signal.SIGTERM), True, (), ()),
        # Decode workers of 2 tensor-parallel ranks each: the drained group's ranks each push
        # their KV heads to the other group's ranks.
        ("SIGTERM (drain, no grace) tp=2 decode", handing_off(kill("decode", signal.SIGTERM,
                                                                     grace=False)),
         False, no_grace + ["--tp", "2"], ()),
        # Decode workers of 2 tensor-parallel ranks each; one rank of one group is killed.
        ("etcd: SIGKILL one rank of a tp=2 decode", kill_tp_rank, True, ["--tp", "2"], ()),
        ("etcd: SIGTERM (drain, no grace) decode", kill("decode", signal.SIGTERM, grace=False),
         True, no_grace, ()),
        ("etcd: restart etcd", restart_etcd, True, (), ()),
        ("etcd: restart the router", restart_router, True, (), ()),
    ]
    if not os.path.exists(ETCD):
        print(f"FAIL: {ETCD} is missing (scripts/install-deps installs etcd-server)")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        logs = os.environ.get("TANDEM_TEST_LOGS") or os.path.join(tmp, "logs")
        cluster.MODEL = os.path.join(tmp, "tiny")
        subprocess.run([a.tandem, "synth-model", "--preset", "tiny", "--out", cluster.MODEL],
                       check=True, stdout=subprocess.DEVNULL)
        # The undisturbed outputs every request must reproduce.
        colocated = cluster.start_colocated()
        try:
            ok, reference, error = stream_once(colocated.url)
            ok_long, reference_long, error_long = stream_once(colocated.url,
                                                              max_tokens=LONG_TOKENS)
        finally:
            colocated.stop()
        if not ok or not ok_long:
            print(f"FAIL: reference run failed: {error or error_long}")
            return 1
        rows = []
        if a.only is None:
            rows += [two_sample_migration(reference_long), drain_handoff(reference_long)]
        for name, action, with_etcd, decode_extra, prefill_extra in scenarios:
            if a.only is not None and a.only not in name:
                continue
            print(f"running: {name}", flush=True)
            etcd = Etcd(os.path.join(tmp, f"etcd-{len(rows)}")) if with_etcd else None
            ttl = RESTART_ETCD_TTL if action is restart_etcd else LEASE_TTL
            # Each scenario's process logs in a directory of their own, quoted if it fails.
            log_dir = os.path.join(logs, f"scenario-{len(rows)}")
            os.environ["TANDEM_TEST_LOGS"] = log_dir
            try:
                row = run_scenario(name, action, reference, a.seconds, a.clients, etcd, ttl,
                                   decode_extra, prefill_extra)
            finally:
                if etcd is not None:
                    etcd.stop()
            if is_bad(row):
                row["log"] = log_excerpt(log_dir)
            rows.append(row)
        if a.only is None:
            rows.append(membership_scenario(tmp))

    print(f"{'scenario':40} {'sent':>5} {'ok':>5} {'failed':>6} {'wrong':>5} {'lost':>4} "
          f"{'recovery s':>10} {'retries':>7} {'kv hand':>7}  leaked blocks")
    for r in rows:
        print(f"{r['scenario']:40} {r['sent']:5d} {r['succeeded']:5d} {r['failed']:6d} "
              f"{r['wrong_output']:5d} {r['lost']:4d} {r['recovery_seconds']:10.2f} {r['retries']:7d} "
              f"{r.get('kv_handoffs', 0):7d}  {r['leaked_blocks'] or 0}")
        for e in r["errors"]:
            print(f"    error: {e}")
        for line in r.get("log", []):
            print(f"    log: {line}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)
    bad = [r for r in rows if is_bad(r)]
    if bad:
        print("FAIL:", ", ".join(r["scenario"] for r in bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
