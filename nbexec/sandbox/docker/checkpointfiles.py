"""A checkpoint's files on their way out of the engine's folder and back in (see `checkpoint`).

They are hostile data. They are copied through descriptors, regular files only and never through a link, hashed as
they are copied, within a cap. This module touches the host's disk only."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Any

from nbexec.errors import SandboxError
from nbexec.files.workdir import remove_tree

_CHUNK = 1 << 20


def copy_out(source: Path, target: Path, cap: int) -> dict[str, list[Any]]:
    """Copy the checkpoint Docker wrote (regular files only) into ``target`` within ``cap`` bytes in all.

    Returns {name: [size, sha256]} of what was copied. Past the cap the copy stops at cap + 1 byte, the partial
    copy is removed and SandboxError says so."""
    target.mkdir(mode=0o700)
    files: dict[str, list[Any]] = {}
    fd = os.open(source, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    out = os.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for name in sorted(os.listdir(fd)):
            left = cap - sum(size for size, _ in files.values())
            size, digest = _copy_file(fd, out, name, limit=left)
            if size > left:
                raise SandboxError(f"the sandbox's checkpoint is larger than its memory limit allows ({cap:,} "
                                   "bytes with the slack): not kept")
            files[name] = [size, digest]
    except BaseException:
        remove_tree(target)
        raise
    finally:
        os.close(fd)
        os.close(out)
    return files


def copy_in(source: Path, target: Path, files: dict[str, tuple[int, str]]) -> None:
    """Copy the kept checkpoint into Docker's data root: exactly the record's files, each as recorded.

    Each must be a regular file of its recorded size and sha256, hashed as it is copied. SandboxError at the
    first difference."""
    fd = os.open(source, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        if sorted(os.listdir(fd)) != sorted(files):
            raise SandboxError("the hibernated sandbox's checkpoint has files added or removed: not restored")
        target.mkdir(mode=0o700, parents=True)
        out = os.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            for name, (size, digest) in files.items():
                if _copy_file(fd, out, name, limit=size) != (size, digest):
                    raise SandboxError(f"the hibernated sandbox's checkpoint file {name!r} changed: not restored")
        finally:
            os.close(out)
    finally:
        os.close(fd)


def _copy_file(src_dir: int, dst_dir: int, name: str, *, limit: int | None) -> tuple[int, str]:
    """Copy one regular file (never a link) between folders; (bytes copied, their sha256); at most ``limit``+1."""
    try:
        src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=src_dir)
    except OSError as exc:
        raise SandboxError(f"the checkpoint file {name!r} cannot be read safely: {exc.strerror}") from exc
    try:
        if not stat.S_ISREG(os.fstat(src).st_mode):
            raise SandboxError(f"the checkpoint file {name!r} is not a regular file")
        dst = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dst_dir)
        digest, copied = hashlib.sha256(), 0
        with os.fdopen(dst, "wb") as out:
            while chunk := os.read(src, _CHUNK):
                copied += len(chunk)
                if limit is not None and copied > limit:
                    break
                digest.update(chunk)
                out.write(chunk)
        return copied, digest.hexdigest()
    finally:
        os.close(src)
