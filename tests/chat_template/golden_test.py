#!/usr/bin/python3
"""chat_template_golden: Tandem's chat template rendering must equal Jinja2's byte for byte.

Renders every case in cases.py with Jinja2 the way Hugging Face transformers does
(render_golden.py) and with Tandem (the tandem_render_template binary), then compares.
Where Jinja2 fails Tandem must fail too; where the template calls raise_exception(msg), Tandem's
error must be exactly msg.

Usage: /usr/bin/python3 golden_test.py --tandem BUILD/bin/tandem_render_template [--filter S]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cases  # noqa: E402
import render_golden  # noqa: E402

def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tandem", required=True, help="path to tandem_render_template")
    parser.add_argument("--filter", default="", help="only cases whose id contains this")
    parser.add_argument("-v", "--verbose", action="store_true", help="list every case")
    args = parser.parse_args()

    missing = [d for d in cases.REAL_MODELS.values() if not os.path.isdir(d)]
    if missing:
        print("missing reference tokenizers (run scripts/install-deps):", *missing, sep="\n  ")
        return 1

    with tempfile.TemporaryDirectory(prefix="tandem_chat_golden_") as tmp:
        jobs = [j for j in cases.all_cases(os.path.join(tmp, "models")) if args.filter in j["id"]]
        expected = [render_golden.render_case(j) for j in jobs]
        cases_path = os.path.join(tmp, "cases.json")
        with open(cases_path, "w", encoding="utf-8") as f:
            json.dump(jobs, f, ensure_ascii=False)
        run = subprocess.run([args.tandem, cases_path], capture_output=True)
        if run.returncode != 0:
            print(run.stderr.decode(errors="replace"))
            print(f"tandem_render_template exited with {run.returncode}")
            return 1
        actual = json.loads(run.stdout.decode("utf-8"))

    failures = 0
    counts = {"output": 0, "raised": 0, "error": 0}
    for job, want, got in zip(jobs, expected, actual):
        kind = next(iter(want))
        counts[kind] += 1
        problem = None
        if job.get("expect") == "ok" and kind != "output":
            problem = f"Jinja2 was expected to render but failed: {want}"
        elif job.get("expect") == "error" and kind == "output":
            problem = "Jinja2 was expected to fail but rendered"
        elif kind == "output" and got.get("output") != want["output"]:
            problem = (f"output differs\n  jinja2: {want['output']!r}\n"
                       f"  tandem: {got.get('output', got.get('error'))!r}")
        elif kind == "raised" and got.get("error") != want["raised"]:
            problem = (f"raise_exception message differs\n  jinja2: {want['raised']!r}\n"
                       f"  tandem: {got.get('output', got.get('error'))!r}")
        elif kind == "error" and "error" not in got:
            problem = f"Jinja2 failed ({want['error']}) but Tandem rendered {got['output']!r}"
        if problem:
            failures += 1
            print(f"FAIL {job['id']}: {problem}")
        elif args.verbose:
            print(f"ok   {job['id']} ({kind})")

    print(f"{len(jobs)} cases: {counts['output']} rendered, {counts['raised']} raise_exception, "
          f"{counts['error']} other errors; {failures} mismatches")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
