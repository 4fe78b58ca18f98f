"""`nbexec image build` where no container registry answers: a plain message naming --debootstrap, quickly."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from nbexec.sandbox.docker import daemon, image

ROOT = Path(__file__).resolve().parent.parent
IMAGE = os.environ.get("NBEXEC_IMAGE", "nbexec-jupyter:latest")


@pytest.mark.parametrize("base", [
    pytest.param("127.0.0.1:9/none:latest", id="registry-refuses"),
    pytest.param("nbexec-no-such-host.invalid/none:latest", id="registry-name-unresolvable"),
])
def test_unreachable_registry_says_so_and_names_debootstrap(base: str, tmp_path: Path, docker_ready: None) -> None:
    tag = f"nbexec-jupyter:pk-unreachable-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", "from nbexec.cli.main import main; main()", "image", "build", "--base-image", base,
         "--tag", tag],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120,
        check=False,
    )
    elapsed = time.monotonic() - started
    assert done.returncode == 3, done.stdout + done.stderr
    assert "no container registry is reachable" in done.stderr, done.stderr
    assert "--debootstrap" in done.stderr and base in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert elapsed < 60, f"took {elapsed:.0f} s to give up"
    assert not image.exists(tag)


def test_present_base_is_used_without_a_pull(docker_ready: None) -> None:
    lines: list[str] = []
    image.require_base(daemon.connect(), IMAGE, lines.append)
    assert lines == []


def test_dockerfile_default_base_is_read_from_the_dockerfile() -> None:
    assert image.default_base(image.context_dir() / "Dockerfile") == "python:3.12-slim"
