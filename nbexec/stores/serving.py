"""How every uploading store serves what it stores.

The rules say which files are downloaded rather than shown, the Content-Type they carry, and how long a link
lives. They also cut secrets from messages and from cloud SDKs' debug logs.

Azure, S3 and GCS apply these rules at upload (object properties) and, where the link can carry them, as
response overrides signed into the link as well.
"""

from __future__ import annotations

import logging
import mimetypes
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from nbexec.errors import ConfigError

# Types a browser runs script in when the file is opened from the storage origin.
ACTIVE_TYPES = frozenset({"text/html", "image/svg+xml", "application/javascript", "text/javascript",
                          "application/xml", "text/xml", "application/xhtml+xml"})
# Served inline: everything else (active, unknown or odd) is sent as an attachment.
PASSIVE_TYPES = frozenset({"text/plain", "text/csv", "application/json", "image/png", "image/jpeg", "image/gif",
                           "image/webp", "application/octet-stream"})
# What an active file is served as: bytes to save, never a document to render.
DOWNLOAD_TYPE = "application/octet-stream"
# A Content-Type header value nbexec passes on: type/subtype with simple parameters, nothing that could end
# the header or start another one.
_SAFE_TYPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]*/[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]*"
                        r"(; ?[A-Za-z0-9_.-]+=[A-Za-z0-9_.-]+)*")

DEFAULT_LINK_EXPIRY_S = 3600.0
# The longest a signed S3 (SigV4) or GCS (V4) link may live: 7 days, the services' own limit.
MAX_SIGNED_LINK_S = 7 * 24 * 3600.0

_SECRET = re.compile(r"(AccountKey=|sig=|SharedAccessSignature=|X-Amz-Signature=|X-Amz-Security-Token=|"
                     r"X-Amz-Credential=|X-Goog-Signature=|X-Goog-Credential=|Signature=|AWSAccessKeyId=|upload_id=|"
                     r"x-amz-security-token[:=]\s*|\bBearer\s+)[^;&\s'\",]+",
                     re.IGNORECASE)


@dataclass(frozen=True)
class Served:
    """The headers a stored object answers with: its Content-Type and Content-Disposition (None: inline)."""

    content_type: str
    disposition: str | None


def _essence(mime: str) -> str:
    return mime.split(";", 1)[0].strip().lower()


def disposition(blob_name: str, content_type: str) -> str | None:
    """``attachment`` unless both the MIME and the type the name's extension implies are passive."""
    guessed = mimetypes.guess_type(blob_name.rsplit("/", 1)[-1], strict=False)[0]
    for mime in (content_type, guessed):
        if mime is not None and (_essence(mime) in ACTIVE_TYPES or _essence(mime) not in PASSIVE_TYPES):
            return "attachment"
    return None


def served(blob_name: str, content_type: str) -> Served:
    """How ``blob_name`` is served.

    Passive types (by MIME and by extension) are served inline as they are. Active ones are an ``attachment`` of
    type application/octet-stream. Anything else is an attachment of its own type. A type that is not a
    well-formed header value is never passed on: it becomes application/octet-stream, as an attachment."""
    safe = _SAFE_TYPE.fullmatch(content_type) is not None
    how = disposition(blob_name, content_type) if safe else "attachment"
    if how is None:
        return Served(content_type, None)
    guessed = mimetypes.guess_type(blob_name.rsplit("/", 1)[-1], strict=False)[0]
    active = any(m is not None and _essence(m) in ACTIVE_TYPES for m in (content_type, guessed))
    return Served(DOWNLOAD_TYPE if active or not safe else content_type, how)


def link_expiry(seconds: float, *, maximum: float | None = None, variable: str = "NBEXEC_LINK_EXPIRY") -> float:
    """``seconds`` when it is a usable link lifetime (above 0, at most ``maximum``), else a ConfigError."""
    if not seconds > 0:
        raise ConfigError(f"{variable} must be above 0 seconds")
    if maximum is not None and seconds > maximum:
        raise ConfigError(f"{variable} is {seconds:g} s; signed links live at most {maximum:g} s (7 days)")
    return seconds


def redact(text: str) -> str:
    """Remove keys and signatures from a message that may quote a connection string or a signed URL."""
    return _SECRET.sub(r"\1<redacted>", text)


class SecretFilter(logging.Filter):
    """Cuts secrets from the records of the loggers it guards, whatever level they are logged at.

    Secrets are the known ones (a store's secret key, session token) and anything behind a key or signature marker."""

    def __init__(self) -> None:
        super().__init__()
        self.secrets: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact(message)
        for secret in self.secrets:
            cleaned = cleaned.replace(secret, "<redacted>")
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return True


_FILTER = SecretFilter()


def guard_logs(loggers: Iterable[str], *secrets: str | None) -> None:
    """Keep ``secrets``, and every marked key or signature, out of what ``loggers`` write.

    Cloud SDKs log signed requests, headers and all, at DEBUG."""
    _FILTER.secrets.update(s for s in secrets if s)
    for name in loggers:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its class name when it has none), redacted."""
    text = str(exc)
    return redact(text.splitlines()[0] if text.strip() else exc.__class__.__name__)


def prefix_from(environ: Mapping[str, str]) -> str:
    """NBEXEC_BLOB_PREFIX: the first part of every object name (default nbexec)."""
    return environ.get("NBEXEC_BLOB_PREFIX") or "nbexec"


def expiry_from(environ: Mapping[str, str], *, older: tuple[str, str | None] | None = None) -> float:
    """NBEXEC_LINK_EXPIRY (or, when unset, the store's ``older`` variable: its name and value) in seconds;
    default 3600."""
    name, text = "NBEXEC_LINK_EXPIRY", environ.get("NBEXEC_LINK_EXPIRY") or ""
    if not text and older:
        name, text = older[0], older[1] or ""
    try:
        return float(text) if text else DEFAULT_LINK_EXPIRY_S
    except ValueError as exc:
        raise ConfigError(f"{name} must be a number of seconds, not {text!r}") from exc
