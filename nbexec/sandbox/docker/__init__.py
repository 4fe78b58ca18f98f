"""Sandboxes on the local Docker engine: the LocalSource behind the seam.

    container  one throwaway container with a ready IPython kernel (`Sandbox`, the local SandboxHandle)
    pool       warm pools per container shape, background teardown
    datafs     /mnt/data as a filesystem of fixed size, and its snapshot
    inputmount /mnt/input without nbexec's own settings files (.env and its kin), laid over with empty mounts
    workdir    a sandbox's working folder on the host: removed safely, swept when its process is gone
    egress     the allowlist wiring of one container: its host proxy, the mount, the in-sandbox forwarder
    daemon     the Docker engine: connect, translate errors, sweep what nbexec left
    runtimes   the OCI runtimes (runc, runsc, crun): known, working, registration
    image      the runtime image: build and describe
    recipe     what a named image is built from, checked, and the hash its tag carries (pure)
    named      named images: build one on the runtime image unless its inputs were built before, list them
    supervisor a process supervisor inside a sandbox (docker exec) for the E2B door: processes, a pty, files

May import: nbexec's values, files, egress, and the kernel wire of `nbexec.sandbox`.
"""
