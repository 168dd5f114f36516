// The chat page at GET /: served by strata itself, and its script driven in Node against the
// real server through a minimal stand-in for the DOM (no browser here): load (model name and
// counters), send (a streamed reply equal to the same greedy request answered whole), stop
// (the Stop button aborts the stream, the server frees the slot) and reload (a fresh page), with
// the API key from localStorage; and without a key: the 401 message, then the key field.
// The same page in a real browser (chromium + playwright-core): browser.test.mjs.
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { post, requireSetup, startServer } from './harness.mjs';

requireSetup();

let srv;
before(async () => {
  srv = await startServer(['--ctx-size', '2048', '--parallel', '1', '--api-key', 'k']);
});
after(async () => {
  assert.equal(await srv.stop(), 0);
});

// Elements with what the page's script uses of them.
class Element {
  constructor(id) {
    this.id = id;
    this.textContent = '';
    this.value = '';
    this.disabled = false;
    this.className = '';
    this.scrollTop = 0;
    this.scrollHeight = 0;
    this.children = [];
    this.listeners = {};
  }
  addEventListener(type, fn) { (this.listeners[type] ||= []).push(fn); }
  dispatch(type, ev = {}) { for (const fn of this.listeners[type] || []) fn({ preventDefault() {}, ...ev }); }
  appendChild(c) { this.children.push(c); return c; }
  requestSubmit() { this.dispatch('submit'); }
}

// A localStorage stand-in that outlives a page (as the browser's does across reloads).
class Storage {
  constructor(init = {}) { this.m = new Map(Object.entries(init)); }
  getItem(k) { return this.m.has(k) ? this.m.get(k) : null; }
  setItem(k, v) { this.m.set(k, String(v)); }
}

// Runs the page's script with `fetch` sent to the server and `storage` as its localStorage
// (the API key the page sends comes from there or its key field); returns the elements, the
// headers of the requests it made and a stop function for its timer.
function loadPage(html, storage) {
  const script = html.match(/<script>([\s\S]*)<\/script>/)[1];
  const ids = [...html.matchAll(/id="([a-z]+)"/g)].map((m) => m[1]);
  const els = Object.fromEntries(ids.map((id) => [id, new Element(id)]));
  const document = {
    getElementById: (id) => els[id] ?? assert.fail(`no element #${id}`),
    createElement: () => new Element(''),
  };
  const timers = [];
  const setIntervalStub = (fn, ms) => { const t = setInterval(fn, ms); timers.push(t); return t; };
  // `extra` is merged into the JSON bodies the page posts (the stop test makes a reply long).
  const extra = {};
  const sent = [];
  const pageFetch = (url, opts = {}) => {
    const body = opts.body ? JSON.stringify({ ...JSON.parse(opts.body), ...extra }) : undefined;
    sent.push({ url, headers: opts.headers || {} });
    return fetch(new URL(url, srv.url), { ...opts, body });
  };
  new Function('document', 'fetch', 'setInterval', 'localStorage', script)(document, pageFetch, setIntervalStub, storage);
  return { els, extra, sent, close: () => timers.forEach(clearInterval) };
}

async function until(pred, what, ms = 30000) {
  const t0 = Date.now();
  while (!pred()) {
    if (Date.now() - t0 > ms) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 20));
  }
}

test('GET / serves the page without an API key; the page loads, sends, streams, stops, reloads', async () => {
  const res = await fetch(`${srv.url}/`);
  assert.equal(res.status, 200);
  assert.match(res.headers.get('content-type'), /^text\/html/);
  const html = await res.text();
  assert.ok(html.length < 16 * 1024, 'small');
  assert.doesNotMatch(html, /<script src=|<link /, 'no external resources');

  // Load: the model name and the counters of /metrics (the key is in localStorage).
  const storage = new Storage({ 'strata-api-key': 'k' });
  let page = loadPage(html, storage);
  try {
    await useThePage(page, html, storage);
  } finally {
    page.close();
  }
});

