// What the node API tests share: where the build and the test model are, the packages
// installed in tests/js, and `tandem serve` started and stopped as a child process.
import { spawn } from 'node:child_process';
import { createRequire } from 'node:module';
import path from 'node:path';

export const sourceDir =
  process.env.TANDEM_SOURCE_DIR ?? path.resolve(import.meta.dirname, '../..');
export const binaryDir = process.env.TANDEM_BINARY_DIR ?? path.join(sourceDir, 'build');
export const modelDir =
  process.env.TANDEM_API_TEST_MODEL ?? path.join(binaryDir, 'tests/api/tiny-model');
// The conformance packages (openai, ajv, ...) are installed in tests/js (scripts/install-deps).
export const requirePackage = createRequire(path.join(sourceDir, 'tests/js/package.json'));

// Starts `tandem serve` (on `model`, the tiny test model unless given) and resolves with
// {url, child} once it prints its address.
export function startServer(extraArgs = [], model = modelDir) {
  const child = spawn(
    path.join(binaryDir, 'bin/tandem'),
    ['serve', '--model', model, '--port', '0', '--threads', '1', ...extraArgs],
    { stdio: ['ignore', 'pipe', 'inherit'] },
  );
  return new Promise((resolve, reject) => {
    let out = '';
    const timer = setTimeout(() => reject(new Error(`server did not start: ${out}`)), 120000);
    child.stdout.on('data', (chunk) => {
      out += chunk;
      const m = out.match(/ on (http:\/\/[^\s]+)/);
      if (m) {
        clearTimeout(timer);
        resolve({ url: m[1], child });
      }
    });
    child.on('exit', (code) => {
      clearTimeout(timer);
      reject(new Error(`server exited with ${code}: ${out}`));
    });
  });
}

export function stopServer(server) {
  if (!server || server.child.exitCode !== null) return Promise.resolve();
  return new Promise((resolve) => {
    server.child.once('exit', resolve);
    server.child.kill('SIGTERM');
  });
}
