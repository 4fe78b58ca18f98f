"""The `.env` file: KEY=value lines from the current folder, loaded under the real environment, never over it."""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

from nbexec.errors import ConfigError

NAME = ".env"
MAX_BYTES = 1024 * 1024  # a .env past this is not a settings file; refuse it rather than parse it


def load(folder: Path | None = None) -> list[str]:
    """Set the variables of ``folder/.env`` (default: the current folder) that the environment lacks.

    A variable already in the environment keeps its value, even an empty one. Returns the names set.
    No file is no error; a file that cannot be read, is over MAX_BYTES, belongs to another user (root excepted) or
    is writable by everyone is a ConfigError: it is trusted like the command line.
    """
    path = (folder if folder is not None else Path.cwd()) / NAME
    text = _read(path)
    if text is None:
        return []
    from dotenv import load_dotenv

    before = set(os.environ)
    load_dotenv(stream=io.StringIO(text), override=False, interpolate=True)
    return sorted(set(os.environ) - before)


def _read(path: Path) -> str | None:
    try:
        # Non-blocking, so a FIFO named .env cannot hang the command before fstat refuses it.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from exc
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise ConfigError(f"{path} is a folder, not a .env file; rename it or run nbexec from another folder")
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{path} is not a regular file; remove it or run nbexec from another folder")
        if info.st_uid not in (os.getuid(), 0) or info.st_mode & stat.S_IWOTH:
            # Another local user could have put it there (a shared folder) to turn the network on or move DOCKER_HOST.
            raise ConfigError(f"{path} is owned by uid {info.st_uid} or writable by everyone; nbexec reads only a "
                              ".env that is yours and not world-writable (fix it with chown/chmod o-w, or remove it)")
        if info.st_size > MAX_BYTES:
            raise ConfigError(f"{path} is {info.st_size} bytes, over the {MAX_BYTES} a .env may have")
        data = _read_at_most(fd, MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_BYTES:  # it grew after fstat
        raise ConfigError(f"{path} is over the {MAX_BYTES} bytes a .env may have")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not UTF-8 text") from exc


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
