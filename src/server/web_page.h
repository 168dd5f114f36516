#pragma once
// The chat page `strata serve` answers at GET / (one self-contained HTML file, no external
// resources, embedded in the binary as this string; edit it here, nothing to build). It
// streams replies from POST /v1/chat/completions (SSE over fetch), stops one with an
// AbortController (the server cancels the request when the stream closes), and shows the
// model (GET /v1/models) and, every second, counters of GET /metrics: decode tokens/s, arena
// hits and misses and the exposed wait of the decode phase. An API key typed into the key
// field (kept in the browser's localStorage) is sent as `Authorization: Bearer KEY`; a 401
// says so on the page.

namespace strata::server {

inline constexpr const char kWebPage[] = R"STRATA_HTML(<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>strata chat</title>
<style>
  body { font-family: system-ui, sans-serif; margin: 0; display: flex; flex-direction: column; height: 100vh; }
  header { padding: 8px 12px; background: #223; color: #eee; font-size: 14px; display: flex; gap: 16px; flex-wrap: wrap; }
  header b { color: #fff; }
  #log { flex: 1; overflow-y: auto; padding: 12px; }
  .msg { white-space: pre-wrap; margin: 6px 0; padding: 8px 10px; border-radius: 6px; max-width: 80ch; }
  .user { background: #e8eefc; margin-left: auto; }
  .assistant { background: #f2f2f2; }
  .error { background: #fde8e8; }
  form { display: flex; gap: 8px; padding: 8px 12px; border-top: 1px solid #ccc; }
  textarea { flex: 1; height: 3em; font: inherit; }
</style>
</head>
<body>
<header>
  <span>model: <b id="model">?</b></span>
  <span>decode: <b id="tps">-</b> tok/s</span>
  <span>arena hits: <b id="hits">-</b></span>
  <span>misses: <b id="misses">-</b></span>
  <span>exposed wait: <b id="wait">-</b> s</span>
  <label>API key: <input id="key" type="password" size="12" autocomplete="off"></label>
  <span id="status">idle</span>
</header>
<div id="log"></div>
<form id="form">
  <textarea id="input" placeholder="Message (Enter sends, Shift+Enter: new line)"></textarea>
  <button id="send" type="submit">Send</button>
  <button id="stop" type="button" disabled>Stop</button>
  <button id="clear" type="button">Clear</button>
</form>
<script>
'use strict';
const $ = (id) => document.getElementById(id);
const messages = [];
let controller = null;
// The API key (--api-key of the server), kept in localStorage across reloads.
const KEY = 'strata-api-key';
const store = typeof localStorage === 'undefined' ? null : localStorage;
$('key').value = (store && store.getItem(KEY)) || '';
$('key').addEventListener('input', () => {
  if (store) store.setItem(KEY, $('key').value);
  loadModel();
});
const UNAUTHORIZED = 'HTTP 401: the server needs an API key (--api-key): enter it in the API key field';

// fetch with the API key as a bearer token; throws on 401 with UNAUTHORIZED.
async function api(url, opts) {
  opts = opts || {};
  const headers = Object.assign({}, opts.headers);
  const key = $('key').value.trim();
  if (key) headers['Authorization'] = 'Bearer ' + key;
  const res = await fetch(url, Object.assign({}, opts, { headers }));
  if (res.status === 401) throw new Error(UNAUTHORIZED);
  return res;
}

function add(role, text) {
  const div = document.createElement('div');
  div.className = 'msg ' + role;
  div.textContent = text;
  $('log').appendChild(div);
  $('log').scrollTop = $('log').scrollHeight;
  return div;
}

// The value of a Prometheus sample `name{labels}` in `text`, or null.
function metric(text, name, labels) {
  const key = labels ? name + '{' + labels + '}' : name;
  for (const line of text.split('\n')) {
    if (line.startsWith(key + ' ')) return Number(line.slice(key.length + 1));
  }
  return null;
}

async function poll() {
  try {
    const t = await (await api('/metrics')).text();
    const tps = metric(t, 'strata_decode_tokens_per_second');
    $('tps').textContent = tps === null ? '-' : tps.toFixed(1);
    $('hits').textContent = String(metric(t, 'strata_arena_hits_total', 'phase="decode"') ?? '-');
    $('misses').textContent = String(metric(t, 'strata_arena_misses_total', 'phase="decode"') ?? '-');
    const w = metric(t, 'strata_exposed_wait_seconds_total', 'phase="decode"');
    $('wait').textContent = w === null ? '-' : w.toFixed(3);
    if ($('status').textContent === UNAUTHORIZED) $('status').textContent = 'idle';
  } catch (e) {
    if (e.message === UNAUTHORIZED && !controller) $('status').textContent = UNAUTHORIZED;
    /* else the server may be restarting */
  }
}

async function loadModel() {
  try {
    const m = await (await api('/v1/models')).json();
    $('model').textContent = m.data[0].id;
  } catch (e) { $('model').textContent = e.message === UNAUTHORIZED ? '(API key needed)' : '(unavailable)'; }
}

async function send(text) {
  messages.push({ role: 'user', content: text });
  add('user', text);
  const out = add('assistant', '');
  controller = new AbortController();
  $('send').disabled = true;
  $('stop').disabled = false;
  $('status').textContent = 'generating';
  let reply = '';
  try {
    const res = await api('/v1/chat/completions', {
      method: 'POST',
      headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify({ messages, stream: true }),
      signal: controller.signal,
    });
    if (!res.ok) throw new Error((await res.json()).error.message);
    const reader = res.body.getReader();
    const dec = new TextDecoder();
    let buf = '';
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let k;
      while ((k = buf.indexOf('\n\n')) >= 0) {
        const ev = buf.slice(0, k);
        buf = buf.slice(k + 2);
        if (!ev.startsWith('data: ') || ev === 'data: [DONE]') continue;
        const j = JSON.parse(ev.slice(6));
        if (j.error) throw new Error(j.error.message);
        const c = j.choices && j.choices[0];
        if (c && c.delta && c.delta.content) {
          reply += c.delta.content;
          out.textContent = reply;
          $('log').scrollTop = $('log').scrollHeight;
        }
      }
    }
    $('status').textContent = 'done';
  } catch (e) {
    if (e.name === 'AbortError') {
      $('status').textContent = 'stopped';
    } else {
      out.className = 'msg error';
      out.textContent = reply + '\n[' + e.message + ']';
      $('status').textContent = 'error';
    }
  }
  messages.push({ role: 'assistant', content: reply });
  controller = null;
  $('send').disabled = false;
  $('stop').disabled = true;
}

$('form').addEventListener('submit', (ev) => {
  ev.preventDefault();
  const text = $('input').value.trim();
  if (!text || controller) return;
  $('input').value = '';
  send(text);
});
$('input').addEventListener('keydown', (ev) => {
  if (ev.key === 'Enter' && !ev.shiftKey) { ev.preventDefault(); $('form').requestSubmit(); }
});
$('stop').addEventListener('click', () => { if (controller) controller.abort(); });
$('clear').addEventListener('click', () => { if (!controller) { messages.length = 0; $('log').textContent = ''; } });
loadModel();
poll();
setInterval(poll, 1000);
</script>
</body>
</html>
)STRATA_HTML";

}  // namespace strata::server
