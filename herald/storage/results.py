"""Result stores (``ResultStore`` in ``herald.storage.ports``): local files, or the NATS object store.

A handler writes its result to a local scratch file, in its process's own scratch directory
(``herald.scratch``: removed by another process once this one is gone); ``commit`` makes it
the job's result before the job is marked succeeded (SPEC §6), and the gateway streams it
back with ``open``. ``FileResultStore`` keeps results under ``HERALD_DATA_DIR`` (one machine);
``NatsResultStore`` keeps them in a JetStream object store bucket, so any gateway can
serve a result any worker wrote, with no shared disk (SPEC §11).

Neither store ever holds a whole result in memory: uploads, reads and downloads go a
chunk at a time.
"""

from __future__ import annotations

import asyncio
import base64
import errno
import hashlib
import io
import logging
import os
import re
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, TypeVar

import nats.errors
from nats.js import JetStreamContext
from nats.js.api import ObjectInfo, RawStreamMsg, StorageType
from nats.js.errors import (
    BadRequestError,
    DigestMismatchError,
    NoStreamResponseError,
    NotFoundError,
    ObjectNotFoundError,
    ServiceUnavailableError,
)
from nats.js.object_store import ObjectStore

from herald.constants import RESULTS_BUCKET
from herald.keyfiles import private_dir
from herald.scratch import ScratchDir
from herald.settings import Settings
from herald.storage.ports import ResultBody, ResultStore

if TYPE_CHECKING:
    from hashlib import _Hash

log = logging.getLogger("herald.results")

T = TypeVar("T")

FILE_CHUNK = 64 * 1024
SCRATCH_SUFFIX = ".part"

# How long a NATS operation is retried through timeouts and "no responders": a stream
# leader election in a cluster takes a few seconds (and a request sent to a server that
# just died waits out the JetStream timeout, 5 s, first); a commit or a download should
# ride it out rather than fail the job or the request.
NATS_RETRY_FOR_S = 30.0
_TRANSIENT_NATS_ERRORS: tuple[type[BaseException], ...] = (
    TimeoutError,  # nats.errors.TimeoutError is one too
    nats.errors.NoRespondersError,
    NoStreamResponseError,  # what a JetStream publish turns "no responders" into
    nats.errors.ConnectionReconnectingError,
    ServiceUnavailableError,
)

# A job id becomes a subject token in the index: no dots, wildcards or whitespace.
_SUBJECT_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")
_ATTEMPT_PREFIX = re.compile(r"^(\d+)")


class ResultGone(Exception):
    """The result disappeared while it was being read (retention ran, or it was discarded)."""


class ResultStoreUnavailable(RuntimeError):
    """The result store cannot be used yet (the NATS store before NATS is connected)."""


def _scratch_name(job_id: str, attempt: int, suffix: str) -> str:
    # One flat file per attempt in the process's scratch dir: a late attempt cleaning up after
    # itself must never remove anything another attempt of the job is writing.
    return f"{job_id}.{attempt}{suffix}{SCRATCH_SUFFIX}"


def _final_name(job_id: str, scratch: Path) -> str:
    """``<attempt><suffix>``: the scratch file's name without its job id and ``.part``."""
    return scratch.name.removesuffix(SCRATCH_SUFFIX).removeprefix(job_id + ".")


# ----- local files ------------------------------------------------------------------------


