"""A private blob space: put, get (capped), list and delete blobs of one Azure container, S3 or GCS bucket, for
snapshots shared by nodes.

Unlike an artifact store nothing here makes a link: these blobs are never served. What is read is hostile (whoever
can write the container can change it), so `get` is capped by the caller's limit twice: by the blob's size before
a byte is read, and by a ranged read of at most ``limit + 1`` bytes (a blob that grew between the two lookups
still cannot send more), streamed in chunks of `CHUNK`. Listing stops at `MAX_LISTED` names. Secrets (connection
strings, account keys) never appear in reprs, logs or errors.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, BinaryIO, Protocol

from nbexec.errors import StorageError

from .gcs import GCSStore
from .s3 import S3Store
from .serving import first_line
from .storage import AzureBlobSettings, azure_service

CHUNK = 1 << 20  # the most one read of a blob holds in memory
MAX_LISTED = 10_000


class BlobSpace(Protocol):
    """Blobs by name in one private container."""

    kind: str

    def put(self, name: str, content: BinaryIO, length: int) -> None:
        """Store ``length`` bytes read from ``content`` as a new blob ``name`` (StorageError if it exists)."""

    def get(self, name: str, limit: int) -> Iterator[bytes]:
        """The bytes of blob ``name`` in chunks; StorageError when it is missing or holds more than ``limit``."""

    def names(self, prefix: str) -> list[str]:
        """The names of the blobs that start with ``prefix`` (StorageError past `MAX_LISTED`)."""

    def folders(self, prefix: str) -> list[str]:
        """The next name parts (up to a ``/``) below ``prefix``: its sub-folders (StorageError past `MAX_LISTED`)."""

    def delete(self, name: str) -> None:
        """Remove blob ``name`` (nothing when it is already gone)."""


def _admitted(name: str, size: int, limit: int) -> bool:
    """Whether blob ``name`` of ``size`` bytes is worth reading (StorageError past ``limit``, before a byte)."""
    if size > limit:
        raise StorageError(f"{name} holds {size} bytes, more than the {limit} it may")
    return size > 0


def _folders(prefix: str, found: list[str]) -> list[str]:
    """The folder names (``<prefix><name>/``) of a delimited listing, without the prefix and the slash."""
    names = [f[len(prefix):-1] for f in found if f.startswith(prefix) and f.endswith("/")]
    if len(names) > MAX_LISTED:
        raise StorageError(f"more than {MAX_LISTED} folders start with {prefix}")
    return names


class AzureBlobSpace:
    """One Azure Blob container (made on the first put; reads never make it)."""

    kind = "azure"

    def __init__(self, settings: AzureBlobSettings) -> None:
        self.settings = settings
        self._container: Any = None
        self._made = False
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"AzureBlobSpace(account={self.settings.account!r}, container={self.settings.container!r})"

    def _client(self) -> Any:
        with self._lock:
            if self._container is None:
                service = azure_service(self.settings, max_single_get_size=CHUNK, max_chunk_get_size=CHUNK)
                self._container = service.get_container_client(self.settings.container)
            return self._container

    def _failed(self, what: str, exc: Exception) -> StorageError:
        return StorageError(f"{what} in Azure Blob Storage (container {self.settings.container}) failed: "
                            f"{first_line(exc)}")

    def put(self, name: str, content: BinaryIO, length: int) -> None:
        from azure.core.exceptions import AzureError, ResourceExistsError

        try:
            if not self._made:
                with contextlib.suppress(ResourceExistsError):
                    self._client().create_container()
                self._made = True
            self._client().upload_blob(name, content, length=length, overwrite=False)
        except AzureError as exc:
            raise self._failed(f"storing {name}", exc) from exc

    def get(self, name: str, limit: int) -> Iterator[bytes]:
        from azure.core.exceptions import AzureError

        try:
            client = self._client().get_blob_client(name)
            if not _admitted(name, int(client.get_blob_properties().size), limit):
                return
            yield from client.download_blob(offset=0, length=limit + 1, max_concurrency=1).chunks()
        except AzureError as exc:
            raise self._failed(f"reading {name}", exc) from exc

    def names(self, prefix: str) -> list[str]:
        from azure.core.exceptions import AzureError, ResourceNotFoundError

        found: list[str] = []
        try:
            for item in self._client().list_blobs(name_starts_with=prefix):
                if len(found) >= MAX_LISTED:
                    raise StorageError(f"more than {MAX_LISTED} blobs start with {prefix}")
                found.append(str(item.name))
        except ResourceNotFoundError:
            return []
        except AzureError as exc:
            raise self._failed(f"listing {prefix}", exc) from exc
        return found

    def folders(self, prefix: str) -> list[str]:
        from azure.core.exceptions import AzureError, ResourceNotFoundError

        try:
            found = [str(item.name) for item in self._client().walk_blobs(name_starts_with=prefix, delimiter="/")]
        except ResourceNotFoundError:
            return []
        except AzureError as exc:
            raise self._failed(f"listing {prefix}", exc) from exc
        return _folders(prefix, found)

    def delete(self, name: str) -> None:
        from azure.core.exceptions import AzureError, ResourceNotFoundError

        try:
            self._client().delete_blob(name)
        except ResourceNotFoundError:
            pass
        except AzureError as exc:
            raise self._failed(f"removing {name}", exc) from exc


class S3BlobSpace:
    """One existing S3 bucket (nbexec makes none), through the S3 artifact store's client (multipart uploads)."""

    kind = "s3"

    def __init__(self, store: S3Store) -> None:
        self.store = store
        self.bucket = store.settings.bucket

    def __repr__(self) -> str:
        return f"S3BlobSpace(bucket={self.bucket!r}, endpoint={self.store.settings.endpoint_url or 'aws'!r})"

    def _failed(self, what: str, exc: Exception) -> StorageError:
        return StorageError(f"{what} in S3 (bucket {self.bucket}) failed: {first_line(exc)}")

    def put(self, name: str, content: BinaryIO, length: int) -> None:
        self.store.upload(name, content, "application/octet-stream", length=length)

    def get(self, name: str, limit: int) -> Iterator[bytes]:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            client = self.store.client()
            if not _admitted(name, int(client.head_object(Bucket=self.bucket, Key=name)["ContentLength"]), limit):
                return
            body = client.get_object(Bucket=self.bucket, Key=name, Range=f"bytes=0-{limit}")["Body"]
            try:
                yield from body.iter_chunks(CHUNK)
            finally:
                body.close()
        except (BotoCoreError, ClientError) as exc:
            raise self._failed(f"reading {name}", exc) from exc

    def names(self, prefix: str) -> list[str]:
        from botocore.exceptions import BotoCoreError, ClientError

        found: list[str] = []
        try:
            for page in self.store.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                                       Prefix=prefix):
                found.extend(str(item["Key"]) for item in page.get("Contents", []))
                if len(found) > MAX_LISTED:
                    raise StorageError(f"more than {MAX_LISTED} blobs start with {prefix}")
        except ClientError as exc:
            if str(exc.response.get("Error", {}).get("Code")) in ("NoSuchBucket", "404"):
                return []
            raise self._failed(f"listing {prefix}", exc) from exc
        except BotoCoreError as exc:
            raise self._failed(f"listing {prefix}", exc) from exc
        return found

    def folders(self, prefix: str) -> list[str]:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            pages = self.store.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix,
                                                                                  Delimiter="/")
            found = [str(p["Prefix"]) for page in pages for p in page.get("CommonPrefixes", [])]
        except ClientError as exc:
            if str(exc.response.get("Error", {}).get("Code")) in ("NoSuchBucket", "404"):
                return []
            raise self._failed(f"listing {prefix}", exc) from exc
        except BotoCoreError as exc:
            raise self._failed(f"listing {prefix}", exc) from exc
        return _folders(prefix, found)

    def delete(self, name: str) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.store.client().delete_object(Bucket=self.bucket, Key=name)
        except (BotoCoreError, ClientError) as exc:
            raise self._failed(f"removing {name}", exc) from exc


