"""The sandbox edge: containers on the local Docker engine, their kernels and their /mnt/data.

    source     the seam: where sandboxes come from (SandboxSource) and what the engine uses of one (SandboxHandle)
    container  one throwaway container with a ready IPython kernel (`Sandbox`, the local SandboxHandle)
    pool       warm pools per container shape, background teardown (behind source.LocalSource)
    kernel     the host's one kernel client: handshake, execute loop, interrupt, warm imports; one receive path
    messages   a kernel message as kept (sized, content unparsed until asked) and the one hostile-JSON parser
    lasterror  asking a kernel how its last cell ended, when its own messages were too large to keep (pure)
    zmtp       the ZeroMQ wire protocol under it
    workdir    a sandbox's working folder on the host: removed safely, swept when its process is gone
    datafs     /mnt/data as a filesystem of fixed size, and its snapshot
    daemon     the Docker engine: connect, translate errors, sweep what nbexec left
    runtimes   the OCI runtimes (runc, runsc, crun): known, working, registration
    image      the runtime image: build and describe; recipe and named: named images built on it
"""

from .docker.container import Sandbox

__all__ = ["Sandbox"]
