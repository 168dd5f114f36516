// Bad input gets the right HTTP status and an OpenAI-style error object, and the server
// keeps serving: malformed JSON, wrong field types, out-of-range values, a prompt longer than
// the context, invalid UTF-8, an oversized body, a wrong API key, a full queue (503).
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { connect } from 'node:net';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { BINARY, MODEL, post, requireSetup, startServer } from './harness.mjs';

requireSetup();

const KEY = 'sk-test-key';
const AUTH = { Authorization: `Bearer ${KEY}` };
let srv;
before(async () => {
  srv = await startServer(['--api-key', KEY, '--ctx-size', '256', '--max-body-kb', '64', '--parallel', '1', '--queue-size', '1',
    '--timeout', '2']);
});
after(async () => {
  assert.equal(await srv.stop(), 0);
});

function assertError(r, status, code) {
  assert.equal(r.status, status, r.text);
  assert.ok(r.body && r.body.error, `an error object: ${r.text}`);
  assert.equal(typeof r.body.error.message, 'string');
  assert.ok(r.body.error.message.length > 0);
  assert.equal(typeof r.body.error.type, 'string');
  assert.ok('code' in r.body.error);
  if (code !== undefined) assert.equal(r.body.error.code, code);
}

const chat = (body, headers = AUTH) => post(`${srv.url}/v1/chat/completions`, body, headers);
const completion = (body, headers = AUTH) => post(`${srv.url}/v1/completions`, body, headers);
const okChat = { messages: [{ role: 'user', content: 'Hi' }], max_tokens: 4, temperature: 0 };

test('API key: missing or wrong gives 401, right one works, /health needs none', async () => {
  assertError(await chat(okChat, {}), 401, 'invalid_api_key');
  assertError(await chat(okChat, { Authorization: 'Bearer wrong' }), 401, 'invalid_api_key');
  assertError(await post(`${srv.url}/tokenize`, { content: 'x' }, {}), 401, 'invalid_api_key');
  const m = await fetch(`${srv.url}/v1/models`);
  assert.equal(m.status, 401);
  assert.equal((await chat(okChat)).status, 200);
  assert.equal((await fetch(`${srv.url}/health`)).status, 200);
});

test('malformed JSON and non-object bodies: 400 invalid_json', async () => {
  assertError(await chat('{"messages": [', AUTH), 400, 'invalid_json');
  assertError(await chat('not json at all', AUTH), 400, 'invalid_json');
  assertError(await chat('[1, 2, 3]', AUTH), 400, 'invalid_json');
  assertError(await completion('', AUTH), 400, 'invalid_json');
});

test('a user message without content: 400 missing_required_parameter (null content is "")', async () => {
  assertError(await chat({ messages: [{ role: 'user' }], max_tokens: 1 }), 400, 'missing_required_parameter');
  assert.equal((await chat({ messages: [{ role: 'system', content: null }, { role: 'user', content: 'x' }], max_tokens: 1 })).status, 200);
});

test('JSON nested 5,000 levels deep (30,000 crashed the server before): 400, and the server lives on', async () => {
  const n = 5000; // within --max-body-kb 64
  const deep = '{"a":'.repeat(n) + '1' + '}'.repeat(n);
  const body = `{"messages":[{"role":"user","content":"x"}],"max_tokens":1,"chat_template_kwargs":{"k":${deep}}}`;
  assertError(await chat(body, AUTH), 400, 'invalid_json');
  // nested inside a tool call's arguments string: the template refuses it
  const args = JSON.stringify({
    messages: [
      { role: 'user', content: 'x' },
      { role: 'assistant', content: '', tool_calls: [{ id: 'c1', type: 'function', function: { name: 'f', arguments: deep } }] },
      { role: 'tool', tool_call_id: 'c1', content: 'r' },
    ],
    max_tokens: 1,
  });
  const r = await chat(args, AUTH);
  assert.equal(r.status, 400);
  assert.equal((await chat(okChat)).status, 200);
});

