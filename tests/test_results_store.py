"""Both result stores against one contract, on a real nats-server and a real temp dir."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import stat
import subprocess
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import httpx
import nats
import psutil
import pytest
from litestar import Litestar
from litestar.exceptions import HTTPException
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import StorageType
from nats.js.errors import DigestMismatchError

from gateway.problems import handle_http_exception
from gateway.routes.results import result_route
from herald import jetstream
from herald.constants import EVENTS_STREAM, JOBS_STREAM, NOTIFIER_CONSUMER, RESULTS_BUCKET, worker_consumer_name
from herald.jobs import JobRow
from herald.directory import Directory
from herald.sealing import Sealer
from herald.settings import DEV_KEY, DEV_TENANT, Settings
from herald.storage.ports import ResultBody, ResultStore
from herald.storage.results import (
    FileResultStore,
    NatsResultStore,
    ResultGone,
    UnavailableResultStore,
    ensure_result_buckets,
    index_stream,
    object_stream,
    open_result_store,
)
from tests.harness import NatsServer, free_port

MB = 1024 * 1024


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path_factory.mktemp("results-nats") / "store")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
async def nc(nats_server: NatsServer) -> AsyncIterator[NATS]:
    client = await nats.connect(nats_server.url)
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture()
def js(nc: NATS) -> JetStreamContext:
    return nc.jetstream()


async def nats_store(js: JetStreamContext, scratch: Path) -> NatsResultStore:
    # A bucket of the test's own, so tests never see each other's objects.
    store = NatsResultStore(js, f"T{uuid.uuid4().hex[:12]}", scratch, replicas=1)
    await store.ensure()
    return store


# Not "store": conftest parametrizes that name with the job store backends.
@pytest.fixture(params=["file", "nats"])
async def results(request: pytest.FixtureRequest, tmp_path: Path, js: JetStreamContext) -> ResultStore:
    if request.param == "file":
        return FileResultStore(tmp_path / "results", tmp_path / "scratch")
    return await nats_store(js, tmp_path / "scratch")


def new_job_id() -> str:
    return str(uuid.uuid4())


async def write_result(store: ResultStore, job_id: str, attempt: int, data: bytes, suffix: str = ".bin") -> str:
    path = store.scratch_path(job_id, attempt, suffix)
    path.write_bytes(data)
    return await store.commit(job_id, attempt, path)


async def read_all(body: ResultBody) -> bytes:
    return b"".join([chunk async for chunk in body.chunks])


# ----- the contract both stores keep ------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 200_000, 3 * MB + 17])
async def test_commit_then_open_streams_the_exact_bytes(results: ResultStore, size: int) -> None:
    job_id = new_job_id()
    data = os.urandom(size)
    scratch = results.scratch_path(job_id, 1, ".pdf")
    assert scratch.name.endswith("1.pdf.part")
    scratch.write_bytes(data)

    key = await results.commit(job_id, 1, scratch)

    assert key.endswith(f"{job_id}/1.pdf")
    assert not scratch.exists(), "the scratch file is consumed by commit"
    body = await results.open(key)
    assert body is not None
    assert body.size == size
    assert await read_all(body) == data


def _others_may_enter(path: Path, below: Path) -> bool:
    """Whether a user other than the owner may reach ``path`` through every directory the store
    made (or found) between ``below`` and it: each grants group or others the search bit."""
    made = [parent for parent in path.parents if below in parent.parents]
    return all(stat.S_IMODE(parent.stat().st_mode) & 0o011 for parent in made)


@pytest.mark.parametrize("existing", [False, True], ids=["made by the store", "there before, 0755"])
async def test_scratch_files_are_the_owners_only(results: ResultStore, tmp_path: Path, existing: bool) -> None:
    """A handler writes a tenant's result into its scratch file with the process's umask (0644),
    so no other local user may reach the directory that holds it; a directory found open is
    closed. (The NATS store's scratch dir, ``HERALD_DATA_DIR/scratch`` of a worker with
    PostgreSQL, was 0755: anyone on the machine read a running export as it was written.)"""
    if existing:
        for name in ("results", "scratch"):
            (tmp_path / name).mkdir(mode=0o755)
            (tmp_path / name).chmod(0o755)
    scratch = results.scratch_path(new_job_id(), 1, ".csv")
    scratch.parent.mkdir(parents=True, exist_ok=True)
    scratch.write_bytes(b"order_id,total\n1,99.5\n")
    assert not _others_may_enter(scratch, tmp_path), [(p, oct(stat.S_IMODE(p.stat().st_mode)))
                                                      for p in scratch.parents if tmp_path in p.parents]


async def test_open_of_a_missing_key_is_none(results: ResultStore) -> None:
    job_id = new_job_id()
    assert await results.open(f"{job_id}/1.bin") is None
    assert await results.open(f"{job_id[:2]}/{job_id}/1.bin") is None


async def test_discard_removes_one_result(results: ResultStore) -> None:
    job_id = new_job_id()
    lost = await write_result(results, job_id, 1, b"lost the race")
    kept = await write_result(results, job_id, 2, b"the winner")

    await results.discard(lost)
    await results.discard(lost)  # twice: a no-op

    assert await results.open(lost) is None
    body = await results.open(kept)
    assert body is not None and await read_all(body) == b"the winner"


async def test_delete_job_removes_all_its_results_and_only_its(results: ResultStore) -> None:
    job_id, other = new_job_id(), new_job_id()
    keys = [await write_result(results, job_id, attempt, b"x" * attempt) for attempt in (1, 2, 3)]
    other_key = await write_result(results, other, 1, b"someone else's")
    left_behind = results.scratch_path(job_id, 4, ".bin")  # an attempt that died mid-write
    left_behind.write_bytes(b"partial")

    await results.delete_job(job_id)
    await results.delete_job(job_id)  # twice: a no-op

    for key in keys:
        assert await results.open(key) is None
    assert not left_behind.exists()
    body = await results.open(other_key)
    assert body is not None and await read_all(body) == b"someone else's"


async def test_an_unread_body_holds_nothing_open(results: ResultStore) -> None:
    """A 304 or an aborted request may never iterate the body: nothing must leak."""
    key = await write_result(results, new_job_id(), 1, b"abc" * 1000)
    body = await results.open(key)
    assert body is not None and body.size == 3000
    await body.chunks.aclose()  # type: ignore[attr-defined]


# ----- the file store ---------------------------------------------------------------------


async def test_file_store_keeps_todays_layout(tmp_path: Path) -> None:
    """Results where they always were; scratch files in the process's own scratch dir (herald.scratch)."""
    store = FileResultStore(tmp_path / "results", tmp_path / "scratch")
    job_id = new_job_id()
    scratch = store.scratch_path(job_id, 2, ".csv")
    assert scratch.parent.parent == tmp_path / "scratch" and scratch.name == f"{job_id}.2.csv.part"
    scratch.write_bytes(b"a,b\n")
    key = await store.commit(job_id, 2, scratch)
    assert key == f"{job_id[:2]}/{job_id}/2.csv"
    assert (tmp_path / "results" / key).read_bytes() == b"a,b\n"
    await store.close()
    assert list((tmp_path / "scratch").iterdir()) == [], "a store closed takes its scratch dir along"


