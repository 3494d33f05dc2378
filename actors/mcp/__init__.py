"""The MCP front: an MCP server (official ``mcp`` SDK, Streamable HTTP) with its own OAuth 2.1
authorization server, served as ASGI by uvicorn (issue #10)."""
