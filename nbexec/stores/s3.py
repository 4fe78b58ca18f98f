"""Artifacts in an S3-compatible bucket (AWS S3, MinIO, R2, Ceph...), read through presigned GET links.

The bucket is the operator's and stays as it is: nbexec creates no bucket and sets no ACL or policy, so objects
are private unless the bucket itself says otherwise. Uploads stream (multipart past `S3Settings.part_size`, one
part in memory at a time); a link is a SigV4 presigned GET of one object that ends after the link lifetime.
Secrets (secret key, session token, signatures) never appear in reprs, logs or error messages.
"""

from __future__ import annotations

import io
import logging
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from nbexec.errors import ConfigError, StorageError

from . import serving

log = logging.getLogger(__name__)

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_REFUSED = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken", "ExpiredToken",
            "InvalidClientTokenId", "AuthorizationHeaderMalformed", "403", "401"}
_MISSING = {"NoSuchBucket", "404", "NotFound"}
# botocore's loggers that write signed requests (headers, canonical requests) or credentials at DEBUG.
_LOGGERS = ("botocore.auth", "botocore.endpoint", "botocore.hooks", "botocore.awsrequest", "botocore.httpsession",
            "botocore.credentials", "botocore.parsers", "botocore.retryhandler", "urllib3.connectionpool")


@dataclass(frozen=True, kw_only=True)
class S3Settings:
    """How to reach one bucket. Without a key pair, boto3's own chain finds credentials (a profile, a role)."""

    bucket: str
    prefix: str = "nbexec"
    region: str | None = None  # AWS_REGION / AWS_DEFAULT_REGION; us-east-1 when unset
    endpoint_url: str | None = None  # AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL: an S3-compatible server
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)  # temporary credentials: links die with them
    link_expiry_s: float = serving.DEFAULT_LINK_EXPIRY_S  # how long a presigned link reads its object
    addressing_style: str = "auto"  # path: http://endpoint/bucket/key, as many S3-compatible servers need
    part_size: int = 8 * 1024**2  # multipart past this size, in parts of this size (one in memory at a time)
    retries: int = 3
    timeout_s: float = 20.0

    def __post_init__(self) -> None:
        if not self.bucket:
            raise ConfigError("S3 uploads need NBEXEC_S3_BUCKET, an existing bucket (see .env.example)")
        if not _BUCKET.fullmatch(self.bucket) or ".." in self.bucket:
            raise ConfigError(f"{self.bucket!r} is not a valid S3 bucket name (3-63 lowercase letters, digits, "
                              "dots and hyphens)")
        if bool(self.access_key_id) != bool(self.secret_access_key):
            raise ConfigError("set both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or neither (boto3's chain)")
        if self.addressing_style not in ("auto", "path", "virtual"):
            raise ConfigError("NBEXEC_S3_ADDRESSING_STYLE must be auto, path or virtual")
        if self.part_size < 5 * 1024**2:
            raise ConfigError("S3 multipart parts must be at least 5 MiB")
        serving.link_expiry(self.link_expiry_s, maximum=serving.MAX_SIGNED_LINK_S)


def _boto() -> tuple[Any, Any, Any]:
    try:
        import boto3
        import boto3.s3.transfer
        import botocore.config
    except ImportError as exc:
        raise ConfigError("S3 uploads need the s3 extra: pip install 'nbexec-sandbox[s3]'") from exc
    return boto3, boto3.s3.transfer, botocore.config


