#!/usr/bin/env python3
"""Keeps deploy/ in step with the code: every metric the Grafana dashboard and the Prometheus
rules query is one the router or a worker exports (or a recording rule the rules file defines),
and the dashboard is importable (datasource input, ids, layout).

usage: dashboard_test.py SOURCE_DIR
"""
import json
import os
import re
import sys

FAILURES = []


def check(cond, message):
    if not cond:
        FAILURES.append(message)


def exported_metrics(source_dir):
    """Metric names registered (metrics::Registry::Counter/Gauge/Histogram) by the router, the
    workers and the engine's own families, histogram series included."""
    names = set()
    register = re.compile(r'registry\.(Counter|Gauge|Histogram)\(\s*"(tandem_\w+)"')
    for folder in ("router", "worker", "prefill_worker", "decode_worker", "cluster", "engine"):
        for root, _, files in os.walk(os.path.join(source_dir, folder)):
            for f in files:
                if not f.endswith((".cc", ".h")) or f.endswith("_test.cc"):
                    continue
                with open(os.path.join(root, f)) as src:
                    for kind, name in register.findall(src.read()):
                        names.add(name)
                        if kind == "Histogram":
                            names.update(name + s for s in ("_bucket", "_sum", "_count"))
    return names


def parse_rules(path):
    """(recording rule name -> expr, [(alert name, expr)]) from the rules file. Handles what
    the file uses: `- record:` / `- alert:` items with `expr:` inline or as a `|` block."""
    records, alerts = {}, []
    lines = open(path).read().splitlines()
    current = None
    i = 0
    while i < len(lines):
        line = lines[i]
        m = re.match(r"\s*- (record|alert):\s*(\S+)\s*$", line)
        if m:
            current = (m.group(1), m.group(2))
        m = re.match(r"(\s*)expr:\s*(.*)$", line)
        if m and current is not None:
            indent, value = len(m.group(1)), m.group(2)
            if value.strip() in ("|", ">", "|-", ">-"):
                block = []
                while i + 1 < len(lines) and (not lines[i + 1].strip() or
                                              len(lines[i + 1]) - len(lines[i + 1].lstrip()) > indent):
                    i += 1
                    block.append(lines[i].strip())
                value = " ".join(block)
            if current[0] == "record":
                check(current[1] not in records, f"recording rule {current[1]} defined twice")
                records[current[1]] = value
            else:
                alerts.append((current[1], value))
            current = None
        i += 1
    return records, alerts


PROMQL_WORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left",
                "group_right", "bool", "offset", "inf", "nan"}


def series_names(expr):
    """Metric and recording-rule names an expression selects (not functions, labels, strings)."""
    e = re.sub(r'"(\\.|[^"\\])*"|\'(\\.|[^\'\\])*\'', '""', expr)   # string literals
    e = re.sub(r"\[[^\]]*\]", "", e)                                 # range selectors
    e = re.sub(r"\{[^}]*\}", "", e)                                  # label matchers
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        word = m.group(0)
        rest = e[m.end():].lstrip()
        if word.lower() in PROMQL_WORDS or rest.startswith("("):
            continue
        if m.start() > 0 and e[m.start() - 1] in "$.0123456789":  # $vars, 1e3, 0.5
            continue
        names.add(word)
    return names


def self_test():
    got = series_names('histogram_quantile(0.99, sum by (job, le) (rate(a_bucket{job=~"$job",'
                       'x="y{z}"}[5m]))) / on(job) group_left(slo) b:c:d{s="t"} > 0.5 and '
                       'max(tandem_x[$__rate_interval]) offset 5m')
    check(got == {"a_bucket", "b:c:d", "tandem_x"}, f"series_names self-test: {got}")


