"""nbexec's own secrets never reach a sandbox, and a sandbox cannot plant settings for a later nbexec.

Attacked from outside: hostile code in a real sandbox reads every spelling of `.env` in the folder `nbexec run
FILE` mounts at /mnt/input (the bytes must never arrive in the result, its files or its notebook); hostile code
leaves a `.env` in /mnt/data and a later `nbexec run` is started in the folder it was copied to (its settings must
never reach the later sandbox); `.env` files and folders of every doubtful shape are offered to the loader; and
each service that accepts bearer tokens is started with short ones (it must refuse to start, and never listen).
"""

from __future__ import annotations

import grp
import http.client
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from ..conftest import IMAGE, wait_until
from ..test_cli import nbexec as run_cli

ROOT = Path(__file__).resolve().parents[2]
GOOD_TOKEN = "good-token-" + "g" * 24


# -- /mnt/input ----------------------------------------------------------------------------------------------------

READ_EVERYTHING = '''
import os
seen = []
def read(path):
    try:
        with open(path, errors="replace") as f:
            seen.append(f"{path}={f.read()!r}")
    except OSError as exc:
        seen.append(f"{path}!{exc.strerror}")
for root, dirs, files in os.walk("/mnt/input", followlinks=True):
    for name in files:
        read(os.path.join(root, name))
for path in ("/mnt/input/.env", "/mnt/input/link-to-env", "/mnt/input/absolute-link", "/mnt/input/hard-link",
             "/mnt/input/sym/.env", "/mnt/input/settings/real.txt", "/mnt/input/venv/.env/pyvenv.cfg",
             "/mnt/data/prod.env", "prod.env", "data.csv", "/mnt/input/sub/deeper/.env.local"):
    read(path)
print("\\n".join(seen))
with open("/mnt/data/seen.txt", "w") as out:
    out.write("\\n".join(seen))
'''


def _secret_folder(folder: Path) -> list[str]:
    """Every spelling of nbexec's configuration in a folder, readable as the usual umask leaves it; returns the
    secret values that must never reach the sandbox."""
    secrets: list[str] = []

    def put(relative: str, name: str) -> None:
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        value = f"secret-{name}-{os.urandom(6).hex()}"
        path.write_text(f"AZURE_STORAGE_CONNECTION_STRING={value}\nNBEXEC_API_TOKENS={value}\n")
        secrets.append(value)

    put(".env", "top")
    put(".env.local", "local")
    put(".env.production", "production")
    put("prod.env", "named")
    put("upper/.ENV", "upper-case")
    put("sub/.env", "sub")
    put("sub/deeper/.env.local", "deeper")
    put("settings/real.txt", "behind-a-link")  # what sym/.env points at
    put("venv/.env/pyvenv.cfg", "in-a-folder-named-env")
    (folder / "sym").mkdir()
    (folder / "sym" / ".env").symlink_to("../settings/real.txt")
    (folder / "link-to-env").symlink_to(".env")
    (folder / "absolute-link").symlink_to("/mnt/input/sub/.env")
    os.link(folder / ".env", folder / "hard-link")
    (folder / "data.csv").write_text("region,value\nnorth,42\n")
    (folder / "script.py").write_text(READ_EVERYTHING)
    for path in [folder, *folder.rglob("*")]:
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() else 0o644)
    return secrets


