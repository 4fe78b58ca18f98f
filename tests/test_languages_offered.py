"""A language asked for through the doors strangers use (issue #28): an HTTP body, an LLM tool's arguments, an MCP
call, and a node asked by another host. What is offered is the operator's choice (``languages``,
NBEXEC_LANGUAGES): the policy and the schemas are checked pure; then each door on real Docker, judged by where the
code ran (its kernel's own output), what was refused (the answer, and that no sandbox started) and what is left.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

import nbexec
from nbexec.errors import ConfigError
from nbexec.integrations import tools
from nbexec.integrations.toolcall import handle_openai_tool_call, parse_arguments
from nbexec.sandbox.remote import source as remote_source
from nbexec.service.settings import ServerSettings

from . import cluster
from .conftest import IMAGE, KERNELS, own_containers, wait_until
from .test_server import TOKEN_A, running

# -- the policy (pure) --------------------------------------------------------------------------------------------

OFFERING = nbexec.SandboxConfig(languages=("bash", "R"))
# Each shape of a language nobody offered: unknown, empty, a NUL, case games on an unknown name, the wrong types.
HOSTILE = ["deno", "ts", "cobol", "", "bash\0", "BASH ", "python2", 3, ["bash"], {"name": "bash"}, True]


def test_the_offered_languages_are_normalised_and_checked() -> None:
    assert OFFERING.languages == ("bash", "r")
    assert nbexec.config.from_env({"NBEXEC_LANGUAGES": "sh, r,bash"}).languages == ("bash", "r")
    with pytest.raises(ConfigError, match="languages entry 'cobol'"):
        nbexec.SandboxConfig(languages=("cobol",))


@pytest.mark.parametrize("asked", [None, "python", "py", "bash", "sh", "r", "R", "ir"], ids=str)
def test_an_offered_language_is_chosen(asked: Any) -> None:
    chosen = OFFERING.offer_language(asked)
    assert chosen.language == {None: "python", "py": "python", "sh": "bash", "R": "r", "ir": "r"}.get(asked, asked)


@pytest.mark.parametrize("asked", HOSTILE, ids=repr)
def test_a_language_not_offered_is_refused_naming_what_is(asked: Any) -> None:
    with pytest.raises(ConfigError, match=r"offers python, bash, r|not a language nbexec runs"):
        OFFERING.offer_language(asked)
    with pytest.raises(ConfigError):
        nbexec.SandboxConfig().offer_language("bash")  # nothing offered: only the configured language


def test_offering_only_the_default_language_offers_nothing_to_choose() -> None:
    alone = nbexec.SandboxConfig(languages=("python",))
    assert tools.offered(alone) == () and "language" not in tools.json_schema(languages=tools.offered(alone))[
        "properties"] and "language argument" not in tools.description(alone)


def test_an_allowlist_policy_cannot_offer_a_language_it_cannot_serve() -> None:
    with pytest.raises(ConfigError, match=r"allowlist.*Python-only.*bash is offered"):
        nbexec.SandboxConfig(network="allowlist", allowed_hosts=("example.com",), languages=("bash",))


@pytest.mark.parametrize(("language", "traceback", "said"), [
    ("r", ("Error in g(): deep", "1. f()", "2. g()"), "deep"),
    ("deno", ("TypeError: deep value", "    at f (<anonymous>:2:3)", "    at <anonymous>:4:1"), "deep value"),
    ("bash", (), "2"),
])
def test_the_model_is_told_another_languages_error_message(language: str, traceback: tuple[str, ...],
                                                          said: str) -> None:
    from nbformat import v4

    from nbexec.result import CellError, ExecutionResult

    error = CellError(ename={"r": "ERROR", "deno": "TypeError", "bash": ""}[language],
                      evalue={"r": "deep", "deno": "deep value", "bash": "2"}[language], traceback=traceback,
                      kind="exception", cell_index=0)
    shown = tools.render_for_llm(ExecutionResult(
        ok=False, execution_id="x", stdout="", stderr="", text="", error=error, outputs=(), images=(), files=(),
        skipped_files=(), notebook=v4.new_notebook(), notebook_path=None, output_dir="/o", duration_s=0.0,
        timings={}))
    assert said in shown and all(line.strip() in shown for line in traceback), shown


def test_the_tool_schemas_offer_exactly_the_offered_languages() -> None:
    for schema in (tools.openai_tool(OFFERING)["function"]["parameters"],
                   tools.anthropic_tool(OFFERING)["input_schema"],
                   tools.json_schema(languages=tools.offered(OFFERING))):
        assert schema["properties"]["language"]["enum"] == ["python", "bash", "r"]
        assert "language" not in schema["required"]
    plain = tools.openai_tool(nbexec.SandboxConfig())
    assert "language" not in plain["function"]["parameters"]["properties"]
    assert tools.openai_tool(OFFERING, api="responses")["strict"] is False  # an optional property: not strict
    said = tools.description(OFFERING)
    assert "language argument" in said and "bash (Bash)" in said and "r (R)" in said


def test_a_tool_for_another_language_describes_that_language() -> None:
    said = tools.description(nbexec.SandboxConfig(language="r"))
    assert said.startswith("Execute R code") and "%pip" not in said and "plt.show" not in said
    assert "numpy" not in said


@pytest.mark.parametrize("asked", [3, ["bash"], {"name": "bash"}, True], ids=repr)
def test_tool_arguments_with_a_language_of_the_wrong_type_are_refused(asked: Any) -> None:
    arguments, problem = parse_arguments({"code": "echo 1", "language": asked})
    assert arguments is None and problem is not None and '"language"' in problem


@pytest.mark.parametrize("asked", ["deno", "cobol", "", "bash\0"], ids=repr)
def test_a_model_asking_for_a_language_not_offered_starts_nothing(cleanup_ledger: None, docker_ready: None,
                                                                 asked: str) -> None:
    before = own_containers(include_pool=True)
    reply = handle_openai_tool_call({"id": "c", "function": {"arguments": json.dumps(
        {"code": "echo ran", "language": asked})}}, config=OFFERING.replace(image=IMAGE, pool_size=0))
    assert reply["content"].startswith("Tool error:") and "ran" not in reply["content"].split(), reply
    assert own_containers(include_pool=True) == before, "a sandbox was started for a refused language"


# -- the doors on real Docker -------------------------------------------------------------------------------------

def _config(**changes: Any) -> nbexec.SandboxConfig:
    return nbexec.SandboxConfig(image=IMAGE, kernels_image=KERNELS, pool_size=0, warm_imports=(), timeout=30,
                                interrupt_grace=2, **changes)


def test_a_model_runs_an_offered_language_and_its_session_keeps_it(cleanup_ledger: None, kernels_image: str) -> None:
    from nbexec import SessionManager
    from nbexec.integrations.toolcall import handle_anthropic_tool_use

    def call(arguments: dict[str, Any]) -> str:
        block = {"type": "tool_use", "id": "t", "name": "execute_python", "input": arguments}
        reply = handle_anthropic_tool_use(block, sessions=manager)
        return "\n".join(part.get("text", "") for part in reply["content"]) if isinstance(reply["content"], list) \
            else str(reply["content"])

    with SessionManager(config=_config(languages=("bash",))) as manager:
        first = call({"code": "kept=41; echo ran-in-${BASH_VERSION:+bash}", "language": "bash"})
        session_id = first.split("session_id: ")[1].split(";")[0]
        assert "ran-in-bash" in first, first
        again = call({"code": "echo $((kept + 1))", "session_id": session_id})
        assert "42" in again, again
        switched = call({"code": "print(1)", "session_id": session_id, "language": "python"})
        assert "runs bash code" in switched, switched


@pytest.fixture(scope="module")
def offering_service(docker_ready: None, kernels_image: str) -> Any:
    settings = ServerSettings(config=_config(languages=("bash", "r")), tokens=(TOKEN_A,), max_sessions_per_token=2,
                              max_running_per_token=1, max_body=1024 * 1024)
    with running(settings) as service:
        yield service


def test_an_http_client_runs_an_offered_language(offering_service: Any) -> None:
    with offering_service.client() as client:
        ran = client.post("/v1/execute", json={"code": "echo $((6 * 7)) from ${BASH_VERSION:+bash}",
                                               "language": "sh"})
        assert ran.status_code == 200 and ran.json()["ok"], ran.text
        assert ran.json()["stdout"].split() == ["42", "from", "bash"]
        made = client.post("/v1/sessions", json={"language": "R"})
        assert made.status_code == 201 and made.json()["language"] == "r", made.text
        route = f"/v1/sessions/{made.json()['id']}"
        try:
            assert client.post(f"{route}/execute", json={"code": "kept <- 41"}).json()["ok"]
            said = client.post(f"{route}/execute", json={"code": "cat(kept + 1, R.version$language)"}).json()
            assert said["stdout"] == "42 R", said
            refused = client.post(f"{route}/execute", json={"code": "1", "packages": ["tabulate"]})
            assert refused.status_code == 400 and "Python-only" in refused.json()["detail"], refused.text
            for other in ("bash", "python", "deno"):  # offered, the default, not offered: none is this session's
                switched = client.post(f"{route}/execute", json={"code": "cat('ran')", "language": other})
                assert switched.status_code == 400 and "ran" not in switched.text.split(), switched.text
            assert client.post(f"{route}/execute", json={"code": "cat(kept)", "language": "R"}).json()["stdout"] \
                == "41"
            snapshot = client.post(f"{route}/snapshot").json()["snapshot"]
            mixed = client.post("/v1/sessions", json={"from_snapshot": snapshot, "language": "bash"})
            assert mixed.status_code == 400 and "omit image and language" in mixed.text, mixed.text
        finally:
            client.delete(route)


@pytest.mark.parametrize("asked", HOSTILE, ids=repr)
def test_an_http_client_asking_for_a_language_not_offered_starts_nothing(offering_service: Any,
                                                                         asked: Any) -> None:
    before = own_containers(include_pool=True)
    with offering_service.client() as client:
        for route in ("/v1/execute", "/v1/sessions"):
            answer = client.post(route, json={"code": "echo ran", "language": asked})
            if isinstance(asked, str):  # a name: refused by the policy, which says why
                assert answer.status_code == 400, (route, answer.text)
                assert re.search("not offered here|not a language nbexec runs", answer.json()["detail"]), answer.text
            else:  # the wrong JSON type: refused by the schema
                assert answer.status_code == 422, (route, answer.text)
            assert "ran" not in answer.text.split()
    assert own_containers(include_pool=True) == before, "a sandbox was started for a refused language"


@pytest.fixture(scope="module")
def bash_node(docker_ready: None, kernels_image: str) -> Any:
    with cluster.running_node("L", {"NBEXEC_POOL_SIZE": "0", "NBEXEC_LANGUAGES": "bash",
                                    "NBEXEC_KERNELS_IMAGE": kernels_image, "NBEXEC_IMAGE": IMAGE}) as server:
        yield server


@pytest.fixture
def on_bash_node(bash_node: cluster.Server, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("NBEXEC_NODES", bash_node.url)
    monkeypatch.setenv("NBEXEC_NODE_TOKEN", cluster.NODE_TOKEN)
    remote_source.forget_all()
    yield bash_node
    remote_source.forget_all()


def test_a_session_on_a_node_runs_the_language_the_node_offers(on_bash_node: cluster.Server) -> None:
    with nbexec.Session(_config(language="bash", source="remote")) as session:
        assert session.run("kept=41").ok
        said = session.run("echo $((kept + 1)) ${BASH_VERSION:+bash}")
        assert said.ok and said.text.split() == ["42", "bash"], said
        assert on_bash_node.containers(), "the session did not run on the node"
    with pytest.raises(nbexec.errors.NotOfferedError, match="language r is not offered"):
        nbexec.execute_notebook("cat(1)", config=_config(language="r", source="remote"))


def test_a_node_that_starts_another_kernel_is_refused_and_its_sandbox_released(
        on_bash_node: cluster.Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node that ignores the language (an older one) would run bash code in Python: the host checks the kernel
    the node started, releases that sandbox, and runs nothing."""
    monkeypatch.setattr(remote_source, "image_body", lambda config: {})
    with pytest.raises(nbexec.errors.NotOfferedError, match="started a 'python' kernel for bash code"):
        nbexec.execute_notebook("echo ran", config=_config(language="bash", source="remote"))
    wait_until(lambda: not on_bash_node.containers(), 60, "the refused sandbox was not released")


