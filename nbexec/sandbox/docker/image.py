"""The runtime image: build it (optionally on a locally made Debian base) and describe it."""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import docker
import docker.utils

from nbexec.config import DEFAULT_IMAGE
from nbexec.errors import ConfigError, DockerError

from . import daemon

log = logging.getLogger(__name__)

DEFAULT_BASE = "nbexec-base:bookworm"
# What Docker says when it cannot reach a registry at all (DNS, refused, timeouts, an intercepting proxy).
_NO_REGISTRY = re.compile(
    r"no such host|dial tcp|connection refused|i/o timeout|network is unreachable|handshake timeout|"
    r"server misbehaving|Client\.Timeout|certificate signed by unknown authority|no route to host|"
    r"temporary failure in name resolution",
    re.IGNORECASE,
)


def context_dir() -> Path:
    """The Dockerfile's folder: shipped inside the wheel, or environments/jupyter in a checkout."""
    package = Path(__file__).parent.parent.parent  # nbexec/
    for candidate in (package / "environment", package.parent / "environments" / "jupyter"):
        if (candidate / "Dockerfile").is_file():
            return candidate
    raise ConfigError("the runtime image's Dockerfile is missing from this installation of nbexec")


def make_base(tag: str = DEFAULT_BASE, *, mirror: str | None = None) -> str:
    """Create a Debian base image with debootstrap and `docker import` (no registry needed)."""
    script = context_dir() / "make-base.sh"
    args = ["sh", str(script), tag, "bookworm"] + ([mirror] if mirror else [])
    result = subprocess.run(args, check=False)
    if result.returncode != 0:
        raise DockerError(f"making the Debian base image failed (exit {result.returncode}); see the lines above")
    return tag


@dataclass(frozen=True)
class BuildOptions:
    """How to build the runtime image."""

    tag: str = DEFAULT_IMAGE
    base_image: str | None = None  # None: the Dockerfile's default (python:3.12-slim, from a registry)
    ca_bundle: Path | None = None  # extra CA certificates for pip inside the build
    no_cache: bool = False


def build(options: BuildOptions, progress: Callable[[str], None]) -> str:
    """Build the runtime image, reporting each build line to ``progress``; return the image id."""
    buildargs = {"BASE_IMAGE": options.base_image} if options.base_image else {}
    base = options.base_image or default_base(context_dir() / "Dockerfile")
    require_base(daemon.connect(), base, progress)
    return run_build(options, progress, dockerfile="Dockerfile", buildargs=buildargs, base=base)


def run_build(options: BuildOptions, progress: Callable[[str], None], *, dockerfile: str,
              buildargs: dict[str, str], base: str) -> str:
    """Build ``dockerfile`` of the image folder (a private copy, with the CA bundle) as ``options.tag``."""
    client = daemon.connect()
    with tempfile.TemporaryDirectory(prefix="nbexec-build-") as temp:
        context = Path(temp) / "context"
        shutil.copytree(context_dir(), context)
        if options.ca_bundle is not None:
            if not options.ca_bundle.is_file():
                raise ConfigError(f"--ca-bundle {options.ca_bundle} is not a file")
            shutil.copyfile(options.ca_bundle, context / "ca" / "ca-bundle.crt")
        image_id = ""
        with daemon.translated("build the runtime image"):
            for chunk in client.api.build(path=str(context), dockerfile=dockerfile, tag=options.tag,
                                          buildargs=buildargs, rm=True, forcerm=True, decode=True,
                                          nocache=options.no_cache):
                if "error" in chunk:
                    raise _build_error(base, str(chunk["error"]).strip())
                line = chunk.get("stream", "").rstrip()
                if line:
                    progress(line)
                if "aux" in chunk and "ID" in chunk["aux"]:
                    image_id = chunk["aux"]["ID"]
    return image_id


def default_base(dockerfile: Path) -> str:
    """The Dockerfile's default BASE_IMAGE (the one a build without --base-image starts from)."""
    match = re.search(r"^ARG BASE_IMAGE=(\S+)", dockerfile.read_text(encoding="utf-8"), re.MULTILINE)
    if match is None:
        raise ConfigError(f"{dockerfile} declares no default BASE_IMAGE")
    return match.group(1)


def require_base(client: docker.DockerClient, base: str, progress: Callable[[str], None]) -> None:
    """Make sure the base image is here, pulling it once; a registry out of reach is said plainly."""
    with daemon.translated(f"look up the base image {base}"):
        try:
            client.images.get(base)
            return
        except docker.errors.ImageNotFound:
            pass
    progress(f"pulling the base image {base}")
    repository, tag = docker.utils.parse_repository_tag(base)
    with daemon.translated(f"pull the base image {base}"):
        try:
            for chunk in client.api.pull(repository, tag=tag or "latest", stream=True, decode=True):
                if "error" in chunk:
                    raise _build_error(base, str(chunk["error"]).strip())
        except docker.errors.APIError as exc:
            raise _build_error(base, str(exc.explanation or exc)) from exc


def _build_error(base: str, detail: str) -> DockerError:
    if _NO_REGISTRY.search(detail):
        return DockerError(
            f"no container registry is reachable from this Docker engine, so the base image {base} cannot be "
            f"pulled ({detail}). Build without a registry: `nbexec image build --debootstrap` makes a Debian base "
            "locally with debootstrap (needs root and a Debian mirror), or load a base image and pass --base-image."
        )
    return DockerError(f"the image build failed: {detail}")


def exists(tag: str) -> bool:
    try:
        daemon.require_image(daemon.connect(), tag)
    except DockerError:
        return False
    return True


def describe(tag: str) -> dict[str, str]:
    """Id, creation time and size of an image (raises ImageNotFoundError when missing)."""
    client = daemon.connect()
    with daemon.translated(f"inspect image {tag}"):
        image = client.images.get(tag)
    attrs = image.attrs
    return {"id": image.id, "created": attrs.get("Created", ""), "size_mb": f"{attrs.get('Size', 0) / 1e6:.0f}"}
