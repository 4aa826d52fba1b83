// The tokenizer conformance corpus: hand-picked edge cases plus deterministic random mixes of
// scripts, emoji, code, numbers, whitespace runs, NFC/NFD spellings and special-token strings.
// Texts may hold '\n'; they travel as JSON strings. Run directly to print it as JSON lines:
//   node tests/tokenizer/corpus.mjs > corpus.jsonl

// Small deterministic PRNG (mulberry32) so that every run, on every machine, sees the same texts.
function rng(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const ENGLISH = [
  "The quick brown fox jumps over the lazy dog.",
  "Hello, world!",
  "It's a truth universally acknowledged",
  "I'LL be there; you'RE late, she'S right, they'VE gone, we'd go, I'M in, don'T",
  "She said: \"Don't panic.\"",
  "rock'n'roll isn't dead",
  "Mr. O'Neil's dog's bone",
  "e-mail, re-enter, co-operate",
  "UPPER lower MiXeD CamelCase snake_case kebab-case",
  "What's the time? It's 10:45 a.m.",
  "Wait... what?!",
  "(parenthetical) [bracketed] {braced} <angled>",
  "#hashtag @mention $dollar %percent ^caret &amp *star",
  "naïve café résumé coöperate façade jalapeño",
  "Straße, Æsir, Øresund, Ångström, Łódź, Škoda, Ğ",
  "ﬁnancial ﬂower (ligatures)",
  "A\u00adsoft\u00adhyphen",
];

const CJK = [
  "漢字のテキスト", "中文分词测试，标点符号。", "日本語の文章です。", "カタカナとひらがな",
  "한국어 문장입니다.", "안녕하세요 세계", "ｆｕｌｌｗｉｄｔｈ　ＡＢＣ１２３", "㍿㌔㌢", "龍龍龍",
  "「引用」『二重』【括弧】", "𠀋𠂤𪚲 (supplementary ideographs)",
];

const EMOJI = [
  "😀", "👍🏽", "👩‍💻", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇫🇷🇯🇵🇧🇷", "❤️", "🧑🏿‍🚀", "✊🏾", "1️⃣", "🫠",
  "👩🏻‍❤️‍💋‍👨🏼", "🐈‍⬛", "🎉🎉🎉", "©️®️™️", "⌚⏰", "🤷‍♀️",
];

const CODE = [
  "for (int i = 0; i < n; ++i) { sum += a[i]; }",
  "def f(x):\n    return x ** 2\n",
  "console.log(`${a} + ${b}`);",
  "#include <vector>\n#include \"tandem/engine/tokenizer.h\"",
  "SELECT * FROM users WHERE id = 42 AND name LIKE '%bob%';",
  "x := y << 3 | 0xFF & ~mask",
  "arr[i] += 1e-9; // epsilon",
  "<div class=\"a\" id='b'>text</div>",
  "fn main() -> Result<(), Box<dyn Error>> { Ok(()) }",
  "if x != None and y >= 2:\n\tpass",
  "λx.x → ∀y∃z (y ≤ z)",
  "{\"key\": [1, 2.5, true, null], \"nested\": {\"a\": \"b\"}}",
  "$ ls -la ~/src | grep '\\.cc$' > out.txt 2>&1",
  "    indented with four spaces",
  "\t\ttwo tabs\tthen text",
  "a==b!=c<=d>=e&&f||g",
  "https://example.com/path?query=1&x=%20#frag",
];

const NUMBERS = [
  "1234567890123456789012345", "3.14159265358979", "1,000,000", "-42", "0.000001", "2024-01-01",
  "12:30:45", "+1 (555) 010-9999", "١٢٣٤٥", "१२३४", "๑๒๓", "ⅫⅣ", "½ ¾ ⅓", "x² + y³", "①②③",
  "𝟘𝟙𝟚", "0x7FFFFFFF", "1e+308", "99.9%", "$1,234.56", "€5", "7" + "0".repeat(40),
];

const SCRIPTS = [
  "مرحبا بالعالم", "السَّلامُ عَلَيْكُم", "שלום עולם", "नमस्ते दुनिया", "क़ क्षत्रिय",
  "Привет, мир! Ёжик", "สวัสดีชาวโลก", "안녕하세요", "Γειά σου Κόσμε", "გამარჯობა", "Բարեւ",
  "வணக்கம்", "হ্যালো", "ሰላም", "ᠮᠣᠩᠭᠣᠯ", "Ελληνικά ΆΈΉ", "Tiếng Việt có dấu", "ꦲꦤꦕꦫꦏ",
  "ខ្មែរ", "ລາວ", "မြန်မာ", "𝐁𝐨𝐥𝐝 𝑰𝒕𝒂𝒍𝒊𝒄", "𝄞 music", "ﷺ",
];

// Spellings that NFC changes: combining sequences, Hangul jamo, singletons, exclusions.
const NFD = [
  "e\u0301", "A\u030a", "e\u0323\u0302", "\u1112\u1161\u11ab\u1100\u1173\u11af",
  "\u212b", "\u2126", "\u0958", "o\u0308\u0304", "n\u0303", "c\u0327a", "\u1e9b\u0323",
  "I\u0307", "a\u0328\u0301", "\u0915\u093c", "\u05d1\u05bc", "Cafe\u0301 na\u0131\u0308ve",
];

const WHITESPACE = [
  " ", "  ", "   ", "    ", "\t", "\t\t", "\n", "\n\n", "\n\n\n", "\r\n", "\r", "\r\r\n",
  " \n ", "\u00a0", "\u00a0\u00a0", "\u2003", "\u3000", "\u2009", "\u202f", "\u205f",
  "\u2028", "\u2029", "\u000b", "\u000c", "\u200b", "\u200c", "\u200d", "\u180e", " \t \n\t",
  "        ", " \u00a0 ",
];

const SPECIAL = [
  "<|eot_id|>", "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
  "<|end_header_id|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>",
  "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|reserved_special_token_5|>", "<|eot_id",
  "<|im_end|", "<<|im_start|>>", "<|eot_id|><|eot_id|>", " <|eot_id|> ", "<|im_end|>\n",
  "<|EOT_ID|>", "<| im_end |>", "<|box_start|>", "<|vision_pad|>",
];

const CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'LL", "'Re", "'vE",
                      "'", "''", "'x", " 's", "’s"];

