"""The runtime image: build it (optionally on a locally made Debian base) and describe it."""

from __future__ import annotations

import logging
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import daemon
from .config import DEFAULT_IMAGE
from .errors import ConfigError, DockerError

log = logging.getLogger(__name__)

DEFAULT_BASE = "nbexec-base:bookworm"


def context_dir() -> Path:
    """The Dockerfile's folder: shipped inside the wheel, or environments/jupyter in a checkout."""
    for candidate in (Path(__file__).parent / "environment", Path(__file__).parent.parent / "environments" / "jupyter"):
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
    client = daemon.connect()
    with tempfile.TemporaryDirectory(prefix="nbexec-build-") as temp:
        context = Path(temp) / "context"
        shutil.copytree(context_dir(), context)
        if options.ca_bundle is not None:
            if not options.ca_bundle.is_file():
                raise ConfigError(f"--ca-bundle {options.ca_bundle} is not a file")
            shutil.copyfile(options.ca_bundle, context / "ca" / "ca-bundle.crt")
        buildargs = {"BASE_IMAGE": options.base_image} if options.base_image else {}
        image_id = ""
        with daemon.translated("build the runtime image"):
            for chunk in client.api.build(path=str(context), tag=options.tag, buildargs=buildargs, rm=True,
                                          forcerm=True, decode=True, nocache=options.no_cache):
                if "error" in chunk:
                    raise DockerError(f"the image build failed: {chunk['error'].strip()}")
                line = chunk.get("stream", "").rstrip()
                if line:
                    progress(line)
                if "aux" in chunk and "ID" in chunk["aux"]:
                    image_id = chunk["aux"]["ID"]
    return image_id


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