test('fields of the wrong type: 400 invalid_type naming the field', async () => {
  const cases = [
    [{ ...okChat, temperature: 'hot' }, 'temperature'],
    [{ ...okChat, max_tokens: '10' }, 'max_tokens'],
    [{ ...okChat, max_tokens: 1.5 }, 'max_tokens'],
    [{ ...okChat, stream: 'yes' }, 'stream'],
    [{ ...okChat, stop: 5 }, 'stop'],
    [{ ...okChat, stop: ['ok', 3] }, 'stop'],
    [{ ...okChat, seed: 'abc' }, 'seed'],
    [{ ...okChat, top_k: 2.5 }, 'top_k'],
    [{ ...okChat, messages: 'hello' }, 'messages'],
    [{ ...okChat, messages: [{ role: 3, content: 'x' }] }, 'messages[0].role'],
    [{ ...okChat, messages: [{ role: 'user', content: 42 }] }, 'messages[0].content'],
    [{ ...okChat, logprobs: 'true' }, 'logprobs'],
  ];
  for (const [body, param] of cases) {
    const r = await chat(body);
    assertError(r, 400, 'invalid_type');
    assert.equal(r.body.error.param, param, JSON.stringify(body));
  }
  const r = await completion({ prompt: { text: 'x' }, max_tokens: 2 });
  assertError(r, 400, 'invalid_type');
  assertError(await completion({ prompt: [1, 'a'], max_tokens: 2 }), 400, 'invalid_type');
  // a role OpenAI does not define is refused, naming the field
  const role = await chat({ ...okChat, messages: [{ role: 'wizard', content: 'x' }] });
  assertError(role, 400, 'invalid_value');
  assert.equal(role.body.error.param, 'messages[0].role');
});

test('values out of range: 400 invalid_value', async () => {
  for (const body of [
    { ...okChat, max_tokens: 0 },
    { ...okChat, max_tokens: -5 },
    { ...okChat, max_tokens: 1e9 },
    { ...okChat, temperature: 5 },
    { ...okChat, top_p: 1.5 },
    { ...okChat, top_logprobs: 50, logprobs: true },
  ]) {
    const r = await chat(body);
    assertError(r, 400, 'invalid_value');
  }
  assertError(await completion({ prompt: [1, 999999], max_tokens: 2 }), 400, 'invalid_value');
  assertError(await chat({ ...okChat, messages: [] }), 400, 'invalid_type');
  assertError(await chat({ max_tokens: 2 }), 400, 'missing_required_parameter');
  assertError(await chat({ ...okChat, n: 3 }), 400, 'unsupported');
  assertError(await completion({ prompt: '', max_tokens: 2 }), 400, 'invalid_value');
});

test('a prompt longer than the context: 400 context_length_exceeded', async () => {
  const long = 'def f(x):\n    return x\n'.repeat(100); // well over 256 tokens
  const r = await completion({ prompt: long, max_tokens: 4 });
  assertError(r, 400, 'context_length_exceeded');
  assert.match(r.body.error.message, /256/);
  assertError(await chat({ ...okChat, messages: [{ role: 'user', content: long }] }), 400, 'context_length_exceeded');
});

test('invalid UTF-8 in the body: 400 invalid_utf8', async () => {
  const bad = Buffer.concat([Buffer.from('{"prompt": "abc'), Buffer.from([0xff, 0xfe]), Buffer.from('", "max_tokens": 2}')]);
  assertError(await completion(bad), 400, 'invalid_utf8');
  const overlong = Buffer.concat([Buffer.from('{"messages": [{"role": "user", "content": "'), Buffer.from([0xc0, 0xaf]), Buffer.from('"}]}')]);
  assertError(await chat(overlong), 400, 'invalid_utf8');
});

test('a body over --max-body-kb: 413 request_too_large', async () => {
  const big = JSON.stringify({ prompt: 'x'.repeat(100 * 1024), max_tokens: 2 });
  assertError(await completion(big), 413, 'request_too_large');
});

// One request written as raw bytes on its own connection; resolves to {status, body (parsed
// JSON or null), text, ms} of the answer, read until the server closes or `timeoutMs` passes.
function rawRequest(text, timeoutMs = 4000) {
  return new Promise((resolve) => {
    const t0 = Date.now();
    const s = connect(Number(new URL(srv.url).port), '127.0.0.1');
    let got = '';
    const done = () => {
      clearTimeout(timer);
      s.destroy();
      const status = Number((got.match(/^HTTP\/1\.1 (\d+)/) || [])[1] || 0);
      const body = got.slice(got.indexOf('\r\n\r\n') + 4);
      let json = null;
      try {
        json = JSON.parse(body);
      } catch {}
      resolve({ status, body: json, text: got, ms: Date.now() - t0 });
    };
    const timer = setTimeout(done, timeoutMs);
    s.on('error', done);
    s.on('data', (d) => {
      got += d.toString('latin1');
      // one complete answer is enough: its headers, then Content-Length bytes of body
      const end = got.indexOf('\r\n\r\n');
      const len = Number((got.match(/\r\nContent-Length: (\d+)/i) || [])[1]);
      if (end >= 0 && !Number.isNaN(len) && got.length >= end + 4 + len) done();
    });
    s.on('close', done);
    s.write(text);
  });
}

