"""Shared fixtures. Tests that need Docker use the real engine and the real runtime image; when either is
missing they fail with a message saying how to get it (they never skip silently)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

import nbexec
from nbexec import daemon, pool
from nbexec.sandbox import work_root

from . import azurite as azurite_module

FILES = Path(__file__).parent / "files"
IMAGE = os.environ.get("NBEXEC_IMAGE", nbexec.SandboxConfig().image)


def own_containers(*, include_pool: bool = False) -> list[str]:
    """Names of nbexec containers made by this test process."""
    client = daemon.connect()
    found = client.containers.list(all=True, filters={"label": f"{daemon.LABEL_OWNER}={daemon.owner()}"})
    return [c.name for c in found if include_pool or c.labels.get(daemon.LABEL_ROLE) != "pool"]


def own_workdirs() -> list[Path]:
    prefix = f"nbexec-{os.getpid()}-"
    return [p for p in work_root().iterdir() if p.name.startswith(prefix)]


@pytest.fixture(scope="session")
def docker_ready() -> None:
    """Fail (not skip) with instructions when Docker or the image is missing."""
    try:
        client = daemon.connect()
    except nbexec.DockerUnavailableError as exc:
        pytest.fail(f"these tests need a running Docker engine: {exc}", pytrace=False)
    try:
        client.images.get(IMAGE)
    except docker.errors.ImageNotFound:
        pytest.fail(f"these tests need the runtime image {IMAGE}: run `nbexec image build` "
                    "(or `nbexec image build --debootstrap` without a registry)", pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def _no_leftovers_at_end() -> Iterator[None]:
    yield
    pool.shutdown()
    nbexec.session.close_all()
    pool.wait_for_teardown()
    try:
        left = own_containers(include_pool=True)
    except nbexec.NbexecError:
        return
    assert left == [], f"containers left after the test session: {left}"


@pytest.fixture
def cleanup_ledger(docker_ready: None) -> Iterator[None]:
    """Fail the test that leaked a container or working folder (pool sandboxes excepted), and remove it."""
    yield
    pool.wait_for_teardown()
    deadline = time.monotonic() + 10
    while own_containers() and time.monotonic() < deadline:
        time.sleep(0.1)
    leaked = own_containers()
    for name in leaked:
        daemon.connect().containers.get(name).remove(force=True)
    assert leaked == [], f"the test leaked containers: {leaked}"


@pytest.fixture
def config(cleanup_ledger: None) -> nbexec.SandboxConfig:
    """A config for fast tests: a small warm pool without warm imports, a short time limit."""
    return nbexec.SandboxConfig(image=IMAGE, pool_size=2, warm_imports=(), timeout=30, interrupt_grace=3)


@pytest.fixture
def cold(cleanup_ledger: None) -> nbexec.SandboxConfig:
    """A config without a pool: every execution starts its own sandbox."""
    return nbexec.SandboxConfig(image=IMAGE, pool_size=0, timeout=30, interrupt_grace=3)


@pytest.fixture(scope="session")
def azurite() -> Iterator[azurite_module.Azurite]:
    """A real Azure Blob API (Azurite), started once for the test session."""
    binary = azurite_module.find_binary()
    if binary is None:
        pytest.fail("these tests need Azurite: run scripts/setup.sh (or `npm install --prefix .tools azurite`)",
                    pytrace=False)
    server = azurite_module.start(binary)
    yield server
    server.stop()
