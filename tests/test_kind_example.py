"""The worked example (examples/wordfreq) as a user runs it: pip install it beside Herald,
``herald up``, start a job through the HTTP API, read its JSON result.

The package is installed (``pip install --target``) into a directory of the module's own
that only this test's ``herald up`` has on its path: the venv the other tests run from,
several at once, never sees a package half installed or half removed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.harness import TLS, free_port, wait_until

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "wordfreq"
KEY = "key-example"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _pip(*argv: str) -> None:
    run = subprocess.run([sys.executable, "-m", "pip", *argv], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


@pytest.fixture(scope="module")
def wordfreq_installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    target = tmp_path_factory.mktemp("site")
    build = tmp_path_factory.mktemp("build")
    copy = build / "wordfreq"
    shutil.copytree(EXAMPLE, copy)  # pip builds in the source tree: leave the checkout clean
    _pip("install", "--quiet", "--no-deps", "--target", str(target), str(copy))
    yield target


@pytest.fixture()
def up(wordfreq_installed: Path, tmp_path: Path) -> Iterator[str]:
    port, nats_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HERALD_", "PROMETHEUS_"))}
    env.update(HERALD_HTTP_PORT=str(port), HERALD_NATS_PORT=str(nats_port), HERALD_DATA_DIR=str(tmp_path / "var"),
               HERALD_WORKERS="1", HERALD_API_KEYS=f"acme:{KEY}", PYTHONPATH=str(wordfreq_installed))
    log = open(tmp_path / "up.log", "wb")  # noqa: SIM115  (closed below, after the process)
    # From another directory than the checkout: the kind is found as an installed package.
    process = subprocess.Popen([str(Path(sys.executable).parent / "herald"), "up"], env=env, stdout=log, stderr=log,
                               cwd=tmp_path)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(base + "/readyz", timeout=1, verify=TLS).status_code == 200, timeout=40, what="herald up")
        yield base
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(30)
        log.close()
        assert code == 0, (tmp_path / "up.log").read_text()[-3000:]


def _finished(http: httpx.Client, job_id: str) -> dict:
    return wait_until(lambda: (b := http.get(f"/jobs/{job_id}").json())["state"] in ("succeeded", "failed") and b,
                      timeout=30, what=f"job {job_id} finished")


def _readme_example() -> tuple[dict, dict]:
    """The body the example's README posts, and the answer it shows (``# {...}`` comment lines;
    a ``...`` closing the top list leaves out the rest of it)."""
    text = (EXAMPLE / "README.md").read_text()
    body = re.search(r"POST localhost:8000/wordfreq .*?-d '(\{.*?\})'", text, re.DOTALL)
    shown = re.search(r'^# (\{"words".*\n(?:#  .*\n)*)', text, re.MULTILINE)
    assert body and shown, "the README's example request or answer moved"
    answer = "".join(line.lstrip("#").strip() for line in shown.group(1).splitlines())
    return json.loads(body.group(1)), json.loads(re.sub(r",\s*\.\.\.\s*\]", "]", answer))


def test_the_example_kind_runs_under_herald_up(up: str) -> None:
    text = "Alpha beta beta gamma, gamma gamma; the and of.\n" * 1000
    with httpx.Client(base_url=up, headers=AUTH, timeout=10) as http:
        accepted = http.post("/wordfreq", json={"text": text, "top": 2})
        assert accepted.status_code == 202, accepted.text
        job = _finished(http, accepted.json()["id"])
        assert job["state"] == "succeeded" and job["kind"] == "wordfreq" and job["progress"] == 100
        assert job["result"] == f"/wordfreq/{job['id']}"

        result = http.get(job["result"])
        assert result.status_code == 200 and result.headers["content-type"] == "application/json"
        assert result.json() == {
            "words": 6000, "distinct": 3, "skipped": 3000,
            "top": [{"word": "gamma", "count": 3000, "share": 0.5}, {"word": "beta", "count": 2000, "share": 0.3333}],
        }
        assert httpx.get(up + job["links"]["result"]).json() == result.json()  # the signed URL, no key

        # The README's example answers what the README shows ("on" and "with" are stopwords too).
        body, shown = _readme_example()
        readme_job = _finished(http, http.post("/wordfreq", json=body).json()["id"])
        answer = http.get(readme_job["result"]).json()
        assert {**answer, "top": answer["top"][:len(shown["top"])]} == shown

        # The kind's own problem type, and validation from its Struct.
        failed = _finished(http, http.post("/wordfreq", json={"text": "the and of"}).json()["id"])
        assert failed["state"] == "failed"
        assert failed["error"]["type"] == "/problems/wordfreq-no-words"
        assert failed["error"]["title"] == "No words left to count" and "3 words" in failed["error"]["detail"]
        invalid = http.post("/wordfreq", json={"text": "", "top": 0, "colour": "red"})
        assert invalid.status_code == 400
        assert {e["field"] for e in invalid.json()["errors"]} == {"text", "top", "colour"}

    spec = httpx.get(up + "/schema/openapi.json").json()
    body = spec["paths"]["/wordfreq"]["post"]["requestBody"]["content"]["application/json"]
    assert body["example"]["top"] == 5 and body["schema"] == {"$ref": "#/components/schemas/WordFreqParams"}
    assert {"text", "top", "stopwords"} <= set(spec["components"]["schemas"]["WordFreqParams"]["properties"])
    metrics = httpx.get(up + "/metrics").text
    assert 'herald_kind_queue_oldest_age_seconds{kind="wordfreq"}' in metrics
    assert 'herald_jobs_finished_total{kind="wordfreq",state="succeeded"} 2.0' in metrics