test('a Content-Length that is no number of bytes: 400 invalid_content_length at once; past the limit: 413 unread',
  async () => {
    const body = '{"prompt": "def f(", "max_tokens": 2}';
    const head = (length) => `POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${KEY}\r\n` +
      `Content-Type: application/json\r\nContent-Length: ${length}\r\n\r\n`;
    // "-5" was read as 2^64 - 5 (the answer came only at the read timeout), "abc" as 0, "5x" as 5.
    for (const length of ['-5', 'abc', '5x', '+5', '99999999999999999999999']) {
      const r = await rawRequest(head(length) + body);
      assertError(r, 400, 'invalid_content_length');
      assert.ok(r.ms < 1500, `Content-Length '${length}' answered after ${r.ms} ms`);
      assert.match(r.text, /\r\nConnection: close\r\n/i);
    }
    // No length at all (an empty "Content-Length:" line is dropped by httplib): 411 at once, where
    // httplib read the body until the client closed.
    const noLength = await rawRequest(head('').replace('Content-Length: \r\n', '') + body);
    assertError(noLength, 411, 'length_required');
    assert.ok(noLength.ms < 1500, `answered after ${noLength.ms} ms`);
    assertError(await rawRequest(head('') + body), 411, 'length_required');
    // Over --max-body-kb 64 by its header: 413 before a byte of the body arrives.
    const big = await rawRequest(head(2000000) + body);
    assertError(big, 413, 'request_too_large');
    assert.ok(big.ms < 1500, `answered after ${big.ms} ms`);
    assert.match(big.body.error.message, /2000000 bytes; at most 65536/);
    // Two different lengths: the body's end is unknown.
    assertError(await rawRequest(head(5).replace('\r\n\r\n', '\r\nContent-Length: 6\r\n\r\n') + body), 400,
      'invalid_content_length');
    // A request line httplib cannot parse: a specific message, not "HTTP 400".
    const garbage = await rawRequest('GARBAGE\r\n\r\n');
    assertError(garbage, 400, 'invalid_http_request');
    assert.doesNotMatch(garbage.body.error.message, /^HTTP 400$/);
    const longUri = await rawRequest(`GET /${'a'.repeat(10000)} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n`);
    assertError(longUri, 414, 'uri_too_long');
    // An empty body says so.
    const empty = await completion('', AUTH);
    assertError(empty, 400, 'invalid_json');
    assert.match(empty.body.error.message, /empty/);
    assert.equal((await completion({ prompt: 'def f(', max_tokens: 2 })).status, 200);
  });

test('unknown endpoint: 404; template rejections are 400', async () => {
  assertError(await post(`${srv.url}/v1/nothing`, {}, AUTH), 404, 'not_found');
  const r = await chat({ ...okChat, messages: [{ role: 'user', content: [{ type: 'image_url', image_url: { url: 'x' } }] }] });
  assertError(r, 400, 'unsupported');
});

