// /v1/embeddings through the official `openai` npm client against `tandem serve --colocated` and
// the disaggregated `tandem serve` (router + prefill + decode, where an embedding runs on the
// prefill worker alone): a string, a list of strings, token ids and lists of them give unit
// vectors of the model's hidden size, equal for the same input however it is batched or spelled
// (text or its token ids); base64 (the client's default, decoded by the client, and asked for
// explicitly) carries the same float32 values as float; usage counts the prompt tokens as
// /tokenize does; empty input, dimensions other than the hidden size, an unknown model and an
// input longer than the context are refused with the client's typed errors. Both modes give the
// same vectors for the same inputs.
//   node --test tests/api/embeddings_test.mjs   (TANDEM_BINARY_DIR=build)
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import path from 'node:path';
import { modelDir, requirePackage, startServer, stopServer } from './serve_process.mjs';

const openaiModule = requirePackage('openai');
const OpenAI = openaiModule.OpenAI ?? openaiModule.default ?? openaiModule;

const MODEL = 'tiny-model';
const HIDDEN = JSON.parse(fs.readFileSync(path.join(modelDir, 'config.json'), 'utf8')).hidden_size;

function client(server) {
  return new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 120000 });
}

function norm(v) {
  return Math.sqrt(v.reduce((s, x) => s + x * x, 0));
}

// The OpenAI wire format: base64 of little-endian float32 bytes.
function decodeBase64(s) {
  const bytes = Buffer.from(s, 'base64');
  assert.equal(bytes.length, HIDDEN * 4);
  return Array.from({ length: bytes.length / 4 }, (_, i) => bytes.readFloatLE(4 * i));
}

async function tokenize(server, prompt) {
  const r = await fetch(`${server.url}/tokenize`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ model: MODEL, prompt }),
  });
  assert.equal(r.status, 200);
  return (await r.json()).tokens;
}

