#!/usr/bin/env node
// Load generator for `strata serve`: requests/s, generated tokens/s and expert reads per
// generated token at several client concurrencies, continuous batching against the former
// interleaving (--no-cont-batching), side by side in one run; and the prefix cache's time to
// first token for a long shared system prompt, cold against cached.
// Starts its own servers on free loopback ports; uses only Node's built-in fetch.
//
//   node bench/serve_load.mjs [--binary build/strata] [--model models/qwen3moe-code-Q8_0.gguf]
//        [--arena-mb 8] [--parallel 32] [--clients 1,4,16,32] [--requests 64] [--max-tokens 32]
//        [--threads 0] [--repeat 1] [--ctx-size 512] [--modes batched,interleaved]
//        [--prefix-tokens 2000] [--prefix-repeat 3] [--extra "more serve flags"]
//
// Each setting is measured --repeat times and the run with the median tokens/s is reported.
// Every request is a streamed greedy text completion with ignore_eos, so each one produces
// exactly --max-tokens tokens; prompts rotate over a few short code prompts. Expert reads come
// from /metrics before and after each measurement (both phases, since a step that holds a
// prompt chunk counts as prefill): experts the compute needed per generated token (the union of
// each layer's experts over the batch, summed over layers and steps) and expert bytes read from
// disk per generated token. --prefix-tokens 0 skips the prefix-cache part.
import { extraArgs, numberArg, parseArgs, startServer as spawnServer } from './common.mjs';

const S = 'serve_load.mjs';
const args = parseArgs(S, process.argv.slice(2), ['binary', 'model', 'arena-mb', 'parallel', 'clients', 'requests',
  'max-tokens', 'threads', 'repeat', 'ctx-size', 'modes', 'prefix-tokens', 'prefix-repeat', 'extra']);
const BINARY = args.binary ?? 'build/strata';
const MODEL = args.model ?? 'models/qwen3moe-code-Q8_0.gguf';
const ARENA = args['arena-mb'] ?? '8';
const PARALLEL = numberArg(S, args, 'parallel', 32, { positive: true });
const CLIENTS = (args.clients ?? '1,4,16,32').split(',').map((c) => numberArg(S, { clients: c }, 'clients', 0, { positive: true }));
const REQUESTS = numberArg(S, args, 'requests', 64, { positive: true });
const MAX_TOKENS = numberArg(S, args, 'max-tokens', 32, { positive: true });
const THREADS = args.threads ?? '0';
const REPEAT = numberArg(S, args, 'repeat', 1, { positive: true });
const CTX = args['ctx-size'] ?? '512';
const MODES = (args.modes ?? 'batched,interleaved').split(',');
const PREFIX_TOKENS = numberArg(S, args, 'prefix-tokens', 2000, { min: 0 });
const PREFIX_REPEAT = numberArg(S, args, 'prefix-repeat', 3, { positive: true });
const EXTRA = extraArgs(args);
const PROMPTS = ['def read_lines(path):', 'class Stack:\n    def __init__(self):', 'import os\n\ndef walk(root):', 'def fib(n):'];

function startServer(flags) {
  return spawnServer(BINARY, ['serve', '-m', MODEL, '--port', '0', '-t', THREADS, '--arena-mb', ARENA, ...flags, ...EXTRA]);
}

async function scrape(url) {
  const text = await (await fetch(`${url}/metrics`)).text();
  const sum = (name) =>
    text.split('\n').filter((l) => l.startsWith(name + '{') || l.startsWith(name + ' '))
      .reduce((a, l) => a + Number(l.split(' ').pop()), 0);
  return {
    needed: sum('strata_experts_needed_total'), bytes: sum('strata_bytes_read_total'),
    generated: sum('strata_generated_tokens_total'), steps: sum('strata_batch_steps_total'),
  };
}

async function oneRequest(url, prompt, maxTokens) {
  const t0 = performance.now();
  const res = await fetch(`${url}/v1/completions`, {
    method: 'POST',
    headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify({
      prompt, max_tokens: maxTokens, temperature: 0, ignore_eos: true,
      stream: true, stream_options: { include_usage: true },
    }),
  });
  if (res.status !== 200) throw new Error(`HTTP ${res.status}: ${await res.text()}`);
  let ttft = null, tokens = 0, buf = '';
  const dec = new TextDecoder();
  for await (const chunk of res.body) {
    buf += dec.decode(chunk, { stream: true });
    for (let i; (i = buf.indexOf('\n\n')) >= 0; buf = buf.slice(i + 2)) {
      const line = buf.slice(0, i);
      if (!line.startsWith('data: ') || line === 'data: [DONE]') continue;
      const j = JSON.parse(line.slice(6));
      if (ttft === null && j.choices?.length) ttft = performance.now() - t0;
      if (j.usage) tokens = j.usage.completion_tokens;
    }
  }
  return { ms: performance.now() - t0, ttft, tokens };
}

