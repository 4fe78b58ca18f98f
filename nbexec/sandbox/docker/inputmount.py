"""What of the input folder the sandbox never sees: nbexec's own configuration files.

`nbexec run FILE` mounts FILE's folder read-only at /mnt/input, and that folder often holds the `.env` nbexec reads
its storage keys and service tokens from, with its kin (`.env.local`, `prod.env`, a sub-folder's `.env`). Before
the container is made, nbexec walks the folder (never following a link, at most MAX_ENTRIES entries) and lays an
empty read-only file, or folder, over: every entry named like a settings file (`is_settings_name`, any case);
the entry a link so named leads to, resolved as the sandbox resolves it; and every other name (hard link) of a
file so withheld. The notebook still runs; the result's notes say what was withheld. Links elsewhere in the folder
need nothing: inside the sandbox they resolve to /mnt/input paths, which are covered, or to the sandbox's own files.
"""

from __future__ import annotations

import os
import posixpath
import stat
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import NamedTuple

import docker.types

from nbexec.errors import ConfigError

MAX_INPUT_LINKS = 200  # top-level entries of the input folder placed in /mnt/data (see inputcopy)
MAX_ENTRIES = 100_000  # entries of the input folder checked before it is mounted; a larger folder is refused
MAX_WITHHELD = 256  # settings files withheld (each is one mount); more is refused
_SHOWN = 10
_HOPS = 40  # links followed when resolving one as the sandbox would (the kernel's own limit)


class Withheld(NamedTuple):
    """An entry of the input folder the sandbox sees empty, and why when its own name does not say."""

    is_dir: bool
    why: str = ""  # "what x/.env leads to", "another name of .env"


def is_settings_name(name: str) -> bool:
    """`.env`, `.env.<anything>` and `<anything>.env`, in any case: the names dotenv files go by."""
    lower = name.lower()
    return lower == ".env" or lower.startswith(".env.") or lower.endswith(".env")


def prepare(folder: str, workdir: Path, mount_point: str, withheld: dict[PurePosixPath, Withheld] | None = None,
            ) -> tuple[list[docker.types.Mount], list[str]]:
    """The mounts that hide ``folder``'s settings files under ``mount_point`` (empty stand-ins made in
    ``workdir``), and the notes that say what was withheld (``withheld``: `scan`'s answer, when already asked).
    ConfigError when the folder is too large to check."""
    withheld = scan(folder, mount_point) if withheld is None else withheld
    if not withheld:
        return [], []
    empty_file, empty_dir = workdir / "withheld", workdir / "withheld.d"
    empty_file.touch(mode=0o444)
    empty_file.chmod(0o444)
    empty_dir.mkdir(mode=0o555)
    empty_dir.chmod(0o555)
    mounts = [docker.types.Mount(f"{mount_point}/{relative}", str(empty_dir if entry.is_dir else empty_file),
                                 type="bind", read_only=True) for relative, entry in sorted(withheld.items())]
    names = [repr(str(relative))[1:-1] + (f" ({entry.why})" if entry.why else "")
             for relative, entry in sorted(withheld.items())]
    shown = ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
    return mounts, [f"nbexec withheld {len(names)} settings file(s) of the input folder from the sandbox (they "
                    f"read as empty in {mount_point}): {shown}."]