async def test_file_store_refuses_keys_outside_its_root(tmp_path: Path) -> None:
    store = FileResultStore(tmp_path / "results", tmp_path / "scratch")
    (tmp_path / "secret").write_bytes(b"no")
    with pytest.raises(ValueError):
        await store.open("../secret")
    with pytest.raises(ValueError):
        await store.open(str(tmp_path / "secret"))


# ----- the NATS store ---------------------------------------------------------------------


async def test_nats_bucket_and_index_have_the_replicas_asked_for(js: JetStreamContext, tmp_path: Path) -> None:
    store = await nats_store(js, tmp_path)
    for stream in (object_stream(store.bucket), index_stream(store.bucket)):
        config = (await js.stream_info(stream)).config
        assert config.num_replicas == 1
        assert config.storage == StorageType.FILE


async def test_nats_buckets_are_created_safely_by_many_processes_at_once(js: JetStreamContext) -> None:
    bucket = f"T{uuid.uuid4().hex[:12]}"
    await asyncio.gather(*(ensure_result_buckets(js, bucket, 1) for _ in range(8)))
    await ensure_result_buckets(js, bucket, 1)  # and again, once they exist
    assert (await js.stream_info(object_stream(bucket))).config.num_replicas == 1


async def test_nats_delete_leaves_nothing_in_the_bucket(js: JetStreamContext, tmp_path: Path) -> None:
    """nats-py's ObjectStore.delete keeps a "deleted" meta per object for ever; ours does not."""
    store = await nats_store(js, tmp_path)
    job_id = new_job_id()
    key = await write_result(store, job_id, 1, os.urandom(300_000))
    await write_result(store, job_id, 2, b"second")
    assert (await js.stream_info(object_stream(store.bucket))).state.messages > 0

    await store.discard(key)
    await store.delete_job(job_id)

    assert (await js.stream_info(object_stream(store.bucket))).state.messages == 0
    assert (await js.stream_info(index_stream(store.bucket))).state.messages == 0


