"""The Docker engine: connect, translate its errors at the boundary, and find what nbexec left behind."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import docker
import docker.errors
import requests.exceptions

from nbexec.config import DEFAULT_IMAGE
from nbexec.errors import ConfigError, DockerError, DockerUnavailableError, ImageNotFoundError, NbexecError
from nbexec.files import statefolder
from nbexec.hostconfig import host_from_env

log = logging.getLogger(__name__)

LABEL = "nbexec"
LABEL_NODE = "nbexec.node"  # the nbexec instance's node name (NBEXEC_NODE_NAME, default the hostname)
LABEL_OWNER = "nbexec.owner"  # "<node>:<pid>" of the process that made the container
LABEL_OWNER_START = "nbexec.owner.start"  # "<boot id>/<start time>" of that process: a reused pid is another owner
LABEL_STATE = "nbexec.state"  # "<identity>:<path>" of the state folder that keeps it past its owner (durable sessions)
LABEL_ROLE = "nbexec.role"  # "pool", "oneshot" or "session"
_lock = threading.Lock()
_client: docker.DockerClient | None = None
_root: Path | None = None


def node() -> str:
    """This nbexec instance's node name."""
    return host_from_env().node_name


def owner() -> str:
    """This process as written on the containers it makes."""
    return f"{node()}:{os.getpid()}"


def process_identity(pid: Any) -> tuple[int, str] | None:
    """(pid, boot id and start time) of a host process, or None when it does not exist here: the one form a
    sandbox's init process is recorded and compared in."""
    start = process_start(pid) if isinstance(pid, int) and pid > 0 else None
    return (pid, start) if start is not None else None


def process_start(pid: int) -> str | None:
    """``"<boot id>/<start time in clock ticks>"`` of a process in this pid namespace, or None when none runs.

    A service restarted in a container is PID 1 again: its start time tells the new instance from the old."""
    try:
        stat_fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except (OSError, IndexError):
        return None
    return f"{boot}/{stat_fields[19]}"


def owner_labels() -> dict[str, str]:
    """The labels that mark a container as made by this process of this node."""
    found = {LABEL: "1", LABEL_NODE: node(), LABEL_OWNER: owner()}
    start = process_start(os.getpid())
    if start:
        found[LABEL_OWNER_START] = start
    return found


def claim_labels(claim: str) -> dict[str, str]:
    """The labels of a sandbox a state folder keeps (none without a ``claim``): the claim, and an owner that is no
    process (so no sweep, nor an older nbexec's, judges it by a pid: its state folder does)."""
    return {LABEL_STATE: claim, LABEL_OWNER: f"{node()}:state", LABEL_OWNER_START: ""} if claim else {}


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
        raise ImageNotFoundError(_missing_image(str(exc.explanation or exc))) from exc
    except (requests.exceptions.ConnectionError, ConnectionError) as exc:
        raise _unavailable(exc) from exc
    except requests.exceptions.ReadTimeout as exc:
        raise DockerError(f"Docker did not answer in time while trying to {action}; is the engine overloaded?") from exc
    except docker.errors.APIError as exc:
        beyond = _CPU_RANGE.search(str(exc.explanation or ""))
        if beyond:  # the config asks more than the machine: the user's to change, not a failure of Docker
            raise ConfigError(f"cpus (--cpus, NBEXEC_CPUS) is more than this machine's {beyond.group(1)} CPUs: give "
                              f"at most {beyond.group(1)}") from exc
        raise DockerError(f"Docker refused to {action}: {exc.explanation or exc}") from exc
    except docker.errors.DockerException as exc:
        raise DockerError(f"Docker failed to {action}: {exc}") from exc


_CPU_RANGE = re.compile(r"Range of CPUs is from [\d.]+ to [\d.]+, as there (?:are|is) only (\d+) CPU")


_NO_SUCH_IMAGE = re.compile(r"No such image: (\S+)")


def _missing_image(explanation: str) -> str:
    """Say which image is not here and what to do: choose one that is (a mistyped --image), or build the runtime
    image when it is the one missing or none is here."""
    found = _NO_SUCH_IMAGE.search(explanation)
    name = found.group(1) if found else None
    present = _present_images()
    build = ("Build the runtime image with `nbexec image build` (or `nbexec image build --debootstrap` where no "
             "registry is reachable).")
    said = f"The image {name} is not here." if name else f"The runtime image is missing ({explanation})."
    if name not in (None, DEFAULT_IMAGE) and present:  # another image was asked for: the fix is to choose
        return f"{said} {present}".rstrip()
    return f"{said} {present}{build}"


def _present_images() -> str:
    """The runtime images this engine has (nbexec's label), as a sentence naming the option that chooses one."""
    with contextlib.suppress(NbexecError, docker.errors.DockerException, requests.exceptions.RequestException,
                             OSError):
        found = sorted({tag for image in connect().images.list(filters={"label": "io.nbexec.role=runtime"})
                        for tag in image.tags})
        if found:
            shown = ", ".join(found[:12]) + (f" and {len(found) - 12} more" if len(found) > 12 else "")
            return f"Images here: {shown} (choose one with --image or NBEXEC_IMAGE; `nbexec image list`). "
    return ""


