"""What the egress proxies may hold and for how long (used by `nbexec.egress.proxy`).

- **Descriptors.** Each connection a proxy serves costs the host `PER_CONNECTION` descriptors (the sandbox's end
  and the upstream's) and a thread, charged when it is accepted and given back when it ends. A sandbox's proxy
  holds at most ``max_open_connections`` at once; all the proxies of this process together at most half of the
  process's descriptor limit (the soft ``RLIMIT_NOFILE``, read at each charge, so ``ulimit -n`` or systemd's
  ``LimitNOFILE`` raises it), and never more than `HOST_MOST`: the other half stays for everything else the
  process does (kernels' sockets, Docker, files). A connection past either budget is refused at once (503).
- **Pace.** A tunnel is closed when nothing moved either way for the idle timeout, or when a window of that
  length moved fewer than ``min_rate`` x window bytes: trickled bytes do not keep it open, and a fast start buys
  no later window.
"""

from __future__ import annotations

import resource
import threading
from collections.abc import Callable

PER_CONNECTION = 2
HOST_SHARE = 2  # the proxies may hold 1/HOST_SHARE of the process's descriptor limit
HOST_MOST = 8192  # descriptors, whatever the limit (each pair is a thread as well)


class Budget:
    """A count of descriptors handed out against a capacity (a number, or a function read at each charge)."""

    def __init__(self, capacity: int | Callable[[], int]) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        self.used = 0

    @property
    def capacity(self) -> int:
        return self._capacity() if callable(self._capacity) else self._capacity

    def take(self, count: int) -> bool:
        """Charge ``count``; False (nothing charged) when that would pass the capacity."""
        capacity = self.capacity
        with self._lock:
            if self.used + count > capacity:
                return False
            self.used += count
            return True

    def give(self, count: int) -> None:
        with self._lock:
            self.used -= count


def host_capacity() -> int:
    """The descriptors all the proxies of this process may hold together."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return HOST_MOST if soft == resource.RLIM_INFINITY else min(soft // HOST_SHARE, HOST_MOST)


HOST = Budget(host_capacity)  # the process's, shared by every proxy (constructed here, read only when charged)


class Pace:
    """The deadlines of one tunnel (times are `time.monotonic` seconds)."""

    def __init__(self, window: float, least: int, now: float) -> None:
        self.window, self.least = window, least
        self.last, self.ends, self.count = now, now + window, 0
        self.reason: str | None = None

    def moved(self, count: int, now: float) -> None:
        self.check(now)  # a window that ended before these bytes is judged without them
        self.count += count
        self.last = now

    def wait(self, now: float) -> float:
        """Seconds until the next deadline."""
        return max(0.0, min(self.last + self.window, self.ends) - now)

    def check(self, now: float) -> str | None:
        """Why the tunnel is to be closed now, or None; once a reason is found it stays."""
        if self.reason is None and now - self.last >= self.window:
            self.reason = f"closed after {self.window:g} s without traffic"
        elif self.reason is None and now >= self.ends:
            if self.count < self.least:
                self.reason = (f"closed: {self.count:,} bytes moved in {self.window:g} s, fewer than the "
                               f"{self.least:,} the minimum rate asks (egress_min_rate)")
            self.ends += self.window
            if self.ends <= now:  # windows passed unchecked: start a fresh one
                self.ends = now + self.window
            self.count = 0
        return self.reason
