"""Sandboxes on the nodes of a Ray cluster (``source="ray"``): a SandboxSource like the local and remote ones.

    source   RaySource: the cluster's alive nodes, an agent actor pinned to each, placement by free capacity
    agent    NodeAgent: the node's half, an actor holding that node's local source (Docker, its pools, limits)
    handle   RayHandle: every SandboxHandle method as one call to the sandbox's agent
    calls    one call: a deadline on the wait, the answer sized before it is kept, Ray's failures as nbexec's

May import: nbexec's values, files, the seam and kernel wire of `nbexec.sandbox`, the local source (the agent
runs it on its node) and the remote backend's hostile-input readers (`remote.frames`, `remote.files`,
`remote.nodes`: a node's answers are read the same way whether they come over HTTP or Ray). Needs the ``ray``
extra; nothing here is imported until a config names the source.
"""
