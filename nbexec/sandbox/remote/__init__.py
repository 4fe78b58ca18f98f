"""Sandboxes on remote nodes (`nbexec serve` agents, NBEXEC_NODES): a SandboxSource like the local one.

    source   RemoteSource: placement over the nodes (capacity, health, backoff), acquire and release
    handle   RemoteHandle: every SandboxHandle method as a call to the node's /v1/sandboxes routes
    frames   a run relayed as length-prefixed frames: written by the node, read here within caps (pure)
    files    a remote /mnt/data: the listing checked and capped, files streamed into the output folder
    nodes    the pure parts shared with the router (Capacity, rank, Health) and the HTTP hop (NodeClient)
    paths    file names in a node's URLs: checked segment by segment, then percent-encoded (pure)

May import: nbexec's values, files, and the seam and kernel wire of `nbexec.sandbox`. The engine drives these
handles exactly as local ones; nothing here runs a cell loop or builds a result.
"""
