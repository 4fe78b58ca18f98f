"""The E2B door against nbexec's own API, side by side in one run, through a real `nbexec serve` on loopback:

    .venv/bin/python benchmarks/e2bdoor.py [--samples 30]

Rows: a sandbox from the warm pool (E2B's `Sandbox.create()`, nbexec's `POST /v1/sandboxes`), a cell
(`run_code("print(1)")`, `POST /v1/sessions/{id}/execute`), and a command (`commands.run("echo hi")`, and the
same through a session cell with `subprocess`). The pool is refilled before each create sample, which is how a
tool call meets it. Prints a Markdown table (docs/benchmark.md keeps the last one)."""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Callable

import httpx
import uvicorn
from run import percentile, timed, wait_pool_ready

import nbexec
from nbexec.service.server import create_app
from nbexec.service.settings import ServerSettings

TOKEN = "benchmark-token-" + "b" * 24
PORT = 8799


def serve(config: nbexec.SandboxConfig) -> uvicorn.Server:
    app = create_app(ServerSettings(config=config, tokens=(TOKEN,), max_sessions_per_token=64,
                                    max_running_per_token=4))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=PORT, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=30)
    args = parser.parse_args()
    config = nbexec.SandboxConfig(pool_size=2, warm_imports=())
    server = serve(config)
    url = f"http://127.0.0.1:{PORT}"
    os.environ.update(E2B_API_URL=f"{url}/e2b", E2B_SANDBOX_URL=f"{url}/e2b/sandbox", E2B_API_KEY=TOKEN)
    from e2b_code_interpreter import Sandbox

    own = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    made: list[Callable[[], object]] = []
    rows: list[tuple[str, str, list[float]]] = []

    def e2b_create() -> None:
        sandbox = Sandbox.create()
        made.append(sandbox.kill)

    def own_create() -> None:
        sandbox = own.post("/v1/sandboxes", json={}).json()["id"]
        made.append(lambda: own.delete(f"/v1/sandboxes/{sandbox}"))

    def cleanup() -> None:
        while made:
            made.pop()()

    ready = wait_pool_ready(config)
    for name, create in (("E2B door: Sandbox.create()", e2b_create), ("nbexec: POST /v1/sandboxes", own_create)):
        rows.append(("sandbox from the warm pool", name, timed(create, args.samples,
                                                               lambda: (cleanup(), ready()))))
    cleanup()
    sandbox = Sandbox.create(timeout=600)
    session = own.post("/v1/sessions", json={}).json()["id"]
    own.post(f"/v1/sessions/{session}/execute", json={"code": "import subprocess"})
    sandbox.run_code("1")
    sandbox.commands.run("true")
    for label, func in (
            ("E2B door: run_code", lambda: sandbox.run_code("print(1)")),
            ("nbexec: session execute", lambda: own.post(f"/v1/sessions/{session}/execute",
                                                         json={"code": "print(1)"}))):
        rows.append(("print(1)", label, timed(func, args.samples)))
    for label, func in (
            ("E2B door: commands.run", lambda: sandbox.commands.run("echo hi")),
            ("nbexec: session execute (subprocess)", lambda: own.post(
                f"/v1/sessions/{session}/execute",
                json={"code": "subprocess.run(['echo', 'hi'])"}))):
        rows.append(("echo hi", label, timed(func, args.samples)))
    sandbox.kill()
    own.delete(f"/v1/sessions/{session}")
    print("| workload | door | p50 | p90 |\n|---|---|---|---|")
    for workload, door, times in rows:
        print(f"| {workload} | {door} | {percentile(times, 0.5) * 1000:.1f} ms | "
              f"{percentile(times, 0.9) * 1000:.1f} ms |")
    server.should_exit = True


if __name__ == "__main__":
    main()
