// Structured outputs through the official `openai` npm client, against `tandem serve` with a
// random-weight model (so only the grammar can make the output valid), colocated and
// disaggregated: 200 random JSON schemas whose every response must parse and validate under
// Ajv (an independent validator), the two modes giving the same text for the same seed; the
// other spellings (guided_regex, guided_choice, guided_grammar, structured_outputs), streaming,
// a max_tokens cut ending with finish_reason "length", and bad constraints answered with 400.
//   node --test tests/api/structured_outputs_test.mjs   (TANDEM_BINARY_DIR=build)
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { requirePackage, startServer, stopServer } from './serve_process.mjs';
import { SchemaGenerator } from './schema_generator.mjs';

const openaiModule = requirePackage('openai');
const OpenAI = openaiModule.OpenAI ?? openaiModule.default ?? openaiModule;
const AjvModule = requirePackage('ajv');
const Ajv = AjvModule.default ?? AjvModule;

const MODEL = 'tiny-model';
const NUM_SCHEMAS = 200;
// Every schema below bounds its documents (strings by maxLength, arrays by maxItems, depth),
// so a sample must finish well inside this; a cut would show up as finish_reason "length".
const MAX_TOKENS = 1500;

function client(server) {
  return new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 300000 });
}

// One structured request per schema; completions and chat, streamed and not, n = 1 or 2.
async function runSchema(openai, schema, i) {
  const chat = i % 2 === 0;
  const stream = i % 4 === 1 || i % 4 === 2;
  const n = i % 5 === 0 ? 2 : 1;
  const common = {
    model: MODEL, max_tokens: MAX_TOKENS, temperature: 1, seed: 1000 + i, n,
    response_format: { type: 'json_schema', json_schema: { name: `s${i}`, schema, strict: true } },
  };
  const texts = Array(n).fill('');
  const finish = Array(n).fill(null);
  if (chat) {
    const params = { ...common, messages: [{ role: 'user', content: `Give me object ${i} as JSON.` }] };
    if (stream) {
      for await (const chunk of await openai.chat.completions.create({ ...params, stream: true })) {
        for (const c of chunk.choices) {
          texts[c.index] += c.delta.content ?? '';
          if (c.finish_reason) finish[c.index] = c.finish_reason;
        }
      }
    } else {
      const r = await openai.chat.completions.create(params);
      for (const c of r.choices) {
        texts[c.index] = c.message.content;
        finish[c.index] = c.finish_reason;
      }
    }
  } else {
    const params = { ...common, prompt: `Object ${i}:` };
    if (stream) {
      for await (const chunk of await openai.completions.create({ ...params, stream: true })) {
        for (const c of chunk.choices) {
          texts[c.index] += c.text;
          if (c.finish_reason) finish[c.index] = c.finish_reason;
        }
      }
    } else {
      const r = await openai.completions.create(params);
      for (const c of r.choices) {
        texts[c.index] = c.text;
        finish[c.index] = c.finish_reason;
      }
    }
  }
  return texts.map((text, index) => ({ text, finish: finish[index] }));
}

// Runs fn over items with at most `limit` in flight.
async function pool(items, limit, fn) {
  const results = new Array(items.length);
  let next = 0;
  async function worker() {
    while (next < items.length) {
      const i = next++;
      results[i] = await fn(items[i], i);
    }
  }
  await Promise.all(Array.from({ length: limit }, worker));
  return results;
}

const schemas = Array.from({ length: NUM_SCHEMAS }, (_, i) => new SchemaGenerator(7919 * (i + 1)).schema());
const outputs = {};

