"""The host-side wheelhouse: resolve requirements to wheels, cache them by sha256, link them into sandboxes.

A resolution is `resolver.resolve` (breadth-first, every dependency judged by the policy before it is fetched)
over rounds of the confined host pip (`hostpip.fetch`: named wheels only, never a build), for the sandbox's
interpreter and platform. Wheels are kept as ``blobs/<sha256>``, a resolution (requirements + policy + target +
index -> wheels) as ``resolved/<key>.json`` for a day, and a failed one as ``failed/<key>.json`` for
``FAILURE_TTL`` seconds, so asking again soon runs no pip at all. Wheels are handed to a sandbox as hard links (or
copies) in its read-only /mnt/wheels folder, each checked against its sha256 first.

One execution's requests share a `Budget`: ``max_packages`` distributions (every wheel fetched counts, and every
failed request counts as one) and ``max_package_download`` bytes, checked before each round of pip.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from nbexec.errors import PackageError, PackageLimitError, PackageRefusedError
from nbexec.files.folders import DIR_FLAGS, private_root
from nbexec.sandbox.source import WheelFile

from . import hostpip, resolver
from .policy import Policy

RESOLUTION_TTL = 24 * 3600.0  # seconds a resolution of unpinned requirements is reused before pip runs again
FAILURE_TTL = 300.0  # seconds a failed resolution is remembered (asked again sooner, it fails without pip)
_VERSION = re.compile(r"^3\.\d{1,2}$")
_FULL_VERSION = re.compile(r"^3\.\d{1,2}\.\d{1,3}$")
_MACHINE = re.compile(r"^[a-z0-9_]{1,32}$")
_GLIBC = re.compile(r"^2\.\d{1,3}$")


@dataclass(frozen=True)
class Target:
    """The sandbox interpreter wheels are chosen for: Python X.Y (and X.Y.Z when known), the machine, and its
    glibc (None: unknown)."""

    python: str
    machine: str
    glibc: str | None
    python_full: str | None = None

    def __post_init__(self) -> None:
        if not _VERSION.match(self.python) or not _MACHINE.match(self.machine) \
                or (self.glibc is not None and not _GLIBC.match(self.glibc)) \
                or (self.python_full is not None and not (_FULL_VERSION.match(self.python_full)
                                                          and self.python_full.startswith(self.python + "."))):
            raise PackageError(f"the sandbox described its interpreter oddly: {self!r}")

    def pip_args(self) -> list[str]:
        nodot = self.python.replace(".", "")
        # Every manylinux tag the sandbox's glibc runs, newest first, and the legacy aliases (pip widens only
        # those: given manylinux_2_36 alone it would not take a manylinux_2_17 wheel).
        newest = int((self.glibc or "2.17").split(".")[1])
        platforms = [f"manylinux_2_{minor}_{self.machine}" for minor in range(newest, 16, -1)]
        platforms += [f"{alias}_{self.machine}" for alias in ("manylinux2014", "manylinux2010", "manylinux1")]
        return ["--python-version", self.python, "--implementation", "cp", "--abi", f"cp{nodot}",
                *(arg for platform in platforms for arg in ("--platform", platform))]

    def markers(self) -> dict[str, str]:
        """The environment markers of the sandbox's interpreter (PEP 508), for judging dependencies."""
        full = self.python_full or f"{self.python}.0"
        return {"implementation_name": "cpython", "implementation_version": full, "os_name": "posix",
                "platform_machine": self.machine, "platform_python_implementation": "CPython",
                "platform_release": "", "platform_system": "Linux", "platform_version": "",
                "python_full_version": full, "python_version": self.python, "sys_platform": "linux"}


@dataclass(frozen=True)
class Wheel:
    """One wheel of a resolution: its project name (normalised), version, file name, sha256 and size."""

    name: str
    version: str
    filename: str
    sha256: str
    size: int


@dataclass(frozen=True)
class Source:
    """Where wheels come from, what one execution may take, and how the host's pip is confined."""

    index: str  # an index URL (PEP 503 simple API), or a local folder of wheels
    max_bytes: int
    max_count: int
    cache: Path | None = None  # default: <tmp>/nbexec-wheels-<uid>
    confinement: hostpip.Confinement = field(default_factory=hostpip.Confinement)

    def pip_args(self) -> list[str]:
        if "://" in self.index:
            return ["--index-url", self.index]
        return ["--no-index", "--find-links", os.path.abspath(self.index)]


