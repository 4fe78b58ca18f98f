"""The installer that runs inside the sandbox's kernel: wheels from /mnt/wheels unpacked into /mnt/packages.

It uses the standard library and pypa/installer (in the runtime image) only. `nbexec.packages` sends this
module's source into the kernel once per sandbox (as ``_nbexec_wheels``). So an install of cached wheels starts no
pip, whose own start costs about a second of the sandbox's CPU. It installs exactly the host's resolution when
that is safe without pip: every distribution is absent, already at the resolved version, or a dependency at a
version every requirement accepts. Anything else is handed to pip, offline, as before.

Every byte of a wheel is hostile, and is checked here before pypa/installer sees it. These refuse the whole wheel
before anything is written: absolute paths, ``..``, backslashes, links, devices, duplicate names, a name both file
and folder, or a place outside the purelib/platlib/scripts/data/headers mapping. WHEEL and entry_points.txt are
read to 64 KiB; the wheel's RECORD is never read. pypa/installer then lays the checked members out through a
destination that never follows links. Writes land on /mnt/packages, whose size the kernel enforces. An image
without pypa/installer installs with pip, offline, instead.
"""

from __future__ import annotations

import base64
import configparser
import hashlib
import importlib
import importlib.metadata
import io
import os
import re
import stat
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from email.parser import HeaderParser
from typing import IO, Any, BinaryIO, cast

try:
    from installer import install as _lay_out
    from installer.destinations import SchemeDictionaryDestination
    from installer.records import Hash, RecordEntry
    from installer.scripts import Script
    from installer.sources import WheelSource
    from installer.utils import Scheme
except ImportError:  # an image built before pypa/installer was in it: `install` hands the wheels to pip
    _lay_out = None  # type: ignore[assignment]
    SchemeDictionaryDestination = WheelSource = object  # type: ignore[assignment,misc]

PREFIX = "/mnt/packages"
WHEELS = "/mnt/wheels"
_SCHEMES = ("purelib", "platlib", "scripts", "data", "headers")
_REFERENCE = re.compile(r"\s*([\w.]+)\s*:\s*([\w.]+)\s*")  # module:attr, as pypa/installer parses a console script
NO_INSTALLER = "this image has no pypa/installer, so pip installs the cached wheels instead"
_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class UnsafeWheel(Exception):
    """A wheel that would write outside its places, or holds something other than files and folders."""


def paths(prefix: str = PREFIX) -> dict[str, str]:
    """Where each wheel scheme goes under ``prefix`` (pip's --prefix layout)."""
    found = sysconfig.get_paths(vars={"base": prefix, "platbase": prefix})
    version = "python{}.{}".format(*sys.version_info[:2])
    return {"purelib": found["purelib"], "platlib": found["platlib"], "scripts": found["scripts"],
            "data": prefix, "headers": os.path.join(prefix, "include", version)}


def install(specs: Sequence[str], wheels: Sequence[Sequence[str]], *, asked: Iterable[str] = (),
            verbose: bool = False, folder: str = WHEELS, prefix: str = PREFIX) -> str:
    """Install the resolution ``wheels`` ([filename, name, version], names normalised); pip (offline) when
    unpacking alone would not do what pip does. Returns what was done, as pip would say it."""
    places = paths(prefix)
    asked = set(asked)
    todo, decided = _plan(wheels, folder, asked)
    if decided == "pip":
        return _pip(specs, verbose)
    if todo and _lay_out is None:
        print(f"nbexec: {NO_INSTALLER}", file=sys.stderr)
        return _pip(specs, verbose, why=f" ({NO_INSTALLER})")
    done = []
    for filename, name, version in todo:
        unpack(os.path.join(folder, filename), places, requested=name in asked)
        done.append(f"{name}-{version}")
    importlib.invalidate_caches()
    said = "Successfully installed " + " ".join(done) if done else "Requirement already satisfied: " + \
        " ".join(specs)
    if verbose:
        print(said)
    return said


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _plan(wheels: Sequence[Sequence[str]], folder: str, asked: set[str]) -> tuple[list[Sequence[str]], str]:
    """The wheels to unpack, and "unpack"; or "pip" when unpacking alone is not safe.

    That is when a package asked for is installed at another version, or an installed dependency does not meet
    a requirement of the resolution."""
    todo: list[Sequence[str]] = []
    present: dict[str, str] = {}
    for filename, name, version in wheels:
        have = _installed(name)
        if have is None:
            todo.append((filename, name, version))
        elif have != version:
            if name in asked:
                return [], "pip"
            present[name] = have
    if present and not _accepted(present, wheels, folder):
        return [], "pip"
    return todo, "unpack"


