"""No secret in plaintext at rest (SPEC §12, issue 20): webhook secrets, Ed25519 private keys,
callback secrets and the URL-signing key are sealed (AES-GCM) under HERALD_SECRET_KEY.

Checked the way an attacker with a copy of the store would look: every byte of the SQLite
file, its WAL and the data dir, every row of every PostgreSQL table, and the processes' logs.
"""

from __future__ import annotations

import asyncio
import base64
import os
import stat
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from standardwebhooks.webhooks import Webhook

from gateway.render import RESULT_PURPOSE
from herald.deliveries import callback_owner
from herald.sealing import KEY_FILE, SealError, Sealer, key_aad, load_or_create_key_file, load_sealer, secret_aad
from herald.settings import Settings, SettingsError
from herald.signing import UrlSigner
from herald.storage import build_storage, open_storage
from herald.webhook_signing import new_key
from launcher.pgserver import PostgresServer
from tests.harness import SECRET_KEY, Deployment, client, new_database, wait_for_state, wait_until
from tests.test_webhooks import Receiver, terminal_hit

KEY_A = "a-first-secret-key-of-32-characters-or-more"
KEY_B = "a-second-secret-key-of-32-characters-or-more"


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    server = Receiver().start()
    try:
        yield server
    finally:
        server.stop()
    assert not server.problems, "\n".join(server.problems)


# ----- the sealer ---------------------------------------------------------------------------


def test_a_sealed_secret_opens_only_unaltered_in_its_own_row_under_a_configured_key() -> None:
    sealer = Sealer([KEY_A])
    secret = os.urandom(32)
    aad = key_aad("endpoint-1", "hmac-sha256", None)
    blob = sealer.seal(secret, aad)
    assert sealer.is_sealed(blob) and not sealer.is_sealed(secret) and secret not in blob
    assert sealer.open(blob, aad) == secret
    assert sealer.seal(secret, aad) != blob  # a fresh nonce each time

    tampered = bytearray(blob)
    tampered[-1] ^= 1
    with pytest.raises(SealError, match="altered"):
        sealer.open(bytes(tampered), aad)
    with pytest.raises(SealError, match="another row"):  # copied into another endpoint's row
        sealer.open(blob, key_aad("endpoint-2", "hmac-sha256", None))
    with pytest.raises(SealError, match="HERALD_SECRET_KEY"):
        Sealer([KEY_B]).open(blob, aad)
    with pytest.raises(SealError, match="not a sealed secret"):
        sealer.open(secret, aad)


def test_the_first_key_seals_every_key_opens_and_reseal_moves_to_the_first() -> None:
    old, rotated = Sealer([KEY_A]), Sealer([KEY_B, KEY_A])
    aad = secret_aad("url-signing")
    under_old = old.seal(b"k" * 32, aad)
    assert rotated.open(under_old, aad) == b"k" * 32
    assert rotated.needs_reseal(under_old) and rotated.needs_reseal(b"k" * 32) and not old.needs_reseal(under_old)
    moved = rotated.reseal(under_old, aad)
    assert not rotated.needs_reseal(moved) and Sealer([KEY_B]).open(moved, aad) == b"k" * 32
    assert Sealer([KEY_B]).open(rotated.reseal(b"plain", aad), aad) == b"plain"  # plaintext: sealed


def test_secret_key_setting_is_a_list_of_long_keys_and_never_shown() -> None:
    settings = Settings.from_env({"HERALD_SECRET_KEY": f"{KEY_B}, {KEY_A}"})
    assert settings.secret_keys == (KEY_B, KEY_A)
    assert KEY_A not in repr(settings)
    with pytest.raises(SettingsError, match="HERALD_SECRET_KEY") as short:
        Settings.from_env({"HERALD_SECRET_KEY": f"{KEY_A},too-short"})
    assert "too-short" not in str(short.value)


def test_the_generated_key_file_is_owner_only_and_one_for_processes_starting_at_once(tmp_path: Path) -> None:
    path = tmp_path / "data" / KEY_FILE
    keys: list[str] = []
    start = threading.Barrier(8)

    def race() -> None:
        start.wait()
        keys.append(load_or_create_key_file(path))

    threads = [threading.Thread(target=race) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(keys)) == 1 and len(keys[0]) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == [KEY_FILE]  # no candidate left behind
    # SQLite without HERALD_SECRET_KEY seals with it; a key file others can read is refused.
    assert load_sealer(Settings(data_dir=tmp_path / "data")).current_prefix == Sealer([keys[0]]).current_prefix
    path.chmod(0o644)
    with pytest.raises(SettingsError, match="chmod 600"):
        load_sealer(Settings(data_dir=tmp_path / "data"))


