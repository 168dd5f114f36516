#!/usr/bin/env node
// Soak benchmark for `strata serve`: many clients for minutes, some of them hanging up, with
// the server's memory and the requests' latency reported. Starts its own server on a free
// loopback port; uses only Node's built-in modules (fetch, net).
//
//   node bench/soak.mjs [--binary build/strata] [--model models/qwen3moe-code-Q8_0.gguf]
//        [--arena-mb 8] [--clients 32] [--minutes 3] [--parallel 8] [--ctx-size 1024]
//        [--hangup 0.25] [--max-tokens 96] [--threads 0] [--report-s 15] [--extra "serve flags"]
//
// Each client loops until --minutes have passed: it picks at random a chat or a text
// completion, streamed or not (chat requests share a system prompt, so the prefix cache is
// used), with max_tokens uniform in [8, --max-tokens] and the server's default sampling. A
// share --hangup of the requests hang up: a third of them in mid-stream (after 1-20 tokens), a
// third while waiting for a non-streamed answer (after 50-1000 ms), a third in mid-request
// (the headers and half the body sent on a raw socket, then the socket closed). 503s are
// counted apart (the queue was full) and retried after Retry-After. Every --report-s seconds
// and at the end: requests done / cancelled by us / errors, generated tokens/s (completed
// requests' usage plus the tokens streamed to clients that hung up), time to first token and
// latency p50/p95/p99 (TTFT of streamed requests; latency of completed ones, request sent to
// last byte), the server's RSS (VmRSS of /proc/PID/status, sampled every second) and its
// prefix-cache bytes (/metrics). After the last client is done, the server's counters:
// slots free (strata_slots - strata_requests_processing), queued, cancelled as it counted them.
import { readFileSync } from 'node:fs';
import net from 'node:net';

import { extraArgs, numberArg, parseArgs, startServer as spawnServer } from './common.mjs';

const args = parseArgs('soak.mjs', process.argv.slice(2), ['binary', 'model', 'arena-mb', 'clients', 'minutes',
  'parallel', 'ctx-size', 'hangup', 'max-tokens', 'threads', 'report-s', 'extra']);
const BINARY = args.binary ?? 'build/strata';
const MODEL = args.model ?? 'models/qwen3moe-code-Q8_0.gguf';
const ARENA = args['arena-mb'] ?? '8';
const CLIENTS = numberArg('soak.mjs', args, 'clients', 32, { positive: true });
const MINUTES = numberArg('soak.mjs', args, 'minutes', 3, { positive: true });
const PARALLEL = args.parallel ?? '8';
const CTX = args['ctx-size'] ?? '1024';
const HANGUP = numberArg('soak.mjs', args, 'hangup', 0.25, { min: 0, max: 1 });
const MAX_TOKENS = numberArg('soak.mjs', args, 'max-tokens', 96, { positive: true });
const THREADS = args.threads ?? '0';
const REPORT_S = numberArg('soak.mjs', args, 'report-s', 15, { positive: true });
const CLIENT_TIMEOUT_S = 120;
const EXTRA = extraArgs(args);

const SYSTEM = 'You are a careful Python assistant. Answer with short, correct code and no prose. ' +
  'Prefer the standard library, type hints and docstrings. '.repeat(4);
const PROMPTS = ['def read_lines(path):', 'class Stack:\n    def __init__(self):', 'import os\n\ndef walk(root):',
  'def fib(n):', 'Write a function that parses a CSV line.', 'def merge_sorted(a, b):'];

// Deterministic pseudo-random numbers (mulberry32), so runs draw the same request mix.
let seed = 12345;
function rand() {
  seed = (seed + 0x6d2b79f5) | 0;
  let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
  t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
  return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
}
const pick = (a) => a[Math.floor(rand() * a.length)];
const uniform = (lo, hi) => lo + Math.floor(rand() * (hi - lo + 1));

function startServer() {
  return spawnServer(BINARY, ['serve', '-m', MODEL, '--port', '0', '-t', THREADS, '--arena-mb', ARENA, '--parallel',
    PARALLEL, '--ctx-size', CTX, ...EXTRA]);
}

function rssMiB(pid) {
  const m = readFileSync(`/proc/${pid}/status`, 'utf8').match(/VmRSS:\s+(\d+) kB/);
  return Number(m[1]) / 1024;
}

async function scrape(url) {
  const text = await (await fetch(`${url}/metrics`)).text();
  const get = (name) => {
    const line = text.split('\n').find((l) => l.startsWith(name + ' '));
    return line ? Number(line.split(' ').pop()) : null;
  };
  return {
    slots: get('strata_slots'), processing: get('strata_requests_processing'), queued: get('strata_requests_queued'),
    cancelled: get('strata_requests_cancelled_total'), completed: get('strata_requests_completed_total'),
    cacheBytes: get('strata_prefix_cache_bytes'), cacheEntries: get('strata_prefix_cache_entries'),
  };
}

