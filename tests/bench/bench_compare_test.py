#!/usr/bin/env python3
"""`tandem bench` comparing `tandem serve --colocated` with `tandem serve` (disaggregated) in one
run: a two-rate sweep against both, JSON with every report, SVG plots checked against the data,
the progress line on a terminal and not elsewhere, and bad flags.

usage: bench_compare_test.py TANDEM_BINARY
"""
import json
import os
import pty
import re
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

SVG = "{http://www.w3.org/2000/svg}"
NUM_REQUESTS = 8
RATES = [20.0, 40.0]
TTFT_SLO, TPOT_SLO = 2.0, 0.5


def check(cond, message):
    if not cond:
        print("FAIL:", message, file=sys.stderr)
        sys.exit(1)


def start_server(tandem, model_dir, extra):
    server = subprocess.Popen([tandem, "serve", "--model", model_dir, "--port", "0"] + extra,
                              stdout=subprocess.PIPE, text=True)
    for line in server.stdout:
        m = re.search(r"serving (\S+) on (http://127\.0\.0\.1:\d+)", line)
        if m:
            return server, m.group(1), m.group(2)
    check(False, f"server {extra} did not print its URL")


def stop(server):
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()


def axis_map(panel, cls):
    """Pixel -> data mapping of one axis, from its ticks' data-value and positions."""
    ticks = []
    for line in panel.iter(SVG + "line"):
        if line.get("class") == cls:
            pos = float(line.get("x1") if cls == "xtick" else line.get("y1"))
            ticks.append((pos, float(line.get("data-value"))))
    check(len(ticks) >= 2, f"fewer than two {cls}s")
    (p0, v0), (p1, v1) = ticks[0], ticks[-1]
    return lambda p: v0 + (p - p0) * (v1 - v0) / (p1 - p0), abs(v1 - v0)


def panel_series(path):
    """{panel title: {series name: [(x, y), ...] in data units}} of one SVG file."""
    root = ET.parse(path).getroot()  # raises on malformed XML
    check(root.tag == SVG + "svg", f"{path}: root is {root.tag}")
    out = {}
    for g in root.iter(SVG + "g"):
        if g.get("class") != "panel":
            continue
        fx, xspan = axis_map(g, "xtick")
        fy, yspan = axis_map(g, "ytick")
        series = {}
        for pl in g.iter(SVG + "polyline"):
            pts = [tuple(map(float, p.split(","))) for p in pl.get("points").split()]
            series[pl.get("data-series")] = ([(fx(x), fy(y)) for x, y in pts], xspan, yspan)
        markers = {}
        for c in g.iter(SVG + "circle"):
            markers.setdefault(c.get("data-series"), []).append(
                (fx(float(c.get("cx"))), fy(float(c.get("cy")))))
        out[g.get("data-title")] = (series, markers)
    legend = [t.text for t in root.iter(SVG + "text") if t.get("class") == "legend-entry"]
    return out, legend


def close(a, b, span):
    return abs(a - b) <= 0.01 * span + 1e-9


