"""The in-sandbox process supervisor and its host client (`nbexec.sandbox.docker.supervisor`), on real sandboxes
under runc and runsc: processes that stream, take stdin and signals, a pty, file operations as the sandbox user,
and the attacks on the door: output floods, a supervisor killed or replaced by the sandbox's code, frames that lie
about their size, a thousand spawns. The host's side is judged from outside: wall time, its memory, what is left.
"""

from __future__ import annotations

import json
import signal
import struct
import textwrap
import threading
import time
import tracemalloc
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

import nbexec
from nbexec.sandbox.docker import pool
from nbexec.sandbox.docker.container import Sandbox
from nbexec.sandbox.docker.supervisor import (
    MAX_PROCESSES,
    BadArgumentError,
    End,
    FsEvent,
    IsDirectoryError,
    LimitError,
    NotFoundError,
    Output,
    PermissionDeniedError,
    ProcessNotFoundError,
    Started,
    Subscription,
    Supervisor,
    SupervisorLostError,
    TooLargeError,
    wire,
)
from nbexec.sandbox.docker.supervisor.events import SUBSCRIBER_BYTES, SUBSCRIBER_EVENTS, Demux, Violation

RUNTIMES = ("runc", "runsc")
FLOOD = ["python3", "-c", "import sys\nb = b'x' * 65536\nwhile True:\n    sys.stdout.buffer.write(b)"]


@pytest.fixture(params=RUNTIMES)
def sandbox(request: pytest.FixtureRequest, cold: nbexec.SandboxConfig) -> Iterator[Sandbox]:
    config = cold.replace(runtime=request.param, warm_imports=(), max_data="16m")
    box = pool.start_sandbox(config, role="oneshot", warm_up=False)
    try:
        yield box
    finally:
        box.destroy()


@pytest.fixture
def runc_sandbox(cold: nbexec.SandboxConfig) -> Iterator[Sandbox]:
    box = pool.start_sandbox(cold.replace(warm_imports=(), max_data="16m"), role="oneshot", warm_up=False)
    try:
        yield box
    finally:
        box.destroy()


@pytest.fixture
def sup(sandbox: Sandbox) -> Iterator[Supervisor]:
    supervisor = Supervisor.start(sandbox)
    yield supervisor
    supervisor.close()


def drain(sub: Subscription, timeout: float = 30) -> tuple[dict[str, bytes], End]:
    """Everything a subscription yields until its end."""
    out: dict[str, bytes] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        event = sub.next(1)
        if isinstance(event, Output):
            out[event.stream] = out.get(event.stream, b"") + event.data
        elif isinstance(event, End):
            return out, event
    raise AssertionError(f"no end within {timeout} s; got {out}")


def run(sup: Supervisor, script: str) -> tuple[dict[str, bytes], End]:
    return drain(sup.spawn(["/bin/sh", "-c", script]))


# -- processes -------------------------------------------------------------------------------------------------


def test_a_command_streams_and_ends_with_its_code(sup: Supervisor) -> None:
    sub = sup.spawn(["/bin/bash", "-l", "-c", "echo out; echo err >&2; echo $GREETING; pwd; exit 3"],
                    cwd="/tmp", envs={"GREETING": "hello"})
    assert sub.next(5) == Started(sub.pid)
    out, end = drain(sub)
    assert out == {"stdout": b"out\nhello\n/tmp\n", "stderr": b"err\n"}
    assert end == End(3, True, "exit status 3", None)


def test_stdin_is_sent_and_closed(sup: Supervisor) -> None:
    sub = sup.spawn(["cat"], stdin=True)
    sup.send_input(sub.pid, b"one\n")
    sup.send_input(sub.pid, b"two\n")
    sup.close_stdin(sub.pid)
    out, end = drain(sub)
    assert (out, end.exit_code) == ({"stdout": b"one\ntwo\n"}, 0)
    with pytest.raises(ProcessNotFoundError):
        sup.send_input(sub.pid, b"late")


