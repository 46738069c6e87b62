// Run a GGUF file through wllama (llama.cpp b12211 compiled to wasm64 + JSPI) under plain Node.js >= 26 and print
// the final normed hidden state at the last token of each given token-id prefix.
//
// Usage:  node wllama_runner.mjs [request.json]        (request JSON is read from stdin when no file is given)
// Request: {"model": "/path/file.gguf", "prefixes": [[ids...], ...],
//           optional: "n_ctx": int, "n_ubatch": int,
//                     "kv_overrides": {"key": "int:5" | "float:1.5" | "bool:true" | "str:x"} (llama.cpp KV overrides,
//                                     applied at load, e.g. {"kimi-k31.attention.indexer.top_k": "int:4"}),
//                     "wllama_dir": "<dir holding @wllama/wllama>" (default: $KIMI_WLLAMA_DIR or ./node_modules lookup),
//                     "verbose": bool (copy the native log to stderr)}
// Output (stdout, one JSON object): {"n_embd", "n_vocab", "n_layer", "arch", "hidden": [[...n_embd floats], ...],
//                                    "timings": {"load_s", "embed_s"}}
// Exit codes: 0 ok; 2 bad request / environment; 3 llama.cpp failed to load the model (reason printed on stderr);
//             4 inference failed.
//
// How it works in Node (no browser): wllama starts its worker from a `blob:` URL, so a small `Worker` class over
// node:worker_threads resolves that URL with buffer.resolveObjectURL and provides the postMessage/onmessage glue;
// `self.location` is set so the wasm path resolves; empty cacheManager/modelManager replace the defaults (which need
// browser storage); setCompat(null) keeps it off any CDN; the wasm is given as a file:// URL. Exact token ids go in
// only through createEmbedding on a model loaded with embeddings:true, pooling_type:'last', embd_normalize:-1.

import fs from 'node:fs';
import path from 'node:path';
import { createRequire } from 'node:module';
import { pathToFileURL, fileURLToPath } from 'node:url';
import { resolveObjectURL } from 'node:buffer';
import { Worker as NodeWorker } from 'node:worker_threads';

const EXIT_BAD_REQUEST = 2;
const EXIT_LOAD_FAILED = 3;
const EXIT_INFERENCE_FAILED = 4;

function die(code, message) {
  process.stderr.write(`wllama_runner: ${message}\n`);
  process.exit(code);
}

// ---------------------------------------------------------------------------------------------------------------
// Worker shim: the web `Worker` API over node:worker_threads.
// The worker code arrives as a blob: URL; reading the Blob is async but the constructor must be sync, so the thread
// starts with a bootstrap that waits for its first message (the code), and every postMessage is chained after it.
const WORKER_BOOTSTRAP = `
const { parentPort } = require('node:worker_threads');
const vm = require('node:vm');
globalThis.self = globalThis;
globalThis.require = require;
globalThis.__filename = '/wllama-worker.js';
globalThis.__dirname = '/';
globalThis.location = { href: 'file:///wllama-worker.js' };
globalThis.postMessage = (data, transfer) =>
  parentPort.postMessage(data, Array.isArray(transfer) ? transfer : (transfer && transfer.transfer) || undefined);
let started = false;
parentPort.on('message', (data) => {
  if (!started) {
    started = true;
    vm.runInThisContext(data.__workerCode, { filename: 'wllama-worker.js' });
    return;
  }
  if (typeof globalThis.onmessage === 'function') globalThis.onmessage({ data });
});
`;

