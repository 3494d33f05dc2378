// @modelcontextprotocol/sdk 1.x against a ToastMachine MCP node: the 2025-11-25 initialize handshake.
// OAuth through the SDK's own flow (lib/provider.mjs approves the consent page), then lib/exercise.mjs;
// prints one JSON object on stdout for tests/test_mcp_node.py.
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { UnauthorizedError } from '@modelcontextprotocol/sdk/client/auth.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';

import { exercise } from './lib/exercise.mjs';
import { ConsentingProvider, args } from './lib/provider.mjs';

const { url, agentName } = args('client-v1.mjs');
const provider = new ConsentingProvider({
  agentName, clientName: 'Node client (MCP SDK v1)', scope: 'toastmachine:read toastmachine:write',
});

function connect() {
  const client = new Client({ name: 'toastmachine-node-v1', version: '1.0.0' });
  const transport = new StreamableHTTPClientTransport(url, { authProvider: provider });
  return { client, transport };
}

let { client, transport } = connect();
try {
  await client.connect(transport);
} catch (error) {
  if (!(error instanceof UnauthorizedError)) throw error;
  // v1's finishAuth takes the code alone (it predates the RFC 9207 `iss` check).
  await transport.finishAuth(provider.callbackParams().get('code'));
  ({ client, transport } = connect());
  await client.connect(transport);
}

const report = await exercise(client, { agentName, sdk: '@modelcontextprotocol/sdk' });
console.log(JSON.stringify({ ...report, protocol_version: transport.protocolVersion }));
await client.close();
