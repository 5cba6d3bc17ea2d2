"""Checkpoints in object storage (``checkpointStorage: s3://bucket/prefix``): S3 and
S3-compatible servers (MinIO, Ceph RGW, ...), through boto3.

A checkpoint is a "directory" of objects, ``<prefix>/<key>/<path>``, made visible whole:
its files are uploaded first and the small marker object ``<prefix>/<key>/.complete`` last,
so a directory without the marker is incomplete (an upload that died half way) and is never
read. Re-uploading a key takes its marker away first; deleting one takes the marker first.

Credentials and the endpoint come from boto3's own chain: ``AWS_ACCESS_KEY_ID`` and
``AWS_SECRET_ACCESS_KEY`` (and ``AWS_SESSION_TOKEN``), ``AWS_PROFILE`` and the shared config
files, an instance or pod role; ``AWS_ENDPOINT_URL`` or ``AWS_ENDPOINT_URL_S3`` for an
S3-compatible server. Every request has connect and read timeouts and a bounded number of
retries; big files go in parts through boto3's transfer manager, a few parts in memory at
a time. Errors name the bucket and key and the cause, never a credential or a signed URL.

boto3 is an extra (``pip install 'trialkeeper[s3]'``), imported only when a store is made.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["MARKER", "ObjectStore", "ObjectStoreError", "parse_url"]

MARKER = ".complete"
INSTALL_HINT = "pip install 'trialkeeper[s3]'"

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0
MAX_ATTEMPTS = 4  # botocore's "standard" retry mode: the first try and three retries, with backoff
PART_BYTES = 8 * 1024 * 1024  # multipart above this size, in parts of this size
CONCURRENCY = 4  # parts in flight per file: what bounds the memory a transfer holds
DELETE_BATCH = 1000  # the most keys one DeleteObjects takes
LIST_PAGE = 1000  # keys a listing returns a page

_BUCKET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")
# What must never reach a message even when a server echoes it back: access key ids, the
# parts of a signed request or URL, a password in an endpoint URL.
_SECRET_PATTERNS = (
    (re.compile(r"\b(?:AKIA|ASIA|AIDA|AROA|ANPA|ANVA|AGPA)[A-Z0-9]{12,}\b"), "<access key id>"),
    (re.compile(r"(?i)(X-Amz-(?:Signature|Credential|Security-Token)=)[^&\s\"'<]+"), r"\1<redacted>"),
    (re.compile(r"(?i)((?:AWSAccessKeyId|Signature|Credential)=)[^&,\s\"'<]+"), r"\1<redacted>"),
    (re.compile(r"(?i)(<(?:AWSAccessKeyId|SignatureProvided|StringToSign|CanonicalRequest)>)[^<]*"),
     r"\1<redacted>"),
    (re.compile(r"(\w+://)[^/@\s]+@"), r"\1<redacted>@"),
)
_CREDENTIAL_CODES = {
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken", "TokenRefreshRequired",
    "InvalidClientTokenId", "AuthorizationHeaderMalformed", "AccessDenied", "AllAccessDisabled", "403",
}
_DOING = {
    "delete_object": "deleting",
    "put_object": "writing",
    "list_objects_v2": "listing",
    "delete_objects": "deleting",
}
_CREDENTIAL_HINT = (
    "check the credentials the agent runs with (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
    "AWS_PROFILE, or the machine's role) and that they may read and write this bucket"
)


class ObjectStoreError(Exception):
    """An object-storage operation failed or was refused; the message names the bucket and
    key and the cause, and never holds a credential or a signed URL."""


def parse_url(url: str) -> tuple[str, str]:
    """``"s3://bucket/some/prefix"`` -> ``("bucket", "some/prefix")`` (the prefix without
    slashes at either end, ``""`` for the bucket's top); ObjectStoreError naming what is wrong."""
    if not isinstance(url, str) or not url.startswith("s3://"):
        raise ObjectStoreError(f"object storage URL {url!r}: must start with s3:// (s3://bucket/prefix)")
    rest = url[len("s3://"):]
    if any(c in rest for c in "?#\\") or any(ord(c) < 32 for c in rest):
        raise ObjectStoreError(f"object storage URL {url!r}: has a character an S3 key here may not hold")
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.match(bucket):
        raise ObjectStoreError(f"object storage URL {url!r}: {bucket!r} is not a bucket name")
    prefix = prefix.strip("/")
    if prefix:
        _check_key(prefix, f"object storage URL {url!r}")
    return bucket, prefix


def _check_key(key: str, what: str) -> str:
    """A relative key of '/'-separated names, none empty, '.' or '..'."""
    if not key or key.startswith("/") or any(part in ("", ".", "..") for part in key.split("/")):
        raise ObjectStoreError(f"{what}: {key!r} is not a relative path of plain names")
    return key


def _join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


class ObjectStore:
    """One bucket and prefix of an S3 or S3-compatible object store.

    Made with :meth:`from_url`; safe to use from several threads at once (boto3's clients are).
    """

    def __init__(self, client: Any, session: Any, bucket: str, prefix: str, transfer: Any) -> None:
        self._client = client
        self._session = session
        self.bucket = bucket
        self.prefix = prefix
        self._transfer = transfer

    @property
    def url(self) -> str:
        return f"s3://{_join(self.bucket, self.prefix)}"

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        read_timeout: float = READ_TIMEOUT_S,
        max_attempts: int = MAX_ATTEMPTS,
    ) -> ObjectStore:
        """The store at ``"s3://bucket/prefix"``, with credentials and endpoint from boto3's
        default chain. Sends the store no request yet: a bad bucket or key shows on first use."""
        bucket, prefix = parse_url(url)
        try:
            import boto3
            import boto3.s3.transfer
            import botocore.config
        except ImportError as e:
            raise ObjectStoreError(
                f"checkpoints in object storage ({url}) need boto3, which is not installed here: {INSTALL_HINT}"
            ) from e
        config = botocore.config.Config(
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"max_attempts": max_attempts, "mode": "standard"},
        )
        transfer = boto3.s3.transfer.TransferConfig(
            multipart_threshold=PART_BYTES,
            multipart_chunksize=PART_BYTES,
            max_concurrency=CONCURRENCY,
            use_threads=True,
            preferred_transfer_client="classic",  # the one whose limits above hold
        )
        try:
            session = boto3.session.Session()
            client = session.client("s3", config=config)
        except Exception as e:  # an unusable endpoint URL or config file; botocore raises several kinds
            raise ObjectStoreError(f"{url}: cannot make an S3 client: {_scrub(str(e), ())}") from e
        return cls(client, session, bucket, prefix, transfer)

    # ---- the three operations ----------------------------------------------------------

    def put_dir(self, local_dir: Path, key: str, files: list[tuple[str, int]]) -> str:
        """Upload ``files`` (relative paths under ``local_dir``, with their sizes) to
        ``<prefix>/<key>/<path>``, then the marker; returns ``s3://bucket/prefix/key``.
        A file whose size is not the one listed is refused before anything is uploaded."""
        directory = _join(self.prefix, _check_key(key.strip("/"), "checkpoint key"))
        url = f"s3://{self.bucket}/{directory}"
        paths = _checked_files(files, url)
        for path, size in paths:
            local = Path(local_dir) / path
            try:
                actual = local.stat().st_size
            except OSError as e:
                raise ObjectStoreError(f"{url}: cannot upload {local}: {e.strerror or e}") from e
            if actual != size:
                raise ObjectStoreError(f"{url}: {local} has {actual} bytes, {size} were listed: it changed")
        marker = f"{directory}/{MARKER}"
        try:  # an earlier upload of this key may have finished: it stops counting as complete now
            self._client.delete_object(Bucket=self.bucket, Key=marker)
        except Exception as e:
            raise self._error(url, "cannot start the upload (taking away an earlier marker)", e) from e
        total = 0
        for path, size in paths:
            object_key = f"{directory}/{path}"
            try:
                self._client.upload_file(
                    str(Path(local_dir) / path), self.bucket, object_key, Config=self._transfer
                )
            except Exception as e:
                raise self._error(f"s3://{self.bucket}/{object_key}", f"upload of {Path(local_dir) / path} failed",
                                  e) from e
            total += size
        body = json.dumps({"files": [[p, s] for p, s in paths]}, separators=(",", ":")).encode()
        self._call("put_object", f"s3://{self.bucket}/{marker}", Bucket=self.bucket, Key=marker, Body=body)
        log.info("uploaded %s: %d files, %d bytes", url, len(paths), total)
        return url

    def get_dir(self, url: str, local_dir: Path, files: list[tuple[str, int]]) -> None:
        """Download the complete directory at ``url`` into ``local_dir``: each of ``files``
        (relative path, size). Refused when the marker is missing (the upload never finished)
        or a file is missing or of another size in storage."""
        bucket, directory = parse_url(url)
        if not directory:
            raise ObjectStoreError(f"{url}: names a whole bucket, not a checkpoint's directory")
        paths = _checked_files(files, url)
        marker = f"{directory}/{MARKER}"
        try:
            self._client.get_object(Bucket=bucket, Key=marker)["Body"].close()
        except Exception as e:
            if _code(e) in ("NoSuchKey", "404"):
                raise ObjectStoreError(
                    f"{url} is incomplete: it has no {MARKER} marker (its upload did not finish, or it was deleted)"
                ) from e
            raise self._error(f"s3://{bucket}/{marker}", "cannot read the marker", e) from e
        stored = dict(self._listing(bucket, directory, url))
        for path, size in paths:
            found = stored.get(f"{directory}/{path}")
            if found is None:
                raise ObjectStoreError(f"{url}: {path} is missing from storage")
            if found != size:
                raise ObjectStoreError(f"{url}: {path} has {found} bytes in storage, {size} expected")
        try:
            Path(local_dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ObjectStoreError(f"{url}: cannot make {local_dir}: {e.strerror or e}") from e
        for path, size in paths:
            self._download(bucket, f"{directory}/{path}", Path(local_dir) / path, size)
        log.info("downloaded %s: %d files", url, len(paths))

    def delete(self, url: str) -> None:
        """Delete every object under the "directory" at ``url``, the marker first; deleting
        what is not there is no error."""
        bucket, directory = parse_url(url)
        if not directory:
            raise ObjectStoreError(f"{url}: names a whole bucket; refusing to delete everything in it")
        marker = f"{directory}/{MARKER}"
        self._call("delete_object", f"s3://{bucket}/{marker}", Bucket=bucket, Key=marker)
        batch: list[str] = []
        for key, _ in self._listing(bucket, directory, url):
            batch.append(key)
            if len(batch) == DELETE_BATCH:
                self._delete_batch(bucket, batch, url)
                batch = []
        if batch:
            self._delete_batch(bucket, batch, url)
        log.info("deleted %s", url)

    # ---- pieces ------------------------------------------------------------------------

    def _download(self, bucket: str, key: str, target: Path, size: int) -> None:
        where = f"s3://{bucket}/{key}"
        part = target.with_name(f".{target.name}.part-{secrets.token_hex(4)}")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            self._client.download_file(bucket, key, str(part), Config=self._transfer)
            got = part.stat().st_size
            if got != size:
                raise ObjectStoreError(f"{where}: downloaded {got} bytes, {size} expected (it changed meanwhile)")
            os.replace(part, target)
        except ObjectStoreError:
            raise
        except OSError as e:
            raise ObjectStoreError(f"{where}: cannot write {target}: {e.strerror or e}") from e
        except Exception as e:
            raise self._error(where, "download failed", e) from e
        finally:
            part.unlink(missing_ok=True)

    def _listing(self, bucket: str, directory: str, url: str) -> Iterator[tuple[str, int]]:
        """(key, size) of every object under ``directory/``."""
        token: str | None = None
        while True:
            args: dict[str, Any] = {"Bucket": bucket, "Prefix": f"{directory}/", "MaxKeys": LIST_PAGE}
            if token:
                args["ContinuationToken"] = token
            page = self._call("list_objects_v2", url, **args)
            for item in page.get("Contents", ()):
                yield item["Key"], int(item["Size"])
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token:
                return

    def _delete_batch(self, bucket: str, keys: list[str], url: str) -> None:
        answer = self._call(
            "delete_objects", url, Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True}
        )
        errors = answer.get("Errors") or []
        if errors:
            first = errors[0]
            raise ObjectStoreError(
                f"s3://{bucket}/{first.get('Key')}: delete failed: {first.get('Code')}: "
                f"{_scrub(str(first.get('Message', '')), self._secrets())} ({len(errors)} of {len(keys)} failed)"
            )

    def _call(self, operation: str, where: str, **args: Any) -> Any:
        try:
            return getattr(self._client, operation)(**args)
        except Exception as e:
            raise self._error(where, _DOING.get(operation, operation) + " failed", e) from e

    def _error(self, where: str, what: str, e: BaseException) -> ObjectStoreError:
        """An ObjectStoreError for ``e``: where, what failed, the cause, a hint when one helps."""
        bucket = where[len("s3://"):].partition("/")[0]
        code = _code(e)
        client_error = _client_error(e)
        name = type(e).__name__
        if client_error is not None:
            err = client_error.response.get("Error", {})
            status = client_error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            message = err.get("Message") or (f"HTTP {status}" if status else "")
            cause = f"{code}: {message}" if message and message != code else str(code)
        elif name == "NoCredentialsError":
            cause = ("no credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, "
                     "or run with a role")
        elif isinstance(e, OSError) and not type(e).__module__.startswith(("botocore", "urllib3")):
            cause = e.strerror or str(e)
        else:
            cause = f"{name}: {e}"
        if code == "NoSuchBucket":
            cause = f"bucket {bucket!r} does not exist ({cause})"
        elif code in _CREDENTIAL_CODES:
            cause = f"the credentials were refused: {cause}; {_CREDENTIAL_HINT}"
        return ObjectStoreError(f"{where}: {what}: {_scrub(cause, self._secrets())}")

    def _secrets(self) -> tuple[str, ...]:
        """The credentials in use, where botocore has resolved them already, to blank out."""
        try:  # resolved once, when the client was made, and cached by the session since
            resolved = self._session.get_credentials()
            if resolved is None:
                return ()
            frozen = resolved.get_frozen_credentials()
        except Exception:  # noqa: BLE001 - a refresh that fails now only means nothing to blank out
            return ()
        return tuple(s for s in (frozen.access_key, frozen.secret_key, frozen.token) if s and len(s) >= 4)


