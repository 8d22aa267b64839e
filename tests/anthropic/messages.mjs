// The official @anthropic-ai/sdk against kvsparse serve (see tests/test_server_anthropic.sh).
// The bundled model is a needle-retrieval model, not a chat model: these check
// shapes, greedy determinism and grammar-forced tool calls, not answers.
import assert from 'node:assert/strict';
import { pathToFileURL } from 'node:url';

const sdk = await import(pathToFileURL(process.env.ANTHROPIC_MODULE).href);
const Anthropic = sdk.default;
const model = process.env.KVS_MODEL;
const client = new Anthropic({ baseURL: process.env.KVS_BASE_URL, apiKey: process.env.KVS_API_KEY, maxRetries: 0 });
const prompt = 'The access code for Marigold is 48213. The sky was grey over the harbour. What is the access code for Marigold?';
const user = [{ role: 'user', content: prompt }];
let passed = 0, failed = 0;

async function test(name, fn) {
  try { await fn(); passed++; console.log(`ok - ${name}`); }
  catch (e) { failed++; console.log(`not ok - ${name}: ${e.stack || e}`); }
}

const tools = [{ name: 'get_access_code', description: 'Looks up an access code',
  input_schema: { type: 'object', properties: { item: { type: 'string' }, digits: { type: 'integer' } },
    required: ['item', 'digits'] } }];
const fitsTool = (input) => input && typeof input.item === 'string' && Number.isInteger(input.digits);

let whole;
await test('messages.create: text, system, usage', async () => {
  const r = await client.messages.create({ model, max_tokens: 16, temperature: 0, system: 'Answer briefly.',
    messages: user, metadata: { user_id: 'u1' } });
  assert.equal(r.type, 'message');
  assert.equal(r.role, 'assistant');
  assert.equal(r.model, model);
  assert.match(r.id, /^msg_/);
  assert.equal(r.content.length, 1);
  assert.equal(r.content[0].type, 'text');
  assert.ok(['end_turn', 'max_tokens'].includes(r.stop_reason), r.stop_reason);
  assert.equal(r.stop_sequence, null);
  for (const k of ['input_tokens', 'output_tokens', 'cache_read_input_tokens', 'cache_creation_input_tokens'])
    assert.ok(Number.isInteger(r.usage[k]), k);
  assert.ok(r.usage.output_tokens >= 1 && r.usage.output_tokens <= 16);
  // system as text blocks (cache_control taken and ignored) is the same prompt
  const b = await client.messages.create({ model, max_tokens: 16, temperature: 0, messages: user,
    system: [{ type: 'text', text: 'Answer briefly.', cache_control: { type: 'ephemeral' } }] });
  assert.deepEqual(b.content, r.content);
  whole = await client.messages.create({ model, max_tokens: 16, temperature: 0, messages: user });
  const again = await client.messages.create({ model, max_tokens: 16, temperature: 0, messages: user });
  assert.deepEqual(again.content, whole.content, 'greedy decoding repeats');
});

await test('messages.create: stop_sequences', async () => {
  const text = whole.content[0].text;
  assert.ok(text.length >= 3, `the output "${text}" is long enough to cut`);
  const stop = text.slice(1, 3);
  const r = await client.messages.create({ model, max_tokens: 16, temperature: 0, messages: user, stop_sequences: [stop] });
  assert.equal(r.stop_reason, 'stop_sequence');
  assert.equal(r.stop_sequence, stop);
  assert.equal(r.content.map((c) => c.text).join(''), text.slice(0, text.indexOf(stop)));
});

let forced;
await test('messages.create: a forced tool (tool_choice tool and any) gives a tool_use whose input fits the schema', async () => {
  for (const tool_choice of [{ type: 'tool', name: 'get_access_code' }, { type: 'any' }]) {
    const r = await client.messages.create({ model, max_tokens: 80, temperature: 0, tools, tool_choice,
      messages: [{ role: 'user', content: 'What is the access code for Marigold?' }] });
    assert.equal(r.stop_reason, 'tool_use', JSON.stringify(r));
    const use = r.content.find((c) => c.type === 'tool_use');
    assert.match(use.id, /^toolu_/);
    assert.equal(use.name, 'get_access_code');
    assert.ok(fitsTool(use.input), JSON.stringify(use.input));
    forced ??= r;
  }
});

await test('messages.create: a tool_result turn, and tool_choice none', async () => {
  const use = forced.content.find((c) => c.type === 'tool_use');
  const r = await client.messages.create({ model, max_tokens: 12, temperature: 0, tools,
    messages: [{ role: 'user', content: 'What is the access code for Marigold?' },
      { role: 'assistant', content: [{ type: 'text', text: 'Let me look it up.' }, use] },
      { role: 'user', content: [{ type: 'tool_result', tool_use_id: use.id, content: [{ type: 'text', text: '48213' }] },
        { type: 'text', text: 'Thanks.' }] }] });
  assert.equal(r.type, 'message');
  assert.ok(r.usage.input_tokens + r.usage.cache_read_input_tokens > 20);
  const none = await client.messages.create({ model, max_tokens: 8, temperature: 0, tools, tool_choice: { type: 'none' },
    messages: user });
  assert.ok(none.content.every((c) => c.type === 'text'));
});

