// `strata serve` through the official openai client: models, chat and text completions,
// streaming, stop strings, logprobs, seeds, tokenize/detokenize, metrics; greedy output
// equals `strata run --temp 0`, and `strata chat` gives the same reply as the server.
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync, spawnSync } from 'node:child_process';
import { BINARY, MODEL, post, requireSetup, startServer } from './harness.mjs';

requireSetup();
const { default: OpenAI } = await import('openai');

let srv, client;
before(async () => {
  srv = await startServer(['--parallel', '2']);
  client = new OpenAI({ baseURL: `${srv.url}/v1`, apiKey: 'not-needed', maxRetries: 0, timeout: 60000 });
});
after(async () => {
  assert.equal(await srv.stop(), 0, 'the server exits cleanly on SIGTERM');
});

const CODE_PROMPT = 'def read_lines(path):';

test('GET /v1/models lists the model', async () => {
  const list = await client.models.list();
  assert.equal(list.data.length, 1);
  assert.equal(list.data[0].id, 'qwen3moe-code-Q8_0');
  assert.equal(list.data[0].object, 'model');
});

test('greedy text completion equals `strata run --temp 0`', async () => {
  const run = JSON.parse(
    execFileSync(BINARY, ['run', '-m', MODEL, '-p', CODE_PROMPT, '-n', '32', '--temp', '0', '--json'], {
      stdio: ['ignore', 'pipe', 'ignore'],
    }).toString(),
  );
  const r = await client.completions.create({ model: 'x', prompt: CODE_PROMPT, max_tokens: 32, temperature: 0 });
  assert.equal(r.object, 'text_completion');
  assert.equal(r.usage.prompt_tokens, run.prompt_ids.length);
  // `run` stops only at EOS; the server also stops at end-of-turn tokens. Neither occurs here.
  assert.equal(r.choices[0].text, run.text);
  assert.equal(r.usage.completion_tokens, run.ids.length);
  assert.equal(r.choices[0].finish_reason, 'length');
  // The same through the stream.
  const stream = await client.completions.create({ model: 'x', prompt: CODE_PROMPT, max_tokens: 32, temperature: 0, stream: true });
  let text = '', finish = null;
  for await (const c of stream) {
    text += c.choices[0].text;
    if (c.choices[0].finish_reason) finish = c.choices[0].finish_reason;
  }
  assert.equal(text, run.text);
  assert.equal(finish, 'length');
});

test('chat completion: ChatML prompt, streaming equals non-streaming, usage', async () => {
  const messages = [
    { role: 'system', content: 'You write Python.' },
    { role: 'user', content: 'Read a file line by line.' },
  ];
  const r = await client.chat.completions.create({ model: 'x', messages, max_tokens: 40, temperature: 0 });
  assert.equal(r.object, 'chat.completion');
  assert.equal(r.choices[0].message.role, 'assistant');
  assert.equal(typeof r.choices[0].message.content, 'string');
  assert.ok(['stop', 'length'].includes(r.choices[0].finish_reason));
  // The prompt is the model's ChatML rendering of the messages.
  const chatml =
    '<|im_start|>system\nYou write Python.<|im_end|>\n<|im_start|>user\nRead a file line by line.<|im_end|>\n<|im_start|>assistant\n';
  const tok = await post(`${srv.url}/tokenize`, { content: chatml });
  assert.equal(r.usage.prompt_tokens, tok.body.tokens.length);
  assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens);

  const stream = await client.chat.completions.create({
    model: 'x', messages, max_tokens: 40, temperature: 0, stream: true, stream_options: { include_usage: true },
  });
  let text = '', finish = null, usage = null, role = null;
  for await (const c of stream) {
    if (c.usage) usage = c.usage;
    if (!c.choices.length) continue;
    if (c.choices[0].delta.role) role = c.choices[0].delta.role;
    text += c.choices[0].delta.content ?? '';
    if (c.choices[0].finish_reason) finish = c.choices[0].finish_reason;
  }
  assert.equal(role, 'assistant');
  assert.equal(text, r.choices[0].message.content);
  assert.equal(finish, r.choices[0].finish_reason);
  assert.deepEqual(usage, r.usage);
});