def test_a_process_outlives_its_subscribers_and_is_listed_and_signalled(sup: Supervisor) -> None:
    first = sup.spawn(["sleep", "100"], tag="server")
    first.close()
    listed = sup.processes()
    assert listed == [{"pid": first.pid, "tag": "server", "cmd": "sleep", "args": ["100"], "envs": {},
                       "cwd": "/mnt/data"}]
    again = sup.subscribe(first.pid)
    assert again.next(1) == Started(first.pid)
    with pytest.raises(BadArgumentError):
        sup.signal(first.pid, signal.SIGHUP)  # only SIGTERM, SIGKILL and SIGINT (a kernel's interrupt)
    sup.signal(first.pid, signal.SIGTERM)
    assert drain(again)[1] == End(-1, False, "signal: terminated", None)
    assert sup.processes() == []
    for call in (lambda: sup.signal(first.pid, signal.SIGKILL), lambda: sup.subscribe(first.pid),
                 lambda: sup.signal(1, signal.SIGKILL)):  # not ours: the kernel's pid stays unreachable
        with pytest.raises(ProcessNotFoundError):
            call()


def test_a_timeout_kills_the_whole_process_group(sup: Supervisor) -> None:
    started = time.monotonic()
    out, end = drain(sup.spawn(["/bin/sh", "-c", "sleep 100 & echo $!; sleep 100"], timeout=1))
    assert time.monotonic() - started < 15
    assert (end.exited, end.status) == (False, "signal: killed") and end.error
    child = out["stdout"].decode().strip()
    assert run(sup, f"kill -0 {child} 2>/dev/null && echo alive || echo gone")[0]["stdout"] == b"gone\n"


def test_many_subscribers_each_see_the_output(sup: Supervisor) -> None:
    sub = sup.spawn(["/bin/sh", "-c", "read x; echo got $x"], stdin=True)
    other = sup.subscribe(sub.pid)
    sup.send_input(sub.pid, b"it\n")
    assert drain(sub)[0] == drain(other)[0] == {"stdout": b"got it\n"}


# -- attacks on the processes door -----------------------------------------------------------------------------