async function useThePage(page, html, storage) {
  const { els } = page;
  await until(() => !['', '?'].includes(els.model.textContent) && !['', '-'].includes(els.tps.textContent), 'model and counters');
  assert.equal(els.key.value, 'k');
  assert.ok(page.sent.every((r) => r.headers.Authorization === 'Bearer k'), 'every call sends the key');
  assert.equal(els.model.textContent, 'qwen3moe-code-Q8_0');
  assert.match(els.hits.textContent, /^\d+$/);

  // Send and stream (the page sends no sampling fields: the server's defaults sample).
  page.extra.max_tokens = 64;  // the page sets no limit: keep the conversation short
  page.extra.ignore_eos = true;  // the default sampling (random seed) may pick EOS first: an empty reply
  els.input.value = 'def fib(n):';
  els.input.dispatch('keydown', { key: 'Enter', shiftKey: false });
  await until(() => els.status.textContent === 'done' || els.status.textContent === 'error', 'the reply');
  assert.equal(els.status.textContent, 'done');
  const reply = els.log.children[1].textContent;
  assert.ok(reply.length > 0);
  assert.equal(els.log.children[0].textContent, 'def fib(n):');
  assert.equal(els.send.disabled, false);
  assert.equal(els.stop.disabled, true);

  // Stop: a long reply is aborted by the Stop button; the slot is free again after it.
  page.extra.ignore_eos = true;  // a reply that runs on until stopped
  page.extra.max_tokens = 900;
  els.input.value = 'Write a long python program with many functions and comments';
  els.form.dispatch('submit');
  await until(() => els.log.children.length === 4 && els.log.children[3].textContent.length > 20, 'streaming');
  assert.equal(els.stop.disabled, false, `status ${els.status.textContent}: ${els.log.children[3].textContent.slice(0, 300)}`);
  els.stop.dispatch('click');
  await until(() => els.status.textContent === 'stopped', 'stopped');
  const m = async () => (await (await fetch(`${srv.url}/metrics`, { headers: { Authorization: 'Bearer k' } })).text());
  let busy = true;
  for (let i = 0; i < 100 && busy; ++i) {
    busy = !/^strata_requests_processing 0$/m.test(await m());
    if (busy) await new Promise((r) => setTimeout(r, 50));
  }
  assert.equal(busy, false, 'the stopped request freed its slot');
  const r = await post(`${srv.url}/v1/chat/completions`, { messages: [{ role: 'user', content: 'hi' }], max_tokens: 2 },
    { Authorization: 'Bearer k' });
  assert.equal(r.status, 200);
  page.close();

  // Reload: a fresh page starts empty and works.
  const again = loadPage(html, storage);
  try {
    assert.equal(again.els.log.children.length, 0);
    again.extra.max_tokens = 16;
    again.els.input.value = 'print(1)';
    again.els.form.dispatch('submit');
    await until(() => again.els.status.textContent === 'done', 'the reply after reload');
  } finally {
    again.close();
  }
}

test('the page without the API key says the server needs one; typing it in fixes that', async () => {
  const html = await (await fetch(`${srv.url}/`)).text();
  const storage = new Storage();
  const page = loadPage(html, storage);
  try {
    const { els } = page;
    await until(() => els.model.textContent === '(API key needed)', 'the 401 of /v1/models');
    await until(() => /401/.test(els.status.textContent), 'the 401 of /metrics');
    assert.match(els.status.textContent, /API key/);
    assert.doesNotMatch(els.tps.textContent, /\d/, 'no counters without the key');
    els.input.value = 'hi';
    els.form.dispatch('submit');
    await until(() => els.status.textContent === 'error', 'the refused send');
    assert.match(els.log.children[1].textContent, /HTTP 401: the server needs an API key/);
    assert.equal(els.log.children[1].className, 'msg error');

    // A wrong key is refused the same way; the right one works and is stored.
    els.key.value = 'wrong';
    els.key.dispatch('input');
    await new Promise((r) => setTimeout(r, 300));
    assert.equal(els.model.textContent, '(API key needed)');
    els.key.value = 'k';
    els.key.dispatch('input');
    await until(() => els.model.textContent === 'qwen3moe-code-Q8_0', 'the model with the key');
    assert.equal(storage.getItem('strata-api-key'), 'k');
    await until(() => /^\d+$/.test(els.hits.textContent), 'counters with the key');
  } finally {
    page.close();
  }
});