test('queue full: 503 with Retry-After; aborted streams free their slot', async () => {
  const long = { prompt: 'def main():', max_tokens: 200, temperature: 0, ignore_eos: true, stream: true };
  const ctrlA = new AbortController(), ctrlB = new AbortController();
  const open = (ctrl) =>
    fetch(`${srv.url}/v1/completions`, {
      method: 'POST', body: JSON.stringify(long), headers: { 'Content-Type': 'application/json', ...AUTH }, signal: ctrl.signal,
    });
  const a = await open(ctrlA); // takes the only slot
  assert.equal(a.status, 200);
  const readerA = a.body.getReader(); // read A's first event but keep the connection open
  const first = await readerA.read();
  assert.match(new TextDecoder().decode(first.value), /^data: /, 'A is generating');
  const b = await open(ctrlB); // waits in the queue of one
  assert.equal(b.status, 200);
  const c = await completion({ prompt: 'x', max_tokens: 2 });
  assertError(c, 503, 'server_busy');
  assert.equal(c.headers.get('retry-after'), '1');
  ctrlA.abort();
  ctrlB.abort();
  // The server notices the closed connections and frees the slot; then a request goes through.
  const deadline = Date.now() + 10000;
  let ok = null;
  while (Date.now() < deadline) {
    const r = await completion({ prompt: 'x', max_tokens: 2, temperature: 0 });
    if (r.status === 200) { ok = r; break; }
    await new Promise((res) => setTimeout(res, 100));
  }
  assert.ok(ok, 'a slot was freed after the clients went away');
  const metrics = await (await fetch(`${srv.url}/metrics`, { headers: AUTH })).text();
  assert.ok(Number(metrics.match(/^strata_requests_cancelled_total (\d+)$/m)[1]) >= 1);
  assert.ok(Number(metrics.match(/^strata_requests_rejected_total (\d+)$/m)[1]) >= 1);
});

test('after all that, the server still serves', async () => {
  const r = await chat(okChat);
  assert.equal(r.status, 200);
  assert.equal(r.body.choices[0].message.role, 'assistant');
  assert.equal((await fetch(`${srv.url}/health`)).status, 200);
});

