"""The `.env` file: KEY=value lines from the current folder, loaded under the real environment, never over it.

A `.env` is trusted like the command line (it can turn the network on or move DOCKER_HOST), so nbexec loads one
only from a place its user controls: a regular file with one name (no link), in a folder that is the user's
(or root's), and neither of them writable by group (the user's own private group excepted) or others; and never
from below a folder that holds files copied out of a sandbox (`nbexec.files.folders.MARK`).
"""

from __future__ import annotations

import errno
import grp
import io
import os
import pwd
import re
import stat
from pathlib import Path

from nbexec.errors import ConfigError
from nbexec.files.folders import marked

NAME = ".env"
MAX_BYTES = 1024 * 1024  # a .env past this is not a settings file; refuse it rather than parse it
_loaded: dict[str, Path] = {}  # each variable a .env set in this process, and that file (for error messages)
_READ = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC  # a FIFO cannot hang us before fstat refuses it


def load(folder: Path | None = None) -> list[str]:
    """Set the variables of ``folder/.env`` (default: the current folder) that the environment lacks.

    A variable already in the environment keeps its value, even an empty one. Returns the names set.
    No file is no error; a file nbexec must not trust (see the module docstring), one that cannot be read or is
    over MAX_BYTES, is a ConfigError.
    """
    folder_path = folder if folder is not None else Path.cwd()
    text = _read(folder_path)
    if text is None:
        return []
    from dotenv import load_dotenv

    before = set(os.environ)
    load_dotenv(stream=io.StringIO(text), override=False, interpolate=True)
    names = sorted(set(os.environ) - before)
    _loaded.update(dict.fromkeys(names, folder_path / NAME))
    return names


def origin(message: str) -> str:
    """" (from PATH)" when ``message`` names a variable this process took from a .env file, else ""."""
    found = sorted({str(path) for name, path in _loaded.items() if re.search(rf"\b{re.escape(name)}\b", message)})
    return f" ({', '.join(found)} sets it; fix the value there)" if found else ""


def _read(folder: Path) -> str | None:
    path = folder / NAME
    try:  # O_PATH: a folder you may enter but not list still works, as before
        folder_fd = os.open(folder, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot open the folder {folder}: {exc.strerror}") from exc
    try:
        fd = os.open(NAME, _READ, dir_fd=folder_fd)
    except FileNotFoundError:
        os.close(folder_fd)
        return None
    except OSError as exc:
        os.close(folder_fd)
        if exc.errno == errno.ELOOP:
            raise ConfigError(f"{path} is a link; nbexec loads only a .env that is a file of its own (copy the "
                              "settings into it, or run nbexec from another folder)") from exc
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from exc
    try:
        _check_folder(folder, os.fstat(folder_fd))
        _check_file(path, os.fstat(fd))
        data = _read_at_most(fd, MAX_BYTES + 1)
    finally:
        os.close(fd)
        os.close(folder_fd)
    if len(data) > MAX_BYTES:  # it grew after fstat
        raise ConfigError(f"{path} is over the {MAX_BYTES} bytes a .env may have")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not UTF-8 text") from exc


def _check_folder(folder: Path, info: os.stat_result) -> None:
    problem = _control_problem(info)
    if problem:
        # Another local user could have put it there (a shared folder) to turn the network on or move DOCKER_HOST.
        raise ConfigError(f"{folder / NAME} lies in a folder {problem}; nbexec loads a .env only from a folder "
                          f"that is yours and writable by you alone (chmod g-w,o-w {folder}), or run nbexec from "
                          "another folder")
    outputs = marked(folder)
    if outputs is not None:
        raise ConfigError(f"{folder / NAME} lies in an nbexec output folder ({outputs}): files there may come from "
                          "a sandbox, so nbexec never loads them. Keep your settings elsewhere, or run nbexec from "
                          "another folder")


def _check_file(path: Path, info: os.stat_result) -> None:
    if stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"{path} is a folder, not a .env file; rename it or run nbexec from another folder")
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{path} is not a regular file; remove it or run nbexec from another folder")
    problem = _control_problem(info)
    if problem:
        raise ConfigError(f"{path} is {problem}; nbexec reads only a .env that is yours and writable by you alone "
                          "(fix it with chown/chmod g-w,o-w, or remove it)")
    if info.st_nlink > 1:
        raise ConfigError(f"{path} has {info.st_nlink} names (a hard link): nbexec loads only a .env that is a file "
                          "of its own, not a link to another (copy it, or run nbexec from another folder)")
    if info.st_size > MAX_BYTES:
        raise ConfigError(f"{path} is {info.st_size} bytes, over the {MAX_BYTES} a .env may have")


def _control_problem(info: os.stat_result) -> str:
    """Why someone but this user (and root) could change the file or folder ``info`` describes ("" if nobody)."""
    if info.st_uid not in (os.getuid(), 0):
        return f"owned by uid {info.st_uid}"
    if info.st_mode & stat.S_IWOTH:
        return "writable by everyone"
    if info.st_mode & stat.S_IWGRP and not _private_group(info.st_gid):
        return f"writable by group {info.st_gid}"
    return ""


def _private_group(gid: int) -> bool:
    """Whether ``gid`` is this user's own group (user private groups: named after the user, no other member), so
    a umask of 002 is no reason to refuse."""
    try:
        user = pwd.getpwuid(os.getuid()).pw_name
        group = grp.getgrgid(gid)
    except KeyError:
        return False
    return gid == os.getgid() and group.gr_name == user and set(group.gr_mem) <= {user}


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = os.read(fd, min(65536, limit - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)