_STAMP = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?\d*(Z|[+-]\d\d:\d\d)")


def _epoch(stamp: str) -> str:
    """One of the engine's RFC 3339 times (nanoseconds, any zone) as the "seconds.nanoseconds" its events API
    reads (it takes such a time as a bare number otherwise)."""
    found = _STAMP.fullmatch(stamp)
    if found is None:
        raise DockerError(f"the engine gave a time nbexec cannot read: {stamp[:60]!r}")
    whole, fraction, zone = found.groups()
    seconds = datetime.fromisoformat(whole + ("+00:00" if zone == "Z" else zone)).timestamp()
    return f"{int(seconds)}.{(fraction or '').ljust(9, '0')}"


def oom_reported(container: Any) -> bool:
    """Whether the engine reported an OOM kill in this stopped container since it started.

    Its OOMKilled flag misses a kill the runtime reports after the exit: under gVisor the `oom` event can come a
    few milliseconds after `die` (about 1 run in 6 under load), and the engine keeps the flag it had at the exit.
    The event is read from the engine's recent history (its last 256 events), within seconds of the exit."""
    started = container.attrs.get("State", {}).get("StartedAt", "")
    with contextlib.suppress(DockerError), translated("read a sandbox's events"):
        until = _epoch(container.client.info()["SystemTime"])
        found = container.client.events(since=_epoch(started), until=until, decode=True,
                                        filters={"container": container.id, "event": "oom"})
        return any(True for _ in found)
    return False


def root_dir() -> Path:
    """The engine's data root (``docker info``'s DockerRootDir), where it keeps each container's checkpoints."""
    global _root
    if _root is None:
        with translated("ask the Docker engine for its data root"):
            _root = Path(connect().info()["DockerRootDir"])
    return _root


def checkpoint_refusal(client: docker.DockerClient | None = None) -> str:
    """Why this engine serves no ``docker checkpoint`` ("" when it does), asked of the route itself.

    Never judged from ``docker info``: after a reload its ExperimentalBuild says true, but the engine adds the
    checkpoint routes only when it starts and answers 501 until a restart. A 404 (no such container) means the
    route is there."""
    client = client or connect()
    with translated("ask the Docker engine whether it can checkpoint"):
        url = client.api._url("/containers/{0}/checkpoints", "nbexec-checkpoint-route-probe")
        status = client.api._get(url).status_code
    if status in (200, 404):
        return ""
    return (f"the engine's checkpoint route answers {status} (\"experimental\": true in daemon.json is read only "
            "when the engine starts): restart the engine (`sudo systemctl restart docker`, or "
            "`sudo scripts/setup-gvisor.sh --restart`)")


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


def _owner_alive(found: dict[str, str]) -> bool:
    """Whether the process that made a container (by its labels) still runs; other nodes' always count as alive."""
    host, _, pid = found.get(LABEL_OWNER, "").rpartition(":")
    if found.get(LABEL_STATE) and (found.get(LABEL_NODE) or host) == node():
        return statefolder.claim_alive(found[LABEL_STATE])  # its state folder judges (nbexec.files.statefolder)
    if (found.get(LABEL_NODE) or host) != node() or not pid.isdigit():
        return True  # another node's: not ours to judge
    start = found.get(LABEL_OWNER_START)
    if start is not None and Path("/proc/self/stat").exists():
        return process_start(int(pid)) == start
    try:  # made by an nbexec without start labels, or no /proc here
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _mounts_from(container: Any, folders: Sequence[Path]) -> bool:
    sources = [Path(m.get("Source", "")) for m in container.attrs.get("Mounts") or []]
    return any(source == folder or folder in source.parents for source in sources for folder in folders)


def cleanup(client: docker.DockerClient, *, everything: bool = False,
            mounting: Sequence[Path] = ()) -> list[Leftover]:
    """Remove nbexec containers whose owning process is gone, those that mount a folder in ``mounting`` (being
    deleted), or all of them with ``everything``."""
    removed: list[Leftover] = []
    with translated("list nbexec containers"):
        # sparse: the list call alone, so a container removed meanwhile cannot fail a per-container inspect
        containers = client.containers.list(all=True, sparse=True, filters={"label": LABEL})
    for container in containers:
        labels = container.attrs.get("Labels") or {}
        owner_label = labels.get(LABEL_OWNER, "")
        if not everything and owner_label and _owner_alive(labels) and not _mounts_from(container, mounting):
            continue
        with contextlib.suppress(docker.errors.NotFound), translated("remove a leftover container"):
            container.remove(force=True)
        name = (container.attrs.get("Names") or ["/"])[0].lstrip("/")
        removed.append(Leftover(container.id[:12], name, owner_label, labels.get(LABEL_ROLE, "")))
    return removed
