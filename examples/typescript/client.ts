// Run Python through an nbexec service with Node's built-in fetch (Node 18+), no packages.
//
//   npm install --no-save typescript@5.9 @types/node@20 && \
//     npx tsc client.ts --target es2022 --module nodenext --types node --outDir build && \
//     NBEXEC_URL=http://127.0.0.1:8080 NBEXEC_TOKEN=... node build/client.js
//
// (@types/node declares `process`; without it tsc stops at "Cannot find name 'process'".)
//
// It runs one-shot code, then keeps state in a session, uploads a file, runs code that reads it, downloads the
// result, and deletes the session.

interface CellError { ename: string; evalue: string; traceback: string[]; kind: string }
interface FileEntry { name: string; size: number; mime: string; sha256: string; url: string | null }
interface ExecutionResult { ok: boolean; stdout: string; text: string; error: CellError | null; files: FileEntry[] }

const base = process.env.NBEXEC_URL ?? "http://127.0.0.1:8080";
const headers = { Authorization: `Bearer ${process.env.NBEXEC_TOKEN ?? ""}`, "Content-Type": "application/json" };

async function call<T>(method: string, path: string, body?: unknown): Promise<T> {
  const response = await fetch(base + path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  if (!response.ok) throw new Error(`${method} ${path}: HTTP ${response.status} ${await response.text()}`);
  return (response.status === 204 ? undefined : await response.json()) as T;
}

async function main(): Promise<void> {
  const once = await call<ExecutionResult>("POST", "/v1/execute", { code: "print(sum(range(101)))" });
  console.log(`one-shot: ok=${once.ok} stdout=${once.stdout.trim()}`);

  const session = await call<{ id: string }>("POST", "/v1/sessions");
  await call<ExecutionResult>("POST", `/v1/sessions/${session.id}/execute`, { code: "total = 41" });
  const upload = await fetch(`${base}/v1/sessions/${session.id}/files/input.csv`, {
    method: "PUT", headers: { Authorization: headers.Authorization }, body: "a,b\n1,2\n3,4\n",
  });
  if (!upload.ok) throw new Error(`upload failed: HTTP ${upload.status}`);
  const run = await call<ExecutionResult>("POST", `/v1/sessions/${session.id}/execute`, {
    code: "import pandas as pd\ndf = pd.read_csv('input.csv')\nprint(total + len(df))\ndf.sum().to_csv('sums.csv')",
  });
  console.log(`session: ok=${run.ok} stdout=${run.stdout.trim()} files=${run.files.map((f) => f.name).join(",")}`);
  const sums = await fetch(`${base}/v1/sessions/${session.id}/files/sums.csv`, { headers });
  console.log(`download: ${(await sums.text()).trim().replace(/\n/g, " | ")}`);
  const failing = await call<ExecutionResult>("POST", `/v1/sessions/${session.id}/execute`, { code: "1/0" });
  console.log(`error: ${failing.error?.ename}: ${failing.error?.evalue}`);
  await call<void>("DELETE", `/v1/sessions/${session.id}`);
  console.log("session deleted");
}

main().catch((error: unknown) => {
  console.error(error);
  process.exit(1);
});
