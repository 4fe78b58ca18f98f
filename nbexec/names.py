"""The names nbexec judges before anything uses them: allowed_hosts entries (the grammar `nbexec.egress` builds its
rules from) and image names (a named image, or a Docker image reference). Pure; a leaf beside `nbexec.config`."""

from __future__ import annotations

import ipaddress
import re

from .errors import ConfigError

# Named images (`nbexec image build --name NAME`): a name is lower-case words joined by . _ or -, and runs the image
# tagged nbexec-image-NAME:latest (its newest build; each build is also tagged with the hash of its inputs).
IMAGE_NAME = re.compile(r"[a-z0-9]+(?:[._-][a-z0-9]+)*")
MAX_IMAGE_NAME = 48
NAMED_IMAGE_PREFIX = "nbexec-image-"
DEFAULT_IMAGE_NAME = "default"  # what a call names to get the configured image; no named image may take it
# A Docker image reference (distribution/reference's grammar): [domain/]path[:tag][@digest], or an image id.
_PATH_PART = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN_PART = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
DOCKER_REFERENCE = re.compile(
    rf"(?:{_DOMAIN_PART}(?:\.{_DOMAIN_PART})*(?::[0-9]+)?/)?{_PATH_PART}(?:/{_PATH_PART})*"
    r"(?::\w[\w.-]{0,127})?(?:@sha256:[0-9a-f]{64})?|sha256:[0-9a-f]{64}")
DEFAULT_PORTS = (80, 443)  # of an allowed_hosts entry without one
_LABEL = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)$")


def host_rule(text: str) -> tuple[str, tuple[int, ...] | None]:
    """An allowed_hosts entry (``name``, ``*.domain``, ``1.2.3.4`` or ``[::1]``, each optionally with ``:port`` or
    ``:*``) as (its host, normalised; its ports, None for any): the grammar `nbexec.egress` builds its rules from."""
    entry = text.strip().lower()
    host, port = entry, ""
    if entry.startswith("["):
        host, _, tail = entry[1:].partition("]")
        if (tail and not tail.startswith(":")) or not isinstance(ip_address(host.strip()), ipaddress.IPv6Address):
            raise ConfigError(f"allowed_hosts entry {text!r}: write an IPv6 address as [addr] or [addr]:port "
                              "(brackets hold an IPv6 address only)")
        port = tail[1:]
    elif entry.count(":") == 1:
        host, port = entry.split(":")
    try:
        ports = DEFAULT_PORTS if port == "" else None if port == "*" else (int(port),)
    except ValueError:
        raise ConfigError(f"allowed_hosts entry {text!r}: the port must be a number or *") from None
    if ports and not all(0 < p < 65536 for p in ports):
        raise ConfigError(f"allowed_hosts entry {text!r}: the port is out of range")
    normal = normal_host(host)
    if normal is None or (normal.startswith("*.") and ip_address(normal[2:]) is not None):
        raise ConfigError(f"allowed_hosts entry {text!r} is not a host name, *.domain, or an IP address")
    return normal, ports


def normal_host(host: str) -> str | None:
    """A host name lower-cased without its final dot, an address in its short form, or None when invalid."""
    host = host.strip().lower()
    address = ip_address(host)
    if address is not None:
        return str(address)
    host = host[:-1] if host.endswith(".") else host
    labels = host.split(".")
    wildcard = labels[0] == "*" and len(labels) > 2
    if len(host) > 253 or not all(_LABEL.match(label) for label in labels[1 if wildcard else 0:]):
        return None
    return host


def ip_address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def is_image_name(value: str) -> bool:
    """Whether ``value`` names a named image (a Docker tag has a ``:``, ``/`` or ``@``)."""
    return isinstance(value, str) and len(value) <= MAX_IMAGE_NAME and IMAGE_NAME.fullmatch(value) is not None


def check_image_name(name: str) -> str:
    """``name`` when it can name a named image; ConfigError saying why not."""
    if not is_image_name(name):
        raise ConfigError(f"{str(name)[:80]!r} is not a valid image name: lower-case letters and digits, words "
                          f"joined by '.', '_' or '-', at most {MAX_IMAGE_NAME} characters (e.g. geo or ml-2025)")
    if name == DEFAULT_IMAGE_NAME:
        raise ConfigError(f"the image name {name!r} is reserved: it asks for the configured image")
    return name


def named_image_tag(name: str, version: str = "latest") -> str:
    """The Docker tag of a named image: its newest build (``latest``) or the build with this inputs hash."""
    return f"{NAMED_IMAGE_PREFIX}{name}:{version}"


def not_allowed(asked: object, allowed: tuple[str, ...]) -> str:
    shown = repr(asked)[:80]
    names = ", ".join(allowed) if allowed else "none"
    return (f"image {shown} is not allowed here: ask for one of the named images the operator allows "
            f"(NBEXEC_IMAGES: {names}), or omit it for the default image. An operator builds one with "
            "`nbexec image build --name NAME` and adds NAME to NBEXEC_IMAGES.")
