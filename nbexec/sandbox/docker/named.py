"""Named images on the local engine: build one from a checked `recipe.Recipe` on the runtime image (or on another
named image), unless an image of the same inputs is already here, and list them.

The base must be an image nbexec built (its runtime label): a named image starts from the runtime image's hardening
and `named.Dockerfile` applies it again after the installs. Nothing is pulled: a base that is not here is an error.
Each build is tagged ``nbexec-image-NAME:<hash of its inputs>`` and becomes ``nbexec-image-NAME:latest``, what the
name runs; the same inputs again only move ``latest`` back to the build they made.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import docker.errors

from nbexec.errors import ConfigError, DockerError
from nbexec.names import NAMED_IMAGE_PREFIX, is_image_name, named_image_tag

from . import daemon, image, recipe
from .recipe import Recipe

DOCKERFILE = "named.Dockerfile"  # beside the runtime image's Dockerfile
RUNTIME_LABEL = ("io.nbexec.role", "runtime")
NAME_LABEL = "io.nbexec.image.name"


@dataclass(frozen=True)
class Built:
    """A named image's build: its tag (with the hash of its inputs), its id, and whether this call built it."""

    tag: str
    image_id: str
    built: bool


def read_requirements(path: Path) -> tuple[str, ...]:
    """The checked requirements of a requirements file: a regular file, sized before it is read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"--requirements {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"--requirements {path} cannot be read: {exc.strerror}") from None
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):  # a device or a FIFO could be read for ever
            raise ConfigError(f"--requirements {path} is not a regular file")
        if found.st_size > recipe.MAX_REQUIREMENTS_BYTES:
            raise ConfigError(f"--requirements {path} is larger than {recipe.MAX_REQUIREMENTS_BYTES // 1024} KiB")
        data = os.read(fd, recipe.MAX_REQUIREMENTS_BYTES + 1)  # one read: a file that grew is cut, then refused
    finally:
        os.close(fd)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"--requirements {path} is not UTF-8 text") from None
    return recipe.requirements(text)


def build(plan: Recipe, *, default_base: str, progress: Callable[[str], None], no_cache: bool = False,
          ca_bundle: Path | None = None) -> Built:
    """Build ``plan`` unless an image of its inputs is here; either way its tag becomes the name's ``latest``."""
    client = daemon.connect()
    base_ref = plan.base_tag or default_base
    base = _base(client, base_ref, plan.base)
    dockerfile = (image.context_dir() / DOCKERFILE).read_text(encoding="utf-8")
    digest = plan.digest(base.id, dockerfile)
    tag = plan.tag(digest)
    found = None if no_cache else _same_inputs(client, tag, digest)
    built = found is None
    if found is None:
        labels = plan.labels(digest, plan.base or base_ref, base.id)
        _run_build(client, plan, dockerfile, tag, base.id, labels, progress, no_cache, ca_bundle)
        found = _get(client, tag)
    with daemon.translated(f"tag {tag} as the newest build of {plan.name}"):
        found.tag(f"{NAMED_IMAGE_PREFIX}{plan.name}", "latest")
    return Built(tag, found.id, built)


def _base(client: docker.DockerClient, ref: str, asked: str | None) -> Any:
    """The base image, here (never pulled) and made by nbexec; ConfigError otherwise."""
    with daemon.translated(f"look up the base image {ref}"):
        try:
            base = client.images.get(ref)
        except docker.errors.ImageNotFound:
            if asked is not None and is_image_name(asked):
                raise ConfigError(f"--base {asked}: the named image {asked} is not built here (nbexec image list "
                                  "shows what is); build it first with `nbexec image build --name`") from None
            raise ConfigError(f"the base image {ref} is not here, and named images are never pulled: build on the "
                              "runtime image (the default) or on a named image (nbexec image list)") from None
    if (base.labels or {}).get(RUNTIME_LABEL[0]) != RUNTIME_LABEL[1]:
        raise ConfigError(f"the base image {ref} is not an image nbexec built: a named image is built on the runtime "
                          "image (nbexec image build) or on another named image, which carry its hardening")
    return base


