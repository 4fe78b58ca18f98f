"""The sandbox edge: the seam every backend implements, the kernel wire they share, and the backends.

    source     the seam: where sandboxes come from (SandboxSource) and what a sandbox offers (SandboxHandle)
    capabilities  what a backend may offer beyond the required core, said by name when it does not
    kernel     the host's one kernel client: handshake, execute loop, interrupt, warm imports; one receive path
    messages   a kernel message as kept (sized, content unparsed until asked) and the one hostile-JSON parser
    lasterror  asking a kernel how its last cell ended, when its own messages were too large to keep (pure)
    zmtp       the ZeroMQ wire protocol under it, over a unix socket or tcp://host:port
    docker/    the local source: this host's Docker engine, warm pools, containers, /mnt/data, egress wiring
    remote/    the remote source: nodes of NBEXEC_NODES, each sandbox driven over HTTP
    fake       a source for tests only: an in-process fake kernel, no isolation (never reachable from config)

May import: nbexec's values (config, errors, result), files and egress. The engine (`nbexec.engine.sources`)
picks a source; nothing here imports the engine.
"""