async def test_nats_result_is_served_from_another_process_scratch_dir(js: JetStreamContext, tmp_path: Path) -> None:
    """A worker and a gateway share the bucket, not a disk."""
    worker = await nats_store(js, tmp_path / "worker")
    gateway = NatsResultStore(js, worker.bucket, tmp_path / "gateway", replicas=1)
    key = await write_result(worker, new_job_id(), 1, b"made elsewhere")
    body = await gateway.open(key)
    assert body is not None and await read_all(body) == b"made elsewhere"


async def test_nats_damaged_object_never_reads_as_complete(js: JetStreamContext, tmp_path: Path) -> None:
    store = await nats_store(js, tmp_path)
    data = os.urandom(300_000)
    key = await write_result(store, new_job_id(), 1, data)
    # Rewrite the meta with another object's digest (as a damaged copy would read).
    info = await js.get_last_msg(object_stream(store.bucket), f"$O.{store.bucket}.M.>")
    meta = json.loads(info.data or b"{}")
    meta["digest"] = "SHA-256=" + "A" * 43 + "="
    await js.publish(info.subject or "", json.dumps(meta).encode(), headers={"Nats-Rollup": "sub"})

    body = await store.open(key)
    assert body is not None
    received = b""
    with pytest.raises(DigestMismatchError):
        async for chunk in body.chunks:
            received += chunk
    assert len(received) < len(data), "the last chunk is held back when the digest is wrong"


async def test_nats_50mb_result_streams_with_flat_memory(js: JetStreamContext, tmp_path: Path) -> None:
    store = await nats_store(js, tmp_path)
    job_id = new_job_id()
    scratch = store.scratch_path(job_id, 1, ".bin")
    with scratch.open("wb") as fh:
        for _ in range(50):
            fh.write(os.urandom(MB))
    process = psutil.Process()

    before_upload = process.memory_info().rss
    key = await store.commit(job_id, 1, scratch)
    upload_growth = process.memory_info().rss - before_upload

    body = await store.open(key)
    assert body is not None and body.size == 50 * MB
    before = process.memory_info().rss
    peak, received = before, 0
    async for chunk in body.chunks:
        received += len(chunk)
        peak = max(peak, process.memory_info().rss)

    assert received == 50 * MB
    assert peak - before < 25 * MB, f"RSS grew by {(peak - before) / MB:.1f} MB while reading 50 MB"
    assert upload_growth < 25 * MB, f"RSS grew by {upload_growth / MB:.1f} MB while uploading 50 MB"
    await store.delete_job(job_id)


