// @modelcontextprotocol/client 2.x against a ToastMachine MCP node, pinned to protocol 2026-07-28.
// OAuth through the SDK's own flow (lib/provider.mjs approves the consent page), then: list the tools,
// read the guide (which onboards the agent), call `whoami` (read), take an operation token and call
// `create_conversation` (write) twice with it, as a client retrying after a lost answer would, and
// read the conversation back. Prints one JSON object on stdout for tests/test_mcp_node.py.
import { Client, StreamableHTTPClientTransport, UnauthorizedError } from '@modelcontextprotocol/client';

import { ConsentingProvider, args, structured } from './lib/provider.mjs';

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

const tools = (await client.listTools()).tools;
await client.readResource({ uri: 'toastmachine://guide' });
const whoami = structured('whoami', await client.callTool({ name: 'whoami', arguments: {} }));
const { operation_token: operationToken } = structured(
  'get_operation_token', await client.callTool({ name: 'get_operation_token', arguments: {} }));
const write = { subject: `Written by ${agentName}`, content: 'hello from Node (MCP SDK v2)',
  operation_token: operationToken };
const created = structured('create_conversation',
  await client.callTool({ name: 'create_conversation', arguments: write }));
const retried = structured('create_conversation',
  await client.callTool({ name: 'create_conversation', arguments: write }));
const readBack = structured('get_conversation', await client.callTool({
  name: 'get_conversation', arguments: { conversation_id: created.conversation.id } }));

console.log(JSON.stringify({
  sdk: '@modelcontextprotocol/client',
  protocol_version: client.getNegotiatedProtocolVersion(),
  server: client.getServerVersion(),
  tools: tools.map((t) => t.name),
  whoami,
  created,
  retried,
  read_back: readBack,
}));
await client.close();
