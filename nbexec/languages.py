"""The languages nbexec runs, in one table: per language its Jupyter kernelspec, the script extensions that choose
it, the comment marker of its `%%` cells, its launcher in the image, and how its kernel is interrupted. Pure, and a
leaf (only `errors` below it), so `config` can check a language by it.

The kernels besides Python (R: IRkernel, TypeScript/JavaScript: Deno's built-in kernel, Bash: bash_kernel) are in
the image `nbexec image build --kernels` makes (environments/jupyter/kernels.Dockerfile); what each does
differently is in docs/languages-spike.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

KERNELS_LABEL = "io.nbexec.kernels"  # the image label listing the languages an image has (missing: python only)


@dataclass(frozen=True)
class Language:
    """One language nbexec runs. ``interrupt`` is "message" (an interrupt_request on the control channel) or
    "signal" (SIGINT to the sandbox: IRkernel ignores interrupt_request)."""

    name: str  # the canonical name: config.language, the image label's entries, `--kernels`
    kernelspec: tuple[tuple[str, str], ...]  # name, display_name, language: what a notebook's metadata says
    info: str  # the language_info name a notebook gets before its kernel says more
    extensions: tuple[str, ...]
    comment: str  # what starts a `%%` cell marker line in a script
    launcher: str  # the command in the image, given the connection file
    interrupt: str = "message"
    settle: float = 0.0  # seconds of iopub silence to wait for after idle (Deno publishes some outputs after it)

    @property
    def spec(self) -> dict[str, str]:
        """The kernelspec as a notebook's metadata holds it."""
        return dict(self.kernelspec)

    @property
    def is_python(self) -> bool:
        return self.name == "python"


def _spec(name: str, display: str, language: str) -> tuple[tuple[str, str], ...]:
    return (("name", name), ("display_name", display), ("language", language))


LANGUAGES: dict[str, Language] = {lang.name: lang for lang in (
    Language("python", _spec("python3", "Python 3 (nbexec sandbox)", "python"), "python", (".py",), "#",
             "nbexec-kernel"),
    Language("r", _spec("ir", "R", "R"), "R", (".R", ".r"), "#", "nbexec-kernel-r", interrupt="signal"),
    Language("deno", _spec("deno", "Deno", "typescript"), "typescript", (".ts", ".js", ".mts", ".mjs"), "//",
             "nbexec-kernel-deno", settle=0.075),
    Language("bash", _spec("bash", "Bash", "bash"), "bash", (".sh", ".bash"), "#", "nbexec-kernel-bash"),
)}
ALIASES = {"python3": "python", "py": "python", "R": "r", "ir": "r", "typescript": "deno", "ts": "deno",
           "javascript": "deno", "js": "deno", "sh": "bash"}
NAMES = tuple(LANGUAGES)


def known() -> str:
    """The languages nbexec knows, for messages."""
    return ", ".join(NAMES)


def canonical(value: Any, what: str = "language") -> str:
    """The canonical name of ``value`` (a name or an alias); ConfigError naming the choices otherwise."""
    if isinstance(value, str):
        name = ALIASES.get(value, ALIASES.get(value.lower(), value.lower()))
        if name in LANGUAGES:
            return name
    shown = repr(value[:60]) if isinstance(value, str) else f"{repr(value)[:60]} ({type(value).__name__})"
    raise ConfigError(f"{what} {shown} is not a language nbexec runs; choose one of {known()} "
                      f"(or an alias: {', '.join(sorted(ALIASES))})")


def get(value: Any) -> Language:
    """The table entry of ``value`` (a name or an alias); ConfigError otherwise."""
    return LANGUAGES[canonical(value)]


def for_extension(suffix: str) -> Language | None:
    """The language a script's file extension (``.R``, ``.ts``) names; None for one nbexec does not know."""
    return next((lang for lang in LANGUAGES.values() if suffix in lang.extensions), None) or \
        next((lang for lang in LANGUAGES.values() if suffix.lower() in lang.extensions), None)


def of_kernelspec(spec: Any) -> Language:
    """The language a notebook's kernelspec names: by its ``language`` field, else its ``name`` (ir, deno, bash,
    python3, or an alias). ConfigError for a kernelspec that is not an object or names no language nbexec runs."""
    if not isinstance(spec, dict):
        raise ConfigError(f"the notebook's metadata.kernelspec is {type(spec).__name__}, not an object with a name "
                          f"and a language; nbexec runs {known()}")
    for key in ("language", "name"):
        value = spec.get(key)
        if isinstance(value, str):
            try:
                return get(value)
            except ConfigError:
                continue
    raise ConfigError(f"the notebook's kernel {str(spec.get('name'))[:60]!r} (language "
                      f"{str(spec.get('language'))[:60]!r}) is not one nbexec runs; it runs {known()}. Pass "
                      "language= (--language) to run the notebook's code in one of them")


def parse_label(value: Any) -> tuple[str, ...]:
    """The languages an image's ``io.nbexec.kernels`` label lists (a missing label: python only)."""
    if not isinstance(value, str) or not value.strip():
        return ("python",)
    return tuple(dict.fromkeys(part.strip().lower() for part in value.split(",") if part.strip()))