def test_the_input_mount_never_shows_nbexecs_configuration(cleanup_ledger: None, tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    secrets = _secret_folder(project)
    done = run_cli("run", str(project / "script.py"), "--json", "--output-dir", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert "north,42" in result["stdout"], "the honest file next to the script was not readable"
    shown = done.stdout + done.stderr + "".join(p.read_text(errors="replace") for p in (tmp_path / "out").rglob("*")
                                                if p.is_file())
    leaked = [s for s in secrets if s in shown]
    assert leaked == [], f"{len(leaked)} of {len(secrets)} secrets reached the sandbox: {leaked}"
    notes = " ".join(result["notes"])
    for name in (".env", ".env.local", "prod.env", "sub/.env", "upper/.ENV", "what sym/.env leads to",
                 "hard-link (another name of .env)", "venv/.env"):
        assert name in notes, f"the result does not say {name} was withheld: {notes}"


def test_a_folder_too_large_to_check_is_refused_with_a_clear_message(cleanup_ledger: None, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import nbexec
    from nbexec.sandbox.docker import inputmount

    monkeypatch.setattr(inputmount, "MAX_ENTRIES", 20)
    for n in range(25):
        (tmp_path / f"file-{n}.csv").write_text("x")
    config = nbexec.SandboxConfig(image=IMAGE, input_dir=str(tmp_path), pool_size=0, warm_imports=())
    with pytest.raises(nbexec.ConfigError, match=r"more than 20 entries.*--mount-input"):
        nbexec.execute_notebook("print(1)", config=config)


def _tree(folder: Path, spec: dict[str, str]) -> None:
    """Make ``spec``: name -> "file", "dir", "fifo", "link:<target>" or "hard:<other name>"."""
    for name, kind in spec.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "file":
            path.write_text("SECRET=1\n")
        elif kind == "dir":
            path.mkdir()
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind.startswith("link:"):
            path.symlink_to(kind[5:])
        else:
            os.link(folder / kind[5:], path)


SCANS: list[object] = [
    pytest.param({"a/.env": "file", "a/b.txt": "file"}, {"a/.env"}, id="sub-folder"),
    pytest.param({".env": "link:/mnt/input/conf/x", "conf/x": "file"}, {"conf/x"}, id="absolute-link-inside"),
    pytest.param({".env": "link:/mnt/input/../input/conf/x", "conf/x": "file"}, {"conf/x"}, id="absolute-dotdot"),
    pytest.param({".env": "link:/home/user/.env"}, set(), id="absolute-link-elsewhere"),
    pytest.param({".env": "link:../outside"}, set(), id="relative-link-above"),
    pytest.param({"s/.env": "link:../conf/../conf/x", "conf/x": "file"}, {"conf/x"}, id="relative-with-dotdot"),
    pytest.param({".env": "link:a", "a": "link:b", "b": "file"}, {"b"}, id="chain"),
    pytest.param({".env": "link:.env"}, set(), id="loop"),
    pytest.param({".env": "link:d/x", "d": "link:real", "real/x": "file"}, {"real/x"}, id="through-a-linked-folder"),
    pytest.param({".env": "link:conf", "conf/x": "file"}, {"conf"}, id="link-to-a-folder"),
    pytest.param({"venv/.env": "dir", "venv/.env/x.env": "file"}, {"venv/.env"}, id="folder-named-env"),
    pytest.param({".env": "file", "copy": "hard:.env", "d/again": "hard:.env"}, {".env", "copy", "d/again"},
                 id="hard-links"),
    pytest.param({"x.ENV": "file", ".Env.Local": "file", "env": "file", "environment.txt": "file", ".envrc": "file"},
                 {"x.ENV", ".Env.Local"}, id="names"),
]


@pytest.mark.parametrize("spec", [{".env": "fifo"}, {"a.env": "link:p", "p": "fifo"}], ids=["fifo", "link-to-fifo"])
def test_a_settings_pipe_is_refused_with_a_clear_message(tmp_path: Path, spec: dict[str, str]) -> None:
    """A FIFO (a secret manager may serve .env through one) cannot be covered: a mount over it hangs gVisor."""
    from nbexec.errors import ConfigError
    from nbexec.sandbox.docker import inputmount

    _tree(tmp_path, spec)
    with pytest.raises(ConfigError, match=r"named pipe.*--mount-input"):
        inputmount.scan(str(tmp_path), "/mnt/input")


@pytest.mark.parametrize(("spec", "expected"), SCANS)
def test_the_scan_finds_every_way_to_a_settings_file(tmp_path: Path, spec: dict[str, str],
                                                     expected: set[str]) -> None:
    from nbexec.sandbox.docker import inputmount

    _tree(tmp_path, spec)
    assert {str(p) for p in inputmount.scan(str(tmp_path), "/mnt/input")} == expected


# -- a .env the sandbox leaves behind ------------------------------------------------------------------------------

PLANT = '''
import os
os.makedirs("/mnt/data/sub", exist_ok=True)
for path in ("/mnt/data/.env", "/mnt/data/sub/.env"):
    with open(path, "w") as f:
        f.write("NBEXEC_ENV_PLANTED=from-the-sandbox\\nNBEXEC_NETWORK=1\\n")
print("planted")
'''
SHOW = "import os\nprint('planted:', os.environ.get('PLANTED'))\n"


@pytest.mark.parametrize("where", ["data", "data/sub"])
def test_a_env_copied_out_of_a_sandbox_is_never_loaded(cleanup_ledger: None, tmp_path: Path, where: str) -> None:
    planted = run_cli("run", "--output-dir", "out", "-", cwd=tmp_path, stdin=PLANT)
    assert planted.returncode == 0 and "planted" in planted.stdout, planted.stderr
    folder = tmp_path / "out" / where
    assert (folder / ".env").read_text().startswith("NBEXEC_ENV_PLANTED"), "the sandbox's .env was not copied out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBEXEC_") or k == "NBEXEC_IMAGE"}
    later = run_cli("run", "--json", "-", cwd=folder, stdin=SHOW, env=env)
    assert "from-the-sandbox" not in later.stdout, "a later nbexec loaded the sandbox's .env into its sandbox"
    assert later.returncode == 2, later.stdout[-2000:] + later.stderr[-2000:]
    assert "nbexec output folder" in later.stderr and ".env" in later.stderr, later.stderr


def test_only_a_folder_that_receives_sandbox_files_is_marked(tmp_path: Path) -> None:
    """The output folder is marked when its data folder is made (not when it is made: an unused one stays empty),
    and a sandbox's own sub-folder named data gets no stray mark among its files."""
    from nbexec.files.folders import MARK, OutputFolder, make_output_dir

    used, unused = (make_output_dir(tmp_path / name, may_exist=False) for name in ("used", "unused"))
    with OutputFolder.open(used) as out, out.child("data") as data, data.child("data"):
        pass
    with OutputFolder.open(unused) as out, out.child("images"):
        pass
    assert (used / MARK).is_file() and not (used / "data" / MARK).exists()
    assert sorted(os.listdir(unused)) == ["images"]


# -- the loader, shape by shape ------------------------------------------------------------------------------------

def _other_group() -> int:
    """A group that is not the current user's own (nogroup, users, ...)."""
    for name in ("nogroup", "users", "daemon", "staff"):
        try:
            return grp.getgrnam(name).gr_gid
        except KeyError:
            continue
    pytest.fail("no shared group (nogroup, users, daemon, staff) to make a group-writable folder with")


def _good(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)
    env = folder / ".env"
    env.write_text("PK_PLANTED=loaded\n")
    env.chmod(0o644)
    return folder


def _in_output_folder(tmp: Path) -> Path:
    from nbexec.files.folders import OutputFolder, make_output_dir

    made = make_output_dir(tmp / "nbexec-output" / "run-1", may_exist=False)
    with OutputFolder.open(made) as folder, folder.child("data"):  # as a run makes the folder for /mnt/data
        pass
    return _good(made / "data" / "sub")


def _group_writable(tmp: Path, what: str) -> Path:
    folder = _good(tmp / "project")
    target = folder if what == "folder" else folder / ".env"
    os.chown(target, -1, _other_group())
    target.chmod(0o775 if what == "folder" else 0o664)
    return folder


def _linked(tmp: Path, target: str) -> Path:
    elsewhere = _good(tmp / "elsewhere")
    folder = tmp / "project"
    folder.mkdir(mode=0o755)
    (folder / ".env").symlink_to(elsewhere / ".env" if target == "outside" else "settings.txt")
    if target == "inside":
        (folder / "settings.txt").write_text("PK_PLANTED=loaded\n")
    return folder


def _hard_linked(tmp: Path) -> Path:
    folder = _good(tmp / "project")
    os.link(folder / ".env", tmp / "another-name")
    return folder


def _folder_of_another_user(tmp: Path) -> Path:
    folder = _good(tmp / "project")
    os.chown(folder, os.getuid() + 4242, -1)
    return folder


def _world_writable(tmp: Path, mode: int) -> Path:
    folder = _good(tmp / "project")
    folder.chmod(mode)
    return folder


REFUSED: list[object] = [
    pytest.param(_in_output_folder, "nbexec output folder", id="inside-an-output-folder"),
    pytest.param(lambda t: _group_writable(t, "folder"), "writable by group", id="folder-group-writable"),
    pytest.param(lambda t: _world_writable(t, 0o777), "writable by", id="folder-world-writable"),
    pytest.param(lambda t: _world_writable(t, 0o1777), "writable by", id="folder-sticky-like-tmp"),
    pytest.param(_folder_of_another_user, "owned by uid", id="folder-of-another-user"),
    pytest.param(lambda t: _group_writable(t, "file"), "writable by group", id="file-group-writable"),
    pytest.param(lambda t: _linked(t, "outside"), "link", id="file-links-outside"),
    pytest.param(lambda t: _linked(t, "inside"), "link", id="file-links-beside"),
    pytest.param(_hard_linked, "link", id="file-hard-linked"),
]


@pytest.mark.parametrize(("make", "reason"), REFUSED)
def test_a_env_nbexec_does_not_control_is_never_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       make: Callable[[Path], Path], reason: str) -> None:
    from nbexec.cli import envfile
    from nbexec.errors import ConfigError

    monkeypatch.delenv("PK_PLANTED", raising=False)
    folder = make(tmp_path)
    with pytest.raises(ConfigError, match=r"\.env") as refused:
        envfile.load(folder)
    assert reason in str(refused.value), str(refused.value)
    assert "PK_PLANTED" not in os.environ


