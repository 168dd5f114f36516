// The chat page at GET / in a real browser: Debian's chromium (headless), driven by
// playwright-core from npm (which downloads no browser), against `strata serve` on the shipped
// model with the README's 8 MiB arena and an API key. Checks: the page loads and says it needs
// the key, takes the key (kept across a reload), shows the model and live numeric counters;
// a sent message streams in (the reply grows over several observations); Stop ends the
// generation and the server frees the slot and counts the request cancelled; after a reload
// the page still works.
//
// Skips (exit 77) saying why when chromium or playwright-core is missing, except when
// STRATA_REQUIRE_BROWSER=1 (scripts/test.sh sets it): then a missing browser fails the test.
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { requireSetup, startServer } from './harness.mjs';

const here = dirname(fileURLToPath(import.meta.url));
const CHROMIUM = process.env.STRATA_CHROMIUM || '/usr/bin/chromium';
const REQUIRED = process.env.STRATA_REQUIRE_BROWSER === '1';

function missing(why) {
  if (REQUIRED) {
    console.error(`FAIL: ${why} (STRATA_REQUIRE_BROWSER=1: the browser test must run)`);
    process.exit(1);
  }
  console.log(`SKIP: ${why}`);
  process.exit(77);
}
if (!existsSync(CHROMIUM)) {
  missing(`no chromium at ${CHROMIUM} (Debian 12: apt-get install chromium, as scripts/install-deps.sh does; or set STRATA_CHROMIUM)`);
}
if (!existsSync(join(here, 'node_modules/playwright-core'))) {
  missing('tests/server/node_modules/playwright-core is missing; run `npm ci` in tests/server (scripts/test.sh does)');
}
requireSetup();
process.env.PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD = '1';
const { chromium } = await import('playwright-core');

const KEY = 'browser-key';
let srv;
let browser;
before(async () => {
  srv = await startServer(['--arena-mb', '8', '--ctx-size', '2048', '--parallel', '1', '--api-key', KEY, '-t', '1']);
  browser = await chromium.launch({ executablePath: CHROMIUM, headless: true, args: ['--no-sandbox'] });
});
after(async () => {
  if (browser) await browser.close();
  if (srv) assert.equal(await srv.stop(), 0);
});

async function metrics() {
  const res = await fetch(`${srv.url}/metrics`, { headers: { Authorization: `Bearer ${KEY}` } });
  assert.equal(res.status, 200);
  return res.text();
}
function sample(text, name) {
  const m = text.match(new RegExp(`^${name.replace(/[{}"]/g, '\\$&')} ([0-9.eE+-]+)$`, 'm'));
  return m ? Number(m[1]) : null;
}