test('stop strings cut the text before the first match, streamed or not', async () => {
  const full = await client.completions.create({ model: 'x', prompt: CODE_PROMPT, max_tokens: 32, temperature: 0 });
  const text = full.choices[0].text;
  const stop = text.slice(12, 16);  // a piece from the middle of the greedy text
  const want = text.slice(0, text.indexOf(stop));
  for (const stopArg of [stop, ['@@never@@', stop]]) {
    const r = await client.completions.create({ model: 'x', prompt: CODE_PROMPT, max_tokens: 32, temperature: 0, stop: stopArg });
    assert.equal(r.choices[0].text, want);
    assert.equal(r.choices[0].finish_reason, 'stop');
    const s = await client.completions.create({ model: 'x', prompt: CODE_PROMPT, max_tokens: 32, temperature: 0, stop: stopArg, stream: true });
    let got = '';
    for await (const c of s) got += c.choices[0].text;
    assert.equal(got, want);
  }
});

test('logprobs: chat top_logprobs and completion logprobs', async () => {
  const r = await client.chat.completions.create({
    model: 'x', messages: [{ role: 'user', content: 'Hello' }], max_tokens: 8, temperature: 0, logprobs: true, top_logprobs: 3,
  });
  const content = r.choices[0].logprobs.content;
  assert.equal(content.length, r.usage.completion_tokens);
  for (const e of content) {
    assert.equal(e.top_logprobs.length, 3);
    assert.ok(e.logprob <= 0);
    assert.ok(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob);
    assert.ok(Math.abs(e.logprob - e.top_logprobs[0].logprob) < 1e-6, 'greedy picks the most likely token');
    if (!e.token.includes('\uFFFD')) assert.equal(Buffer.from(e.bytes).toString('utf8'), e.token);
  }
  const c = await client.completions.create({ model: 'x', prompt: CODE_PROMPT, max_tokens: 6, temperature: 0, logprobs: 2 });
  const lp = c.choices[0].logprobs;
  assert.equal(lp.tokens.length, 6);
  assert.equal(lp.token_logprobs.length, 6);
  assert.equal(Object.keys(lp.top_logprobs[0]).length, 2);
  assert.equal(lp.tokens.join(''), c.choices[0].text);
  assert.deepEqual(lp.text_offset[0], 0);
});

test('sampling with a seed is reproducible; different seeds differ', async () => {
  const req = (seed) =>
    client.completions.create({ model: 'x', prompt: CODE_PROMPT, max_tokens: 24, temperature: 1.0, top_k: 0, top_p: 1, min_p: 0, seed });
  const [a, b, c] = await Promise.all([req(42), req(42), req(7)]);
  assert.equal(a.choices[0].text, b.choices[0].text);
  assert.notEqual(a.choices[0].text, c.choices[0].text);
});

test('top_p 0 keeps only the most likely token (as llama.cpp, and strata run --top-p 0): the greedy text', async () => {
  const greedy = await client.completions.create({ model: 'x', prompt: CODE_PROMPT, max_tokens: 12, temperature: 0 });
  for (const seed of [1, 2]) {
    const r = await client.completions.create({ model: 'x', prompt: CODE_PROMPT, max_tokens: 12, temperature: 1, top_p: 0, seed });
    assert.equal(r.choices[0].text, greedy.choices[0].text);
  }
});

test('max_tokens bounds the completion', async () => {
  const r = await client.completions.create({ model: 'x', prompt: CODE_PROMPT, max_tokens: 3, temperature: 0 });
  assert.equal(r.usage.completion_tokens, 3);
  assert.equal(r.choices[0].finish_reason, 'length');
});