def test_a_env_of_yours_in_a_folder_of_yours_still_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nbexec.cli import envfile

    monkeypatch.delenv("PK_PLANTED", raising=False)
    assert envfile.load(_good(tmp_path / "project")) == ["PK_PLANTED"]
    assert os.environ["PK_PLANTED"] == "loaded"


# -- bearer tokens -------------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


SHORT = "short-token"  # 11 characters
UNICODE_SHORT = "\u00e4" * 8  # 8 characters in 16 bytes
SERVICES: list[object] = [
    pytest.param(["serve"], {"NBEXEC_API_TOKENS": SHORT}, id="serve"),
    pytest.param(["serve"], {"NBEXEC_API_TOKENS": f"{GOOD_TOKEN},{'x' * 15}"}, id="serve-one-of-two-15-chars"),
    pytest.param(["serve", "--nodes", "http://127.0.0.1:9"], {"NBEXEC_API_TOKENS": SHORT,
                                                               "NBEXEC_NODE_TOKEN": GOOD_TOKEN}, id="router"),
    pytest.param(["serve", "--nodes", "http://127.0.0.1:9"], {"NBEXEC_API_TOKENS": GOOD_TOKEN,
                                                               "NBEXEC_NODE_TOKEN": SHORT}, id="router-node-token"),
    pytest.param(["mcp", "--transport", "streamable-http"], {"NBEXEC_API_TOKENS": SHORT}, id="mcp-http"),
    pytest.param(["mcp", "--transport", "streamable-http"], {"NBEXEC_API_TOKENS": f"{GOOD_TOKEN},{SHORT}"},
                 id="mcp-http-one-of-two"),
    pytest.param(["mcp", "--transport", "streamable-http"], {"NBEXEC_API_TOKENS": UNICODE_SHORT},
                 id="mcp-http-16-bytes-8-characters"),
    pytest.param(["mcp", "--transport", "streamable-http", "--token-file", "{tokens}"], {}, id="mcp-http-token-file"),
]


