"""Sandboxes on remote nodes (`nbexec serve` agents, NBEXEC_NODES).

    nodes           capacity, health, placement and the one HTTP hop to a node
    remote          one-shot runs on a node
    remote_session  a session whose kernel lives on a node
    noderun         one run on a node, seen from this host
    paths           file names in a node's URLs: checked segment by segment, then percent-encoded

May import: nbexec's values, files, stores, notebook.
"""
