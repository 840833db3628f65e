"""A worker killed mid-job leaves no partial result on disk for long (``herald.scratch``).

Each worker writes its handlers' scratch files (``ctx.output``) in a directory of its own
under ``HERALD_DATA_DIR/scratch``, locked for its life. A worker that starts (a restarted one,
a sibling) removes the directories whose owner is gone, and never a live worker's. Both
shapes: ``herald up``'s, whose workers share one data dir (SQLite: the file result store;
PostgreSQL: the NATS one), and ``herald up --cluster``'s, whose workers each have their own,
kept when the supervisor restarts a killed one. The worker is killed for real (SIGKILL), in the
middle of writing its file.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx

from herald.scratch import OWNER_FILE, STAGING_PREFIX, remove_orphans
from launcher.pgserver import PostgresServer
from tests.harness import Deployment, client, new_database, wait_for_state, wait_until

PARTIAL_KIND = "tests.kinds_fixture:PARTIAL"
SLEEP_MS = 8000  # how long each job keeps its half-written file open: longer than the test needs


def _partial_job(http: httpx.Client, message: str) -> str:
    started = http.post("/partials", json={"message": message, "sleep_ms": SLEEP_MS})
    assert started.status_code == 202, started.text
    return str(started.json()["id"])


def _writing(data_dir: Path, job_id: str) -> Path:
    """The job's half-written result file, wherever under ``data_dir`` its worker keeps it."""

    def found() -> Path | None:
        for path in data_dir.rglob("*.part"):
            if job_id in str(path) and path.read_bytes().startswith(b"half of "):
                return path
        return None

    return wait_until(found, timeout=30, what=f"a worker writing job {job_id}'s result")


def _removed_by(deployment: Deployment, name: str, directory: Path) -> list[dict[str, Any]]:
    return deployment.logged(name, "removed the scratch directory of a process that is gone", directory=str(directory))


def test_a_worker_killed_mid_job_has_its_scratch_dir_removed_by_the_next_never_a_live_ones(fresh: Deployment) -> None:
    """``herald up``: one data dir. Worker 1 is killed while it writes a result; worker 2, alive,
    is writing another. The worker that starts next removes worker 1's directory and leaves
    worker 2's; the killed job runs again elsewhere and succeeds with a whole result."""
    fresh.env_overrides.update(HERALD_KINDS=PARTIAL_KIND)
    base = fresh.start_gateway()
    scratch_root = fresh.data_dir / "scratch"
    with client(base) as http:
        killed = fresh.start_worker("worker-1")
        first = _partial_job(http, "half of the first")
        doomed = _writing(fresh.data_dir, first)
        alive = fresh.start_worker("worker-2")
        second = _partial_job(http, "half of the second")  # worker 1's one slot of the kind is taken
        kept = _writing(fresh.data_dir, second)

        fresh.kill("worker-1")  # SIGKILL, mid-write
        assert doomed.exists(), "the killed worker's partial file is left behind"
        fresh.start_worker("worker-3")
        wait_until(lambda: not doomed.exists(), timeout=30, what="the killed worker's partial file removed")
        # With its directory, which was the killed worker's own, and nobody else's.
        assert doomed.parent.parent == scratch_root and doomed.parent.name.startswith(f"{killed.pid}-")
        assert not doomed.parent.exists()
        wait_until(lambda: _removed_by(fresh, "worker-3", doomed.parent), what="the removal logged")
        # The live worker's directory, and the file it is writing, are untouched.
        assert kept.parent.name.startswith(f"{alive.pid}-")
        assert kept.exists() and (kept.parent / OWNER_FILE).exists()
        assert not _removed_by(fresh, "worker-3", kept.parent)

        # The killed job is re-queued (heartbeat timeout) and ends with a whole result.
        for job_id, message in ((second, "half of the second"), (first, "half of the first")):
            done = wait_for_state(http, job_id, {"succeeded"}, timeout=60)
            result = http.get(f"/partials/{job_id}")
            assert result.status_code == 200 and result.text == f"{message}\ndone\n", (done, result.text)
    fresh.stop()
    # Every worker stopped cleanly took its own directory along.
    assert [p.name for p in scratch_root.iterdir()] == []


