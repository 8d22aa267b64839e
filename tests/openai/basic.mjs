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


// ---- the agents' API: n, top logprobs, penalties and logit_bias ----------------
const chatMsgs = [{ role: 'user', content: prompt }];

await test('n: 3 greedy choices are identical; seeded temperature 1 repeats', async () => {
  const r = await client.chat.completions.create({ model, messages: chatMsgs, max_tokens: 6, temperature: 0, n: 3 });
  assert.deepEqual(r.choices.map((c) => c.index), [0, 1, 2]);
  assert.ok(r.choices.every((c) => c.message.content === r.choices[0].message.content));
  const args = { model, messages: chatMsgs, max_tokens: 6, temperature: 1, seed: 7, n: 3 };
  const a = await client.chat.completions.create(args), b = await client.chat.completions.create(args);
  assert.deepEqual(a.choices.map((c) => c.message.content), b.choices.map((c) => c.message.content));
  // streamed: every index gets its own deltas, the same texts
  const stream = await client.chat.completions.create({ ...args, stream: true });
  const texts = ['', '', ''];
  for await (const chunk of stream) for (const c of chunk.choices) texts[c.index] += c.delta.content ?? '';
  assert.deepEqual(texts, a.choices.map((c) => c.message.content));
});

await test('top_logprobs: 5 real alternatives, best first, a distribution', async () => {
  const r = await client.chat.completions.create({ model, messages: chatMsgs, max_tokens: 4, temperature: 0,
    logprobs: true, top_logprobs: 5 });
  const wide = await client.chat.completions.create({ model, messages: chatMsgs, max_tokens: 4, temperature: 0,
    logprobs: true, top_logprobs: 20 });
  const content = r.choices[0].logprobs.content;
  assert.equal(content.length, r.usage.completion_tokens);
  content.forEach((t, i) => {
    assert.equal(t.top_logprobs.length, 5);
    for (let j = 1; j < 5; j++) assert.ok(t.top_logprobs[j - 1].logprob >= t.top_logprobs[j].logprob);
    assert.equal(t.top_logprobs[0].token, t.token, 'greedy: the chosen token is the most likely');
    assert.ok(Math.abs(t.top_logprobs[0].logprob - t.logprob) < 1e-6);
    const mass = t.top_logprobs.reduce((a, x) => a + Math.exp(x.logprob), 0);
    const all20 = wide.choices[0].logprobs.content[i].top_logprobs;
    assert.equal(all20.length, 20);
    const mass20 = all20.reduce((a, x) => a + Math.exp(x.logprob), 0);
    assert.ok(mass <= mass20 + 1e-6 && mass20 <= 1 + 1e-3, `probabilities ${mass} <= ${mass20} <= 1`);
    for (let j = 0; j < 5; j++) assert.ok(Math.abs(all20[j].logprob - t.top_logprobs[j].logprob) < 1e-3);
  });
  // full-softmax references by other paths: the sample op's own log softmax (a request without
  // alternatives) for the chosen tokens, and each alternative of the first token drawn by
  // logit_bias +100 (its reported logprob is that of the raw logits over the whole vocabulary)
  const plain = await client.chat.completions.create({ model, messages: chatMsgs, max_tokens: 4, temperature: 0,
    logprobs: true });
  plain.choices[0].logprobs.content.forEach((t, i) => assert.ok(Math.abs(t.logprob - content[i].logprob) < 1e-3,
    `token ${i}: ${t.logprob} vs ${content[i].logprob}`));
  for (const alt of content[0].top_logprobs.slice(1)) {
    const tok = await (await fetch(process.env.KVS_URL.replace(/\/v1$/, '') + '/tokenize', { method: 'POST',
      headers: { Authorization: `Bearer ${process.env.KVS_API_KEY}` },
      body: JSON.stringify({ prompt: alt.token, add_special_tokens: false }) })).json();
    if (tok.count !== 1) continue; // a text that re-encodes to other tokens
    const forced = await client.chat.completions.create({ model, messages: chatMsgs, max_tokens: 1, temperature: 0,
      logprobs: true, logit_bias: { [tok.tokens[0]]: 100 } });
    const f = forced.choices[0].logprobs.content[0];
    assert.equal(f.token, alt.token);
    assert.ok(Math.abs(f.logprob - alt.logprob) < 1e-3, `${alt.token}: ${f.logprob} vs ${alt.logprob}`);
  }
});

