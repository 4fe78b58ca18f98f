"""Where produced files and images go: a local folder (the default), Azure Blob Storage with read-only SAS links, or
(`s3`, `gcs`) an S3-compatible bucket or Google Cloud Storage with signed read-only links; `from_env` picks one.

Uploads never lose anything: a file that cannot be uploaded stays on disk and its status in the result says why.
Secrets (connection strings, account keys, SAS tokens) never appear in reprs, logs or error messages.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol
from urllib.parse import quote

from nbexec.errors import ConfigError, StorageError

from .serving import DEFAULT_LINK_EXPIRY_S, expiry_from, first_line, link_expiry, prefix_from, served

log = logging.getLogger(__name__)


class ArtifactStore(Protocol):
    """Something that turns a produced file into a link."""

    kind: str

    @property
    def prefix(self) -> str:
        """The first part of every blob name."""

    def upload(self, blob_name: str, content: bytes | BinaryIO, content_type: str, *,
               length: int | None = None) -> str:
        """Store ``content`` (bytes, or a stream of ``length`` bytes read in chunks) under ``blob_name`` and
        return a URL to read it; raise StorageError on failure."""

    def local_url(self, path: Path) -> str | None:
        """The URL of a file kept on disk (the local store), or None when the store uploads."""

    def check(self) -> None:
        """Reach the store now, before any code runs: ConfigError for what the user must fix (a missing extra,
        refused credentials, no such bucket), StorageError for a service that does not answer."""


class LocalStore:
    """Files stay in the run's output folder; their URL is the file:// URL of their absolute path."""

    kind = "local"

    @property
    def prefix(self) -> str:
        return "nbexec"

    def __repr__(self) -> str:
        return "LocalStore()"

    def upload(self, blob_name: str, content: bytes | BinaryIO, content_type: str, *,
               length: int | None = None) -> str:  # pragma: no cover - unused
        raise StorageError("the local store keeps files where they are")

    def local_url(self, path: Path) -> str | None:
        return Path(path).absolute().as_uri()

    def check(self) -> None:
        """Nothing to reach: files stay where they are."""


@dataclass(frozen=True, kw_only=True)
class AzureBlobSettings:
    """How to reach a blob container. Give a connection string, or an account name (with a key, or with
    azure-identity's DefaultAzureCredential and a user-delegation SAS when there is no key)."""

    connection_string: str | None = field(default=None, repr=False)
    account_name: str | None = None
    account_key: str | None = field(default=None, repr=False)
    container: str = "nbexec"
    prefix: str = "nbexec"
    sas_expiry_s: float = DEFAULT_LINK_EXPIRY_S
    retries: int = 3
    timeout_s: float = 20.0

    def __post_init__(self) -> None:
        if not self.connection_string and not self.account_name:
            raise ConfigError("Azure Blob Storage needs AZURE_STORAGE_CONNECTION_STRING or AZURE_STORAGE_ACCOUNT_NAME "
                              "(see .env.example)")
        if not re.fullmatch(r"[a-z0-9](?!.*--)[a-z0-9-]{1,61}[a-z0-9]", self.container):
            raise ConfigError(f"{self.container!r} is not a valid blob container name (3-63 lowercase letters, "
                              "digits and single hyphens)")
        link_expiry(self.sas_expiry_s, variable="the SAS expiry (NBEXEC_LINK_EXPIRY)")

    @property
    def account(self) -> str:
        """The account's name: given, or read from the connection string ("" when neither says)."""
        if self.account_name:
            return self.account_name
        parts = dict(p.split("=", 1) for p in (self.connection_string or "").split(";") if "=" in p)
        return parts.get("AccountName", "")


def _azure() -> Any:
    try:
        import azure.storage.blob as blob
    except ImportError as exc:
        raise ConfigError("Azure Blob Storage needs the azure extra: pip install 'nbexec-sandbox[azure]'") from exc
    return blob


