"""The host-side wheelhouse: resolve requirements to wheels with the host's pip, cache them by sha256, link them.

The host runs ``pip download --only-binary=:all:`` (never a source build) for the sandbox's interpreter and
platform, into a private folder of its own; a running download is stopped once its files pass the byte cap.
Wheels are kept as ``blobs/<sha256>`` and a resolution (requirements + target + index -> wheels) as
``resolved/<key>.json``, so a second request for the same thing runs no pip at all. Wheels are handed to a
sandbox as hard links (or copies) in its read-only /mnt/wheels folder, each checked against its sha256 first.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

from nbexec.errors import PackageError
from nbexec.files.folders import DIR_FLAGS, private_root

RESOLUTION_TTL = 24 * 3600.0  # seconds a resolution of unpinned requirements is reused before pip runs again
DOWNLOAD_TIME_LIMIT = 300.0  # seconds one pip download may take
_POLL = 0.1
_VERSION = re.compile(r"^3\.\d{1,2}$")
_MACHINE = re.compile(r"^[a-z0-9_]{1,32}$")
_GLIBC = re.compile(r"^2\.\d{1,3}$")


@dataclass(frozen=True)
class Target:
    """The sandbox interpreter wheels are chosen for: Python X.Y, the machine, and its glibc (None: unknown)."""

    python: str
    machine: str
    glibc: str | None

    def __post_init__(self) -> None:
        if not _VERSION.match(self.python) or not _MACHINE.match(self.machine) \
                or (self.glibc is not None and not _GLIBC.match(self.glibc)):
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
    """Where wheels come from and what one resolution may cost."""

    index: str  # an index URL (PEP 503 simple API), or a local folder of wheels
    max_bytes: int
    max_count: int
    cache: Path | None = None  # default: <tmp>/nbexec-wheels-<uid>

    def pip_args(self) -> list[str]:
        if "://" in self.index:
            return ["--index-url", self.index]
        return ["--no-index", "--find-links", os.path.abspath(self.index)]


@dataclass
class Budget:
    """What one execution was provided so far, against its caps: ``source.max_count`` distributions and
    ``source.max_bytes`` bytes of wheels (0: no byte cap), summed over all its requests (a wheel counts once)."""

    source: Source
    provided: dict[str, int] = field(default_factory=dict)  # sha256 -> size

    def remaining(self) -> Source:
        """The source for the next request, its download capped by what is left; PackageError when nothing is."""
        used = sum(self.provided.values())
        if len(self.provided) >= self.source.max_count or (self.source.max_bytes and used >= self.source.max_bytes):
            raise PackageError(f"this execution already has {len(self.provided)} distributions ({used:,} bytes), "
                               "its cap (max_packages, max_package_download)")
        return replace(self.source, max_bytes=self.source.max_bytes and self.source.max_bytes - used)

    def charge(self, wheels: list[Wheel]) -> None:
        new = {w.sha256: w.size for w in wheels if w.sha256 not in self.provided}
        count, size = len(self.provided) + len(new), sum(self.provided.values()) + sum(new.values())
        if count > self.source.max_count:
            raise PackageError(f"it would bring this execution to {count} distributions, more than the "
                               f"{self.source.max_count} allowed (max_packages)")
        if self.source.max_bytes and size > self.source.max_bytes:
            raise PackageError(f"it would bring this execution to {size:,} bytes of wheels, more than the "
                               f"{self.source.max_bytes:,} allowed (max_package_download)")
        self.provided.update(new)


def cache_root(source: Source) -> Path:
    """The wheelhouse folder (0700, ours), with its blobs/, resolved/ and tmp/ sub-folders."""
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
    for name in ("blobs", "resolved", "tmp"):
        with contextlib.suppress(FileExistsError):
            os.mkdir(root / name, 0o700)
    return root


def resolve(requirements: list[str], constraints: list[str], target: Target, source: Source) -> list[Wheel]:
    """The wheels that satisfy ``requirements`` for ``target``: from the cache, else downloaded now."""
    root = cache_root(source)
    key = hashlib.sha256(json.dumps([sorted(requirements), sorted(constraints), asdict(target),
                                     source.index]).encode()).hexdigest()  # the caps are checked by a Budget
    cached = _cached(root, key)
    if cached is not None:
        return cached
    with tempfile.TemporaryDirectory(dir=root / "tmp") as scratch:
        wheels = _download(Path(scratch), requirements, constraints, target, source)
        for wheel, path in wheels:
            blob = root / "blobs" / wheel.sha256
            if not blob.exists():
                os.chmod(path, 0o644)  # the sandbox user reads the linked file through /mnt/wheels
                os.replace(path, blob)
        found = [wheel for wheel, _ in wheels]
        record = root / "resolved" / f"{key}.json"
        temporary = record.with_suffix(".tmp")
        temporary.write_text(json.dumps([asdict(w) for w in found]))
        os.replace(temporary, record)
    return found


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


def _download(scratch: Path, requirements: list[str], constraints: list[str], target: Target,
              source: Source) -> list[tuple[Wheel, Path]]:
    dest, temp = scratch / "wheels", scratch / "pip-tmp"
    dest.mkdir()
    temp.mkdir()
    constraint_file = scratch / "constraints.txt"
    constraint_file.write_text("".join(f"{c}\n" for c in constraints))
    args = [sys.executable, "-m", "pip", "download", "--isolated", "--only-binary=:all:", "--no-input",
            "--disable-pip-version-check", "--progress-bar", "off", "--no-cache-dir", "--dest", str(dest),
            "--constraint", str(constraint_file), *source.pip_args(), *target.pip_args(), "--", *requirements]
    # Only what nbexec sets: no host variable (PIP_*, proxies aside) changes what is resolved.
    env = {"PATH": os.defpath, "TMPDIR": str(temp), "HOME": str(scratch),
           **{k: v for k, v in os.environ.items() if k.lower() in ("http_proxy", "https_proxy", "no_proxy")}}
    log_path = scratch / "pip.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=scratch,
                                   preexec_fn=_file_size_limit(source.max_bytes))
        problem = _watch(process, scratch, source.max_bytes)
    too_large = process.returncode != 0 and "File too large" in log_path.read_text("utf-8", "replace")
    if problem is None and (too_large or (source.max_bytes and _tree_size(scratch) > source.max_bytes)):
        # a file stopped at the kernel's file size limit (EFBIG), or the total grew past the cap between two looks
        problem = f"the download passed the {source.max_bytes:,}-byte cap (max_package_download)"
    if problem is None and process.returncode != 0:
        problem = "pip could not resolve it: " + _tail(log_path)
    if problem is not None:
        raise PackageError(problem)
    return _collect(dest, source)


def _file_size_limit(max_bytes: int) -> Callable[[], None] | None:
    """pip's files can never grow past the cap (RLIMIT_FSIZE, enforced by the kernel); the total is watched."""
    if not max_bytes:
        return None
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes + 64 * 1024, max_bytes + 64 * 1024))