async function measure(url, clients) {
  const runs = [];
  for (let k = 0; k < REPEAT; k++) runs.push(await measureOnce(url, clients));
  runs.sort((a, b) => a.tps - b.tps);
  return { ...runs[Math.floor(runs.length / 2)], range: `${runs[0].tps.toFixed(0)}-${runs[runs.length - 1].tps.toFixed(0)}` };
}

async function measureOnce(url, clients) {
  await oneRequest(url, PROMPTS[0], MAX_TOKENS); // warm-up: experts in the arena, pages touched
  const m0 = await scrape(url);
  let next = 0;
  const done = [];
  const t0 = performance.now();
  await Promise.all(
    Array.from({ length: clients }, async () => {
      while (next < REQUESTS) {
        const k = next++;
        done.push(await oneRequest(url, PROMPTS[k % PROMPTS.length], MAX_TOKENS));
      }
    }),
  );
  const s = (performance.now() - t0) / 1000;
  const m1 = await scrape(url);
  const tokens = done.reduce((a, r) => a + r.tokens, 0);
  const lat = done.map((r) => r.ms).sort((a, b) => a - b);
  const ttft = done.map((r) => r.ttft).sort((a, b) => a - b);
  const pct = (xs, p) => xs[Math.min(xs.length - 1, Math.floor(p * xs.length))];
  const gen = m1.generated - m0.generated;
  return {
    clients, requests: done.length, s, rps: done.length / s, tps: tokens / s, p50: pct(lat, 0.5), ttft50: pct(ttft, 0.5),
    needed: (m1.needed - m0.needed) / gen, mib: (m1.bytes - m0.bytes) / gen / 2 ** 20, steps: m1.steps - m0.steps,
  };
}

console.log(`${MODEL}, --arena-mb ${ARENA}, -t ${THREADS}, --parallel ${PARALLEL}, --ctx-size ${CTX}; ` +
  `${REQUESTS} requests x ${MAX_TOKENS} generated tokens each, streamed greedy completions, median of ${REPEAT}\n`);
const rows = [];
for (const mode of MODES) {
  const flags = ['--parallel', String(PARALLEL), '--ctx-size', CTX, '--cache-ram', '0'];
  if (mode === 'interleaved') flags.push('--no-cont-batching');
  const srv = await startServer(flags);
  console.log(srv.banner);
  for (const c of CLIENTS) rows.push({ mode, ...(await measure(srv.url, c)) });
  await srv.stop();
}
console.log('\n| scheduling | clients | requests/s | generated tokens/s (range) | latency p50 (ms) | time to first token p50 (ms) | forward steps | experts needed / token | expert MiB read / token |');
console.log('|---|---:|---:|---:|---:|---:|---:|---:|---:|');
for (const r of rows)
  console.log(`| ${r.mode} | ${r.clients} | ${r.rps.toFixed(2)} | ${r.tps.toFixed(1)} (${r.range}) | ${r.p50.toFixed(0)} | ${r.ttft50.toFixed(0)} | ${r.steps} | ${r.needed.toFixed(1)} | ${r.mib.toFixed(2)} |`);

if (PREFIX_TOKENS > 0) {
  // A system prompt of about PREFIX_TOKENS tokens (a code file), new for every repetition (so the
  // first request is cold), then a second request with the same system prompt and another ask.
  const srv = await startServer(['--parallel', '2', '--ctx-size', String(PREFIX_TOKENS + 512)]);
  const tok = async (text) =>
    (await (await fetch(`${srv.url}/tokenize`, { method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify({ content: text }) })).json()).tokens.length;
  const cold = [], cached = [];
  let sysTokens = 0;
  for (let k = 0; k < PREFIX_REPEAT; k++) {
    let sys = `# session ${k}: a helper module\n`;
    for (let i = 0; (sysTokens = await tok(sys)) < PREFIX_TOKENS; i += 8)
      for (let j = i; j < i + 8; j++) sys += `def helper_${k}_${j}(x, y):\n    return (x * ${j} + y) % ${k + 7}\n\n`;
    cold.push((await oneRequest(srv.url, sys + 'def read_lines(path):', 8)).ttft);
    cached.push((await oneRequest(srv.url, sys + 'class Stack:', 8)).ttft);
  }
  const m = await (await fetch(`${srv.url}/metrics`)).text();
  await srv.stop();
  const med = (xs) => xs.sort((a, b) => a - b)[Math.floor(xs.length / 2)];
  const reused = m.match(/^strata_prefix_cache_tokens_reused_total (\S+)$/m)[1];
  console.log(`\nprefix cache: system prompt of ${sysTokens} tokens, ${PREFIX_REPEAT} repetitions; ` +
    `time to first token median cold ${med(cold).toFixed(0)} ms (${cold.map((x) => x.toFixed(0)).join(', ')}), ` +
    `cached ${med(cached).toFixed(0)} ms (${cached.map((x) => x.toFixed(0)).join(', ')}); tokens reused ${reused}`);
}
