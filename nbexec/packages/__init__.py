"""Packages for the code, installed in the sandbox while it still has no network interface.

1. What is asked: ``packages=[...]`` of the call, and the pip lines of the cells about to run. `scan` is an
   honest syntax scan of lines that start with ``%pip install``, ``!pip install`` or ``!python -m pip install``
   (nothing else is read; it is no security filter: the sandbox's isolation is).
2. `Policy.check` (`policy`): a refused requirement is never downloaded; for this run its pip line is replaced
   by one that prints which package was refused, why, and what is allowed (the saved notebook keeps the original).
3. The host resolves the rest for the sandbox's interpreter (`wheelhouse`): breadth-first (`resolver`), every
   dependency judged by the same policy before it is fetched, over rounds of its own pip confined to named wheels
   (`hostpip`, unprivileged and under kernel limits), so no code of a package runs on the host. It links the
   wheels into the sandbox's /mnt/wheels (a read-only mount every sandbox gets at start). All of it counts
   inside the execution's time limit, and against its package budget, failures included.
4. Inside, `nbexec.packages.wheelinstall` (sent into the kernel once per sandbox) unpacks the resolution into
   /mnt/packages: an in-memory filesystem of the sandbox (tmp_size bytes, counted against its memory, gone with
   it; mounted exec, unlike /tmp, so native extensions load; not /mnt/data, whose files are results). No pip
   starts unless the sandbox already has another version of something (then pip runs offline:
   ``--no-index --find-links /mnt/wheels --prefix /mnt/packages``, which the kernel's PIP_* variables also make
   of the code's own pip calls). Packages of the call are installed by a hidden step before the first cell; a
   plain pip line of a cell is replaced, for the run, by a call of the installer.
"""

from __future__ import annotations

import ast
import contextlib
import json
import re
import shlex
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from nbformat import NotebookNode
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from nbexec.config import SandboxConfig, parse_size
from nbexec.errors import PackageError, PackageLimitError, PackageRefusedError
from nbexec.result import Package
from nbexec.sandbox.hidden import Named
from nbexec.sandbox.source import PACKAGES_MOUNT, WHEELS_MOUNT, Capability, SandboxHandle

from . import hostpip, wheelhouse
from .policy import Policy, shipped

__all__ = ["PipLine", "Policy", "installer_call", "notes", "prepared", "scan", "shipped", "source_of"]

PREFIX = PACKAGES_MOUNT
_PIP_LINE = re.compile(r"^(?P<indent>[ \t]*)(?:%|!\s*)?(?:pip3?|python3?\s+-m\s+pip)\s+install(?P<args>(?:\s.*)?)$")
# pip options whose value is the next word (none of them is fetched by the host).
_VALUED = {"-r", "--requirement", "-c", "--constraint", "-e", "--editable", "-i", "--index-url", "--extra-index-url",
           "-f", "--find-links", "-t", "--target", "--prefix", "--root", "--platform", "--python-version",
           "--implementation", "--abi", "--src", "--upgrade-strategy", "--progress-bar", "--log", "--cache-dir",
           "--trusted-host", "--proxy", "--timeout", "--retries", "--config-settings", "-C", "--report",
           "--global-option", "--no-binary", "--only-binary"}
_SETUP = f"""
import importlib, os, sys, sysconfig
site = sysconfig.get_path("purelib", vars={{"base": {PREFIX!r}, "platbase": {PREFIX!r}}})
os.makedirs(site, exist_ok=True)
if site not in sys.path:
    sys.path.insert(1 if sys.path and sys.path[0] in ("", os.getcwd()) else 0, site)
os.environ.update(PIP_NO_INDEX="1", PIP_FIND_LINKS={WHEELS_MOUNT!r}, PIP_PREFIX={PREFIX!r}, PIP_ONLY_BINARY=":all:",
                  PIP_NO_CACHE_DIR="1", PIP_NO_COMPILE="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
                  PIP_NO_WARN_SCRIPT_LOCATION="1")
env = os.environ
env.update(PATH={PREFIX!r} + "/bin:" + env.get("PATH", ""))
import types
module = types.ModuleType("_nbexec_wheels")
exec(compile(INSTALLER, "<nbexec-wheels>", "exec"), module.__dict__)
sys.modules["_nbexec_wheels"] = module
importlib.invalidate_caches()
"""
_TARGET = ("__import__('json').dumps(['%d.%d.%d' % __import__('sys').version_info[:3], "
           "__import__('platform').machine(), __import__('os').confstr('CS_GNU_LIBC_VERSION') or ''])")
