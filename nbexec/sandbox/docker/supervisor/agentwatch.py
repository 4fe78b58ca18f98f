"""Folder watches inside the sandbox (stdlib only, Python 3.9+): part of the agent.

inotify through ctypes, one instance per watch, so closing a watch is closing its descriptor. A recursive watch
adds the folders made below it, up to MAX_WATCH_DIRS; the kernel's own event queue is bounded (an overflow is
reported as such). Links are not followed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import selectors
import struct
from typing import Any

from .agentfiles import Answer, Failure
from .wire import MAX_WATCH_DIRS, MAX_WATCHERS

IN_MODIFY, IN_ATTRIB, IN_MOVED_FROM, IN_MOVED_TO = 0x2, 0x4, 0x40, 0x80
IN_CREATE, IN_DELETE, IN_DELETE_SELF, IN_MOVE_SELF = 0x100, 0x200, 0x400, 0x800
IN_Q_OVERFLOW, IN_IGNORED, IN_ISDIR = 0x4000, 0x8000, 0x40000000
IN_ONLYDIR, IN_DONT_FOLLOW = 0x01000000, 0x02000000
KINDS = ((IN_CREATE | IN_MOVED_TO, "create"), (IN_MODIFY, "write"), (IN_DELETE | IN_DELETE_SELF, "remove"),
         (IN_MOVED_FROM | IN_MOVE_SELF, "rename"), (IN_ATTRIB, "chmod"))
MASK = IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF
EVENT = struct.Struct("iIII")  # wd, mask, cookie, name length


class Watch:
    """One watched folder (and, when recursive, the folders below it)."""

    def __init__(self, libc: Any, root: str, recursive: bool) -> None:
        self.libc, self.recursive = libc, recursive
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed", root)
        self.folders: dict[int, str] = {}  # watch descriptor: folder relative to the root
        try:
            self.add(root, "")
            for folder, names, _files in os.walk(root) if recursive else ():
                for name in names:
                    path = os.path.join(folder, name)
                    if not os.path.islink(path) and not self.add(path, os.path.relpath(path, root)):
                        raise Failure("resource_exhausted", f"more than {MAX_WATCH_DIRS} folders to watch")
        except BaseException:
            os.close(self.fd)
            raise

    def add(self, path: str, relative: str) -> bool:
        """Watch one more folder; False past MAX_WATCH_DIRS."""
        if len(self.folders) >= MAX_WATCH_DIRS:
            return False
        wd = self.libc.inotify_add_watch(self.fd, os.fsencode(path), MASK | IN_ONLYDIR | IN_DONT_FOLLOW)
        if wd < 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), path)
        self.folders[wd] = relative
        return True

    def read(self, root: str) -> list[tuple[str, str]]:
        """The (name relative to the root, kind) of each event waiting."""
        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return []
        found, offset = [], 0
        while offset + EVENT.size <= len(data):
            wd, mask, _cookie, length = EVENT.unpack_from(data, offset)
            raw = data[offset + EVENT.size:offset + EVENT.size + length].rstrip(b"\0")
            offset += EVENT.size + length
            if mask & IN_Q_OVERFLOW:
                found.append(("", "overflow"))
            if mask & IN_IGNORED or wd not in self.folders:
                self.folders.pop(wd, None)
                continue
            name = os.path.join(self.folders[wd], raw.decode(errors="replace")) if raw else self.folders[wd]
            if self.recursive and mask & (IN_CREATE | IN_MOVED_TO) and mask & IN_ISDIR:
                with contextlib.suppress(OSError):  # gone again; past the cap, the folder is not watched
                    self.add(os.path.join(root, name), name)
            found += [(name, kind) for bits, kind in KINDS if mask & bits]
        return found


class Watches:
    """The watch requests and the watches open (at most MAX_WATCHERS), their descriptors in the agent's loop."""

    def __init__(self, selector: selectors.BaseSelector) -> None:
        self.selector = selector
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.open: dict[int, tuple[Watch, str]] = {}
        self.by_fd: dict[int, int] = {}
        self.next_id = 1

    def op_watch_dir(self, head: dict[str, Any], _: bytes) -> Answer:
        if len(self.open) >= MAX_WATCHERS:
            raise Failure("resource_exhausted", f"{MAX_WATCHERS} watches are open already")
        root = os.path.abspath(head["path"])
        if not os.path.isdir(root):
            raise Failure("not_found" if not os.path.exists(root) else "not_a_directory", f"{root} is no folder")
        watch = Watch(self.libc, root, bool(head.get("recursive")))
        number, self.next_id = self.next_id, self.next_id + 1
        self.open[number] = (watch, root)
        self.by_fd[watch.fd] = number
        self.selector.register(watch.fd, selectors.EVENT_READ)
        return {"watch": number}, b""

    def op_unwatch_dir(self, head: dict[str, Any], _: bytes) -> Answer:
        watch, _root = self.open.pop(head["watch"])
        del self.by_fd[watch.fd]
        self.selector.unregister(watch.fd)
        os.close(watch.fd)
        return {}, b""

    def read(self, fd: int) -> tuple[int, list[tuple[str, str]]]:
        """The watch of ``fd`` and its events waiting."""
        number = self.by_fd[fd]
        watch, root = self.open[number]
        return number, watch.read(root)