@pytest.mark.parametrize(("command", "env"), SERVICES)
def test_every_service_refuses_short_bearer_tokens(tmp_path: Path, command: list[str], env: dict[str, str]) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{GOOD_TOKEN}\n{SHORT}\n")
    port = _free_port()
    environ = {k: v for k, v in os.environ.items() if k not in ("NBEXEC_API_TOKENS", "NBEXEC_NODE_TOKEN")}
    environ.update(NBEXEC_IMAGE=IMAGE, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path), **env)
    args = [a.format(tokens=tokens) for a in command]
    with (tmp_path / "log").open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "nbexec.cli", *args, "--host", "127.0.0.1", "--port",
                                 str(port)], env=environ, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        wait_until(lambda: proc.poll() is not None or _listening(port), 60, "the service neither started nor ended")
        if proc.poll() is None:
            short = UNICODE_SHORT if UNICODE_SHORT in str(env) else SHORT
            path = "/mcp" if command[0] == "mcp" else "/v1/sessions"
            answer = httpx.post(f"http://127.0.0.1:{port}{path}", timeout=30, json={}, headers={
                b"Authorization": b"Bearer " + short.encode(), b"Accept": b"application/json, text/event-stream"})
            pytest.fail(f"{' '.join(args)} started with a short token and answered it {answer.status_code} "
                        "(401 would have refused it)")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    output = (tmp_path / "log").read_text()
    assert proc.returncode == 2, output
    assert re.search(r"16\+? characters", output), output


