"""A process that serves egress proxies under a small descriptor limit (for tests/security/test_egress_load.py).

    python egress_child.py LIMIT MAX_OPEN RULES NAME [NAME ...]

It lowers its own RLIMIT_NOFILE soft limit to LIMIT, starts one `Proxy` on each socket NAME (relative to its
working folder) with the comma-separated allowlist RULES and MAX_OPEN connections at once, prints ``ready``, and
then obeys lines on stdin: ``hog`` opens files until the descriptor table is full (``full N``), ``free`` closes
them (``freed``). The proxies' log goes to stderr. Everything else about the proxies is the real thing: the
default process-wide descriptor budget (derived from the limit) included.
"""

from __future__ import annotations

import logging
import os
import resource
import sys
from pathlib import Path

from nbexec import egress
from nbexec.egress.proxy import Limits, Proxy


def main() -> None:
    limit, max_open, rules, *names = sys.argv[1:]
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(limit), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s: %(message)s")
    allowlist = egress.Allowlist.of(rules.split(","))
    limits = Limits(max_bytes=0, max_connections=100_000, max_open=int(max_open))
    proxies = [Proxy.start(Path(name), allowlist, limits) for name in names]
    print("ready", flush=True)
    hogged: list[int] = []
    for line in sys.stdin:
        if line.strip() == "hog":
            try:
                while True:
                    hogged.append(os.open("/dev/null", os.O_RDONLY))
            except OSError:
                pass
            print("full", len(hogged), flush=True)
        elif line.strip() == "free":
            for fd in hogged:
                os.close(fd)
            hogged.clear()
            print("freed", flush=True)
    for proxy in proxies:
        proxy.close()


if __name__ == "__main__":
    main()