# ----- the factory ------------------------------------------------------------------------


async def test_factory_chooses_by_setting(js: JetStreamContext, tmp_path: Path) -> None:
    files = await open_result_store(Settings(data_dir=tmp_path), js)
    assert isinstance(files, FileResultStore) and files.root == tmp_path / "results"

    nats_settings = Settings(data_dir=tmp_path, result_store="nats")
    assert isinstance(await open_result_store(nats_settings, None), UnavailableResultStore)
    in_nats = await open_result_store(nats_settings, js)
    assert isinstance(in_nats, NatsResultStore) and in_nats.bucket == RESULTS_BUCKET
    assert (await js.stream_info(object_stream(RESULTS_BUCKET))).config.num_replicas == 1


# ----- the connection and the topology ----------------------------------------------------


async def test_connect_with_one_of_two_servers_down(nats_server: NatsServer) -> None:
    dead = f"nats://127.0.0.1:{free_port()}"
    for url in (f"{dead},{nats_server.url}", f"{nats_server.url}, {dead}"):
        client = await jetstream.connect(Settings(nats_url=url), name="test-cluster-url")
        try:
            assert client.is_connected
            assert client.connected_url is not None and client.connected_url.port == nats_server.port
            assert (await client.jetstream().account_info()) is not None
        finally:
            await client.close()


async def test_topology_has_the_replicas_and_the_result_bucket(js: JetStreamContext, tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, result_store="nats", nats_replicas=1)
    await jetstream.ensure_topology(js, settings)
    await jetstream.ensure_topology(js, settings)  # a second process starting: no error, no change
    for stream in (*(c.name or "" for c in jetstream.stream_configs(settings)), object_stream(RESULTS_BUCKET)):
        assert (await js.stream_info(stream)).config.num_replicas == 1
    assert (await js.consumer_info(EVENTS_STREAM, NOTIFIER_CONSUMER)).config.num_replicas == 1
    # Workers make their consumers per kind and tenant when first needed, with the same replicas.
    from herald.kinds import declared_kinds

    await jetstream.ensure_consumer(js, jetstream.worker_consumer(settings, declared_kinds()["report"], "acme", 3))
    info = await js.consumer_info(JOBS_STREAM, worker_consumer_name("report", "acme"))
    assert info.config.num_replicas == 1 and info.config.filter_subject == "jobs.report.acme"
    assert info.config.max_ack_pending == 3  # the tenant's max_running


async def test_nats_result_deleted_while_read_breaks_the_download(js: JetStreamContext, tmp_path: Path) -> None:
    store = await nats_store(js, tmp_path)
    job_id = new_job_id()
    key = await write_result(store, job_id, 1, os.urandom(1 * MB))
    body = await store.open(key)
    assert body is not None
    chunks = aiter(body.chunks)
    await anext(chunks)
    await store.delete_job(job_id)
    with pytest.raises(ResultGone):
        async for _ in chunks:
            pass


# ----- the gateway's download route -------------------------------------------------------

# The gateway declares parameters in the style litestar 2.25 deprecates (as every route does).
legacy_params = pytest.mark.filterwarnings("ignore::DeprecationWarning:litestar.*")


@dataclass
class _Jobs:
    """The two reads the route makes of the job store."""

    row: JobRow

    async def get(self, job_id: str) -> JobRow | None:
        return self.row if job_id == self.row.id else None

    async def get_for_tenant(self, tenant: str, job_id: str) -> JobRow | None:
        return self.row if (tenant, job_id) == (self.row.tenant, self.row.id) else None

    async def tombstone_tenant(self, job_id: str) -> str | None:
        return None


