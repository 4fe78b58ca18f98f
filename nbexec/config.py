"""The sandbox policy: one frozen dataclass whose defaults are the safe choice, and the one reader of NBEXEC_*."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import languages
from .errors import ConfigError, NotOfferedError
from .names import (
    DEFAULT_IMAGE_NAME,
    DOCKER_REFERENCE,
    check_image_name,
    host_rule,
    is_image_name,
    named_image_tag,
    not_allowed,
)
from .overrides import ConfigOverrides, Unpack

DEFAULT_IMAGE = "nbexec-jupyter:latest"
KERNELS_IMAGE = "nbexec-kernels:latest"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$", re.IGNORECASE)
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
MIN_TOKEN_CHARS = 16  # every bearer token nbexec accepts or sends (serve, router, node token, MCP over HTTP)
SANDBOX_SOURCES = ("local", "remote", "ray")  # the places sandboxes come from (nbexec.engine.sources.for_config)
TEST_SOURCES: set[str] = set()  # names only tests add (nbexec.engine.sources.register_for_tests): "fake"
MAX_OPEN = 16  # connections one sandbox holds through its egress proxy at once (max_open_connections)
IDLE_TIMEOUT = 60.0  # seconds a tunnel may move nothing (egress_idle_timeout); also the pace's window
MIN_RATE = 1024  # bytes per second a tunnel must average over each such window (egress_min_rate)


def parse_size(value: str | int) -> int:
    """Turn ``"1g"``, ``"512MiB"`` or a byte count into bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ConfigError(f"size must not be negative, got {value}")
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ConfigError(f"not a size: {value!r} (use bytes or a suffix: 512m, 1g, 100k)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def running_as_root() -> bool:
    """Whether nbexec runs as root: the one place that asks. As root it gives each sandbox a fresh uid, chowns the
    files it puts in /mnt/data to it, and mounts /mnt/data as a filesystem of its own."""
    return hasattr(os, "geteuid") and os.geteuid() == 0


def parse_duration(value: str) -> float:
    """Turn ``"30m"``, ``"12h"``, ``"1d"`` (or seconds) into seconds."""
    match = _DURATION.match(str(value))
    if not match:
        raise ConfigError(f"not a duration: {value!r} (use seconds or a suffix: 30m, 12h, 1d)")
    return float(match.group(1)) * _SECONDS[match.group(2).lower()]


class _Bytes:
    """A size field (``memory_bytes`` for ``memory``) in bytes, parsed when read."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.field = name.removesuffix("_bytes")

    def __get__(self, instance: object, owner: type | None = None) -> int:
        return parse_size(getattr(instance, self.field))


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    """Where and how code runs. Every field is documented once, here; the CLI and NBEXEC_* reuse these texts."""

    image: str = field(default=DEFAULT_IMAGE, metadata=_doc(
        "Runtime image: a Docker tag (build it with `nbexec image build`), or the name of a named image (`nbexec "
        "image build --name NAME`), which must be one of images."))
    images: tuple[str, ...] = field(default=(), metadata=_doc(
        "Named images that may be asked for by name (image=NAME here, --image, HTTP bodies, tool arguments); a "
        "name not on this list is refused. The default image is always allowed."))
    language: str = field(default="python", metadata=_doc(
        "Code's language: python, r, deno (TypeScript/JavaScript) or bash (aliases: py, R, ts, js, sh). A notebook's "
        "kernelspec or a script's extension chooses its own, unless a call gives one (language=, --language)."))
    languages: tuple[str, ...] = field(default=(), metadata=_doc(
        "Languages an HTTP client or a model (tool and MCP arguments) may ask for besides language, e.g. r,deno,bash; "
        "any other is refused. The library and the CLI choose any language."))
    kernels_image: str = field(default=KERNELS_IMAGE, metadata=_doc(
        "The image for languages other than Python while image is the default (`nbexec image build --kernels "
        "r,deno,bash`)."))
    network: bool | str = field(default=False, metadata=_doc(
        "The sandbox's network: off (no interface but loopback), on (Docker's bridge: anywhere), or allowlist "
        "(still no interface; HTTP and HTTPS to allowed_hosts only, through nbexec's proxy on the host)."))
    memory: str = field(default="1g", metadata=_doc("Memory limit of the sandbox; swap is off."))
    cpus: float = field(default=1.0, metadata=_doc("CPU limit (cores)."))
    pids: int = field(default=256, metadata=_doc("Limit on processes and threads in the sandbox."))
    timeout: float = field(default=60.0, metadata=_doc("Wall-clock limit for one execution, in seconds."))
    cell_timeout: float | None = field(default=None, metadata=_doc(
        "Wall-clock limit for one cell, in seconds (default: the execution limit)."))
    max_output: str = field(default="1m", metadata=_doc("Text kept per execution; the rest is dropped with a marker."))
    max_display: str = field(default="32m", metadata=_doc(
        "Rich output (images, HTML) kept per execution; the rest is dropped with a marker. JSON is charged what "
        "holding it parsed costs the host (lists nested deep: about 40 times their text)."))
    max_outputs: int = field(default=2000, metadata=_doc(
        "Outputs kept per execution; later ones are dropped with a marker saying how many."))
    max_data: str = field(default="1g", metadata=_doc(
        "Size of /mnt/data, a filesystem of its own for each sandbox: writes past it fail with 'No space left on "
        "device' (0: no cap)."))
    max_files: int = field(default=1000, metadata=_doc(
        "Files kept per execution (the rest are listed as not kept); /mnt/data holds at most a quarter more "
        "entries, for folders."))
    tmp_size: str = field(default="256m", metadata=_doc("Size of the in-memory /tmp (counts against memory)."))
    disk_margin: str = field(default="1g", metadata=_doc(
        "Host disk kept free: a sandbox is not started while the free space of the working or output folder's "
        "filesystem, less what running sandboxes may still write, is below what it may write (2 x max_data, "
        "max_display, 2 x (max_output + max_display), max_package_download) plus this."))
    user: str | None = field(default=None, metadata=_doc(
        "uid:gid inside the sandbox, neither 0 (default: yours; when nbexec runs as root, a fresh uid per sandbox "
        "above 2,000,000,000 that no account has)."))
    env: Mapping[str, str] = field(default_factory=dict, metadata=_doc(
        "Environment variables for the sandbox; no host variable is passed otherwise."))
    runtime: str | None = field(default=None, metadata=_doc("OCI runtime, e.g. runsc for gVisor (default: Docker's)."))
    input_dir: str | None = field(default=None, metadata=_doc("Host folder mounted read-only at /mnt/input."))
    link_input: bool = field(default=False, metadata=_doc(
        "Copy the entries of input_dir (up to 200, not hidden ones) into the working folder /mnt/data, so relative "
        "paths read, overwrite and write next to a notebook; the host's folder is never written (see inputcopy)."))
    warm_imports: tuple[str, ...] = field(default=("numpy", "pandas", "matplotlib.pyplot"), metadata=_doc(
        "Modules a waiting kernel imports in advance (only sys.modules changes)."))
    pool_size: int = field(default=2, metadata=_doc("Warm sandboxes kept ready for one-shot calls (0: none)."))
    startup_timeout: float = field(default=60.0, metadata=_doc("Seconds to wait for a new sandbox's kernel."))
    interrupt_grace: float = field(default=5.0, metadata=_doc(
        "Seconds an interrupted cell gets to stop before the sandbox is killed."))
    source: str = field(default="local", metadata=_doc(
        "Where sandboxes come from: local (this host's Docker engine, warm pool), remote (the nodes of "
        "NBEXEC_NODES; the default when it is set) or ray (the nodes of the Ray cluster, the ray extra)."))

    # -- packages (see nbexec.packages): resolved and downloaded on the host, installed offline in the sandbox --
    packages: str = field(default="allowlist", metadata=_doc(
        "Which packages the code may install (%pip install, packages=[...]): allowlist (the shipped list plus "
        "allowed_packages), any (any wheel from the index) or off."))
    allowed_packages: tuple[str, ...] = field(default=(), metadata=_doc(
        "Project names (optionally with a version constraint, e.g. pyarrow>=14) added to the shipped allowlist."))
    package_index: str = field(default="https://pypi.org/simple", metadata=_doc(
        "Where the host fetches wheels: a package index URL (PEP 503), or a local folder of wheels."))
    max_packages: int = field(default=40, metadata=_doc(
        "Distributions (wheels, dependencies included) one execution may be provided, all its requests together."))
    max_package_download: str = field(default="256m", metadata=_doc(
        "Bytes of wheels one execution may be provided, all its requests together; a download past it is stopped."))
    package_cache: str | None = field(default=None, metadata=_doc(
        "Host folder (0700) that caches wheels by sha256 (default: <tmp>/nbexec-wheels-<uid>)."))
    package_resolver_user: str = field(default="nobody", metadata=_doc(
        "The account (name or uid) the host's pip runs as when nbexec runs as root; never root. It needs to read "
        "a folder package_index and the Python that runs pip, and nothing of nbexec's."))
    package_resolver_python: str | None = field(default=None, metadata=_doc(
        "The Python (with pip) that runs the host's pip (default: nbexec's own, else /usr/local/bin/python3 or "
        "/usr/bin/python3, the first package_resolver_user can run)."))
    package_resolver_memory: str = field(default="512m", metadata=_doc(
        "Address-space cap of the host's pip (RLIMIT_AS, enforced by the kernel); past it the request fails."))

    # -- network="allowlist" (see nbexec.egress): HTTP(S) to listed hosts through a proxy on the host --
    allowed_hosts: tuple[str, ...] = field(default=(), metadata=_doc(
        "Hosts network=allowlist reaches: exact names or *.domain, optionally :port (default 80 and 443; :* any); "
        "private, loopback and link-local addresses only when listed as an address (127.0.0.1:8080)."))
    egress_widen: bool = field(default=False, metadata=_doc(
        "Whether a running session may allow hosts beyond allowed_hosts (Session.allow_hosts, the egress route); "
        "off: a change may only narrow them."))
    max_egress: str = field(default="64m", metadata=_doc(
        "Bytes (up and down) one execution may move through the allowlist proxy; the connection past it is closed."))
    max_connections: int = field(default=64, metadata=_doc(
        "Connections one execution may open through the allowlist proxy (refused ones count); later ones are "
        "refused."))
    max_open_connections: int = field(default=MAX_OPEN, metadata=_doc(
        "Connections one sandbox may hold open through the allowlist proxy at once (each costs the host two "
        "descriptors and a thread); more are refused (503) until one closes."))
    egress_idle_timeout: float = field(default=IDLE_TIMEOUT, metadata=_doc(
        "Seconds a connection through the allowlist proxy may move nothing before it is closed; also the window "
        "egress_min_rate is averaged over."))
    egress_min_rate: int = field(default=MIN_RATE, metadata=_doc(
        "Bytes per second (both ways together) a connection through the allowlist proxy must average over each "
        "egress_idle_timeout window, or it is closed: trickled bytes do not keep it open."))

    def __post_init__(self) -> None:
        self._check_packages()
        self._check_network()
        for name in ("memory", "max_output", "max_display", "max_data", "tmp_size", "disk_margin"):
            parse_size(getattr(self, name))
        if parse_size(self.memory) < 64 * 1024**2:
            raise ConfigError(f"memory {self.memory!r} is too small: a kernel needs at least 64m")
        if not 0 < self.cpus <= 256:
            raise ConfigError(f"cpus must be above 0 and at most 256, got {self.cpus}")
        for name in ("timeout", "startup_timeout", "interrupt_grace"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be above 0, got {getattr(self, name)}")
        if self.cell_timeout is not None and not self.cell_timeout > 0:
            raise ConfigError(f"cell_timeout must be above 0, got {self.cell_timeout}")
        for name, least in (("pids", 16), ("pool_size", 0), ("max_files", 1), ("max_outputs", 1)):
            if getattr(self, name) < least:  # pids: a kernel runs several threads
                raise ConfigError(f"{name} must be {least} or more, got {getattr(self, name)}")
        self._check_names()
        object.__setattr__(self, "env", dict(self.env))
        if self.input_dir is not None:
            object.__setattr__(self, "input_dir", os.path.abspath(self.input_dir))
        object.__setattr__(self, "warm_imports", tuple(self.warm_imports))

    def _check_images(self) -> None:
        object.__setattr__(self, "images", tuple(self.images))
        for name in self.images:
            check_image_name(name)
        if is_image_name(self.image):
            if self.image not in self.images:
                raise ConfigError(not_allowed(self.image, self.images))
        elif not (isinstance(self.image, str) and len(self.image) <= 255 and DOCKER_REFERENCE.fullmatch(self.image)):
            raise ConfigError(f"image {str(self.image)[:80]!r} is neither a named image nor a Docker image "
                              "reference (repository:tag, e.g. nbexec-jupyter:latest)")

    def _check_names(self) -> None:
        self._check_images()
        object.__setattr__(self, "language", languages.canonical(self.language))
        object.__setattr__(self, "languages", tuple(dict.fromkeys(
            languages.canonical(name, "languages entry") for name in self.languages)))
        if not (isinstance(self.kernels_image, str) and DOCKER_REFERENCE.fullmatch(self.kernels_image)):
            raise ConfigError(f"kernels_image {str(self.kernels_image)[:80]!r} is not a Docker image reference")
        if self.source not in SANDBOX_SOURCES and self.source not in TEST_SOURCES:
            raise ConfigError(f"source must be one of {', '.join(SANDBOX_SOURCES)}, got {self.source!r}")
        if self.user is not None and not re.fullmatch(r"[1-9]\d*(:[1-9]\d*)?", self.user):
            raise ConfigError(f"user must be a non-zero uid or uid:gid with a non-zero gid, got {self.user!r} "
                              "(root is not allowed, nor its group)")
        bad = [k for k in self.env if not _ENV_NAME.match(k)]
        if bad:
            raise ConfigError(f"invalid environment variable names: {bad}")

    def _check_packages(self) -> None:
        if self.packages not in ("allowlist", "any", "off"):
            raise ConfigError(f"packages must be allowlist, any or off, got {self.packages!r}")
        parse_size(self.max_package_download)
        if self.max_packages < 1:
            raise ConfigError(f"max_packages must be 1 or more, got {self.max_packages}")
        object.__setattr__(self, "allowed_packages", tuple(self.allowed_packages))
        if self.package_cache is not None:
            object.__setattr__(self, "package_cache", os.path.abspath(self.package_cache))
        if self.package_resolver_user.strip() in ("", "root", "0"):
            raise ConfigError(f"package_resolver_user must be an unprivileged account, got "
                              f"{self.package_resolver_user!r}")
        if parse_size(self.package_resolver_memory) < 128 * 1024**2:
            raise ConfigError(f"package_resolver_memory {self.package_resolver_memory!r} is too small: pip needs "
                              "at least 128m")

    def _check_network(self) -> None:
        if self.network not in (False, True, "allowlist"):
            raise ConfigError(f"network must be False, True or 'allowlist', got {self.network!r}")
        object.__setattr__(self, "allowed_hosts", tuple(self.allowed_hosts))
        for entry in self.allowed_hosts:
            host_rule(entry)
        others = [name for name in (self.language, *self.languages) if self.network == "allowlist"
                  and languages.canonical(name, "languages entry") != "python"]
        if others:
            raise ConfigError(f"network='allowlist' is Python-only (its forwarder runs in the kernel), and "
                              f"{others[0]} is {'the language' if others[0] == self.language else 'offered'}: use "
                              "network off, or on (Docker's bridge)")
        if self.network == "allowlist" and not self.allowed_hosts:
            raise ConfigError("network='allowlist' needs allowed_hosts (NBEXEC_ALLOWED_HOSTS, --allow-host): "
                              "the hosts the code may reach")
        parse_size(self.max_egress)
        for name in ("max_connections", "max_open_connections", "egress_min_rate"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be 1 or more, got {getattr(self, name)}")
        if not self.egress_idle_timeout > 0:
            raise ConfigError(f"egress_idle_timeout must be above 0, got {self.egress_idle_timeout}")

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.env.items())) + tuple(
            getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "env"))

    def __repr__(self) -> str:
        shown = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "env"}
        shown["env"] = sorted(self.env)  # names only: values may be secrets
        return "SandboxConfig(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"

    def replace(self, **changes: Unpack[ConfigOverrides]) -> SandboxConfig:
        """Return a copy with some fields changed; ``None`` values are ignored."""
        kept: dict[str, Any] = {k: v for k, v in changes.items() if v is not None}
        return dataclasses.replace(self, **kept)

    @property
    def image_tag(self) -> str:
        """The Docker image a sandbox starts from: ``image`` itself, or a named image's newest build; for a language
        other than Python while ``image`` is the default, ``kernels_image``."""
        if self.language != "python" and self.image == DEFAULT_IMAGE:
            return self.kernels_image
        return named_image_tag(self.image) if is_image_name(self.image) else self.image

    def choose_image(self, asked: str | None) -> SandboxConfig:
        """This config with the image a caller asked for (a body, a tool argument): None or "default" keep the
        configured one; any other value must be a name on ``images`` (never a Docker tag). ConfigError otherwise."""
        if asked is None or asked == DEFAULT_IMAGE_NAME:
            return self
        if not isinstance(asked, str) or asked not in self.images:
            raise ConfigError(not_allowed(asked, self.images))
        return dataclasses.replace(self, image=asked)

    def choose_language(self, asked: Any) -> SandboxConfig:
        """This config with the language a caller asked for (None keeps it); ConfigError for an unknown one."""
        return self if asked is None else dataclasses.replace(self, language=languages.canonical(asked))

    def offer_language(self, asked: Any) -> SandboxConfig:
        """This config with the language an HTTP client or a model asked for: None keeps it; anything else must be
        ``language`` or on ``languages``. ConfigError otherwise, naming what is offered."""
        if asked is None:
            return self
        try:
            name = languages.canonical(asked)
        except ConfigError as exc:
            raise NotOfferedError(str(exc)) from None
        if name != self.language and name not in self.languages:
            offered = ", ".join(dict.fromkeys((self.language, *self.languages)))
            raise NotOfferedError(f"language {name} is not offered here; this server offers {offered} "
                                  "(an operator adds others with NBEXEC_LANGUAGES)")
        return dataclasses.replace(self, language=name)

    @property
    def container_key(self) -> tuple[Any, ...]:
        """The fields that shape a sandbox; sandboxes made for equal keys are interchangeable."""
        return (self.image, self.language, self.kernels_image, self.network, self.memory, self.cpus, self.pids,
                self.tmp_size, self.user,
                tuple(sorted(self.env.items())), self.runtime, self.warm_imports, self.input_dir, self.link_input,
                self.max_data_bytes, self.max_files, self.max_output, self.max_display,  # the frame cap
                self.allowed_hosts, self.max_egress, self.max_connections,  # the egress proxy's rules
                self.max_open_connections, self.egress_idle_timeout, self.egress_min_rate)

    # Sizes in bytes: parsed here, never at the call sites.
    memory_bytes = _Bytes()
    max_data_bytes = _Bytes()
    max_output_bytes = _Bytes()
    max_display_bytes = _Bytes()
    tmp_size_bytes = _Bytes()
    disk_margin_bytes = _Bytes()


def describe(name: str) -> str:
    """The documentation of a SandboxConfig field (the CLI's help text)."""
    return next(f.metadata["doc"] for f in dataclasses.fields(SandboxConfig) if f.name == name)


def _parse_field(name: str, raw: str) -> Any:
    kind = {f.name: f.type for f in dataclasses.fields(SandboxConfig)}[name]
    kind = str(kind)
    try:
        if kind == "bool | str":  # network: a switch, or the word allowlist
            return "allowlist" if raw.strip().lower() == "allowlist" else _parse_field_bool(raw)
        if kind == "bool":
            return _parse_field_bool(raw)
        if kind == "int":
            return int(raw)
        if kind.startswith("float"):
            return float(raw) if raw.strip() else None
        if kind.startswith("tuple"):
            return tuple(m.strip() for m in raw.split(",") if m.strip())
        if kind.startswith("Mapping"):
            raise ConfigError("pass sandbox variables with NBEXEC_ENV_<NAME>=value")
        return raw or None if kind.endswith("None") else raw
    except ValueError as exc:
        raise ConfigError(f"NBEXEC_{name.upper()}={raw!r} is not a valid {kind}") from exc


def _parse_field_bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered not in {"1", "0", "true", "false", "yes", "no", "on", "off"}:
        raise ValueError(raw)
    return lowered in {"1", "true", "yes", "on"}


def from_env(environ: Mapping[str, str] | None = None, **overrides: Unpack[ConfigOverrides]) -> SandboxConfig:
    """Build a SandboxConfig from NBEXEC_* variables (the only place nbexec reads them), then apply overrides.

    NBEXEC_<FIELD> sets a field (NBEXEC_MEMORY=2g, NBEXEC_NETWORK=1, NBEXEC_WARM_IMPORTS=numpy,pandas);
    NBEXEC_ENV_<NAME>=value passes NAME=value into the sandbox.
    """
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(SandboxConfig)} - {"env"}
    for name in names:
        raw = environ.get(f"NBEXEC_{name.upper()}")
        if raw is not None:
            values[name] = _parse_field(name, raw)
    if "source" not in values and environ.get("NBEXEC_NODES", "").strip():
        values["source"] = "remote"  # NBEXEC_NODES (with NBEXEC_NODE_TOKEN, see host_from_env) names the nodes
    sandbox_env = {k[len("NBEXEC_ENV_"):]: v for k, v in environ.items() if k.startswith("NBEXEC_ENV_")}
    if sandbox_env:
        values["env"] = sandbox_env
    values.update({k: v for k, v in overrides.items() if v is not None})
    return SandboxConfig(**values)
