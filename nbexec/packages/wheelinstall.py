"""The installer that runs inside the sandbox's kernel: wheels from /mnt/wheels unpacked into /mnt/packages.

Standard library only: `nbexec.packages` sends this module's source into the kernel once per sandbox (as the
module ``_nbexec_wheels``), so an install of cached wheels starts no pip (pip's own start costs about a second
of the sandbox's CPU). It installs exactly the host's resolution when that is safe to do without pip: every
distribution is absent, already at the resolved version, or (a dependency) installed at a version every
requirement of the resolution accepts. Anything else (another version of a package asked for, a requirement the
installed version does not meet) is handed to pip, offline, as before.

Every byte of a wheel is treated as hostile: members with absolute paths, ``..``, backslashes, links, devices,
duplicate names, or a place outside the purelib/platlib/scripts/data/headers mapping refuse the whole wheel, and
files are created without following links. Writes land on /mnt/packages, whose size the kernel enforces.
"""

from __future__ import annotations

import base64
import configparser
import csv
import hashlib
import importlib
import importlib.metadata
import io
import os
import stat
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterable, Sequence
from email.parser import HeaderParser
from typing import Any

PREFIX = "/mnt/packages"
WHEELS = "/mnt/wheels"
_SCHEMES = ("purelib", "platlib", "scripts", "data", "headers")
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
    """The wheels to unpack, and "unpack", or "pip" when a package asked for is installed at another version
    or an installed dependency does not meet a requirement of the resolution."""
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


def _pip(specs: Sequence[str], verbose: bool) -> str:
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-input", "--", *specs],
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError((done.stdout + done.stderr).strip()[-1500:])
    importlib.invalidate_caches()
    if verbose:
        print(done.stdout.strip()[-3000:])
    return "pip: " + done.stdout.strip()[-200:]


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


def unpack(path: str, places: dict[str, str], *, requested: bool = False) -> list[str]:
    """Install one wheel: its files, console scripts, INSTALLER, REQUESTED and a RECORD of what was written."""
    with zipfile.ZipFile(path) as archive:
        members = [info for info in archive.infolist() if not info.filename.endswith("/")]
        names = [info.filename for info in members]
        if len(set(names)) != len(names):
            raise UnsafeWheel(f"{os.path.basename(path)} names a file twice")
        dist_info = _dist_info(names)
        wheel = HeaderParser().parsestr(archive.read(f"{dist_info}/WHEEL")[:65536].decode("utf-8", "replace"))
        root = "purelib" if str(wheel.get("Root-Is-Purelib", "")).strip().lower() == "true" else "platlib"
        planned = [(info, *target(info.filename, info, dist_info, places, root)) for info in members
                   if info.filename != f"{dist_info}/RECORD"]
        scripts = {os.path.join(places["scripts"], name): body for name, body in _scripts(archive, dist_info).items()}
        site = places[root]
        meta = os.path.join(site, dist_info)
        _refuse_clashes(path, [where for _, where, _ in planned] + list(scripts)
                        + [os.path.join(meta, name) for name in ("INSTALLER", "REQUESTED", "RECORD")])
        records = [_write(archive, info, where, scheme) for info, where, scheme in planned]
        records += [_put(where, body.encode(), 0o755) for where, body in scripts.items()]
    extra = {"INSTALLER": b"nbexec\n", **({"REQUESTED": b""} if requested else {})}
    for name, content in extra.items():
        records.append(_put(os.path.join(meta, name), content, 0o644))
    rows = [(os.path.relpath(where, site), digest, str(size)) for where, digest, size in records]
    rows.append((os.path.relpath(os.path.join(meta, "RECORD"), site), "", ""))
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows(rows)
    _put(os.path.join(meta, "RECORD"), text.getvalue().encode(), 0o644)
    return [row[0] for row in rows]


def _refuse_clashes(wheel: str, writes: list[str]) -> None:
    """UnsafeWheel when a path to write is also a folder another one needs (checked before anything is written,
    so such a wheel is refused whole instead of stopping half-way with an OSError)."""
    files = set(writes)
    for where in files:
        folder = os.path.dirname(where)
        while folder != os.path.dirname(folder):
            if folder in files:
                raise UnsafeWheel(f"{os.path.basename(wheel)} names {folder[-200:]!r} both a file and a folder")
            folder = os.path.dirname(folder)


def _write(archive: zipfile.ZipFile, info: zipfile.ZipInfo, where: str, scheme: str) -> tuple[str, str, int]:
    with archive.open(info) as source:
        content = source.read()
    executable = scheme == "scripts" or bool((info.external_attr >> 16) & 0o111)
    if scheme == "scripts" and content.startswith(b"#!python"):
        content = b"#!" + sys.executable.encode() + content[len(b"#!python"):]
    return _put(where, content, 0o755 if executable else 0o644)


def _put(where: str, content: bytes, mode: int) -> tuple[str, str, int]:
    os.makedirs(os.path.dirname(where), exist_ok=True)
    fd = os.open(where, _FLAGS, mode)
    with os.fdopen(fd, "wb") as handle:
        handle.write(content)
    os.chmod(where, mode, follow_symlinks=False)
    digest = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=").decode()
    return where, f"sha256={digest}", len(content)


def _scripts(archive: zipfile.ZipFile, dist_info: str) -> dict[str, str]:
    """The console_scripts launchers pip would write (entry_points.txt): name -> the launcher's text."""
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
    launchers = {}
    entries: dict[str, Any] = dict(parser["console_scripts"]) if parser.has_section("console_scripts") else {}
    for name, value in entries.items():
        module, _, attr = value.partition(":")
        if not name or "/" in name or name.startswith(".") or not module.strip():
            continue
        call = f"{attr.strip()}()" if attr.strip() else "None"
        launchers[name] = (f"#!{sys.executable}\nimport sys\nfrom {module.strip()} import "
                           f"{attr.strip().split('.')[0]}\nsys.exit({call})\n") if attr.strip() else \
            f"#!{sys.executable}\nimport {module.strip()}\n"
    return launchers