def azure_service(settings: AzureBlobSettings, **options: Any) -> Any:
    """A BlobServiceClient for ``settings`` with nbexec's retries and timeouts (``options`` added to them): the
    connection string, else the account URL with its key or azure-identity's DefaultAzureCredential."""
    blob = _azure()
    retry = blob.ExponentialRetry(initial_backoff=1, increment_base=2, retry_total=settings.retries,
                                  random_jitter_range=1)
    options = {"retry_policy": retry, "connection_timeout": settings.timeout_s, "read_timeout": settings.timeout_s,
               **options}
    if settings.connection_string:
        return blob.BlobServiceClient.from_connection_string(settings.connection_string, **options)
    url = f"https://{settings.account_name}.blob.core.windows.net"
    return blob.BlobServiceClient(url, credential=_credential(settings), **options)


def _credential(settings: AzureBlobSettings) -> Any:
    if settings.account_key:
        return {"account_name": settings.account_name, "account_key": settings.account_key}
    try:
        from azure.identity import DefaultAzureCredential
    except ImportError as exc:
        raise ConfigError("without AZURE_STORAGE_ACCOUNT_KEY, Azure Blob Storage needs azure-identity "
                          "(pip install 'nbexec-sandbox[azure]') for DefaultAzureCredential") from exc
    return DefaultAzureCredential()


class AzureBlobStore:
    """Uploads to one container (created when missing) and returns read-only SAS URLs."""

    kind = "azure"

    def __init__(self, settings: AzureBlobSettings) -> None:
        self.settings = settings
        self._service: Any = None
        self._container_ready = False
        self._delegation_key: Any = None
        self._delegation_key_expires = dt.datetime.min.replace(tzinfo=dt.timezone.utc)
        self._lock = threading.Lock()

    @property
    def prefix(self) -> str:
        return self.settings.prefix

    def __repr__(self) -> str:
        return f"AzureBlobStore(account={self.settings.account!r}, container={self.settings.container!r})"

    def _client(self) -> Any:
        with self._lock:
            if self._service is None:
                self._service = azure_service(self.settings)
            return self._service

    def _account_key(self) -> str | None:
        if self.settings.account_key:
            return self.settings.account_key
        parts = dict(p.split("=", 1) for p in (self.settings.connection_string or "").split(";") if "=" in p)
        return parts.get("AccountKey")

    def _sas(self, blob_name: str) -> str:
        blob = _azure()
        now = dt.datetime.now(dt.timezone.utc)
        expiry = now + dt.timedelta(seconds=self.settings.sas_expiry_s)
        common = {"account_name": self.settings.account, "container_name": self.settings.container,
                  "blob_name": blob_name, "permission": blob.BlobSasPermissions(read=True), "expiry": expiry,
                  "start": now - dt.timedelta(minutes=5)}
        key = self._account_key()
        if key:
            return str(blob.generate_blob_sas(account_key=key, **common))
        with self._lock:
            if self._delegation_key is None or self._delegation_key_expires <= expiry:
                self._delegation_key_expires = now + dt.timedelta(days=1)
                self._delegation_key = self._client().get_user_delegation_key(now, self._delegation_key_expires)
        return str(blob.generate_blob_sas(user_delegation_key=self._delegation_key, **common))

    def check(self) -> None:
        """Reach the container now (made when missing), before any code runs: a missing extra or bad settings
        raise ConfigError, an unreachable service StorageError; each says what to do."""
        _azure()
        from azure.core.exceptions import AzureError, HttpResponseError

        where = f"Azure Blob Storage (account {self.settings.account or '?'}, container {self.settings.container})"
        try:
            self._ensure_container()
        except HttpResponseError as exc:
            if exc.status_code in (401, 403):
                raise ConfigError(f"{where} refused the credentials: {first_line(exc)} Check "
                                  "AZURE_STORAGE_CONNECTION_STRING or AZURE_STORAGE_ACCOUNT_KEY.") from exc
            raise ConfigError(f"{where} answered {exc.status_code}: {first_line(exc)}") from exc
        except (AzureError, ValueError) as exc:  # ValueError: a malformed connection string or account URL
            raise StorageError(f"{where} is not reachable: {first_line(exc)}. Check the endpoint in "
                               "AZURE_STORAGE_CONNECTION_STRING and that the service runs.") from exc

    def _ensure_container(self) -> None:
        if self._container_ready:
            return
        from azure.core.exceptions import ResourceExistsError

        with contextlib.suppress(ResourceExistsError):
            self._client().create_container(self.settings.container)
        self._container_ready = True

    def upload(self, blob_name: str, content: bytes | BinaryIO, content_type: str, *,
               length: int | None = None) -> str:
        from azure.core.exceptions import AzureError

        blob = _azure()
        try:
            self._ensure_container()
            client = self._client().get_blob_client(self.settings.container, blob_name)
            # Blob properties are what a SAS download answers with: HTML, SVG, scripts and XML are downloaded,
            # never rendered on the storage origin.
            how = served(blob_name, content_type)
            settings = blob.ContentSettings(content_type=how.content_type, content_disposition=how.disposition)
            client.upload_blob(content, length=length, overwrite=True, content_settings=settings)
            return f"{client.url}?{self._sas(blob_name)}"
        except AzureError as exc:
            raise StorageError(f"upload of {blob_name} failed: {first_line(exc)}") from exc

    def local_url(self, path: Path) -> str | None:
        return None