class S3Store:
    """Uploads to one existing bucket and returns presigned read-only links."""

    kind = "s3"

    def __init__(self, settings: S3Settings) -> None:
        self.settings = settings
        self._s3: Any = None
        self._lock = threading.Lock()

    @property
    def prefix(self) -> str:
        return self.settings.prefix

    def __repr__(self) -> str:
        return f"S3Store(bucket={self.settings.bucket!r}, endpoint={self.settings.endpoint_url or 'aws'!r})"

    def _client(self) -> Any:
        with self._lock:
            if self._s3 is None:
                boto3, _, config = _boto()
                from botocore.exceptions import ProfileNotFound

                s = self.settings
                serving.guard_logs(_LOGGERS, s.secret_access_key, s.session_token)
                options = config.Config(
                    signature_version="s3v4", s3={"addressing_style": s.addressing_style},
                    retries={"max_attempts": s.retries, "mode": "standard"}, connect_timeout=s.timeout_s,
                    read_timeout=s.timeout_s,
                    # Checksums only where S3 requires them: many S3-compatible servers refuse the trailers.
                    request_checksum_calculation="when_required", response_checksum_validation="when_required")
                try:
                    session = boto3.session.Session(aws_access_key_id=s.access_key_id,
                                                    aws_secret_access_key=s.secret_access_key,
                                                    aws_session_token=s.session_token,
                                                    region_name=s.region or "us-east-1")
                    self._s3 = session.client("s3", endpoint_url=s.endpoint_url, config=options)
                except ProfileNotFound as exc:
                    raise ConfigError(f"{serving.first_line(exc)}: check AWS_PROFILE") from exc
                except ValueError as exc:  # a malformed endpoint URL
                    raise ConfigError(f"AWS_ENDPOINT_URL_S3 is not usable: {serving.first_line(exc)}") from exc
            return self._s3

    def client(self) -> Any:
        """The boto3 S3 client of this store (made once; secrets kept out of its logs)."""
        return self._client()

    def _where(self) -> str:
        return f"S3 (bucket {self.settings.bucket} at {self.settings.endpoint_url or 'AWS'})"

    def check(self) -> None:
        """Reach the bucket now, before any code runs: a missing extra, absent or refused credentials and a
        missing bucket raise ConfigError; a service that does not answer StorageError. Each says what to do."""
        client = self._client()
        from botocore import exceptions as aws

        try:
            client.head_bucket(Bucket=self.settings.bucket)
        except (aws.NoCredentialsError, aws.PartialCredentialsError) as exc:
            raise ConfigError(f"{self._where()}: no credentials ({serving.first_line(exc)}). Set AWS_ACCESS_KEY_ID and "
                              "AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary ones).") from exc
        except aws.ClientError as exc:
            raise self._refusal(exc) from exc
        except aws.BotoCoreError as exc:
            raise StorageError(f"{self._where()} is not reachable: {serving.first_line(exc)}. Check "
                               "AWS_ENDPOINT_URL_S3 and that the service runs.") from exc

    def _refusal(self, exc: Any) -> ConfigError:
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in _REFUSED or status in (401, 403):
            return ConfigError(f"{self._where()} refused the credentials ({status} {code}). Check "
                               "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN, and that they may "
                               "read and write the bucket.")
        if code in _MISSING or status == 404:
            return ConfigError(f"{self._where()}: the bucket does not exist. Create it (private; nbexec sets no "
                               "ACL or policy) or set NBEXEC_S3_BUCKET to an existing one.")
        if status in (301, 307) or code in ("PermanentRedirect", "AuthorizationHeaderMalformed"):
            return ConfigError(f"{self._where()} lives in another region: set AWS_REGION to the bucket's.")
        return ConfigError(f"{self._where()} answered {status} {code}: {serving.redact(str(error.get('Message', '')))}")

    def upload(self, blob_name: str, content: bytes | BinaryIO, content_type: str, *,
               length: int | None = None) -> str:
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        _, transfer, _ = _boto()
        how = serving.served(blob_name, content_type)
        extra = {"ContentType": how.content_type}
        if how.disposition:  # stored on the object: what every GET answers with, link or not
            extra["ContentDisposition"] = how.disposition
        stream = io.BytesIO(content) if isinstance(content, bytes) else content
        size = self.settings.part_size
        plan = transfer.TransferConfig(multipart_threshold=size, multipart_chunksize=size, use_threads=False,
                                       max_io_queue=2)
        try:
            self._client().upload_fileobj(stream, self.settings.bucket, blob_name, ExtraArgs=extra, Config=plan)
            return self._link(blob_name, how.content_type, how.disposition)
        except StorageError:
            raise  # the stream's own verdict (a file that changed), not the service's
        except (Boto3Error, BotoCoreError, ClientError) as exc:
            cause = exc.__cause__ or exc.__context__
            if isinstance(cause, StorageError):
                raise StorageError(str(cause)) from exc
            raise StorageError(f"upload of {blob_name} failed: {serving.first_line(exc)}") from exc

    def _link(self, blob_name: str, content_type: str, disposition: str | None) -> str:
        params = {"Bucket": self.settings.bucket, "Key": blob_name}
        if disposition:  # signed into the link too, for servers that ignore stored headers
            params |= {"ResponseContentDisposition": disposition, "ResponseContentType": content_type}
        return str(self._client().generate_presigned_url("get_object", Params=params,
                                                         ExpiresIn=int(self.settings.link_expiry_s)))

    def local_url(self, path: Any) -> str | None:
        return None


def from_env(environ: Mapping[str, str]) -> S3Store:
    """An S3 store from NBEXEC_S3_BUCKET (required), AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN
    (unset: boto3's chain), AWS_REGION or AWS_DEFAULT_REGION, AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL (an
    S3-compatible server), NBEXEC_S3_ADDRESSING_STYLE, NBEXEC_BLOB_PREFIX and NBEXEC_LINK_EXPIRY."""
    return S3Store(S3Settings(
        bucket=environ.get("NBEXEC_S3_BUCKET") or "",
        prefix=serving.prefix_from(environ),
        region=environ.get("AWS_REGION") or environ.get("AWS_DEFAULT_REGION") or None,
        endpoint_url=environ.get("AWS_ENDPOINT_URL_S3") or environ.get("AWS_ENDPOINT_URL") or None,
        access_key_id=environ.get("AWS_ACCESS_KEY_ID") or None,
        secret_access_key=environ.get("AWS_SECRET_ACCESS_KEY") or None,
        session_token=environ.get("AWS_SESSION_TOKEN") or None,
        addressing_style=environ.get("NBEXEC_S3_ADDRESSING_STYLE") or "auto",
        link_expiry_s=serving.expiry_from(environ),
    ))
