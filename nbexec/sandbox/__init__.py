"""The sandbox edge: the seam every backend implements, the kernel wire they share, and the backends.

    source     the seam: where sandboxes come from (SandboxSource) and what a sandbox offers (SandboxHandle)
    kernel     the host's one kernel client: handshake, execute loop, interrupt, warm imports; one receive path
    messages   a kernel message as kept (sized, content unparsed until asked) and the one hostile-JSON parser
    lasterror  asking a kernel how its last cell ended, when its own messages were too large to keep (pure)
    zmtp       the ZeroMQ wire protocol under it
    docker/    the local source: this host's Docker engine, warm pools, containers, /mnt/data, egress wiring
    remote/    the remote source: nodes of NBEXEC_NODES, each sandbox driven over HTTP

May import: nbexec's values (config, errors, result), files and egress. The engine (`nbexec.engine.sources`)
picks a source; nothing here imports the engine.
"""