class WorkerShim {
  constructor(url /* , options */) {
    const urlStr = String(url);
    const blob = urlStr.startsWith('blob:') ? resolveObjectURL(urlStr) : null;
    if (urlStr.startsWith('blob:') && !blob) throw new Error(`WorkerShim: cannot resolve ${urlStr}`);
    this.onmessage = null;
    this.onerror = null;
    this._w = new NodeWorker(WORKER_BOOTSTRAP, { eval: true });
    this._w.on('message', (data) => this.onmessage && this.onmessage({ data }));
    this._w.on('error', (err) => (this.onerror ? this.onerror(err) : process.stderr.write(`worker error: ${err}\n`)));
    const codeP = blob ? blob.text() : Promise.resolve(fs.readFileSync(fileURLToPath(urlStr), 'utf8'));
    this._ready = codeP.then((code) => this._w.postMessage({ __workerCode: code }));
    this._ready.catch((err) => this.onerror && this.onerror(err));
  }
  postMessage(data, transfer) {
    const list = Array.isArray(transfer) ? transfer : (transfer && transfer.transfer) || undefined;
    this._ready = this._ready.then(() => this._w.postMessage(data, list));
  }
  addEventListener(type, fn) {
    if (type === 'message') this.onmessage = fn;
    if (type === 'error') this.onerror = fn;
  }
  terminate() {
    this._w.terminate();
  }
}

// ---------------------------------------------------------------------------------------------------------------
function findWllamaPackage(req) {
  const candidates = [];
  if (req.wllama_dir) candidates.push(req.wllama_dir);
  if (process.env.KIMI_WLLAMA_DIR) candidates.push(process.env.KIMI_WLLAMA_DIR);
  if (process.env.KIMI_INTEROP_DIR) candidates.push(path.join(process.env.KIMI_INTEROP_DIR, 'node_modules/@wllama/wllama'));
  const here = path.dirname(fileURLToPath(import.meta.url));
  candidates.push(path.resolve(here, '../../.interop/node_modules/@wllama/wllama'));
  for (const c of candidates) {
    if (fs.existsSync(path.join(c, 'package.json')) && fs.existsSync(path.join(c, 'esm/index.js'))) return c;
  }
  try {
    const require = createRequire(import.meta.url);
    return path.resolve(path.dirname(require.resolve('@wllama/wllama/package.json')));
  } catch {
    die(EXIT_BAD_REQUEST, `@wllama/wllama not found (looked in: ${candidates.join(', ')}); run .ci/install-interop.sh`);
  }
}

