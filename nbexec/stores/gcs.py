"""Artifacts in a Google Cloud Storage bucket, read through V4 signed GET links.

The bucket is the operator's and stays as it is: nbexec creates no bucket and sets no ACL (no predefined ACL on
upload), so objects are as private as the bucket. Uploads stream as resumable uploads in chunks of
`GCSSettings.chunk_size` (one chunk in memory at a time); links are V4 signed URLs of one object, signed with the
service-account key of GOOGLE_APPLICATION_CREDENTIALS, ending after the link lifetime. The key never appears in
reprs, logs or error messages.
"""

from __future__ import annotations

import datetime as dt
import io
import logging
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from nbexec.errors import ConfigError, StorageError

from . import serving

log = logging.getLogger(__name__)

_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")
_SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"
# Loggers that may write tokens or resumable-upload URLs (a write capability until the upload ends) at DEBUG.
_LOGGERS = ("google.auth.transport.requests", "google.auth._helpers", "google.cloud.storage",
            "google.resumable_media", "urllib3.connectionpool")


@dataclass(frozen=True, kw_only=True)
class GCSSettings:
    """How to reach one bucket and sign links to its objects."""

    bucket: str
    prefix: str = "nbexec"
    credentials_file: str | None = None  # GOOGLE_APPLICATION_CREDENTIALS: a service-account key; unset: ADC
    emulator_host: str | None = None  # STORAGE_EMULATOR_HOST, e.g. http://127.0.0.1:9023 (no auth is sent there)
    link_expiry_s: float = serving.DEFAULT_LINK_EXPIRY_S  # how long a signed link reads its object
    chunk_size: int = 8 * 1024**2  # resumable upload chunks (a multiple of 256 KiB), one in memory at a time
    timeout_s: float = 20.0

    def __post_init__(self) -> None:
        if not self.bucket:
            raise ConfigError("GCS uploads need NBEXEC_GCS_BUCKET, an existing bucket (see .env.example)")
        if not _BUCKET.fullmatch(self.bucket) or ".." in self.bucket:
            raise ConfigError(f"{self.bucket!r} is not a valid GCS bucket name (lowercase letters, digits, dots, "
                              "hyphens and underscores)")
        if self.chunk_size <= 0 or self.chunk_size % (256 * 1024):
            raise ConfigError("GCS upload chunks must be a positive multiple of 256 KiB")
        serving.link_expiry(self.link_expiry_s, maximum=serving.MAX_SIGNED_LINK_S)


def _google() -> tuple[Any, Any]:
    try:
        import google.auth
        from google.cloud import storage
    except ImportError as exc:
        raise ConfigError("GCS uploads need the gcs extra: pip install 'nbexec-sandbox[gcs]'") from exc
    return google.auth, storage