def scan(folder: str, mount_point: str) -> dict[PurePosixPath, Withheld]:
    """The entries of ``folder`` (mounted at ``mount_point``) to withhold, by relative path."""
    withheld: dict[PurePosixPath, Withheld] = {}
    for relative, entry in _walk(folder):
        if not is_settings_name(relative.name):
            continue
        if entry is None or not entry.is_symlink():
            withheld[relative] = Withheld(entry is not None and entry.is_dir(follow_symlinks=False))
            continue
        target = _resolve(folder, relative, mount_point)
        if target is not None:
            withheld.setdefault(target, Withheld(os.path.isdir(os.path.join(folder, target)),
                                                 f"what {relative} leads to"))
    _add_hard_links(folder, withheld)
    for relative in withheld:
        mode = os.lstat(os.path.join(folder, relative)).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # a mount over a FIFO hangs gVisor's start
            raise ConfigError(f"{os.path.join(folder, relative)} looks like a settings file and is not a regular "
                              "file (a named pipe, socket or device), which nbexec cannot withhold from the sandbox: "
                              "mount a narrower folder with --mount-input (input_dir), or run without one "
                              "(--no-mount-folder)")
    folders = {relative for relative, entry in withheld.items() if entry.is_dir}
    withheld = {relative: entry for relative, entry in withheld.items()  # an empty folder hides what it covers
                if not any(parent in folders for parent in relative.parents)}
    if len(withheld) > MAX_WITHHELD:
        raise ConfigError(f"the input folder {folder} holds more than {MAX_WITHHELD} settings files (.env and the "
                          "like) to withhold from the sandbox; mount a narrower folder with --mount-input (input_dir)"
                          " or run without one (--no-mount-folder)")
    for relative in withheld:
        try:
            str(relative).encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError(f"{os.path.join(folder, relative)!r} looks like a settings file, and its name is not "
                              "UTF-8, so nbexec cannot withhold it from the sandbox: rename it, or mount another "
                              "folder") from None
    return withheld


def _walk(folder: str) -> Iterator[tuple[PurePosixPath, os.DirEntry[str] | None]]:
    """Every entry below ``folder`` (links not followed), at most MAX_ENTRIES; an entry of a folder nbexec cannot
    list is probed by the one name nbexec loads (`.env`), with None for its DirEntry."""
    pending, seen = [PurePosixPath()], 0
    while pending:
        relative = pending.pop()
        try:
            with os.scandir(os.path.join(folder, relative)) as entries:
                listed = list(entries)
        except PermissionError:
            if os.path.lexists(os.path.join(folder, relative, ".env")):
                yield relative / ".env", None
            continue
        except (FileNotFoundError, NotADirectoryError):
            continue  # changed while it was walked
        seen += len(listed)
        if seen > MAX_ENTRIES:
            raise ConfigError(f"the input folder {folder} has more than {MAX_ENTRIES:,} entries: nbexec checks "
                              "every one for its own settings files (.env and the like) before it shows a folder to "
                              "the sandbox. Mount a narrower folder with --mount-input (input_dir), or run without "
                              "one (--no-mount-folder)")
        for entry in listed:
            yield relative / entry.name, entry
            if entry.is_dir(follow_symlinks=False) and not is_settings_name(entry.name):
                pending.append(relative / entry.name)


def _resolve(folder: str, relative: PurePosixPath, mount_point: str) -> PurePosixPath | None:
    """Where the sandbox lands when it opens ``mount_point``/``relative``, as a path inside ``folder`` (None when
    that is outside it, the folder itself, or nothing)."""
    done: list[str]
    parts, done, hops = list(relative.parts), [], 0
    while parts:
        part = parts.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if not done:
                return None  # above /mnt/input: the sandbox's own folders
            done.pop()
            continue
        here = os.path.join(folder, *done, part)
        if not os.path.islink(here):
            done.append(part)
            continue
        hops += 1
        target = os.readlink(here)
        if hops > _HOPS:
            return None
        if target.startswith("/"):  # an absolute link means the sandbox's tree: only the mount is the folder
            target = posixpath.normpath(target)
            if not target.startswith(mount_point + "/"):
                return None
            done, target = [], target[len(mount_point) + 1:]
        parts = target.split("/") + parts
    return PurePosixPath(*done) if done and os.path.lexists(os.path.join(folder, *done)) else None


def _add_hard_links(folder: str, withheld: dict[PurePosixPath, Withheld]) -> None:
    """Add every other name of a withheld regular file (same device and inode)."""
    inodes = {}
    for relative, entry in withheld.items():
        info = os.lstat(os.path.join(folder, relative))
        if not entry.is_dir and stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
            inodes[(info.st_dev, info.st_ino)] = relative
    if not inodes:
        return
    for relative, found in _walk(folder):
        if found is not None and found.is_file(follow_symlinks=False):
            info = found.stat(follow_symlinks=False)
            if (info.st_dev, info.st_ino) in inodes:
                withheld.setdefault(relative, Withheld(False, f"another name of {inodes[(info.st_dev, info.st_ino)]}"))

