// A reverse proxy in front of a ToastMachine MCP node that adds `Authorization: Bearer <token>` to
// requests for /mcp which carry none. The conformance suite has no way to authenticate its server
// scenarios, and our /mcp refuses anonymous requests (401) before any protocol code runs.
//
// Everything else passes through unchanged, Host and Origin included, so the node's own checks
// (DNS-rebinding protection, OAuth endpoints) are what the suite sees. The node must be configured
// with this proxy's URL as its public URL (TOASTMACHINE_MCP_PUBLIC_URL), like behind a load balancer.
//
// Usage: node lib/bearer-proxy.mjs <listen port> <upstream origin> <token file>
// The token is read from <token file> on each request, so the proxy can run (passing everything
// through) while a client gets the token through it by OAuth; until the file exists nothing is added.
// Prints "proxy listening on http://127.0.0.1:<port>" once it accepts connections.
import fs from 'node:fs';
import http from 'node:http';

const [port, upstream, tokenFile] = process.argv.slice(2);
if (!port || !upstream || !tokenFile) {
  console.error('usage: bearer-proxy.mjs <listen port> <upstream origin> <token file>');
  process.exit(2);
}
const target = new URL(upstream);

function token() {
  try {
    return fs.readFileSync(tokenFile, 'utf8').trim() || undefined;
  } catch {
    return undefined;
  }
}

const server = http.createServer((req, res) => {
  const headers = { ...req.headers };
  const path = new URL(req.url, 'http://proxy').pathname;
  const bearer = token();
  if ((path === '/mcp' || path.startsWith('/mcp/')) && !headers.authorization && bearer) {
    headers.authorization = `Bearer ${bearer}`;
  }
  const forward = http.request(
    { hostname: target.hostname, port: target.port, method: req.method, path: req.url, headers },
    (answer) => {
      res.writeHead(answer.statusCode ?? 502, answer.rawHeaders);
      answer.pipe(res);
    },
  );
  forward.on('error', () => {
    if (!res.headersSent) res.writeHead(502);
    res.end();
  });
  // A client that goes away (an SSE stream closed) ends the upstream request too.
  res.on('close', () => forward.destroy());
  req.pipe(forward);
});

server.listen(Number(port), '127.0.0.1', () => {
  console.log(`proxy listening on http://127.0.0.1:${server.address().port}`);
});
process.on('SIGTERM', () => {
  // Open SSE streams would hold close() forever: end every connection, then exit.
  server.closeAllConnections();
  server.close(() => process.exit(0));
});