def _succeeded_job(key: str, job_id: str) -> JobRow:
    return JobRow(
        id=job_id, tenant=DEV_TENANT, kind="report", collection="/reports", state="succeeded", params=b"{}",
        progress=100, version=4, attempt=2, cancel_requested=False, created_at=0.0, updated_at=0.0,
        heartbeat_at=None, deadline_at=0.0, finished_at=0.0, expires_at=None, result_path=key,
        media_type="application/pdf", error=None, callback_url=None,
    )


def _download_app(results: ResultStore, job: JobRow) -> Litestar:
    kind = SimpleNamespace(name="report", collection="/reports")
    app = Litestar(
        route_handlers=[result_route(kind)],  # type: ignore[arg-type]
        exception_handlers={HTTPException: handle_http_exception},
    )
    settings = Settings(api_keys={DEV_KEY: DEV_TENANT})
    # The directory's HERALD_API_KEYS part needs no store: the route reads nothing else of it.
    directory = Directory(settings, store=None, sealer=Sealer(["a test key, thirty-two characters long"]))  # type: ignore[arg-type]
    app.state.services = SimpleNamespace(settings=settings, store=_Jobs(job), results=results, signer=None,
                                         directory=directory)
    return app


def _client(app: Litestar) -> httpx.AsyncClient:
    # On this loop (litestar's test client runs the app on another, where our NATS
    # connection cannot be used); the route needs no lifespan.
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")  # type: ignore[arg-type]


@legacy_params
async def test_download_streams_the_result_with_its_headers(results: ResultStore) -> None:
    job_id = new_job_id()
    data = os.urandom(300_000)
    key = await write_result(results, job_id, 2, data, suffix=".pdf")
    auth = {"Authorization": f"Bearer {DEV_KEY}"}
    async with _client(_download_app(results, _succeeded_job(key, job_id))) as client:
        response = await client.get(f"/reports/{job_id}", headers=auth)
        assert response.status_code == 200
        assert response.content == data
        assert response.headers["content-type"] == "application/pdf"
        assert response.headers["content-length"] == str(len(data))
        assert response.headers["content-disposition"] == f'attachment; filename="report-{job_id}.pdf"'
        assert response.headers["etag"] == f'"{job_id}-2"'
        assert response.headers["cache-control"] == "private, no-cache"
        assert response.headers["x-content-type-options"] == "nosniff"

        again = await client.get(f"/reports/{job_id}", headers={**auth, "If-None-Match": f'"{job_id}-2"'})
        assert again.status_code == 304 and again.content == b""

        await results.delete_job(job_id)
        gone = await client.get(f"/reports/{job_id}", headers=auth)
        assert gone.status_code == 410
        assert gone.json()["type"] == "/problems/gone"