@dataclass
class Budget:
    """What one execution has taken so far, against its caps: ``source.max_count`` distributions and
    ``source.max_bytes`` bytes of wheels (0: no byte cap), summed over all its requests. Every wheel fetched or
    provided counts once (by sha256), and every failed request counts as one distribution."""

    source: Source
    charged: dict[str, Wheel] = field(default_factory=dict)  # sha256 -> wheel
    failures: int = 0

    def used(self) -> tuple[int, int]:
        return len(self.charged) + self.failures, sum(w.size for w in self.charged.values())

    def remaining(self) -> Source:
        """The source for the next round, its download capped by what is left; PackageLimitError when nothing is."""
        count, size = self.used()
        if count >= self.source.max_count or (self.source.max_bytes and size >= self.source.max_bytes):
            raise PackageLimitError(f"this execution already used {count} of its {self.source.max_count} "
                                    f"distributions ({size:,} bytes; failed requests count too), its cap "
                                    "(max_packages, max_package_download)")
        return replace(self.source, max_bytes=self.source.max_bytes and self.source.max_bytes - size)

    def check_more(self, names: list[str]) -> None:
        """Refuse, before anything is fetched, a round that would pass ``max_packages`` with ``names``."""
        have = {w.name for w in self.charged.values()}
        count = self.used()[0] + len([n for n in names if n not in have])
        if count > self.source.max_count:
            raise PackageLimitError(f"it needs more distributions than this execution has left: {count} of "
                                    f"{self.source.max_count} (max_packages); nothing more was downloaded")

    def charge(self, wheels: list[Wheel]) -> None:
        new = {w.sha256: w for w in wheels if w.sha256 not in self.charged}
        count, size = self.used()
        count, size = count + len(new), size + sum(w.size for w in new.values())
        if count > self.source.max_count:
            raise PackageLimitError(f"it would bring this execution to {count} distributions, more than the "
                                    f"{self.source.max_count} allowed (max_packages)")
        if self.source.max_bytes and size > self.source.max_bytes:
            raise PackageLimitError(f"it would bring this execution to {size:,} bytes of wheels, more than the "
                                    f"{self.source.max_bytes:,} allowed (max_package_download)")
        self.charged.update(new)

    def fail(self) -> None:
        self.failures += 1


def cache_root(source: Source) -> Path:
    """The wheelhouse folder (0700, ours), with its blobs/, resolved/, failed/ and tmp/ sub-folders."""
    if source.cache is None:
        root = private_root("nbexec-wheels")
    else:
        root = source.cache
        with contextlib.suppress(FileExistsError):
            os.makedirs(root, mode=0o700)
        fd = os.open(root, DIR_FLAGS)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or st.st_mode & 0o022:
                raise PackageError(f"the wheel cache {root} must be a folder of yours, not writable by others")
        finally:
            os.close(fd)
    for name in ("blobs", "resolved", "failed", "tmp"):
        with contextlib.suppress(FileExistsError):
            os.mkdir(root / name, 0o700)
    return root


def resolve(requirements: list[str], policy: Policy, target: Target, budget: Budget, *,
            deadline: float, stop: threading.Event | None = None) -> list[Wheel]:
    """The wheels that satisfy ``requirements`` (each already allowed by ``policy``) and their dependencies for
    ``target``: from the cache, else resolved now, charged to ``budget``. PackageRefusedError when the policy
    refuses a dependency, PackageLimitError when the budget or the ``deadline`` (time.monotonic()) runs out, or
    once ``stop`` is set (an interrupt)."""
    root = cache_root(budget.source)
    key = hashlib.sha256(json.dumps([sorted(requirements), policy.key(), asdict(target),
                                     budget.source.index]).encode()).hexdigest()
    budget.remaining()
    cached = _cached(root, key)
    if cached is not None:
        budget.charge(cached)
        return cached
    try:
        _remembered(root, key)
        fetch, fetched = _fetcher(root, target, budget, (deadline, stop))
        chosen = resolver.resolve([Requirement(text) for text in requirements], policy, target.markers(), fetch,
                                  max_rounds=budget.source.max_count + 2)
        wheels = [fetched[found.filename] for found in chosen]
    except PackageLimitError:
        budget.fail()
        raise
    except PackageError as exc:
        budget.fail()  # a failure counts too: a cell of failing pip lines runs out of its budget
        _remember(root, key, exc)
        raise
    _write(root / "resolved" / f"{key}.json", [asdict(w) for w in wheels])
    return wheels


