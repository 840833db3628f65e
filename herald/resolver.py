"""Looking up webhook and callback hosts: asynchronous, bounded in time, and holding no thread.

Every tenant's webhook hosts are looked up by the same process: the SSRF guard at
registration (the gateway, ``herald.ssrf``) and before every attempt (the notifier,
``notifier.delivery``). ``getaddrinfo`` runs in a thread (on uvloop, one of libuv's pool of
four that every lookup of the process shares), and a caller's timeout ends only its wait,
never the lookup: the thread stays with a name whose DNS server does not answer until the
system resolver gives up. A tenant whose hosts never resolve so took every thread, and every
other tenant's lookups, of names that resolve at once, waited behind them.

So these hosts are looked up with c-ares (``aiodns``): a lookup is a query on a socket that
c-ares's own event thread watches (one thread for all of them, however many hang), and it
ends within ``RESOLVE_WITHIN_S`` either way: a name without an answer by then raises
``NameNotResolved``, which the notifier records as a failed attempt (retried with backoff,
and counted by the breaker as a target that does not answer) and the guard as a name that
does not resolve. c-ares reads ``/etc/hosts`` and ``/etc/resolv.conf`` as the system
resolver does (sources that only ``nsswitch.conf`` adds, such as mDNS or LDAP, are not
asked); ``Settings.webhook_dns_servers`` names other DNS servers.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import aiodns

RESOLVE_WITHIN_S = 5.0  # a name that does not resolve by then is a failed lookup
# c-ares's own schedule within that bound: a query sent again after 1 s, then 2 s (a lost
# UDP packet costs a second, not the whole lookup); a lookup given up by the bound above
# goes on inside c-ares until this ends, holding a socket's slot, not a thread.
_TRY_S = 1.0
_TRIES = 3


class NameNotResolved(OSError):
    """The host got no answer within ``RESOLVE_WITHIN_S``."""

    def __init__(self, host: str) -> None:
        # errno and strerror set, so aiohttp's connection error shows the message
        super().__init__(errno.ETIMEDOUT, f"{host} did not resolve within {RESOLVE_WITHIN_S:g} s")
        self.host = host


@dataclass(frozen=True, slots=True)
class Address:
    family: int
    host: str  # the address, as text (an IPv6 link-local one with its %scope)
    port: int


def dns_server(text: str) -> str:
    """``ip``, ``ip:port`` or ``[ipv6]:port`` checked and written as c-ares takes it; raises ValueError."""
    text = text.strip()
    host, port = text, None
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"not a DNS server address: {text!r}")
        port = rest[1:] or None
    elif text.count(":") == 1:
        host, port = text.split(":")
    address = ipaddress.ip_address(host)
    if port is None:
        return str(address)
    if not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ValueError(f"not a port: {port!r}")
    return f"[{address}]:{int(port)}" if address.version == 6 else f"{address}:{int(port)}"


class Resolver:
    """One process's lookups of webhook hosts; ``close()`` is safe to call twice. Opened on
    first use, on the running loop."""

    def __init__(self, servers: Sequence[str] = ()) -> None:
        self._servers = [dns_server(s) for s in servers]
        self._resolver: aiodns.DNSResolver | None = None

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_UNSPEC) -> list[Address]:
        """The addresses of ``host`` (TCP); ``NameNotResolved`` when it takes longer than
        ``RESOLVE_WITHIN_S``, ``OSError`` when it has none."""
        if self._resolver is None:
            self._resolver = aiodns.DNSResolver(self._servers or None, timeout=_TRY_S, tries=_TRIES)
        try:
            async with asyncio.timeout(RESOLVE_WITHIN_S):
                answer = await self._resolver.getaddrinfo(host, family=socket.AddressFamily(family), port=port,
                                                          type=socket.SOCK_STREAM)
        except TimeoutError:
            raise NameNotResolved(host) from None
        except aiodns.error.DNSError as exc:
            if exc.args and exc.args[0] == aiodns.error.ARES_ETIMEOUT:
                raise NameNotResolved(host) from None
            raise OSError(errno.EHOSTUNREACH, f"{host}: {exc.args[1] if len(exc.args) > 1 else exc}") from None
        found = [_address(node.family, node.addr) for node in answer.nodes]
        if not found:
            raise OSError(errno.EHOSTUNREACH, f"{host} has no address")
        return found

    async def close(self) -> None:
        resolver, self._resolver = self._resolver, None
        if resolver is not None:
            await resolver.close()


def _address(family: int, addr: tuple[bytes, int] | tuple[bytes, int, int, int]) -> Address:
    host = addr[0].decode("ascii")
    if family == socket.AF_INET6 and len(addr) > 3 and addr[3]:
        host = f"{host}%{addr[3]}"  # a link-local address keeps its interface
    return Address(family=family, host=host, port=addr[1])
