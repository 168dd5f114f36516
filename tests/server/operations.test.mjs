// Operations of `strata serve`: a non-streaming request whose client hangs up stops generating
// (its slot is freed and counted as cancelled), an unset max_tokens is capped by -n, /metrics
// carries the scheduler's histograms and prefix-cache counters, and SIGTERM is a graceful
// shutdown (running requests finish within --shutdown-grace or are cancelled; exit status 0);
// serve's sampling flags are the defaults of requests that leave the fields unset.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync, spawnSync } from 'node:child_process';
import { BINARY, MODEL, post, readSSE, requireSetup, startServer } from './harness.mjs';

requireSetup();

const metric = (text, name) => {
  const line = text.split('\n').find((l) => l.startsWith(name + ' '));
  return line === undefined ? undefined : Number(line.split(' ').pop());
};
const metrics = async (url) => (await fetch(`${url}/metrics`)).text();

test('a hung-up non-streaming request stops; unset max_tokens is capped by -n', async () => {
  const srv = await startServer(['--ctx-size', '4096', '--parallel', '1', '-n', '7']);
  try {
    // -n 7: a request without max_tokens generates 7 tokens.
    const r = await post(`${srv.url}/v1/completions`, { prompt: 'def f(x):', temperature: 0, ignore_eos: true });
    assert.equal(r.status, 200, r.text);
    assert.equal(r.body.usage.completion_tokens, 7);
    assert.equal(r.body.choices[0].finish_reason, 'length');
    // A long non-streaming request, abandoned after 300 ms: the server notices and frees the slot.
    const ac = new AbortController();
    const pending = fetch(`${srv.url}/v1/completions`, {
      method: 'POST', signal: ac.signal, headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify({ prompt: 'def main():', max_tokens: 4000, temperature: 0, ignore_eos: true }),
    }).catch((e) => e);
    await new Promise((res) => setTimeout(res, 300));
    assert.equal(metric(await metrics(srv.url), 'strata_requests_processing'), 1);
    ac.abort();
    await pending;
    const t0 = Date.now();
    let m = await metrics(srv.url);
    while (metric(m, 'strata_requests_processing') !== 0 && Date.now() - t0 < 5000) {
      await new Promise((res) => setTimeout(res, 50));
      m = await metrics(srv.url);
    }
    assert.equal(metric(m, 'strata_requests_processing'), 0, 'slot freed within 5 s');
    assert.equal(metric(m, 'strata_requests_cancelled_total'), 1);
    assert.ok(metric(m, 'strata_generated_tokens_total') < 7 + 4000);
    // The scheduler's histograms and prefix-cache counters.
    assert.equal(metric(m, 'strata_time_to_first_token_seconds_count'), 2);
    assert.equal(metric(m, 'strata_queue_seconds_count'), 2);
    assert.ok(metric(m, 'strata_batch_sequences_count') > 0);
    assert.ok(metric(m, 'strata_prefix_cache_lookups_total') >= 2);
    assert.ok(m.includes('strata_slot_requests_total{slot="0"} 2'), m);
  } finally {
    assert.equal(await srv.stop(), 0);
  }
});

test('SIGTERM lets a running stream finish, refuses new work, exits 0', async () => {
  const srv = await startServer(['--ctx-size', '512', '--parallel', '2', '--shutdown-grace', '20']);
  const res = await fetch(`${srv.url}/v1/completions`, {
    method: 'POST', headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify({ prompt: 'def main():', max_tokens: 48, temperature: 0, ignore_eos: true, stream: true }),
  });
  let tokens = 0, finish = null, stopped = null;
  await readSSE(res, async (j) => {
    if (j.choices?.[0]?.finish_reason) finish = j.choices[0].finish_reason;
    if (j.choices?.[0]?.text !== undefined) tokens++;
    if (tokens === 2 && !stopped) {
      stopped = srv.stop(); // SIGTERM while the stream runs
      await new Promise((r) => setTimeout(r, 200));
      const late = await fetch(`${srv.url}/v1/completions`, {
        method: 'POST', headers: { 'Content-Type': 'application/json' },
        body: JSON.stringify({ prompt: 'x', max_tokens: 2 }),
      }).then((r) => r.status, () => 'refused');
      assert.ok(late === 503 || late === 'refused', `new request during shutdown: ${late}`);
    }
  });
  assert.equal(finish, 'length');
  assert.equal(await stopped, 0);
  assert.match(srv.log(), /stopping/);
});

test('SIGTERM cancels what does not finish within --shutdown-grace', async () => {
  const srv = await startServer(['--ctx-size', '4096', '--parallel', '1', '--shutdown-grace', '0.5']);
  const pending = post(`${srv.url}/v1/completions`, { prompt: 'def main():', max_tokens: 4000, temperature: 0, ignore_eos: true });
  await new Promise((r) => setTimeout(r, 300));
  const t0 = Date.now();
  assert.equal(await srv.stop(), 0);
  assert.ok(Date.now() - t0 < 8000, `stopped in ${Date.now() - t0} ms`);
  assert.match(srv.log(), /cancelled 1 unfinished request/);
  await pending.catch(() => {});
});