class GCSBlobSpace:
    """One existing Google Cloud Storage bucket (nbexec makes none), through the GCS artifact store's client;
    reads are ranged requests of at most `CHUNK` bytes each, never past the limit."""

    kind = "gcs"

    def __init__(self, store: GCSStore) -> None:
        self.store = store
        self.bucket = store.settings.bucket

    def __repr__(self) -> str:
        return f"GCSBlobSpace(bucket={self.bucket!r}, endpoint={self.store.settings.emulator_host or 'google'!r})"

    def _failed(self, what: str, exc: Exception) -> StorageError:
        return StorageError(f"{what} in Google Cloud Storage (bucket {self.bucket}) failed: {first_line(exc)}")

    def put(self, name: str, content: BinaryIO, length: int) -> None:
        self.store.upload(name, content, "application/octet-stream", length=length)

    def get(self, name: str, limit: int) -> Iterator[bytes]:
        from google.api_core.exceptions import GoogleAPIError

        try:
            blob = self.store.client().bucket(self.bucket).get_blob(name)
            if blob is None:
                raise StorageError(f"no blob {name}")
            size = int(blob.size or 0)
            if not _admitted(name, size, limit):
                return
            for start in range(0, min(size, limit + 1), CHUNK):
                end = min(start + CHUNK, size, limit + 1) - 1
                yield bytes(blob.download_as_bytes(start=start, end=end, checksum=None))
        except GoogleAPIError as exc:
            raise self._failed(f"reading {name}", exc) from exc

    def names(self, prefix: str) -> list[str]:
        from google.api_core.exceptions import GoogleAPIError, NotFound

        found: list[str] = []
        try:
            for item in self.store.client().list_blobs(self.bucket, prefix=prefix):
                if len(found) >= MAX_LISTED:
                    raise StorageError(f"more than {MAX_LISTED} blobs start with {prefix}")
                found.append(str(item.name))
        except NotFound:
            return []
        except GoogleAPIError as exc:
            raise self._failed(f"listing {prefix}", exc) from exc
        return found

    def folders(self, prefix: str) -> list[str]:
        from google.api_core.exceptions import GoogleAPIError, NotFound

        try:
            listing = self.store.client().list_blobs(self.bucket, prefix=prefix, delimiter="/")
            for _ in listing.pages:
                pass  # the folders arrive with the pages
            found = [str(p) for p in listing.prefixes]
        except NotFound:
            return []
        except GoogleAPIError as exc:
            raise self._failed(f"listing {prefix}", exc) from exc
        return _folders(prefix, found)

    def delete(self, name: str) -> None:
        from google.api_core.exceptions import GoogleAPIError, NotFound

        try:
            self.store.client().bucket(self.bucket).blob(name).delete()
        except NotFound:
            pass
        except GoogleAPIError as exc:
            raise self._failed(f"removing {name}", exc) from exc
