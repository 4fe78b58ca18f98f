"""The E2B door with E2B's npm SDKs (`e2b`, `@e2b/code-interpreter`, the versions scripts/test-tools pins),
unmodified, run by the machine's Node against a real `nbexec serve`: tests/e2b_js/*.mjs print what they saw."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from .conftest import own_containers
from .test_e2b import door  # noqa: F401  (the module's service)
from .test_server import TOKEN_A, Running

TOOLS = Path(__file__).parent.parent / ".tools"
SCRIPTS = Path(__file__).parent / "e2b_js"


def node(script: str, service: Running) -> dict[str, object]:
    assert (TOOLS / "node_modules" / "@e2b" / "code-interpreter").is_dir(), \
        "E2B's npm SDKs are missing: scripts/setup.sh --test installs them into .tools/"
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(E2B_API_URL=f"{service.url}/e2b", E2B_SANDBOX_URL=f"{service.url}/e2b/sandbox", E2B_API_KEY=TOKEN_A)
    # Node resolves bare imports from the script's folder upwards: the script runs from a copy inside .tools/.
    copy = TOOLS / f"nbexec-{script}"
    shutil.copyfile(SCRIPTS / script, copy)
    try:
        done = subprocess.run(["node", str(copy)], env=env, capture_output=True, text=True, timeout=180)
    finally:
        copy.unlink()
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_the_typescript_sdk_drives_a_sandbox(door: Running) -> None:  # noqa: F811
    seen = node("lifecycle.mjs", door)
    assert seen["text"] == "42" and seen["stdout"] == ["from ts\n"] and seen["error"] == "ZeroDivisionError"
    assert seen["metadata"] == {"lang": "ts"} and seen["state"] == "running" and seen["listed"] is True
    assert seen["running"] is True and seen["paused"] is True and seen["afterResume"] == "42"
    assert "template 'nope' not found" in str(seen["unknownTemplate"])
    assert seen["command"] == "42\n/home/user\n" and seen["exitCode"] == 3
    assert seen["file"] == "from ts" and "ts.txt" in seen["listedFiles"]  # type: ignore[operator]
    assert seen["killed"] is True and seen["killedAgain"] is False
    assert not own_containers()