test('SIGTERM during a long prefill: stops within a layer, the request gets 503 "shutting down"', async () => {
  // A small arena, one compute thread and a prompt near the context make the prefill take
  // seconds (the AVX-512 Q8_0 GEMM did 3000 tokens on 2 threads within the grace): the shutdown
  // must not wait for it.
  const srv = await startServer(['--ctx-size', '4096', '--parallel', '1', '--arena-mb', '8', '--shutdown-grace', '0.5',
    '-t', '1']);
  const prompt = 'def f(x): return x + 1\n'.repeat(390);
  const pending = post(`${srv.url}/v1/completions`, { prompt, max_tokens: 4, temperature: 0 });
  const pendingStream = post(`${srv.url}/v1/completions`, { prompt: 'def g():', max_tokens: 4, stream: true });
  await new Promise((r) => setTimeout(r, 1000));
  const t0 = Date.now();
  const stopped = srv.stop();
  await new Promise((r) => setTimeout(r, 100));
  const late = await post(`${srv.url}/v1/completions`, { prompt: 'x', max_tokens: 2 }).catch(() => 'refused');
  if (late !== 'refused') {
    assert.equal(late.status, 503, late.text);
    assert.equal(late.body.error.message, 'the server is shutting down');
  }
  assert.equal(await stopped, 0);
  const ms = Date.now() - t0;
  assert.ok(ms < 5000, `stopped ${ms} ms after SIGTERM with --shutdown-grace 0.5`);
  const r = await pending;
  assert.equal(r.status, 503, r.text);
  assert.equal(r.body.error.message, 'the server is shutting down');
  // The queued streamed request either gets the freed slot and finishes within the grace (on a
  // fast machine) or ends with an error event; then [DONE]. Never a finish_reason "cancelled".
  const s = await pendingStream;
  assert.doesNotMatch(s.text, /"finish_reason":"cancelled"/);
  assert.ok(/the server is shutting down/.test(s.text) || /"finish_reason":"(length|stop)"/.test(s.text), s.text);
  assert.match(s.text, /data: \[DONE\]/);
});

test('serve --temp 0 / -s: unset sampling fields take the flags; a bad flag fails before the model loads', async () => {
  const run = JSON.parse(
    execFileSync(BINARY, ['run', '-m', MODEL, '-p', 'def read_lines(path):', '-n', '32', '--temp', '0', '--json'], {
      stdio: ['ignore', 'pipe', 'ignore'],
    }).toString(),
  );
  const hot = { temperature: 2, top_k: 0, top_p: 1, min_p: 0 };
  const text = async (url, extra) =>
    (await post(`${url}/v1/completions`, { prompt: 'def read_lines(path):', max_tokens: 32, ...extra })).body.choices[0].text;
  let srv = await startServer(['--ctx-size', '512', '--parallel', '1', '--temp', '0']);
  try {
    // no temperature in the request: greedy from --temp 0 alone, the text of `strata run --temp 0`
    // (openai.test.mjs: neither stops early on this prompt)
    assert.equal(await text(srv.url, {}), run.text);
    // a request's own fields win: hot requests with their own seeds are reproducible per seed and
    // differ between seeds (and from the greedy text)
    const texts = [await text(srv.url, { ...hot, seed: 1 }), await text(srv.url, { ...hot, seed: 2 }), await text(srv.url, { ...hot, seed: 3 })];
    assert.equal(await text(srv.url, { ...hot, seed: 1 }), texts[0]);
    assert.ok(new Set(texts).size > 1, 'the requests\' seeds were not applied');
    assert.ok(texts.some((t) => t !== run.text), 'a request temperature of 2 was not applied');
  } finally {
    assert.equal(await srv.stop(), 0);
  }
  // -s 5 with a hot server default: requests without a seed all draw with seed 5
  srv = await startServer(['--ctx-size', '512', '--parallel', '1', '--temp', '2', '--top-k', '0', '--top-p', '1', '--min-p', '0', '-s', '5']);
  try {
    assert.match(srv.log(), /defaults of unset request fields: temperature 2, top_k 0, top_p 1, min_p 0, .*seed 5/);
    const a = await text(srv.url, {}), b = await text(srv.url, {});
    assert.equal(a, b);
    assert.equal(await text(srv.url, { seed: 5 }), a);
    assert.notEqual(await text(srv.url, { seed: 6 }), a);
  } finally {
    assert.equal(await srv.stop(), 0);
  }
  const t0 = Date.now();
  const bad = spawnSync(BINARY, ['serve', '-m', MODEL, '--port', '0', '--temp', '-1'], { encoding: 'utf8', timeout: 20000 });
  assert.notEqual(bad.status, 0);
  assert.match(bad.stderr, /--temp must be a number >= 0/);
  assert.doesNotMatch(bad.stderr, /listening|loading|arena/);
  assert.ok(Date.now() - t0 < 10000);
  // above a request's own range [0, 2]: refused as a default too
  const hi = spawnSync(BINARY, ['serve', '-m', MODEL, '--port', '0', '--temp', '2.5'], { encoding: 'utf8', timeout: 20000 });
  assert.notEqual(hi.status, 0);
  assert.match(hi.stderr, /--temp must be in \[0, 2\] for serve/);
  assert.doesNotMatch(hi.stderr, /listening/);
});
