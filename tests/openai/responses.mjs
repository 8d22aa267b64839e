// The official openai client's Responses API against kvsparse serve (see tests/test_server_openai.sh).
// The bundled model is not a chat model: shapes, greedy determinism and grammar-forced calls.
import assert from 'node:assert/strict';
import { pathToFileURL } from 'node:url';

const { default: OpenAI } = await import(pathToFileURL(process.env.OPENAI_MODULE).href);
const model = process.env.KVS_MODEL;
const client = new OpenAI({ baseURL: process.env.KVS_URL, apiKey: process.env.KVS_API_KEY, maxRetries: 0 });
const prompt = 'The access code for Marigold is 48213. The sky was grey over the harbour. What is the access code for Marigold?';
let passed = 0, failed = 0;

async function test(name, fn) {
  try { await fn(); passed++; console.log(`ok - ${name}`); }
  catch (e) { failed++; console.log(`not ok - ${name}: ${e.stack || e}`); }
}

const tools = [{ type: 'function', name: 'get_access_code', description: 'Looks up an access code', strict: true,
  parameters: { type: 'object', properties: { item: { type: 'string' }, digits: { type: 'integer' } },
    required: ['item', 'digits'], additionalProperties: false } }];

let whole;
await test('responses.create: string input, instructions, usage', async () => {
  const r = await client.responses.create({ model, input: prompt, instructions: 'Answer briefly.',
    max_output_tokens: 16, temperature: 0, store: false });
  assert.equal(r.object, 'response');
  assert.match(r.id, /^resp_/);
  assert.equal(r.status, 'completed');
  assert.equal(r.model, model);
  assert.equal(r.instructions, 'Answer briefly.');
  assert.equal(r.output[0].type, 'message');
  assert.equal(r.output[0].role, 'assistant');
  assert.equal(r.output[0].content[0].type, 'output_text');
  assert.equal(r.output_text, r.output[0].content[0].text);
  assert.ok(r.usage.input_tokens > 20 && r.usage.output_tokens >= 1);
  assert.equal(r.usage.total_tokens, r.usage.input_tokens + r.usage.output_tokens);
  assert.ok(Number.isInteger(r.usage.input_tokens_details.cached_tokens));
  whole = await client.responses.create({ model, input: prompt, max_output_tokens: 16, temperature: 0 });
  const again = await client.responses.create({ model, input: [{ role: 'user', content: [{ type: 'input_text', text: prompt }] }],
    max_output_tokens: 16, temperature: 0 });
  assert.equal(again.output_text, whole.output_text, 'a message item with an input_text part is the same prompt');
});

await test('responses.create: max_output_tokens cut is incomplete', async () => {
  const r = await client.responses.create({ model, input: 'a a a a a a a a', max_output_tokens: 2, temperature: 0 });
  assert.equal(r.status, 'incomplete');
  assert.equal(r.incomplete_details.reason, 'max_output_tokens');
  assert.equal(r.usage.output_tokens, 2);
});

await test('responses.create: function tools, a forced call, then its function_call_output turn', async () => {
  for (const tool_choice of ['required', { type: 'function', name: 'get_access_code' }]) {
    const r = await client.responses.create({ model, input: 'What is the access code for Marigold?', tools, tool_choice,
      max_output_tokens: 80, temperature: 0 });
    const call = r.output.find((o) => o.type === 'function_call');
    assert.ok(call, JSON.stringify(r.output));
    assert.equal(call.name, 'get_access_code');
    assert.match(call.call_id, /^call_/);
    const a = JSON.parse(call.arguments);
    assert.ok(typeof a.item === 'string' && Number.isInteger(a.digits), call.arguments);
    const next = await client.responses.create({ model, tools, max_output_tokens: 8, temperature: 0,
      input: [{ role: 'user', content: 'What is the access code for Marigold?' },
        { type: 'function_call', call_id: call.call_id, name: call.name, arguments: call.arguments },
        { type: 'function_call_output', call_id: call.call_id, output: '48213' }] });
    assert.ok(['completed', 'incomplete'].includes(next.status));
    assert.ok(next.usage.input_tokens > r.usage.input_tokens);
  }
});

