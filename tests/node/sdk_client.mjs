// The official TypeScript MCP client (@modelcontextprotocol/sdk) driven from tests/e2e/test_real_clients.py.
// Usage: node sdk_client.mjs <url> '<json list of [tool, arguments]>'
// Env: MCP_BEARER (optional bearer token). Prints one JSON object on stdout:
// {"protocolVersion", "tools": [names], "calls": [{"tool", "isError", "text", "meta"} | {"tool", "error": {code, message}}]}
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

const [url, callsJson] = process.argv.slice(2);
const calls = JSON.parse(callsJson || "[]");
const headers = process.env.MCP_BEARER ? { Authorization: `Bearer ${process.env.MCP_BEARER}` } : {};
const transport = new StreamableHTTPClientTransport(new URL(url), { requestInit: { headers } });
const client = new Client({ name: "envelope-ts-test", version: "0.0.0" });
await client.connect(transport);
const out = { protocolVersion: transport.protocolVersion ?? null, sessionId: transport.sessionId ?? null };
out.tools = (await client.listTools()).tools.map((t) => t.name);
out.calls = [];
for (const [tool, args] of calls) {
  try {
    const r = await client.callTool({ name: tool, arguments: args });
    out.calls.push({
      tool,
      isError: r.isError ?? false,
      text: r.content?.[0]?.text ?? null,
      meta: r._meta ?? null,
    });
  } catch (e) {
    out.calls.push({ tool, error: { code: e.code ?? null, message: String(e.message ?? e) } });
  }
}
await transport.terminateSession().catch(() => {});
await client.close();
process.stdout.write(JSON.stringify(out) + "\n");
