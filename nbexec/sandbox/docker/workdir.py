"""The wheels the host resolved, handed to a Docker sandbox's /mnt/wheels (a folder of its working folder; see
`nbexec.files.workdir` for the working folder itself)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from nbexec.errors import PackageError
from nbexec.files import transfer
from nbexec.sandbox.source import WheelFile


def provide_wheels(folder: Path, wheels: Sequence[WheelFile]) -> None:
    """Link (or copy) each wheel into ``folder`` (a sandbox's /mnt/wheels) under its own file name."""
    fd = os.open(folder, transfer.DIR_FLAGS)
    try:
        present = set(os.listdir(fd))
        for wheel in wheels:
            if wheel.filename not in present:
                _add_wheel(fd, wheel)
                present.add(wheel.filename)
    finally:
        os.close(fd)


def _add_wheel(folder_fd: int, wheel: WheelFile) -> None:
    """Hard-link ``wheel`` (checked by the host that resolved it) into the folder; a copy on another filesystem."""
    if "/" in wheel.filename or not wheel.filename.endswith(".whl") or wheel.filename.startswith("."):
        raise PackageError(f"{wheel.filename!r} is not a wheel's file name")
    try:
        os.link(wheel.path, wheel.filename, dst_dir_fd=folder_fd)
        return
    except OSError:  # another filesystem (or no hard links): copy
        pass
    with open(wheel.path, "rb") as blob:
        out = os.open(wheel.filename, transfer.WRITE_FLAGS, 0o644, dir_fd=folder_fd)
        with os.fdopen(out, "wb") as copy:
            shutil.copyfileobj(blob, copy)