await test('logit_bias and presence_penalty change the output as predicted', async () => {
  const base = await client.completions.create({ model, prompt, max_tokens: 3, temperature: 0, logprobs: 5 });
  const lp = base.choices[0].logprobs;
  const second = Object.entries(lp.top_logprobs[0]).sort((a, b) => b[1] - a[1])[1][0];
  const tok = await (await fetch(process.env.KVS_URL.replace(/\/v1$/, '') + '/tokenize', { method: 'POST',
    headers: { Authorization: `Bearer ${process.env.KVS_API_KEY}` },
    body: JSON.stringify({ prompt: second, add_special_tokens: false }) })).json();
  assert.equal(tok.count, 1, `the runner-up "${second}" is one token`);
  // +100 on the runner-up makes it the first token; -100 on the winner bans it
  const up = await client.completions.create({ model, prompt, max_tokens: 1, temperature: 0,
    logit_bias: { [tok.tokens[0]]: 100 } });
  assert.equal(up.choices[0].text, second);
  // a strong presence penalty: no token twice in a row of 12 greedy tokens that repeat without it
  const plain = await client.completions.create({ model, prompt: 'a a a a a a a a', max_tokens: 12, temperature: 0,
    ignore_eos: true, return_token_ids: true });
  const pen = await client.completions.create({ model, prompt: 'a a a a a a a a', max_tokens: 12, temperature: 0,
    ignore_eos: true, return_token_ids: true, presence_penalty: 2, frequency_penalty: 2 });
  const distinct = (ids) => new Set(ids).size;
  assert.ok(distinct(pen.choices[0].token_ids) > distinct(plain.choices[0].token_ids),
    `penalised ${distinct(pen.choices[0].token_ids)} distinct tokens vs ${distinct(plain.choices[0].token_ids)}`);
});

await test('usage and the kv extension: cached tokens, compression', async () => {
  const r = await client.completions.create({ model, prompt, max_tokens: 2, temperature: 0 });
  assert.ok(r.usage.prompt_tokens_details && Number.isInteger(r.usage.prompt_tokens_details.cached_tokens));
  assert.ok(r.kv && typeof r.kv.policy === 'string' && r.kv.compression_ratio >= 1);
});


// ---- structured output -----------------------------------------------------------
const recordSchema = { type: 'object', properties: { name: { type: 'string' }, code: { type: 'integer' } },
  required: ['name', 'code'], additionalProperties: false };
const fitsRecord = (d) => d && typeof d === 'object' && !Array.isArray(d) &&
  Object.keys(d).sort().join() === 'code,name' && typeof d.name === 'string' && Number.isInteger(d.code);

await test('response_format json_schema: 20 prompts, every output parses and fits the schema', async () => {
  const names = ['Marigold', 'Juniper', 'Cobalt', 'Harbour', 'Saffron', 'Willow', 'Granite', 'Lantern', 'Meadow', 'Falcon',
    'Orchid', 'Pebble', 'Quartz', 'Raven', 'Summit', 'Thistle', 'Umber', 'Violet', 'Walnut', 'Zephyr'];
  let bad = [];
  for (const [i, n] of names.entries()) {
    const code = 10000 + (i * 7919) % 90000;
    const r = await client.chat.completions.create({ model, max_tokens: 120, temperature: 0,
      messages: [{ role: 'user', content: `The access code for ${n} is ${code}. What is the access code for ${n}?` }],
      response_format: { type: 'json_schema', json_schema: { name: 'record', strict: true, schema: recordSchema } } });
    const text = r.choices[0].message.content;
    let d = null;
    try { d = JSON.parse(text); } catch { /* counted below */ }
    if (!fitsRecord(d)) bad.push(`${n}: ${r.choices[0].finish_reason} ${JSON.stringify(text.slice(0, 80))}`);
  }
  assert.deepEqual(bad, []);
});

