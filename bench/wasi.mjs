// Runs a wasm32-wasip1 command (the `core` micro-benchmarks, or the library's unit tests, built
// for wasm) in Node's V8, the engine Envoy embeds: `node bench/wasi.mjs <file.wasm> [args...]`
// (`make bench-core-v8`, `make unit-wasm`). Exits with the command's code; a trap (a failed
// test: a panic aborts on wasm32-wasip1) is an uncaught error, so non-zero too.
//
// Both link the filter's library, whose proxy-wasm imports (module "env") are never called by
// the core: each is a stub that throws, so a host call outside a host fails loudly.
import { readFile } from 'node:fs/promises';
import { argv, exit } from 'node:process';
import { WASI } from 'node:wasi';

if (argv.length < 3) {
  console.error('usage: node bench/wasi.mjs <file.wasm> [args...]');
  exit(2);
}
const wasi = new WASI({ version: 'preview1', args: ['core', ...argv.slice(3)], env: {}, returnOnExit: true });
const module = await WebAssembly.compile(await readFile(argv[2]));
const imports = wasi.getImportObject();
for (const imp of WebAssembly.Module.imports(module)) {
  if (imp.kind !== 'function' || imports[imp.module]?.[imp.name]) continue;
  imports[imp.module] ??= {};
  imports[imp.module][imp.name] = () => {
    throw new Error(`host call ${imp.module}.${imp.name} outside a host`);
  };
}
const instance = await WebAssembly.instantiate(module, imports);
// The library also exports `_initialize` (a proxy-wasm module is a reactor); WASI's `start`
// wants a command, so it sees only the memory and `_start`.
const code = wasi.start({ exports: { memory: instance.exports.memory, _start: instance.exports._start } });
exit(code ?? 0);
