// The official openai client against kvsparse serve (see tests/test_server_openai.sh).
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

await test('models list', async () => {
  const list = await client.models.list();
  assert.deepEqual(list.data.map((m) => m.id), [model]);
});

let whole;
await test('completions, whole', async () => {
  const r = await client.completions.create({ model, prompt, max_tokens: 10, temperature: 0, ignore_eos: true });
  assert.equal(r.object, 'text_completion');
  assert.equal(r.choices.length, 1);
  assert.equal(r.choices[0].finish_reason, 'length');
  assert.equal(r.usage.completion_tokens, 10);
  assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + 10);
  whole = r.choices[0].text;
  assert.ok(whole.length > 0);
});

await test('completions, streamed equals whole, with usage', async () => {
  const stream = await client.completions.create({ model, prompt, max_tokens: 10, temperature: 0, ignore_eos: true,
    stream: true, stream_options: { include_usage: true } });
  let text = '', finish = null, usage = null;
  for await (const chunk of stream) {
    if (chunk.choices.length) { text += chunk.choices[0].text; finish = chunk.choices[0].finish_reason ?? finish; }
    if (chunk.usage) usage = chunk.usage;
  }
  assert.equal(text, whole);
  assert.equal(finish, 'length');
  assert.equal(usage.completion_tokens, 10);
});

await test('completions, stop string honoured', async () => {
  const stop = whole.slice(Math.floor(whole.length / 2), Math.floor(whole.length / 2) + 3);
  const r = await client.completions.create({ model, prompt, max_tokens: 10, temperature: 0, ignore_eos: true, stop: [stop] });
  assert.equal(r.choices[0].text, whole.slice(0, whole.indexOf(stop)));
  assert.equal(r.choices[0].finish_reason, 'stop');
});

let chatText;
await test('chat, whole', async () => {
  const r = await client.chat.completions.create({ model, messages: [{ role: 'user', content: prompt }],
    max_completion_tokens: 16, temperature: 0 });
  assert.equal(r.object, 'chat.completion');
  assert.equal(r.choices[0].message.role, 'assistant');
  chatText = r.choices[0].message.content;
  assert.match(chatText, /48213/);
  assert.ok(r.usage.prompt_tokens > 20);
  assert.ok(r.usage.completion_tokens >= 1 && r.usage.completion_tokens <= 16);
});

await test('chat, streamed equals whole', async () => {
  const stream = await client.chat.completions.create({ model, messages: [{ role: 'user', content: prompt }],
    max_tokens: 16, temperature: 0, stream: true, stream_options: { include_usage: true } });
  let text = '', role = null, finish = null, usage = null;
  for await (const chunk of stream) {
    assert.equal(chunk.object, 'chat.completion.chunk');
    if (chunk.choices.length) {
      const d = chunk.choices[0].delta;
      if (d.role) role = d.role;
      if (d.content) text += d.content;
      finish = chunk.choices[0].finish_reason ?? finish;
    }
    if (chunk.usage) usage = chunk.usage;
  }
  assert.equal(role, 'assistant');
  assert.equal(text, chatText);
  assert.equal(finish, 'stop');
  assert.ok(usage && usage.total_tokens === usage.prompt_tokens + usage.completion_tokens);
});

await test('errors: bad temperature is a 400 naming the field', async () => {
  await assert.rejects(client.completions.create({ model, prompt: 'hi', temperature: -1 }), (e) => {
    assert.equal(e.status, 400);
    assert.equal(e.param, 'temperature');
    return true;
  });
});

await test('errors: unknown model is a 404', async () => {
  await assert.rejects(client.completions.create({ model: 'nope', prompt: 'hi' }), (e) => e.status === 404);
});

await test('errors: a wrong key is a 401', async () => {
  const bad = new OpenAI({ baseURL: process.env.KVS_URL, apiKey: 'wrong', maxRetries: 0 });
  await assert.rejects(bad.models.list(), (e) => e.status === 401);
});

await test('kv_policy extension is accepted', async () => {
  const r = await client.completions.create({ model, prompt, max_tokens: 4, temperature: 0,
    kv_policy: { policy: 'snapkv', budget: 0.5, full_layers: 2, window: 8, pool: 3 } });
  assert.equal(r.usage.completion_tokens <= 4, true);
});

console.log(`${passed} passed, ${failed} failed`);
process.exit(failed ? 1 : 0);