class FileResultStore:
    """Results as files under ``root``: ``<id[:2]>/<id>/<attempt><suffix>``, the key being
    that path relative to ``root``. Attempts write ``<id>.<attempt><suffix>.part`` in this
    process's directory under ``scratch`` (``HERALD_DATA_DIR/scratch``, beside ``root``:
    commit is a rename on the same filesystem)."""

    def __init__(self, root: Path, scratch: Path) -> None:
        self.root = root
        self.scratch = ScratchDir(scratch)

    @staticmethod
    def _job_dir(base: Path, job_id: str) -> Path:
        return base / job_id[:2] / job_id

    def scratch_path(self, job_id: str, attempt: int, suffix: str) -> Path:
        private_dir(self.root)  # results are the tenants' data: the owner's only (0700), also when found open
        return self.scratch.path / _scratch_name(job_id, attempt, suffix)

    async def commit(self, job_id: str, attempt: int, scratch: Path) -> str:
        final = self._job_dir(self.root, job_id) / _final_name(job_id, scratch)
        await asyncio.to_thread(_install, scratch, final)
        return str(final.relative_to(self.root))

    async def open(self, key: str) -> ResultBody | None:
        path = self._path(key)
        try:
            size = (await asyncio.to_thread(path.stat)).st_size
        except FileNotFoundError:
            return None
        return ResultBody(size=size, chunks=_read_file(path))

    async def discard(self, key: str) -> None:
        await asyncio.to_thread(self._path(key).unlink, missing_ok=True)

    async def delete_job(self, job_id: str) -> None:
        # (An older Herald's scratch files, beside the results, go with the job's directory.)
        await asyncio.to_thread(_remove_tree, self._job_dir(self.root, job_id))
        if (own := self.scratch.made) is not None:
            await asyncio.to_thread(_remove_job_scratch, own, job_id)

    async def close(self) -> None:
        await asyncio.to_thread(self.scratch.close)

    def _path(self, key: str) -> Path:
        # Keys come from our own job rows, but a key must never name a file outside the store.
        path = Path(key)
        if path.is_absolute() or ".." in path.parts:
            raise ValueError(f"not a result key: {key!r}")
        return self.root / path


def _install(scratch: Path, final: Path) -> None:
    """Make a finished scratch file the result: durable first, then visible all at once."""
    with open(scratch, "rb") as fh:
        os.fchmod(fh.fileno(), 0o600)  # a handler wrote it with the process's umask
        os.fsync(fh.fileno())
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(scratch, final)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        _copy_across_devices(scratch, final)
    _fsync_dir(final.parent)  # the rename itself survives a power cut


def _copy_across_devices(scratch: Path, final: Path) -> None:
    """A scratch dir on another filesystem: copy beside the result, then rename there.

    The copy is the owner's only (0600) from its creation, as a renamed scratch file is, and
    a copy that fails (the results' filesystem full, read-only, failing) is removed: left
    there, each failed attempt's partial file kept the space it took until the job's
    retention, so a full results volume stayed full after the operator freed room."""
    staging = final.with_name(final.name + SCRATCH_SUFFIX)
    try:
        with open(scratch, "rb") as src, open(os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
                                              "wb") as dst:
            shutil.copyfileobj(src, dst, FILE_CHUNK)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(staging, final)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    scratch.unlink(missing_ok=True)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def _read_file(path: Path) -> AsyncIterator[bytes]:
    # Opened on the first read, not in open(): a body that is never iterated holds no file.
    try:
        fh: BinaryIO = await asyncio.to_thread(open, path, "rb")
    except FileNotFoundError as exc:
        raise ResultGone(str(path)) from exc
    try:
        while chunk := await asyncio.to_thread(fh.read, FILE_CHUNK):
            yield chunk
    finally:
        fh.close()


# ----- the NATS object store --------------------------------------------------------------


def object_stream(bucket: str) -> str:
    return f"OBJ_{bucket}"


def index_bucket(bucket: str) -> str:
    """The key-value bucket indexing ``bucket``'s objects by job: ``<job id>.<attempt>`` -> key.

    The object store names a meta subject after the base64 of the object's name, so no
    subject filter can select one job's objects; without this index, retention would list
    every object in the bucket for every expired job."""
    return f"{bucket}_INDEX"


def index_stream(bucket: str) -> str:
    return f"KV_{index_bucket(bucket)}"


def _chunk_subject(bucket: str, nuid: str) -> str:
    return f"$O.{bucket}.C.{nuid}"


def _meta_subject(bucket: str, key: str) -> str:
    return f"$O.{bucket}.M.{base64.urlsafe_b64encode(key.encode()).decode()}"


def _index_subject(bucket: str, job_id: str, attempt: int | str) -> str:
    return f"$KV.{index_bucket(bucket)}.{job_id}.{attempt}"


async def retry_nats(operation: Callable[[], Awaitable[T]], *, for_s: float = NATS_RETRY_FOR_S) -> T:
    """Run ``operation``, again after a transient NATS failure, for up to ``for_s`` seconds."""
    give_up = time.monotonic() + for_s
    delay = 0.1
    while True:
        try:
            return await operation()
        except _TRANSIENT_NATS_ERRORS as exc:
            if time.monotonic() >= give_up:
                raise
            log.info("NATS busy, retrying: %r", exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)


