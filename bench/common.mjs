// What the `strata serve` benchmarks (serve_load.mjs, soak.mjs) share: their `--name value`
// command line and starting a server on a free loopback port. Node built-ins only.
import { spawn } from 'node:child_process';

/**
 * Parses `--name value` pairs into { name: value } (strings; absent flags are absent).
 * `known` lists the accepted names (without `--`). An unknown flag, a flag without a value, or a
 * word that is not a flag prints a named error and the accepted flags, and exits with status 2.
 * @param {string} script the script's file name, for the messages
 * @param {string[]} argv the arguments after the script (process.argv.slice(2))
 * @param {string[]} known accepted flag names
 * @returns {Record<string, string>}
 */
export function parseArgs(script, argv, known) {
  const fail = (msg) => {
    console.error(`${script}: ${msg}; flags: ${known.map((k) => `--${k}`).join(' ')}`);
    process.exit(2);
  };
  const args = {};
  for (let i = 0; i < argv.length; i += 2) {
    const a = argv[i];
    if (!a.startsWith('--')) fail(`'${a}' is not a flag (flags are --name value)`);
    const name = a.slice(2);
    if (!known.includes(name)) fail(`unknown flag ${a}`);
    if (i + 1 >= argv.length) fail(`${a} needs a value`);
    args[name] = argv[i + 1];
  }
  return args;
}

/**
 * The number of flag `name` (or `def` when absent). Exits with status 2 and a named error when
 * it is not a finite number in [min, max] (both inclusive; min defaults to -Infinity, max to
 * Infinity), or, with positive, not > 0.
 */
export function numberArg(script, args, name, def, { min = -Infinity, max = Infinity, positive = false } = {}) {
  const v = Number(args[name] ?? def);
  if (!Number.isFinite(v) || v < min || v > max || (positive && v <= 0)) {
    const range = positive ? 'a positive number' : `a number in [${min}, ${max}]`;
    console.error(`${script}: --${name} ${args[name]}: must be ${range}`);
    process.exit(2);
  }
  return v;
}

/** Splits `--extra "more serve flags"` on spaces (empty parts dropped). */
export const extraArgs = (args) => (args.extra ?? '').split(' ').filter((x) => x);

/**
 * Starts `binary` with `argv` (a `serve ... --port 0` command line) and resolves once its stderr
 * says "listening on http://HOST:PORT". Rejects with the server's log if it exits first, or with
 * the reason when it cannot be started (e.g. no such binary).
 * @returns {Promise<{url: string, banner: string, pid: number, log: () => string, stop: () => Promise<void>}>}
 *   url: http://HOST:PORT; banner: the "listening on ..." line; log(): stderr so far;
 *   stop(): SIGTERM, resolved when the process has exited.
 */
export async function startServer(binary, argv) {
  const proc = spawn(binary, argv, { stdio: ['ignore', 'ignore', 'pipe'] });
  let log = '';
  const url = await new Promise((resolve, reject) => {
    proc.stderr.on('data', (d) => {
      log += d;
      const m = log.match(/listening on (http:\/\/[0-9.]+:[0-9]+)/);
      if (m) resolve(m[1]);
    });
    proc.on('error', (e) => reject(new Error(`cannot start ${binary}: ${e.message}`)));
    proc.on('exit', (c) => reject(new Error(`server exited ${c}: ${log}`)));
  });
  const banner = log.match(/listening on [^\n]*/)[0];
  return {
    url,
    banner,
    pid: proc.pid,
    log: () => log,
    stop: () => new Promise((r) => { proc.once('exit', r); proc.kill('SIGTERM'); }),
  };
}
