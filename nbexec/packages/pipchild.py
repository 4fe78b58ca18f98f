"""The program the host's resolver runs in: ``python -I -c <this source> <spec>``, as an unprivileged user.

`nbexec.packages.hostpip` starts it. It uses the standard library and pip only; nbexec's own process never runs it.

It first drops what it does not need: no new privileges, an address-space cap (a zip bomb in a wheel's metadata
ends in ``MemoryError``), a CPU cap, a file-size cap and no core dumps. It may start no process or thread
(``RLIMIT_NPROC`` 0), since pip needs none for wheels. Then it runs ``pip download`` and reads the header block
of each wheel's METADATA. It reads at most ``metadata_cap`` bytes, decompressed as read, so a bomb costs no more
than the cap. It reports them with each wheel's size and sha256 as JSON. The host checks every byte of that
report and copies each wheel itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import sys
import zipfile
from typing import Any

PR_SET_NO_NEW_PRIVS = 38


def confine(spec: dict[str, Any]) -> None:
    """Drop what pip does not need, before pip is imported."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    except (ImportError, OSError, AttributeError):  # an interpreter without ctypes: the uid is the boundary
        pass
    limits = {resource.RLIMIT_AS: spec["memory"], resource.RLIMIT_CORE: 0, resource.RLIMIT_NPROC: 0}
    if spec["file_size"]:
        limits[resource.RLIMIT_FSIZE] = spec["file_size"]
    for kind, value in limits.items():
        resource.setrlimit(kind, (value, value))
    resource.setrlimit(resource.RLIMIT_CPU, (spec["cpu"], spec["cpu"] + 5))


def describe(path: str, cap: int) -> dict[str, Any]:
    """A downloaded wheel: its size, sha256 and the header block of its METADATA (or the problem with it)."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
            size += len(chunk)
    found: dict[str, Any] = {"filename": os.path.basename(path), "size": size, "sha256": digest.hexdigest(),
                             "metadata": None, "problem": None}
    try:
        with zipfile.ZipFile(path) as archive:
            names = [info for info in archive.infolist()
                     if info.filename.count("/") == 1 and info.filename.endswith(".dist-info/METADATA")]
            if len(names) != 1:
                found["problem"] = "it has no single .dist-info/METADATA"
                return found
            with archive.open(names[0]) as member:
                data = member.read(cap + 1)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as exc:
        found["problem"] = f"it is not a readable wheel ({type(exc).__name__})"
        return found
    head, blank, _ = data.replace(b"\r\n", b"\n").partition(b"\n\n")
    if not blank and len(data) > cap:
        found["problem"] = f"its METADATA headers are longer than {cap:,} bytes"
        return found
    found["metadata"] = head.decode("utf-8", "replace")
    return found


def main() -> int:
    spec = json.loads(sys.argv[1])
    confine(spec)
    from pip._internal.cli.main import main as pip

    status = pip(spec["pip"])
    if status:
        return int(status)
    dest = spec["dest"]
    report = [describe(os.path.join(dest, name), spec["metadata_cap"]) for name in sorted(os.listdir(dest))]
    with open(spec["report"], "x", encoding="utf-8") as handle:
        json.dump(report, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