async def ensure_result_buckets(js: JetStreamContext, bucket: str, replicas: int) -> None:
    """Create the object store bucket and its index (file storage, ``replicas`` copies), or
    leave them as they are. Safe when many processes start at once."""

    async def create_objects() -> None:
        await js.create_object_store(bucket, storage=StorageType.FILE, replicas=replicas)

    async def create_index() -> None:
        await js.create_key_value(bucket=index_bucket(bucket), history=1, storage=StorageType.FILE, replicas=replicas)

    await _ensure_stream(js, object_stream(bucket), create_objects, replicas)
    await _ensure_stream(js, index_stream(bucket), create_index, replicas)


async def _ensure_stream(
    js: JetStreamContext, stream: str, create: Callable[[], Awaitable[None]], replicas: int
) -> None:
    for _ in range(20):
        try:
            await create()  # the same config again is a no-op for JetStream
            return
        except BadRequestError:
            pass  # "already in use with a different configuration": created by another version or with other replicas
        try:
            info = await js.stream_info(stream)
        except NotFoundError:
            await asyncio.sleep(0.25)  # another process's create is still being placed: try again
            continue
        if info.config.num_replicas != replicas:
            # Scaling the replicas is the one change we make to an existing bucket.
            info.config.num_replicas = replicas
            await js.update_stream(info.config)
        return
    raise RuntimeError(f"could not create or read the stream {stream}")


