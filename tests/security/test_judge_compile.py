"""The judge image's compilers attacked: a source whose compile eats memory without end (an #include of /dev/zero, a
template instantiation bomb), a compile that runs past its time limit (a constexpr loop), a binary larger than
/mnt/data's cap (or /tmp's), and builds that want the network (a Go module, a Rust crate). Each runs as the table
says (`nbexec.judgelangs`), in a sandbox with the default limits, and is judged from outside: the command's
outcome, the sandbox's memory cgroup read on the host (its peak and its OOM kills), the sandbox's process list
after the compile, the host's free disk, and what the cleanup ledger finds left. Real Docker, the real image."""

from __future__ import annotations

import shutil
import time

import pytest

import nbexec
from nbexec import judgelangs
from nbexec.engine.session import Session
from nbexec.files.folders import work_root

from .. import judging
from ..conftest import CONTAINER_ID, container_id
from ..judging import compile_program, run_program

pytestmark = pytest.mark.timeout(judging.TIMEOUT_S)
LANG = judgelangs.LANGUAGES

# GCC reads a file that is not a regular one until its end, doubling its buffer: /dev/zero never ends.
ENDLESS_INCLUDE = '#include "/dev/zero"\nint main(void) { return 0; }\n'
# 2^26 distinct instantiations (each T<n, m> has its own m): memory and time without end, at a depth of only 26.
TEMPLATE_BOMB = ("template <int N, int M> struct T {\n"
                 "  static const long v = T<N - 1, 2 * M>::v + T<N - 1, 2 * M + 1>::v;\n};\n"
                 "template <int M> struct T<0, M> { static const long v = 1; };\n"
                 "int main() { return T<26, 0>::v == 0; }\n")
# Each loop stays under GCC's constexpr loop limit (262144); together 10^10 steps, minutes of one core.
# Forty constant evaluations, each well under g++'s own limits (-fconstexpr-ops-limit, 2^33 operations, which one
# long loop reached within 5 s on a fast machine and ended as a compile error): together, far past 5 s anywhere.
SLOW_CONSTEXPR = ("constexpr long spin(long k) {\n  long s = 0;\n"
                  "  for (long i = 0; i < 20000; ++i)\n    for (long j = 0; j < 20000; ++j) s += i ^ j ^ k;\n"
                  "  return s;\n}\n" + "".join(f"constexpr long v{k} = spin({k});\n" for k in range(40))
                  + "int main() { return (" + " + ".join(f"v{k}" for k in range(40)) + ") & 1; }\n")
_PROCESSES = ("import os\nfor pid in os.listdir('/proc'):\n    if pid.isdigit():\n        try:\n"
              "            print(open(f'/proc/{pid}/comm').read().strip())\n        except OSError:\n            pass")
_COMPILERS = ("cc1", "cc1plus", "as", "ld", "collect2", "gcc", "g++", "go", "compile", "link", "rustc", "java")


def memory_of(session: Session) -> tuple[int, int]:
    """The sandbox's peak memory and its OOM kills, read on the host (tests/judging.py)."""
    return judging.memory_of(container_id(session.run(CONTAINER_ID).stdout))


def compilers_left(session: Session) -> list[str]:
    listing = session.run(_PROCESSES)
    assert listing.ok, listing.error
    return [name for name in listing.stdout.split() if name in _COMPILERS]


def assert_kernel_fine(session: Session) -> None:
    after = session.run("print(6 * 7)")
    assert (after.ok, after.stdout) == (True, "42\n"), after.error


def test_an_include_that_never_ends_is_killed_at_the_memory_limit(judge_config: nbexec.SandboxConfig) -> None:
    with Session(judge_config) as session:
        built, seconds = compile_program(session, LANG["c"], ENDLESS_INCLUDE, timeout=50)
        assert not built.ok and built.error is not None and built.error.kind == "exit", built.error
        assert "Killed signal terminated program cc1" in built.stderr, built.stderr[-2000:]
        peak, kills = memory_of(session)
        assert kills >= 1 and peak <= 1 << 30, (peak, kills)  # the documented default limit, 1 GiB
        assert seconds < 50 and compilers_left(session) == []
        assert_kernel_fine(session)


def test_a_template_bomb_ends_at_the_memory_or_the_time_limit(judge_config: nbexec.SandboxConfig) -> None:
    with Session(judge_config) as session:
        started = time.monotonic()
        built, _ = compile_program(session, LANG["cpp"], TEMPLATE_BOMB, timeout=30)
        elapsed = time.monotonic() - started
        assert not built.ok and built.error is not None and built.error.kind in ("exit", "timeout"), built.error
        assert elapsed < 45, f"took {elapsed:.0f} s"
        peak, _ = memory_of(session)
        assert peak <= judge_config.memory_bytes
        assert compilers_left(session) == []
        assert_kernel_fine(session)


def test_a_compile_past_its_time_limit_is_a_timeout_and_leaves_no_compiler(
        judge_config: nbexec.SandboxConfig) -> None:
    with Session(judge_config) as session:
        started = time.monotonic()
        built, _ = compile_program(session, LANG["cpp"], SLOW_CONSTEXPR, timeout=5)
        elapsed = time.monotonic() - started
        assert not built.ok and built.error is not None and built.error.kind == "timeout", built.error
        assert built.exit_code is None and elapsed < 15, f"took {elapsed:.0f} s"
        assert compilers_left(session) == []
        assert_kernel_fine(session)


