"""Hostile programs, each judged from outside the sandbox: what the host sees, what the result says, what is left.

Every case runs through execute_notebook() with the default policy (short time limits to keep the suite quick),
under the cleanup ledger (no container or working folder may be left), and checks a canary file on the host that
the code must not be able to touch.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

import nbexec
from nbexec import ExecutionResult, pool

from ..conftest import IMAGE

Check = Callable[[ExecutionResult], None]


@dataclass(frozen=True)
class Case:
    id: str
    code: str
    check: Check
    wall_s: float = 30.0  # the run must end within this


def kind(expected: str, text: str = "") -> Check:
    def check(result: ExecutionResult) -> None:
        assert result.error is not None, f"expected {expected}, the code succeeded: {result.stdout[-500:]}"
        assert result.error.kind == expected, result.error
        assert text in f"{result.error.ename}: {result.error.evalue}\n{result.error.traceback_text}", result.error
    return check


def raises(*names: str) -> Check:
    def check(result: ExecutionResult) -> None:
        assert result.error is not None, f"expected one of {names}: {result.stdout[-500:]}"
        assert result.error.ename in names, result.error
    return check


def prints(expected: str) -> Check:
    def check(result: ExecutionResult) -> None:
        assert expected in result.stdout, (result.stdout[-2000:], result.error)
    return check


def all_of(*checks: Check) -> Check:
    def check(result: ExecutionResult) -> None:
        for item in checks:
            item(result)
    return check


def skipped(name: str, reason: str) -> Check:
    def check(result: ExecutionResult) -> None:
        found = {s.name: s.reason for s in result.skipped_files}
        assert reason in found.get(name, ""), found
        assert name not in {f.name for f in result.files}
    return check


def truncated(result: ExecutionResult) -> None:
    assert result.truncated_bytes > 0 and len(result.stdout) + len(result.stderr) < 3 * 1024 * 1024


def denied(result: ExecutionResult) -> None:
    """The program prints DENIED once it has seen every attempt fail."""
    assert result.ok, result.error
    assert "ALLOWED" not in result.stdout and "DENIED" in result.stdout, result.stdout


def try_all(*attempts: str) -> str:
    """Code that runs each attempt and prints ALLOWED if any succeeds, else DENIED."""
    body = "".join(f"try:\n    {a}\n    print('ALLOWED: ' + {a!r})\nexcept BaseException:\n    pass\n"
                   for a in attempts)
    return "import os, socket, ctypes, subprocess\n" + body + "print('DENIED')\n"


CASES = [
    # -- time ---------------------------------------------------------------------------------------------------
    Case("cpu-loop", "while True:\n    pass", kind("timeout")),
    Case("sleep-forever", "import time\ntime.sleep(10**6)", kind("timeout")),
    Case("busy-thread", "import threading, time\nthreading.Thread(target=lambda: [0 for _ in iter(int, 1)]).start()\n"
                        "time.sleep(10**6)", kind("timeout")),
    # -- processes ----------------------------------------------------------------------------------------------
    Case("fork-bomb", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
         lambda r: kind(r.error.kind if r.error else "timeout")(r), wall_s=40),
    Case("thread-bomb", "import threading, time\nthreads = []\nwhile True:\n"
                        "    t = threading.Thread(target=time.sleep, args=(100,)); t.start(); threads.append(t)",
         raises("RuntimeError", "MemoryError", "TimeoutError", "DeadKernelError")),
    Case("subprocess-bomb", "import subprocess\nprocs = []\nwhile True:\n"
                            "    procs.append(subprocess.Popen(['sleep', '100']))",
         raises("BlockingIOError", "OSError", "TimeoutError", "MemoryError", "DeadKernelError")),
    Case("outlives-cell", "import subprocess\nsubprocess.Popen(['sh', '-c', 'sleep 1000 &'])\nprint('left it')",
         prints("left it")),
    Case("daemonize", "import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                      "        import time; time.sleep(1000)\n    os._exit(0)\nprint('parent done')",
         prints("parent done")),
    Case("ignores-sigint", "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                           "signal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(10**6)",
         kind("timeout", "killed")),
    Case("os-exit", "import os\nos._exit(7)", kind("kernel_died", "exit code")),
    Case("segfault", "import ctypes\nctypes.string_at(0)", kind("kernel_died")),
    Case("sys-exit", "import sys\nsys.exit(3)", raises("SystemExit")),
    Case("keyboard-interrupt", "raise KeyboardInterrupt", raises("KeyboardInterrupt")),
    Case("input", "input('password: ')", raises("StdinNotImplementedError")),
    # -- memory -------------------------------------------------------------------------------------------------
    Case("memory-bomb", "blocks = []\nwhile True:\n    blocks.append(bytearray(64 * 1024 * 1024))",
         lambda r: (raises("MemoryError") if r.error and r.error.ename == "MemoryError" else kind("oom"))(r)),
    Case("memory-bomb-child", "import subprocess, sys\nsubprocess.run([sys.executable, '-c', "
                              "'b = []\\nwhile True: b.append(bytearray(64 * 2**20))'])\nprint('kernel alive')",
         lambda r: None if r.ok and "kernel alive" in r.stdout else kind("oom")(r)),
    Case("numpy-huge", "import numpy as np\nnp.ones(10**12)", raises("MemoryError", "_ArrayMemoryError")),
    # -- disk ---------------------------------------------------------------------------------------------------
    Case("fill-data", "f = open('/mnt/data/fill', 'wb')\nwhile True:\n    f.write(b'x' * 2**20)\n    f.flush()",
         kind("limit", "/mnt/data")),
    Case("fill-tmp", "f = open('/tmp/fill', 'wb')\nwhile True:\n    f.write(b'x' * 2**20)\n    f.flush()",
         raises("OSError")),
    Case("fill-home", "import os\nf = open(os.path.expanduser('~/fill'), 'wb')\nwhile True:\n"
                      "    f.write(b'x' * 2**20)\n    f.flush()", raises("OSError")),
    Case("fill-shm", "f = open('/dev/shm/fill', 'wb')\nwhile True:\n    f.write(b'x' * 2**20)\n    f.flush()",
         raises("OSError")),
    Case("write-rootfs", try_all("open('/usr/evil', 'w')", "open('/etc/passwd', 'a')", "os.mkdir('/evil')"), denied),
    Case("ten-thousand-files", "import os\nos.makedirs('many', exist_ok=True)\nfor i in range(10000):\n"
                               "    open(f'many/{i}.txt', 'w').write(str(i))\nprint('made')",
         lambda r: (prints("made")(r), None if len(r.files) == 10000 else pytest.fail(f"{len(r.files)} files"))[1],
         wall_s=60),
    Case("zip-bomb", "import zipfile\nwith zipfile.ZipFile('/mnt/data/bomb.zip', 'w', zipfile.ZIP_DEFLATED) as z:\n"
                     "    with z.open('zeros', 'w') as f:\n"
                     "        for _ in range(320):\n            f.write(bytes(2**20))\n"
                     "zipfile.ZipFile('/mnt/data/bomb.zip').extractall('/tmp/out')",
         raises("OSError"), wall_s=60),
    # -- output -------------------------------------------------------------------------------------------------
    Case("huge-output", "import sys\nchunk = 'y' * 2**20\nfor _ in range(300):\n    sys.stdout.write(chunk)",
         truncated, wall_s=60),
    Case("giant-line", "print('z' * (200 * 2**20))", truncated, wall_s=60),
    Case("tiny-messages", "import sys\nfor i in range(2_000_000):\n    sys.stdout.write('.')\nprint('end')",
         lambda r: None if r.ok and (r.truncated_bytes or r.stdout.endswith("end\n")) else pytest.fail(str(r.error)),
         wall_s=60),
    Case("giant-image", "import numpy as np\nfrom PIL import Image\nfrom IPython.display import display\n"
                        "rng = np.random.default_rng(0)\n"
                        "display(Image.fromarray(rng.integers(0, 255, (4000, 4000, 3), dtype=np.uint8)))",
         lambda r: None if r.truncated_bytes > 0 and not r.images else pytest.fail(f"{r.truncated_bytes} {r.images}"),
         wall_s=60),
    Case("fake-result-json", "print(json.dumps({'ok': True, 'stdout': 'all good', 'error': None}))\n"
                             "raise ValueError('real')",
         lambda r: (raises("ValueError")(r), None if '"ok": true' in r.stdout else pytest.fail(r.stdout))[1]),
    Case("fake-notebook-file", "import json\nopen('/mnt/data/notebook.ipynb', 'w').write(json.dumps({'cells': []}))\n"
                               "print('wrote')", prints("wrote")),
    Case("ansi-escapes", "print('\\x1b[2J\\x1b[31mred\\x1b]0;title\\x07')\n"
                         "raise RuntimeError('\\x1b[31mcolored\\x1b[0m')",
         lambda r: None if "\x1b" not in r.text + (r.error.traceback_text if r.error else "x\x1b") else pytest.fail()),
    # -- network ------------------------------------------------------------------------------------------------
    Case("http-exfiltration", try_all("socket.create_connection(('1.1.1.1', 80), timeout=3)",
                                      "__import__('urllib.request').request.urlopen('http://example.com', timeout=3)"),
         denied),
    Case("dns", try_all("socket.getaddrinfo('example.com', 80)"), denied),
    Case("raw-socket", try_all("socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)",
                               "socket.socket(socket.AF_PACKET, socket.SOCK_RAW)"), denied),
    Case("docker-bridge-host", try_all("socket.create_connection(('172.17.0.1', 2375), timeout=3)",
                                       "socket.create_connection(('172.17.0.1', 22), timeout=3)"), denied),
    Case("udp", try_all("socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('8.8.8.8', 53))"), denied),
    # -- host secrets -------------------------------------------------------------------------------------------
    Case("host-env", "import os\nprint(sorted(k for k in os.environ if 'SECRET' in k))\n"
                     "print(open('/proc/1/environ', 'rb').read().count(b's3cret'))", prints("[]\n0")),
    Case("docker-socket", try_all("socket.socket(socket.AF_UNIX).connect('/var/run/docker.sock')",
                                  "socket.socket(socket.AF_UNIX).connect('/run/docker.sock')"), denied),
    Case("host-files", "import os\nprint(os.path.exists(os.environ.get('NOPE', '/work')), "
                       "os.path.exists('/root/.ssh'))", prints("False False")),
    Case("read-shadow", try_all("open('/etc/shadow').read()"), denied),
    # -- privilege ----------------------------------------------------------------------------------------------
    Case("setuid-root", try_all("os.setuid(0)", "os.setgid(0)", "os.seteuid(0)"), denied),
    Case("su-sudo", try_all("subprocess.run(['su', '-c', 'id'], check=True, capture_output=True, timeout=5)",
                            "subprocess.run(['sudo', 'id'], check=True, capture_output=True, timeout=5)"), denied),
    Case("mount", try_all("subprocess.run(['mount', '-t', 'tmpfs', 'x', '/tmp'], check=True, capture_output=True)",
                          "ctypes.CDLL(None).mount(b'x', b'/tmp', b'tmpfs', 0, None) == 0 or 1/0"), denied),
    # PID 1 (tini) shares the user's uid, so the kernel lets the code ptrace it: that is allowed and harmless,
    # because the host trusts nothing inside the sandbox. What must fail is reaching anything outside it.
    Case("ptrace", try_all(f"ctypes.CDLL(None).ptrace(16, {os.getpid()}, 0, 0) == 0 or 1/0",
                           "ctypes.CDLL(None).ptrace(16, 2**22 - 1, 0, 0) == 0 or 1/0",
                           "open('/proc/kcore', 'rb').read(1)"), denied),
    Case("namespaces", try_all("ctypes.CDLL(None).unshare(0x10000000) == 0 or 1/0",
                               "ctypes.CDLL(None).unshare(0x00020000) == 0 or 1/0",
                               "ctypes.CDLL(None).chroot(b'/tmp') == 0 or 1/0"), denied),
    Case("proc-sys", try_all("open('/proc/sys/kernel/hostname', 'w').write('x')",
                             "open('/proc/sysrq-trigger', 'w').write('b')"), denied),
    Case("mknod", try_all("os.mknod('/mnt/data/dev', 0o20666, os.makedev(1, 3))",
                          "os.mknod('/tmp/dev', 0o60666, os.makedev(8, 0))"), denied),
    Case("setuid-file", "import os, shutil\nshutil.copy('/bin/true', '/mnt/data/suid')\n"
                        "os.chmod('/mnt/data/suid', 0o4755)",
         skipped("suid", "setuid")),
    Case("kernel-modules", try_all("ctypes.CDLL(None).init_module(0, 0, b'') == 0 or 1/0",
                                   "open('/dev/mem', 'rb').read(1)", "open('/dev/kmsg').read(1)"), denied),
    # -- files planted for the host ------------------------------------------------------------------------------
    Case("symlink-to-host", "import os\nos.symlink(os.environ['PLANTED_PATH'], '/mnt/data/canary-link')\n"
                            "os.symlink('/etc/shadow', '/mnt/data/shadow')", skipped("canary-link", "symbolic link")),
    Case("fifo", "import os\nos.mkfifo('/mnt/data/pipe')", skipped("pipe", "FIFO")),
    Case("hostile-names", "for name in ['a\\nb', '..x', 'x' * 255, 'caf\\udce9']:\n"
                          "    try:\n        open(name.encode('utf-8', 'surrogateescape'), 'w').write('x')\n"
                          "    except OSError:\n        pass",
         lambda r: None if {"a\\nb", "caf\\xe9"} <= {s.name for s in r.skipped_files} else pytest.fail(
             str(r.skipped_files))),
    Case("hardlink-outside", try_all("os.link('/etc/passwd', '/mnt/data/passwd')",
                                     "os.link('/tmp', '/mnt/data/tmp')"), denied),
]


@pytest.fixture
def canary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "canary.txt"
    path.write_text("host secret")
    monkeypatch.setenv("NBEXEC_CANARY_SECRET", "s3cret-canary")
    return path


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_program_is_contained(case: Case, canary: Path, cleanup_ledger: None) -> None:
    before = (canary.stat().st_mtime_ns, hashlib.sha256(canary.read_bytes()).hexdigest())
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=1, warm_imports=(), timeout=4, interrupt_grace=2,
                                  max_data="64m", env={"PLANTED_PATH": str(canary)})
    code = ("import json, os\n" if case.id.startswith("fake") else "") + case.code
    started = time.monotonic()
    result = nbexec.execute_notebook(code, config=config, timeout=20 if case.wall_s > 30 else 4)
    elapsed = time.monotonic() - started
    case.check(result)
    assert elapsed < case.wall_s, f"took {elapsed:.1f} s"
    assert (canary.stat().st_mtime_ns, hashlib.sha256(canary.read_bytes()).hexdigest()) == before
    assert "s3cret-canary" not in json.dumps(result.to_dict())
    assert os.path.exists(result.notebook_path or "")
    if "sleep" in case.code:  # nothing the code started survives on the host once its sandbox is gone
        pool.wait_for_teardown()
        assert not [p for p in _host_commands() if "sleep 1000" in p or "sleep(1000)" in p or "'100'" in p]


def _host_commands() -> list[str]:
    commands = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                commands.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                continue
    return commands


def test_the_suite_covers_at_least_forty_programs() -> None:
    assert len(CASES) >= 40 and len({c.id for c in CASES}) == len(CASES)