class NatsResultStore:
    """Results in a JetStream object store bucket, keyed ``<job id>/<attempt><suffix>``.

    Attempts write scratch files in this process's directory under the local ``scratch_dir``
    (``herald.scratch``); ``commit`` uploads one and removes it. Every key is also recorded in
    the bucket's index (``index_bucket``) before its upload starts, so ``delete_job`` finds it
    with a subject filter, even one left by a worker that died between its upload and the
    job's transition."""

    def __init__(self, js: JetStreamContext, bucket: str, scratch_dir: Path, replicas: int) -> None:
        self._js = js
        self._bucket = bucket
        self._scratch_dir = scratch_dir
        self._scratch = ScratchDir(scratch_dir)
        self._replicas = replicas
        self._objects = ObjectStore(name=bucket, stream=object_stream(bucket), js=js)

    @property
    def bucket(self) -> str:
        return self._bucket

    async def ensure(self) -> None:
        """Create the bucket and its index if they do not exist yet (waiting out a cluster
        that is still electing its leaders)."""
        await retry_nats(lambda: ensure_result_buckets(self._js, self._bucket, self._replicas), for_s=60.0)

    def scratch_path(self, job_id: str, attempt: int, suffix: str) -> Path:
        _check_job_id(job_id)
        return self._scratch.path / _scratch_name(job_id, attempt, suffix)

    async def commit(self, job_id: str, attempt: int, scratch: Path) -> str:
        _check_job_id(job_id)
        key = f"{job_id}/{_final_name(job_id, scratch)}"
        # Index first: whatever reaches the bucket is then findable by delete_job, even if
        # this process dies halfway through the upload.
        subject = _index_subject(self._bucket, job_id, attempt)
        await retry_nats(lambda: self._js.publish(subject, key.encode()))
        # A failed upload purges its own chunks; the retry uploads the file afresh.
        await retry_nats(lambda: self._upload(key, scratch))
        await asyncio.to_thread(_remove_scratch, scratch)
        return key

    async def _upload(self, key: str, scratch: Path) -> None:
        fh = await asyncio.to_thread(_open_binary, scratch)
        try:
            # ObjectStore.put reads a file object with readinto() in an executor, one
            # 128 KiB chunk at a time, and publishes each chunk before reading the next:
            # the result is never whole in memory.
            await self._objects.put(key, fh)
        finally:
            fh.close()

    async def open(self, key: str) -> ResultBody | None:
        info = await self._info(key)
        if info is None:
            return None
        size, nuid, digest = info.size or 0, info.nuid, info.digest or ""
        if size == 0:
            return ResultBody(size=0, chunks=_no_chunks())
        subject = _chunk_subject(self._bucket, nuid)
        # The first chunk is fetched now, so a result deleted since its meta was read is a
        # "gone" answer (410) rather than a download that breaks after its headers.
        first = await self._chunk_after(subject, 0)
        if first is None:
            return None
        return ResultBody(size=size, chunks=self._chunks(subject, first, size, digest))

    async def _chunks(self, subject: str, first: RawStreamMsg, size: int, digest: str) -> AsyncIterator[bytes]:
        """The object's chunks, fetched one by one as the reader asks for them.

        Not ``ObjectStore.get``: without ``writeinto`` it gathers the whole object in memory,
        and it (like any ordered push consumer) lets the server push chunks faster than a
        slow HTTP client takes them, buffering tens of MB in the subscription. A request per
        chunk (next message on the object's chunk subject after the last one's sequence)
        keeps exactly one chunk in memory and leaves no consumer behind when the download
        is abandoned. The digest is checked before the last chunk goes out, so a damaged
        object never reads as a complete download."""
        sha = hashlib.sha256()
        received = 0
        msg: RawStreamMsg | None = first
        while msg is not None:
            data = msg.data or b""
            sha.update(data)
            received += len(data)
            if received >= size:
                _verify(received, size, sha, digest)
                yield data
                return
            yield data
            msg = await self._chunk_after(subject, msg.seq or 0)
        raise ResultGone(f"result deleted while it was read ({received} of {size} bytes sent)")

    async def _chunk_after(self, subject: str, seq: int) -> RawStreamMsg | None:
        """The first message on ``subject`` after stream sequence ``seq``, or None."""
        stream = object_stream(self._bucket)

        async def get(direct: bool) -> RawStreamMsg:
            return await self._js.get_msg(stream, seq=seq + 1, subject=subject, next=True, direct=direct)

        try:
            # A direct get may be answered by any replica, which spreads the reads...
            return await retry_nats(lambda: get(True))
        except NotFoundError:
            pass
        try:
            # ...but a replica still catching up may not have the chunk yet: the leader has
            # every chunk that was acknowledged.
            return await retry_nats(lambda: get(False))
        except NotFoundError:
            return None

    async def discard(self, key: str) -> None:
        await self._delete_object(key)
        job_id, _, name = key.partition("/")
        attempt = _ATTEMPT_PREFIX.match(name)
        if attempt is not None and _SUBJECT_TOKEN.match(job_id):
            subject = _index_subject(self._bucket, job_id, attempt.group(1))
            await retry_nats(lambda: self._js.purge_stream(index_stream(self._bucket), subject=subject))

    async def delete_job(self, job_id: str) -> None:
        _check_job_id(job_id)
        for key in await self._indexed_keys(job_id):
            await self._delete_object(key)
        # Only once the objects are gone: a failure above leaves the index for the next sweep.
        subject = _index_subject(self._bucket, job_id, "*")
        await retry_nats(lambda: self._js.purge_stream(index_stream(self._bucket), subject=subject))
        for scratch_dir in (self._scratch_dir, self._scratch.made):  # an older Herald's flat dir; this process's
            if scratch_dir is not None:
                await asyncio.to_thread(_remove_job_scratch, scratch_dir, job_id)

    async def close(self) -> None:
        await asyncio.to_thread(self._scratch.close)  # the NATS connection is the caller's

    async def _info(self, key: str) -> ObjectInfo | None:
        try:
            info = await retry_nats(lambda: self._objects.get_info(key))
        except ObjectNotFoundError:
            return None
        if info.is_link() or not info.nuid:
            return None  # Herald never stores links; anything else is not one of our results
        return info

    async def _indexed_keys(self, job_id: str) -> list[str]:
        """Every key recorded for the job, read from the index's leader (a replica may lag)."""
        stream, subject = index_stream(self._bucket), _index_subject(self._bucket, job_id, "*")
        keys: list[str] = []
        seq = 0
        while True:
            try:
                msg = await retry_nats(lambda: self._js.get_msg(stream, seq=seq + 1, subject=subject, next=True))
            except NotFoundError:
                return keys
            seq = msg.seq or seq + 1
            if msg.data:
                keys.append(msg.data.decode())

    async def _delete_object(self, key: str) -> None:
        """Remove an object completely: chunks, then the meta.

        Not ``ObjectStore.delete``: it leaves a "deleted" meta message behind for ever, one
        per result, which would grow the bucket with every expired job. The chunks go first,
        so a failure halfway leaves the meta for a retry to find them again."""
        info = await self._info(key)
        if info is None:
            return
        stream = object_stream(self._bucket)
        chunks, meta = _chunk_subject(self._bucket, info.nuid), _meta_subject(self._bucket, key)
        await retry_nats(lambda: self._js.purge_stream(stream, subject=chunks))
        await retry_nats(lambda: self._js.purge_stream(stream, subject=meta))