@pytest.mark.parametrize("command", ["gateway", "worker", "notifier"])
def test_postgres_without_a_secret_key_exits_at_start_naming_the_variable(tmp_path: Path, command: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERALD_")}
    env.update(HERALD_DATA_DIR=str(tmp_path), HERALD_DATABASE_URL="postgresql://postgres@127.0.0.1:9/herald")
    done = subprocess.run([sys.executable, "-m", "launcher.cli", command], env=env, capture_output=True, timeout=60)
    assert done.returncode != 0
    assert b"HERALD_SECRET_KEY" in done.stderr
    assert not (tmp_path / KEY_FILE).exists()  # never a key generated for a shared store


@pytest.mark.parametrize("command", ["gateway", "worker", "notifier"])
def test_a_secret_key_set_after_the_store_was_sealed_is_refused_at_start_in_one_line(
        tmp_path: Path, command: str) -> None:
    """SQLite: ``herald up`` made a key file and sealed the store with it; setting
    HERALD_SECRET_KEY afterwards is an exit 2 that says so (and names the key file), before any
    process opens the store, not a traceback from each."""

    async def seal_with_the_key_file() -> None:
        storage = await open_storage(Settings(data_dir=tmp_path))
        try:
            await storage.jobs.signing_key()
        finally:
            await storage.close()

    asyncio.run(seal_with_the_key_file())
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERALD_")}
    env.update(HERALD_DATA_DIR=str(tmp_path), HERALD_SECRET_KEY=KEY_B)
    done = subprocess.run([sys.executable, "-m", "launcher.cli", command], env=env, capture_output=True, timeout=60)
    assert done.returncode == 2, done.stderr
    said = done.stderr.decode()
    assert "HERALD_SECRET_KEY" in said and str(tmp_path / KEY_FILE) in said and "Traceback" not in said
    assert KEY_B not in said


# ----- secrets at rest, in a running deployment ---------------------------------------------------


def _forms(secret: bytes) -> list[bytes]:
    """Every way a secret could be written down: raw, hex, base64 (both alphabets), whsec_."""
    b64 = base64.b64encode(secret)
    return [secret, secret.hex().encode(), secret.hex().upper().encode(), b64, b"whsec_" + b64,
            base64.urlsafe_b64encode(secret).rstrip(b"="), b64.rstrip(b"=")]


def _sealer_of(deployment: Deployment) -> Sealer:
    if deployment.database_url is not None:
        return Sealer([SECRET_KEY])
    key_file = deployment.data_dir / KEY_FILE
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600  # generated by the first process, owner-only
    return Sealer([key_file.read_text().strip()])


def _stored_rows(data_dir: Path, database_url: str | None) -> tuple[list[dict[str, Any]], dict[str, bytes]]:
    """The raw ``webhook_keys`` rows and ``herald_secrets`` values, as the store holds them."""
    if database_url is None:
        import sqlite3

        with sqlite3.connect(f"file:{data_dir / 'herald.db'}?mode=ro", uri=True) as db:
            db.row_factory = sqlite3.Row
            keys = [dict(r) for r in db.execute("SELECT * FROM webhook_keys")]
            values = {r["name"]: bytes(r["value"]) for r in db.execute("SELECT * FROM herald_secrets")}
        return keys, values

    async def read() -> tuple[list[dict[str, Any]], dict[str, bytes]]:
        conn = await asyncpg.connect(database_url)
        try:
            keys = [dict(r) for r in await conn.fetch("SELECT * FROM webhook_keys")]
            values = {r["name"]: bytes.fromhex(r["value"]) for r in await conn.fetch("SELECT * FROM herald_secrets")}
            return keys, values
        finally:
            await conn.close()

    return asyncio.run(read())


def _everything_stored(deployment: Deployment) -> dict[str, bytes]:
    """What a copy of the store holds: SQLite: every file under the data dir (the database,
    its WAL, the results); PostgreSQL: every row of every table, as text (bytea as hex)."""
    if deployment.database_url is None:
        return {str(p): p.read_bytes() for p in deployment.data_dir.rglob("*")
                if p.is_file() and p.name != KEY_FILE and "metrics" not in p.parts}

    async def read() -> dict[str, bytes]:
        conn = await asyncpg.connect(deployment.database_url)
        try:
            tables = [r["table_name"] for r in await conn.fetch(
                "SELECT table_name FROM information_schema.tables"
                " WHERE table_schema = current_schema() AND table_type = 'BASE TABLE'")]
            assert {"webhook_keys", "herald_secrets", "webhook_endpoints"} <= set(tables)
            found = {}
            for table in tables:
                rows = await conn.fetch(f'SELECT t::text AS row FROM "{table}" t')
                found[table] = "\n".join(r["row"] for r in rows).encode()
            return found
        finally:
            await conn.close()

    return asyncio.run(read())


def _leaks(haystacks: dict[str, bytes], needles: dict[str, list[bytes]]) -> list[str]:
    return [f"{what} in {where}" for where, data in haystacks.items()
            for what, forms in needles.items() if any(form in data for form in forms)]


def test_no_secret_in_the_store_or_the_logs(fresh: Deployment, receiver: Receiver) -> None:
    fresh.start_gateway()
    fresh.start_worker()
    fresh.start_notifier()
    with client(fresh.url()) as http:
        hmac_url, ed_url, cb_url = (receiver.route(p) for p in ("/hmac", "/ed25519", "/callback"))
        hmac_ep = http.post("/webhooks", json={"url": hmac_url, "event_types": ["job.succeeded"]}).json()
        ed_ep = http.post("/webhooks", json={"url": ed_url, "event_types": ["job.succeeded"],
                                             "signature": "ed25519"}).json()
        callback_secret = http.get("/webhooks/callback-secret").json()["secret"]
        receiver.routes["/hmac"].hmac.append(hmac_ep["secret"])
        receiver.routes["/ed25519"].ed25519.append(ed_ep["public_key"])
        receiver.routes["/callback"].hmac.append(callback_secret)
        job = http.post("/reports", json={"title": "sealed", "pages": 1, "callback_url": cb_url}).json()
        status = wait_for_state(http, job["id"], {"succeeded"})
        for path in ("/hmac", "/ed25519", "/callback"):  # signed with the secrets, verified by the receiver
            wait_until(lambda path=path: terminal_hit(receiver, path, job["id"]), what=f"delivery to {path}")

    # The secrets themselves, opened from the store with the deployment's key and checked
    # against what the API gave out (so the needles below are the real secrets).
    sealer = _sealer_of(fresh)
    keys, values = _stored_rows(fresh.data_dir, fresh.database_url)
    opened = {}
    for row in keys:
        public_key = bytes(row["public_key"]) if row["public_key"] is not None else None
        assert sealer.is_sealed(bytes(row["secret"]))
        opened[row["owner"]] = sealer.open(bytes(row["secret"]), key_aad(row["owner"], row["algorithm"], public_key))
    assert "whsec_" + base64.b64encode(opened[hmac_ep["id"]]).decode() == hmac_ep["secret"]
    assert "whsec_" + base64.b64encode(opened[callback_owner("acme")]).decode() == callback_secret
    ed_public = Ed25519PrivateKey.from_private_bytes(opened[ed_ep["id"]]).public_key().public_bytes(
        Encoding.Raw, PublicFormat.Raw)
    assert "whpk_" + base64.b64encode(ed_public).decode() == ed_ep["public_key"]
    url_key = sealer.open(values["url-signing"], secret_aad("url-signing"))
    result = urllib.parse.urlsplit(status["links"]["result"])
    query = dict(urllib.parse.parse_qsl(result.query))
    assert UrlSigner((url_key,), 900).verify(result.path, RESULT_PURPOSE, query["exp"], query["sig"])

    needles = {
        "the HMAC endpoint secret": _forms(opened[hmac_ep["id"]]),
        "the Ed25519 private key": _forms(opened[ed_ep["id"]]),
        "the callback secret": _forms(opened[callback_owner("acme")]),
        "the URL-signing key": _forms(url_key),
    }
    stored = _everything_stored(fresh)
    if fresh.database_url is None:
        assert str(fresh.data_dir / "herald.db") in stored and any(name.endswith("-wal") for name in stored)
        assert any("/results/" in name for name in stored)
    assert _leaks(stored, needles) == []
    logs = {p.name: p.read_bytes() for p in fresh.logs.iterdir()}
    key_itself = {"the secret key": [SECRET_KEY.encode(), *(
        [(fresh.data_dir / KEY_FILE).read_bytes().strip()] if fresh.database_url is None else [])]}
    assert _leaks(logs, {**needles, **key_itself}) == []


# ----- a store an older Herald wrote -----------------------------------------------------------------


def _write_like_main(data_dir: Path, database_url: str | None, endpoints: dict[str, bytes], url: str,
                     url_key: bytes) -> None:
    """Endpoints, their HMAC keys and the URL-signing key, as ``main`` before sealing wrote them:
    the secrets in plaintext. The schema is made by opening the store (it is unchanged)."""
    settings = Settings(data_dir=data_dir, database_url=database_url, secret_keys=(SECRET_KEY,) if database_url else ())

    async def schema() -> None:
        storage = await open_storage(settings)
        await storage.close()

    asyncio.run(schema())
    ts = time.time()
    if database_url is None:
        import sqlite3

        with sqlite3.connect(data_dir / "herald.db") as db:
            for endpoint_id, secret in endpoints.items():
                db.execute("INSERT INTO webhook_endpoints (id, tenant, url, event_types, kinds, signature, status,"
                           " created_at, updated_at) VALUES (?, 'acme', ?, ?, NULL, 'hmac-sha256', 'enabled', ?, ?)",
                           (endpoint_id, url, msgspec.json.encode(["job.succeeded"]).decode(), ts, ts))
                db.execute("INSERT INTO webhook_keys (owner, created_at, algorithm, secret, public_key)"
                           " VALUES (?, ?, 'hmac-sha256', ?, NULL)", (endpoint_id, ts, secret))
            db.execute("INSERT INTO herald_secrets (name, value) VALUES ('url-signing', ?)", (url_key,))
        return

    async def write() -> None:
        conn = await asyncpg.connect(database_url)
        try:
            for endpoint_id, secret in endpoints.items():
                await conn.execute(
                    "INSERT INTO webhook_endpoints (id, tenant, url, event_types, kinds, signature, status, created_at,"
                    " updated_at) VALUES ($1, 'acme', $2, $3, NULL, 'hmac-sha256', 'enabled', $4, $4)",
                    endpoint_id, url, ["job.succeeded"], ts)
                await conn.execute("INSERT INTO webhook_keys (owner, created_at, algorithm, secret, public_key)"
                                   " VALUES ($1, $2, 'hmac-sha256', $3, NULL)", endpoint_id, ts, secret)
            await conn.execute("INSERT INTO herald_secrets (name, value) VALUES ('url-signing', $1)", url_key.hex())
        finally:
            await conn.close()

    asyncio.run(write())


def test_a_store_written_by_main_is_sealed_at_start_and_its_secrets_still_verify(
        fresh: Deployment, receiver: Receiver) -> None:
    endpoint_id, secret, url_key = str(uuid.uuid4()), new_key("hmac-sha256").secret, os.urandom(32)
    whsec = "whsec_" + base64.b64encode(secret).decode()
    _write_like_main(fresh.data_dir, fresh.database_url, {endpoint_id: secret}, receiver.route("/old"), url_key)
    receiver.routes["/old"].hmac.append(whsec)

    fresh.start_gateway()
    fresh.start_worker()
    fresh.start_notifier()
    keys, values = _stored_rows(fresh.data_dir, fresh.database_url)
    (row,) = keys
    assert Sealer.is_sealed(bytes(row["secret"])) and secret not in bytes(row["secret"])
    assert Sealer.is_sealed(values["url-signing"]) and url_key not in values["url-signing"]

    with client(fresh.url()) as http:
        job = http.post("/reports", json={"title": "migrated", "pages": 1}).json()
        status = wait_for_state(http, job["id"], {"succeeded"})
    hit = wait_until(lambda: terminal_hit(receiver, "/old", job["id"]), what="delivery to the migrated endpoint")
    assert Webhook(whsec).verify(hit.body, hit.headers)["type"] == "job.succeeded"  # the original secret
    result = urllib.parse.urlsplit(status["links"]["result"])
    query = dict(urllib.parse.parse_qsl(result.query))
    assert UrlSigner((url_key,), 900).verify(result.path, RESULT_PURPOSE, query["exp"], query["sig"])


def test_processes_starting_at_once_seal_each_plaintext_secret_exactly_once(
        tmp_path: Path, store_server: PostgresServer | None) -> None:
    database_url = new_database(store_server) if store_server is not None else None
    endpoints = {str(uuid.uuid4()): os.urandom(32) for _ in range(30)}
    url_key = os.urandom(32)
    _write_like_main(tmp_path, database_url, endpoints, "https://hooks.example.com/x", url_key)
    settings = Settings(data_dir=tmp_path, database_url=database_url, secret_keys=(SECRET_KEY,))

    async def start_four() -> None:
        stores = [build_storage(settings) for _ in range(4)]  # four processes' stores
        try:
            await asyncio.gather(*(s.jobs.open() for s in stores))
        finally:
            await asyncio.gather(*(s.close() for s in stores))

    asyncio.run(start_four())
    keys, values = _stored_rows(tmp_path, database_url)
    sealer = Sealer([SECRET_KEY])
    # Sealed twice, a row would open to a sealed blob, not to the original secret.
    assert {row["owner"]: sealer.open(bytes(row["secret"]), key_aad(row["owner"], "hmac-sha256", None))
            for row in keys} == endpoints
    assert sealer.open(values["url-signing"], secret_aad("url-signing")) == url_key


# ----- rotation ---------------------------------------------------------------------------------------


def _settings(tmp_path: Path, database_url: str | None, keys: tuple[str, ...]) -> Settings:
    return Settings(data_dir=tmp_path, database_url=database_url, secret_keys=keys)


def test_reencrypt_moves_every_secret_to_the_first_key(tmp_path: Path, store_server: PostgresServer | None) -> None:
    database_url = new_database(store_server) if store_server is not None else None

    async def write_under_old() -> tuple[bytes, bytes, str]:
        storage = await open_storage(_settings(tmp_path, database_url, (KEY_A,)))
        try:
            endpoint, key = await storage.webhooks.create_endpoint(
                "acme", url="https://hooks.example.com/x", event_types=["job.succeeded"], kinds=None,
                signature="ed25519")
            return await storage.jobs.signing_key(), (await storage.webhooks.callback_key("acme")).secret, endpoint.id
        finally:
            await storage.close()

    url_key, callback_secret, endpoint_id = asyncio.run(write_under_old())

    env = {k: v for k, v in os.environ.items() if not k.startswith("HERALD_")}
    env.update(HERALD_DATA_DIR=str(tmp_path), HERALD_SECRET_KEY=f"{KEY_B},{KEY_A}")
    if database_url is not None:
        env["HERALD_DATABASE_URL"] = database_url
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "secrets", "reencrypt"], env=env,
                          capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert b"re-encrypted 3 secret(s)" in done.stdout
    assert KEY_A.encode() not in done.stdout + done.stderr and KEY_B.encode() not in done.stdout + done.stderr

    async def read_under_new_alone() -> None:
        storage = await open_storage(_settings(tmp_path, database_url, (KEY_B,)))
        try:
            assert await storage.jobs.signing_key() == url_key
            assert (await storage.webhooks.callback_key("acme")).secret == callback_secret
        finally:
            await storage.close()
        old_only = build_storage(_settings(tmp_path, database_url, (KEY_A,)))
        try:
            with pytest.raises(SealError, match="HERALD_SECRET_KEY"):  # the old key alone no longer opens the store
                await old_only.jobs.open()
        finally:
            await old_only.close()

    asyncio.run(read_under_new_alone())
    keys, _values = _stored_rows(tmp_path, database_url)
    new_only = Sealer([KEY_B])
    assert {row["owner"] for row in keys} == {endpoint_id, callback_owner("acme")}
    for row in keys:  # the endpoint's Ed25519 key opens under the new key alone too
        public_key = bytes(row["public_key"]) if row["public_key"] is not None else None
        new_only.open(bytes(row["secret"]), key_aad(row["owner"], row["algorithm"], public_key))
