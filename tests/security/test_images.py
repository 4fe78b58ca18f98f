"""Attacks on named images: hostile inputs to `nbexec image build --name` (names, apt packages, requirements, bases),
images asked for past the operator's list (NBEXEC_IMAGES) through every door (library, CLI, HTTP bodies, tool
arguments), and the hostile suite's core escapes run in a named image that carries a set-id program.

Judged from outside: Docker's own list of images (no build began), the images' files read by a root container on
the host, the containers the engine was asked to create, and the host canary and listener of the hostile suite.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import nbexec
from nbexec.integrations.toolcall import handle_openai_tool_call
from nbexec.sandbox.docker import daemon, pool
from nbexec.service.server import ServerSettings

from ..conftest import IMAGE, created, own_containers, settle
from ..test_images import DERIVED, NAME, ROOT, Built, derived, named, nbexec_cli  # noqa: F401  (session fixtures)
from ..test_server import TOKEN_A, running
from . import test_hostile as hostile
from .hostile_cases import CASES, Case, denied, try_all


def all_image_ids() -> set[str]:
    return {i.id for i in daemon.connect().images.list(all=True)}


def refused_before_building(args: list[str], expected: str, tmp_path: Path) -> None:
    """`nbexec image build --name ...` exits 2 with ``expected`` in its message, and Docker holds no new image."""
    before = all_image_ids()
    done = nbexec_cli("image", "build", *args, cwd=tmp_path, timeout=120)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr[-2000:])
    assert expected in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "Step 1/" not in done.stderr, done.stderr  # no build began
    assert all_image_ids() == before, "an image was made"


@pytest.mark.parametrize(("name", "expected"), [
    pytest.param("../x", "not a valid image name", id="traversal"),
    pytest.param("Geo", "not a valid image name", id="upper-case"),
    pytest.param("geo:latest", "not a valid image name", id="a-tag"),
    pytest.param("geo;id", "not a valid image name", id="shell"),
    pytest.param("-rf", "not a valid image name", id="option"),
    pytest.param("", "not a valid image name", id="empty"),
    pytest.param("g" * 49, "not a valid image name", id="too-long"),
    pytest.param("geo\nRUN id", "not a valid image name", id="newline"),
    pytest.param("default", "is reserved", id="reserved"),
])
def test_bad_names_are_refused_before_any_build(name: str, expected: str, tmp_path: Path, docker_ready: None) -> None:
    refused_before_building(["--name", name, "--apt", "sudo"], expected, tmp_path)


@pytest.mark.parametrize("package", [
    pytest.param("sudo; touch /pwned", id="shell-separator"),
    pytest.param("$(id)", id="substitution"),
    pytest.param("`id`", id="backticks"),
    pytest.param("-o=APT::Get::AllowUnauthenticated=true", id="option"),
    pytest.param("--allow-unauthenticated", id="long-option"),
    pytest.param("sudo\nRUN id", id="newline"),
    pytest.param("sudo curl", id="two-in-one"),
    pytest.param("", id="empty"),
    pytest.param("a" * 200, id="too-long"),
    pytest.param("../../etc/passwd", id="path"),
    pytest.param("./local.deb", id="local-file"),
])
def test_bad_apt_names_are_refused_before_any_build(package: str, tmp_path: Path, docker_ready: None) -> None:
    refused_before_building(["--name", "nbexec-attack", "--apt", package], "--apt", tmp_path)


def test_too_many_apt_names_are_refused(tmp_path: Path, docker_ready: None) -> None:
    packages = [arg for index in range(101) for arg in ("--apt", f"package{index}")]
    refused_before_building(["--name", "nbexec-attack", *packages], "at most 100", tmp_path)


@pytest.mark.parametrize(("content", "expected"), [
    pytest.param(b"--index-url http://127.0.0.1:9/simple\niniconfig\n", "line 1: options", id="index-url"),
    pytest.param(b"iniconfig\n--extra-index-url=http://127.0.0.1:9/\n", "line 2: options", id="extra-index"),
    pytest.param(b"-e git+https://127.0.0.1:9/x.git#egg=x\n", "line 1: options", id="editable"),
    pytest.param(b"-r /etc/passwd\n", "line 1: options", id="include"),
    pytest.param(b"--trusted-host evil.example\n", "line 1: options", id="trusted-host"),
    pytest.param(b"iniconfig @ https://127.0.0.1:9/iniconfig.whl\n", "direct reference", id="url"),
    pytest.param(b"iniconfig @ file:///etc/passwd\n", "direct reference", id="file-url"),
    pytest.param(b"./local/package\n", "not a requirement", id="local-path"),
    pytest.param(b"iniconfig==2.0.0 --hash=sha256:00\n", "not a requirement", id="per-line-option"),
    pytest.param(b"iniconfig; $(id)\n", "not a requirement", id="shell-in-marker"),
    pytest.param(b"iniconfig \\\n==2.0.0\n", "not a requirement", id="continuation"),
    pytest.param(b"inicon\xfffig\n", "not UTF-8", id="not-utf8"),
    pytest.param(b"iniconfig\x00\n", "not a requirement", id="nul"),
    pytest.param(b"x" * (64 * 1024 + 1), "larger than", id="oversized"),
    pytest.param(b"".join(f"package{i}\n".encode() for i in range(201)), "at most 200", id="too-many"),
])
def test_bad_requirements_are_refused_before_any_build(content: bytes, expected: str, tmp_path: Path,
                                                       docker_ready: None) -> None:
    path = tmp_path / "requirements.txt"
    path.write_bytes(content)
    refused_before_building(["--name", "nbexec-attack", "--requirements", str(path)], expected, tmp_path)


@pytest.mark.parametrize(("path", "expected"), [
    pytest.param("/dev/zero", "not a regular file", id="endless-device"),
    pytest.param("/nonexistent/requirements.txt", "does not exist", id="missing"),
    pytest.param("/tmp", "not a regular file", id="folder"),
])
def test_requirements_that_are_not_a_file_are_refused(path: str, expected: str, tmp_path: Path,
                                                      docker_ready: None) -> None:
    refused_before_building(["--name", "nbexec-attack", "--requirements", path], expected, tmp_path)


@pytest.mark.parametrize(("base", "expected"), [
    pytest.param("nbexec-base:bookworm", "not an image nbexec built", id="debootstrapped-base"),
    pytest.param("python:3.12-slim", "is not here", id="registry-image"),
    pytest.param("nbexec-never-built", "is not built here", id="unbuilt-name"),
    pytest.param("127.0.0.1:9/evil:latest", "is not here", id="registry-address"),
])
def test_a_base_nbexec_did_not_build_is_refused(base: str, expected: str, tmp_path: Path, docker_ready: None) -> None:
    present = {t for i in daemon.connect().images.list() for t in i.tags}
    refused_before_building(["--name", "nbexec-attack", "--base", base, "--apt", "sudo"], expected, tmp_path)
    assert {t for i in daemon.connect().images.list() for t in i.tags} == present  # nothing pulled either


def test_a_named_image_keeps_no_set_id_file(named: Built, derived: Built) -> None:  # noqa: F811
    """sudo ships set-uid root; the named image strips it like the runtime image strips its own."""
    for built in (named, derived):
        found = as_root(built.tag, "find", "/", "-xdev", "-perm", "/6000", "-type", "f")
        assert found.split() == [], found
        assert as_root(built.tag, "stat", "-c", "%a %U", "/usr/bin/sudo").split() == ["755", "root"]


def as_root(tag: str, *command: str) -> str:
    """What ``command`` prints in a throwaway root container of ``tag`` (no network): the image seen from outside."""
    labels = {daemon.LABEL: "1", daemon.LABEL_OWNER: daemon.owner(), daemon.LABEL_ROLE: "control"}
    return str(daemon.connect().containers.run(tag, list(command), entrypoint=[], user="0:0", remove=True,
                                               network_mode="none", labels=labels).decode())


def test_requirements_reach_the_build_as_a_file_not_a_command(derived: Built) -> None:  # noqa: F811
    """DERIVED's requirement has a marker with `;`, `>` and quotes: spliced into a shell line it would end the
    command and redirect into a file named `=`; read from a file, it installs iniconfig and writes nothing else."""
    listing = as_root(derived.tag, "sh", "-c", "ls -A /mnt/data /opt/nbexec/named; python -c 'import iniconfig'")
    assert listing.split() == ["/mnt/data:", "/opt/nbexec/named:", "apt.txt", "ca-bundle.crt", "requirements.txt"]


CORE = ("capabilities", "setgid-root", "setuid-file", "write-rootfs", "read-shadow", "mount", "ptrace",
        "namespaces", "proc-sys", "mknod", "kernel-modules", "docker-socket", "host-files", "host-env",
        "http-exfiltration", "docker-bridge-host", "raw-socket", "fork-bomb", "memory-bomb", "fill-tmp",
        "outlives-cell", "daemonize", "symlink-to-host")
SUDO = Case("sudo-in-named-image", try_all(
    "checked(subprocess.run(['sudo', '-n', 'id', '-u'], capture_output=True, timeout=10).returncode)",
    "os.setuid(0)",
    prelude="import shutil\nassert shutil.which('sudo'), 'sudo is missing'\n"
            "print('set-id bits', oct(os.stat(shutil.which('sudo')).st_mode & 0o6000))\n"), denied)


@pytest.mark.parametrize("case", [c for c in CASES if c.id in CORE] + [SUDO], ids=lambda c: c.id)
def test_a_named_image_contains_the_hostile_programs(case: Case, named: Built, canary: Path,  # noqa: F811
                                                      listener: hostile.Listener, cleanup_ledger: None) -> None:
    run = hostile.prepare(case, listener)
    before = hashlib.sha256(canary.read_bytes()).hexdigest()
    config = hostile.contained_config(case, canary).replace(image=NAME, images=(NAME,))
    with created() as seen:
        result = nbexec.execute_notebook(run.code, config=config)
    case.check(result)
    if case is SUDO:
        assert "set-id bits 0o0" in result.stdout, result.stdout
    assert hashlib.sha256(canary.read_bytes()).hexdigest() == before
    assert "s3cret-canary" not in json.dumps(result.to_dict())
    assert listener.got(run.token) == b"", "the host listener received data from the sandbox"
    pool.wait_for_teardown()
    sandboxes = seen.ids()
    assert sandboxes and all(daemon.connect().containers.list(all=True, filters={"id": s}) == [] for s in sandboxes)
    settle(lambda: not hostile.survivors(sandboxes, run.mark), 5)
    assert hostile.survivors(sandboxes, run.mark) == []


# -- the operator's list: a name not on it is refused at every door ---------------------------------------------

OFF_LIST = [
    pytest.param(DERIVED, id="built-but-not-allowed"),
    pytest.param("nbexec-base:bookworm", id="a-tag-of-this-engine"),
    pytest.param(f"nbexec-image-{NAME}:latest", id="the-tag-of-an-allowed-name"),
    pytest.param("python:3.12-slim", id="a-registry-tag"),
    pytest.param("../nbexec-test", id="traversal"),
    pytest.param("NBEXEC-TEST", id="another-case"),
    pytest.param("x" * 300, id="oversized"),
    pytest.param("", id="empty"),
]


@pytest.mark.parametrize("asked", OFF_LIST)
def test_the_library_refuses_an_image_off_the_list(asked: str) -> None:
    with pytest.raises(nbexec.ConfigError, match="NBEXEC_IMAGES"):
        nbexec.SandboxConfig(image=IMAGE, images=(NAME,)).choose_image(asked)
    if asked and ":" not in asked:  # a name in `image` itself must be on the list too
        with pytest.raises(nbexec.ConfigError):
            nbexec.SandboxConfig(image=asked, images=(NAME,))
    with pytest.raises(nbexec.ConfigError, match="NBEXEC_IMAGES"):
        nbexec.from_env({"NBEXEC_IMAGE": NAME, "NBEXEC_IMAGES": "other"})


def test_the_cli_refuses_an_image_off_the_list(tmp_path: Path, docker_ready: None) -> None:
    command = [sys.executable, "-m", "nbexec.cli", "run", "--image", NAME, "-"]
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "NBEXEC_IMAGE": IMAGE, "NBEXEC_IMAGES": DERIVED,
               "NBEXEC_POOL_SIZE": "0"}
    with created(daemon.LABEL) as seen, subprocess.Popen(
            command, env=environ, cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True) as process:
        stdout, stderr = process.communicate("print('ran')", timeout=120)
    assert process.returncode == 2 and "ran" not in stdout, (stdout, stderr)
    assert "NBEXEC_IMAGES" in stderr and NAME in stderr, stderr
    owner = f"{daemon.owner().rsplit(':', 1)[0]}:{process.pid}"
    assert seen.ids(owner) == [], "the refused run created a container"


def test_http_bodies_refuse_an_image_off_the_list(named: Built, cleanup_ledger: None) -> None:  # noqa: F811
    config = nbexec.SandboxConfig(image=IMAGE, images=(NAME,), pool_size=0, warm_imports=(), timeout=30)
    asked = [p.values[0] for p in OFF_LIST] + [123, ["x"], {"name": NAME}]
    before = set(own_containers())  # a pool_size=0 service makes no pool sandbox; earlier tests' pools are theirs
    with running(ServerSettings(config=config, tokens=(TOKEN_A,))) as service, service.client() as client:
        answers = [(value, client.post("/v1/execute", json={"code": "print('ran')", "image": value}),
                    client.post("/v1/sessions", json={"image": value})) for value in asked]
        made = sorted(set(own_containers()) - before)
    for value, one_shot, session in answers:
        expected = 422 if not isinstance(value, str) else 400
        assert (one_shot.status_code, session.status_code) == (expected, expected), (value, one_shot.text)
        if expected == 400:
            assert "NBEXEC_IMAGES" in one_shot.json()["detail"] and "ran" not in one_shot.text
    assert made == [], "a sandbox was started for a refused image"


def test_tool_arguments_refuse_an_image_off_the_list(config: nbexec.SandboxConfig) -> None:
    allowed = config.replace(images=(NAME,))
    for asked in [p.values[0] for p in OFF_LIST] + [7, ["x"]]:
        arguments = json.dumps({"code": "print('ran')", "image": asked})
        reply = handle_openai_tool_call({"id": "c", "function": {"arguments": arguments}}, config=allowed)
        assert reply["content"].startswith("Tool error:") and "ran" not in reply["content"], (asked, reply)
    assert own_containers(include_pool=True) == [], "a sandbox was started for a refused image"


def test_mcp_arguments_refuse_an_image_off_the_list(named: Built, docker_ready: None, tmp_path: Path) -> None:  # noqa: F811
    """The real `mcp` client against `nbexec mcp`: the listed schema offers the allowed names; a call naming any
    other image is a tool error that starts no sandbox; the connection's session keeps the image it started in."""
    from .test_mcp import _text, conversation

    probe = "import importlib.util\nprint(importlib.util.find_spec('tomli_w') is not None)"

    async def attack(server: Any, client: Any) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        listed = (await client.list_tools()).tools[0]
        seen["enum"] = listed.input_schema["properties"]["image"]["enum"]
        seen["refused"] = []
        for asked in [p.values[0] for p in OFF_LIST] + [7]:
            answer = await client.call_tool("execute_python", {"code": "print('ran')", "image": asked})
            seen["refused"].append((asked, answer.is_error, _text(answer)))
        seen["containers_after_refusals"] = server.containers()
        seen["named"] = _text(await client.call_tool("execute_python", {"code": probe, "image": NAME}))
        switched = await client.call_tool("execute_python", {"code": probe, "image": "default"})
        seen["switched"] = (switched.is_error, _text(switched))
        seen["kept"] = _text(await client.call_tool("execute_python", {"code": probe}))
        return seen

    seen, leaked = conversation(tmp_path, {"NBEXEC_IMAGES": NAME}, attack)
    assert seen["enum"] == ["default", NAME]
    for asked, is_error, text in seen["refused"]:
        assert is_error and "ran" not in text.split(), (asked, text)
    assert seen["containers_after_refusals"] == [], "a sandbox was started for a refused image"
    assert seen["named"].startswith("True") and seen["kept"].startswith("True"), seen
    assert seen["switched"][0] and "runs in image" in seen["switched"][1], seen["switched"]
    assert leaked == []
