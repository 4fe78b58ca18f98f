"""What a named image is built from, checked before any build, and the hash of it that the image's tag carries. Pure.

A named image (`nbexec image build --name NAME`) is the runtime image, or another named image, plus Python
requirements and Debian packages. Both lists come from the operator's command line and files; they reach the build
only as files of the build context (read by pip -r and xargs, never spliced into a command), and they are checked
here first anyway: a requirement is a PEP 508 name with extras, versions and a marker (no pip option, no URL, no
path: what the image holds is what its hash says), an apt package is a Debian package name, optionally =version.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from packaging.requirements import InvalidRequirement, Requirement

from nbexec.errors import ConfigError
from nbexec.names import check_image_name, is_image_name, named_image_tag

MAX_REQUIREMENTS_BYTES = 64 * 1024
MAX_REQUIREMENTS = 200
MAX_APT = 100
INPUTS_FORMAT = 1  # bumped when what the hash covers changes, so no old build is taken for a new one
HASH_CHARS = 16  # of the inputs' sha256, in the tag
# Debian policy 5.6.1: a package name is lower-case letters, digits, + - and ., two or more, starting alphanumeric.
_APT_PACKAGE = re.compile(r"[a-z0-9][a-z0-9+.-]{1,62}(?:=[A-Za-z0-9][A-Za-z0-9.+~:-]{0,63})?")
_COMMENT = re.compile(r"(^|\s)#.*$")  # pip's rule: a # at the start of a line or after white space


@dataclass(frozen=True)
class Recipe:
    """A named image's inputs, checked: build one with `named.build`."""

    name: str
    requirements: tuple[str, ...] = ()  # normalised PEP 508 requirements
    apt: tuple[str, ...] = ()  # Debian package names, sorted, each once
    base: str | None = None  # a named image's name or an nbexec runtime image's tag; None: the configured image

    def __post_init__(self) -> None:
        check_image_name(self.name)
        object.__setattr__(self, "requirements", tuple(_requirement(line, "") for line in self.requirements))
        object.__setattr__(self, "apt", apt_packages(self.apt))
        if self.base is not None and not self.base.strip():
            raise ConfigError("--base is empty: give a named image's name or an nbexec runtime image's tag")

    @property
    def base_tag(self) -> str | None:
        """The Docker reference of the base, when one was given (a name: its newest build)."""
        if self.base is None:
            return None
        return named_image_tag(self.base) if is_image_name(self.base) else self.base

    def digest(self, base_id: str, dockerfile: str) -> str:
        """The sha256 of everything the image is made of: the base image's id, the Dockerfile, the lists."""
        inputs = {"format": INPUTS_FORMAT, "base": base_id, "requirements": list(self.requirements),
                  "dockerfile": hashlib.sha256(dockerfile.encode()).hexdigest(), "apt": list(self.apt)}
        return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()

    def tag(self, digest: str) -> str:
        return named_image_tag(self.name, digest[:HASH_CHARS])

    def labels(self, digest: str, base: str, base_id: str) -> dict[str, str]:
        """What `nbexec image list` shows of a build (set through the API, never written into the Dockerfile)."""
        return {"io.nbexec.image.name": self.name, "io.nbexec.image.inputs": digest, "io.nbexec.image.base": base,
                "io.nbexec.image.base-id": base_id, "io.nbexec.image.requirements": "\n".join(self.requirements),
                "io.nbexec.image.apt": " ".join(self.apt)}


def requirements(text: str) -> tuple[str, ...]:
    """The requirements of a requirements file's text, normalised; ConfigError naming the first bad line."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_REQUIREMENTS_BYTES:
        raise ConfigError(f"--requirements: the file is larger than {MAX_REQUIREMENTS_BYTES // 1024} KiB")
    found = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = _COMMENT.sub("", raw).strip()
        if line:
            found.append(_requirement(line, f" line {number}"))
    if len(found) > MAX_REQUIREMENTS:
        raise ConfigError(f"--requirements: {len(found)} requirements; a named image takes at most {MAX_REQUIREMENTS}")
    return tuple(found)


def _requirement(line: str, where: str) -> str:
    shown = repr(line[:80])
    if line.startswith("-"):
        raise ConfigError(f"--requirements{where}: options are not allowed in a named image's requirements ({shown}): "
                          "give names with versions only; the image is built from the package index its build uses")
    try:
        found = Requirement(line)
    except InvalidRequirement as exc:
        reason = str(exc).splitlines()[0]
        raise ConfigError(f"--requirements{where}: {shown} is not a requirement (a name with optional extras, "
                          f"versions and a marker, one per line): {reason}") from None
    if found.url:
        raise ConfigError(f"--requirements{where}: {shown} is a direct reference (name @ URL), which is not allowed: "
                          "pin a version from the package index instead, so the image's hash says what it holds")
    return str(found)


def apt_packages(names: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """Debian package names (optionally =version), sorted and each once; ConfigError naming the first bad one."""
    for name in names:
        if not isinstance(name, str) or not _APT_PACKAGE.fullmatch(name):
            raise ConfigError(f"--apt {str(name)[:80]!r} is not a Debian package name (lower-case letters, digits, "
                              "'+', '-' and '.', optionally =version): give one package per --apt")
    unique = tuple(sorted(set(names)))
    if len(unique) > MAX_APT:
        raise ConfigError(f"--apt: {len(unique)} packages; a named image takes at most {MAX_APT}")
    return unique