_targets: weakref.WeakKeyDictionary[SandboxHandle, wheelhouse.Target] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class PipLine:
    """A pip install line of a cell: where it is, the requirements it names, and the words not fetched."""

    cell: int
    line: int
    indent: str
    requirements: tuple[str, ...]
    skipped: tuple[str, ...]


def scan(source: str, cell: int = 0) -> list[PipLine]:
    """The pip install lines of a cell's source (see the module docstring for what counts as one)."""
    found = []
    for number, line in enumerate(source.splitlines()):
        match = _PIP_LINE.match(line)
        if match is None:
            continue
        try:
            words = shlex.split(match.group("args"))
        except ValueError:
            words = match.group("args").split()
        requirements, skipped = _split_words(words)
        found.append(PipLine(cell, number, match.group("indent"), tuple(requirements), tuple(skipped)))
    return found


def _split_words(words: list[str]) -> tuple[list[str], list[str]]:
    requirements: list[str] = []
    skipped: list[str] = []
    take_value = False
    for word in words:
        if take_value:
            take_value = False
            skipped.append(word)
        elif word.startswith("-"):
            take_value = word in _VALUED
            if word in ("-e", "--editable"):
                requirements.append("")  # refused below: an editable install is a path or URL
        elif "{" in word or "$" in word:  # IPython expands these inside the sandbox: the host cannot know them
            skipped.append(word)
        else:
            requirements.append(word)
    return requirements, skipped


def source_of(config: SandboxConfig) -> wheelhouse.Source:
    confinement = hostpip.Confinement(user=config.package_resolver_user, python=config.package_resolver_python,
                                      memory=parse_size(config.package_resolver_memory))
    return wheelhouse.Source(index=config.package_index, max_bytes=parse_size(config.max_package_download),
                             max_count=config.max_packages,
                             cache=Path(config.package_cache) if config.package_cache else None,
                             confinement=confinement)


@contextlib.contextmanager
def prepared(sandbox: SandboxHandle, nb: NotebookNode, config: SandboxConfig, *, requested: Sequence[str] = (),
             first_index: int = 0, deadline: float | None = None,
             stop: threading.Event | None = None) -> Iterator[list[Package]]:
    """Provide what the call asks for and the pip lines of cells ``first_index``... ask for; yield the records.
    ``sandbox`` is any source's: only its hidden runs and its /mnt/wheels are used (the wheels are resolved here).
    Everything here, the host's pip included, ends by ``deadline`` (time.monotonic(); default: ``config.timeout``
    from now): the execution's time limit, which the caller's cells share; and once ``stop`` is set (an interrupt).

    Refused pip lines are rewritten for the run and restored after it; the records are added to the notebook's
    metadata (``nbexec.packages``). Without packages asked for, this does nothing (no call into the sandbox)."""
    lines = [] if config.network is True else [found for index in range(first_index, len(nb.cells))
                                       if nb.cells[index].cell_type == "code"
                                       for found in scan(nb.cells[index].source, index)]
    records: list[Package] = []
    originals: dict[int, str] = {}
    try:
        if requested or lines:
            ends = time.monotonic() + config.timeout if deadline is None else deadline
            _provide(_Request(sandbox, config, Policy.of(config), wheelhouse.Budget(source_of(config)), ends, stop),
                     nb, list(requested), lines, records, originals)
        yield records
    finally:
        for index, source in originals.items():
            nb.cells[index].source = source
        if records:
            meta = nb.metadata.setdefault("nbexec", {})
            meta["packages"] = [*meta.get("packages", []), *(r.to_dict() for r in records)]


def notes(records: Sequence[Package]) -> list[str]:
    """One remark per package that was refused or failed (for the result's notes)."""
    return [f"package {r.name} was {r.status}: {r.reason}" for r in records if r.status in ("refused", "failed")]


