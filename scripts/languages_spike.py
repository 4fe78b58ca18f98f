"""Spike for issue #28: start each kernel launcher through nbexec's own, unchanged host code (Sandbox.start with
its container options, connection file, socket wait, kernel_info, lock; KernelClient.run with its deadline,
interrupt and kill), with only the container's command swapped for the launcher.

    python scripts/languages_spike.py [IMAGE]      # IMAGE built from environments/jupyter/kernels.Dockerfile

Prints one line per case. Not a test: the findings are in docs/languages-spike.md.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from nbexec.config import SandboxConfig
from nbexec.sandbox.docker import container, options

IMAGE = sys.argv[1] if len(sys.argv) > 1 else "nbexec-jupyter:kernels-spike"

# launcher, a cell that prints, a cell that raises, a cell that never ends by itself
CASES = {
    "python": ("nbexec-kernel", "print(6 * 7)", "1/0", "import time; time.sleep(100)"),
    "r": ("nbexec-kernel-r", "cat(6 * 7, '\\n')", "stop('boom')", "Sys.sleep(100)"),
    "deno": ("nbexec-kernel-deno", "console.log(6 * 7)", "throw new Error('boom')",
             "await new Promise(r => setTimeout(r, 100000))"),
    "deno-busy": ("nbexec-kernel-deno", "console.log(6 * 7)", "null.x", "while (true) {}"),
    "bash": ("nbexec-kernel-bash", "echo $((6 * 7))", "ls /nonexistent", "sleep 100"),
}


def with_launcher(launcher: str) -> None:
    made = options.container_options

    def container_options(config: SandboxConfig, role: str, place: options.Place) -> dict[str, Any]:
        opts = made(config, role, place)
        opts["command"] = [launcher, f"{options.RUNTIME_MOUNT}/kernel.json"]
        opts["labels"]["nbexec-spike"] = "1"
        return opts

    container.container_options = container_options


def run(sandbox: container.Sandbox, code: str, seconds: float) -> str:
    outputs: list[str] = []
    started = time.monotonic()
    done = sandbox.run(code, deadline=started + seconds,
                       on_output=lambda m: outputs.append(f"{m.msg_type}:{str(m.content(1 << 20))[:90]}"))
    error = f" error={done.error.ename}: {done.error.evalue[:60]!r}" if done.error else ""
    return (f"status={done.status} stop={done.stop or '-'} reply={done.reply or '-'}{error} "
            f"in {time.monotonic() - started:.2f}s outputs={outputs}")


def main() -> None:
    for name, (launcher, ok, raises, endless) in CASES.items():
        with_launcher(launcher)
        started = time.monotonic()
        sandbox = container.Sandbox.start(SandboxConfig(image=IMAGE, interrupt_grace=5.0), role="spike")
        try:
            print(f"{name}: ready in {time.monotonic() - started:.2f}s language_info={sandbox.language_info}")
            print(f"  prints: {run(sandbox, ok, 30)}")
            print(f"  raises: {run(sandbox, raises, 30)}")
            print(f"  endless, deadline 2 s: {run(sandbox, endless, 2)}")
            if sandbox.state().running:
                print(f"  after:  {run(sandbox, ok, 10)}")
            else:
                print("  after:  the sandbox was killed")
        finally:
            sandbox.destroy()


if __name__ == "__main__":
    main()
