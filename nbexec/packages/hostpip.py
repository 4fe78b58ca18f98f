"""The host's pip, confined: one ``pip download --no-deps --only-binary=:all:`` round for named projects.

pip runs in a child of its own (`nbexec.packages.pipchild`, sent as ``python -I -c``). When nbexec runs as root
it runs as an unprivileged user (``package_resolver_user``, ``nobody`` by default) with no supplementary groups.
It has no new privileges. Kernel limits cap its address space (``package_resolver_memory``), CPU time, file size
(the remaining byte budget) and core dumps. It may start no process, since pip needs none for wheels. It works
in a scratch folder of its own, owned by that user, and reaches nothing of nbexec's (the wheel cache is 0700 and
root's).
Its output is hostile input. The host reads its report within a size cap and opens each wheel through a
descriptor of the scratch folder, never following links. It copies each into its own private folder while hashing
it, and keeps it only if the hash is the one the report named. So what was judged is what is kept.

pip is stopped past the byte budget (the scratch folder is measured while it runs), the execution's deadline, or
``DOWNLOAD_TIME_LIMIT``. Every way it can end becomes one clear PackageError.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from nbexec.errors import PackageError, PackageLimitError
from nbexec.files.folders import DIR_FLAGS

DOWNLOAD_TIME_LIMIT = 300.0  # seconds one round of pip may take, whatever the execution's deadline
CPU_SECONDS = 120  # CPU seconds one round of pip may use (RLIMIT_CPU)
METADATA_CAP = 1024 * 1024  # bytes of a wheel's METADATA header block the child reads
_LOG_TAIL = 64 * 1024
_POLL = 0.1
_FALLBACK_PYTHONS = ("/usr/local/bin/python3", "/usr/bin/python3")
_PROBE = "import pip._internal.cli.main"
_interpreters: set[tuple[str, int | None]] = set()
_interpreters_lock = threading.Lock()


@dataclass(frozen=True)
class Confinement:
    """Who the host's pip runs as and what it may use."""

    user: str = "nobody"  # the account pip runs as when nbexec runs as root (name or uid)
    python: str | None = None  # default: nbexec's own interpreter, else the first fallback the user can run
    memory: int = 512 * 1024**2  # RLIMIT_AS, bytes
    max_bytes: int = 0  # RLIMIT_FSIZE and the scratch folder's cap, bytes (0: none)


@dataclass(frozen=True)
class Downloaded:
    """One wheel of a round, copied and hashed by the host.

    It holds the file name, sha256, size, METADATA headers, and where the host's copy is."""

    filename: str
    sha256: str
    size: int
    metadata: str
    path: Path


@dataclass(frozen=True)
class _Child:
    """One run of the child program.

    It holds the Python, the account it runs as (None: nbexec's own), its scratch folder, and the host's file that
    keeps its output."""

    python: str
    account: tuple[int, int] | None
    scratch: Path
    log: Path


