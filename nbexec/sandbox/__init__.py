"""The sandbox edge: containers on the local Docker engine, their kernels and their /mnt/data.

    container  one throwaway container with a ready IPython kernel (`Sandbox`)
    pool       where sandboxes come from: warm pools per container shape, background teardown
    kernel     the host's one kernel client (every message sized and checked before it is parsed)
    zmtp       the ZeroMQ wire protocol under it
    datafs     /mnt/data as a filesystem of fixed size, and its snapshot
    daemon     the Docker engine: connect, translate errors, sweep what nbexec left
    runtimes   the OCI runtimes (runc, runsc, crun): known, working, registration
    image      the runtime image: build and describe
"""

from .container import Sandbox

__all__ = ["Sandbox"]
