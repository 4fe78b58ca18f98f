"""The keyword overrides of SandboxConfig's fields (``timeout=5``, ``memory="2g"``...) that calls take, as
TypedDicts: an editor completes them and mypy refuses a misspelt one.

`ConfigOverrides` has one key per field, typed as the field (a tuple field takes a list too) or None (None keeps
the config's value): `from_env`, `SandboxConfig.replace` and `Session` take it. `RunOverrides`, what
execute_notebook() and execute_many() take, lacks ``source`` and ``packages``: there those names are the code to
run and the requirements to install. Both are written out because a type checker reads no generated class;
tests/test_overrides.py keeps them equal to the fields.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TypedDict

if sys.version_info >= (3, 11):
    from typing import Unpack as Unpack
else:  # typing gained Unpack in 3.11
    from typing_extensions import Unpack as Unpack


class RunOverrides(TypedDict, total=False):
    """SandboxConfig's fields but ``source`` and ``packages``, as keyword overrides (see SandboxConfig)."""

    image: str | None
    images: tuple[str, ...] | list[str] | None
    language: str | None
    languages: tuple[str, ...] | list[str] | None
    kernels_image: str | None
    network: bool | str | None
    memory: str | None
    cpus: float | None
    pids: int | None
    timeout: float | None
    cell_timeout: float | None
    max_output: str | None
    max_display: str | None
    max_outputs: int | None
    max_data: str | None
    max_files: int | None
    tmp_size: str | None
    disk_margin: str | None
    user: str | None
    env: Mapping[str, str] | None
    runtime: str | None
    input_dir: str | None
    link_input: bool | None
    warm_imports: tuple[str, ...] | list[str] | None
    pool_size: int | None
    startup_timeout: float | None
    interrupt_grace: float | None
    allowed_packages: tuple[str, ...] | list[str] | None
    package_index: str | None
    max_packages: int | None
    max_package_download: str | None
    package_cache: str | None
    package_resolver_user: str | None
    package_resolver_python: str | None
    package_resolver_memory: str | None
    allowed_hosts: tuple[str, ...] | list[str] | None
    egress_widen: bool | None
    max_egress: str | None
    max_connections: int | None
    max_open_connections: int | None
    egress_idle_timeout: float | None
    egress_min_rate: int | None


class ConfigOverrides(RunOverrides, total=False):
    """SandboxConfig's fields as keyword overrides (see SandboxConfig for what each means)."""

    source: str | None
    packages: str | None
