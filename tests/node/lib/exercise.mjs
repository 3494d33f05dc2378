// What each Node client does once connected, with either SDK's Client (their call shapes agree):
// list the tools, read the guide (which onboards the agent), call `whoami` (read), take an operation
// token and call `create_conversation` (write) twice with it, as a client retrying after a lost answer
// would, and read the conversation back. Returns the report the client script prints.

/** The structured content of a successful tool result; throws with the result otherwise. */
async function call(client, name, args = {}) {
  const result = await client.callTool({ name, arguments: args });
  if (result.isError || !result.structuredContent) {
    throw new Error(`${name} failed: ${JSON.stringify(result)}`);
  }
  return result.structuredContent;
}

export async function exercise(client, { agentName, sdk }) {
  const tools = (await client.listTools()).tools;
  await client.readResource({ uri: 'toastmachine://guide' });
  const whoami = await call(client, 'whoami');
  const { operation_token: operationToken } = await call(client, 'get_operation_token');
  const write = { subject: `Written by ${agentName}`, content: `hello from Node (${sdk})`,
    operation_token: operationToken };
  const created = await call(client, 'create_conversation', write);
  const retried = await call(client, 'create_conversation', write);
  const readBack = await call(client, 'get_conversation', { conversation_id: created.conversation.id });
  return {
    sdk,
    server: client.getServerVersion(),
    tools: tools.map((t) => t.name),
    whoami,
    created,
    retried,
    read_back: readBack,
  };
}
