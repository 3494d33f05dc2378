// Runs the conformance suite's authorization-server scenarios against a ToastMachine MCP node's OAuth
// authorization server, playing the parts the suite leaves to a person: it registers a public client
// (RFC 7591) for the suite's callback, and when the suite prints the authorization URL it approves the
// consent page (lib/consent.mjs) and delivers the redirect to the suite's callback server.
//
// Usage: node conformance-authorization.mjs <issuer> <output dir>
// Exits with the suite's exit code; the per-scenario checks are in <output dir>.
import { spawn } from 'node:child_process';
import net from 'node:net';
import { createInterface } from 'node:readline';
import { fileURLToPath } from 'node:url';

import { approve } from './lib/consent.mjs';

const [issuer, outputDir] = process.argv.slice(2);
if (!issuer || !outputDir) {
  console.error('usage: node conformance-authorization.mjs <issuer> <output dir>');
  process.exit(2);
}
const here = (path) => fileURLToPath(new URL(path, import.meta.url));

/** A loopback port that was free a moment ago, for the suite's callback server. */
function freePort() {
  return new Promise((resolve, reject) => {
    const server = net.createServer();
    server.on('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const { port } = server.address();
      server.close(() => resolve(port));
    });
  });
}

const port = await freePort();
const registered = await fetch(new URL('/register', issuer), {
  method: 'POST',
  headers: { 'content-type': 'application/json' },
  body: JSON.stringify({
    client_name: 'MCP conformance suite', redirect_uris: [`http://127.0.0.1:${port}/callback`],
    token_endpoint_auth_method: 'none', grant_types: ['authorization_code'], response_types: ['code'],
  }),
});
if (registered.status !== 201) throw new Error(`registration answered ${registered.status}`);
const { client_id: clientId } = await registered.json();

const suite = spawn(process.execPath, [
  '--import', here('./lib/node20.mjs'), here('./node_modules/@modelcontextprotocol/conformance/dist/index.js'),
  'authorization', '--url', issuer, '--client-id', clientId, '--resource', `${issuer}/mcp`,
  '--port', String(port), '-o', outputDir,
], { stdio: ['ignore', 'pipe', 'inherit'] });

/** GET the redirect on the suite's callback server, which it may still be starting: retry for 10 s. */
async function deliver(callback) {
  const deadline = Date.now() + 10_000;
  for (;;) {
    try {
      return await fetch(callback);
    } catch (error) {
      if (Date.now() > deadline) throw error;
      await new Promise((resolve) => setTimeout(resolve, 100));
    }
  }
}

let approving;
for await (const line of createInterface({ input: suite.stdout })) {
  console.log(line);
  // The suite prints the URL for "your browser" on a line of its own.
  if (!approving && line.startsWith(`${issuer}/authorize?`)) {
    approving = approve(line, `conformance-${clientId.slice(0, 8)}`).then(deliver);
  }
}
if (approving) await approving;
const code = await new Promise((resolve) => {
  if (suite.exitCode !== null) resolve(suite.exitCode);
  else suite.on('exit', (c) => resolve(c ?? 1));
});
process.exit(code);