async function main() {
  const major = Number(process.versions.node.split('.')[0]);
  if (major < 26) die(EXIT_BAD_REQUEST, `needs Node.js >= 26 (wasm64, JSPI), this is ${process.version}`);

  const raw = process.argv[2] ? fs.readFileSync(process.argv[2], 'utf8') : fs.readFileSync(0, 'utf8');
  let req;
  try {
    req = JSON.parse(raw);
  } catch (e) {
    die(EXIT_BAD_REQUEST, `request is not JSON: ${e.message}`);
  }
  if (!req || typeof req.model !== 'string') die(EXIT_BAD_REQUEST, 'request needs "model" (path to a .gguf)');
  const prefixes = req.prefixes ?? [];
  if (!Array.isArray(prefixes) || prefixes.some((p) => !Array.isArray(p) || p.length === 0 || p.some((t) => !Number.isInteger(t) || t < 0)))
    die(EXIT_BAD_REQUEST, '"prefixes" must be a list of non-empty lists of token ids');
  if (!fs.existsSync(req.model)) die(EXIT_BAD_REQUEST, `model file not found: ${req.model}`);
  const maxLen = prefixes.reduce((m, p) => Math.max(m, p.length), 0);
  const nCtx = req.n_ctx ?? Math.max(16, maxLen);
  if (maxLen > nCtx) die(EXIT_BAD_REQUEST, `longest prefix (${maxLen}) exceeds n_ctx (${nCtx})`);
  const nUbatch = Math.max(2, req.n_ubatch ?? Math.min(nCtx, 512));

  const wllamaDir = findWllamaPackage(req);
  const wasmPath = path.join(wllamaDir, 'esm/wasm/wllama.wasm');

  // globals wllama expects from a browser
  globalThis.Worker = WorkerShim;
  globalThis.self ??= globalThis;
  globalThis.location ??= { href: pathToFileURL(path.join(wllamaDir, 'esm') + '/').href };

  const { Wllama } = await import(pathToFileURL(path.join(wllamaDir, 'esm/index.js')).href);

  const nativeLog = [];
  const record = (level) => (...args) => {
    const line = args.map((a) => (typeof a === 'string' ? a : a instanceof Error ? a.stack || a.message : JSON.stringify(a))).join(' ');
    nativeLog.push(`[${level}] ${line}`);
    if (req.verbose) process.stderr.write(`[${level}] ${line}\n`);
  };
  const logger = { debug: record('debug'), log: record('log'), warn: record('warn'), error: record('error') };
  const tailLog = () => nativeLog.slice(-40).join('\n');

  const wllama = new Wllama({ default: pathToFileURL(wasmPath).href }, { logger, cacheManager: {}, modelManager: {} });
  wllama.setCompat(null);

  const t0 = performance.now();
  const params = {
    n_ctx: nCtx,
    n_batch: Math.max(nCtx, nUbatch),
    n_ubatch: nUbatch,
    n_threads: 1,
    n_gpu_layers: 0,
    n_parallel: 1,
    warmup: false,
    flash_attn: false,
    cache_type_k: 'f32',
    cache_type_v: 'f32',
    embeddings: true,
    pooling_type: 'last',
  };
  if (req.kv_overrides && Object.keys(req.kv_overrides).length) {
    // wllama 3.13.0 forwards kv_overrides to common_model_params_to_llama without the empty-key terminator that
    // llama.cpp asserts on (GGML_ASSERT "KV overrides not terminated with empty key" -> abort); an entry with the key
    // "" parses into exactly that terminator, so it goes last (JS keeps string-key insertion order).
    const kvo = {};
    for (const [k, v] of Object.entries(req.kv_overrides)) {
      if (!k) continue;
      if (typeof v !== 'string' || !/^(int|float|bool|str):/.test(v))
        die(EXIT_BAD_REQUEST, `kv_overrides["${k}"] must be a string "int:N", "float:X", "bool:true|false" or "str:S"`);
      if (k.length >= 128) die(EXIT_BAD_REQUEST, `kv_overrides key too long (llama.cpp limit 127 chars): ${k}`);
      kvo[k] = v;
    }
    kvo[''] = 'int:0';
    params.kv_overrides = kvo;
  }
  try {
    await wllama.loadModel([await fs.openAsBlob(req.model)], params);
  } catch (e) {
    die(EXIT_LOAD_FAILED, `loadModel threw: ${e && (e.message || e)}\n--- native log (tail) ---\n${tailLog()}`);
  }
  const info = wllama.getLoadedContextInfo();
  if (!info || !info.n_vocab) {
    // a failed load resolves with n_vocab = 0; the reason is only in the native log
    const reasons = nativeLog.filter((l) => /^\[(error|warn)\]/.test(l) && !/ggml_webgpu/.test(l));
    die(EXIT_LOAD_FAILED, `llama.cpp failed to load ${req.model}\n--- reason ---\n${reasons.join('\n') || '(none logged)'}\n--- native log (tail) ---\n${tailLog()}`);
  }
  const t1 = performance.now();

  let hidden = [];
  if (prefixes.length) {
    let res;
    try {
      res = await wllama.createEmbedding({ input: prefixes, embd_normalize: -1, encoding_format: 'float' });
    } catch (e) {
      die(EXIT_INFERENCE_FAILED, `createEmbedding failed: ${e && (e.message || e)}\n--- native log (tail) ---\n${tailLog()}`);
    }
    const data = [...res.data].sort((a, b) => a.index - b.index);
    if (data.length !== prefixes.length) die(EXIT_INFERENCE_FAILED, `got ${data.length} embeddings for ${prefixes.length} prefixes`);
    hidden = data.map((d) => d.embedding);
  }
  const t2 = performance.now();

  const out = {
    n_embd: info.n_embd,
    n_vocab: info.n_vocab,
    n_layer: info.n_layer,
    arch: info.metadata['general.architecture'] ?? null,
    hidden,
    timings: { load_s: (t1 - t0) / 1000, embed_s: (t2 - t1) / 1000 },
  };
  try {
    await wllama.exit();
  } catch {}
  process.stdout.write(JSON.stringify(out) + '\n', () => process.exit(0));
}

main().catch((e) => die(EXIT_INFERENCE_FAILED, `unexpected error: ${e && (e.stack || e)}`));
