"""Secrets at rest (SPEC §12): every secret a store keeps is sealed with AES-256-GCM.

A sealed blob is ``MAGIC | fingerprint (8) | nonce (12) | ciphertext and tag``. The
fingerprint names the configured key that sealed it (so ``open`` needs no trial and
error, and ``needs_reseal`` can tell an old key's blob without opening it); the
associated data is the row's identity, so a blob copied into another row does not open.

The AES keys are derived with HKDF-SHA256 from the operator's ``HERALD_SECRET_KEY``
(a comma-separated list: the first seals, every one opens, for rotation). Without it,
on one machine, a key is generated once into ``HERALD_DATA_DIR/secret.key``; PostgreSQL
serves many machines, which must all hold the same key, so there it must be set.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Sequence
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from herald.settings import Settings, SettingsError

# Six bytes: a plaintext secret (random bytes) starts with them once in 2**48.
MAGIC = b"hsl\x00v1"
FINGERPRINT_BYTES = 8
NONCE_BYTES = 12
TAG_BYTES = 16
_HEADER = len(MAGIC) + FINGERPRINT_BYTES + NONCE_BYTES
_SALT = b"herald secret key"
KEY_FILE = "secret.key"
SECRET_KEY_VARIABLE = "HERALD_SECRET_KEY"


class SealError(Exception):
    """A blob that no configured key opens (another key, tampered, or another row's)."""


def unknown_key_error(where: str) -> SealError:
    return SealError(
        f"{where} holds secrets sealed under a key that {SECRET_KEY_VARIABLE} does not hold: set the key they "
        "were sealed with (after the new one while rotating, see the README's \"Secrets at rest\")"
    )


def _derive(key: str, info: bytes, length: int) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=_SALT, info=info).derive(key.encode())


def key_aad(owner: str, algorithm: str, public_key: bytes | None) -> bytes:
    """A webhook signing key's identity: its owner (endpoint or a tenant's callbacks), its
    scheme and, for Ed25519, its public half. (The owner's keys differ by ``created_at``,
    which PostgreSQL assigns inside the insert; a blob moved between one owner's keys
    gains an attacker nothing.)"""
    return b"webhook_keys|" + owner.encode() + b"|" + algorithm.encode() + b"|" + (public_key or b"")


def secret_aad(name: str) -> bytes:
    """A row of ``herald_secrets`` (the URL-signing key)."""
    return b"herald_secrets|" + name.encode()


class Sealer:
    """Seals with the first key, opens with any of them."""

    def __init__(self, keys: Sequence[str]) -> None:
        if not keys:
            raise ValueError("a Sealer needs at least one key")
        self._ciphers: dict[bytes, AESGCM] = {}
        self._fingerprints: list[bytes] = []
        for key in keys:
            fingerprint = _derive(key, b"herald sealing v1 fingerprint", FINGERPRINT_BYTES)
            self._ciphers.setdefault(fingerprint, AESGCM(_derive(key, b"herald sealing v1 aes-256-gcm", 32)))
            self._fingerprints.append(fingerprint)
        self._current = self._fingerprints[0]
        self._tag_key = _derive(keys[0], b"herald tags v1 hmac-sha256", 32)

    def tag(self, text: str, length: int = 12) -> str:
        """A short stable name for ``text`` that only a holder of the first key can compute
        (HMAC-SHA256, hex): an id for a secret that must reveal nothing of it, not even to
        whoever tries guesses offline against it."""
        return hmac.new(self._tag_key, text.encode(), hashlib.sha256).hexdigest()[:length]

    @property
    def current_prefix(self) -> bytes:
        """What every blob sealed by the first key starts with."""
        return MAGIC + self._current

    @staticmethod
    def is_sealed(blob: bytes) -> bool:
        return len(blob) >= _HEADER + TAG_BYTES and blob.startswith(MAGIC)

    def needs_reseal(self, blob: bytes) -> bool:
        """Plaintext, or sealed under a key other than the first."""
        return not blob.startswith(self.current_prefix) or not self.is_sealed(blob)

    def knows(self, blob: bytes) -> bool:
        """Sealed under one of the configured keys, judged by the fingerprint (not opened; the
        blob's head is enough)."""
        return blob.startswith(MAGIC) and blob[len(MAGIC):len(MAGIC) + FINGERPRINT_BYTES] in self._ciphers

    def seal(self, plaintext: bytes, aad: bytes) -> bytes:
        nonce = secrets.token_bytes(NONCE_BYTES)
        return self.current_prefix + nonce + self._ciphers[self._current].encrypt(nonce, plaintext, aad)

    def open(self, blob: bytes, aad: bytes) -> bytes:
        blob = bytes(blob)
        if not self.is_sealed(blob):
            raise SealError("not a sealed secret (a plaintext row the start-up migration has not sealed?)")
        fingerprint = blob[len(MAGIC):len(MAGIC) + FINGERPRINT_BYTES]
        cipher = self._ciphers.get(fingerprint)
        if cipher is None:
            raise SealError(f"sealed under a key that {SECRET_KEY_VARIABLE} does not hold (fingerprint {fingerprint.hex()})")
        nonce = blob[len(MAGIC) + FINGERPRINT_BYTES:_HEADER]
        try:
            return cipher.decrypt(nonce, blob[_HEADER:], aad)
        except InvalidTag:
            raise SealError("a sealed secret does not open: altered, or copied from another row") from None

    def reseal(self, blob: bytes, aad: bytes) -> bytes:
        """Sealed under the first key: a plaintext value sealed, another key's blob re-sealed."""
        return self.seal(self.open(blob, aad) if self.is_sealed(blob) else bytes(blob), aad)


def load_sealer(settings: Settings) -> Sealer:
    """The keys of ``HERALD_SECRET_KEY``; unset, the generated key file (SQLite only).

    Raises ``SettingsError`` naming the variable with PostgreSQL and no key."""
    if settings.secret_keys:
        return Sealer(settings.secret_keys)
    if settings.uses_postgres:
        raise SettingsError(
            f"{SECRET_KEY_VARIABLE} must be set with PostgreSQL (HERALD_DATABASE_URL): every process of the "
            "deployment seals and opens the store's secrets with it (at least 32 characters, e.g. "
            "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
        )
    return Sealer([load_or_create_key_file(settings.data_dir / KEY_FILE)])


def load_or_create_key_file(path: Path) -> str:
    """The key kept in ``path``, made on first use (mode 0600).

    Several processes may start at once: each writes a candidate to a file of its own, then
    links it to ``path``, which succeeds for exactly one of them (like O_EXCL, and the file
    is complete the moment it appears); the others read the winner's key."""
    try:
        return _read_key_file(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    candidate = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(32) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(candidate, path)
        except FileExistsError:
            pass  # another process won; its key is the one
    finally:
        candidate.unlink(missing_ok=True)
    return _read_key_file(path)


def _read_key_file(path: Path) -> str:
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SettingsError(f"{path} (the store's secret key) is readable by others: chmod 600 it")
    key = path.read_text().strip()
    if len(key) < 32:
        raise SettingsError(f"{path} (the store's secret key) must hold at least 32 characters")
    return key