def _same_inputs(client: docker.DockerClient, tag: str, digest: str) -> Any:
    """The image of ``tag`` when it was built from exactly these inputs, else None."""
    try:
        found = _get(client, tag)
    except ConfigError:
        return None
    return found if (found.labels or {}).get("io.nbexec.image.inputs") == digest else None


def _get(client: docker.DockerClient, tag: str) -> Any:
    with daemon.translated(f"look up {tag}"):
        try:
            return client.images.get(tag)
        except docker.errors.ImageNotFound:
            raise ConfigError(f"{tag} is not here") from None


def _run_build(client: docker.DockerClient, plan: Recipe, dockerfile: str, tag: str, base_id: str,
               labels: dict[str, str], progress: Callable[[str], None], no_cache: bool, ca_bundle: Path | None) -> None:
    """Docker's build of ``named.Dockerfile`` in a private context holding the lists as files."""
    with tempfile.TemporaryDirectory(prefix="nbexec-named-") as context:
        folder = Path(context)
        (folder / "Dockerfile").write_text(dockerfile, encoding="utf-8")
        (folder / "requirements.txt").write_text("".join(f"{line}\n" for line in plan.requirements), encoding="utf-8")
        (folder / "apt.txt").write_text("".join(f"{name}\n" for name in plan.apt), encoding="utf-8")
        if ca_bundle is not None:
            if not ca_bundle.is_file():
                raise ConfigError(f"--ca-bundle {ca_bundle} is not a file")
            shutil.copyfile(ca_bundle, folder / "ca-bundle.crt")
        else:
            (folder / "ca-bundle.crt").write_bytes(b"")
        with daemon.translated(f"build the named image {plan.name}"):
            for chunk in client.api.build(path=context, tag=tag, buildargs={"BASE_IMAGE": base_id}, labels=labels,
                                          rm=True, forcerm=True, decode=True, nocache=no_cache, pull=False):
                if "error" in chunk:
                    raise DockerError(f"the build of the named image {plan.name} failed: {str(chunk['error']).strip()}")
                line = chunk.get("stream", "").rstrip()
                if line:
                    progress(line)


def listing(*, allowed: tuple[str, ...], default_tag: str, every_build: bool = False) -> list[dict[str, Any]]:
    """The default image and the named images here: name, tag, size, creation time, what each was built from,
    and whether the configured list allows it. Only the newest build of each name unless ``every_build``."""
    client = daemon.connect()
    rows = []
    with daemon.translated("list the named images"):
        try:
            default = client.images.get(default_tag)
            rows.append(_row("default", default_tag, default, True, True))
        except docker.errors.ImageNotFound:
            pass
        for found in client.images.list(filters={"label": NAME_LABEL}):
            name = (found.labels or {}).get(NAME_LABEL, "")
            current = named_image_tag(name) in found.tags
            for tag in found.tags:
                if tag.startswith(f"{NAMED_IMAGE_PREFIX}{name}:") and not tag.endswith(":latest") and (
                        current or every_build):
                    rows.append(_row(name, tag, found, current, name in allowed))
    named = sorted(rows[1:] if rows and rows[0]["name"] == "default" else rows,
                   key=lambda r: (r["name"], not r["current"], r["created"]))
    return [r for r in rows if r["name"] == "default"] + named


def _row(name: str, tag: str, found: Any, current: bool, allowed: bool) -> dict[str, Any]:
    labels = found.labels or {}
    requirements = labels.get("io.nbexec.image.requirements", "")
    return {"name": name, "tag": tag, "id": found.id, "current": current, "allowed": allowed,
            "size": int(found.attrs.get("Size", 0)), "created": str(found.attrs.get("Created", ""))[:19],
            "base": labels.get("io.nbexec.image.base", ""),
            "requirements": requirements.split("\n") if requirements else [],
            "apt": labels.get("io.nbexec.image.apt", "").split()}
