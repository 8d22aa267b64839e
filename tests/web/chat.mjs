// The chat page of `kvsparse serve` in headless Chromium (tests/test_web_ui.sh): the key asked for, a message
// sent, the streamed answer and its KV panel, the latest panel in view, Stop, New chat, a screenshot.
// Every wait is for a state that stays: the in-flight state is held open from here (nextChat), never
// caught in passing, so a fast answer cannot slip by.
import assert from 'node:assert/strict';
import { pathToFileURL } from 'node:url';

const { default: puppeteer } = await import(pathToFileURL(process.env.PUPPETEER_MODULE).href);
const url = process.env.KVS_URL, key = process.env.KVS_API_KEY, shot = process.env.KVS_SCREENSHOT;
const haystack = 'The sky was grey over the harbour and the boats rocked at their moorings. ';
const question = haystack.repeat(6) + 'The access code for Marigold is 48213. ' + haystack.repeat(6) +
                 'What is the access code for Marigold?';

// In the page, before its own script: the chat completion request that follows nextChat(extra, hold) gets the
// fields of extra added to its body, and with hold its stream is relayed as the server sends it, but its end is
// kept back until window.kvsNext.release() or the page's abort.
function installNextChat() {
  const realFetch = window.fetch.bind(window);
  window.nextChat = (extra, hold) => {
    window.kvsNext = { extra, hold, taken: false, chunks: 0, aborted: false, release: null };
  };
  window.fetch = async (input, init) => {
    const next = window.kvsNext;
    if (!next || next.taken || !String(input).endsWith('/v1/chat/completions')) return realFetch(input, init);
    next.taken = true;
    const released = new Promise((resolve) => { next.release = resolve; });
    const r = await realFetch(input, { ...init, body: JSON.stringify({ ...JSON.parse(init.body), ...next.extra }) });
    if (!next.hold || !r.ok) return r;
    const upstream = r.body.getReader();
    const body = new ReadableStream({
      start(c) {
        init.signal.addEventListener('abort', () => {
          next.aborted = true;
          c.error(new DOMException('The user aborted a request.', 'AbortError'));
        });
        (async () => {
          try {
            for (;;) {
              const { value, done } = await upstream.read();
              if (done) break;
              next.chunks++;
              c.enqueue(value);
            }
            await released;
            c.close();
          } catch { /* aborted: the page's stream is errored already */ }
        })();
      },
    });
    return new Response(body, { status: r.status, statusText: r.statusText, headers: r.headers });
  };
}

// Sends a message and waits for its KV panel: the turn's last state.
async function ask(page, text) {
  const panels = await page.$$eval('.assistant .kv', (p) => p.length);
  await page.type('#input', text);
  await page.keyboard.press('Enter');
  await page.waitForFunction((n) => document.querySelectorAll('.assistant .kv').length === n, { timeout: 120000 }, panels + 1);
}

// The latest answer's KV panel is on screen: inside the viewport and the conversation's visible area, clear of
// the input box. The conversation must be longer than the page, or the page never had to scroll.
async function assertPanelInView(page, what) {
  const r = await page.evaluate(() => {
    const box = (e) => { const b = e.getBoundingClientRect(); return { top: b.top, bottom: b.bottom, left: b.left, right: b.right }; };
    const log = document.getElementById('log'), panel = [...document.querySelectorAll('.assistant .kv')].at(-1);
    return { panel: box(panel), log: box(log), compose: box(document.getElementById('compose')),
             width: innerWidth, height: innerHeight, scrolls: log.scrollHeight > log.clientHeight };
  });
  const at = `${what} at ${r.width}x${r.height}: panel ${JSON.stringify(r.panel)}, conversation ${JSON.stringify(r.log)}, ` +
             `input ${JSON.stringify(r.compose)}`;
  console.log(at);
  assert.ok(r.scrolls, `${at}: the conversation is longer than the page`);
  assert.ok(r.panel.top >= 0 && r.panel.left >= 0 && r.panel.bottom <= r.height && r.panel.right <= r.width,
            `${at}: the panel is inside the viewport`);
  assert.ok(r.panel.top >= r.log.top && r.panel.bottom <= r.log.bottom, `${at}: the panel is not scrolled away`);
  assert.ok(r.panel.bottom <= r.compose.top || r.panel.right <= r.compose.left || r.panel.left >= r.compose.right,
            `${at}: the input box does not cover the panel`);
}

