"""Host disk admitted before it is used: what one sandbox may write here, and a ledger of what admitted sandboxes
may still write.

A sandbox writes the host's disk in a few places, each capped by a limit the kernel or nbexec enforces (`share`):
- its /mnt/data filesystem, an image file in its working folder (max_data);
- the copy of its files in the output folder (max_data), and image files (max_display);
- the notebook, written beside its previous version before replacing it (twice max_output + max_display);
- wheels fetched for it into the wheel cache (max_package_download, when packages are on).
Docker's log of the container is capped at about 1 MiB. The root filesystem is read-only; /tmp, $HOME and
/dev/shm live in memory.

`reserve` admits one sandbox. On each filesystem it will write, the free space (statvfs ``f_bavail``) less what
earlier reservations may still write must cover its needs plus ``disk_margin``; else DiskSpaceError.
Reservations live in the `ledger`, shared by this uid's nbexec processes. They are checked and recorded under its
lock, so concurrent starts cannot all pass on the same free space. A reservation ends with its sandbox, or with
its process. What a sandbox already wrote is gone from the free space, so it no longer counts as held.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from nbexec.config import SandboxConfig, parse_size
from nbexec.errors import DiskSpaceError

from . import ledger
from .folders import output_root

KNOBS = ("Free space there, lower max_data / max_display / max_output (NBEXEC_MAX_DATA, ...), lower disk_margin "
         "(NBEXEC_DISK_MARGIN), or wait for running sandboxes to end.")


@dataclass(frozen=True)
class Share:
    """The host disk one sandbox may write, in bytes, by what writes it."""

    data: int  # its /mnt/data filesystem image, in its working folder
    copy: int  # the copy of /mnt/data's files, in the output folder
    images: int  # image files saved from its outputs
    notebook: int  # the notebook, and its next version while it replaces it
    packages: int  # wheels fetched for it into the wheel cache

    @property
    def outputs(self) -> int:
        """What lands in the output folder."""
        return self.copy + self.images + self.notebook

    @property
    def total(self) -> int:
        return self.data + self.outputs + self.packages

    def describe(self) -> str:
        return (f"{size(self.total)} (/mnt/data {size(self.data)}, its copy {size(self.copy)}, images "
                f"{size(self.images)}, notebook {size(self.notebook)}, wheels {size(self.packages)})")


def share(config: SandboxConfig) -> Share:
    """What one sandbox of ``config`` may write on the host (max_data 0, no cap: its data counts for nothing)."""
    outputs = config.max_output_bytes + config.max_display_bytes
    packages = parse_size(config.max_package_download) if config.packages != "off" else 0
    return Share(data=config.max_data_bytes, copy=config.max_data_bytes, images=config.max_display_bytes,
                 notebook=2 * outputs, packages=packages)


def size(count: float) -> str:
    """Bytes for people: 1.0 GiB, 40.0 MiB, 512 B."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(count) >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{int(count)} B"


@dataclass(frozen=True)
class Need:
    """``count`` bytes a sandbox may write on the filesystem of ``path``.

    ``grows`` is a file of it whose allocated blocks are already gone from the free space."""

    path: Path
    count: int
    what: str
    grows: Path | None = None


def sandbox_needs(config: SandboxConfig, workdir: Path) -> list[Need]:
    """Where a sandbox working in ``workdir`` may write, and how much (its output folder: the default one)."""
    found = share(config)
    needs = [Need(workdir, found.data, "its /mnt/data filesystem (max_data)", workdir / "data.img"),
             Need(output_root(), found.outputs, "the copy of its files, its images and notebook (max_data, "
                  "max_display, max_output)")]
    if found.packages:
        cache = Path(config.package_cache) if config.package_cache else Path(tempfile.gettempdir())
        needs.append(Need(cache, found.packages, "wheels fetched for it (max_package_download)"))
    return needs


def reserve_outputs(config: SandboxConfig, folder: Path) -> Reservation | None:
    """Admit the output share of a sandbox of ``config`` on ``folder``'s filesystem; None when nothing more is held.

    The default output folder's filesystem needs nothing more: every sandbox already holds its share there."""
    if _device(folder)[0] == _device(output_root())[0]:
        return None
    return reserve([Need(folder, share(config).outputs, "the copy of its files, its images and notebook")],
                   config.disk_margin_bytes)


