#!/usr/bin/env node
// Load generator for `strata serve`: requests/s and tokens/s at several client concurrencies,
// plus llama.cpp-style sequential use (a --parallel 1 server, one request at a time).
// Starts its own servers on free loopback ports; uses only Node's built-in fetch.
//
//   node bench/serve_load.mjs [--binary build/strata] [--model models/qwen3moe-code-Q8_0.gguf]
//        [--parallel 4] [--clients 1,4,16] [--requests 48] [--max-tokens 64] [--threads 0] [--repeat 3]
//
// Each setting is measured --repeat times and the run with the median tokens/s is reported
// (the development machines are shared, so single runs are noisy).
// Every request is a streamed greedy text completion with ignore_eos, so each one produces
// exactly --max-tokens tokens; prompts rotate over a few short code prompts.
import { spawn } from 'node:child_process';

const args = Object.fromEntries(
  process.argv.slice(2).reduce((acc, a, i, all) => (a.startsWith('--') ? [...acc, [a.slice(2), all[i + 1]]] : acc), []),
);
const BINARY = args.binary ?? 'build/strata';
const MODEL = args.model ?? 'models/qwen3moe-code-Q8_0.gguf';
const PARALLEL = Number(args.parallel ?? 4);
const CLIENTS = (args.clients ?? '1,4,16').split(',').map(Number);
const REQUESTS = Number(args.requests ?? 48);
const MAX_TOKENS = Number(args['max-tokens'] ?? 64);
const THREADS = args.threads ?? '0';
const REPEAT = Number(args.repeat ?? 3);
const PROMPTS = ['def read_lines(path):', 'class Stack:\n    def __init__(self):', 'import os\n\ndef walk(root):', 'def fib(n):'];

async function startServer(parallel) {
  const proc = spawn(BINARY, ['serve', '-m', MODEL, '--port', '0', '--parallel', String(parallel), '-t', THREADS], {
    stdio: ['ignore', 'ignore', 'pipe'],
  });
  let log = '';
  const url = await new Promise((resolve, reject) => {
    proc.stderr.on('data', (d) => {
      log += d;
      const m = log.match(/listening on (http:\/\/[0-9.]+:[0-9]+)/);
      if (m) resolve(m[1]);
    });
    proc.on('exit', (c) => reject(new Error(`server exited ${c}: ${log}`)));
  });
  return { url, stop: () => new Promise((r) => { proc.once('exit', r); proc.kill('SIGTERM'); }) };
}

async function oneRequest(url, k) {
  const t0 = performance.now();
  const res = await fetch(`${url}/v1/completions`, {
    method: 'POST',
    headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify({
      prompt: PROMPTS[k % PROMPTS.length], max_tokens: MAX_TOKENS, temperature: 0, ignore_eos: true,
      stream: true, stream_options: { include_usage: true },
    }),
  });
  if (res.status !== 200) throw new Error(`HTTP ${res.status}: ${await res.text()}`);
  let ttft = null, tokens = 0, buf = '';
  const dec = new TextDecoder();
  for await (const chunk of res.body) {
    if (ttft === null) ttft = performance.now() - t0;
    buf += dec.decode(chunk, { stream: true });
    for (let i; (i = buf.indexOf('\n\n')) >= 0; buf = buf.slice(i + 2)) {
      const line = buf.slice(0, i);
      if (!line.startsWith('data: ') || line === 'data: [DONE]') continue;
      const j = JSON.parse(line.slice(6));
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
  await oneRequest(url, 0); // warm-up: experts in the arena, pages touched
  let next = 0;
  const done = [];
  const t0 = performance.now();
  await Promise.all(
    Array.from({ length: clients }, async () => {
      while (next < REQUESTS) done.push(await oneRequest(url, next++));
    }),
  );
  const s = (performance.now() - t0) / 1000;
  const tokens = done.reduce((a, r) => a + r.tokens, 0);
  const lat = done.map((r) => r.ms).sort((a, b) => a - b);
  const ttft = done.map((r) => r.ttft).sort((a, b) => a - b);
  const pct = (xs, p) => xs[Math.min(xs.length - 1, Math.floor(p * xs.length))];
  return { clients, requests: done.length, s, rps: done.length / s, tps: tokens / s, p50: pct(lat, 0.5), p95: pct(lat, 0.95), ttft50: pct(ttft, 0.5) };
}

const rows = [];
{
  const srv = await startServer(PARALLEL);
  for (const c of CLIENTS) rows.push({ mode: `--parallel ${PARALLEL}, ${c} concurrent client${c > 1 ? 's' : ''}`, ...(await measure(srv.url, c)) });
  await srv.stop();
}
{
  const srv = await startServer(1);
  rows.push({ mode: 'sequential (--parallel 1, one request at a time)', ...(await measure(srv.url, 1)) });
  await srv.stop();
}
console.log(`${REQUESTS} requests x ${MAX_TOKENS} generated tokens each, streamed greedy completions, ${MODEL}, -t ${THREADS}, median of ${REPEAT}\n`);
console.log('| setting | requests/s | generated tokens/s (range) | latency p50 (ms) | latency p95 (ms) | time to first token p50 (ms) |');
console.log('|---|---:|---:|---:|---:|---:|');
for (const r of rows)
  console.log(`| ${r.mode} | ${r.rps.toFixed(2)} | ${r.tps.toFixed(1)} (${r.range}) | ${r.p50.toFixed(0)} | ${r.p95.toFixed(0)} | ${r.ttft50.toFixed(0)} |`);
