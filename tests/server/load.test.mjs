// Load: 16 concurrent streaming clients (every fourth one disconnects early) against
// --parallel 4, twice, bounded in time. /health answers throughout; every finished response
// equals the same request served alone; the cancelled ones free their slots; and the server's
// resident memory returns to its level before the load (within RSS_MARGIN).
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { requireSetup, rssBytes, startServer } from './harness.mjs';

requireSetup();
const { default: OpenAI } = await import('openai');

const CLIENTS = 16;
const MAX_TOKENS = 48;
const ROUND_LIMIT_MS = 60000;
const RSS_MARGIN = 16 * 1024 * 1024; // allocator slack: per-request buffers, thread stacks touched once
const PROMPTS = [
  'def read_lines(path):',
  'import os\n\ndef walk(root):',
  'class Stack:\n    def __init__(self):',
  'def fib(n):',
  'for i in range(10):',
  'def parse_args():\n    parser = argparse.ArgumentParser(',
  'with open(path) as f:',
  'def merge_sort(xs):',
];

let srv, client;
const reference = new Map();
before(async () => {
  srv = await startServer(['--parallel', '4']);
  client = new OpenAI({ baseURL: `${srv.url}/v1`, apiKey: 'x', maxRetries: 0, timeout: 60000 });
  // The same requests one at a time: the expected outputs (and the warm-up).
  for (const p of PROMPTS) {
    const r = await client.completions.create({ model: 'x', prompt: p, max_tokens: MAX_TOKENS, temperature: 0 });
    reference.set(p, { text: r.choices[0].text, finish: r.choices[0].finish_reason });
  }
});
after(async () => {
  assert.equal(await srv.stop(), 0);
});

async function metric(name) {
  const text = await (await fetch(`${srv.url}/metrics`)).text();
  return Number(text.match(new RegExp(`^${name} ([0-9.e+]+)$`, 'm'))[1]);
}

async function idle() {
  const deadline = Date.now() + 10000;
  while (Date.now() < deadline) {
    if ((await metric('strata_requests_processing')) === 0 && (await metric('strata_requests_queued')) === 0) return true;
    await new Promise((r) => setTimeout(r, 50));
  }
  return false;
}

async function client_run(i) {
  const prompt = PROMPTS[i % PROMPTS.length];
  const quitter = i % 4 === 3;
  const stream = await client.completions.create({ model: 'x', prompt, max_tokens: MAX_TOKENS, temperature: 0, stream: true });
  let text = '', finish = null, chunks = 0;
  for await (const c of stream) {
    text += c.choices[0].text;
    if (c.choices[0].finish_reason) finish = c.choices[0].finish_reason;
    if (quitter && ++chunks === 3) {
      stream.controller.abort();
      return { prompt, quit: true };
    }
  }
  return { prompt, quit: false, text, finish };
}

async function round() {
  const health = { n: 0, worst: 0, bad: 0 };
  let running = true;
  const poller = (async () => {
    while (running) {
      const t0 = Date.now();
      const r = await fetch(`${srv.url}/health`).catch(() => null);
      health.n++;
      health.worst = Math.max(health.worst, Date.now() - t0);
      if (!r || r.status !== 200) health.bad++;
      else await r.text();
      await new Promise((res) => setTimeout(res, 50));
    }
  })();
  const t0 = Date.now();
  let timer;
  const limit = new Promise((_, rej) => { timer = setTimeout(() => rej(new Error(`load round over ${ROUND_LIMIT_MS} ms`)), ROUND_LIMIT_MS); });
  const results = await Promise.race([Promise.all(Array.from({ length: CLIENTS }, (_, i) => client_run(i))), limit]);
  clearTimeout(timer);
  const ms = Date.now() - t0;
  running = false;
  await poller;
  return { results, ms, health };
}

test('16 concurrent streaming clients, some leaving early, twice', async () => {
  assert.ok(await idle());
  const rssBefore = rssBytes(srv.pid);
  const cancelledBefore = await metric('strata_requests_cancelled_total');
  for (let k = 0; k < 2; k++) {
    const { results, ms, health } = await round();
    assert.equal(health.bad, 0, '/health answered 200 throughout');
    assert.ok(health.n >= 3, `/health was polled during the load (${health.n} times)`);
    assert.ok(health.worst < 2000, `/health answered within 2 s (worst ${health.worst} ms)`);
    let finished = 0;
    for (const r of results) {
      if (r.quit) continue;
      finished++;
      const want = reference.get(r.prompt);
      assert.equal(r.text, want.text, `complete and correct output for ${JSON.stringify(r.prompt)}`);
      assert.equal(r.finish, want.finish);
    }
    assert.equal(finished, CLIENTS - CLIENTS / 4);
    console.log(`# round ${k + 1}: ${CLIENTS} clients in ${ms} ms; /health polled ${health.n} times, worst ${health.worst} ms`);
  }
  assert.ok(await idle(), 'all slots free and the queue empty after the load');
  const cancelled = (await metric('strata_requests_cancelled_total')) - cancelledBefore;
  assert.ok(cancelled >= 1, `disconnected clients stopped their generation (${cancelled} cancelled)`);
  const rssAfter = rssBytes(srv.pid);
  console.log(`# RSS before ${(rssBefore / 1048576).toFixed(1)} MiB, after ${(rssAfter / 1048576).toFixed(1)} MiB; ${cancelled} generations cancelled`);
  assert.ok(rssAfter <= rssBefore + RSS_MARGIN, `RSS returned to its level: ${rssBefore} -> ${rssAfter} bytes`);
});