await test('messages.stream: events in order, the final message equals the whole one', async () => {
  const stream = client.messages.stream({ model, max_tokens: 16, temperature: 0, messages: user });
  const types = [];
  let text = '';
  stream.on('streamEvent', (e) => types.push(e.type));
  stream.on('text', (t) => { text += t; });
  const msg = await stream.finalMessage();
  assert.equal(types[0], 'message_start');
  assert.equal(types.at(-1), 'message_stop');
  assert.equal(types.at(-2), 'message_delta');
  assert.ok(types.indexOf('content_block_start') < types.indexOf('content_block_delta'));
  assert.ok(types.lastIndexOf('content_block_delta') < types.indexOf('content_block_stop'));
  assert.equal(text, whole.content[0].text);
  assert.deepEqual(msg.content, whole.content);
  assert.equal(msg.stop_reason, whole.stop_reason);
  assert.equal(msg.usage.output_tokens, whole.usage.output_tokens);
  assert.equal(msg.usage.input_tokens + msg.usage.cache_read_input_tokens,
    whole.usage.input_tokens + whole.usage.cache_read_input_tokens);
});

await test('messages.stream: a forced tool use streams as input_json_delta to the same input', async () => {
  const args = { model, max_tokens: 80, temperature: 0, tools, tool_choice: { type: 'tool', name: 'get_access_code' },
    messages: [{ role: 'user', content: 'What is the access code for Marigold?' }] };
  const stream = client.messages.stream(args);
  let json = '';
  stream.on('inputJson', (partial) => { json += partial; });
  const msg = await stream.finalMessage();
  assert.equal(msg.stop_reason, 'tool_use');
  const use = msg.content.find((c) => c.type === 'tool_use');
  const ref = forced.content.find((c) => c.type === 'tool_use');
  assert.equal(use.name, ref.name);
  assert.deepEqual(use.input, ref.input);
  assert.deepEqual(JSON.parse(json), ref.input);
});

await test('messages.countTokens: the prompt messages.create counts', async () => {
  const c = await client.messages.countTokens({ model, messages: user, system: 'Answer briefly.' });
  const r = await client.messages.create({ model, max_tokens: 1, temperature: 0, messages: user, system: 'Answer briefly.' });
  assert.ok(c.input_tokens > 20);
  assert.equal(c.input_tokens, r.usage.input_tokens + r.usage.cache_read_input_tokens);
  const t = await client.messages.countTokens({ model, messages: user, tools });
  assert.ok(Number.isInteger(t.input_tokens));
});

await test('kv_policy extension is accepted', async () => {
  const r = await client.messages.create({ model, max_tokens: 4, temperature: 0, messages: user,
    kv_policy: { policy: 'snapkv', budget: 0.5, full_layers: 2, window: 8, pool: 3 } });
  assert.ok(r.usage.output_tokens <= 4);
});

await test('errors are the SDK typed errors', async () => {
  const isErr = (cls, status, re) => (e) => {
    assert.ok(e instanceof cls, `${e.constructor.name}: ${e.message}`);
    assert.equal(e.status, status);
    assert.equal(e.error?.type, 'error');
    if (re) assert.match(e.message, re);
    return true;
  };
  await assert.rejects(client.messages.create({ model, max_tokens: 8, messages: [{ role: 'user',
    content: [{ type: 'image', source: { type: 'base64', media_type: 'image/png', data: 'AA==' } }] }] }),
  isErr(sdk.BadRequestError, 400, /image/));
  await assert.rejects(client.messages.create({ model, messages: user }), isErr(sdk.BadRequestError, 400, /max_tokens/));
  await assert.rejects(client.messages.create({ model, max_tokens: 8, messages: user, temperature: 3 }),
    isErr(sdk.BadRequestError, 400, /temperature/));
  await assert.rejects(client.messages.create({ model, max_tokens: 8, messages: user, tools,
    tool_choice: { type: 'tool', name: 'other' } }), isErr(sdk.BadRequestError, 400, /tool_choice/));
  const bad = new Anthropic({ baseURL: process.env.KVS_BASE_URL, apiKey: 'wrong', maxRetries: 0 });
  await assert.rejects(bad.messages.create({ model, max_tokens: 8, messages: user }), isErr(sdk.AuthenticationError, 401));
  await assert.rejects(client.messages.create({ model: 'nope', max_tokens: 8, messages: user }),
    isErr(sdk.NotFoundError, 404, /nope/));
  await assert.rejects(client.post('/v1/messages/nope', { body: {} }), isErr(sdk.NotFoundError, 404));
});

console.log(`${passed} passed, ${failed} failed`);
process.exit(failed ? 1 : 0);