@dataclass(frozen=True)
class _Request:
    """What every request of one execution shares: its sandbox, config, policy, budget and deadline."""

    sandbox: SandboxHandle
    config: SandboxConfig
    policy: Policy
    budget: wheelhouse.Budget  # the caps hold for all of the execution's requests together, failures included
    deadline: float  # time.monotonic(): the execution's time limit
    stop: threading.Event | None = None  # set by an interrupt or close: nothing more is provided

    def left(self, most: float) -> float:
        """Seconds a step in the sandbox may take: ``most``, within the deadline; PackageLimitError past it."""
        left = min(most, self.deadline - time.monotonic())
        if left <= 0:
            raise PackageLimitError("the execution's time limit ran out before it could be provided")
        if self.stop is not None and self.stop.is_set():
            raise PackageLimitError("the execution was interrupted before it could be provided")
        return left


def _provide(request: _Request, nb: NotebookNode, requested: list[str], lines: list[PipLine],
             records: list[Package], originals: dict[int, str]) -> None:
    if requested:  # each on its own: the allowed ones are installed, the refused ones reported
        allowed = [text for text in requested if request.policy.check(text)[1] is None]
        _refusals(request.policy, [text for text in requested if text not in allowed], records)
        _provide_one(request, allowed, records, install=True)
    for line in lines:
        replacement = _provide_one(request, list(line.requirements), records, install=False, plain=not line.skipped)
        if replacement:
            _rewrite(nb, line, replacement, originals)


def _provide_one(request: _Request, texts: list[str], records: list[Package], *, install: bool,
                 plain: bool = False) -> str | None:
    """Check, resolve, link (and with ``install``, install) one request. For a pip line: the code that replaces
    it for this run (a message saying why nothing was provided, or, for a ``plain`` line, the installer that
    needs no pip), or None (the line runs pip as written)."""
    refusals = _refusals(request.policy, texts, records)
    if refusals:
        return _say("nbexec refused to install " + "; ".join(refusals) + ". Nothing from this request was installed.")
    if not texts:
        return None
    sandbox = request.sandbox
    try:
        if not sandbox.offers(Capability.WHEELS):  # said in the result, as any other failure to provide
            raise PackageError(str(sandbox.refusal(Capability.WHEELS)))
        target = _target(sandbox, request.left(request.config.startup_timeout))
        wheels = wheelhouse.resolve(texts, request.policy, target, request.budget, deadline=request.deadline,
                                    stop=request.stop)
        sandbox.provide_wheels(wheelhouse.files(wheels, request.budget.source))
        asked = {canonicalize_name(Requirement(text).name) for text in texts}
        if install:
            listed = [[w.filename, w.name, w.version] for w in wheels]
            _run_hidden(sandbox, Named("packages.install", {"texts": texts, "wheels": listed, "asked": sorted(asked)}),
                        request.left(request.config.timeout))
    except PackageRefusedError as exc:
        records.extend(Package(name=text, status="refused", reason=str(exc)) for text in texts)
        return _say(f"nbexec refused to install {', '.join(texts)}: {exc}. Nothing from this request was installed.")
    except PackageError as exc:
        records.extend(Package(name=text, status="failed", reason=str(exc)) for text in texts)
        return _say(f"nbexec could not provide {', '.join(texts)}: {exc}")
    records.extend(Package(name=w.name, status="installed" if install and w.name in asked else "provided",
                           version=w.version, sha256=w.sha256, filename=w.filename, size=w.size,
                           requested=w.name in asked) for w in wheels)
    return installer_call(texts, wheels, asked, verbose=True) if plain else None


def installer_call(texts: Sequence[str], wheels: Sequence[wheelhouse.Wheel], asked: Iterable[str], *,
                   verbose: bool = False) -> str:
    """The code that installs ``wheels`` in the kernel with `nbexec.packages.wheelinstall` (pip only where needed)."""
    return _installer([[w.filename, w.name, w.version] for w in wheels], texts, asked, verbose=verbose)