def _check_job_id(job_id: str) -> None:
    if not _SUBJECT_TOKEN.match(job_id):
        raise ValueError(f"job id {job_id!r} cannot name a NATS subject token")


def _verify(received: int, size: int, sha: _Hash, digest: str) -> None:
    """The object read whole matches its meta (size and SHA-256), or it is damaged."""
    expected = digest.removeprefix("SHA-256=").removeprefix("sha-256=")
    if received != size or base64.urlsafe_b64decode(expected) != sha.digest():
        raise DigestMismatchError()


def _open_binary(path: Path) -> io.BufferedReader:
    return open(path, "rb")


def _remove_scratch(scratch: Path) -> None:
    scratch.unlink(missing_ok=True)


def _remove_tree(directory: Path) -> None:
    """``directory`` and all in it; what is gone already is fine, any other failure raises.

    Retention deletes a job's row only after its result is gone, and tries again on its next
    pass when this raises. Errors were ignored here: on a results volume gone read-only or
    failing, the row went and the result stayed for good, a tenant's data kept past its
    retention with nothing left to remove it."""

    def gone_already(function: Callable[..., object], path: str,
                     info: tuple[type[BaseException], BaseException, object]) -> None:
        if not isinstance(info[1], FileNotFoundError):
            raise info[1]

    shutil.rmtree(directory, onerror=gone_already)  # (onerror: Python 3.11 has no onexc)


def _remove_job_scratch(scratch_dir: Path, job_id: str) -> None:
    """Whatever attempts of the job left in ``scratch_dir`` (an older Herald's flat one, where a
    worker that died left its files; a process's own directory goes when it is gone:
    ``herald.scratch``)."""
    for leftover in scratch_dir.glob(f"{job_id}.*{SCRATCH_SUFFIX}"):
        leftover.unlink(missing_ok=True)


async def _no_chunks() -> AsyncIterator[bytes]:
    return
    yield  # an async generator that yields nothing


# ----- the NATS store before NATS is connected ------------------------------------------


class UnavailableResultStore:
    """Stands in for the NATS store until a connection exists (the gateway serves before
    NATS is up): every operation raises ``ResultStoreUnavailable``; the gateway answers 503."""

    def scratch_path(self, job_id: str, attempt: int, suffix: str) -> Path:
        raise ResultStoreUnavailable("the result store is not connected yet")

    async def commit(self, job_id: str, attempt: int, scratch: Path) -> str:
        raise ResultStoreUnavailable("the result store is not connected yet")

    async def open(self, key: str) -> ResultBody | None:
        raise ResultStoreUnavailable("the result store is not connected yet")

    async def discard(self, key: str) -> None:
        raise ResultStoreUnavailable("the result store is not connected yet")

    async def delete_job(self, job_id: str) -> None:
        raise ResultStoreUnavailable("the result store is not connected yet")

    async def close(self) -> None:
        return None


async def open_result_store(settings: Settings, js: JetStreamContext | None) -> ResultStore:
    """The store ``settings.effective_result_store`` names: files under HERALD_DATA_DIR, or
    the NATS bucket (created if missing; scratch files under HERALD_DATA_DIR/scratch).
    ``js`` None with the NATS store: a stand-in that refuses until NATS is connected."""
    if settings.effective_result_store == "file":
        return FileResultStore(settings.results_dir, settings.scratch_dir)
    if js is None:
        return UnavailableResultStore()
    store = NatsResultStore(js, RESULTS_BUCKET, settings.scratch_dir, settings.nats_replicas)
    await store.ensure()
    return store