def check_report(r, label):
    n = NUM_REQUESTS
    check(r["label"] == label, f"label {r['label']} != {label}")
    check(r["requests_sent"] == n and r["requests_succeeded"] == n and r["requests_failed"] == 0,
          f"{label} @ {r['request_rate']}: {r['requests_succeeded']}/{r['requests_sent']} succeeded")
    check(r["output_tokens"] == 8 * n, f"{label}: output_tokens {r['output_tokens']}")
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        m = r[metric]
        check(0 <= m["p50"] <= m["p90"] <= m["p99"], f"{label} {metric} out of order: {m}")
    slo = r["slo"]
    check(slo["ttft_s"] == TTFT_SLO and slo["tpot_s"] == TPOT_SLO, f"{label} slo: {slo}")
    check(0 <= slo["attainment"] <= 1, f"{label} attainment {slo['attainment']}")
    check(slo["goodput"] <= r["request_throughput"] + 1e-9,
          f"{label} goodput {slo['goodput']} > throughput {r['request_throughput']}")
    good = sum(1 for q in r["requests"]
               if q["success"] and q["ttft_ms"] <= TTFT_SLO * 1e3 and q["tpot_ms"] <= TPOT_SLO * 1e3)
    check(abs(slo["attainment"] - good / n) < 1e-9, f"{label} attainment != {good}/{n}")
    check(abs(slo["goodput"] - good / r["duration_s"]) < 1e-6, f"{label} goodput")
    for q in r["requests"]:
        # One gap per content chunk after the first (a token may decode to no text yet).
        check(len(q["itl_ms"]) <= q["output_tokens"] - 1, f"{label}: itls {q}")
        tpot = (q["e2e_ms"] - q["ttft_ms"]) / (q["output_tokens"] - 1)
        check(abs(q["tpot_ms"] - tpot) < 1e-6, f"{label}: tpot {q}")


