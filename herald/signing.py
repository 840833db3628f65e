"""Signed URLs (valet keys): ``<path>?exp=<unix s>&sig=<base64url HMAC>``, scoped to path and purpose."""

from __future__ import annotations

import base64
import hashlib
import hmac
import time

from herald.jobs import StoreUnavailable


class UrlSigner:
    """Signs with the first key, verifies with any. Built before the keys are known when
    they come from the store (``set_keys`` once it is open): until then it cannot sign."""

    def __init__(self, keys: tuple[bytes, ...], ttl_s: float) -> None:
        self._keys = keys
        self._ttl_s = ttl_s

    def set_keys(self, keys: tuple[bytes, ...]) -> None:
        if not keys:
            raise ValueError("at least one signing key is needed")
        self._keys = keys

    @property
    def ready(self) -> bool:
        return bool(self._keys)

    @staticmethod
    def _mac(key: bytes, purpose: str, path: str, exp: int, extra: str) -> str:
        message = f"{purpose}\n{path}\n{exp}\n{extra}".encode()
        digest = hmac.new(key, message, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def expiry(self, now: float | None = None) -> int:
        """The ``exp`` a link signed at ``now`` (default: this instant) carries: links signed with the
        same expiry, path and purpose are byte-identical, so an answer built once may be shared."""
        return int((now if now is not None else time.time()) + self._ttl_s)

    def sign(self, path: str, purpose: str, *, extra: str = "", now: float | None = None) -> str:
        exp, sig = self.seal(path, purpose, extra=extra, now=now)
        return f"{path}?exp={exp}&sig={sig}"

    def seal(self, path: str, purpose: str, *, extra: str = "", ttl_s: float | None = None,
             now: float | None = None) -> tuple[int, str]:
        """``(exp, sig)`` for ``path`` and ``purpose``, valid ``ttl_s`` (default: the signed-URL TTL)."""
        if not self._keys:
            raise StoreUnavailable("the URL signing key is not loaded yet")
        exp = int((now if now is not None else time.time()) + (self._ttl_s if ttl_s is None else ttl_s))
        return exp, self._mac(self._keys[0], purpose, path, exp, extra)

    def verify(self, path: str, purpose: str, exp: str | None, sig: str | None, *, extra: str = "") -> bool:
        """True when ``sig`` is valid for this path and purpose under any current key and not expired."""
        # isascii first: str.isdigit() accepts '²', which int() refuses, and compare_digest
        # raises on non-ASCII strings; either would be a 500 for a client's bad input.
        if not exp or not sig or len(sig) > 100 or not (exp.isascii() and sig.isascii()) or not exp.isdigit() \
                or len(exp) > 12:
            return False
        if int(exp) < time.time():
            return False
        return any(hmac.compare_digest(self._mac(key, purpose, path, int(exp), extra), sig) for key in self._keys)