test('chromium: load, API key, counters, send and stream, stop, reload', async () => {
  const page = await browser.newPage();
  const errors = [];
  page.on('pageerror', (e) => errors.push(String(e)));

  // The page's chat requests get a bounded length (the page sends none): `extra` is merged into
  // the JSON body on the way out; the response streams through untouched.
  let extra = { max_tokens: 48, ignore_eos: true };
  await page.route('**/v1/chat/completions', (route) => {
    const body = { ...JSON.parse(route.request().postData()), ...extra };
    route.continue({ postData: JSON.stringify(body) });
  });

  // Load without a key: the page says a key is needed.
  await page.goto(srv.url + '/');
  assert.equal(await page.title(), 'strata chat');
  await page.waitForFunction(() => document.getElementById('model').textContent === '(API key needed)');
  await page.waitForFunction(() => /401.*API key/.test(document.getElementById('status').textContent));

  // The key: the model and the counters appear, as numbers.
  await page.fill('#key', KEY);
  await page.waitForFunction(() => document.getElementById('model').textContent === 'qwen3moe-code-Q8_0');
  await page.waitForFunction(() => document.getElementById('status').textContent === 'idle', null, { timeout: 5000 });
  const counters = async () => page.evaluate(() =>
    Object.fromEntries(['tps', 'hits', 'misses', 'wait'].map((id) => [id, document.getElementById(id).textContent])));

  // Send: the reply streams in (its text grows over several observations), then ends. The
  // lengths are recorded in the page by a MutationObserver on every change of the log, so that
  // how fast this side polls (a loaded machine, a fast decode) does not decide what is seen.
  await page.evaluate(() => {
    window.replyLengths = [];
    new MutationObserver(() => {
      const m = document.querySelectorAll('#log .msg');
      const a = window.replyLengths;
      const n = m.length >= 2 ? m[1].textContent.length : -1;
      if (n > 0 && n !== a[a.length - 1]) a.push(n);
    }).observe(document.getElementById('log'), { childList: true, subtree: true, characterData: true });
  });
  await page.fill('#input', 'def fibonacci(n):');
  await page.press('#input', 'Enter');
  for (let i = 0; i < 3000; ++i) {
    const status = await page.evaluate(() => document.getElementById('status').textContent);
    if (status !== 'generating') {
      assert.equal(status, 'done');
      break;
    }
    await new Promise((r) => setTimeout(r, 5));
  }
  const seen = await page.evaluate(() => window.replyLengths);
  assert.ok(seen.length >= 3, `the reply grew over several observations: lengths seen ${seen}`);
  for (let i = 1; i < seen.length; ++i) assert.ok(seen[i] > seen[i - 1], `lengths only grow: ${seen}`);
  const userMsg = await page.textContent('#log .msg.user');
  assert.equal(userMsg, 'def fibonacci(n):');

  // Counters after a generation: all four are numbers; decode tok/s is above zero.
  await page.waitForFunction(() => Number(document.getElementById('tps').textContent) > 0, null, { timeout: 5000 });
  const c = await counters();
  assert.match(c.tps, /^\d+\.\d$/);
  assert.match(c.hits, /^\d+$/);
  assert.match(c.misses, /^\d+$/);
  assert.match(c.wait, /^\d+\.\d{3}$/);
  assert.ok(Number(c.hits) + Number(c.misses) > 0, `arena counters count: ${JSON.stringify(c)}`);

  // Stop: a reply that would run on for 1500 tokens is stopped; the server frees the slot and
  // counts it cancelled.
  const cancelledBefore = sample(await metrics(), 'strata_requests_cancelled_total');
  extra = { max_tokens: 1500, ignore_eos: true };
  await page.fill('#input', 'Write a long python program with many functions');
  await page.click('#send');
  await page.waitForFunction(() => {
    const m = document.querySelectorAll('#log .msg');
    return m.length === 4 && m[3].textContent.length > 20;
  });
  assert.equal(await page.isEnabled('#stop'), true);
  await page.click('#stop');
  await page.waitForFunction(() => document.getElementById('status').textContent === 'stopped', null, { timeout: 5000 });
  const stoppedAt = (await page.textContent('#log .msg:nth-child(4)')).length;
  let m = '';
  for (let i = 0; i < 100; ++i) {
    m = await metrics();
    if (sample(m, 'strata_requests_processing') === 0 && sample(m, 'strata_requests_cancelled_total') > cancelledBefore) break;
    await new Promise((r) => setTimeout(r, 50));
  }
  assert.equal(sample(m, 'strata_requests_processing'), 0, 'the stopped request freed its slot');
  assert.equal(sample(m, 'strata_requests_cancelled_total'), cancelledBefore + 1, 'counted cancelled');
  assert.equal(await page.isEnabled('#send'), true);
  await new Promise((r) => setTimeout(r, 300));
  assert.equal((await page.textContent('#log .msg:nth-child(4)')).length, stoppedAt, 'no text after Stop');

  // Reload: the key is kept (localStorage), the conversation starts empty and works again.
  extra = { max_tokens: 16, ignore_eos: true };  // random-seed sampling could pick EOS first
  await page.reload();
  assert.equal(await page.inputValue('#key'), KEY);
  await page.waitForFunction(() => document.getElementById('model').textContent === 'qwen3moe-code-Q8_0');
  assert.equal(await page.locator('#log .msg').count(), 0);
  await page.fill('#input', 'print(1)');
  await page.press('#input', 'Enter');
  await page.waitForFunction(() => ['done', 'error'].includes(document.getElementById('status').textContent));
  assert.equal(await page.textContent('#status'), 'done');
  assert.ok((await page.textContent('#log .msg:nth-child(2)')).length > 0);
  assert.deepEqual(errors, [], 'no script errors on the page');
  await page.close();
});