const browser = await puppeteer.launch({
  executablePath: process.env.KVS_CHROMIUM, headless: 'shell',
  args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage'],
});
let failed = false;
try {
  const page = await browser.newPage();
  await page.setViewport({ width: 1280, height: 800 });
  const errors = [];
  page.on('pageerror', (e) => errors.push(e.message));
  await page.evaluateOnNewDocument(installNextChat);
  await page.goto(url, { waitUntil: 'load' });

  // the server has a key: the page says so, and takes it
  await page.waitForFunction(() => /API key/.test(document.getElementById('status').textContent), { timeout: 15000 });
  await page.type('#api-key', key);
  await page.$eval('#api-key', (e) => e.dispatchEvent(new Event('change')));
  await page.waitForFunction(() => document.getElementById('model').textContent.includes('context'), { timeout: 15000 });

  // a sparse policy with two full layers, so the panel shows both kinds; the answer streams in
  // (held open: the cursor, Stop on, Send off), then ends with its panel
  await page.select('#policy', 'snapkv');
  await page.type('#budget', '25%');
  await page.type('#full-layers', '2');
  await page.$eval('#max-tokens', (e) => { e.value = '16'; });
  await page.evaluate(() => window.nextChat({}, true));
  await page.type('#input', question);
  await page.keyboard.press('Enter');
  await page.waitForFunction(() => /48213/.test(document.querySelector('.assistant .msg.streaming')?.textContent),
                             { timeout: 120000 });
  assert.equal(await page.$eval('#stop', (e) => e.disabled), false, 'Stop is on while the answer streams');
  assert.equal(await page.$eval('#send', (e) => e.disabled), true, 'Send is off while the answer streams');
  assert.equal(await page.$$eval('.assistant .kv', (p) => p.length), 0, 'the panel comes after the answer');
  await page.evaluate(() => window.kvsNext.release());
  await page.waitForSelector('.assistant .kv', { timeout: 120000 });
  const answer = await page.$eval('.assistant .msg', (e) => e.textContent);
  const panel = await page.$eval('.assistant .kv', (e) => e.textContent);
  const bars = await page.$$eval('.assistant .kv .bar', (b) => b.map((x) => x.classList.contains('sparse')));
  console.log(`answer: ${JSON.stringify(answer)}`);
  console.log(`panel: ${panel}`);
  assert.match(answer, /48213/, 'the answer holds the needle');
  assert.equal(await page.$$eval('.assistant .msg.streaming', (m) => m.length), 0, 'the cursor is gone');
  assert.match(panel, /snapkv/);
  assert.match(panel, /compression\s*[0-9.]+×/);
  assert.match(panel, /prompt \([0-9]+ cached\)/);
  assert.match(panel, /tokens\/s/);
  assert.ok(bars.length > 2, 'a bar per layer');
  assert.deepEqual(bars.slice(0, 2), [false, false], 'the first two layers full');
  assert.ok(bars.slice(2).every((s) => s), 'the others compressed');
  await page.screenshot({ path: shot });
  console.log(`screenshot: ${shot}`);

  // a follow-up in the same conversation: the page scrolls to its panel
  await ask(page, 'What is the access code for Marigold?');
  await assertPanelInView(page, 'a follow-up');

  // a long answer on a short screen (600 tokens by min_tokens, as this model ends its answers after a few):
  // the panel beside it stays in view, however tall the answer
  await page.setViewport({ width: 1280, height: 600 });
  await page.$eval('#max-tokens', (e) => { e.value = '600'; });
  await page.evaluate(() => window.nextChat({ min_tokens: 600 }, false));
  await ask(page, 'Tell me a long story about the harbour.');
  assert.match(await page.$$eval('.assistant .kv', (p) => p.at(-1).textContent), /600 generated/);
  console.log(`long answer: ${await page.$$eval('.assistant .msg', (m) => m.at(-1).offsetHeight)} px high, ` +
              `${await page.$eval('#log', (e) => e.clientHeight)} px of conversation on screen`);
  await assertPanelInView(page, 'a long answer');

  // Stop during an answer (held open, so it cannot end first; server-side aborts are test_server_http's):
  // the request is aborted, nothing more streams into the answer, and the page takes the next message
  await page.setViewport({ width: 1280, height: 800 });
  await page.$eval('#max-tokens', (e) => { e.value = '2000'; });
  await page.evaluate(() => window.nextChat({}, true));
  const turns = await page.$$eval('.assistant', (t) => t.length);
  await page.type('#input', 'Tell me a long story about the harbour.');
  await page.keyboard.press('Enter');
  await page.waitForFunction(() => window.kvsNext.chunks > 0, { timeout: 120000 });  // the answer has begun
  const atStop = await page.evaluate(() => {  // one task: no token can land between reading and stopping
    const text = [...document.querySelectorAll('.assistant .msg')].at(-1).textContent;
    document.getElementById('stop').click();
    return text;
  });
  await page.waitForSelector('#send:not([disabled])', { timeout: 15000 });
  assert.equal(await page.evaluate(() => window.kvsNext.aborted), true, 'Stop aborts the request');
  assert.equal(await page.$eval('#stop', (e) => e.disabled), true, 'Stop is off again');
  assert.equal(await page.$$eval('.assistant .msg.streaming', (m) => m.length), 0, 'nothing streams after Stop');
  const stopped = await page.$$eval('.assistant .msg', (m) => m.at(-1).textContent);
  assert.equal(stopped, atStop || '(stopped)', 'the answer stops where it was');
  await ask(page, 'What is the access code for Marigold?');
  assert.equal(await page.$$eval('.assistant', (t) => t.length), turns + 2, 'the next message has its own turn');
  assert.equal(await page.$$eval('.assistant .msg', (m) => m.at(-2).textContent), stopped, 'the stopped answer stays as it was');
  await assertPanelInView(page, 'the message after Stop');

  // a new chat empties the conversation
  await page.click('#new-chat');
  assert.equal(await page.$$eval('.turn', (t) => t.length), 0, 'a new chat has no turns');
  assert.deepEqual(errors, [], 'no script errors');
} catch (e) {
  failed = true;
  console.log(`not ok: ${e.stack || e}`);
} finally {
  await browser.close();
}
process.exit(failed ? 1 : 0);