@pytest.mark.parametrize(("max_data", "megabytes", "full"), [
    pytest.param("64m", 160, "/mnt/data", id="binary-past-mnt-data"),
    pytest.param("1g", 1000, "/tmp", id="object-past-tmp"),
])
def test_a_huge_binary_fails_the_compile_at_its_filesystems_cap(max_data: str, megabytes: int, full: str,
                                                                judge_config: nbexec.SandboxConfig) -> None:
    """The array is initialised and global (the compiler may drop neither), so the object file and the binary hold
    all of it: the object goes to /tmp (256 MiB), the binary to /mnt/data. Whichever is past its cap fails the
    compile with ENOSPC, and nothing of it stays."""
    source = f"char big[{megabytes}L << 20] = {{1}};\nint main(void) {{ return big[4096]; }}\n"
    free_before = shutil.disk_usage(work_root()).free
    with Session(judge_config.replace(max_data=max_data)) as session:
        built, _ = compile_program(session, LANG["c"], source, timeout=120)
        assert not built.ok and built.error is not None and built.error.kind == "exit", built.error
        full_line = next((line for line in built.stderr.splitlines() if "No space left on device" in line), "")
        # The assembler names its object in /tmp; the linker writes the binary into /mnt/data.
        assert ("/tmp/" in full_line) if full == "/tmp" else ("final link failed" in full_line), built.stderr[-2000:]
        used = session.shell("du -sm /tmp /mnt/data | cut -f1")
        tmp_mb, data_mb = (int(n) for n in used.stdout.split())
        assert tmp_mb < 8, f"{tmp_mb} MiB of the failed compile's files left in /tmp"
        assert data_mb <= judge_config.replace(max_data=max_data).max_data_bytes >> 20
        assert compilers_left(session) == []
        assert_kernel_fine(session)
    assert shutil.disk_usage(work_root()).free > free_before - (256 << 20), "the host's disk lost space"


GO_MOD = "module judged\n\ngo 1.19\n\nrequire github.com/google/uuid v1.3.0\n"
GO_SUM = ("github.com/google/uuid v1.3.0 h1:t6JiXgmwXMjEs8VusXIJk2BXHsn+wx8BZdTaoZ5fu7I=\n"
          "github.com/google/uuid v1.3.0/go.mod h1:TIyPZe4MgqvfeYDBFedMoGGpEw/LqOeaOT+nhxU+yHo=\n")
GO_IMPORT = ('package main\n\nimport (\n\t"fmt"\n\n\t"github.com/google/uuid"\n)\n\n'
             "func main() { fmt.Println(uuid.New()) }\n")


@pytest.mark.parametrize("with_module", [False, True], ids=["no-go-mod", "go-mod-asks-for-it"])
def test_a_go_build_that_wants_a_module_fails_at_once_without_the_network(
        with_module: bool, judge_config: nbexec.SandboxConfig) -> None:
    """With a go.mod that requires the module (and its go.sum), go would fetch it: GOPROXY=off says no before any
    network is tried, so the failure is the table's choice, not a lookup that the missing network happened to end."""
    with Session(judge_config) as session:
        if with_module:
            session.upload(GO_MOD.encode(), "go.mod")
            session.upload(GO_SUM.encode(), "go.sum")
        built, seconds = compile_program(session, LANG["go"], GO_IMPORT, timeout=60)
        assert not built.ok and built.error is not None and built.error.kind == "exit", built.error
        assert "github.com/google/uuid" in built.stderr and seconds < 20, (seconds, built.stderr)
        if with_module:
            assert "module lookup disabled by GOPROXY=off" in built.stderr, built.stderr
        assert "proxy.golang.org" not in built.stderr and "dial tcp" not in built.stderr, built.stderr
        assert compilers_left(session) == []


def test_a_rust_crate_from_outside_is_a_compile_error(judge_config: nbexec.SandboxConfig) -> None:
    source = "extern crate rand;\nuse rand::Rng;\nfn main() { println!(\"{}\", rand::thread_rng().gen::<u8>()); }\n"
    with Session(judge_config) as session:
        built, seconds = compile_program(session, LANG["rust"], source, timeout=60)
        assert not built.ok and built.error is not None and built.error.kind == "exit", built.error
        assert "can't find crate for `rand`" in built.stderr and seconds < 30, (seconds, built.stderr)


def test_a_compiled_program_that_dials_out_fails_at_once(judge_config: nbexec.SandboxConfig) -> None:
    source = ('package main\n\nimport (\n\t"fmt"\n\t"net"\n\t"time"\n)\n\nfunc main() {\n'
              '\t_, err := net.DialTimeout("tcp", "1.1.1.1:80", 20*time.Second)\n\tfmt.Println("dial:", err)\n}\n')
    with Session(judge_config) as session:
        built, _ = compile_program(session, LANG["go"], source)
        assert built.ok, built.stderr
        started = time.monotonic()
        ran = run_program(session, LANG["go"])
        assert ran.ok and "network is unreachable" in ran.stdout, ran.stdout
        assert time.monotonic() - started < 10
