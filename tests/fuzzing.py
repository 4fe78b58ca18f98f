"""What the property-based tests share: the hypothesis profiles and the linear-time check.

Profiles (chosen with HYPOTHESIS_PROFILE, loaded by tests/conftest.py): ``ci`` (the default) runs a bounded number
of examples, derandomized (the same examples on every run and machine: the tier is deterministic) with no
per-example deadline (the machine is shared: wall-clock limits flake); ``deep`` runs many more, randomized, for a
hunt on a developer's machine (``HYPOTHESIS_PROFILE=deep pytest tests/test_fuzz_*.py``); ``mutants`` fewer, for
scripts/mutants.py, where every surviving mutant runs every test that reaches it.

Time is judged by CPU, never by the clock: a parser fed an input ``factor`` times larger may cost at most
``slack * factor`` times the CPU of the smaller one (the best of a few tries each). A quadratic pass costs
``factor ** 2``: with factor 16 and slack 3, linear is ~16x, the bound is 48x, quadratic would be 256x.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable

from hypothesis import HealthCheck, Phase, settings

settings.register_profile("ci", max_examples=150, deadline=None, derandomize=True, database=None,
                          print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("deep", max_examples=5000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
# scripts/mutants.py: every surviving mutant runs every test that reaches it, so fewer (still fixed) examples each,
# and a failure is not shrunk (the first failing example is verdict enough; shrinking a mutant that makes every
# example wait out a timeout would replay that wait many times).
settings.register_profile("mutants", max_examples=40, deadline=None, derandomize=True, database=None,
                          phases=(Phase.explicit, Phase.generate),
                          suppress_health_check=[HealthCheck.too_slow])

FLOOR = 0.002  # seconds: below this the process clock's granularity dominates


def cpu(work: Callable[[], object], tries: int = 3) -> float:
    """The least process CPU time ``work`` took over ``tries`` runs, the garbage collector paused: a full
    collection costs in proportion to every object the test process holds, which says nothing of ``work``."""
    best = math.inf
    for _ in range(tries):
        gc.collect()
        gc.disable()
        try:
            start = time.process_time()
            work()
            best = min(best, time.process_time() - start)
        finally:
            gc.enable()
    return best


def assert_linear(make: Callable[[int], object], run: Callable[[object], object], small: int, *,
                  factor: int = 16, slack: float = 3.0) -> None:
    """``run`` on an input of size ``factor * small`` costs at most ``slack * factor`` times its cost on ``small``.

    ``make(n)`` builds the input outside the measured time."""
    little, large = make(small), make(small * factor)
    base = max(cpu(lambda: run(little)), FLOOR)
    big = cpu(lambda: run(large))
    assert big <= base * factor * slack, (
        f"{factor}x the input cost {big / base:.0f}x the CPU ({base * 1000:.1f} ms -> {big * 1000:.1f} ms): "
        f"more than linear (bound {factor * slack:.0f}x)")