def _accepted(present: dict[str, str], wheels: Sequence[Sequence[str]], folder: str) -> bool:
    """Whether every requirement of the resolution accepts the versions installed for ``present``."""
    try:
        from pip._vendor.packaging.requirements import InvalidRequirement, Requirement
        from pip._vendor.packaging.utils import canonicalize_name
    except ImportError:
        return False
    for filename, _, _ in wheels:
        for line in _requires(os.path.join(folder, filename)):
            try:
                requirement = Requirement(line)
            except InvalidRequirement:
                return False
            name = canonicalize_name(requirement.name)
            if name not in present or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
                continue
            if not requirement.specifier.contains(present[name], prereleases=True):
                return False
    return True


def _requires(path: str) -> list[str]:
    with zipfile.ZipFile(path) as archive:
        info = _dist_info(archive.namelist())
        text = archive.read(f"{info}/METADATA")[:1 << 20].decode("utf-8", "replace")
    return HeaderParser().parsestr(text).get_all("Requires-Dist") or []


def _pip(specs: Sequence[str], verbose: bool, why: str = "") -> str:
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-input", "--", *specs],
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError((done.stdout + done.stderr).strip()[-1500:])
    importlib.invalidate_caches()
    if verbose:
        print(done.stdout.strip()[-3000:])
    return f"pip{why}: " + done.stdout.strip()[-200:]


def _dist_info(names: list[str]) -> str:
    found = {name.split("/", 1)[0] for name in names if name.count("/") == 1 and name.endswith(".dist-info/WHEEL")}
    if len(found) != 1:
        raise UnsafeWheel("a wheel needs exactly one .dist-info folder with a WHEEL file")
    return found.pop()


def target(name: str, info: zipfile.ZipInfo, dist_info: str, places: dict[str, str], root: str) -> tuple[str, str]:
    """Where member ``name`` goes and its scheme, or UnsafeWheel."""
    parts = name.split("/")
    kind = stat.S_IFMT(info.external_attr >> 16)
    if name.startswith("/") or "\\" in name or "\0" in name or any(p in ("", ".", "..") for p in parts) \
            or ":" in parts[0] or kind not in (0, stat.S_IFREG):
        raise UnsafeWheel(f"the wheel member {name[:200]!r} is not a plain relative file")
    data = dist_info[:-len(".dist-info")] + ".data"
    if parts[0] != data:
        return os.path.join(places[root], *parts), root
    if len(parts) < 3 or parts[1] not in _SCHEMES:
        raise UnsafeWheel(f"the wheel member {name[:200]!r} names no scheme a wheel may install to")
    return os.path.join(places[parts[1]], *parts[2:]), parts[1]


class CheckedWheel(WheelSource):
    """A wheel whose every member nbexec checked, as pypa/installer reads it.

    It offers the checked members only (never the wheel's RECORD), the WHEEL nbexec read, and the console scripts
    nbexec kept."""

    def __init__(self, archive: zipfile.ZipFile, dist_info: str, members: list[zipfile.ZipInfo], root: str,
                 version: str, scripts: dict[str, str]) -> None:
        stem = dist_info[:-len(".dist-info")]
        super().__init__(stem, "")  # only pypa/installer's messages read these: the two properties below are exact
        self.archive, self.members, self.root, self.scripts = archive, members, root, scripts
        self.info, self.data = dist_info, stem + ".data"
        self.wheel = f"Wheel-Version: {version}\nRoot-Is-Purelib: {str(root == 'purelib').lower()}\n"

    @property
    def dist_info_dir(self) -> str:
        return self.info

    @property
    def data_dir(self) -> str:
        return self.data

    @property
    def dist_info_filenames(self) -> list[str]:
        return ["WHEEL", *(["entry_points.txt"] if self.scripts else [])]

    def read_dist_info(self, filename: str) -> str:
        return self.wheel if filename == "WHEEL" else \
            "[console_scripts]\n" + "".join(f"{name} = {ref}\n" for name, ref in self.scripts.items())

    def get_contents(self) -> Iterator[tuple[tuple[str, str, str], BinaryIO, bool]]:
        for info in self.members:
            with self.archive.open(info) as stream:
                yield (info.filename, "", ""), cast(BinaryIO, stream), bool((info.external_attr >> 16) & 0o111)


class NoFollowDestination(SchemeDictionaryDestination):
    """pypa/installer's destination, writing through `_put` so no link the sandbox planted is followed.

    Modes are nbexec's: 0o755 for scripts and members with an x bit, 0o644 for the rest. It remembers what it
    wrote. No @dataclass: the kernel runs this module unregistered in sys.modules, where dataclasses cannot find it."""

    def __init__(self, places: dict[str, str]) -> None:
        super().__init__(dict(places), sys.executable, "posix")
        self.written: list[str] = []

    def write_to_fs(self, scheme: Scheme, path: str, stream: IO[bytes], is_executable: bool) -> RecordEntry:
        where = os.path.join(self.scheme_dict[scheme], path)
        digest, size = _put(where, stream, 0o755 if is_executable or scheme == "scripts" else 0o644)
        self.written.append(where)
        return RecordEntry(path, Hash("sha256", digest), size)

    def write_script(self, name: str, module: str, attr: str, section: Any) -> RecordEntry:
        """pypa/installer's launcher, written by `write_to_fs` (its own write_script chmods by path, after)."""
        filename, launcher = Script(name, module, attr, section).generate(self.interpreter, self.script_kind)
        return self.write_to_fs(Scheme("scripts"), filename, io.BytesIO(launcher), True)