@legacy_params
async def test_one_byte_range_is_answered_206_and_the_rest_as_http_allows(results: ResultStore) -> None:
    """A download that broke off resumes (``curl -C -``): one range is a ``206`` of exactly
    those bytes, across chunk boundaries, from either result store and from a row's result."""
    job_id = new_job_id()
    data = os.urandom(300_000)
    key = await write_result(results, job_id, 2, data, suffix=".pdf")
    file_job = _succeeded_job(key, job_id)
    row_job = dataclasses.replace(file_job, result_path=None, result_body=data[:1000], media_type="application/json")
    auth = {"Authorization": f"Bearer {DEV_KEY}"}
    tag = f'"{job_id}-2"'
    for job, body in ((file_job, data), (row_job, data[:1000])):
        size = len(body)
        async with _client(_download_app(results, job)) as client:
            async def get(**headers: str) -> httpx.Response:
                return await client.get(f"/reports/{job_id}", headers={**auth, **headers})

            whole = await get()
            assert whole.status_code == 200 and whole.headers["accept-ranges"] == "bytes"
            parts = {"bytes=0-9": (0, 9), "bytes=65530-131080": (65530, 131080), "bytes=500-": (500, size - 1),
                     "bytes=-700": (size - 700, size - 1), f"bytes={size - 2}-{size + 50}": (size - 2, size - 1)}
            for asked, (first, last) in parts.items():
                if first >= size:
                    continue
                part = await get(Range=asked)
                assert part.status_code == 206, (asked, part.text[:200])
                assert part.content == body[first:last + 1], asked
                assert part.headers["content-range"] == f"bytes {first}-{last}/{size}"
                assert part.headers["content-length"] == str(last - first + 1)
                assert part.headers["etag"] == tag and part.headers["content-type"] == whole.headers["content-type"]
            assert (await get(Range="bytes=0-3", **{"If-Range": tag})).status_code == 206
            # The whole result, as HTTP allows: several ranges, another unit, a malformed range,
            # an If-Range of another (or a weak) tag or a date.
            for headers in ({"Range": "bytes=0-1,5-6"}, {"Range": "lines=0-5"}, {"Range": "bytes=9-1"},
                            {"Range": "bytes=x-"}, {"Range": "bytes=" + "9" * 30 + "-"},
                            {"Range": "bytes=0-3", "If-Range": f"W/{tag}"},
                            {"Range": "bytes=0-3", "If-Range": "Fri, 04 Dec 2026 05:00:00 GMT"}):
                answer = await get(**headers)
                assert answer.status_code == 200 and answer.content == body, headers
            for asked in (f"bytes={size}-", f"bytes={size + 10}-{size + 20}", "bytes=-0"):
                unsatisfiable = await get(Range=asked)
                assert unsatisfiable.status_code == 416, asked
                assert unsatisfiable.headers["content-range"] == f"bytes */{size}"
                assert unsatisfiable.json()["type"] == "/problems/range-not-satisfiable"
            assert (await get(Range="bytes=0-3", **{"If-None-Match": tag})).status_code == 304  # judged first


@legacy_params
async def test_download_before_the_nats_store_is_connected_is_503() -> None:
    job_id = new_job_id()
    auth = {"Authorization": f"Bearer {DEV_KEY}"}
    app = _download_app(UnavailableResultStore(), _succeeded_job(f"{job_id}/2.pdf", job_id))
    async with _client(app) as client:
        response = await client.get(f"/reports/{job_id}", headers=auth)
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"


def test_a_copy_to_a_results_volume_that_fails_leaves_nothing_behind(tmp_path: Path) -> None:
    """Scratch on another filesystem than the results (/dev/shm against the test's tmp dir):
    the result is copied across. When that copy fails (here a real file-size limit, the
    kernel's EFBIG, as a full or failing volume fails it with ENOSPC or EIO), the partial
    copy is removed: it was left beside the result until retention, so every failed attempt
    kept space on a full volume. A copy that works is the owner's only, as a renamed one."""
    import resource

    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs /dev/shm on a filesystem of its own")
    from herald.storage.results import _install

    job_id = new_job_id()
    final = tmp_path / "results" / job_id / "1.pdf"
    scratch = shm / f"herald-test-{job_id}.part"
    try:
        scratch.write_bytes(b"x" * (512 * 1024))
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (128 * 1024, hard))  # Python ignores SIGXFSZ: write() fails
        try:
            with pytest.raises(OSError):
                _install(scratch, final)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        assert list(final.parent.iterdir()) == [], "no partial copy left on the results volume"
        _install(scratch, final)  # room again: the same scratch file becomes the result
        assert final.stat().st_size == 512 * 1024 and not scratch.exists()
        assert stat.S_IMODE(final.stat().st_mode) == 0o600
    finally:
        scratch.unlink(missing_ok=True)



