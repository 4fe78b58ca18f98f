"""File operations inside the sandbox, as the sandbox user (stdlib only, Python 3.9+): part of the agent.

Paths are resolved in the sandbox (relative ones from the agent's working folder), so the sandbox's own view and
permissions decide. Contents go through descriptors opened without blocking, so a FIFO the code planted cannot hold
the agent, and only regular files are read or written; a read never goes past the size seen when it was opened.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import shutil
import stat
from typing import Any

from .wire import FILE_CHUNK, MAX_DEPTH, MAX_ENTRIES, MAX_HANDLES

Answer = tuple[dict[str, Any], bytes]


def error_code(exc: OSError) -> str:
    """The wire's code for an OSError."""
    codes = {errno.ENOENT: "not_found", errno.EEXIST: "already_exists", errno.EISDIR: "is_a_directory",
             errno.ENOTDIR: "not_a_directory", errno.EACCES: "permission_denied", errno.EPERM: "permission_denied",
             errno.EROFS: "permission_denied", errno.ENOSPC: "no_space", errno.EDQUOT: "no_space",
             errno.ENAMETOOLONG: "invalid_argument", errno.ENXIO: "invalid_argument",
             errno.ENOTEMPTY: "invalid_argument"}
    return codes.get(exc.errno or 0, "os_error")


class Failure(Exception):
    """A request refused with a code the host maps to its error classes."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _name(table: Any, number: int) -> str:
    try:
        return str(table(number)[0])
    except (KeyError, OSError):
        return str(number)


def entry(path: str) -> dict[str, Any]:
    """What E2B's EntryInfo says of ``path``, not following a last link."""
    info = os.lstat(path)
    kind = ("symlink" if stat.S_ISLNK(info.st_mode) else "dir" if stat.S_ISDIR(info.st_mode)
            else "file" if stat.S_ISREG(info.st_mode) else "other")
    return {"name": os.path.basename(path) or path, "type": kind, "path": path, "size": info.st_size,
            "mode": stat.S_IMODE(info.st_mode), "permissions": stat.filemode(info.st_mode),
            "owner": _name(pwd.getpwuid, info.st_uid), "group": _name(grp.getgrgid, info.st_gid),
            "mtime": info.st_mtime, "symlink_target": os.readlink(path) if kind == "symlink" else None}


class FileOps:
    """The file requests and the files they hold open (reads and writes in progress, at most MAX_HANDLES)."""

    def __init__(self) -> None:
        self.handles: dict[int, tuple[int, int, str]] = {}  # handle: (fd, bytes left or -1 for a write, path)
        self.next_handle = 1

    def op_stat(self, head: dict[str, Any], _: bytes) -> Answer:
        return {"entry": entry(os.path.abspath(head["path"]))}, b""

    def op_list_dir(self, head: dict[str, Any], _: bytes) -> Answer:
        root, depth, found = os.path.abspath(head["path"]), min(int(head["depth"]), MAX_DEPTH), []
        if not stat.S_ISDIR(os.stat(root).st_mode):
            raise Failure("not_a_directory", f"{root} is not a directory")
        level = [root]
        for _round in range(max(depth, 1)):
            deeper = []
            for folder in level:
                with os.scandir(folder) as scan:
                    for item in scan:
                        found.append(entry(item.path))
                        if len(found) > MAX_ENTRIES:
                            raise Failure("resource_exhausted", f"more than {MAX_ENTRIES} entries")
                        if item.is_dir(follow_symlinks=False):
                            deeper.append(item.path)
            level = deeper
        return {"entries": found}, b""

    def op_make_dir(self, head: dict[str, Any], _: bytes) -> Answer:
        path = os.path.abspath(head["path"])
        try:
            os.makedirs(path)
        except FileExistsError:
            return {"created": False, "entry": entry(path)}, b""
        return {"created": True, "entry": entry(path)}, b""

    def op_move(self, head: dict[str, Any], _: bytes) -> Answer:
        source, target = os.path.abspath(head["source"]), os.path.abspath(head["destination"])
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.rename(source, target)
        return {"entry": entry(target)}, b""

    def op_remove(self, head: dict[str, Any], _: bytes) -> Answer:
        path = os.path.abspath(head["path"])
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path)
        else:
            os.unlink(path)
        return {}, b""

    def open_handle(self, path: str, flags: int) -> tuple[int, os.stat_result]:
        if len(self.handles) >= MAX_HANDLES:
            raise Failure("resource_exhausted", f"{MAX_HANDLES} files are open already")
        # Non-blocking, so a FIFO planted by the code cannot hold the supervisor; only regular files go on.
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            kind = "is_a_directory" if stat.S_ISDIR(info.st_mode) else "invalid_argument"
            raise Failure(kind, f"{path} is not a regular file")
        os.set_blocking(fd, True)
        return fd, info

    def op_read_open(self, head: dict[str, Any], _: bytes) -> Answer:
        path = os.path.abspath(head["path"])
        fd, info = self.open_handle(path, os.O_RDONLY)
        if info.st_size > int(head["max"]):
            os.close(fd)
            raise Failure("too_large", f"{path} has {info.st_size} bytes, over the cap of {head['max']}")
        handle, self.next_handle = self.next_handle, self.next_handle + 1
        self.handles[handle] = (fd, info.st_size, path)  # never more than the size seen at open
        return {"handle": handle, "size": info.st_size}, b""

    def op_read_chunk(self, head: dict[str, Any], _: bytes) -> Answer:
        fd, left, path = self.handles[head["handle"]]
        chunk = os.read(fd, min(FILE_CHUNK, left)) if left > 0 else b""
        self.handles[head["handle"]] = (fd, left - len(chunk), path)
        if not chunk:
            self.op_close(head, b"")
        return {"eof": not chunk}, chunk

    def op_write_open(self, head: dict[str, Any], _: bytes) -> Answer:
        path = os.path.abspath(head["path"])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = self.open_handle(path, os.O_WRONLY | os.O_CREAT)[0]
        os.ftruncate(fd, 0)
        handle, self.next_handle = self.next_handle, self.next_handle + 1
        self.handles[handle] = (fd, -1, path)
        return {"handle": handle}, b""

    def op_write_chunk(self, head: dict[str, Any], data: bytes) -> Answer:
        fd, _left, _path = self.handles[head["handle"]]
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        return {}, b""

    def op_close(self, head: dict[str, Any], _: bytes) -> Answer:
        fd, _left, path = self.handles.pop(head["handle"])
        os.close(fd)
        if head.get("discard"):  # a write the host gave up on: no half file stays
            os.unlink(path)
            return {}, b""
        return {"entry": entry(path)}, b""
