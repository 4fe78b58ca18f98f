"""Host files: nbexec's own private folders, and the files of a sandbox read and written without following links.

    folders    private roots in the temporary folder, output folders held by descriptor, retention
    transfer   one file at a time through directory descriptors: into /mnt/data, out of it, into output folders
    artifacts  what the code left in /mnt/data, collected within the caps
    space      the host disk one sandbox may write, admitted before it starts (DiskSpaceError otherwise)
    ledger     the record of disk held for sandboxes, shared by this uid's nbexec processes
    inputs     the input folder a notebook brings (its own folder, read-only at /mnt/input)
    workdir    a sandbox's working folder: removed without following links or mounts, swept when its process died
    mounts     mounts under nbexec's folders, found in the mount table and unmounted (deepest first)

May import: nbexec's values (config, errors, result) and notebook.outputs. Nothing about sandboxes or the engine.
"""
