"""The Docker engine: connect, translate its errors at the boundary, and find what nbexec left behind."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import docker
import docker.errors
import requests.exceptions

from .errors import DockerError, DockerUnavailableError, ImageNotFoundError

log = logging.getLogger(__name__)

LABEL = "nbexec"
LABEL_OWNER = "nbexec.owner"  # "<hostname>:<pid>" of the process that made the container
LABEL_ROLE = "nbexec.role"  # "pool", "oneshot" or "session"
_lock = threading.Lock()
_client: docker.DockerClient | None = None


def owner() -> str:
    """This process as written on the containers it makes."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _where() -> str:
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def _unavailable(exc: BaseException) -> DockerUnavailableError:
    return DockerUnavailableError(
        f"Docker is not reachable at {_where()} ({exc.__class__.__name__}). "
        "Start Docker (e.g. `sudo systemctl start docker`, or `dockerd &`) or set DOCKER_HOST, "
        "then check with `nbexec doctor`."
    )


def connect() -> docker.DockerClient:
    """Return the process-wide Docker client, made on first use from DOCKER_HOST and friends."""
    global _client
    with _lock:
        if _client is None:
            try:
                client = docker.from_env(timeout=120, max_pool_size=64)
                client.ping()
            except (docker.errors.DockerException, requests.exceptions.RequestException, OSError) as exc:
                raise _unavailable(exc) from exc
            _client = client
        return _client


@contextlib.contextmanager
def translated(action: str) -> Iterator[None]:
    """Turn docker-py and requests errors raised inside into nbexec errors naming ``action``."""
    try:
        yield
    except docker.errors.ImageNotFound as exc:
        raise ImageNotFoundError(
            f"The runtime image is missing ({exc.explanation}). Build it with `nbexec image build` "
            "(or `nbexec image build --debootstrap` where no registry is reachable)."
        ) from exc
    except (requests.exceptions.ConnectionError, ConnectionError) as exc:
        raise _unavailable(exc) from exc
    except requests.exceptions.ReadTimeout as exc:
        raise DockerError(f"Docker did not answer in time while trying to {action}; is the engine overloaded?") from exc
    except docker.errors.APIError as exc:
        raise DockerError(f"Docker refused to {action}: {exc.explanation or exc}") from exc
    except docker.errors.DockerException as exc:
        raise DockerError(f"Docker failed to {action}: {exc}") from exc


def require_image(client: docker.DockerClient, image: str) -> None:
    """Raise ImageNotFoundError with the build command when ``image`` is not present."""
    with translated(f"look up image {image}"):
        client.images.get(image)


@dataclass(frozen=True)
class Leftover:
    """A container nbexec made that was removed by `cleanup`."""

    id: str
    name: str
    owner: str
    role: str


def _owner_alive(owner_label: str) -> bool:
    host, _, pid = owner_label.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return True  # another machine's: not ours to judge
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup(client: docker.DockerClient, *, everything: bool = False) -> list[Leftover]:
    """Remove nbexec containers whose owning process is gone (or all of them with ``everything``)."""
    removed: list[Leftover] = []
    with translated("list nbexec containers"):
        containers = client.containers.list(all=True, filters={"label": LABEL})
    for container in containers:
        labels = container.labels
        owner_label = labels.get(LABEL_OWNER, "")
        if not everything and owner_label and _owner_alive(owner_label):
            continue
        with contextlib.suppress(docker.errors.NotFound), translated("remove a leftover container"):
            container.remove(force=True)
        removed.append(Leftover(container.id[:12], container.name, owner_label, labels.get(LABEL_ROLE, "")))
    return removed