await test('responses.create: text.format json_schema output parses and fits', async () => {
  const schema = { type: 'object', properties: { name: { type: 'string' }, code: { type: 'integer' } },
    required: ['name', 'code'], additionalProperties: false };
  const r = await client.responses.create({ model, input: prompt, max_output_tokens: 120, temperature: 0,
    text: { format: { type: 'json_schema', name: 'record', schema, strict: true } } });
  const d = JSON.parse(r.output_text);
  assert.ok(typeof d.name === 'string' && Number.isInteger(d.code), r.output_text);
  assert.equal(r.text.format.type, 'json_schema');
  const o = await client.responses.create({ model, input: prompt, max_output_tokens: 60, temperature: 0,
    text: { format: { type: 'json_object' } } });
  assert.equal(typeof JSON.parse(o.output_text), 'object');
});

await test('responses.stream: events in order with sequence numbers, final text equals the whole one', async () => {
  const stream = client.responses.stream({ model, input: prompt, max_output_tokens: 16, temperature: 0 });
  const types = [];
  let text = '', seq = -1;
  for await (const e of stream) {
    assert.equal(e.sequence_number, seq + 1);
    seq = e.sequence_number;
    types.push(e.type);
    if (e.type === 'response.output_text.delta') text += e.delta;
  }
  const final = await stream.finalResponse();
  const order = ['response.created', 'response.in_progress', 'response.output_item.added', 'response.content_part.added',
    'response.output_text.delta', 'response.output_text.done', 'response.content_part.done', 'response.output_item.done',
    'response.completed'];
  assert.deepEqual(types.filter((t, i) => t !== types[i - 1]), order);
  assert.equal(text, whole.output_text);
  // the stream's final response has no output_text convenience in this client: the text of its message items
  const finalText = final.output.filter((o) => o.type === 'message').flatMap((o) => o.content).map((c) => c.text).join('');
  assert.equal(finalText, whole.output_text);
  assert.deepEqual(final.output.map((o) => [o.type, o.status]), whole.output.map((o) => [o.type, o.status]));
  assert.equal(final.status, whole.status);
  assert.deepEqual(final.usage.output_tokens, whole.usage.output_tokens);
});

await test('responses.stream: a forced call streams its arguments', async () => {
  const args = { model, input: 'What is the access code for Marigold?', tools, tool_choice: 'required',
    max_output_tokens: 80, temperature: 0 };
  const ref = (await client.responses.create(args)).output.find((o) => o.type === 'function_call');
  const stream = client.responses.stream(args);
  let deltas = '', done = null;
  for await (const e of stream) {
    if (e.type === 'response.function_call_arguments.delta') deltas += e.delta;
    if (e.type === 'response.function_call_arguments.done') done = e.arguments;
  }
  const call = (await stream.finalResponse()).output.find((o) => o.type === 'function_call');
  assert.equal(deltas, done);
  assert.equal(call.arguments, ref.arguments);
  assert.equal(call.name, ref.name);
});

await test('responses errors: previous_response_id, unknown tool types, bad fields are 400s naming them', async () => {
  const bad = async (body, param) => assert.rejects(client.responses.create({ model, max_output_tokens: 4, ...body }),
    (e) => { assert.equal(e.status, 400); assert.equal(e.param, param, e.message); return true; });
  await bad({ input: 'hi', previous_response_id: 'resp_123' }, 'previous_response_id');
  await bad({ input: 'hi', tools: [{ type: 'web_search' }] }, 'tools');
  await bad({ input: [{ role: 'user', content: [{ type: 'input_image', image_url: 'x' }] }] }, 'input[0].content');
  await bad({ input: 'hi', temperature: -1 }, 'temperature');
  await bad({ input: 'hi', text: { format: { type: 'json_schema', name: 'x' } } }, 'text.format');
  await assert.rejects(client.responses.create({ model: 'nope', input: 'hi' }), (e) => e.status === 404);
});

console.log(`${passed} passed, ${failed} failed`);
process.exit(failed ? 1 : 0);
