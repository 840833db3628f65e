"""The SSRF guard for webhook and callback URLs: https to public addresses only.

Checked at registration (syntax and literal addresses) and again before every delivery
(the name is resolved then, since DNS can change between the two).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from urllib.parse import urlsplit

MAX_URL_LENGTH = 2048


class UnsafeUrl(ValueError):
    """The URL may not be called; the message says why."""


def _is_public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def check_url_syntax(url: str, *, allow_private: bool) -> None:
    if len(url) > MAX_URL_LENGTH:
        raise UnsafeUrl(f"URL longer than {MAX_URL_LENGTH} characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise UnsafeUrl(f"not a valid URL: {exc}") from exc
    schemes = ("https", "http") if allow_private else ("https",)
    if parts.scheme not in schemes:
        raise UnsafeUrl("must be an https URL")
    if not parts.hostname:
        raise UnsafeUrl("must name a host")
    try:
        parts.hostname.encode("idna")  # what the resolver and the TLS layer will need
    except UnicodeError:
        raise UnsafeUrl("the host is not a valid domain name") from None
    if parts.username or parts.password:
        raise UnsafeUrl("must not carry credentials")
    if port == 0:
        raise UnsafeUrl("port 0 is not a valid port")
    if allow_private:
        return
    try:
        literal = ipaddress.ip_address(parts.hostname)
    except ValueError:
        if parts.hostname.lower() in ("localhost",) or parts.hostname.lower().endswith(".localhost"):
            raise UnsafeUrl("must resolve to a public address") from None
        return
    if not _is_public(str(literal)):
        raise UnsafeUrl("must resolve to a public address")


async def check_url_resolves_public(url: str, *, allow_private: bool) -> None:
    """Syntax, then every address the host resolves to must be public."""
    check_url_syntax(url, allow_private=allow_private)
    if allow_private:
        return
    parts = urlsplit(url)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(
            parts.hostname, parts.port or 443, type=socket.SOCK_STREAM
        )
    except (OSError, UnicodeError, ValueError) as exc:
        raise UnsafeUrl(f"host does not resolve: {exc}") from exc
    if not infos or not all(_is_public(str(info[4][0])) for info in infos):
        raise UnsafeUrl("must resolve to a public address")


def is_public_address(address: str) -> bool:
    """True for a globally routable unicast address (the rule every resolved address must pass)."""
    return _is_public(address)
