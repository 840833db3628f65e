"""Standard Webhooks signatures: HMAC-SHA256 (``v1,``) and Ed25519 (``v1a,``).

The signed content is ``"<webhook-id>.<webhook-timestamp>.<body>"``. Every key an owner
holds signs (the current one and, for 24 h after a rotation, the previous one: see
``herald.delivery_rules``), and the signatures are sent space-separated in one
``webhook-signature`` header, so a receiver that still knows only the old secret keeps
verifying while it updates.

Core, not the notifier's: the stores make, seal and hand out these keys, the gateway shows
them once, the notifier signs with them.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

SECRET_PREFIX = "whsec_"
PUBLIC_KEY_PREFIX = "whpk_"
HMAC = "hmac-sha256"
ED25519 = "ed25519"
SECRET_BYTES = 32  # Standard Webhooks asks for 24..64 random bytes


@dataclass(frozen=True, slots=True)
class SigningKey:
    """One key. For HMAC ``secret`` is the shared secret; for Ed25519 the raw private key."""

    algorithm: str
    secret: bytes
    public_key: bytes | None = None

    @property
    def shown_secret(self) -> str | None:
        """``whsec_…`` for an HMAC key (what its owner verifies with); None for Ed25519."""
        return SECRET_PREFIX + base64.b64encode(self.secret).decode() if self.algorithm == HMAC else None

    @property
    def shown_public_key(self) -> str | None:
        """``whpk_…`` for an Ed25519 key; its private half never leaves the server."""
        if self.algorithm != ED25519 or self.public_key is None:
            return None
        return PUBLIC_KEY_PREFIX + base64.b64encode(self.public_key).decode()

    def sign(self, content: bytes) -> str:
        if self.algorithm == ED25519:
            signature = Ed25519PrivateKey.from_private_bytes(self.secret).sign(content)
            return "v1a," + base64.b64encode(signature).decode()
        digest = hmac.new(self.secret, content, hashlib.sha256).digest()
        return "v1," + base64.b64encode(digest).decode()


def new_key(algorithm: str) -> SigningKey:
    if algorithm == ED25519:
        private = Ed25519PrivateKey.generate()
        return SigningKey(
            algorithm=ED25519,
            secret=private.private_bytes_raw(),
            public_key=private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw),
        )
    if algorithm != HMAC:
        raise ValueError(f"unknown signature scheme {algorithm!r}")
    return SigningKey(algorithm=HMAC, secret=secrets.token_bytes(SECRET_BYTES))


def signature_header(keys: Sequence[SigningKey], msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value: one signature per live key, newest first."""
    content = f"{msg_id}.{timestamp}.".encode() + body
    return " ".join(key.sign(content) for key in keys)
