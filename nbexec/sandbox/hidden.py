"""nbexec's own silent requests, by name: what a node's hidden route takes instead of code (pure).

A request that runs outside the notebook (the package set-up, an install) is named here, with its arguments as
JSON data. A local sandbox runs the code its builder (`nbexec.packages.hidden_code`) makes. A remote one sends only
the name and the arguments, and its node builds the same code itself. So no client ever sends code to that door.
The user's own code (a replayed cell) is not a named request: a remote sandbox runs it as a cell.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

NAMES = ("packages.setup", "packages.install")  # every request a node's hidden route takes


@dataclass(frozen=True)
class Named:
    """One of nbexec's own requests: ``name`` (one of NAMES) and its arguments (JSON data, never code)."""

    name: str
    args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in NAMES:
            raise ValueError(f"{self.name[:60]!r} is not one of nbexec's own requests ({', '.join(NAMES)})")