def _installer(listed: Iterable[Sequence[str]], texts: Iterable[str], asked: Iterable[str], *,
               verbose: bool = False) -> str:
    return (f"__import__('_nbexec_wheels').install({list(texts)!r}, {[list(w) for w in listed]!r}, "
            f"asked={sorted(asked)!r}{', verbose=True' if verbose else ''})")


def hidden_code(named: Named) -> tuple[str, dict[str, str]]:
    """The code (and user_expressions) of one of nbexec's own requests, built from its name and its arguments
    (data: each checked to be a list of short strings, every value a literal in the code); ValueError otherwise.
    A node builds it the same way from what a client sent (see `nbexec.sandbox.hidden`)."""
    if named.name == "packages.setup" and not named.args:
        installer = resources.files("nbexec").joinpath("packages/wheelinstall.py").read_text("utf-8")
        return f"exec(compile({_SETUP!r}, '<nbexec-setup>', 'exec'), {{'INSTALLER': {installer!r}}})", \
            {"target": _TARGET}
    args = named.args
    if named.name == "packages.install" and set(args) == {"texts", "wheels", "asked"}:
        texts, asked, wheels = _strings(args["texts"]), _strings(args["asked"]), args["wheels"]
        if isinstance(wheels, list) and len(wheels) <= 1000 and all(
                isinstance(w, list) and len(w) == 3 and _strings(w) for w in wheels):
            return _installer(wheels, texts, asked), {}
    raise ValueError(f"the arguments of {named.name} are not what it takes")


def _strings(value: Any) -> list[str]:
    if not isinstance(value, list) or len(value) > 1000 or not all(isinstance(v, str) and len(v) <= 1000
                                                                    for v in value):
        raise ValueError("not a list of short strings")
    return value


def _say(message: str) -> str:
    return f"print({message!r}, file=__import__('sys').stderr)"


def _refusals(policy: Policy, texts: list[str], records: list[Package]) -> list[str]:
    """Record the requirements the policy refuses; "<name>: <why>" for each."""
    refusals = []
    for text in texts:
        reason = policy.check(text)[1]
        if reason is not None:
            shown = text or "an editable install"
            records.append(Package(name=shown, status="refused", reason=reason))
            refusals.append(f"{shown}: {reason}")
    return refusals


def _rewrite(nb: NotebookNode, line: PipLine, code: str, originals: dict[int, str]) -> None:
    cell = nb.cells[line.cell]
    originals.setdefault(line.cell, cell.source)
    lines = cell.source.splitlines()
    lines[line.line] = f"{line.indent}{code}"
    cell.source = "\n".join(lines)


def _target(sandbox: SandboxHandle, timeout: float) -> wheelhouse.Target:
    """Set the kernel up for offline installs (once per sandbox) and learn its interpreter and platform."""
    known = _targets.get(sandbox)
    if known is not None:
        return known
    content = _run_hidden(sandbox, Named("packages.setup"), timeout)
    try:
        shown = content["user_expressions"]["target"]["data"]["text/plain"]
        if not isinstance(shown, str) or len(shown) > 256:  # size before parse: earlier code may shape the reply
            raise ValueError("an oversized description")
        full, machine, libc = json.loads(ast.literal_eval(shown))
        glibc = libc.split()[1] if isinstance(libc, str) and libc.startswith("glibc ") else None
        python = ".".join(str(full).split(".")[:2])
        target = wheelhouse.Target(python=python, machine=str(machine), glibc=glibc, python_full=str(full))
    except (KeyError, TypeError, ValueError, SyntaxError, IndexError) as exc:
        raise PackageError("the sandbox did not describe its interpreter") from exc
    _targets[sandbox] = target
    return target


def _run_hidden(sandbox: SandboxHandle, named: Named, timeout: float) -> dict[str, Any]:
    """Run one of nbexec's own requests in the kernel outside the notebook (silent, no history); its reply, or
    PackageError."""
    code, expressions = hidden_code(named)
    content = sandbox.run_hidden(code, timeout, expressions=expressions, named=named)
    if content is None:
        raise PackageError(f"the sandbox did not finish installing within {timeout:g} s")
    if content.get("status") != "ok":
        raise PackageError(f"pip in the sandbox failed: {str(content.get('evalue', ''))[-1500:]}")
    return content