def test_a_process_printing_forever_keeps_host_memory_flat(sup: Supervisor) -> None:
    """Before: no supervisor. After: an idle subscriber holds at most SUBSCRIBER_BYTES, the rest is counted."""
    tracemalloc.start()
    try:
        sub = sup.spawn(FLOOD)
        deadline = time.monotonic() + 120
        while sub.lost < 64 << 20 and time.monotonic() < deadline:
            time.sleep(0.2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sub.lost >= 64 << 20, f"the flood dropped only {sub.lost} bytes in 120 s"
    assert peak < 3 * SUBSCRIBER_BYTES, f"the host held {peak} bytes for an idle subscriber"
    # Closed, it takes no more: what it holds is what it had queued.
    sub.close()
    kept = 0
    while isinstance(event := sub.next(0), (Started, Output)):
        kept += len(event.data) if isinstance(event, Output) else 0
    assert kept <= SUBSCRIBER_BYTES
    # Nobody subscribed: the supervisor drops the output in the sandbox and the host receives nothing of it.
    time.sleep(0.5)
    before = sup.received_bytes
    time.sleep(2)
    assert sup.received_bytes - before < 1 << 20
    sup.signal(sub.pid, signal.SIGKILL)


def test_sandbox_code_that_kills_the_supervisor_loses_it_for_every_waiter(sup: Supervisor,
                                                                         sandbox: Sandbox) -> None:
    """Before: no supervisor. After: a subscriber mid-stream and a caller blocked in a request both get
    SupervisorLostError within a second or two, and a fresh supervisor starts."""
    streaming = sup.spawn(["/bin/sh", "-c", "while true; do echo tick; sleep 0.05; done"])
    assert isinstance(streaming.next(5), Started) and isinstance(streaming.next(5), Output)
    raised: list[BaseException] = []
    blocked = threading.Thread(target=lambda: _catch(raised, lambda: drain(sup.spawn(["sleep", "100"]), 60)))
    blocked.start()
    time.sleep(0.5)
    killer = sup.spawn(["/bin/sh", "-c", "sleep 0.5; kill -9 $PPID"])
    started = time.monotonic()
    with pytest.raises(SupervisorLostError):
        while time.monotonic() - started < 30:
            streaming.next(1)
    assert time.monotonic() - started < 3
    blocked.join(10)
    assert not blocked.is_alive() and isinstance(raised[0], SupervisorLostError)
    with pytest.raises(SupervisorLostError):
        for _ in range(5):
            killer.next(1)
    with pytest.raises(SupervisorLostError):
        sup.processes()
    fresh = Supervisor.start(sandbox)
    try:
        assert run(fresh, "echo back")[0] == {"stdout": b"back\n"}
    finally:
        fresh.close()


def _catch(into: list[BaseException], call: object) -> None:
    try:
        call()  # type: ignore[operator]
    except BaseException as exc:  # handed to the test thread
        into.append(exc)


def test_sandbox_code_writing_into_the_supervisors_stream(sup: Supervisor, sandbox: Sandbox) -> None:
    """The supervisor is not dumpable: under runc the same user cannot open its stdout through /proc to forge
    frames. gVisor does not honour that bit, so there the forged bytes arrive: the host takes them as the hostile
    input they are (the supervisor is lost at once, nothing hangs), and a fresh one starts."""
    script = "echo forged > /proc/$PPID/fd/1 && echo wrote || echo refused"
    if sandbox.config.runtime == "runc":
        assert run(sup, script)[0]["stdout"] == b"refused\n"
        assert sup.processes() == []  # and the door still works
        return
    started = time.monotonic()
    with pytest.raises(SupervisorLostError, match="broke the protocol"):
        run(sup, script)
    assert time.monotonic() - started < 5
    fresh = Supervisor.start(sandbox)
    try:
        assert run(fresh, "echo back")[0] == {"stdout": b"back\n"}
    finally:
        fresh.close()


def test_a_thousand_spawns_meet_the_cap_and_close_kills_them_all(runc_sandbox: Sandbox) -> None:
    sup = Supervisor.start(runc_sandbox)
    refused = 0
    try:
        for _ in range(1000):
            try:
                sup.spawn(["sleep", "100"]).close()
            except LimitError:
                refused += 1
        assert (refused, len(sup.processes())) == (1000 - MAX_PROCESSES, MAX_PROCESSES)
    finally:
        sup.close()
    check = Supervisor.start(runc_sandbox)
    try:
        script = "for p in /proc/[0-9]*; do cat $p/cmdline 2>/dev/null | tr '\\0' ' '; echo; done | grep -c '^sleep'"
        deadline = time.monotonic() + 20
        while run(check, script)[0].get("stdout") != b"0\n":
            assert time.monotonic() < deadline, "closing the supervisor left its processes running"
            time.sleep(0.2)
        for _ in range(100):  # short ones end and free their slots
            assert drain(check.spawn(["true"]))[1].exit_code == 0
    finally:
        check.close()


@pytest.mark.parametrize("bad", [
    {"argv": []}, {"argv": ["a\0b"]}, {"argv": ["x" * 70_000]}, {"argv": ["true"], "envs": {"A=B": "c"}},
    {"argv": ["true"], "envs": {f"V{i}": "x" for i in range(300)}}, {"argv": ["true"], "pty": (0, 24)},
    {"argv": ["true"], "pty": (80, 1001)}, {"argv": ["true"], "cwd": "/" + "d" * 5000},
], ids=["empty", "nul", "long-arg", "env-name", "env-count", "pty-zero", "pty-huge", "long-cwd"])
def test_spawn_refuses_bad_requests_before_they_reach_the_sandbox(bad: dict[str, object],
                                                                 runc_sandbox: Sandbox) -> None:
    sup = Supervisor.start(runc_sandbox)
    try:
        with pytest.raises(BadArgumentError):
            sup.spawn(**bad)  # type: ignore[arg-type]
        with pytest.raises(NotFoundError):
            sup.spawn(["/no/such/program"])
        with pytest.raises(TooLargeError):
            sup.send_input(sup.spawn(["cat"], stdin=True).pid, b"x" * (2 << 20))
    finally:
        sup.close()


# -- a supervisor replaced by hostile code ---------------------------------------------------------------------

HOSTILE = textwrap.dedent("""\
    import json, os, struct, sys, time
    def frame(head, data=b''):
        text = json.dumps(head).encode()
        os.write(1, struct.pack('>II', len(text), len(data)) + text + data)
    frame({'ev': 'ready'})
    sys.stdin.buffer.read(8)
    """)


PORT_UP = "frame({'id': 1, 'conn': 1}); frame({'ev': 'port', 'conn': 1, 'up': True}); "  # a relay, connected


@pytest.mark.parametrize(("answer", "call"), [
    ("os.write(1, struct.pack('>II', 2**31, 0))", "processes"),
    ("os.write(1, struct.pack('>II', 2, 2**30) + b'{}')", "processes"),
    ("os.write(1, struct.pack('>II', 3, 0) + b'{{{')", "processes"),
    ("os.write(1, struct.pack('>II', 3, 0) + b'[1]')", "processes"),
    ("frame({'id': 1, 'processes': 'x'})", "processes"),
    ("frame({'id': 1, 'pid': 'x'})", "spawn"),
    ("frame({'id': 1, 'entry': {'name': 1}})", "stat"),
    ("frame({'id': 1, 'handle': 1, 'size': 5}); sys.stdin.buffer.read(99); frame({'id': 2}, b'y' * 999999)", "read"),
    ("frame({'ev': 'end', 'pid': 1, 'exit_code': 'x'})", "processes"),
    ("frame({'ev': 'out', 'pid': [1], 'fd': 'stdout'})", "processes"),
    ("sys.exit(0)", "processes"),
    ("time.sleep(60)", "processes"),
    ("\nwhile True:\n    frame({'id': 12345}, b'z' * 1000000)", "processes"),
    (PORT_UP + f"frame({{'ev': 'port', 'conn': 1}}, b'p' * {wire.PORT_WINDOW + 1})", "port"),
    (PORT_UP + "frame({'ev': 'port', 'conn': 1, 'took': 5})", "port"),
    ("frame({'id': 1, 'conn': 1}); frame({'ev': 'port', 'conn': 1}, b'p')", "port"),
], ids=["length-2**31", "data-over-cap", "not-json", "not-object", "bad-process", "bad-pid", "bad-entry",
        "more-than-size", "bad-end", "unhashable-pid", "exits", "silent", "flood", "port-past-its-window",
        "port-took-more-than-sent", "port-data-before-up"])
def test_a_hostile_supervisor_is_lost_at_bounded_cost(answer: str, call: str, runc_sandbox: Sandbox) -> None:
    """Before: no supervisor. After: every lie ends the call with SupervisorLostError at once (silence and a
    flood of answers to nothing: at the request deadline, 2 s here), the host's memory bounded by one frame."""
    sup = Supervisor.start(runc_sandbox, program=HOSTILE + answer + "\ntime.sleep(60)\n")
    sup.request_timeout = 2 if answer.startswith(("time.sleep", "\nwhile")) else 60
    calls = {"processes": sup.processes, "spawn": lambda: sup.spawn(["true"]), "stat": lambda: sup.files.stat("/"),
             "read": lambda: list(sup.files.read_file("/etc/hostname", max_bytes=100)),
             "port": lambda: _relay_until_lost(sup)}
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(SupervisorLostError):
            calls[call]()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        sup.close()
    assert time.monotonic() - started < 10
    assert peak < 8 << 20, f"the host held {peak} bytes"


def _relay_until_lost(sup: Supervisor) -> None:
    """Open a relay and take from it until it fails (or 5 s pass)."""
    relay = sup.ports.open(8000)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        relay.wait(1)
        relay.poll()


# A supervisor that starts whatever it is asked, with no cap of its own.
OBLIGING = textwrap.dedent("""\
    import json, os, struct, sys
    def frame(head):
        text = json.dumps(head).encode()
        os.write(1, struct.pack('>II', len(text), 0) + text)
    frame({'ev': 'ready'})
    pid = 100
    while True:
        header = sys.stdin.buffer.read(8)
        if len(header) < 8:
            break
        size, length = struct.unpack('>II', header)
        request = json.loads(sys.stdin.buffer.read(size))
        sys.stdin.buffer.read(length)
        pid += 1
        frame({'id': request['id'], 'pid': pid})
    """)


def test_the_host_caps_processes_even_when_the_supervisor_does_not(runc_sandbox: Sandbox) -> None:
    sup = Supervisor.start(runc_sandbox, program=OBLIGING)
    started = 0
    try:
        for _ in range(1000):
            try:
                sup.spawn(["sleep", "100"])
                started += 1
            except LimitError:
                pass
    finally:
        sup.close()
    assert started == MAX_PROCESSES


def test_a_supervisor_that_never_starts_is_refused_in_time(runc_sandbox: Sandbox) -> None:
    started = time.monotonic()
    with pytest.raises(SupervisorLostError):
        Supervisor.start(runc_sandbox, timeout=2, program="import time; time.sleep(60)")
    with pytest.raises(SupervisorLostError):
        Supervisor.start(runc_sandbox, timeout=2, program="raise SystemExit(1)")
    assert time.monotonic() - started < 15


@given(st.binary(max_size=200))
def test_the_frame_reader_refuses_without_allocating_and_never_raises_otherwise(data: bytes) -> None:
    reader = wire.FrameReader()
    try:
        for head, _ in reader.feed(data):
            assert isinstance(head, dict)
    except ValueError:  # json's errors are ValueErrors too
        pass
    assert len(reader._buffer) <= len(data)


def test_a_frame_of_2_gib_is_refused_from_its_header() -> None:
    with pytest.raises(ValueError, match="over the caps"):
        wire.FrameReader().feed(struct.pack(">II", 2**31, 0))
    head = json.dumps({"ev": "ready"}).encode()
    frames = wire.FrameReader().feed(struct.pack(">II", len(head), 3) + head + b"abc")
    assert frames == [({"ev": "ready"}, b"abc")]


def test_dockers_stream_headers_are_counted_not_allocated() -> None:
    demux = Demux()
    parts = list(demux.feed(bytes([1, 0, 0, 0]) + (2**32 - 1).to_bytes(4, "big") + b"abc"))
    assert parts == [(1, b"abc")]
    with pytest.raises(Violation):
        list(Demux().feed(bytes([3, 0, 0, 0, 0, 0, 0, 1]) + b"x"))


# -- a pty ------------------------------------------------------------------------------------------------------


def test_a_pty_takes_input_and_resizes(sup: Supervisor) -> None:
    sub = sup.spawn(["/bin/bash", "-i", "-l"], pty=(80, 24), envs={"TERM": "xterm-256color"})
    sup.send_input(sub.pid, b"stty size; tty\n", pty=True)
    seen = b""
    while b"24 80" not in seen:
        event = sub.next(10)
        assert event is not None, f"no size in {seen!r}"
        seen += event.data if isinstance(event, Output) else b""
    sup.resize(sub.pid, 120, 40)
    sup.send_input(sub.pid, b"stty size; exit 5\n", pty=True)
    out, end = drain(sub)
    assert b"40 120" in out["pty"] and b"/dev/pts/" in seen + out["pty"]
    assert end.exit_code == 5
    with pytest.raises(BadArgumentError):
        sup.resize(sup.spawn(["sleep", "10"]).pid, 80, 24)  # no pty


# -- files, as the sandbox user ----------------------------------------------------------------------------------


def test_files_are_made_read_listed_moved_and_removed(sup: Supervisor) -> None:
    assert sup.files.make_dir("/mnt/data/a/b") is True
    assert sup.files.make_dir("/mnt/data/a/b") is False
    entry = sup.files.write_file("/mnt/data/a/b/f.txt", [b"hello ", b"world"], max_bytes=100)
    assert (entry["type"], entry["size"], entry["permissions"]) == ("file", 11, "-rw-r--r--")
    assert b"".join(sup.files.read_file("/mnt/data/a/b/f.txt", max_bytes=100)) == b"hello world"
    assert {e["path"] for e in sup.files.list_dir("/mnt/data", 1)} >= {"/mnt/data/a"}
    assert {e["path"] for e in sup.files.list_dir("/mnt/data/a", 2)} == {"/mnt/data/a/b", "/mnt/data/a/b/f.txt"}
    moved = sup.files.move("/mnt/data/a/b/f.txt", "/mnt/data/c/g.txt")
    assert moved["path"] == "/mnt/data/c/g.txt"
    sup.files.remove("/mnt/data/a")
    for call in (lambda: sup.files.stat("/mnt/data/a"), lambda: sup.files.remove("/mnt/data/a"),
                 lambda: list(sup.files.read_file("/mnt/data/nope", max_bytes=10))):
        with pytest.raises(NotFoundError):
            call()


def test_a_link_is_reported_and_read_inside_the_sandbox_only(sup: Supervisor) -> None:
    run(sup, "ln -s /etc/passwd /mnt/data/link")
    entry = sup.files.stat("/mnt/data/link")
    assert (entry["type"], entry["symlink_target"]) == ("symlink", "/etc/passwd")
    inside = run(sup, "cat /etc/passwd")[0]["stdout"]
    assert b"".join(sup.files.read_file("/mnt/data/link", max_bytes=1 << 20)) == inside
    with open("/etc/passwd", "rb") as host:
        assert inside != host.read(), "the test needs the sandbox's /etc/passwd to differ from the host's"


def test_file_operations_keep_their_bounds(sup: Supervisor) -> None:
    with pytest.raises(PermissionDeniedError):
        sup.files.write_file("/etc/evil", [b"x"], max_bytes=10)
    with pytest.raises(PermissionDeniedError):
        sup.files.make_dir("/usr/evil")
    with pytest.raises(TooLargeError):
        sup.files.write_file("/mnt/data/big", [b"x" * 60, b"y" * 60], max_bytes=100)
    with pytest.raises(NotFoundError):
        sup.files.stat("/mnt/data/big")  # nothing half-written stays
    sup.files.write_file("/mnt/data/ten", [b"0123456789"], max_bytes=10)
    with pytest.raises(TooLargeError):
        list(sup.files.read_file("/mnt/data/ten", max_bytes=9))
    with pytest.raises(IsDirectoryError):
        list(sup.files.read_file("/mnt/data", max_bytes=9))
    with pytest.raises(TooLargeError):  # the data filesystem is 16 MiB
        sup.files.write_file("/mnt/data/fill", iter([b"z" * (1 << 20)] * 32), max_bytes=64 << 20)
    # A FIFO planted by the code neither holds the supervisor on read nor on write.
    run(sup, "mkfifo /mnt/data/fifo")
    started = time.monotonic()
    with pytest.raises(BadArgumentError):
        list(sup.files.read_file("/mnt/data/fifo", max_bytes=10))
    with pytest.raises((BadArgumentError, NotFoundError)):
        sup.files.write_file("/mnt/data/fifo", [b"x"], max_bytes=10)
    assert time.monotonic() - started < 10
    assert sup.files.stat("/mnt/data/fifo")["type"] == "other"


# -- folder watches ----------------------------------------------------------------------------------------------


def test_a_folder_watch_streams_changes_below_it(sup: Supervisor) -> None:
    sup.files.make_dir("/mnt/data/w")
    watch = sup.files.watch_dir("/mnt/data/w", recursive=True)
    run(sup, "cd /mnt/data/w && mkdir sub && sleep 0.2 && touch sub/f && echo x > a && mv a b && chmod 600 b && rm b")
    seen: set[tuple[str, str]] = set()
    deadline = time.monotonic() + 20
    while ("b", "remove") not in seen and time.monotonic() < deadline:
        event = watch.next(1)
        if isinstance(event, FsEvent):
            seen.add((event.name, event.type))
    assert {("sub", "create"), ("sub/f", "create"), ("a", "create"), ("a", "write"), ("a", "rename"),
            ("b", "create"), ("b", "chmod"), ("b", "remove")} <= seen, seen
    watch.close()
    run(sup, "touch /mnt/data/w/late")
    assert watch.next(0.5) is None
    with pytest.raises(NotFoundError):
        sup.files.watch_dir("/mnt/data/nope")
    with pytest.raises(BadArgumentError):
        sup.files.watch_dir("/etc/hostname")


def test_a_watch_flood_is_bounded_and_watches_are_capped(runc_sandbox: Sandbox) -> None:
    """Before: no watches. After: an idle reader of a folder churned forever holds at most SUBSCRIBER_EVENTS
    events, the rest counted; a 17th watch is refused."""
    sup = Supervisor.start(runc_sandbox)
    try:
        watch = sup.files.watch_dir("/mnt/data")
        churn = "import os\nwhile True:\n    open('/mnt/data/x', 'w').close()\n    os.unlink('/mnt/data/x')"
        sup.spawn(["python3", "-c", churn]).close()
        tracemalloc.start()
        try:
            deadline = time.monotonic() + 60
            while watch.lost < 10 * SUBSCRIBER_EVENTS and time.monotonic() < deadline:
                time.sleep(0.2)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert watch.lost >= 10 * SUBSCRIBER_EVENTS
        assert peak < 8 << 20, f"the host held {peak} bytes for an idle watch"
        watch.close()
        kept = 0
        while watch.next(0) is not None:
            kept += 1
        assert kept <= SUBSCRIBER_EVENTS
        for _ in range(16):  # the first one is closed
            sup.files.watch_dir("/tmp")
        with pytest.raises(LimitError):
            sup.files.watch_dir("/tmp")
    finally:
        sup.close()