@contextlib.contextmanager
def a_volume(directory: Path) -> Iterator[Callable[[bool], None]]:
    """``directory`` as a volume that can be made read-only for real, for whoever runs the
    test: a tmpfs mounted on it, remounted read-only and back, as root (whom permissions do
    not stop); its directories' modes (0500, 0700) otherwise. Yields ``read_only(flag)``."""
    directory.mkdir()
    root = os.geteuid() == 0

    def read_only(flag: bool) -> None:
        if root:
            subprocess.run(["mount", "-o", f"remount,{'ro' if flag else 'rw'}", str(directory)], check=True)
        else:
            for each in [directory, *(p for p in directory.rglob("*") if p.is_dir())]:
                each.chmod(0o500 if flag else 0o700)

    if root and subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(directory)], capture_output=True).returncode:
        pytest.skip("root without the right to mount a tmpfs")
    try:
        yield read_only
    finally:
        if root:
            subprocess.run(["umount", "-l", str(directory)], check=True)
        else:
            read_only(False)


async def test_retention_on_a_read_only_results_volume_keeps_the_result_until_it_can_delete_it(
        tmp_path: Path) -> None:
    """The sweeper forgets an expired job's row only after ``delete_job`` took its result, and
    tries again next pass when it raises. The file store ignored every error removing the
    job's directory, so on a results volume gone read-only the row went and the result stayed
    for good, past its retention, with nothing left to remove it. Now the failure is raised,
    and once the volume is writable again the result goes."""
    with a_volume(tmp_path / "results") as read_only:
        store = FileResultStore(tmp_path / "results", tmp_path / "scratch")
        job_id = new_job_id()
        scratch = store.scratch_path(job_id, 1, ".csv")
        scratch.write_bytes(b"a,b\n")
        result = tmp_path / "results" / await store.commit(job_id, 1, scratch)
        read_only(True)
        with pytest.raises(OSError):
            await store.delete_job(job_id)
        assert result.exists()
        read_only(False)
        await store.delete_job(job_id)
        assert not result.exists()
        await store.delete_job(job_id)  # gone already: nothing to say
        await store.close()



async def test_a_result_retention_cannot_remove_holds_back_only_its_own_job(tmp_path: Path) -> None:
    """SPEC §4: past ``expires_at`` the job, its result and history go within a sweep. One
    job whose result cannot be removed yet (on a results volume gone read-only) keeps its row
    for the next pass; the others expire now (it stopped the whole pass, every tenant's
    retention with it), and it follows once the volume is writable again."""
    from herald.storage.sqlite.db import Database
    from herald.storage.sqlite.jobs import SqliteJobStore
    from herald.storage.sqlite.schema import SCHEMA
    from herald.sweeper import sweep_once
    from herald.transitions import Change
    from schemas.problems import JOB_FAILED
    from tests.harness import make_sealer
    from tests.store_contract.support import CLAIM, new_job

    store = SqliteJobStore(Database(tmp_path / "herald.db", SCHEMA), retention_s=0.0, sealer=make_sealer())
    await store.open()
    settings = Settings(data_dir=tmp_path)
    try:
        with a_volume(tmp_path / "results") as read_only:
            results = FileResultStore(tmp_path / "results", tmp_path / "scratch")
            with_result, without = [(await store.accept(new_job())).job.id for _ in range(2)]
            for job_id in (with_result, without):
                await store.transition(job_id, CLAIM)
            scratch = results.scratch_path(with_result, 1, ".csv")
            scratch.write_bytes(b"a,b\n")
            key = await results.commit(with_result, 1, scratch)
            await store.transition(with_result, Change(expect={"running"}, to="succeeded", attempt=1, result_path=key))
            await store.transition(without, Change(expect={"running"}, to="failed", attempt=1,
                                                   error=JOB_FAILED.problem("no result")))
            read_only(True)
            await sweep_once(store, results, settings)
            assert await store.get(without) is None, "a job with nothing left to remove expires"
            assert await store.get(with_result) is not None, "kept until its result can go"
            read_only(False)
            await sweep_once(store, results, settings)
            assert await store.get(with_result) is None and not (tmp_path / "results" / key).exists()
            await results.close()
    finally:
        await store.close()