for (const mode of ['colocated', 'disaggregated']) {
  describe(`structured outputs, ${mode}`, () => {
    let server;
    let openai;
    before(async () => {
      server = await startServer(mode === 'colocated' ? ['--colocated'] : []);
      openai = client(server);
    });
    after(() => stopServer(server));

    test(`${NUM_SCHEMAS} random JSON schemas: every response parses and validates`, async () => {
      const ajv = new Ajv({ strict: true, allErrors: true });
      const got = await pool(schemas, 8, (schema, i) => runSchema(openai, schema, i));
      let documents = 0;
      got.forEach((choices, i) => {
        const validate = ajv.compile(schemas[i]);
        for (const { text, finish } of choices) {
          const where = `schema ${i} ${JSON.stringify(schemas[i])}\noutput ${JSON.stringify(text)}`;
          assert.equal(finish, 'stop', where);
          let doc;
          assert.doesNotThrow(() => { doc = JSON.parse(text); }, where);
          assert.ok(validate(doc), `${where}\n${ajv.errorsText(validate.errors)}`);
          documents++;
        }
      });
      assert.ok(documents >= NUM_SCHEMAS);
      outputs[mode] = got;
    });

    test('guided_regex, guided_choice, guided_grammar and structured_outputs', async () => {
      const ask = (extra) => openai.completions.create({
        model: MODEL, prompt: 'Answer:', max_tokens: 64, temperature: 1, seed: 3, n: 3, ...extra,
      });
      for (const c of (await ask({ guided_regex: '[a-c]{2,5}-[0-9]{1,3}' })).choices) {
        assert.match(c.text, /^[a-c]{2,5}-[0-9]{1,3}$/);
        assert.equal(c.finish_reason, 'stop');
      }
      for (const c of (await ask({ guided_choice: ['yes', 'no', 'it "depends"'] })).choices) {
        assert.ok(['yes', 'no', 'it "depends"'].includes(c.text), c.text);
      }
      for (const c of (await ask({ guided_grammar: 'root ::= "(" [0-9]{1,3} ("+" [0-9]{1,3})* ")"' })).choices) {
        assert.match(c.text, /^\([0-9]{1,3}(\+[0-9]{1,3})*\)$/);
      }
      for (const c of (await ask({ structured_outputs: { choice: ['left', 'right'] } })).choices) {
        assert.ok(['left', 'right'].includes(c.text), c.text);
      }
      const chat = await openai.chat.completions.create({
        model: MODEL, messages: [{ role: 'user', content: 'JSON please' }], max_tokens: 800,
        temperature: 1, seed: 5, response_format: { type: 'json_object' },
      });
      const c = chat.choices[0];
      if (c.finish_reason === 'stop') {
        assert.equal(typeof JSON.parse(c.message.content), 'object');
      } else {
        assert.equal(c.finish_reason, 'length');
      }
    });

    test('a max_tokens cut ends with finish_reason length, streamed or not', async () => {
      const schema = {
        type: 'object', properties: { s: { type: 'string', minLength: 30, maxLength: 40 } },
        required: ['s'], additionalProperties: false,
      };
      const params = {
        model: MODEL, prompt: 'x', max_tokens: 5, temperature: 0,
        response_format: { type: 'json_schema', json_schema: { name: 'cut', schema } },
      };
      const r = await openai.completions.create(params);
      assert.equal(r.choices[0].finish_reason, 'length');
      assert.throws(() => JSON.parse(r.choices[0].text));
      let text = '';
      let finish;
      for await (const chunk of await openai.completions.create({ ...params, stream: true })) {
        text += chunk.choices[0]?.text ?? '';
        finish = chunk.choices[0]?.finish_reason ?? finish;
      }
      assert.equal(text, r.choices[0].text);
      assert.equal(finish, 'length');
    });

    test('bad constraints are BadRequestErrors naming the field', async () => {
      const bad = (extra, param, pattern) => assert.rejects(
        openai.chat.completions.create({
          model: MODEL, messages: [{ role: 'user', content: 'x' }], max_tokens: 4, ...extra,
        }),
        (e) => e instanceof OpenAI.BadRequestError && e.status === 400 && e.param === param &&
          pattern.test(e.message),
      );
      await bad({ response_format: { type: 'json_schema', json_schema: { name: 'a', schema: { type: 'object', patternProperties: {} } } } },
        'response_format', /patternProperties/);
      await bad({ guided_regex: '(unclosed' }, 'guided_regex', /guided_regex/);
      await bad({ guided_grammar: 'root ::= undefined_rule' }, 'guided_grammar', /undefined_rule/);
      await bad({ response_format: { type: 'json_object' }, guided_choice: ['a'] }, 'guided_choice',
        /only one structured-output constraint/);
      await bad({ response_format: { type: 'xml' } }, 'response_format', /json_schema/);
    });
  });
}

describe('colocated and disaggregated', () => {
  test('give the same constrained text for the same seed', () => {
    assert.ok(outputs.colocated && outputs.disaggregated, 'both modes ran');
    assert.deepEqual(outputs.disaggregated, outputs.colocated);
  });
});