test('/tokenize and /detokenize round-trip', async () => {
  const text = 'def héllo(x):\n    return x  # 🌍';
  const t = await post(`${srv.url}/tokenize`, { content: text, with_pieces: true });
  assert.equal(t.status, 200);
  const ids = t.body.tokens.map((p) => p.id);
  assert.ok(ids.length > 5);
  const d = await post(`${srv.url}/detokenize`, { tokens: ids });
  assert.equal(d.status, 200);
  assert.equal(d.body.content, text);
});

test('/apply-template renders the chat template as `strata template` does; bad messages are 400', async () => {
  const messages = [
    { role: 'system', content: 'You write Python.' },
    { role: 'user', content: 'Read a file line by line.' },
  ];
  const chatml = '<|im_start|>system\nYou write Python.<|im_end|>\n<|im_start|>user\nRead a file line by line.<|im_end|>\n';
  const r = await post(`${srv.url}/apply-template`, { messages });
  assert.equal(r.status, 200);
  assert.equal(r.body.prompt, chatml + '<|im_start|>assistant\n');
  const noGen = await post(`${srv.url}/apply-template`, { messages, add_generation_prompt: false });
  assert.equal(noGen.body.prompt, chatml);
  const cli = spawnSync(BINARY, ['template', '-m', MODEL, '--messages', JSON.stringify(messages), '--add-generation-prompt']);
  assert.equal(cli.status, 0, cli.stderr.toString());
  assert.equal(cli.stdout.toString(), r.body.prompt);
  for (const body of [{}, { messages: 'hi' }, { messages: [{ role: 'wizard', content: 'x' }] },
    { messages, tools: 'x' }, { messages, add_generation_prompt: 'yes' }]) {
    const bad = await post(`${srv.url}/apply-template`, body);
    assert.equal(bad.status, 400, JSON.stringify(body));
    assert.equal(typeof bad.body.error.message, 'string');
  }
});

test('/metrics exposes request, token and stream counters', async () => {
  const res = await fetch(`${srv.url}/metrics`);
  assert.equal(res.status, 200);
  const text = await res.text();
  const value = (re) => {
    const m = text.match(re);
    assert.ok(m, `metric ${re} missing`);
    return Number(m[1]);
  };
  assert.ok(value(/^strata_requests_total\{endpoint="\/v1\/completions",status="200"\} (\d+)$/m) >= 5);
  assert.ok(value(/^strata_generated_tokens_total (\d+)$/m) > 50);
  assert.ok(value(/^strata_prompt_tokens_total (\d+)$/m) > 5);
  assert.ok(value(/^strata_decode_tokens_per_second ([0-9.e+]+)$/m) > 0);
  assert.ok(value(/^strata_prefill_tokens_per_second ([0-9.e+]+)$/m) > 0);
  for (const phase of ['prefill', 'decode']) {
    const needed = value(new RegExp(`^strata_experts_needed_total\\{phase="${phase}"\\} (\\d+)$`, 'm'));
    const hits = value(new RegExp(`^strata_arena_hits_total\\{phase="${phase}"\\} (\\d+)$`, 'm'));
    const misses = value(new RegExp(`^strata_arena_misses_total\\{phase="${phase}"\\} (\\d+)$`, 'm'));
    assert.equal(hits + misses, needed);
    value(new RegExp(`^strata_streamed_ahead_total\\{phase="${phase}"\\} (\\d+)$`, 'm'));
    value(new RegExp(`^strata_bytes_read_total\\{phase="${phase}"\\} (\\d+)$`, 'm'));
    value(new RegExp(`^strata_exposed_wait_seconds_total\\{phase="${phase}"\\} ([0-9.e+-]+)$`, 'm'));
  }
});

test('`strata chat` (stdin from a pipe) replies as the server does', async () => {
  const r = await client.chat.completions.create({
    model: 'x', messages: [{ role: 'user', content: 'Hello' }], max_tokens: 12, temperature: 0,
  });
  const out = spawnSync(BINARY, ['chat', '-m', MODEL, '--temp', '0', '-n', '12'], { input: 'Hello\n/exit\nnot read\n' });
  assert.equal(out.status, 0, out.stderr.toString());
  assert.equal(out.stdout.toString(), r.choices[0].message.content + '\n');
});
