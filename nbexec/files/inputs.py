"""The input folder a notebook brings: the folder it lies in, mounted read-only at /mnt/input with its entries linked
from the kernel's working folder (how `nbexec run FILE` and `execute_notebook(Path(...))` let `open('data.csv')`
read the file next to the notebook). What the mount shows and hides is the sandbox's business
(`sandbox.docker.container`); this only chooses the folder. Pure but for resolving the path."""

from __future__ import annotations

import logging
from pathlib import Path

from nbexec.config import SandboxConfig
from nbexec.hostconfig import host_from_env

log = logging.getLogger(__name__)


def with_folder(config: SandboxConfig, path: Path) -> SandboxConfig:
    """The config with ``path``'s folder as the read-only input folder (its entries linked from the kernel's
    working folder), unless one is set, the input is stdin, or the folder is the home folder or / (too much to
    show untrusted code: mount a narrower folder with --mount-input / input_dir)."""
    if config.input_dir is not None or str(path) == "-" or host_from_env().nodes:  # nodes mount no host folder
        return config
    folder = Path(path).resolve().parent
    if folder in (Path.home().resolve(), Path(folder.anchor)):
        log.info("%s lies in %s: its folder is not mounted (use --mount-input)", path, folder)
        return config
    return config.replace(input_dir=str(folder), link_input=True)
