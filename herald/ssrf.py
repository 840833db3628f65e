"""The SSRF guard for webhook and callback URLs: https to public addresses only (SPEC §7, §10).

Checked at registration (syntax, literal addresses, and the name resolved then by
``herald.resolver``, within its ``RESOLVE_WITHIN_S``) and again before every delivery (the
name is resolved then, since DNS can change between the two; ``notifier.delivery`` dials the
very addresses it judged).

An address is public only if it is global unicast and not one of the IPv6 forms that carry
an IPv4 address (mapped, compatible, NAT64, 6to4, Teredo): those reach whatever IPv4 address
they carry (often through a translator we cannot see), so they are refused outright. A host
written as a number (``2130706433``, ``127.1``, ``0x7f.1``, ``0177.0.0.1``) is judged as the
address the resolver would make of it (inet_aton's reading), and so is a host written with
characters that IDNA maps to such a number (fullwidth digits, ideographic full stops).
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

from yarl import URL

from herald.resolver import Resolver

MAX_URL_LENGTH = 2048
NOT_PUBLIC = "must resolve to a public address"  # also for a name that does not resolve: no probing

GLOBAL_UNICAST_V6 = ipaddress.ip_network("2000::/3")
IPV4_CARRYING_V6 = tuple(ipaddress.ip_network(n) for n in (
    "::ffff:0:0/96",    # IPv4-mapped
    "::/96",            # IPv4-compatible (deprecated)
    "64:ff9b::/96",     # NAT64, well-known prefix
    "64:ff9b:1::/48",   # NAT64, local use
    "2002::/16",        # 6to4
    "2001::/32",        # Teredo
))
# Special-purpose IPv4 blocks IANA lists as not globally reachable that Python before 3.11.10
# (CVE-2024-4032) still calls global: IETF protocol assignments (192.0.0.9 and .10 are
# anycast services no webhook lives at) and the deprecated 6to4 relay anycast.
NOT_GLOBAL_V4 = tuple(ipaddress.ip_network(n) for n in ("192.0.0.0/24", "192.88.99.0/24"))
_NUMERIC_LABEL = re.compile(r"(0x[0-9a-f]*|[0-9]+)", re.IGNORECASE)


class UnsafeUrl(ValueError):
    """The URL may not be called; the message says why."""


def numeric_host(host: str) -> ipaddress.IPv4Address | None:
    """The IPv4 address a host written as numbers denotes, as inet_aton reads it: one to four
    parts, each decimal, octal (leading 0) or hex (0x), the last filling the remaining bytes.
    None when the host is not written that way (a name). A host that looks numeric but is no
    valid address raises ``UnsafeUrl``: no resolver may be left to guess at it."""
    parts = host.removesuffix(".").split(".")
    if not host.isascii() or not all(_NUMERIC_LABEL.fullmatch(p) for p in parts):
        if _NUMERIC_LABEL.fullmatch(parts[-1]) and parts[-1].isdigit():
            raise UnsafeUrl("the host is not a valid address")  # WHATWG: a numeric last label is IPv4
        return None
    if len(parts) > 4:
        raise UnsafeUrl("the host is not a valid address")
    try:
        values = [int(p, 16) if p[:2].lower() == "0x" else int(p, 8) if len(p) > 1 and p[0] == "0" else int(p)
                  for p in (p if p.lower() != "0x" else "0x0" for p in parts)]
    except ValueError:  # an octal part with 8 or 9
        raise UnsafeUrl("the host is not a valid address") from None
    *head, last = values
    if any(v > 255 for v in head) or last >= 256 ** (4 - len(head)):
        raise UnsafeUrl("the host is not a valid address")
    number = last
    for index, value in enumerate(head):
        number += value << (8 * (3 - index))
    return ipaddress.IPv4Address(number)


def _is_public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):
        if ip not in GLOBAL_UNICAST_V6 or any(ip in net for net in IPV4_CARRYING_V6):
            return False
    elif any(ip in net for net in NOT_GLOBAL_V4):
        return False
    return ip.is_global and not ip.is_multicast


def literal_address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address a URL's host denotes without DNS: an IP literal or a number; None for a name."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return numeric_host(host)


def check_url_syntax(url: str, *, allow_private: bool) -> None:
    if len(url) > MAX_URL_LENGTH:
        raise UnsafeUrl(f"URL longer than {MAX_URL_LENGTH} characters")
    try:
        parts = urlsplit(url)
        port = parts.port
        # The notifier's HTTP client (aiohttp) holds the URL as yarl reads it, and refuses what
        # yarl refuses (a host with a soft hyphen or a zero-width space, which IDNA would map
        # away here): a URL let in that it cannot read would fail every delivery, for ever.
        URL(url)
    except ValueError as exc:
        raise UnsafeUrl(f"not a valid URL: {exc}") from exc
    schemes = ("https", "http") if allow_private else ("https",)
    if parts.scheme not in schemes:
        raise UnsafeUrl("must be an https URL")
    if not parts.hostname:
        raise UnsafeUrl("must name a host")
    host = ascii_host(parts.hostname)
    if parts.username or parts.password:
        raise UnsafeUrl("must not carry credentials")
    if port == 0:
        raise UnsafeUrl("port 0 is not a valid port")
    if allow_private:
        return
    literal = literal_address(host)
    if literal is None:
        if host.lower() in ("localhost",) or host.lower().endswith(".localhost"):
            raise UnsafeUrl(NOT_PUBLIC)
        return
    if not _is_public(str(literal)):
        raise UnsafeUrl(NOT_PUBLIC)


def ascii_host(hostname: str) -> str:
    """The host as the resolver and the HTTP client will see it: IDNA-encoded, which maps
    compatibility forms to ASCII (``１２７.０.０.１`` and ``127。0。0。1`` are ``127.0.0.1``,
    ``ⓛocalhost`` is ``localhost``). The guard judges this form, never the spelling: a
    spelling that looked like a name was dialled as the address it maps to, unjudged."""
    try:
        return hostname.encode("idna").decode("ascii")
    except UnicodeError:
        raise UnsafeUrl("the host is not a valid domain name") from None


async def check_url_resolves_public(url: str, *, allow_private: bool, resolver: Resolver) -> None:
    """Syntax, then every address the host resolves to must be public. Looked up with
    ``resolver`` (``herald.resolver``: no thread per lookup, ``RESOLVE_WITHIN_S`` at most), so a
    start or a registration naming a host whose DNS never answers holds nothing that another
    tenant's needs."""
    check_url_syntax(url, allow_private=allow_private)
    if allow_private:
        return
    parts = urlsplit(url)
    assert parts.hostname is not None  # check_url_syntax made sure
    host = ascii_host(parts.hostname)
    if literal_address(host) is not None:
        return  # judged by check_url_syntax
    try:
        addresses = await resolver.resolve(host, parts.port or 443)
    except (OSError, UnicodeError, ValueError):
        # The same answer as for a private address: the guard must not tell which internal
        # names exist (a probe of names that resolve only inside the network).
        raise UnsafeUrl(NOT_PUBLIC) from None
    if not addresses or not all(_is_public(a.host) for a in addresses):
        raise UnsafeUrl(NOT_PUBLIC)


def is_public_address(address: str) -> bool:
    """True for a globally routable unicast address (the rule every resolved address must pass)."""
    return _is_public(address)
