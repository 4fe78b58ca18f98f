"""`nbexec image`: build the runtime image, build named images on it, and list them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from nbexec import judgelangs
from nbexec.config import DEFAULT_IMAGE, from_env
from nbexec.errors import ConfigError, NbexecError
from nbexec.names import is_image_name
from nbexec.sandbox.docker import image, judgeimage, kernels, named, recipe

from .commands import EXIT_CODES, EXIT_INFRA, EXIT_USAGE, fail

_RUNTIME_ONLY = ("tag", "base_image", "debootstrap", "mirror")


@click.group(name="image")
def image_group() -> None:
    """Build and list the runtime image and named images."""


@image_group.command(name="build", epilog=EXIT_CODES)
@click.option("--name", help="Build a named image NAME on the runtime image instead (with --requirements, --apt, "
              "--base): tagged nbexec-image-NAME:<hash of its inputs>; the same inputs build nothing new. Calls ask "
              "for it with image=NAME once NBEXEC_IMAGES lists it.")
@click.option("--requirements", type=click.Path(path_type=Path), metavar="FILE",
              help="With --name: Python requirements to install (names, extras, versions, markers; no pip options "
                   "or URLs), one per line.")
@click.option("--apt", "apt_packages", multiple=True, metavar="PACKAGE",
              help="With --name: a Debian package to install (repeatable).")
@click.option("--base", help="With --name: the image to build on, a named image or an nbexec runtime image's tag "
              "[default: the configured image, NBEXEC_IMAGE].")
@click.option("--kernels", "kernel_list", metavar="r,deno,bash|judge", help="Build the kernels image instead: these "
              "languages' kernels added to the runtime image (NBEXEC_IMAGE), tagged NBEXEC_KERNELS_IMAGE unless --tag "
              "(R and IRkernel from Debian, Deno and bash_kernel from PyPI; no registry needed). `judge`: the judge "
              f"image, Debian's compilers for C, C++, Java, Go and Rust on the runtime image, tagged "
              f"{judgelangs.IMAGE} unless --tag.")
@click.option("--tag", default=None, help="The runtime image's tag [default: the config's image].")
@click.option("--base-image", help="The runtime image's base (build argument BASE_IMAGE) [default: python:3.12-slim].")
@click.option("--debootstrap", is_flag=True,
              help="No registry: make a Debian base with debootstrap + docker import (root), and build on it.")
@click.option("--mirror", help="Debian mirror for --debootstrap [default: http://deb.debian.org/debian].")
@click.option("--ca-bundle", type=click.Path(dir_okay=False, exists=True, path_type=Path), envvar="NBEXEC_CA_BUNDLE",
              help="CA certificates for pip inside the build (a TLS-inspecting proxy or private mirror).")
@click.option("--no-cache", is_flag=True, help="Build every layer anew (with --name: even when its inputs did not "
              "change).")
def image_build(name: str | None, requirements: Path | None, apt_packages: tuple[str, ...], base: str | None,
                ca_bundle: Path | None, no_cache: bool, kernel_list: str | None, **runtime: Any) -> None:
    """Build the runtime image, or with --name a named image on it, or with --kernels the image for other
    languages, showing Docker's progress."""
    if kernel_list is not None:
        given = [f"--{o.replace('_', '-')}" for o in _RUNTIME_ONLY if runtime[o] and o != "tag"] + \
            (["--name"] if name else []) + (["--requirements, --apt, --base"] if requirements or apt_packages or base
                                             else [])
        if given:
            fail(f"{', '.join(given)} do not apply to --kernels (built on the configured runtime image)", EXIT_USAGE,
                 False)
        _build_kernels(kernel_list, runtime["tag"], ca_bundle, no_cache)
        return
    if name is not None:
        given = [f"--{option.replace('_', '-')}" for option in _RUNTIME_ONLY if runtime[option]]
        if given:
            fail(f"{', '.join(given)} apply to the runtime image; a named image is built on --base", EXIT_USAGE, False)
        _build_named(name, requirements, apt_packages, base, ca_bundle, no_cache)
        return
    if requirements is not None or apt_packages or base is not None:
        fail("--requirements, --apt and --base build a named image: give its --name", EXIT_USAGE, False)
    _build_runtime(ca_bundle, no_cache, **runtime)


