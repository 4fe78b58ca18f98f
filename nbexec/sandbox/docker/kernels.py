"""Which languages an image has (its ``io.nbexec.kernels`` label, see `nbexec.languages`), checked before a sandbox
of a language other than Python starts, and the build of the kernels image (environments/jupyter/kernels.Dockerfile
on a runtime image)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import docker.errors

from nbexec import languages
from nbexec.config import SandboxConfig
from nbexec.errors import ConfigError, ImageNotFoundError

from . import daemon, image


def of_image(tag: str) -> tuple[str, ...]:
    """The languages the image ``tag`` has, by its label (python only without one); ImageNotFoundError when the
    image is missing."""
    with daemon.translated(f"look up image {tag}"):
        labels = daemon.connect().images.get(tag).labels or {}
    return languages.parse_label(labels.get(languages.KERNELS_LABEL))


def require(config: SandboxConfig) -> None:
    """ConfigError (or ImageNotFoundError) before any container when the image lacks ``config.language``'s kernel.
    Python is in every runtime image: not asked. The image is inspected each time (a rebuild changes it); a start
    takes a second or more, the inspect milliseconds."""
    if config.language == "python":
        return
    tag, build = config.image_tag, f"nbexec image build --kernels {config.language}"
    try:
        has = of_image(tag)
    except ImageNotFoundError as exc:
        raise ImageNotFoundError(f"The image {tag} for language {config.language} is missing. Build it with "
                                 f"`{build}` (it adds the kernels to the runtime image).") from exc
    if config.language not in has:
        raise ConfigError(f"language {config.language} needs its kernel, and the image {tag} has only "
                          f"{', '.join(has)}. Build one that has it: `{build}` (tagged {config.kernels_image}), or "
                          "choose another image (NBEXEC_IMAGE, NBEXEC_KERNELS_IMAGE).")


def parse_list(text: str) -> tuple[str, ...]:
    """The kernels `--kernels r,deno,bash` names, canonical, without python (every image has it)."""
    names = [languages.canonical(part.strip(), "--kernels entry") for part in text.split(",") if part.strip()]
    chosen = tuple(dict.fromkeys(name for name in names if name != "python"))
    if not chosen:
        raise ConfigError(f"--kernels names no kernel to add; choose from {', '.join(languages.NAMES[1:])}")
    return chosen


def build(kernels: Sequence[str], *, base: str, tag: str, progress: Callable[[str], None],
          options: image.BuildOptions) -> str:
    """Build the kernels image ``tag`` on the runtime image ``base`` (which must be here: nothing is pulled);
    return its id."""
    with daemon.translated(f"look up the runtime image {base}"):
        try:
            daemon.connect().images.get(base)
        except docker.errors.ImageNotFound:
            raise ImageNotFoundError(f"the runtime image {base} that the kernels are added to is missing: build it "
                                     "first with `nbexec image build`") from None
    args = {"BASE_IMAGE": base, "KERNELS": ",".join(kernels)}
    return image.run_build(image.BuildOptions(tag=tag, ca_bundle=options.ca_bundle, no_cache=options.no_cache),
                           progress, dockerfile="kernels.Dockerfile", buildargs=args, base=base)