const CONTROL = ["\u0000", "\u0001", "\u001b[31m", "\u007f", "\u0080", "\u009f", "\ufffd",
                 "\ufe0f", "\u200f", "\u202e", "\ue000"];

const POOLS = [ENGLISH, CJK, EMOJI, CODE, NUMBERS, SCRIPTS, NFD, WHITESPACE, SPECIAL,
               CONTRACTIONS, CONTROL];
const SEPARATORS = ["", " ", " ", " ", "  ", "\t", "\n", "\r\n", "\u00a0", "\u3000", "\n\n", "   "];

function handPicked() {
  const lines = [
    "", " ", "a", "Hello world", " Hello world", "Hello  world", "Hello\tworld", "Hello\nworld",
    "Hello \n\n world", "  leading", "trailing  ", "\n\nleading newlines", "trailing newlines\n\n",
    "a\r\nb\rc\n", "   \n   \n", "word    \nword", "!!!???...", " !", "   !x", "a  !b",
    "\u00a0\u00a0x", "x\u00a0\u00a0", "a\u3000b\u3000\u3000c", "tab\t\t\tsep", "\t\n\t\n",
    "1", "12", "123", "1234", "12345", "123456", "1234567", "9".repeat(64), "3.14e-10 + 2,000.5",
    "I'm", "I'M", "you're", "THEY'RE", "it's 'quoted' text", "'s'S'", "don't'll've",
    "<|eot_id|>", "text<|eot_id|>text", "<|begin_of_text|>Hello<|end_of_text|>",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "<think>\nreasoning\n</think>\n",
    "<|eot_id", "<|eot_id|", "<<|eot_id|>>", "<|im_end|><|im_end|>", "a<|endoftext|>b",
    "😀", "😀😀", "👩‍💻 codes", "family: 👨‍👩‍👧‍👦", "thumbs 👍🏽👍🏿👍", "flags 🇫🇷🇩🇪🇯🇵",
    "漢字", "日本語のテキストです。", "한국어", "ไทย", "हिन्दी", "العربية", "русский", "עברית",
    "e\u0301", "\u00e9", "Cafe\u0301", "Caf\u00e9", "\u1100\u1161", "\uac00", "\u212b", "\u00c5",
    "\u0000", "a\u0000b", "\u001b[0m", "\ufeff", "\u200b\u200b", "x\u180ey", "x \u180e y",
    "a \ufeff b", "a\ufeff\ufeff\nb", "x\u0085\u0085y", "x \u0085 y", "it'\u017f", "I'\u212a",
    "ǅungla Ǉ ǈ", "ſ is a long s", "Kelvin K", "ΣΑΣ σας ς",
    " ".repeat(3000) + "x", "a".repeat(3000), "\n".repeat(500) + "end", "\t ".repeat(400),
    "ab".repeat(1500), "😀".repeat(300), "1".repeat(3001), ". ".repeat(700),
  ];
  return lines;
}

export function generateCorpus(count = 2200) {
  const next = rng(20240607);
  const pick = (list) => list[Math.floor(next() * list.length)];
  const lines = handPicked();
  while (lines.length < count) {
    const fragments = 1 + Math.floor(next() * 10);
    let text = "";
    for (let i = 0; i < fragments; ++i) {
      if (i > 0) text += pick(SEPARATORS);
      text += pick(pick(POOLS));
    }
    const roll = next();
    if (roll < 0.1) text = text.normalize("NFD");  // accented letters and Hangul decomposed
    else if (roll < 0.15) text = text.toUpperCase();
    else if (roll < 0.2) text = " " + text;
    lines.push(text);
  }
  // A long mixed paragraph: one text of ~20 KB.
  let long = "";
  while (long.length < 20000) long += pick(pick(POOLS)) + pick(SEPARATORS);
  lines.push(long);
  return lines;
}

if (import.meta.url === `file://${process.argv[1]}`) {
  for (const line of generateCorpus()) process.stdout.write(JSON.stringify(line) + "\n");
}