test('an unsupported chat template stops the server at startup with a clear message', () => {
  const dir = mkdtempSync(join(tmpdir(), 'strata-tmpl-'));
  try {
    const file = join(dir, 'bad.jinja');
    writeFileSync(file, "{% for m in messages %}{{ m.content | frobnicate }}{% endfor %}");
    const r = spawnSync(BINARY, ['serve', '-m', MODEL, '--port', '0', '--chat-template-file', file], { timeout: 30000 });
    assert.equal(r.status, 1);
    assert.match(r.stderr.toString(), /unsupported chat template .*line 1: unsupported filter 'frobnicate'/);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test('a JSON body sent as a form (curl -d) is read up to --max-body-kb, not 8 KiB', async () => {
  const body = JSON.stringify({ prompt: 'Hi', max_tokens: 2, temperature: 0, padding: 'x'.repeat(40 * 1024) });
  const r = await post(`${srv.url}/v1/completions`, body, { ...AUTH, 'Content-Type': 'application/x-www-form-urlencoded' });
  assert.equal(r.status, 200, r.text);
  assert.equal(r.body.object, 'text_completion');
  const none = await fetch(`${srv.url}/v1/completions`, { method: 'POST', body: Buffer.from(body), headers: AUTH });
  assert.equal(none.status, 200);
  const big = JSON.stringify({ prompt: 'Hi', padding: 'x'.repeat(70 * 1024) });
  assertError(await post(`${srv.url}/v1/completions`, big, { ...AUTH, 'Content-Type': 'application/x-www-form-urlencoded' }),
    413, 'request_too_large');
});

test('"tools" that is not a list: 400 naming it; response_format json_schema: 400 unsupported', async () => {
  let r = await chat({ ...okChat, tools: 'notalist' });
  assertError(r, 400, 'invalid_type');
  assert.equal(r.body.error.param, 'tools');
  r = await chat({ ...okChat, response_format: { type: 'json_schema', json_schema: { name: 'x', schema: {} } } });
  assertError(r, 400, 'unsupported');
  assert.equal(r.body.error.param, 'response_format');
});

test('GET on a POST route: 405 with Allow; a lowercase bearer scheme is accepted', async () => {
  const r = await fetch(`${srv.url}/v1/chat/completions`, { headers: AUTH });
  assert.equal(r.status, 405);
  assert.equal(r.headers.get('allow'), 'POST');
  assert.equal((await r.json()).error.code, 'method_not_allowed');
  const p = await fetch(`${srv.url}/health`, { method: 'POST', body: '{}' });
  assert.equal(p.status, 405);
  assert.equal(p.headers.get('allow'), 'GET');
  assert.equal((await chat(okChat, { Authorization: `bearer ${KEY}` })).status, 200);
  assert.equal((await chat(okChat, { Authorization: `BEARER  ${KEY}` })).status, 200);
  assertError(await chat(okChat, { Authorization: `Basic ${KEY}` }), 401, 'invalid_api_key');
});

test('slow clients do not hold /health: 120 connections with a partial body; idle ones closed after --timeout', async () => {
  const port = new URL(srv.url).port;
  const sockets = [];
  const closed = [];
  // Four at a time, each batch connected before the next: httplib listens with a backlog of 5,
  // and a SYN dropped by a full backlog is retried by the kernel only seconds later.
  for (let i = 0; i < 120; i += 4) {
    const batch = [];
    for (let k = 0; k < 4; ++k) {
      const s = connect(Number(port), '127.0.0.1');
      s.on('error', () => {});
      s.resume();  // read (and drop) the error answer, so that 'close' comes
      closed.push(new Promise((resolve) => s.on('close', resolve)));
      batch.push(new Promise((resolve) => s.on('connect', resolve)));
      s.write(`POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${KEY}\r\nContent-Type: application/json\r\n` +
        'Content-Length: 1000\r\n\r\n{"prompt": "');
      sockets.push(s);
    }
    await Promise.all(batch);
  }
  await new Promise((r) => setTimeout(r, 200));
  const t0 = Date.now();
  const h = await fetch(`${srv.url}/health`);
  const waited = Date.now() - t0;
  assert.equal(h.status, 200);
  // A fixed pool of parallel + queue-size + 16 threads (before) made it wait about 14 s here.
  assert.ok(waited < 2000, `/health took ${waited} ms behind 120 slow connections`);
  assert.equal((await chat(okChat)).status, 200);
  // --timeout 2: the server closes every stalled connection within a few seconds.
  const t1 = Date.now();
  await Promise.all(closed);
  const took = Date.now() - t1;
  assert.ok(took < 8000, `stalled connections closed after ${took} ms`);
  for (const s of sockets) s.destroy();
});

test('logit_bias: +100 forces a token at temperature 0, -100 bans it; bad keys and values are 400', async () => {
  const base = { prompt: 'def f(x):', max_tokens: 3, temperature: 0, ignore_eos: true, logprobs: 1 };
  const ids = async (body) => {
    const r = await completion(body);
    assert.equal(r.status, 200, r.text);
    return r.body.choices[0].logprobs.tokens;
  };
  const plain = await ids(base);
  // Token 5 forced: every generated token is token 5's text.
  const tok5 = (await post(`${srv.url}/detokenize`, { tokens: [5] }, AUTH)).body.content;
  const forced = await ids({ ...base, logit_bias: { 5: 100 } });
  assert.deepEqual(forced, [tok5, tok5, tok5]);
  // The greedy first token banned: the first token changes and never is that token.
  const first = (await post(`${srv.url}/tokenize`, { content: plain[0] }, AUTH)).body.tokens;
  assert.equal(first.length, 1, `the first piece '${plain[0]}' is one token`);
  const banned = await ids({ ...base, logit_bias: { [first[0]]: -100 } });
  assert.notEqual(banned[0], plain[0]);
  const rc = await chat({ ...okChat, max_tokens: 2, logit_bias: { 5: 100 } });
  assert.equal(rc.status, 200, rc.text);
  assert.equal(rc.body.choices[0].message.content, tok5 + tok5);
  assertError(await completion({ ...base, logit_bias: { 5: 101 } }), 400, 'invalid_value');
  assertError(await completion({ ...base, logit_bias: { x: 1 } }), 400, 'invalid_value');
  assertError(await completion({ ...base, logit_bias: { 99999999: 1 } }), 400, 'invalid_value');
  assertError(await completion({ ...base, logit_bias: [1] }), 400, 'invalid_type');
  assertError(await completion({ ...base, logit_bias: { 5: 'a' } }), 400, 'invalid_type');
});

test('tools with a chat template that never renders them: 400 unsupported, unless tool_choice is "none"', async () => {
  // The shipped model's template is plain ChatML: tool definitions would silently vanish.
  const tools = [{ type: 'function', function: { name: 'get_time', parameters: { type: 'object' } } }];
  const r = await chat({ ...okChat, tools });
  assertError(r, 400, 'unsupported');
  assert.equal(r.body.error.param, 'tools');
  assert.match(r.body.error.message, /does not render tools/);
  assert.equal((await chat({ ...okChat, tools, tool_choice: 'none' })).status, 200);
  assert.equal((await chat({ ...okChat, tools: [] })).status, 200);
  const t = await post(`${srv.url}/apply-template`, { messages: okChat.messages, tools }, AUTH);
  assertError(t, 400, 'unsupported');
});
