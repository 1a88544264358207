"""A remote graph library: an fsspec file system and the folder in it that holds a graphs store.

The layout is the graphs folder's own (compiler/store/graph_store.py):
`ROOT/<Architecture>-<structure>/<graph_id>.json` (manifest) beside the
content-named package it names. A reader lists and reads manifests first and
fetches a package only once it has decided it wants it; a writer puts the
package first and the manifest last, create-only, so a manifest is visible
only once its package is complete and the first complete upload of a graph
wins.

Any fsspec URL works: `s3://bucket/prefix` (s3fs), `hf://org/repo` (the
`huggingface_hub` file system), `gcs://bucket/prefix` (gcsfs), a local or
network folder (`/mnt/shared/keepfast` or `file://...`), `memory://` in tests.
A library is read-only unless opened for writing (`graphs push`).

Every failure of the remote side (no such bucket, no credentials, a timeout,
a missing client package) comes out as `RemoteError` with a message that
says what to do; nothing here writes to the local graphs folder.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional

from ..settings import REMOTE_OPTIONS, remote_options

REMOTE_OPTIONS_ENV = REMOTE_OPTIONS.name

# The client package each protocol needs, for the message when it is missing.
_CLIENTS = {"s3": "s3fs", "s3a": "s3fs", "gcs": "gcsfs", "gs": "gcsfs", "hf": "huggingface_hub",
            "az": "adlfs", "abfs": "adlfs"}
# Bounded waits for S3 unless the caller sets its own: a worker must not hang at start on a dead endpoint.
_S3_DEFAULTS = {"config_kwargs": {"connect_timeout": 10, "read_timeout": 120,
                                  "retries": {"max_attempts": 2, "mode": "standard"}}}
_NO_CREDENTIALS = ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                   "DefaultCredentialsError", "LocalTokenNotFoundError")
_UNREACHABLE = ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
                "ClientConnectorError", "ServerTimeoutError", "FSTimeoutError", "TimeoutError",
                "ConnectionError", "ConnectTimeout", "ReadTimeout", "ConnectError", "gaierror",
                "OfflineModeIsEnabled")
_CUT_SHORT = ("ClientPayloadError", "ContentLengthError", "IncompleteRead", "ProtocolError", "ResponseStreamingError")
_NOT_FOUND = ("NoSuchBucket", "RepositoryNotFoundError", "RevisionNotFoundError")


class RemoteError(Exception):
    """A remote library could not be read or written; the message says why and what to do."""


def storage_options(given: Optional[Mapping[str, Any]] = None, environ: Mapping[str, str] = os.environ,
                    protocol: str = "") -> Dict[str, Any]:
    """fsspec storage options: defaults for the protocol, then $KEEPFAST_REMOTE_OPTIONS (JSON), then `given`."""
    options: Dict[str, Any] = {}
    if protocol in ("s3", "s3a"):
        options.update(json.loads(json.dumps(_S3_DEFAULTS)))
    text = remote_options(environ)
    if text:
        try:
            extra = json.loads(text)
        except ValueError as error:
            raise RemoteError(f"${REMOTE_OPTIONS_ENV} is not JSON ({error}); give an object such as "
                              '{"endpoint_url": "http://minio:9000"}') from None
        if not isinstance(extra, dict):
            raise RemoteError(f"${REMOTE_OPTIONS_ENV} must be a JSON object of fsspec storage options")
        options.update(extra)
    options.update(given or {})
    return options


def _protocol_of(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else "file"


@contextlib.contextmanager
def remote_errors(url: str, action: str) -> Iterator[None]:
    """Turn what fsspec and its clients raise into RemoteError with a message that says what to do."""
    try:
        yield
    except RemoteError:
        raise
    except Exception as error:  # noqa: BLE001 - every client raises its own classes
        raise RemoteError(describe_failure(url, action, error)) from error


def describe_failure(url: str, action: str, error: BaseException) -> str:
    """One sentence for a remote failure: what went wrong and what to do about it."""
    names = {cls.__name__ for cls in type(error).__mro__}
    text = str(error) or type(error).__name__
    if names & set(_NO_CREDENTIALS):
        return (f"{action} {url}: no credentials ({text}); set the store's credentials (for S3: "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or an instance role; for a public "
                'bucket, KEEPFAST_REMOTE_OPTIONS=\'{"anon": true}\')')
    if isinstance(error, PermissionError) or "AccessDenied" in text or "Forbidden" in text:
        return f"{action} {url}: access denied ({text}); check the credentials and the bucket's permissions"
    if names & set(_NOT_FOUND) or isinstance(error, FileNotFoundError):
        return f"{action} {url}: not found ({text}); check the bucket, repository or folder name"
    if (names & set(_UNREACHABLE) or isinstance(error, (TimeoutError, asyncio.TimeoutError, ConnectionError))
            or any(words in text.lower() for words in ("timed out", "could not connect", "name or service not known",
                                                       "temporary failure in name resolution"))):
        return (f"{action} {url}: cannot reach the store ({text}); check the network and the store's address "
                "(an S3-compatible store's: endpoint_url in KEEPFAST_REMOTE_OPTIONS or --option)")
    if names & set(_CUT_SHORT):
        return (f"{action} {url}: the download was cut short ({text}); nothing was written, "
                "the next pull tries again")
    if isinstance(error, ImportError):
        return f"{action} {url}: {text}"
    return f"{action} {url} failed: {type(error).__name__}: {text}"


@dataclass
class RemoteLibrary:
    """A graphs store on an fsspec file system; counts what it reads and writes."""

    url: str
    fs: Any
    root: str
    writable: bool = False
    bytes_read: int = 0
    bytes_written: int = 0
    reads: List[str] = field(default_factory=list)

    @classmethod
    def open(cls, url: str, options: Optional[Mapping[str, Any]] = None, writable: bool = False,
             environ: Mapping[str, str] = os.environ) -> "RemoteLibrary":
        """The library at `url` (read-only unless `writable`); RemoteError if its client is missing."""
        protocol = _protocol_of(url)
        resolved = storage_options(options, environ, protocol)
        try:
            from fsspec.core import url_to_fs
        except ImportError:
            raise RemoteError("remote graph libraries need fsspec: python -m pip install fsspec") from None
        try:
            fs, root = url_to_fs(url, **resolved)
        except ImportError as error:
            client = _CLIENTS.get(protocol, f"the fsspec client for {protocol}://")
            raise RemoteError(f"{url}: reading {protocol}:// needs {client}: python -m pip install {client} "
                              f"({error})") from None
        except (ValueError, TypeError) as error:
            raise RemoteError(f"{url}: not a library URL or bad storage options ({error})") from None
        return cls(url=url, fs=fs, root=str(root).rstrip("/"), writable=writable)

    # -- paths ---------------------------------------------------------------------
    def path(self, relative: str) -> str:
        return f"{self.root}/{relative}" if self.root else relative

    def relative(self, path: str) -> str:
        path = str(path)
        prefix = self.root + "/" if self.root else ""
        return path[len(prefix):] if prefix and path.startswith(prefix) else path.lstrip("/")

    @property
    def is_local(self) -> bool:
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        return "file" in protocols or "local" in protocols

    # -- reading -------------------------------------------------------------------
    def manifest_names(self) -> List[str]:
        """Every manifest as 'FOLDER/GRAPH_ID.json' (listing only, nothing downloaded)."""
        with remote_errors(self.url, "listing"):
            found = self.fs.glob(self.path("*/*.json"))
            if not found and not self.fs.exists(self.root or "/"):
                # An empty prefix in an existing bucket is an empty library; a missing bucket or folder is not.
                top = self.root if self.is_local else self.root.split("/")[0]
                if self.is_local or not top or not self.fs.exists(top):
                    raise FileNotFoundError(f"no bucket, repository or folder at {self.url}")
        return sorted(self.relative(p) for p in found)

    def read(self, relative: str, limit: Optional[int] = None) -> bytes:
        """The object's bytes; with `limit`, at most limit + 1 of them (so a caller can tell "too large"
        without downloading an object of any size a library may hold)."""
        with remote_errors(self.url, f"reading {relative} from"):
            if limit is None:
                data = self.fs.cat_file(self.path(relative))
            else:
                data = self.fs.cat_file(self.path(relative), start=0, end=limit + 1)
        self.bytes_read += len(data)
        self.reads.append(relative)
        return data

    def exists(self, relative: str) -> bool:
        with remote_errors(self.url, f"looking for {relative} in"):
            return bool(self.fs.exists(self.path(relative)))

    def size(self, relative: str) -> Optional[int]:
        with remote_errors(self.url, f"looking for {relative} in"):
            try:
                return int(self.fs.size(self.path(relative)))
            except FileNotFoundError:
                return None

    # -- writing (push only) -------------------------------------------------------------
    def _check_writable(self) -> None:
        if not self.writable:
            raise RemoteError(f"{self.url} was opened read-only (only `graphs push` writes to a library)")

    def put(self, relative: str, data: bytes) -> None:
        """Write an object so that no reader ever sees it half-written (replaces one of the same name)."""
        self._check_writable()
        with remote_errors(self.url, f"writing {relative} to"):
            if self.is_local:
                from ..store.atomic import write_bytes

                write_bytes(self.path(relative), data)  # temp file, fsync, rename
            else:  # an object store's PUT is all-or-nothing (a multipart upload appears only once completed)
                self.fs.pipe_file(self.path(relative), data)
        self.bytes_written += len(data)

    def create(self, relative: str, data: bytes) -> bool:
        """Write an object only if none of that name exists; False when one did (another writer won)."""
        self._check_writable()
        with remote_errors(self.url, f"writing {relative} to"):
            created = self._create_local(relative, data) if self.is_local else self._create_object(relative, data)
        if created:
            self.bytes_written += len(data)
        return created

    def _create_local(self, relative: str, data: bytes) -> bool:
        from ..store.atomic import TEMP_PREFIX, _fsync_dir

        target = self.path(relative)
        folder = os.path.dirname(target)
        os.makedirs(folder, exist_ok=True)
        fd, temp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=".part", dir=folder)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            try:
                os.link(temp, target)  # atomic, and fails if the name exists: the first complete file wins
            except FileExistsError:
                return False
            _fsync_dir(Path(folder))
            return True
        finally:
            os.unlink(temp)

    def _create_object(self, relative: str, data: bytes) -> bool:
        path = self.path(relative)
        try:
            self.fs.pipe_file(path, data, mode="create")  # S3: If-None-Match: *, a conditional put
            return True
        except FileExistsError:
            return False
        except OSError as error:
            if error.errno == errno.EINVAL and "precondition" in str(error).lower():
                return False
            raise
        except (TypeError, NotImplementedError, ValueError):
            # A store without conditional writes: check, then put (a narrow race; documented in docs/fleet.md).
            if self.fs.exists(path):
                return False
            self.fs.pipe_file(path, data)
            return True

    def remove(self, relative: str) -> None:
        self._check_writable()
        with remote_errors(self.url, f"removing {relative} from"):
            try:
                self.fs.rm_file(self.path(relative))
            except FileNotFoundError:
                pass
