// Starts `strata serve` on a free loopback port for a test file and stops it afterwards.
// The binary and model come from the command line (CTest passes them) or from
// STRATA_BINARY / STRATA_MODEL. Exits 77 (CTest: skipped) when node_modules was not
// installed (scripts/test.sh runs `npm ci` in tests/server first).
import { spawn } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const here = dirname(fileURLToPath(import.meta.url));
export const BINARY = process.argv[2] || process.env.STRATA_BINARY;
export const MODEL = process.argv[3] || process.env.STRATA_MODEL || join(here, '../../models/qwen3moe-code-Q8_0.gguf');

export function requireSetup() {
  if (!existsSync(join(here, 'node_modules/openai'))) {
    console.log('SKIP: tests/server/node_modules is missing; run `npm ci` in tests/server (scripts/test.sh does)');
    process.exit(77);
  }
  if (!BINARY || !existsSync(BINARY)) {
    console.log('SKIP: no strata binary (pass its path as the first argument or set STRATA_BINARY)');
    process.exit(77);
  }
}

/// Starts the server with `args` added; resolves to {url, pid, stop(), log()}.
export async function startServer(args = []) {
  const proc = spawn(BINARY, ['serve', '-m', MODEL, '--host', '127.0.0.1', '--port', '0', ...args], {
    stdio: ['ignore', 'ignore', 'pipe'],
  });
  let log = '';
  const url = await new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`server did not start within 30 s:\n${log}`)), 30000);
    proc.stderr.on('data', (d) => {
      log += d;
      const m = log.match(/listening on (http:\/\/[0-9.]+:[0-9]+)/);
      if (m) {
        clearTimeout(timer);
        resolve(m[1]);
      }
    });
    proc.on('exit', (code) => {
      clearTimeout(timer);
      reject(new Error(`server exited with ${code}:\n${log}`));
    });
  });
  return {
    url,
    pid: proc.pid,
    log: () => log,
    async stop() {
      if (proc.exitCode !== null) return proc.exitCode;
      const exited = new Promise((r) => proc.once('exit', (code) => r(code)));
      proc.kill('SIGTERM');
      const t = setTimeout(() => proc.kill('SIGKILL'), 10000);
      const code = await exited;
      clearTimeout(t);
      return code;
    },
  };
}

/// Resident set size of a process in bytes (Linux).
export function rssBytes(pid) {
  const m = readFileSync(`/proc/${pid}/status`, 'utf8').match(/VmRSS:\s+(\d+) kB/);
  return Number(m[1]) * 1024;
}

/// POST JSON (or a raw string/Buffer body); resolves to {status, headers, body (parsed when JSON)}.
export async function post(url, body, headers = {}) {
  const raw = typeof body === 'string' || Buffer.isBuffer(body) ? body : JSON.stringify(body);
  const res = await fetch(url, { method: 'POST', body: raw, headers: { 'Content-Type': 'application/json', ...headers } });
  const text = await res.text();
  let json = null;
  try {
    json = JSON.parse(text);
  } catch {}
  return { status: res.status, headers: res.headers, body: json, text };
}

/// Reads a server-sent-event stream from a fetch Response; calls onEvent(json) per data line.
export async function readSSE(res, onEvent) {
  const dec = new TextDecoder();
  let buf = '';
  for await (const chunk of res.body) {
    buf += dec.decode(chunk, { stream: true });
    let k;
    while ((k = buf.indexOf('\n\n')) >= 0) {
      const ev = buf.slice(0, k);
      buf = buf.slice(k + 2);
      for (const line of ev.split('\n')) {
        if (!line.startsWith('data: ')) continue;
        const data = line.slice(6);
        if (data === '[DONE]') return;
        if ((await onEvent(JSON.parse(data))) === false) return;
      }
    }
  }
}
