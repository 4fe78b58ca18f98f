"""The input folder a notebook brings: the folder it lies in.

It is mounted read-only at /mnt/input and copied into the kernel's working folder. That is how `nbexec run FILE`
lets `open('data.csv')` read, and overwrite, the file next to the notebook; the host's copy stays untouched.
The sandbox decides what the mount shows and what is copied (`sandbox.docker.inputmount`, `inputcopy`); this
module only chooses the folder. It is pure but for resolving the path."""

from __future__ import annotations

import logging
from pathlib import Path

from nbexec.config import SandboxConfig
from nbexec.hostconfig import host_from_env

log = logging.getLogger(__name__)


def with_folder(config: SandboxConfig, path: Path) -> SandboxConfig:
    """The config with ``path``'s folder as the read-only input folder, linked from the kernel's working folder.

    Nothing changes when a folder is set, the input is stdin, or the folder is the home folder or /. Those show
    untrusted code too much: mount a narrower folder with --mount-input / input_dir."""
    if config.input_dir is not None or str(path) == "-" or host_from_env().nodes:  # nodes mount no host folder
        return config
    folder = Path(path).resolve().parent
    if folder in (Path.home().resolve(), Path(folder.anchor)):
        log.info("%s lies in %s: its folder is not mounted (use --mount-input)", path, folder)
        return config
    return config.replace(input_dir=str(folder), link_input=True)