def _watch(process: subprocess.Popen[bytes], folder: Path, max_bytes: int) -> str | None:
    """Wait for pip; stop it past the byte cap or the time limit and say why (None: it finished)."""
    give_up = time.monotonic() + DOWNLOAD_TIME_LIMIT
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(_POLL)
            return None
        if max_bytes and _tree_size(folder) > max_bytes:
            problem = f"the download passed the {max_bytes:,}-byte cap (max_package_download), so it was stopped"
        elif time.monotonic() > give_up:
            problem = f"the download took longer than {DOWNLOAD_TIME_LIMIT:g} s, so it was stopped"
        else:
            continue
        process.kill()
        process.wait()
        return problem


def _tree_size(folder: Path) -> int:
    total = 0
    for parent, _, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(parent, name)).st_size
    return total


def _tail(log_path: Path) -> str:
    lines = [line for line in log_path.read_text("utf-8", "replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")] or lines[-3:]
    return " ".join(errors)[-1500:] or "no output"


def _collect(dest: Path, source: Source) -> list[tuple[Wheel, Path]]:
    found: list[tuple[Wheel, Path]] = []
    entries = sorted(os.listdir(dest))
    if len(entries) > source.max_count:
        raise PackageError(f"it needs {len(entries)} distributions, more than the {source.max_count} allowed per "
                           "execution (max_packages)")
    for filename in entries:
        path = dest / filename
        try:
            name, version, _, _ = parse_wheel_filename(filename)
        except InvalidWheelFilename:
            raise PackageError(f"pip fetched {filename!r}, which is not a wheel; nothing was kept") from None
        found.append((Wheel(canonicalize_name(name), str(version), filename, _sha256(path),
                            os.lstat(path).st_size), path))
    return found


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def link(wheels: list[Wheel], folder: Path, source: Source) -> None:
    """Put ``wheels`` into ``folder`` (a sandbox's /mnt/wheels on the host) under their own file names, each
    checked against its sha256 first; a cache file that no longer matches is removed and raises."""
    blobs = cache_root(source) / "blobs"
    fd = os.open(folder, DIR_FLAGS)
    try:
        present = set(os.listdir(fd))
        for wheel in wheels:
            if wheel.filename in present:
                continue
            blob = blobs / wheel.sha256
            if _sha256(blob) != wheel.sha256:
                blob.unlink(missing_ok=True)
                raise PackageError(f"the cached {wheel.filename} no longer matches its sha256; it was removed, "
                                   "ask again to download it afresh")
            try:
                os.link(blob, wheel.filename, dst_dir_fd=fd)
            except OSError:  # another filesystem (or no hard links): copy
                _copy(blob, wheel.filename, fd)
    finally:
        os.close(fd)


def _copy(blob: Path, name: str, dir_fd: int) -> None:
    with open(blob, "rb") as src:
        out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dir_fd)
        with os.fdopen(out, "wb") as dst:
            shutil.copyfileobj(src, dst)