def main():
    tandem = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "tiny")
        subprocess.run([tandem, "synth-model", "--preset", "tiny", "--out", model_dir],
                       check=True, stdout=subprocess.DEVNULL)
        colocated, name, url_a = start_server(tandem, model_dir, ["--colocated"])
        try:
            disagg, name_b, url_b = start_server(tandem, model_dir, [])
            try:
                check(name == name_b, f"model names differ: {name} {name_b}")
                out = os.path.join(tmp, "out.json")
                plots = os.path.join(tmp, "plots")
                cmd = [tandem, "bench", "--url", url_a, "--url", url_b,
                       "--label", "colocated", "--label", "disaggregated", "--model", name,
                       "--num-requests", str(NUM_REQUESTS), "--input-len", "16",
                       "--output-len", "8", "--request-rate-sweep",
                       ",".join(f"{r:g}" for r in RATES), "--seed", "3",
                       "--ttft-slo", str(TTFT_SLO), "--tpot-slo", str(TPOT_SLO),
                       "--json", out, "--plot-dir", plots]
                run = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
                print(run.stdout)
                check(run.returncode == 0, f"bench exited {run.returncode}: {run.stderr}")
                check(run.stderr == "", f"progress or noise on a non-terminal stderr: {run.stderr!r}")
                check("Goodput (req/s)" in run.stdout and "disaggregated" in run.stdout,
                      "no side-by-side table")

                # The progress line on a terminal (stderr is a pty), once more at one rate.
                master, slave = pty.openpty()
                tty_run = subprocess.run(
                    [tandem, "bench", "--url", url_a, "--model", name, "--num-requests", "4",
                     "--input-len", "4", "--output-len", "4", "--label", "colocated"],
                    stdout=subprocess.PIPE, stderr=slave, text=True, timeout=120)
                os.close(slave)
                tty_err = b""
                while True:
                    try:
                        chunk = os.read(master, 4096)
                    except OSError:
                        break
                    if not chunk:
                        break
                    tty_err += chunk
                os.close(master)
                check(tty_run.returncode == 0, f"tty run exited {tty_run.returncode}")
                check(b"4/4 finished, 4 sent, 0 failed" in tty_err,
                      f"no progress line on a terminal: {tty_err!r}")
            finally:
                stop(disagg)
        finally:
            stop(colocated)

        with open(out) as f:
            doc = json.load(f)
        runs = doc["runs"]
        check(len(runs) == 4, f"{len(runs)} runs, want 2 endpoints x 2 rates")
        check(doc["slo"] == {"ttft_s": TTFT_SLO, "tpot_s": TPOT_SLO}, f"slo: {doc['slo']}")
        expected = [("colocated", url_a), ("colocated", url_a),
                    ("disaggregated", url_b), ("disaggregated", url_b)]
        for r, (label, url), rate in zip(runs, expected, RATES * 2):
            check(r["url"] == url and r["request_rate"] == rate, f"run order: {r['url']} {rate}")
            check_report(r, label)
        # The same workload against both: same prompt lengths (reported by the servers).
        for i in range(2):
            a = [q["prompt_tokens"] for q in runs[i]["requests"]]
            b = [q["prompt_tokens"] for q in runs[i + 2]["requests"]]
            check(a == b, f"prompts differ between endpoints: {a} {b}")

        # Latency CDFs: per panel, per run, the sorted per-request values at (i+1)/n.
        panels, legend = panel_series(os.path.join(plots, "latency_cdf.svg"))
        check(set(panels) == {"TTFT", "TPOT", "E2E"}, f"cdf panels: {list(panels)}")
        check(len(legend) == 4, f"cdf legend: {legend}")
        for title, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("E2E", "e2e_ms")):
            series, _ = panels[title]
            for r in runs:
                name_r = f"{r['label']} @ {r['request_rate']:g} req/s"
                check(name_r in series, f"{title}: no series {name_r}: {list(series)}")
                pts, xspan, yspan = series[name_r]
                values = sorted(q[key] for q in r["requests"])
                check(len(pts) == len(values), f"{title} {name_r}: {len(pts)} points")
                for i, ((x, y), v) in enumerate(zip(pts, values)):
                    check(close(x, v, xspan), f"{title} {name_r}: x {x} != {v}")
                    check(close(y, (i + 1) / len(values), yspan), f"{title} {name_r}: y {y}")
                check(all(b[0] >= a[0] and b[1] >= a[1] for a, b in zip(pts, pts[1:])),
                      f"{title} {name_r}: CDF not monotonic")

        # Attainment and goodput against the rate, one line per endpoint.
        panels, legend = panel_series(os.path.join(plots, "attainment_vs_rate.svg"))
        check(len(panels) == 2, f"attainment panels: {list(panels)}")
        (att_series, att_markers), (good_series, _) = (panels["SLO attainment"],
                                                       panels[[t for t in panels
                                                               if t.startswith("Goodput")][0]])
        for label in ("colocated", "disaggregated"):
            mine = [r for r in runs if r["label"] == label]
            pts, xspan, yspan = att_series[label]
            check(len(pts) == len(RATES) and len(att_markers[label]) == len(RATES),
                  f"{label}: {len(pts)} attainment points")
            for (x, y), r in zip(pts, mine):
                check(close(x, r["request_rate"], xspan), f"{label}: rate {x}")
                check(close(y, r["slo"]["attainment"], yspan), f"{label}: attainment {y}")
            pts, xspan, yspan = good_series[label]
            for (x, y), r in zip(pts, mine):
                check(close(y, r["slo"]["goodput"], yspan), f"{label}: goodput {y}")
            pts, xspan, yspan = good_series[label + " throughput"]
            for (x, y), r in zip(pts, mine):
                check(close(y, r["request_throughput"], yspan), f"{label}: throughput {y}")

    # Bad flags: non-zero exit, one line on stderr naming the problem.
    for args, needle in (
            (["--label", "a", "--label", "b"], "--label"),
            (["--request-rate", "2", "--sweep", "1,2"], "exclude"),
            (["--sweep", "1,x"], "sweep"),
            (["--input-len-dist", "gauss"], "--input-len-dist"),
            (["--input-len-dist", "normal"], "--input-len-std"),
            (["--output-len-range", "3"], "uniform"),
            (["--max-concurrency", "0"], "--max-concurrency"),
            (["--url"], "--url")):
        run = subprocess.run([tandem, "bench", "--url", "http://127.0.0.1:1", "--model", "x",
                              "--num-requests", "1"] + args,
                             capture_output=True, text=True, timeout=60)
        lines = run.stderr.strip().splitlines()
        check(run.returncode != 0 and len(lines) == 1 and needle in lines[0],
              f"{args}: rc {run.returncode}, stderr {run.stderr!r}")
    print("ok")


if __name__ == "__main__":
    main()
