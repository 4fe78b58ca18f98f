"""Sessions and the session manager, on real sandboxes."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

import nbexec
from nbexec import Session, SessionManager

from .conftest import own_containers, unaccounted_containers, wait_until


def test_state_persists_and_notebook_grows(config: nbexec.SandboxConfig, tmp_path: Path) -> None:
    with Session(config) as session:
        assert session.run("x = 41").ok
        result = session.run("print(x + 1)")
        assert result.stdout == "42\n" and result.ok
        assert [c.source for c in session.notebook.cells] == ["x = 41", "print(x + 1)"]
        assert [o["cell_index"] for o in result.outputs] == [1]
        saved = session.save(tmp_path / "s.ipynb")
        assert "print(x + 1)" in saved.read_text()
    assert session.status == "closed"
    session.close()  # idempotent
    with pytest.raises(nbexec.SessionClosedError):
        session.run("x")


def test_a_second_close_returns_only_once_the_sandbox_is_gone(config: nbexec.SandboxConfig) -> None:
    """A node's shutdown closes each run's session from its own thread while the run's end closes it too, then the
    process exits: whichever close() returns second, the container must be gone by then (it was left to a dying
    process's removal, one stop in five)."""
    before = set(own_containers(role="session"))
    session = Session(config.replace(pool_size=0)).start()
    mine = set(own_containers(role="session")) - before
    assert len(mine) == 1
    first = threading.Thread(target=session.close)
    first.start()
    wait_until(lambda: session.status == "closed", 30, "the first close never began", interval=0.0005)
    session.close()
    left = mine & set(own_containers(role="session"))
    first.join(60)
    assert not left, "the second close() returned while the first was still removing the sandbox"


def test_upload_download_binary_round_trip(config: nbexec.SandboxConfig, tmp_path: Path) -> None:
    payload = bytes(range(256)) * 1000
    source = tmp_path / "blob.bin"
    source.write_bytes(payload)
    with Session(config) as session:
        assert session.upload(source) == "/mnt/data/blob.bin"
        session.upload(b"a,b\n1,2\n", "in/table.csv")
        result = session.run("import hashlib\nprint(hashlib.sha256(open('blob.bin','rb').read()).hexdigest())\n"
                             "open('out.bin', 'wb').write(bytes(reversed(open('blob.bin','rb').read())))")
        import hashlib
        assert result.stdout.strip() == hashlib.sha256(payload).hexdigest()
        assert session.download("out.bin") == bytes(reversed(payload))
        assert session.download("in/table.csv") == b"a,b\n1,2\n"
        assert {f.name for f in session.files()} == {"blob.bin", "in/table.csv", "out.bin"}
        with pytest.raises(nbexec.FileTransferError):
            session.download("../etc/passwd")
        with pytest.raises(nbexec.FileTransferError):
            session.download("missing.txt")


def test_timeout_interrupts_then_kills(config: nbexec.SandboxConfig) -> None:
    with Session(config.replace(interrupt_grace=1)) as session:
        session.run("y = 5")
        result = session.run("import time; time.sleep(60)", timeout=1)
        assert result.error is not None and result.error.kind == "timeout"
        assert session.status == "ready"
        assert session.run("print(y)").stdout == "5\n"  # interrupted, state kept
        stubborn = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(60)"
        started = time.monotonic()
        result = session.run(stubborn, timeout=1)
        assert time.monotonic() - started < 15
        assert result.error is not None and "killed" in result.error.evalue
        assert session.status == "dead"
        with pytest.raises(nbexec.SessionDeadError, match="restart"):
            session.run("print(y)")
        session.restart()
        assert session.run("print('fresh')").stdout == "fresh\n"


def test_kernel_death_marks_session_dead_and_files_survive_restart(config: nbexec.SandboxConfig) -> None:
    with Session(config) as session:
        session.run("open('keep.txt', 'w').write('kept')")
        result = session.run("import os; os._exit(1)")
        assert result.error is not None and result.error.kind == "kernel_died"
        with pytest.raises(nbexec.SessionDeadError):
            session.run("1")
        session.restart()
        assert session.run("print(open('keep.txt').read())").stdout == "kept\n"


def test_interrupt_from_another_thread(config: nbexec.SandboxConfig) -> None:
    with Session(config) as session:
        session.start()
        # Interrupt once the cell has shown it runs (not after a fixed delay, which may come before it starts),
        # and once only: a second one, sent on the error's output, is test_display's case of an interrupt that
        # lands after the cell.
        sent = threading.Event()

        def interrupt_once(*_: object) -> None:
            if not sent.is_set():
                sent.set()
                threading.Thread(target=session.interrupt).start()

        result = session.run("print('running', flush=True)\nimport time; time.sleep(30)", on_output=interrupt_once)
        assert result.stdout == "running\n"
        assert result.error is not None and result.error.ename == "KeyboardInterrupt"


def test_idle_sessions_are_reaped(config: nbexec.SandboxConfig) -> None:
    session = Session(config, ttl=1.0)
    session.run("1")
    wait_until(lambda: session.status == "closed", 15, "the idle session was not reaped")


def test_manager_cap_get_close(config: nbexec.SandboxConfig) -> None:
    manager = SessionManager(config, max_sessions=2)
    first = manager.create()
    second = manager.create(session_id="chat-2")
    with pytest.raises(nbexec.SessionLimitError, match="cap is 2"):
        manager.create()
    assert manager.get("chat-2") is second
    first.run("a = 1")
    manager.close(first.id)
    with pytest.raises(nbexec.SessionNotFoundError):
        manager.get(first.id)
    third = manager.create()
    assert len(manager) == 2
    results = []

    def use(session: Session, n: int) -> None:
        results.append(session.run(f"v = {n}\nprint(v)").stdout)

    threads = [threading.Thread(target=use, args=(s, n)) for n, s in enumerate([second, third, second])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["0\n", "1\n", "2\n"]
    manager.close_all()
    assert len(manager) == 0
    assert unaccounted_containers() == []


def test_sessions_do_not_see_each_other(config: nbexec.SandboxConfig) -> None:
    with Session(config) as a, Session(config) as b:
        a.run("secret = 'a'; open('a.txt', 'w').write('a')")
        result = b.run("import os\nprint('secret' in globals(), os.listdir('.'))")
        assert result.stdout == "False []\n"


def test_docker_going_away_mid_session_is_a_clear_error(cleanup_ledger: None, tmp_path: Path) -> None:
    """The engine disappears (its API stops answering and the sandbox is gone): the next run fails fast with a
    DockerError naming the problem, instead of hanging."""
    import docker as docker_sdk

    from nbexec.sandbox.docker import daemon

    from .conftest import IMAGE
    from .socketproxy import SocketProxy

    proxy = SocketProxy(tmp_path / "docker.sock")
    saved = daemon._client
    cut_client = docker_sdk.DockerClient(base_url=f"unix://{proxy.path}", timeout=10)
    daemon._client = cut_client
    try:
        config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, timeout=30)
        session = Session(config).start()
        assert session.run("x = 1").ok
        container_name = session._sandbox.container.name  # type: ignore[union-attr]
        proxy.cut()
        saved.containers.get(container_name).kill() if saved else None  # the engine took its containers along
        started = time.monotonic()
        with pytest.raises(nbexec.DockerError, match="Docker"):
            session.run("import time; time.sleep(5)")
        assert time.monotonic() - started < 20
    finally:
        daemon._client = saved
    session.close()  # cannot reach the engine through the cut socket: warns and leaves the container
    cut_client.close()
    if saved is not None:  # what `nbexec cleanup` would do once the engine is back
        saved.containers.get(container_name).remove(force=True)
    proxy.close()


def test_run_notebook_appends_its_cells(config: nbexec.SandboxConfig, tmp_path: Path) -> None:
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("n = globals().get('n', 0) + 1"),
                                         nbformat.v4.new_code_cell("print(n)")])
    with Session(config) as session:
        assert session.run_notebook(nbformat.from_dict(nb)).stdout == "1\n"
        again = session.run_notebook(nbformat.from_dict(nb))
        assert again.stdout == "2\n" and [o["cell_index"] for o in again.outputs] == [3]
        assert len({c.id for c in session.notebook.cells}) == 4
        nbformat.validate(nbformat.read(session.save(tmp_path / "twice.ipynb"), as_version=4))
