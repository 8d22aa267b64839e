// The chat page of `kvsparse serve` in headless Chromium (tests/test_web_ui.sh):
// the key asked for, a message sent, the streamed answer and its KV panel, a screenshot.
import assert from 'node:assert/strict';
import { pathToFileURL } from 'node:url';

const { default: puppeteer } = await import(pathToFileURL(process.env.PUPPETEER_MODULE).href);
const url = process.env.KVS_URL, key = process.env.KVS_API_KEY, shot = process.env.KVS_SCREENSHOT;
const haystack = 'The sky was grey over the harbour and the boats rocked at their moorings. ';
const question = haystack.repeat(6) + 'The access code for Marigold is 48213. ' + haystack.repeat(6) +
                 'What is the access code for Marigold?';

const browser = await puppeteer.launch({
  executablePath: process.env.KVS_CHROMIUM, headless: 'shell',
  args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage'],
});
let failed = false;
try {
  const page = await browser.newPage();
  await page.setViewport({ width: 1280, height: 760 });
  const errors = [];
  page.on('pageerror', (e) => errors.push(e.message));
  await page.goto(url, { waitUntil: 'load' });

  // the server has a key: the page says so, and takes it
  await page.waitForFunction(() => /API key/.test(document.getElementById('status').textContent), { timeout: 15000 });
  await page.type('#api-key', key);
  await page.$eval('#api-key', (e) => e.dispatchEvent(new Event('change')));
  await page.waitForFunction(() => document.getElementById('model').textContent.includes('context'), { timeout: 15000 });

  // a sparse policy with two full layers, so the panel shows both kinds
  await page.select('#policy', 'snapkv');
  await page.type('#budget', '25%');
  await page.type('#full-layers', '2');
  await page.$eval('#max-tokens', (e) => { e.value = '16'; });
  await page.type('#input', question);
  await page.keyboard.press('Enter');

  await page.waitForSelector('.assistant .msg.streaming', { timeout: 15000 });
  await page.waitForSelector('.assistant .kv', { timeout: 120000 });
  const answer = await page.$eval('.assistant .msg', (e) => e.textContent);
  const panel = await page.$eval('.assistant .kv', (e) => e.textContent);
  const bars = await page.$$eval('.assistant .kv .bar', (b) => b.map((x) => x.classList.contains('sparse')));
  console.log(`answer: ${JSON.stringify(answer)}`);
  console.log(`panel: ${panel}`);
  assert.match(answer, /48213/, 'the answer holds the needle');
  assert.match(panel, /snapkv/);
  assert.match(panel, /compression\s*[0-9.]+×/);
  assert.match(panel, /prompt \([0-9]+ cached\)/);
  assert.match(panel, /tokens\/s/);
  assert.ok(bars.length > 2, 'a bar per layer');
  assert.deepEqual(bars.slice(0, 2), [false, false], 'the first two layers full');
  assert.ok(bars.slice(2).every((s) => s), 'the others compressed');
  assert.deepEqual(errors, [], 'no script errors');
  await page.screenshot({ path: shot });
  console.log(`screenshot: ${shot}`);

  // a follow-up in the same conversation, then a new chat empties it
  await page.type('#input', 'What is the access code for Marigold?');
  await page.keyboard.press('Enter');
  await page.waitForFunction(() => document.querySelectorAll('.assistant .kv').length === 2, { timeout: 120000 });

  // Stop during an answer (the tiny model may end first: server-side aborts are test_server_http's)
  // leaves the page ready for the next message
  await page.$eval('#max-tokens', (e) => { e.value = '2000'; });
  await page.type('#input', 'Tell me a long story about the harbour.');
  await page.keyboard.press('Enter');
  await page.waitForSelector('#stop:not([disabled])', { timeout: 15000 });
  await page.click('#stop');
  await page.waitForSelector('#send:not([disabled])', { timeout: 15000 });
  assert.equal(await page.$eval('#stop', (e) => e.disabled), true, 'Stop is off again');
  assert.equal(await page.$$eval('.assistant .msg.streaming', (m) => m.length), 0, 'nothing streams after Stop');
  await page.click('#new-chat');
  assert.equal(await page.$$eval('.turn', (t) => t.length), 0, 'a new chat has no turns');
} catch (e) {
  failed = true;
  console.log(`not ok: ${e.stack || e}`);
} finally {
  await browser.close();
}
process.exit(failed ? 1 : 0);
