// E2B's npm SDKs, unmodified, against nbexec serve: only E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY are set.
// Prints one JSON object of what it saw; the Python test judges it.
import { Sandbox } from '@e2b/code-interpreter'

const seen = {}
const sandbox = await Sandbox.create({ metadata: { lang: 'ts' }, timeoutMs: 60_000 })
try {
  const out = []
  const run = await sandbox.runCode("print('from ts')\n6 * 7", { onStdout: (m) => out.push(m.line) })
  seen.text = run.text
  seen.stdout = out
  const failed = await sandbox.runCode('1/0')
  seen.error = failed.error && failed.error.name
  const info = await sandbox.getInfo()
  seen.metadata = info.metadata
  seen.state = info.state
  const listed = await Sandbox.list({ query: { metadata: { lang: 'ts' } } }).nextItems()
  seen.listed = listed.map((s) => s.sandboxId).includes(sandbox.sandboxId)
  seen.command = (await sandbox.commands.run('echo $((6*7)); pwd', { cwd: '/home/user' })).stdout
  try {
    await sandbox.commands.run('exit 3')
  } catch (err) {
    seen.exitCode = err.exitCode
  }
  await sandbox.files.write('/home/user/ts.txt', 'from ts')
  seen.file = await sandbox.files.read('/home/user/ts.txt')
  seen.listedFiles = (await sandbox.files.list('/home/user')).map((e) => e.name)
  await sandbox.setTimeout(30_000)
  seen.running = await sandbox.isRunning()
  seen.paused = await sandbox.pause()
  const again = await Sandbox.connect(sandbox.sandboxId)
  seen.afterResume = (await again.runCode('6 * 7')).text
  try {
    await Sandbox.create({ template: 'nope' })
  } catch (err) {
    seen.unknownTemplate = `${err.name}: ${err.message}`
  }
} finally {
  seen.killed = await sandbox.kill()
}
seen.killedAgain = await Sandbox.kill(sandbox.sandboxId)
console.log(JSON.stringify(seen))