class Reservation:
    """Disk held for one sandbox (a record in the `ledger`) until ``release`` (idempotent)."""

    def __init__(self, record: str) -> None:
        self.record: str | None = record

    def release(self) -> None:
        record, self.record = self.record, None
        if record is not None:
            ledger.remove(record)


def _device(path: Path) -> tuple[int, Path]:
    """The filesystem of ``path``, or of its nearest existing folder (a folder not made yet)."""
    for candidate in (path, *path.parents):
        with contextlib.suppress(OSError):
            return os.stat(candidate).st_dev, candidate
    raise DiskSpaceError(f"cannot find the filesystem of {path}", "the host's folders cannot be found")


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _held(records: list[list[ledger.Held]]) -> dict[int, int]:
    """Bytes the recorded sandboxes may still write, by filesystem.

    A growing file's written blocks are in use already, so they are no longer held."""
    held: dict[int, int] = {}
    for record in records:
        for device, count, grows in record:
            written = 0
            if grows is not None:
                with contextlib.suppress(OSError):
                    written = os.stat(grows, follow_symlinks=False).st_blocks * 512
            held[device] = held.get(device, 0) + max(0, count - written)
    return held


def reserve(needs: Sequence[Need], margin: int, *, action: str = "start a sandbox") -> Reservation:
    """Admit one sandbox, or one ``action`` of one: hold ``needs`` on their filesystems.

    DiskSpaceError, with nothing held, when a filesystem's free space less what earlier sandboxes hold (in any
    process) is below its needs plus ``margin``."""
    placed = [(*_device(need.path), need) for need in needs if need.count > 0]
    with ledger.locked() as fd:
        held = _held(ledger.records(fd))
        for device in {where for where, _, _ in placed}:
            mine = [need for where, _, need in placed if where == device]
            place = next(path for where, path, _ in placed if where == device)
            free = _free(place)
            if free - held.get(device, 0) < sum(need.count for need in mine) + margin:
                raise _refusal(place, free, held.get(device, 0), mine, margin, action)
        record = ledger.add(fd, [(where, need.count, None if need.grows is None else str(need.grows))
                                 for where, _, need in placed])
    return Reservation(record)


def _refusal(place: Path, free: int, held: int, mine: list[Need], margin: int, action: str) -> DiskSpaceError:
    wanted = sum(need.count for need in mine)
    what = " and ".join(f"{size(need.count)} for {need.what}" for need in mine)
    message = (f"Not enough free disk to {action}: the filesystem of {place} has {size(free)} free, "
               f"{size(held)} of it held for sandboxes already running, and one more may write {what} there, plus "
               f"a margin of {size(margin)} (disk_margin). {KNOBS}")
    reason = (f"the host is short of disk to {action}: it may write {size(wanted)} and {size(margin)} are "
              f"kept free, but only {size(max(0, free - held))} is free beyond what running sandboxes hold (max_data, "
              "disk_margin); try again later")
    return DiskSpaceError(message, reason)


@dataclass(frozen=True)
class Room:
    """How many sandboxes of a config the host's disk has room for now, and where that is decided."""

    count: int
    place: Path
    free: int


def room(config: SandboxConfig, workdir: Path) -> Room:
    """Room for sandboxes of ``config`` working under ``workdir``.

    The tightest filesystem they write decides, after what admitted sandboxes hold and the margin."""
    tightest: Room | None = None
    placed = [(*_device(need.path), need) for need in sandbox_needs(config, workdir) if need.count > 0]
    for device in {where for where, _, _ in placed}:
        wanted = sum(need.count for where, _, need in placed if where == device)
        place = next(path for where, path, _ in placed if where == device)
        with ledger.locked() as fd:
            free = _free(place) - _held(ledger.records(fd)).get(device, 0)
        count = max(0, (free - config.disk_margin_bytes) // wanted)
        if tightest is None or count < tightest.count:
            tightest = Room(count, place, free)
    return tightest or Room(1 << 30, workdir, _free(workdir))