def _build_runtime(ca_bundle: Path | None, no_cache: bool, *, tag: str | None, base_image: str | None,
                   debootstrap: bool, mirror: str | None) -> None:
    try:
        configured = from_env().image
        tag = tag or (DEFAULT_IMAGE if is_image_name(configured) else configured)
        if debootstrap:
            base_image = base_image or image.DEFAULT_BASE
            if image.exists(base_image):
                click.echo(f"nbexec: using the existing base image {base_image}", err=True)
            else:
                image.make_base(base_image, mirror=mirror)
        options = image.BuildOptions(tag=tag, base_image=base_image, ca_bundle=ca_bundle, no_cache=no_cache)
        image_id = image.build(options, progress=lambda line: click.echo(line, err=True))
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE, False)
    except NbexecError as exc:
        fail(str(exc), EXIT_INFRA, False)
    click.echo(f"built {tag} ({image_id})")


def _build_kernels(kernel_list: str, tag: str | None, ca_bundle: Path | None, no_cache: bool) -> None:
    try:
        config = from_env()
        base = config.replace(language="python").image_tag
        if judgeimage.wants_judge(kernel_list):
            _build_judge(base, tag or judgelangs.IMAGE, image.BuildOptions(ca_bundle=ca_bundle, no_cache=no_cache))
            return
        chosen = kernels.parse_list(kernel_list)
        tag = tag or config.kernels_image
        image_id = kernels.build(chosen, base=base, tag=tag, progress=lambda line: click.echo(line, err=True),
                                 options=image.BuildOptions(ca_bundle=ca_bundle, no_cache=no_cache))
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE, False)
    except NbexecError as exc:
        fail(str(exc), EXIT_INFRA, False)
    click.echo(f"built {tag} ({image_id}) with python,{','.join(chosen)} on {base}")


def _build_judge(base: str, tag: str, options: image.BuildOptions) -> None:
    image_id = judgeimage.build(base=base, tag=tag, progress=lambda line: click.echo(line, err=True), options=options)
    click.echo(f"built {tag} ({image_id}) with {','.join(judgelangs.COMPILED)} on {base}")


def _build_named(name: str, requirements: Path | None, apt_packages: tuple[str, ...], base: str | None,
                 ca_bundle: Path | None, no_cache: bool) -> None:
    """Check every input before Docker is asked anything, then build (or find the build of the same inputs)."""
    try:
        lines = named.read_requirements(requirements) if requirements is not None else ()
        plan = recipe.Recipe(name=name, requirements=lines, apt=apt_packages, base=base)
        default_base = from_env().image_tag
        built = named.build(plan, default_base=default_base, progress=lambda line: click.echo(line, err=True),
                            no_cache=no_cache, ca_bundle=ca_bundle)
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE, False)
    except NbexecError as exc:
        fail(str(exc), EXIT_INFRA, False)
    if built.built:
        click.echo(f"built {built.tag} ({built.image_id}); image={name} runs it")
    else:
        click.echo(f"{built.tag} is up to date (built before from the same base, requirements and apt packages): "
                   f"nothing built; image={name} runs it")


@image_group.command(name="list", epilog=EXIT_CODES)
@click.option("--all", "every_build", is_flag=True, help="Also list older builds of each name.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON array.")
def image_list(every_build: bool, as_json: bool) -> None:
    """List the default image and the named images: tag, size, when built, what from, and whether NBEXEC_IMAGES
    allows calls to ask for it."""
    try:
        config = from_env()
        rows = named.listing(allowed=config.images, default_tag=config.image_tag, every_build=every_build)
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE, as_json)
    except NbexecError as exc:
        fail(str(exc), EXIT_INFRA, as_json)
    if as_json:
        click.echo(json.dumps(rows))
        return
    click.echo(f"{'NAME':24} {'TAG':48} {'SIZE':>8}  {'CREATED':19}  {'ALLOWED':7}  BUILT FROM")
    for row in rows:
        built_from = "; ".join(part for part in (
            f"base {row['base']}" if row["base"] else "",
            f"requirements: {', '.join(row['requirements'])}" if row["requirements"] else "",
            f"apt: {' '.join(row['apt'])}" if row["apt"] else "") if part)
        name = row["name"] + ("" if row["current"] else " (older)")
        click.echo(f"{name:24} {row['tag']:48} {row['size'] / 1e6:>5.0f} MB  {row['created']:19}  "
                   f"{'yes' if row['allowed'] else 'no':7}  {built_from}")