await test('response_format json_object, and a schema keyword it cannot enforce is a 400 naming it', async () => {
  const r = await client.completions.create({ model, prompt, max_tokens: 60, temperature: 0,
    response_format: { type: 'json_object' } });
  const d = JSON.parse(r.choices[0].text);
  assert.ok(d && typeof d === 'object' && !Array.isArray(d));
  await assert.rejects(client.completions.create({ model, prompt, max_tokens: 4,
    response_format: { type: 'json_schema', json_schema: { name: 'x', schema: { type: 'integer', multipleOf: 3 } } } }),
  (e) => e.status === 400 && /multipleOf/.test(e.message));
  await assert.rejects(client.completions.create({ model, prompt, max_tokens: 4,
    response_format: { type: 'json_schema', json_schema: { name: 'x', schema: { type: 'string', pattern: '(?<=a)b' } } } }),
  (e) => e.status === 400 && /lookbehind/.test(e.message));
});

await test('response_format pattern, format and a $ref to a property: the outputs match', async () => {
  const schema = { type: 'object', properties: {
    code: { type: 'string', pattern: '^[A-Z]{3}-\\d{4}$' }, mail: { type: 'string', format: 'email', maxLength: 40 },
    day: { type: 'string', format: 'date' }, again: { $ref: '#/properties/code' } },
  required: ['code', 'mail', 'day', 'again'], additionalProperties: false };
  for (const seed of [1, 2, 3]) {
    const r = await client.chat.completions.create({ model, max_tokens: 120, temperature: 1, seed,
      messages: [{ role: 'user', content: 'A record, please.' }],
      response_format: { type: 'json_schema', json_schema: { name: 'record', strict: true, schema } } });
    const d = JSON.parse(r.choices[0].message.content);
    assert.match(d.code, /^[A-Z]{3}-\d{4}$/);
    assert.match(d.again, /^[A-Z]{3}-\d{4}$/);
    assert.match(d.mail, /^[^@\s]+@[^@\s]+\.[^@\s]+$/);
    assert.ok(d.mail.length <= 40);
    assert.match(d.day, /^\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])$/);
  }
});


await test('tools with tool_choice required: a tool_calls entry whose arguments parse and fit the schema', async () => {
  const tools = [{ type: 'function', function: { name: 'get_access_code', description: 'Looks up an access code',
    parameters: { type: 'object', properties: { item: { type: 'string' }, digits: { type: 'integer' } },
      required: ['item', 'digits'] } } }];
  for (const stream of [false, true]) {
    const args = { model, max_tokens: 80, temperature: 0, tools, tool_choice: 'required',
      messages: [{ role: 'user', content: 'What is the access code for Marigold?' }] };
    let call, finish;
    if (!stream) {
      const r = await client.chat.completions.create(args);
      finish = r.choices[0].finish_reason;
      call = r.choices[0].message.tool_calls?.[0];
    } else {
      const s = await client.chat.completions.create({ ...args, stream: true });
      const parts = {};
      for await (const chunk of s) for (const c of chunk.choices) {
        for (const tc of c.delta.tool_calls ?? []) {
          parts[tc.index] ??= { id: tc.id, type: 'function', function: { name: '', arguments: '' } };
          if (tc.function?.name) parts[tc.index].function.name += tc.function.name;
          if (tc.function?.arguments) parts[tc.index].function.arguments += tc.function.arguments;
        }
        finish = c.finish_reason ?? finish;
      }
      call = parts[0];
    }
    assert.equal(finish, 'tool_calls', `stream ${stream}`);
    assert.equal(call.function.name, 'get_access_code');
    const a = JSON.parse(call.function.arguments);
    assert.ok(typeof a.item === 'string' && Number.isInteger(a.digits), call.function.arguments);
  }
});

console.log(`${passed} passed, ${failed} failed`);
process.exit(failed ? 1 : 0);
