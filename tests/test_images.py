"""Named images: `nbexec image build --name` on the real engine (on top of the runtime image under test, no
registry), cached by the content of its inputs, listed by `nbexec image list`, and asked for by name from the library,
the CLI, HTTP bodies and tool arguments, within what the operator allows (NBEXEC_IMAGES).

The images built here keep their tags (nbexec-image-nbexec-test*:<hash>): a later run with the same inputs builds
nothing. Attacks on all of this are in tests/security/test_images.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import nbexec
from nbexec import Session, execute_notebook
from nbexec.integrations import tools
from nbexec.integrations.toolcall import handle_anthropic_tool_use, handle_openai_tool_call
from nbexec.sandbox.docker import daemon
from nbexec.service.server import ServerSettings

from .conftest import IMAGE
from .test_server import TOKEN_A, running

ROOT = Path(__file__).resolve().parent.parent
NAME = "nbexec-test"  # requirements: tomli-w; apt: sudo (a set-id program, see tests/security/test_images.py)
DERIVED = "nbexec-test-b"  # built on NAME: iniconfig besides (a requirement with a marker: `;`, `>`, quotes)
DERIVED_REQUIREMENT = 'iniconfig==2.0.0; python_version >= "3.0"'
REQUIREMENTS = "# the TOML writer\ntomli-w==1.0.0\n"
PROBE = ("import importlib.util, shutil\n"
         "found = [importlib.util.find_spec(m) is not None for m in ('tomli_w', 'iniconfig')]\n"
         "print(found, bool(shutil.which('sudo')))")


@dataclass(frozen=True)
class Built:
    name: str
    tag: str
    image_id: str
    output: str


def nbexec_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
               stdin: str | None = None, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """The real `nbexec` command, with the image under test as the default image."""
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "NBEXEC_IMAGE": IMAGE, **(env or {})}
    return subprocess.run([sys.executable, "-m", "nbexec.cli", *args], env=environ, cwd=cwd, input=stdin,
                          capture_output=True, text=True, timeout=timeout, check=False)


def build(name: str, tmp: Path, *args: str, requirements: str | None = None) -> Built:
    """`nbexec image build --name NAME ...`; fails the test (with Docker's output) when the build fails."""
    extra = list(args)
    if requirements is not None:
        (tmp / f"{name}.txt").write_text(requirements)
        extra += ["--requirements", str(tmp / f"{name}.txt")]
    done = nbexec_cli("image", "build", "--name", name, *extra, cwd=tmp)
    if done.returncode != 0:
        pytest.fail(f"nbexec image build --name {name} failed ({done.returncode}):\n{done.stdout}\n"
                    f"{done.stderr[-4000:]}", pytrace=False)
    tag = next(word for word in done.stdout.split() if word.startswith(f"nbexec-image-{name}:"))
    image = daemon.connect().images.get(tag)
    return Built(name, tag, image.id, done.stdout)


@pytest.fixture(scope="session")
def named(docker_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Built:
    """NAME, built once per test session (nothing is built when an earlier run left it with the same inputs)."""
    return build(NAME, tmp_path_factory.mktemp("named"), "--apt", "sudo", requirements=REQUIREMENTS)


@pytest.fixture(scope="session")
def derived(named: Built, tmp_path_factory: pytest.TempPathFactory) -> Built:
    return build(DERIVED, tmp_path_factory.mktemp("derived"), "--base", NAME, requirements=DERIVED_REQUIREMENT + "\n")


def _named_ids() -> set[str]:
    """Every image Docker holds that nbexec built as a named image (dangling ones too)."""
    return {i.id for i in daemon.connect().images.list(all=True, filters={"label": "io.nbexec.image.name"})}


def test_the_same_inputs_build_nothing_new(named: Built, tmp_path: Path) -> None:
    before = _named_ids()
    again = build(NAME, tmp_path, "--apt", "sudo", requirements="tomli-w==1.0.0  # same, said differently\n")
    assert (again.tag, again.image_id) == (named.tag, named.image_id)
    assert "up to date" in again.output and "nothing built" in again.output, again.output
    assert _named_ids() == before, "a build of the same inputs made an image"


def test_the_tag_carries_the_hash_of_the_inputs(named: Built, derived: Built) -> None:
    digest = named.tag.split(":")[1]
    assert len(digest) == 16 and all(c in "0123456789abcdef" for c in digest)
    labels = daemon.connect().images.get(named.tag).labels
    assert labels["io.nbexec.image.inputs"].startswith(digest)
    assert labels["io.nbexec.image.requirements"] == "tomli-w==1.0.0" and labels["io.nbexec.image.apt"] == "sudo"
    assert derived.tag.split(":")[1] != digest
    current = daemon.connect().images.get(f"nbexec-image-{NAME}:latest")  # what the name runs
    assert current.id == named.image_id


def test_a_named_image_keeps_the_runtime_images_hardening(named: Built, derived: Built) -> None:
    runtime = daemon.connect().images.get(IMAGE).attrs["Config"]
    for built in (named, derived):
        config = daemon.connect().images.get(built.tag).attrs["Config"]
        assert config["User"] == "1000:1000" and config["Entrypoint"] == ["/usr/bin/tini", "-s", "--"]
        assert config["Cmd"] == runtime["Cmd"] == ["nbexec-kernel", "/run/nbexec/kernel.json"]
        assert config["Labels"]["io.nbexec.role"] == "runtime"


def test_image_list_says_what_each_was_built_from(named: Built, derived: Built) -> None:
    done = nbexec_cli("image", "list", env={"NBEXEC_IMAGES": NAME})
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line for line in done.stdout.splitlines()[1:] if line.strip()}
    assert named.tag in rows[NAME] and "tomli-w==1.0.0" in rows[NAME] and "apt: sudo" in rows[NAME]
    assert "MB" in rows[NAME] and rows[DERIVED].count(f"base {NAME}") == 1
    listed = {item["name"]: item for item in json.loads(nbexec_cli("image", "list", "--json",
                                                                   env={"NBEXEC_IMAGES": NAME}).stdout)}
    assert listed[NAME]["tag"] == named.tag and listed[NAME]["allowed"] is True
    assert listed[DERIVED]["allowed"] is False and listed[DERIVED]["requirements"] == [DERIVED_REQUIREMENT]
    assert listed["default"]["tag"] == IMAGE and listed["default"]["allowed"] is True
    assert int(listed[NAME]["size"]) > 0 and listed[NAME]["created"]


def test_the_library_runs_a_named_image_by_name(named: Built, derived: Built, cold: nbexec.SandboxConfig) -> None:
    config = cold.replace(images=(NAME, DERIVED), warm_imports=())
    assert execute_notebook(PROBE, config=config).stdout == "[False, False] False\n"  # the default image
    assert execute_notebook(PROBE, config=config.replace(image=NAME)).stdout == "[True, False] True\n"
    with Session(config.replace(image=DERIVED)) as session:
        assert session.run(PROBE).stdout == "[True, True] True\n"


def test_the_cli_runs_a_named_image(named: Built, tmp_path: Path) -> None:
    done = nbexec_cli("run", "--image", NAME, "-q", "-", stdin=PROBE, cwd=tmp_path,
                      env={"NBEXEC_IMAGES": NAME, "NBEXEC_POOL_SIZE": "0"})
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[True, False] True\n"


def test_http_bodies_name_the_image(named: Built, cleanup_ledger: None) -> None:
    config = nbexec.SandboxConfig(image=IMAGE, images=(NAME,), pool_size=0, warm_imports=(), timeout=30)
    with running(ServerSettings(config=config, tokens=(TOKEN_A,))) as service, service.client() as client:
        one_shot = client.post("/v1/execute", json={"code": PROBE, "image": NAME}).json()
        default = client.post("/v1/execute", json={"code": PROBE}).json()
        created = client.post("/v1/sessions", json={"image": NAME})
        session = created.json()["id"]
        in_session = client.post(f"/v1/sessions/{session}/execute", json={"code": PROBE}).json()
        plain = client.post("/v1/sessions")  # no body: the default image, as before
        plain_run = client.post(f"/v1/sessions/{plain.json()['id']}/execute", json={"code": PROBE}).json()
        for sid in (session, plain.json()["id"]):
            client.delete(f"/v1/sessions/{sid}")
    assert one_shot["stdout"] == "[True, False] True\n" and default["stdout"] == "[False, False] False\n"
    assert created.status_code == 201 and in_session["stdout"] == "[True, False] True\n"
    assert plain.status_code == 201 and plain_run["stdout"] == "[False, False] False\n"


def test_tool_arguments_name_the_image(named: Built, config: nbexec.SandboxConfig) -> None:
    allowed = config.replace(images=(NAME,))
    schema = tools.openai_tool(allowed)["function"]["parameters"]
    assert schema["properties"]["image"]["enum"] == ["default", NAME]
    assert "image" not in tools.openai_tool(config)["function"]["parameters"]["properties"]  # none allowed: not offered
    reply = handle_openai_tool_call({"id": "c1", "function": {"arguments": json.dumps({"code": PROBE, "image": NAME})}},
                                    config=allowed)
    assert reply["content"].startswith("[True, False] True"), reply["content"]
    manager = nbexec.SessionManager(allowed)
    try:
        block = {"type": "tool_use", "id": "t1", "name": "execute_python", "input": {"code": PROBE, "image": NAME}}
        answer = handle_anthropic_tool_use(block, config=allowed, sessions=manager)
    finally:
        manager.close_all()
    assert "[True, False] True" in answer["content"][0]["text"], answer



def test_remote_nodes_run_the_named_image(named: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          cleanup_ledger: None) -> None:
    """With NBEXEC_NODES the library sends the name; the node runs it from its own list (NBEXEC_IMAGES)."""
    import signal

    from .cluster import NODE_TOKEN, node, wait_ready
    from .conftest import wait_until

    tmp_path.chmod(0o755)  # the sandbox user reaches its bind mounts through it
    server = node(0, tmp_path, tag="img")
    server.env.update(NBEXEC_IMAGE=IMAGE, NBEXEC_IMAGES=NAME, NBEXEC_POOL_SIZE="0")
    server.start()
    try:
        wait_ready([server])
        monkeypatch.setenv("NBEXEC_NODES", server.url)
        monkeypatch.setenv("NBEXEC_NODE_TOKEN", NODE_TOKEN)
        config = nbexec.SandboxConfig(image=NAME, images=(NAME,), pool_size=0, warm_imports=(), source="remote")
        one_shot = execute_notebook(PROBE, config=config)
        with Session(config) as session:
            in_session = session.run(PROBE)
        default = execute_notebook(PROBE, config=config.replace(image=IMAGE))
    finally:
        server.kill(signal.SIGTERM)
        wait_until(lambda: not server.containers(), 60, f"{server.name} left containers behind")
    assert (one_shot.node, in_session.node) == (server.name, server.name)
    assert one_shot.stdout == in_session.stdout == "[True, False] True\n", (one_shot.stdout, one_shot.error)
    assert default.stdout == "[False, False] False\n"