def main():
    source_dir = sys.argv[1]
    self_test()
    exported = exported_metrics(source_dir)
    for must in ("tandem_requests_slo_total", "tandem_requests_slo_met_total",
                 "tandem_time_per_output_token_seconds_bucket", "tandem_kv_transfer_bytes_total"):
        check(must in exported, f"the code does not export {must} (scan broken?)")
    records, alerts = parse_rules(os.path.join(source_dir, "deploy/prometheus/tandem-rules.yaml"))
    check(len(records) >= 10 and len(alerts) >= 4, f"rules file parsed to {len(records)} "
          f"recording rules and {len(alerts)} alerts")
    known = exported | set(records) | {"up"}

    def check_expr(where, expr):
        check(expr.strip() != "", f"{where}: empty expression")
        for name in sorted(series_names(expr)):
            if ":" in name:
                check(name in records, f"{where}: recording rule {name} is not defined "
                      "in deploy/prometheus/tandem-rules.yaml")
            else:
                check(name in known, f"{where}: metric {name} is not exported by the code")

    for name, expr in records.items():
        check_expr(f"rule {name}", expr)
        check(re.fullmatch(r"[a-z_]+:[a-z0-9_]+:[a-z0-9_]+", name) is not None,
              f"rule {name}: not named level:metric:operations")
    for name, expr in alerts:
        check_expr(f"alert {name}", expr)

    with open(os.path.join(source_dir, "deploy/grafana/tandem-dashboard.json")) as f:
        dash = json.load(f)
    check(dash.get("schemaVersion", 0) >= 36, "schemaVersion")
    check(any(i.get("name") == "DS_PROMETHEUS" and i.get("pluginId") == "prometheus"
              for i in dash.get("__inputs", [])), "no DS_PROMETHEUS datasource input")
    check(dash.get("uid") and dash.get("title"), "uid and title")
    ids = set()
    used_records = set()
    titles = []
    for p in dash["panels"]:
        check(p["id"] not in ids, f"panel id {p['id']} twice")
        ids.add(p["id"])
        g = p.get("gridPos", {})
        check(all(k in g for k in "xywh") and g["x"] + g["w"] <= 24, f"panel {p['id']} gridPos")
        if p["type"] == "row":
            continue
        titles.append(p["title"])
        check(p.get("datasource", {}).get("uid") == "${DS_PROMETHEUS}",
              f"panel {p['title']}: datasource is not ${{DS_PROMETHEUS}}")
        check(p.get("targets"), f"panel {p['title']}: no targets")
        for t in p.get("targets", []):
            check(t.get("datasource", {}).get("uid") == "${DS_PROMETHEUS}",
                  f"panel {p['title']} target {t.get('refId')}: datasource")
            check_expr(f"panel {p['title']!r}", t.get("expr", ""))
            used_records |= {n for n in series_names(t.get("expr", "")) if ":" in n}
    for v in dash.get("templating", {}).get("list", []):
        q = v.get("definition", "")
        m = re.fullmatch(r"label_values\((\w+),\s*\w+\)", q)
        check(m is not None and m.group(1) in known, f"variable {v.get('name')}: {q}")
    for wanted in ("Time to first token", "Time per output token", "SLO attainment",
                   "Goodput and throughput", "Requests running and waiting", "KV cache usage",
                   "KV transfer bandwidth", "KV transfer hidden behind prefill", "Preemptions"):
        check(wanted in titles, f"no panel {wanted!r}")
    # The SLO lines: the latency panels draw the configured objectives.
    exprs = json.dumps(dash)
    for gauge in ("tandem_slo_ttft_seconds", "tandem_slo_tpot_seconds"):
        check(gauge in exprs, f"the dashboard does not draw {gauge}")
    print(f"{len(exported)} exported series, {len(records)} recording rules "
          f"({len(used_records)} on the dashboard), {len(alerts)} alerts, {len(titles)} panels")

    if FAILURES:
        for f in FAILURES:
            print("FAIL:", f, file=sys.stderr)
        sys.exit(1)
    print("OK")


if __name__ == "__main__":
    main()
