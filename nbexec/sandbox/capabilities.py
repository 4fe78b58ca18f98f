"""What a backend may offer beyond the required core, and how the seam knows which it does. Pure: no I/O.

A capability is a set of methods of the handle or the source (`CAPABILITIES`). The base classes in `source`
give each of them a default that raises NotOfferedError naming the backend and the capability. A backend offers
a capability by defining all of its methods: a class that defines only some of them is refused when it is made,
so a half-done capability cannot reach the engine. The engine asks ``offers(Capability.X)`` before it relies on
one; it never probes attributes.
"""

from __future__ import annotations

import enum

from nbexec.errors import NotOfferedError


class Capability(enum.Enum):
    """An optional part of the seam."""

    SLEEP = "sleep"  # stop every process keeping /mnt/data; a fresh kernel later (the engine replays)
    FREEZE = "freeze"  # stop every process where it is, so /mnt/data is collected as one moment
    EGRESS = "egress changes"  # change a running sandbox's egress rules
    WHEELS = "wheels"  # put wheels the host resolved into /mnt/wheels (packages=)
    DURABLE = "durable sessions"  # find a sandbox again from another process (describe, adopt, abandon)
    CHECKPOINT = "checkpoint"  # keep a sandbox's memory across a sleep (hibernate, wake, discard)
    JUDGE = "judging by name"  # judge a program sent as data (where run_hidden takes no code: a remote node)


# The methods each capability needs: (on the handle, on the source).
CAPABILITIES: dict[Capability, tuple[tuple[str, ...], tuple[str, ...]]] = {
    Capability.SLEEP: (("sleep", "awake"), ()),
    Capability.FREEZE: (("freeze",), ()),
    Capability.EGRESS: (("change_egress",), ()),
    Capability.WHEELS: (("provide_wheels",), ()),
    Capability.DURABLE: (("describe",), ("adopt", "abandon")),
    Capability.CHECKPOINT: ((), ("hibernate", "wake", "discard")),
    Capability.JUDGE: (("judge",), ()),
}


def offered(cls: type, base: type, side: int) -> frozenset[Capability]:
    """The capabilities ``cls`` implements over ``base`` (``side`` 0: a handle, 1: a source). TypeError for a
    capability only partly defined: it would fail at its first use instead of saying so now."""
    found = set()
    for capability, methods in CAPABILITIES.items():
        names = methods[side]
        defined = [name for name in names if getattr(cls, name) is not getattr(base, name)]
        if defined and len(defined) < len(names):
            missing = sorted(set(names) - set(defined))
            raise TypeError(f"{cls.__name__} defines {', '.join(defined)} but not {', '.join(missing)}: the "
                            f"{capability.value} capability needs all of them")
        if names and defined:
            found.add(capability)
    return frozenset(found)


def not_offered(backend: str, capability: Capability) -> NotOfferedError:
    """The error a default raises: the backend and what it does not offer."""
    return NotOfferedError(f"the {backend} sandbox backend does not offer {capability.value}")