def test_a_restarted_worker_removes_its_killed_predecessors_scratch_dir_in_its_own_data_dir(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    """``herald up --cluster``: PostgreSQL, the NATS result store, and a data dir per process,
    which the supervisor keeps when it restarts a killed worker (launcher/cluster_up.py).
    Nothing else ever looked there: a worker killed mid-job left its partial result for good."""
    deployment = Deployment(tmp_path / "herald", env_overrides={"HERALD_KINDS": PARTIAL_KIND},
                            database_url=new_database(postgres_server))
    deployment.nats.start()
    own = tmp_path / "worker-1"
    try:
        base = deployment.start_gateway()
        with client(base) as http:
            killed = deployment.start_worker("worker-1", HERALD_DATA_DIR=str(own))
            job = _partial_job(http, "half of a result")
            doomed = _writing(own, job)
            deployment.kill("worker-1")
            assert doomed.exists()
            deployment.start_worker("worker-1-again", HERALD_DATA_DIR=str(own))  # the supervisor's restart
            wait_until(lambda: not doomed.exists(), timeout=30, what="the killed worker's partial file removed")
            assert doomed.parent.name.startswith(f"{killed.pid}-") and not doomed.parent.exists()
            wait_until(lambda: _removed_by(deployment, "worker-1-again", doomed.parent), what="the removal logged")
            wait_for_state(http, job, {"succeeded"}, timeout=60)
            assert http.get(f"/partials/{job}").text == "half of a result\ndone\n"
    finally:
        deployment.stop()


_CLAIMER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from herald.scratch import ScratchDir
    scratch = ScratchDir(Path(sys.argv[1]))
    (scratch.path / "job.1.csv.part").write_bytes(b"partial")
    print(scratch.path, flush=True)
    sys.stdin.read()  # until told to end (or killed)
""")


def test_only_directories_whose_owner_is_gone_are_removed(tmp_path: Path) -> None:
    """The lock, not the pid, says who is alive: a live process's directory (another's, or this
    process's own) stays; a killed one's goes, once; a half-made one goes only when stale."""
    root = tmp_path / "scratch"

    def claimer() -> tuple[subprocess.Popen[str], Path]:
        process = subprocess.Popen([sys.executable, "-c", _CLAIMER, str(root)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, env={**os.environ})
        assert process.stdout is not None
        return process, Path(process.stdout.readline().strip())

    (live, live_dir), (dead, dead_dir) = claimer(), claimer()
    try:
        from herald.scratch import ScratchDir

        mine = ScratchDir(root)
        own_dir = mine.path
        dead.send_signal(signal.SIGKILL)
        dead.wait(10)
        staging = root / f"{STAGING_PREFIX}1-abcd"
        staging.mkdir()  # a process died between making its directory and locking it, just now
        (root / "7.1.csv.part").write_bytes(b"an older Herald's flat file")

        assert remove_orphans(root) == [dead_dir]
        assert not dead_dir.exists() and live_dir.exists() and own_dir.exists() and staging.exists()
        assert (live_dir / "job.1.csv.part").exists() and (root / "7.1.csv.part").exists()
        assert remove_orphans(root) == []  # nothing twice
        os.utime(staging, (1.0, 1.0))  # long ago
        assert remove_orphans(root) == [staging]

        mine.close()
        mine.close()  # twice: a no-op
        assert not own_dir.exists()
    finally:
        for process in (live, dead):
            if process.poll() is None:
                process.kill()
            process.wait(10)
            if process.stdin:
                process.stdin.close()
            if process.stdout:
                process.stdout.close()
    assert remove_orphans(root) == [live_dir]  # killed now too
