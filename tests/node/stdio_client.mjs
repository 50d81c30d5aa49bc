// The official TypeScript MCP client (@modelcontextprotocol/sdk) over stdio, driven from
// tests/e2e/test_stdio_front.py: it launches `envelope-proxy stdio ...` as its server command.
// Usage: node stdio_client.mjs '<json {"command", "args", "env"}>' '<json list of [tool, arguments]>'
// Declares elicitation and accepts every question (approval questions with approve: true).
// Prints one JSON object on stdout:
// {"tools": [names], "calls": [{"tool", "isError", "text"} | {"tool", "error": {code, message}}],
//  "elicitations": [messages], "stderr": "<the proxy's stderr>"}
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";
import { ElicitRequestSchema } from "@modelcontextprotocol/sdk/types.js";

const [serverJson, callsJson] = process.argv.slice(2);
const server = JSON.parse(serverJson);
const calls = JSON.parse(callsJson || "[]");
const transport = new StdioClientTransport({ ...server, stderr: "pipe" });
let stderr = "";
transport.stderr?.on("data", (chunk) => { stderr += chunk.toString(); });
const client = new Client({ name: "envelope-ts-stdio-test", version: "0.0.0" },
                          { capabilities: { elicitation: {} } });
const elicitations = [];
client.setRequestHandler(ElicitRequestSchema, async (request) => {
  elicitations.push(request.params.message);
  const wantsApproval = JSON.stringify(request.params.requestedSchema ?? {}).includes("approve");
  return { action: "accept", content: wantsApproval ? { approve: true } : { answer: "ts" } };
});
await client.connect(transport);
const out = { tools: (await client.listTools()).tools.map((t) => t.name), calls: [] };
for (const [tool, args] of calls) {
  try {
    const r = await client.callTool({ name: tool, arguments: args });
    out.calls.push({ tool, isError: r.isError ?? false, text: r.content?.[0]?.text ?? null });
  } catch (e) {
    out.calls.push({ tool, error: { code: e.code ?? null, message: String(e.message ?? e) } });
  }
}
await client.close();
out.elicitations = elicitations;
out.stderr = stderr;
process.stdout.write(JSON.stringify(out) + "\n");