class GCSStore:
    """Uploads to one existing bucket and returns V4 signed read-only links."""

    kind = "gcs"

    def __init__(self, settings: GCSSettings) -> None:
        self.settings = settings
        self._signer: Any = None
        self._storage: Any = None
        self._lock = threading.Lock()

    @property
    def prefix(self) -> str:
        return self.settings.prefix

    def __repr__(self) -> str:
        return f"GCSStore(bucket={self.settings.bucket!r}, endpoint={self.settings.emulator_host or 'google'!r})"

    def _where(self) -> str:
        return f"Google Cloud Storage (bucket {self.settings.bucket} at {self.settings.emulator_host or 'Google'})"

    def _credentials(self) -> Any:
        """The credentials that sign links (and, on Google, make the calls): a key that can sign, or ConfigError."""
        google_auth, _ = _google()
        from google.auth.credentials import Signing
        from google.auth.exceptions import GoogleAuthError
        from google.oauth2 import service_account

        path = self.settings.credentials_file
        try:
            if path:
                credentials = service_account.Credentials.from_service_account_file(path, scopes=[_SCOPE])
            else:
                credentials, _ = google_auth.default(scopes=[_SCOPE])
        except OSError as exc:
            raise ConfigError(f"cannot read GOOGLE_APPLICATION_CREDENTIALS ({path}): {exc.strerror}") from exc
        except (ValueError, KeyError, GoogleAuthError) as exc:  # not JSON, not a key, a malformed key
            raise ConfigError(f"GOOGLE_APPLICATION_CREDENTIALS ({path or 'default credentials'}) is not a usable "
                              f"service-account key: {serving.first_line(exc)}") from exc
        if not isinstance(credentials, Signing):
            raise ConfigError("signed GCS links need a service-account key: set GOOGLE_APPLICATION_CREDENTIALS to "
                              "its JSON file (the default credentials found cannot sign)")
        return credentials

    def _client(self) -> tuple[Any, Any]:
        """(the storage client, the signing credentials), made once."""
        with self._lock:
            if self._storage is None:
                _, storage = _google()
                serving.guard_logs(_LOGGERS)
                signer = self._credentials()
                if self.settings.emulator_host:
                    from google.auth.credentials import AnonymousCredentials

                    client = storage.Client(project="nbexec", credentials=AnonymousCredentials(),
                                            client_options={"api_endpoint": self.settings.emulator_host})
                else:
                    client = storage.Client(project=getattr(signer, "project_id", None), credentials=signer)
                self._storage, self._signer = client, signer
            return self._storage, self._signer

    def client(self) -> Any:
        """The storage client of this store (made once; tokens kept out of its logs)."""
        return self._client()[0]

    def check(self) -> None:
        """Reach the bucket now, before any code runs: a missing extra, an unusable key, refused credentials and
        a missing bucket raise ConfigError; a service that does not answer StorageError."""
        client, _ = self._client()
        from google.api_core import exceptions as api
        from google.auth.exceptions import RefreshError, TransportError
        from google.cloud.storage.retry import DEFAULT_RETRY
        from requests import RequestException

        # objects.list: the permission an uploader has (buckets.get often is not granted). Retried for at most
        # timeout_s in all: the client's default retries an unreachable endpoint for two minutes before it says so.
        retry = DEFAULT_RETRY.with_timeout(self.settings.timeout_s)
        try:
            list(client.list_blobs(self.settings.bucket, max_results=1, timeout=self.settings.timeout_s, retry=retry))
        except api.NotFound as exc:
            raise ConfigError(f"{self._where()}: the bucket does not exist. Create it (private; nbexec sets no "
                              "ACL) or set NBEXEC_GCS_BUCKET to an existing one.") from exc
        except (api.Unauthorized, api.Forbidden, RefreshError) as exc:
            raise ConfigError(f"{self._where()} refused the credentials: {serving.first_line(exc)} Check "
                              "GOOGLE_APPLICATION_CREDENTIALS and the key's access to the bucket.") from exc
        except (api.GoogleAPIError, TransportError, RequestException) as exc:
            raise StorageError(f"{self._where()} is not reachable: {serving.first_line(exc)}. Check "
                               "STORAGE_EMULATOR_HOST (or the network) and that the service runs.") from exc

    def upload(self, blob_name: str, content: bytes | BinaryIO, content_type: str, *,
               length: int | None = None) -> str:
        from google.api_core.exceptions import GoogleAPIError
        from google.auth.exceptions import GoogleAuthError
        from google.resumable_media.common import InvalidResponse
        from requests import RequestException

        how = serving.served(blob_name, content_type)
        stream = io.BytesIO(content) if isinstance(content, bytes) else _Forward(content)
        size = len(content) if isinstance(content, bytes) else length
        client, _ = self._client()
        blob = client.bucket(self.settings.bucket).blob(blob_name, chunk_size=self.settings.chunk_size)
        blob.content_disposition = how.disposition  # stored: what every GET of the object answers with
        try:
            blob.upload_from_file(stream, size=size, content_type=how.content_type, timeout=self.settings.timeout_s)
            return self._link(blob, how)
        except StorageError:
            raise  # the stream's own verdict (a file that changed), not the service's
        except (GoogleAPIError, GoogleAuthError, InvalidResponse, RequestException, ValueError) as exc:
            cause = exc.__cause__ or exc.__context__
            if isinstance(cause, StorageError):
                raise StorageError(str(cause)) from exc
            raise StorageError(f"upload of {blob_name} failed: {serving.first_line(exc)}") from exc

    def _link(self, blob: Any, how: serving.Served) -> str:
        _, signer = self._client()
        options: dict[str, Any] = {}
        if self.settings.emulator_host:
            options["api_access_endpoint"] = self.settings.emulator_host
        if how.disposition:  # signed into the link too: the response answers with them whatever is stored
            options |= {"response_disposition": how.disposition, "response_type": how.content_type}
        return str(blob.generate_signed_url(version="v4", method="GET", credentials=signer,
                                            expiration=dt.timedelta(seconds=self.settings.link_expiry_s),
                                            **options))

    def local_url(self, path: Any) -> str | None:
        return None


class _Forward(io.RawIOBase):
    """A stream read once, front to back, with the position a resumable upload asks for: it may "seek" only to
    where it already is (after each chunk the service acknowledges); a rewind fails the upload rather than
    re-reading a file that may have changed."""

    def __init__(self, stream: BinaryIO) -> None:
        self._stream, self._position = stream, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        target = {io.SEEK_SET: offset, io.SEEK_CUR: self._position + offset}.get(whence)
        if target != self._position:
            raise StorageError("the upload needed the file again from an earlier point; it was not re-read")
        return self._position

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(size)
        self._position += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def from_env(environ: Mapping[str, str]) -> GCSStore:
    """A GCS store from NBEXEC_GCS_BUCKET (required), GOOGLE_APPLICATION_CREDENTIALS (a service-account key file;
    unset: application default credentials, which must be able to sign), STORAGE_EMULATOR_HOST (an emulator),
    NBEXEC_BLOB_PREFIX and NBEXEC_LINK_EXPIRY."""
    return GCSStore(GCSSettings(
        bucket=environ.get("NBEXEC_GCS_BUCKET") or "",
        prefix=serving.prefix_from(environ),
        credentials_file=environ.get("GOOGLE_APPLICATION_CREDENTIALS") or None,
        emulator_host=environ.get("STORAGE_EMULATOR_HOST") or None,
        link_expiry_s=serving.expiry_from(environ),
    ))
