// A reverse proxy in front of a ToastMachine MCP node that adds `Authorization: Bearer <token>` to
// requests for /mcp which carry none. The conformance suite has no way to authenticate its server
// scenarios, and our /mcp refuses anonymous requests (401) before any protocol code runs.
//
// Everything else passes through unchanged, Host and Origin included, so the node's own checks
// (DNS-rebinding protection, OAuth endpoints) are what the suite sees. The node must be configured
// with this proxy's URL as its public URL (TOASTMACHINE_MCP_PUBLIC_URL), like behind a load balancer.
//
// Usage: TM_BEARER_TOKEN=... node lib/bearer-proxy.mjs <listen port> <upstream origin>
// Prints "proxy listening on http://127.0.0.1:<port>" once it accepts connections.
import http from 'node:http';

const [port, upstream] = process.argv.slice(2);
const token = process.env.TM_BEARER_TOKEN;
if (!port || !upstream || !token) {
  console.error('usage: TM_BEARER_TOKEN=... bearer-proxy.mjs <listen port> <upstream origin>');
  process.exit(2);
}
const target = new URL(upstream);

const server = http.createServer((req, res) => {
  const headers = { ...req.headers };
  const path = new URL(req.url, 'http://proxy').pathname;
  if ((path === '/mcp' || path.startsWith('/mcp/')) && !headers.authorization) {
    headers.authorization = `Bearer ${token}`;
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
process.on('SIGTERM', () => server.close(() => process.exit(0)));