// The statistics of a window (and of the whole run).
function newStats() {
  return { done: 0, cancelled: 0, hung: { stream: 0, wait: 0, send: 0 }, errors: 0, busy: 0, tokens: 0, ttft: [], latency: [], errorSamples: [] };
}
let win = newStats();
const total = newStats();
function record(f) { f(win); f(total); }

function pct(xs, p) {
  if (!xs.length) return NaN;
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor((p / 100) * s.length))];
}
const ms = (x) => (Number.isNaN(x) ? '-' : x.toFixed(0));

function body(kind, maxTokens, stream) {
  const b = kind === 'chat'
    ? { messages: [{ role: 'system', content: SYSTEM }, { role: 'user', content: pick(PROMPTS) }] }
    : { prompt: pick(PROMPTS) };
  return { ...b, max_tokens: maxTokens, stream, ...(stream ? { stream_options: { include_usage: true } } : {}) };
}

// One request; resolves to what happened. `hang` is null or 'stream' / 'wait' / 'send'.
async function oneRequest(url, hang) {
  const kind = rand() < 0.5 ? 'chat' : 'text';
  const path = kind === 'chat' ? '/v1/chat/completions' : '/v1/completions';
  const stream = hang === 'stream' ? true : hang === 'wait' ? false : rand() < 0.5;
  const maxTokens = uniform(8, MAX_TOKENS);
  const payload = JSON.stringify(body(kind, maxTokens, stream));
  if (hang === 'send') return hangUpMidRequest(url, path, payload);
  const ac = new AbortController();
  const hangAfterTokens = hang === 'stream' ? uniform(1, 20) : Infinity;
  let timer = null, timedOut = false;
  if (hang === 'wait') timer = setTimeout(() => ac.abort(), uniform(50, 1000));
  // A client-side bound, so that a stuck request shows as an error instead of a hung run.
  const watchdog = setTimeout(() => { timedOut = true; ac.abort(); }, CLIENT_TIMEOUT_S * 1000);
  const t0 = performance.now();
  let streamed = 0;
  try {
    const res = await fetch(url + path, {
      method: 'POST', headers: { 'Content-Type': 'application/json' }, body: payload, signal: ac.signal,
    });
    if (res.status === 503) {
      await res.text();
      return { busy: true, retryAfter: Number(res.headers.get('retry-after') ?? 1) };
    }
    if (res.status !== 200) return { error: `HTTP ${res.status}: ${(await res.text()).slice(0, 200)}` };
    if (!stream) {
      const j = await res.json();
      clearTimeout(timer);
      if (!j.usage) return { error: `no usage: ${JSON.stringify(j).slice(0, 200)}` };
      return { done: true, tokens: j.usage.completion_tokens, latency: performance.now() - t0 };
    }
    let ttft = null, usage = null, buf = '', finished = false;
    const dec = new TextDecoder();
    for await (const chunk of res.body) {
      buf += dec.decode(chunk, { stream: true });
      let k;
      while ((k = buf.indexOf('\n\n')) >= 0) {
        const ev = buf.slice(0, k);
        buf = buf.slice(k + 2);
        if (!ev.startsWith('data: ')) continue;
        if (ev === 'data: [DONE]') { finished = true; continue; }
        const j = JSON.parse(ev.slice(6));
        if (j.error) return { error: `stream error: ${j.error.message}` };
        if (j.usage) usage = j.usage;
        const c = j.choices && j.choices[0];
        const piece = c && (kind === 'chat' ? c.delta && c.delta.content : c.text);
        if (piece) {
          if (ttft === null) ttft = performance.now() - t0;
          if (++streamed >= hangAfterTokens) {
            ac.abort();
            return { cancelled: true, tokens: streamed, ttft };
          }
        }
      }
    }
    if (!finished || !usage) return { error: `stream ended without [DONE] and usage` };
    return { done: true, tokens: usage.completion_tokens, ttft, latency: performance.now() - t0 };
  } catch (e) {
    if (timedOut) return { error: `no answer within ${CLIENT_TIMEOUT_S} s (client timeout)` };
    if (ac.signal.aborted) return { cancelled: true, tokens: streamed };
    return { error: String(e.cause ?? e) };
  } finally {
    clearTimeout(timer);
    clearTimeout(watchdog);
  }
}

// Sends the headers and half the body, then closes the socket.
function hangUpMidRequest(url, path, payload) {
  const u = new URL(url);
  return new Promise((resolve) => {
    const s = net.connect(Number(u.port), u.hostname, () => {
      s.write(`POST ${path} HTTP/1.1\r\nHost: ${u.host}\r\nContent-Type: application/json\r\n` +
        `Content-Length: ${Buffer.byteLength(payload)}\r\n\r\n` + payload.slice(0, payload.length >> 1));
      setTimeout(() => { s.destroy(); resolve({ cancelled: true, tokens: 0 }); }, uniform(10, 200));
    });
    s.setTimeout(CLIENT_TIMEOUT_S * 1000, () => { s.destroy(); resolve({ error: 'raw socket: connect timed out' }); });
    s.on('error', (e) => resolve({ error: `raw socket: ${e.message}` }));
  });
}