def fetch(requirements: list[str], pip_args: list[str], confinement: Confinement, into: Path, *,
          deadline: float, stop: threading.Event | None = None) -> list[Downloaded]:
    """Download a wheel for each of ``requirements`` (``name<specifier>`` lines) into the private folder ``into``.

    ``pip_args`` say where from and for which interpreter. Setting ``stop`` (an interrupt) stops pip."""
    if time.monotonic() >= deadline:
        raise PackageLimitError("the execution's time limit ran out before the host could resolve it")
    account = _account(confinement.user)
    python = interpreter(confinement.python, account)
    scratch = _scratch(account)
    try:
        log_fd, log_name = tempfile.mkstemp(dir=into, suffix=".log")
        os.close(log_fd)
        child = _Child(python, account, scratch, Path(log_name))
        try:
            _run(child, [*pip_args, "--", *requirements], confinement, (deadline, stop))
            return _take(scratch, into, len(requirements), confinement.max_bytes)
        finally:
            child.log.unlink(missing_ok=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # fd-based: links the child made are removed, not followed


def _account(user: str) -> tuple[int, int] | None:
    """The uid and gid pip runs as: ``user``'s when nbexec runs as root, else None (pip runs as nbexec does)."""
    if os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    except (KeyError, ValueError):
        raise PackageError(f"the host has no account {user!r} to run pip as (package_resolver_user)") from None
    if entry.pw_uid == 0:
        raise PackageError("package_resolver_user is root; pip never runs as root")
    return entry.pw_uid, entry.pw_gid


def interpreter(python: str | None, account: tuple[int, int] | None) -> str:
    """The Python that runs pip: the first that ``account`` can run with pip importable.

    ``python`` is tried first, then nbexec's own, then a fallback; each is probed once per process."""
    candidates = [python] if python else [sys.executable, *_FALLBACK_PYTHONS]
    for candidate in candidates:
        key = (candidate, None if account is None else account[0])
        with _interpreters_lock:
            known = key in _interpreters
        if known or _probe(candidate, account):
            with _interpreters_lock:
                _interpreters.add(key)  # only a success is remembered: a failed probe costs one exec next time
            return candidate
    who = "nbexec's user" if account is None else f"uid {account[0]}"
    raise PackageError(f"no Python with pip that {who} can run was found ({', '.join(candidates)}); set "
                       "NBEXEC_PACKAGE_RESOLVER_PYTHON to one (pip runs unprivileged, so it needs a Python "
                       "outside private folders such as /root)")


def _probe(python: str, account: tuple[int, int] | None) -> bool:
    try:
        user, group, groups = _as(account)
        done = subprocess.run([python, "-I", "-c", _PROBE], stdin=subprocess.DEVNULL, capture_output=True,
                              env={"PATH": os.defpath}, cwd="/", timeout=60, user=user, group=group,
                              extra_groups=groups)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _as(account: tuple[int, int] | None) -> tuple[int | None, int | None, list[int] | None]:
    """Popen's user, group and extra_groups: ``account`` with no supplementary groups, or unchanged."""
    if account is None:
        return None, None, None
    return account[0], account[1], []


def _scratch(account: tuple[int, int] | None) -> Path:
    """A fresh folder for one round, owned by the account pip runs as, with ``dest`` and ``tmp`` inside."""
    scratch = Path(tempfile.mkdtemp(prefix="nbexec-pip-"))
    for name in ("dest", "tmp"):
        os.mkdir(scratch / name, 0o700)
    if account is not None:
        for path in (scratch, scratch / "dest", scratch / "tmp"):
            os.chown(path, *account)
    return scratch


def _run(child: _Child, words: list[str], confinement: Confinement,
         until: tuple[float, threading.Event | None]) -> None:
    """Run pip in the child with ``words`` (where from, for which interpreter, and what); PackageError unless it
    finished well."""
    dest = child.scratch / "dest"
    args = ["download", "--isolated", "--no-deps", "--only-binary=:all:", "--no-input", "--disable-pip-version-check",
            "--progress-bar", "off", "--no-cache-dir", "--dest", str(dest), *words]
    spec = {"pip": args, "dest": str(dest), "report": str(child.scratch / "report.json"),
            "memory": confinement.memory, "cpu": CPU_SECONDS, "metadata_cap": METADATA_CAP,
            "file_size": confinement.max_bytes and confinement.max_bytes + 64 * 1024}
    source = resources.files("nbexec").joinpath("packages/pipchild.py").read_text("utf-8")
    # Only what nbexec sets: no host variable (PIP_*, proxies aside) changes what is resolved.
    env = {"PATH": os.defpath, "TMPDIR": str(child.scratch / "tmp"), "HOME": str(child.scratch), "LC_ALL": "C.UTF-8",
           **{k: v for k, v in os.environ.items() if k.lower() in ("http_proxy", "https_proxy", "no_proxy")}}
    user, group, groups = _as(child.account)
    with open(child.log, "wb") as log:
        try:
            process = subprocess.Popen([child.python, "-I", "-c", source, json.dumps(spec)],
                                       stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                       cwd=child.scratch, umask=0o077, start_new_session=True, user=user,
                                       group=group, extra_groups=groups)
        except OSError as exc:
            raise PackageError(f"the host could not start its resolver ({child.python}): {exc}") from exc
        problem = _watch(process, child.scratch, confinement.max_bytes, *until)
    if problem is None and process.returncode != 0:
        problem = _failure(process.returncode, _tail(child.log), confinement)
    if problem is not None:
        raise problem


def _watch(process: subprocess.Popen[bytes], scratch: Path, max_bytes: int, deadline: float,
           stop: threading.Event | None) -> PackageError | None:
    """Wait for pip, and say why it was stopped (None: it ended).

    It is stopped past the byte cap, the deadline or the time limit, or once ``stop`` is set."""
    give_up = time.monotonic() + DOWNLOAD_TIME_LIMIT
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(_POLL)
            return None
        now = time.monotonic()
        problem: PackageError
        if max_bytes and _tree_size(scratch) > max_bytes:
            problem = PackageLimitError(f"the download passed the {max_bytes:,}-byte cap (max_package_download), "
                                        "so it was stopped")
        elif now >= deadline:
            problem = PackageLimitError("the execution's time limit ran out while the host was resolving it, so "
                                        "pip was stopped")
        elif stop is not None and stop.is_set():
            problem = PackageLimitError("the execution was interrupted while the host was resolving it")
        elif now >= give_up:
            problem = PackageError(f"the download took longer than {DOWNLOAD_TIME_LIMIT:g} s, so it was stopped")
        else:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return problem


def _failure(returncode: int, tail: str, confinement: Confinement) -> PackageError:
    """What a pip that ended badly means, from its exit and the end of its log."""
    if "MemoryError" in tail or "Unable to allocate" in tail:
        return PackageError(f"the host's resolver passed its memory cap ({confinement.memory // 1024**2:,} MiB) "
                            "reading what the index served; it was stopped and nothing was kept")
    if returncode == -signal.SIGXCPU:
        return PackageError(f"the host's resolver passed its CPU cap ({CPU_SECONDS} s); nothing was kept")
    if "File too large" in tail or returncode == -signal.SIGXFSZ:
        return PackageLimitError(f"the download passed the {confinement.max_bytes:,}-byte cap "
                                 "(max_package_download)")
    if "Permission denied" in tail:
        return PackageError("pip could not read something it needed as the unprivileged resolver user (a folder "
                            "index and the temporary folder must be reachable by others): " + _errors(tail))
    return PackageError("pip could not resolve it: " + _errors(tail))


def _tail(log_path: Path) -> str:
    with open(log_path, "rb") as handle:
        handle.seek(max(0, os.fstat(handle.fileno()).st_size - _LOG_TAIL))
        return handle.read(_LOG_TAIL).decode("utf-8", "replace")


def _errors(tail: str) -> str:
    lines = [line for line in tail.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")] or lines[-3:]
    return " ".join(errors)[-1500:] or "no output"


def _tree_size(folder: Path) -> int:
    total = 0
    for parent, _, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(parent, name)).st_size
    return total


def _take(scratch: Path, into: Path, count: int, max_bytes: int) -> list[Downloaded]:
    """The wheels the child reported, each copied into ``into`` through descriptors and checked against the report.

    PackageError for anything else in its folder, or a report that does not hold."""
    report = _report(scratch, count)
    dest_fd = os.open(scratch / "dest", DIR_FLAGS)
    try:
        present = sorted(os.listdir(dest_fd))
        if present != sorted(item["filename"] for item in report):
            raise PackageError(f"pip left {', '.join(present)[:300]} where the report names other files")
        copied: list[Downloaded] = []
        try:
            for item in report:
                copied.append(_copy(dest_fd, item, into, max_bytes))
        except BaseException:
            for done in copied:
                done.path.unlink(missing_ok=True)
            raise
        return copied
    finally:
        os.close(dest_fd)


def _report(scratch: Path, count: int) -> list[dict[str, Any]]:
    """The child's report, read within a size cap through a descriptor and checked field by field."""
    cap = count * (6 * METADATA_CAP + 4096) + 4096  # JSON may spell a character in six bytes
    fd = os.open(scratch / "report.json", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PackageError("the resolver's report is not a file")
        raw = handle.read(cap + 1)
    if len(raw) > cap:
        raise PackageError("the resolver's report is larger than it can be")
    try:
        report = json.loads(raw)
    except ValueError:
        raise PackageError("the resolver's report is not JSON") from None
    if not isinstance(report, list) or len(report) > count:
        raise PackageError("the resolver reported more wheels than were asked for")
    for item in report:
        _check_item(item)
    return report


def _check_item(item: object) -> None:
    kinds: dict[str, type | tuple[type, ...]] = {"filename": str, "sha256": str, "size": int,
                                                 "metadata": (str, type(None)), "problem": (str, type(None))}
    if not isinstance(item, dict) or set(item) != set(kinds) \
            or not all(isinstance(item[k], kind) for k, kind in kinds.items()):
        raise PackageError("the resolver's report is malformed")
    name = item["filename"]
    if not name.endswith(".whl") or "/" in name or name.startswith(".") or len(name) > 255 or "\0" in name:
        raise PackageError(f"pip fetched {name[:200]!r}, which is not a wheel; nothing was kept")
    if item["problem"] is not None:
        raise PackageError(f"{name} was refused: {item['problem'][:300]}")
    if len(item["sha256"]) != 64 or item["metadata"] is None:
        raise PackageError("the resolver's report is malformed")


def _copy(dest_fd: int, item: dict[str, Any], into: Path, max_bytes: int) -> Downloaded:
    """Copy one reported wheel into ``into`` (0600, O_EXCL) while hashing it; it must be the file reported."""
    name, size = str(item["filename"]), int(item["size"])
    source = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), dir_fd=dest_fd)
    target_fd, target = tempfile.mkstemp(dir=into, suffix=".whl")
    digest, copied = hashlib.sha256(), 0
    with os.fdopen(source, "rb") as src, os.fdopen(target_fd, "wb") as dst:
        st = os.fstat(src.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size != size or (max_bytes and size > max_bytes):
            Path(target).unlink(missing_ok=True)
            raise PackageError(f"{name} is not the regular file of {size:,} bytes the resolver reported")
        while copied < size:
            chunk = src.read(min(1 << 20, size - copied))
            if not chunk:
                break
            digest.update(chunk)
            dst.write(chunk)
            copied += len(chunk)
    if copied != size or digest.hexdigest() != item["sha256"]:
        Path(target).unlink(missing_ok=True)
        raise PackageError(f"{name} changed while the host read it; nothing was kept")
    return Downloaded(name, digest.hexdigest(), size, str(item["metadata"]), Path(target))