@pytest.fixture(scope="module")
def bash_default_node(docker_ready: None, kernels_image: str) -> Any:
    """A node whose own language is bash and that offers nothing else (not even Python)."""
    with cluster.running_node("B", {"NBEXEC_POOL_SIZE": "0", "NBEXEC_LANGUAGE": "bash",
                                    "NBEXEC_KERNELS_IMAGE": kernels_image, "NBEXEC_IMAGE": IMAGE}) as server:
        yield server


PYTHON_SAYS = "import sys; print('python', sys.version_info[0])"


def test_python_code_never_runs_in_a_nodes_other_default_kernel(bash_default_node: cluster.Server,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NBEXEC_NODES", bash_default_node.url)
    monkeypatch.setenv("NBEXEC_NODE_TOKEN", cluster.NODE_TOKEN)
    remote_source.forget_all()
    try:
        with pytest.raises(nbexec.errors.NotOfferedError, match="language python is not offered"):
            nbexec.execute_notebook(PYTHON_SAYS, config=_config(source="remote"))
        monkeypatch.setattr(remote_source, "image_body", lambda config: {})  # a host that does not say: bash starts
        with pytest.raises(nbexec.errors.NotOfferedError, match="started a 'bash' kernel for python code"):
            nbexec.execute_notebook(PYTHON_SAYS, config=_config(source="remote"))
        wait_until(lambda: not bash_default_node.containers(), 60, "the refused sandbox was not released")
    finally:
        remote_source.forget_all()


def test_a_language_one_node_lacks_runs_on_another_that_has_it(bash_default_node: cluster.Server,
                                                              bash_node: cluster.Server,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Python on a bash-only node and a Python node: the first refuses it, the second runs it, and the refusal does
    not put the first out of rotation (bash still runs there). The bash-only node is asked first each time (the
    order by capacity alone may never ask it, and then proves nothing)."""
    monkeypatch.setenv("NBEXEC_NODES", f"{bash_default_node.url},{bash_node.url}")
    monkeypatch.setenv("NBEXEC_NODE_TOKEN", cluster.NODE_TOKEN)
    candidates, asked_first = remote_source.Cluster.candidates, []

    def refusing_node_first(self: remote_source.Cluster) -> list[Any]:
        order = sorted(candidates(self), key=lambda client: client.url != bash_default_node.url)
        asked_first.append(order[0].url)
        return order

    monkeypatch.setattr(remote_source.Cluster, "candidates", refusing_node_first)
    remote_source.forget_all()
    try:
        for _ in range(3):
            ran = nbexec.execute_notebook(PYTHON_SAYS, config=_config(source="remote"))
            assert ran.ok and ran.text.strip() == "python 3", ran
        assert asked_first == [bash_default_node.url] * 3, asked_first
        health = remote_source.RemoteSource.from_env().cluster.health
        assert all(h.failures == 0 for h in health.values()), "a refusal marked a node as failing"
    finally:
        remote_source.forget_all()


def test_a_snapshot_restores_for_a_caller_only_in_a_language_still_offered(cleanup_ledger: None, kernels_image: str,
                                                                          tmp_path: Path) -> None:
    """The service and MCP restore under the policy as it is now: a bash snapshot made while bash was offered is
    refused once it is not (no sandbox starts), and restores in bash while it is."""
    with nbexec.Session(_config(language="bash")) as session:
        assert session.run("kept=41").ok
        snapshot = session.snapshot(snapshot_dir=tmp_path)
    before = own_containers(include_pool=True)
    with pytest.raises(nbexec.errors.NotOfferedError, match="language bash is not offered"):
        nbexec.Session.from_snapshot(snapshot, snapshot_dir=tmp_path, policy=_config())
    assert own_containers(include_pool=True) == before, "a sandbox was started for a refused snapshot"
    with nbexec.Session.from_snapshot(snapshot, snapshot_dir=tmp_path, policy=_config(languages=("bash",))) as again:
        said = again.run("echo $((kept + 1)) ${BASH_VERSION:+bash}")
        assert said.ok and said.text.split() == ["42", "bash"], said


def test_mcp_offers_exactly_the_offered_languages_and_a_conversation_keeps_its_own(kernels_image: str,
                                                                                   tmp_path: Path) -> None:
    """The real `mcp` client against `nbexec mcp` offering bash: the listed schema's enum; a call in bash runs in
    bash; a call naming no language keeps it; one naming another, or one not offered, is a tool error that starts
    nothing; a restored snapshot says its language."""
    from .security.test_mcp import _text, conversation

    said = "echo ran-in-${BASH_VERSION:+bash}"

    async def talk(server: Any, client: Any) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        listed = {tool.name: tool for tool in (await client.list_tools()).tools}
        seen["enum"] = listed["execute_python"].input_schema["properties"]["language"]["enum"]
        refused = []
        for asked in ("deno", "cobol", "", 7):
            answer = await client.call_tool("execute_python", {"code": said, "language": asked})
            refused.append((asked, answer.is_error, _text(answer)))
        seen["refused"], seen["containers_after_refusals"] = refused, server.containers()
        seen["bash"] = _text(await client.call_tool("execute_python", {"code": said, "language": "sh"}))
        seen["kept"] = _text(await client.call_tool("execute_python", {"code": said}))
        other = await client.call_tool("execute_python", {"code": "print('ran')", "language": "python"})
        seen["other"] = (other.is_error, _text(other))
        made = _text(await client.call_tool("snapshot_session", {}))
        seen["restored"] = _text(await client.call_tool("restore_session", {"snapshot_id": made}))
        return seen

    seen, leaked = conversation(tmp_path, {"NBEXEC_LANGUAGES": "bash", "NBEXEC_KERNELS_IMAGE": kernels_image}, talk)
    assert seen["enum"] == ["python", "bash"]
    for asked, is_error, text in seen["refused"]:
        assert is_error and "ran-in" not in text, (asked, text)
    assert seen["containers_after_refusals"] == [], "a sandbox was started for a refused language"
    assert "ran-in-bash" in seen["bash"] and "ran-in-bash" in seen["kept"], seen
    assert seen["other"][0] and "runs bash code" in seen["other"][1] and "ran" not in seen["other"][1].split()
    assert "the session runs bash code" in seen["restored"], seen["restored"]
    assert leaked == []
