// @modelcontextprotocol/client 2.x against a ToastMachine MCP node, pinned to protocol 2026-07-28
// (stateless, `server/discover`). OAuth through the SDK's own flow (lib/provider.mjs approves the
// consent page), then lib/exercise.mjs; prints one JSON object on stdout for tests/test_mcp_node.py.
import { Client, StreamableHTTPClientTransport, UnauthorizedError } from '@modelcontextprotocol/client';

import { exercise } from './lib/exercise.mjs';
import { ConsentingProvider, args } from './lib/provider.mjs';

const PROTOCOL = '2026-07-28';
const { url, agentName } = args('client-v2.mjs');
const provider = new ConsentingProvider({
  agentName, clientName: 'Node client (MCP SDK v2)', scope: 'toastmachine:read toastmachine:write',
});

function connect() {
  const client = new Client(
    { name: 'toastmachine-node-v2', version: '1.0.0' },
    { versionNegotiation: { mode: { pin: PROTOCOL } } },
  );
  const transport = new StreamableHTTPClientTransport(url, { authProvider: provider });
  return { client, transport };
}

let { client, transport } = connect();
try {
  await client.connect(transport);
} catch (error) {
  if (!(error instanceof UnauthorizedError)) throw error;
  // The SDK sent the user agent to the consent page; finish with the callback (code and iss).
  await transport.finishAuth(provider.callbackParams());
  ({ client, transport } = connect());
  await client.connect(transport);
}

const report = await exercise(client, { agentName, sdk: '@modelcontextprotocol/client' });
console.log(JSON.stringify({ ...report, protocol_version: client.getNegotiatedProtocolVersion() }));
await client.close();
