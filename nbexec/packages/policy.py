"""Which requirements may be installed, and which of their dependencies may come with them (pure).

The same policy judges what the code asks for and every dependency the resolution reaches. In mode ``allowlist``
a dependency must be on the allowlist too; the shipped list holds its packages' dependencies. In mode ``any`` any
project will do. In every mode only a project name found on the index is taken. A "direct reference" (a URL, a
path or a version-control repository) is refused, in a requirement or a dependency.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from nbexec.config import SandboxConfig
from nbexec.errors import PackageError


def shipped() -> list[str]:
    """The requirement lines of the allowlist that ships with nbexec (nbexec/data/allowed-packages.txt)."""
    text = resources.files("nbexec").joinpath("data/allowed-packages.txt").read_text("utf-8")
    return [line.split("#", 1)[0].strip() for line in text.splitlines() if line.split("#", 1)[0].strip()]


@dataclass(frozen=True)
class Policy:
    """Which requirements may be installed: ``mode`` allowlist, any or off.

    ``allowed`` maps a normalised project name to its version constraint ("" for any version)."""

    mode: str
    allowed: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, config: SandboxConfig) -> Policy:
        allowed: dict[str, str] = {}
        for line in [*shipped(), *config.allowed_packages]:
            try:
                requirement = Requirement(line)
            except InvalidRequirement as exc:
                raise PackageError(f"the allowlist entry {line!r} is not a requirement: {exc}") from None
            allowed[canonicalize_name(requirement.name)] = str(requirement.specifier)
        return cls(config.packages, allowed)

    def check(self, text: str) -> tuple[Requirement | None, str | None]:
        """The parsed requirement and None, or None and why it is refused."""
        if self.mode == "off":
            return None, "package installs are turned off on this nbexec (NBEXEC_PACKAGES=off)"
        try:
            requirement = Requirement(text)
        except InvalidRequirement:
            return None, "it is not a valid requirement (use a project name, optionally with a version: name==1.2)"
        if requirement.url:
            return None, "only names from the package index can be installed (no URLs, paths or editable installs)"
        if self.mode == "allowlist" and canonicalize_name(requirement.name) not in self.allowed:
            examples = ", ".join(sorted(self.allowed)[:12])
            return None, (f"{requirement.name} is not on this nbexec's allowlist of packages ({len(self.allowed)} "
                          f"common data, science, plotting, file-format and text libraries, e.g. {examples}, ...); "
                          "the operator can extend it (NBEXEC_ALLOWED_PACKAGES) or allow any wheel "
                          "(NBEXEC_PACKAGES=any)")
        return requirement, None

    def check_dependency(self, parent: str, requirement: Requirement) -> str | None:
        """Why ``parent`` (a wheel, "name version") may not bring ``requirement``, or None."""
        if requirement.url:  # a direct reference: a URL, a path or a VCS repository, never fetched
            return (f"{parent} depends on {requirement.name} by a direct reference ({requirement.name} @ "
                    f"{requirement.url[:300]}): nbexec installs only wheels it finds by name on the package index, "
                    "never from a URL, a path or a version-control repository")
        if self.mode == "off":
            return "package installs are turned off on this nbexec (NBEXEC_PACKAGES=off)"
        if self.mode == "allowlist" and canonicalize_name(requirement.name) not in self.allowed:  # a dependency too
            return (f"{parent} depends on {requirement.name}, which is not on this nbexec's allowlist of packages "
                    "(dependencies must be on it too); the operator can add it (NBEXEC_ALLOWED_PACKAGES) or allow "
                    "any wheel (NBEXEC_PACKAGES=any)")
        return None

    def bound(self, name: str) -> SpecifierSet:
        """The allowlist's version constraint on project ``name`` (normalised), for what is asked and dependencies
        alike (none in mode any)."""
        return SpecifierSet(self.allowed.get(name, "") if self.mode == "allowlist" else "")

    def constraints(self) -> list[str]:
        """The allowlist's version constraints, which bound dependencies too (none in mode any)."""
        if self.mode != "allowlist":
            return []
        return [f"{name}{spec}" for name, spec in sorted(self.allowed.items()) if spec]

    def key(self) -> list[object]:
        """What a cached resolution depends on: the mode and, for an allowlist, the list itself."""
        return [self.mode, sorted(self.allowed.items()) if self.mode == "allowlist" else []]