def unpack(path: str, places: dict[str, str], *, requested: bool = False) -> list[str]:
    """Install one wheel: its files, console scripts, INSTALLER, REQUESTED and a RECORD of what was written.
    Returns the RECORD's paths (relative to the root scheme's folder)."""
    with zipfile.ZipFile(path) as archive:
        source = checked(path, archive, places)
        destination = NoFollowDestination(places)
        _lay_out(source, destination, {"INSTALLER": b"nbexec\n", **({"REQUESTED": b""} if requested else {})})
    return [os.path.relpath(where, places[source.root]) for where in destination.written]


def checked(path: str, archive: zipfile.ZipFile, places: dict[str, str]) -> CheckedWheel:
    """The wheel at ``path`` once every member is checked, or UnsafeWheel (before anything is written)."""
    members = [info for info in archive.infolist() if not info.filename.endswith("/")]
    names = [info.filename for info in members]
    if len(set(names)) != len(names):
        raise UnsafeWheel(f"{os.path.basename(path)} names a file twice")
    dist_info = _dist_info(names)
    wheel = HeaderParser().parsestr(archive.read(f"{dist_info}/WHEEL")[:65536].decode("utf-8", "replace"))
    version = str(wheel.get("Wheel-Version", "")).strip()
    if not version.startswith("1."):
        raise UnsafeWheel(f"{os.path.basename(path)} is no Wheel-Version 1.x wheel ({version[:20]!r})")
    root = "purelib" if str(wheel.get("Root-Is-Purelib", "")).strip().lower() == "true" else "platlib"
    members = [info for info in members if info.filename != f"{dist_info}/RECORD"]
    planned = [target(info.filename, info, dist_info, places, root)[0] for info in members]
    scripts = _scripts(archive, dist_info)
    meta = os.path.join(places[root], dist_info)
    _refuse_clashes(path, planned + [os.path.join(places["scripts"], name) for name in scripts]
                    + [os.path.join(meta, name) for name in ("INSTALLER", "REQUESTED", "RECORD")])
    return CheckedWheel(archive, dist_info, members, root, version, scripts)


def _refuse_clashes(wheel: str, writes: list[str]) -> None:
    """UnsafeWheel when a path to write is also a folder another one needs.

    This is checked before anything is written, so such a wheel is refused whole, not half-way with an OSError."""
    files = set(writes)
    for where in files:
        folder = os.path.dirname(where)
        while folder != os.path.dirname(folder):
            if folder in files:
                raise UnsafeWheel(f"{os.path.basename(wheel)} names {folder[-200:]!r} both a file and a folder")
            folder = os.path.dirname(folder)


def _put(where: str, stream: IO[bytes], mode: int) -> tuple[str, int]:
    """Write ``stream`` to a new or truncated ``where``, never through a link, ``mode`` whatever the umask.

    Returns its sha256 (urlsafe base64, unpadded) and size."""
    os.makedirs(os.path.dirname(where), exist_ok=True)
    digest, size = hashlib.sha256(), 0
    with os.fdopen(os.open(where, _FLAGS, mode), "wb") as handle:
        os.fchmod(handle.fileno(), mode)
        for block in iter(lambda: stream.read(1 << 16), b""):
            digest.update(block)
            handle.write(block)
            size += len(block)
    return base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode(), size


def _scripts(archive: zipfile.ZipFile, dist_info: str) -> dict[str, str]:
    """The console scripts of entry_points.txt that pypa/installer can write a launcher for: name -> module:attr.
    A hidden, slashed or empty name, or a reference that is not module:attr, is skipped (pypa/installer would
    stop half-way on it)."""
    try:
        text = archive.read(f"{dist_info}/entry_points.txt")[:65536].decode("utf-8", "replace")
    except KeyError:
        return {}
    parser = configparser.ConfigParser(interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    try:
        parser.read_string(text)
    except configparser.Error:
        return {}
    entries: dict[str, Any] = dict(parser["console_scripts"]) if parser.has_section("console_scripts") else {}
    kept = {}
    for name, value in entries.items():
        reference = _REFERENCE.fullmatch(value)
        if name and not name.startswith(".") and not any(c in name for c in "/\\\0") and reference:
            kept[name] = f"{reference[1]}:{reference[2]}"
    return kept
