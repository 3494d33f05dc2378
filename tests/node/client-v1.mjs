// @modelcontextprotocol/sdk 1.x against a ToastMachine MCP node: the 2025-11-25 initialize handshake.
// The same steps as client-v2.mjs (OAuth through the SDK's own flow, list tools, read the guide, call
// `whoami`, `create_conversation` twice with one operation token, read back); one JSON object on stdout.
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { UnauthorizedError } from '@modelcontextprotocol/sdk/client/auth.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';

import { ConsentingProvider, args, structured } from './lib/provider.mjs';

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
  await transport.finishAuth(provider.callbackParams().get('code'));
  ({ client, transport } = connect());
  await client.connect(transport);
}

const tools = (await client.listTools()).tools;
await client.readResource({ uri: 'toastmachine://guide' });
const whoami = structured('whoami', await client.callTool({ name: 'whoami', arguments: {} }));
const { operation_token: operationToken } = structured(
  'get_operation_token', await client.callTool({ name: 'get_operation_token', arguments: {} }));
const write = { subject: `Written by ${agentName}`, content: 'hello from Node (MCP SDK v1)',
  operation_token: operationToken };
const created = structured('create_conversation',
  await client.callTool({ name: 'create_conversation', arguments: write }));
const retried = structured('create_conversation',
  await client.callTool({ name: 'create_conversation', arguments: write }));
const readBack = structured('get_conversation', await client.callTool({
  name: 'get_conversation', arguments: { conversation_id: created.conversation.id } }));

console.log(JSON.stringify({
  sdk: '@modelcontextprotocol/sdk',
  protocol_version: transport.protocolVersion,
  server: client.getServerVersion(),
  tools: tools.map((t) => t.name),
  whoami,
  created,
  retried,
  read_back: readBack,
}));
await client.close();