def _fetcher(root: Path, target: Target, budget: Budget,
             until: tuple[float, threading.Event | None]) -> tuple[resolver.Fetch, dict[str, Wheel]]:
    """The resolver's fetch: one round of the confined pip, within the budget, each wheel kept in the blobs and
    charged as it comes; and the wheels fetched so far, by file name."""
    fetched: dict[str, Wheel] = {}

    def fetch(lines: list[str]) -> list[resolver.Fetched]:
        budget.check_more([canonicalize_name(Requirement(line).name) for line in lines])
        source = budget.remaining()
        items = hostpip.fetch(lines, [*source.pip_args(), *target.pip_args()],
                              replace(source.confinement, max_bytes=source.max_bytes), root / "tmp", deadline=until[0],
                              stop=until[1])
        found = []
        try:
            for item in items:
                described = resolver.read_metadata(item.filename, item.metadata)
                wheel = _keep(root, item, described)
                budget.charge([wheel])
                fetched[wheel.filename] = wheel
                found.append(described)
        finally:
            for item in items:  # the copies not kept (a refusal midway)
                item.path.unlink(missing_ok=True)
        return found

    return fetch, fetched


def _keep(root: Path, item: hostpip.Downloaded, described: resolver.Fetched) -> Wheel:
    """Move the host's checked copy of a wheel into the blobs (the sandbox user reads it through a link)."""
    blob = root / "blobs" / item.sha256
    if not blob.exists():
        os.chmod(item.path, 0o644)
        os.replace(item.path, blob)
    return Wheel(described.name, described.version, item.filename, item.sha256, item.size)


def _cached(root: Path, key: str) -> list[Wheel] | None:
    record = root / "resolved" / f"{key}.json"
    try:
        if time.time() - record.stat().st_mtime > RESOLUTION_TTL:
            return None
        wheels = [Wheel(**item) for item in json.loads(record.read_text())]
    except (OSError, ValueError, TypeError):
        return None
    if all((root / "blobs" / w.sha256).is_file() for w in wheels):
        return wheels
    return None


def _remembered(root: Path, key: str) -> None:
    """Raise again a failure of the last ``FAILURE_TTL`` seconds for the same resolution (no pip runs)."""
    record = root / "failed" / f"{key}.json"
    try:
        age = time.time() - record.stat().st_mtime
        if age > FAILURE_TTL:
            return
        kind, message = json.loads(record.read_text())
    except (OSError, ValueError, TypeError):
        return
    error = PackageRefusedError if kind == "refused" else PackageError
    raise error(f"{str(message)[:2000]} (remembered from {age:.0f} s ago; nbexec asks the index again after "
                f"{FAILURE_TTL:g} s)")


def _remember(root: Path, key: str, exc: PackageError) -> None:
    if "(remembered from" not in str(exc):
        _write(root / "failed" / f"{key}.json",
               ["refused" if isinstance(exc, PackageRefusedError) else "failed", str(exc)[:2000]])


def _write(record: Path, value: object) -> None:
    """Replace ``record`` atomically (threads and processes may write the same one at once)."""
    fd, temporary = tempfile.mkstemp(dir=record.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        json.dump(value, handle)
    os.replace(temporary, record)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def files(wheels: list[Wheel], source: Source) -> list[WheelFile]:
    """The cached files of ``wheels``, each checked against its sha256 (a file that no longer matches is removed
    and raises), for `SandboxHandle.provide_wheels`."""
    blobs = cache_root(source) / "blobs"
    found = []
    for wheel in wheels:
        blob = blobs / wheel.sha256
        if _sha256(blob) != wheel.sha256:
            blob.unlink(missing_ok=True)
            raise PackageError(f"the cached {wheel.filename} no longer matches its sha256; it was removed, "
                               "ask again to download it afresh")
        found.append(WheelFile(wheel.filename, wheel.sha256, wheel.size, blob))
    return found