for (const mode of ['colocated', 'disaggregated']) {
  describe(`embeddings, ${mode}`, () => {
    let server;
    let openai;
    before(async () => {
      server = await startServer(mode === 'colocated' ? ['--colocated'] : []);
      openai = client(server);
    });
    after(() => stopServer(server));

    test('a string gives one unit vector of the hidden size, with usage', async () => {
      const r = await openai.embeddings.create({ model: MODEL, input: 'The cat sat', encoding_format: 'float' });
      assert.equal(r.object, 'list');
      assert.equal(r.model, MODEL);
      assert.equal(r.data.length, 1);
      assert.equal(r.data[0].object, 'embedding');
      assert.equal(r.data[0].index, 0);
      assert.equal(r.data[0].embedding.length, HIDDEN);
      assert.ok(Math.abs(norm(r.data[0].embedding) - 1) < 1e-5);
      // Tokenized as a completions prompt (BOS included), no chat template.
      const tokens = await tokenize(server, 'The cat sat');
      assert.equal(r.usage.prompt_tokens, tokens.length);
      assert.equal(r.usage.total_tokens, tokens.length);
    });

    test('a list of strings gives each its own vector, in order, as each alone', async () => {
      const inputs = ['first input', 'a second, longer input than the first one', 'third'];
      const r = await openai.embeddings.create({ model: MODEL, input: inputs, encoding_format: 'float' });
      assert.deepEqual(r.data.map((d) => d.index), [0, 1, 2]);
      let total = 0;
      for (const [i, text] of inputs.entries()) {
        const alone = await openai.embeddings.create({ model: MODEL, input: text, encoding_format: 'float' });
        assert.deepEqual(r.data[i].embedding, alone.data[0].embedding, `input ${i}`);
        total += alone.usage.prompt_tokens;
      }
      assert.equal(r.usage.prompt_tokens, total);
      assert.notDeepEqual(r.data[0].embedding, r.data[1].embedding);
      assert.notDeepEqual(r.data[1].embedding, r.data[2].embedding);
    });

    test('token ids and lists of token ids equal the text they spell', async () => {
      const tokens = await tokenize(server, 'The cat sat');
      const text = await openai.embeddings.create({ model: MODEL, input: 'The cat sat', encoding_format: 'float' });
      const ids = await openai.embeddings.create({ model: MODEL, input: tokens, encoding_format: 'float' });
      assert.deepEqual(ids.data[0].embedding, text.data[0].embedding);
      assert.equal(ids.usage.prompt_tokens, tokens.length);
      const lists = await openai.embeddings.create({
        model: MODEL, input: [tokens, tokens.slice(0, 2)], encoding_format: 'float',
      });
      assert.equal(lists.data.length, 2);
      assert.deepEqual(lists.data[0].embedding, text.data[0].embedding);
      assert.notDeepEqual(lists.data[1].embedding, text.data[0].embedding);
      assert.equal(lists.usage.prompt_tokens, tokens.length + 2);
    });

    test('base64 carries the same float32 values as float', async () => {
      const input = ['base64 and float', 'agree'];
      const floats = await openai.embeddings.create({ model: MODEL, input, encoding_format: 'float' });
      const raw = await openai.embeddings.create({ model: MODEL, input, encoding_format: 'base64' });
      // Without encoding_format the client asks for base64 and decodes it itself.
      const decoded = await openai.embeddings.create({ model: MODEL, input });
      for (let i = 0; i < input.length; ++i) {
        assert.equal(typeof raw.data[i].embedding, 'string');
        assert.deepEqual(decodeBase64(raw.data[i].embedding), floats.data[i].embedding);
        assert.deepEqual(Array.from(decoded.data[i].embedding), floats.data[i].embedding);
      }
    });

    test('dimensions equal to the hidden size and user are accepted', async () => {
      const r = await openai.embeddings.create({
        model: MODEL, input: 'x', dimensions: HIDDEN, user: 'someone', encoding_format: 'float',
      });
      assert.equal(r.data[0].embedding.length, HIDDEN);
    });

    test('bad requests are BadRequestErrors naming the parameter', async () => {
      const bad = async (body, param, pattern) => {
        await assert.rejects(openai.embeddings.create({ model: MODEL, ...body }), (e) => {
          assert.ok(e instanceof OpenAI.BadRequestError, `${JSON.stringify(body)}: ${e}`);
          assert.equal(e.status, 400);
          assert.equal(e.param, param);
          assert.match(e.message, pattern);
          return true;
        });
      };
      await bad({ input: '' }, 'input', /empty string/);
      await bad({ input: [] }, 'input', /empty array/);
      await bad({ input: [[1, 2], []] }, 'input', /input\[1\] must not be empty/);
      await bad({ input: ['a', 3] }, 'input', /input\[1\] must be a string/);
      await bad({ input: 'x', dimensions: HIDDEN - 1 }, 'dimensions', new RegExp(`hidden size, ${HIDDEN}`));
      await bad({ input: 'x', encoding_format: 'int8' }, 'encoding_format', /base64/);
      await bad({ input: [1e9] }, 'input', /outside the vocabulary/);
    });

    test('an input longer than the context is a 400 naming the limit', async () => {
      const models = await openai.models.list();
      const maxLen = models.data[0].max_model_len;
      await assert.rejects(
        openai.embeddings.create({ model: MODEL, input: [[5, 6], Array(maxLen + 1).fill(5)] }),
        (e) => e instanceof OpenAI.BadRequestError && e.code === 'context_length_exceeded' &&
          e.param === 'input' && e.message.includes(`${maxLen} tokens`) &&
          e.message.includes(`input[1] has ${maxLen + 1} tokens`),
      );
      // The whole context is the input's: nothing is generated after it.
      const full = await openai.embeddings.create({ model: MODEL, input: Array(maxLen).fill(5), encoding_format: 'float' });
      assert.equal(full.usage.prompt_tokens, maxLen);
    });

    test('an unknown model is refused as on the other endpoints', async () => {
      await assert.rejects(
        openai.embeddings.create({ model: 'no-such-model', input: 'x' }),
        (e) => e instanceof OpenAI.NotFoundError && e.param === 'model' && e.code === 'model_not_found',
      );
    });

    test('the embeddings and their prompt tokens are counted in /metrics', async () => {
      const before = await (await fetch(`${server.url}/metrics`)).text();
      const count = (text) => Number(text.match(/^tandem_embeddings_total (\S+)$/m)?.[1] ?? 0);
      await openai.embeddings.create({ model: MODEL, input: ['one', 'two'] });
      const afterText = await (await fetch(`${server.url}/metrics`)).text();
      assert.equal(count(afterText) - count(before), 2);
    });
  });
}

// The disaggregated server computes an embedding on a prefill-role engine: the vectors are the
// colocated engine's, bit for bit, for single inputs, batches, token ids and long prompts.
describe('embeddings, disaggregated equal colocated', () => {
  let colocated;
  let disaggregated;
  before(async () => {
    [colocated, disaggregated] = await Promise.all([startServer(['--colocated']), startServer()]);
  });
  after(() => Promise.all([stopServer(colocated), stopServer(disaggregated)]));

  test('the same inputs give the same vectors and usage', async () => {
    const long = Array.from({ length: 300 }, (_, i) => 5 + (i * 7) % 200);
    const inputs = [
      'The cat sat',
      ['a batch of', 'three inputs', 'in one request'],
      [7, 8, 9, 10],
      [long, [11, 12]],
    ];
    for (const input of inputs) {
      const [a, b] = await Promise.all([colocated, disaggregated].map((server) =>
        client(server).embeddings.create({ model: MODEL, input, encoding_format: 'float' })));
      assert.equal(b.data.length, a.data.length);
      for (let i = 0; i < a.data.length; ++i) {
        assert.equal(b.data[i].embedding.length, HIDDEN);
        assert.deepEqual(b.data[i].embedding, a.data[i].embedding, `${JSON.stringify(input)}[${i}]`);
      }
      assert.deepEqual(b.usage, a.usage);
    }
  });
});