const inFlight = new Map();  // client -> what it is waiting for, since when
async function client(url, deadline, id) {
  while (performance.now() < deadline) {
    const hang = rand() < HANGUP ? pick(['stream', 'wait', 'send']) : null;
    inFlight.set(id, { hang, since: performance.now() });
    const r = await oneRequest(url, hang);
    inFlight.delete(id);
    if (r.busy) {
      record((s) => ++s.busy);
      await new Promise((res) => setTimeout(res, 1000 * r.retryAfter));
    } else if (r.error) {
      record((s) => { ++s.errors; if (s.errorSamples.length < 3) s.errorSamples.push(r.error); });
    } else {
      record((s) => {
        if (r.done) { ++s.done; s.latency.push(r.latency); } else { ++s.cancelled; ++s.hung[hang]; }
        s.tokens += r.tokens;
        if (r.ttft != null) s.ttft.push(r.ttft);
      });
    }
  }
}

function line(label, s, seconds, rss, m) {
  return `${label.padEnd(9)} done ${String(s.done).padStart(5)}  cancelled ${String(s.cancelled).padStart(4)}  ` +
    `errors ${s.errors}  503 ${s.busy}  tok/s ${(s.tokens / seconds).toFixed(1).padStart(6)}  ` +
    `ttft p50/p95/p99 ${ms(pct(s.ttft, 50))}/${ms(pct(s.ttft, 95))}/${ms(pct(s.ttft, 99))} ms  ` +
    `latency p50/p95/p99 ${ms(pct(s.latency, 50))}/${ms(pct(s.latency, 95))}/${ms(pct(s.latency, 99))} ms  ` +
    `RSS ${rss.toFixed(1)} MiB (${(rss - m.cacheBytes / 2 ** 20).toFixed(1)} without the prefix cache)  prefix cache ${(m.cacheBytes / 2 ** 20).toFixed(1)} MiB / ${m.cacheEntries} entries` +
    (s.errorSamples.length ? `\n          errors, e.g.: ${s.errorSamples.join(' | ')}` : '');
}

const srv = await startServer();
console.log(`# ${srv.banner}`);
console.log(`# ${CLIENTS} clients for ${MINUTES} min, ${Math.round(HANGUP * 100)} % of requests hang up, ` +
  `max_tokens 8..${MAX_TOKENS}, --parallel ${PARALLEL} --ctx-size ${CTX} --arena-mb ${ARENA} -t ${THREADS}`);
// Warm-up: one request, so the start RSS includes what any first request allocates.
await oneRequest(srv.url, null);
const rss = { start: rssMiB(srv.pid), min: Infinity, max: 0, last: 0 };
const sampler = setInterval(() => {
  rss.last = rssMiB(srv.pid);
  rss.min = Math.min(rss.min, rss.last);
  rss.max = Math.max(rss.max, rss.last);
}, 1000);
const t0 = performance.now();
const deadline = t0 + MINUTES * 60000;
let tWin = t0;
const reporter = setInterval(async () => {
  const now = performance.now();
  const w = win;
  win = newStats();
  console.log(line(`${((now - t0) / 1000).toFixed(0)} s`, w, (now - tWin) / 1000, rssMiB(srv.pid), await scrape(srv.url)));
  tWin = now;
  if (now > deadline) console.log(`          still waiting: ${JSON.stringify([...inFlight.entries()].map(([c, v]) => [c, v.hang, Math.round((now - v.since) / 1000)]))}`);
}, REPORT_S * 1000);
await Promise.all(Array.from({ length: CLIENTS }, (_, i) => client(srv.url, deadline, i)));
const elapsed = (performance.now() - t0) / 1000;
clearInterval(reporter);
// The server frees a hung-up request's slot at its next step: give it a moment.
let m = await scrape(srv.url);
for (let i = 0; i < 50 && (m.processing !== 0 || m.queued !== 0); ++i) {
  await new Promise((r) => setTimeout(r, 100));
  m = await scrape(srv.url);
}
clearInterval(sampler);
const rssEnd = rssMiB(srv.pid);
console.log(line('total', total, elapsed, rssEnd, m));
console.log(`hung up: ${total.hung.stream} mid-stream, ${total.hung.wait} waiting for a whole answer, ${total.hung.send} mid-request (body half sent)`);
console.log(`server RSS: start ${rss.start.toFixed(1)} MiB (after one warm-up request), min ${rss.min.toFixed(1)}, ` +
  `max ${rss.max.toFixed(1)}, end ${rssEnd.toFixed(1)} MiB (${(rssEnd - rss.start >= 0 ? '+' : '')}${(rssEnd - rss.start).toFixed(1)} MiB)`);
console.log(`server at the end: slots ${m.slots}, free ${m.slots - m.processing}, queued ${m.queued}, ` +
  `completed ${m.completed}, cancelled ${m.cancelled} (strata_requests_*_total)`);
const code = await srv.stop();
console.log(`server exit status ${code}`);
if (m.processing !== 0 || m.queued !== 0 || total.errors) process.exitCode = 1;