def _checked_files(files: list[tuple[str, int]], url: str) -> list[tuple[str, int]]:
    seen: set[str] = set()
    out: list[tuple[str, int]] = []
    for path, size in files:
        path = str(PurePosixPath(_check_key(str(path), f"{url}: file")))
        if path == MARKER:
            raise ObjectStoreError(f"{url}: a file may not be named {MARKER} (the name of the completion marker)")
        if path in seen:
            raise ObjectStoreError(f"{url}: {path} is listed twice")
        if not isinstance(size, int) or size < 0:
            raise ObjectStoreError(f"{url}: {path} has size {size!r}, not a byte count")
        seen.add(path)
        out.append((path, size))
    return out


def _client_error(e: BaseException | None) -> Any:
    """The botocore ClientError that ``e`` is or that caused it (boto3's transfer errors
    wrap one without naming it as the cause), if any."""
    try:
        from botocore.exceptions import ClientError
    except ImportError:
        return None
    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, ClientError):  # or one of its modelled kinds: NoSuchKey, NoSuchBucket, ...
            return e
        e = e.__cause__ or e.__context__
        seen += 1
    return None


def _code(e: BaseException) -> str:
    found = _client_error(e)
    if found is None:
        return ""
    return str(found.response.get("Error", {}).get("Code", ""))


def _scrub(text: str, known: tuple[str, ...]) -> str:
    for value in sorted(known, key=len, reverse=True):
        text = text.replace(value, "<redacted>")
    for pattern, replacement in _SECRET_PATTERNS:
        text = pattern.sub(replacement, text)
    return text