def blob_name(prefix: str, execution_id: str, relative: str) -> str:
    """``<prefix>/<execution-id>/<relative-path>``, each path segment percent-encoded where a blob name would
    be ambiguous."""
    segments = [s for s in relative.split("/") if s not in ("", ".", "..")]
    return "/".join([prefix.strip("/"), execution_id, *(quote(s, safe=" !$&'()*+,;=@-._~") for s in segments)])


STORES = ("local", "azure", "s3", "gcs")


def from_env(kind: str = "local", environ: Mapping[str, str] | None = None) -> ArtifactStore:
    """The artifact store named ``kind`` (one of `STORES`), configured from the environment (see .env.example).

    Every uploading store reads NBEXEC_BLOB_PREFIX (object names are ``<prefix>/<execution-id>/<path>``, default
    nbexec) and NBEXEC_LINK_EXPIRY (seconds a read-only link lives, default 3600). Azure reads
    AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY (without a key,
    DefaultAzureCredential), AZURE_BLOB_CONTAINER_NAME (default nbexec) and NBEXEC_SAS_EXPIRY (the older name of
    NBEXEC_LINK_EXPIRY); S3 and GCS: see `nbexec.stores.s3.from_env` and `nbexec.stores.gcs.from_env`.
    """
    environ = os.environ if environ is None else environ
    if kind == "local":
        return LocalStore()
    if kind == "s3":
        from . import s3

        return s3.from_env(environ)
    if kind == "gcs":
        from . import gcs

        return gcs.from_env(environ)
    if kind != "azure":
        raise ConfigError(f"unknown store {kind!r}: use one of {', '.join(STORES)}")
    return AzureBlobStore(AzureBlobSettings(
        connection_string=environ.get("AZURE_STORAGE_CONNECTION_STRING") or None,
        account_name=environ.get("AZURE_STORAGE_ACCOUNT_NAME") or None,
        account_key=environ.get("AZURE_STORAGE_ACCOUNT_KEY") or None,
        container=environ.get("AZURE_BLOB_CONTAINER_NAME") or "nbexec",
        prefix=prefix_from(environ),
        sas_expiry_s=expiry_from(environ, older=("NBEXEC_SAS_EXPIRY", environ.get("NBEXEC_SAS_EXPIRY"))),
    ))