def test_empty_items_of_a_token_list_are_no_token(tmp_path: Path) -> None:
    """`,a,, ,b,` lists two tokens: the empty items are not tokens a caller could send (an empty bearer, a comma,
    a space) and do not stop the service as short ones would."""
    other = "other-token-" + "o" * 24
    port = _free_port()
    environ = {k: v for k, v in os.environ.items() if k not in ("NBEXEC_API_TOKENS", "NBEXEC_NODE_TOKEN")}
    environ.update(NBEXEC_IMAGE=IMAGE, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path), NBEXEC_POOL_SIZE="0",
                   NBEXEC_API_TOKENS=f",{GOOD_TOKEN},, ,{other},")
    with (tmp_path / "log").open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "nbexec.cli", "serve", "--host", "127.0.0.1", "--port",
                                 str(port)], env=environ, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        wait_until(lambda: proc.poll() is not None or _listening(port), 60, "the service neither started nor ended")
        assert proc.poll() is None, (tmp_path / "log").read_text()
        answers = {}
        for value in ("Bearer ", "Bearer ,", "Bearer  ", "Bearer", f"Bearer {GOOD_TOKEN}", f"Bearer {other}"):
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)  # sends the header as written
            try:
                connection.request("GET", "/v1/capacity", headers={"Authorization": value})
                answers[value] = connection.getresponse().status
            finally:
                connection.close()
        assert answers == {"Bearer ": 401, "Bearer ,": 401, "Bearer  ": 401, "Bearer": 401,
                           f"Bearer {GOOD_TOKEN}": 200, f"Bearer {other}": 200}, answers
    finally:
        proc.kill()
        proc.wait(timeout=30)


@pytest.mark.parametrize("tokens", [(b"short-token",), (GOOD_TOKEN.encode(), b"x" * 15), ("\u00e4" * 8).encode()],
                         ids=["short", "one-of-two", "16-bytes-8-characters"])
def test_the_mcp_bearer_gate_refuses_short_tokens(tokens: Any) -> None:
    """The library's gate (what `nbexec mcp` and a program serving MCP over HTTP put in front of the app)."""
    from nbexec.errors import ConfigError
    from nbexec.integrations.mcp import BearerGate

    with pytest.raises(ConfigError, match="16 characters"):
        BearerGate(object(), tokens if isinstance(tokens, tuple) else (tokens,))
    assert BearerGate(object(), (GOOD_TOKEN.encode(),)).tokens == (GOOD_TOKEN.encode(),)


def test_a_client_never_sends_a_short_node_token(tmp_path: Path) -> None:
    env = {"NBEXEC_NODES": "http://127.0.0.1:9", "NBEXEC_NODE_TOKEN": SHORT}
    done = run_cli("run", "-", cwd=tmp_path, stdin="print(1)\n", env=env)
    assert done.returncode == 2 and "16 characters" in done.stderr, done.stderr
