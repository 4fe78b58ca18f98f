"""Resolve requirements to one wheel per project, breadth-first, judging every dependency before it is fetched.

Pure: fetching is a function the caller passes (see `nbexec.packages.wheelhouse`).

pip is never shown a dependency. Each round asks it for named projects only (``pip download --no-deps
--only-binary=:all:``), so it considers nothing but wheel files of those names. The dependencies those wheels
declare (``Requires-Dist``) are read and judged here, markers evaluated for the sandbox's interpreter, before any
is asked for. A direct reference (``name @ URL``, a path, a VCS URL) is refused wherever it appears. So pip
prepares nothing but wheels, and no build backend ever runs.

Each round settles what every reached project must satisfy: its requirers' specifiers and the policy's bound.
It fetches the projects that have no wheel yet, or whose wheel no longer fits. There is no backtracking: a
conflict that narrowing cannot settle fails with pip's own message, and pinning a version settles it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from email.parser import HeaderParser

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from nbexec.errors import PackageError, PackageRefusedError

from .policy import Policy

MAX_REQUIRES = 1000  # dependency lines one wheel may declare


@dataclass(frozen=True)
class Fetched:
    """One wheel a round brought: file name, project, version, declared dependencies and extras (normalised).

    An extra asked for that the wheel does not declare is ignored, as pip does."""

    filename: str
    name: str
    version: str
    requires: tuple[str, ...]
    extras: frozenset[str] = frozenset()


Fetch = Callable[[list[str]], list[Fetched]]


@dataclass
class _Demand:
    """What the resolution asks of one project so far."""

    name: str
    specifier: SpecifierSet
    extras: set[str] = field(default_factory=set)

    def accepts(self, version: str) -> bool:
        return self.specifier.contains(version, prereleases=True)


def read_metadata(filename: str, text: str) -> Fetched:
    """The wheel ``filename`` described by the header block ``text`` of its METADATA.

    PackageError when the two disagree on the project or version, or the dependencies are too many."""
    try:
        name, version, _, _ = parse_wheel_filename(filename)
    except InvalidWheelFilename:
        raise PackageError(f"the index served {filename[:200]!r}, which is not a wheel") from None
    headers = HeaderParser().parsestr(text)
    said_name, said_version = str(headers.get("Name", "")).strip(), str(headers.get("Version", "")).strip()
    try:
        same = canonicalize_name(said_name) == name and Version(said_version) == version
    except InvalidVersion:
        same = False
    if not same:
        raise PackageError(f"{filename} says it is {said_name[:100]!r} {said_version[:50]!r} in its metadata, "
                           "not what its file name says; it was not used")
    requires = tuple(str(line) for line in headers.get_all("Requires-Dist") or [])
    extras = [str(extra).strip() for extra in headers.get_all("Provides-Extra") or []]
    if len(requires) > MAX_REQUIRES or len(extras) > MAX_REQUIRES:
        raise PackageError(f"{filename} declares {max(len(requires), len(extras)):,} dependencies or extras, more "
                           f"than the {MAX_REQUIRES} nbexec reads; it was not used")
    return Fetched(filename, name, str(version), requires, frozenset(canonicalize_name(e) for e in extras))


def resolve(roots: Sequence[Requirement], policy: Policy, environment: dict[str, str], fetch: Fetch, *,
            max_rounds: int) -> list[Fetched]:
    """The wheels for ``roots`` and everything they need, in breadth-first order; ``fetch`` is given one list of
    ``name<specifier>`` lines per round. PackageRefusedError when a dependency is refused by the policy."""
    chosen: dict[str, Fetched] = {}
    for _ in range(max_rounds):
        demands, problem = _demands(roots, chosen, policy, environment)
        # A wheel that no longer fits goes first, alone: what it declared may not be needed once it is replaced.
        stale = [d for name, d in demands.items() if name in chosen and not d.accepts(chosen[name].version)]
        if not stale and problem is not None:
            raise problem
        missing = stale or [d for name, d in demands.items() if name not in chosen]
        if not missing:
            return [chosen[name] for name in demands]
        for found in _checked(fetch([f"{d.name}{d.specifier}" for d in missing]), missing):
            chosen[found.name] = found
    raise PackageError(f"the resolution did not settle in {max_rounds} rounds; pin the versions you need")


def _checked(fetched: list[Fetched], missing: list[_Demand]) -> list[Fetched]:
    """``fetched`` when it is exactly one fitting wheel per project asked for; PackageError otherwise."""
    asked = {d.name: d for d in missing}
    names = [f.name for f in fetched]
    if sorted(names) != sorted(asked):
        raise PackageError(f"pip brought {', '.join(sorted(names))[:300] or 'nothing'} for "
                           f"{', '.join(sorted(asked))[:300]}")
    for found in fetched:
        if not asked[found.name].accepts(found.version):
            raise PackageError(f"pip brought {found.name} {found.version}, which {asked[found.name].specifier} "
                               "does not accept")
    return fetched


def _demands(roots: Sequence[Requirement], chosen: dict[str, Fetched], policy: Policy,
             environment: dict[str, str]) -> tuple[dict[str, _Demand], PackageError | None]:
    """Walk breadth-first from ``roots`` through the dependencies of the wheels chosen so far.

    Returns what each reached project must satisfy, and the first dependency refused or unreadable."""
    demands: dict[str, _Demand] = {}
    expanded: set[tuple[str, frozenset[str]]] = set()
    problem: PackageError | None = None
    queue: deque[Requirement] = deque(r for r in roots if _applies(r, {""}, environment))
    while queue:
        requirement = queue.popleft()
        name = canonicalize_name(requirement.name)
        demand = demands.setdefault(name, _Demand(name, policy.bound(name)))
        demand.specifier &= requirement.specifier
        demand.extras |= {canonicalize_name(extra) for extra in requirement.extras}
        found = chosen.get(name)
        seen = (name, frozenset(demand.extras))
        if found is None or not demand.accepts(found.version) or seen in expanded:
            continue
        expanded.add(seen)
        try:
            queue.extend(_dependencies(found, demand.extras, policy, environment))
        except PackageError as exc:
            problem = problem or exc
    return demands, problem


def _dependencies(found: Fetched, extras: set[str], policy: Policy, environment: dict[str, str]) -> list[Requirement]:
    """The dependencies of ``found`` the sandbox would install (markers evaluated, with ``extras``), each judged."""
    parent = f"{found.name} {found.version}"
    extras = extras & found.extras
    wanted = []
    for line in found.requires:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            raise PackageError(f"{parent} declares a dependency that is not a requirement: {line[:200]!r}") from None
        if not _applies(requirement, extras | {""}, environment):
            continue
        reason = policy.check_dependency(parent, requirement)
        if reason is not None:
            raise PackageRefusedError(reason)
        wanted.append(requirement)
    return wanted


def _applies(requirement: Requirement, extras: set[str], environment: dict[str, str]) -> bool:
    """Whether ``requirement``'s marker holds for the sandbox's interpreter with one of ``extras``."""
    if requirement.marker is None:
        return True
    try:
        return any(requirement.marker.evaluate({**environment, "extra": extra}) for extra in sorted(extras))
    except ValueError as exc:  # packaging's undefined comparisons and names
        raise PackageError(f"the marker of {str(requirement)[:200]!r} cannot be evaluated: {exc}") from None
