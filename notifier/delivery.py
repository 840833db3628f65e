"""Sending one webhook attempt over HTTP: one shared client, pooled connections, the SSRF guard.

The client is an ``aiohttp.ClientSession``. It was httpx's ``AsyncClient`` over the
``httpx-aiohttp`` transport (several times faster than httpx's own transport), but the
notifier's profile (issue 14, ``bench/RESULTS.md``) showed the httpx layer above aiohttp
costing more CPU per POST than aiohttp itself (building the request and its URL, header
objects, cookie extraction, mapping the response): aiohttp directly halves the HTTP
client's share of a delivery. aiohttp also gives the SSRF guard a place at connect time:
it resolves names through ``PublicOnlyResolver``, so the address actually dialled is the
one that was checked (no window for DNS rebinding between check and connect), and literal
addresses (a host written as a number too, dialled as the address it denotes) are checked
by ``check_url_syntax`` before every attempt. Proxies from the
environment are ignored (a proxy would dial on our behalf, past the guard).

Names are looked up by ``herald.resolver`` (c-ares), not by aiohttp's default
``getaddrinfo`` in threads: a tenant's hosts whose DNS never answers held every lookup
thread of the process, and every other tenant's attempt to a name waited behind them. A
lookup now holds no thread and ends within ``RESOLVE_WITHIN_S``: a name that does not
resolve by then is a failed attempt, timed out and unreachable (retried with backoff, and
counted by the breaker like a host that does not take the connection).
"""

from __future__ import annotations

import asyncio
import email.utils
import errno
import functools
import socket
import time
from collections.abc import Sequence
from types import TracebackType

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

import herald
from herald.deliveries import Outcome
from herald.delivery_rules import RESPONSE_KEEP_BYTES
from herald.resolver import RESOLVE_WITHIN_S, NameNotResolved, Resolver
from herald.ssrf import NOT_PUBLIC, UnsafeUrl, check_url_syntax, is_public_address, literal_address, numeric_host

SUCCESS_WITHIN_S = 15.0  # SPEC §7: a 2xx within 15 s, else the attempt failed
# A receiver that does not even accept the connection is known sooner than one that does not
# answer: connecting gets a third of the answer's time, so a dead host holds a slot 5 s, not 15.
CONNECT_WITHIN_S = 5.0
USER_AGENT = f"Herald/{herald.__version__}"
MAX_CONNECTIONS = 256
# The longest line of a receiver's answer (status line, or one header) that is read: aiohttp's
# default is 8190 bytes, and a receiver's 2xx with one longer header (a session cookie, a
# tracing header) was counted a failure with no status and sent again for ever. The answer's
# header lines (at most aiohttp's 128) are held only while the attempt is read. Twice the usual
# 8 KiB, not more: a receiver may send the most of it on every attempt in flight, and a
# notifier holds hundreds at once for every tenant (128 lines of 16 KiB: 2 MiB an attempt).
MAX_ANSWER_LINE_BYTES = 16 * 1024


class NonPublicAddress(OSError):
    def __init__(self, host: str) -> None:
        # errno and strerror set, so aiohttp's connection error shows the message
        super().__init__(errno.EACCES, f"{host} resolves to a non-public address (SSRF guard)")


class PublicOnlyResolver(AbstractResolver):
    """Resolves with ``herald.resolver``, then refuses names with any non-public address."""

    def __init__(self, *, allow_private: bool, dns_servers: Sequence[str] = ()) -> None:
        self._inner = Resolver(dns_servers)
        self._allow_private = allow_private

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = [ResolveResult(hostname=host, host=a.host, port=a.port, family=a.family, proto=0,
                                 flags=socket.AI_NUMERICHOST | socket.AI_NUMERICSERV)
                   for a in await self._inner.resolve(host, port, family)]
        if not self._allow_private and not all(is_public_address(r["host"]) for r in results):
            raise NonPublicAddress(host)
        return results

    async def close(self) -> None:
        await self._inner.close()


def parse_retry_after(value: str | None, *, at: float) -> float | None:
    """``Retry-After`` as seconds from ``at``: delta-seconds or an HTTP date (RFC 9110 §10.2.3)."""
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():  # not '²' (isdigit, but no int)
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - at)


@functools.lru_cache(maxsize=4096)
def _checked_url(url: str, allow_private: bool) -> URL | str:
    """The URL parsed once for aiohttp, or why the SSRF guard refuses it.

    Both depend on the string alone (names are checked when they are resolved, at connect
    time), and a notifier sends to the same few URLs over and over: parsing and checking
    each once per process took a few percent of a delivery's CPU.
    """
    try:
        check_url_syntax(url, allow_private=allow_private)
    except UnsafeUrl as exc:
        return str(exc)
    try:
        target = URL(url)
        # A host written as a number (``0x7f.1``) was judged as the address it denotes: dial
        # that address, written canonically (as a browser would), not a spelling that some
        # resolver might read otherwise (aiohttp refuses the spelling outright).
        number = numeric_host(target.raw_host or "")
        if number is not None:
            target = target.with_host(str(number))
    except (ValueError, UnsafeUrl) as exc:
        return f"not a valid URL: {exc}"
    # The address that will be dialled without our resolver (aiohttp resolves no literal) is
    # judged as the client holds it, after its own IDNA mapping: whatever spelling led there.
    literal = literal_address(target.raw_host or "")
    if not allow_private and literal is not None and not is_public_address(str(literal)):
        return NOT_PUBLIC
    return target


def _describe(exc: BaseException, target: URL) -> str:
    """An attempt's error, as the delivery keeps it and the notifier logs it: the target named by
    its origin only, never its path or query, which are often the receiver's secret (a
    Slack-style hook URL, a ``?token=``)."""
    if isinstance(exc, aiohttp.ClientResponseError):
        # An answer aiohttp could not parse: its text is "400, message=…, url=<the whole URL>",
        # and the 400 is aiohttp's own, not the receiver's.
        text = "the answer could not be read: " + " ".join(str(exc.message).split())  # on one line, caret and all
    else:
        text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text.replace(str(target), str(target.origin()))}"[:500]


class Sender:
    """Owns the one HTTP client of a notifier process. ``aclose()`` is safe to call twice."""

    def __init__(self, *, allow_private: bool, dns_servers: Sequence[str] = (),
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self._allow_private = allow_private
        self._dns_servers = tuple(dns_servers)
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._resolver: PublicOnlyResolver | None = None

    async def __aenter__(self) -> Sender:
        # Ours to close: a connector closes only a resolver it made itself.
        self._resolver = PublicOnlyResolver(allow_private=self._allow_private, dns_servers=self._dns_servers)
        connector = aiohttp.TCPConnector(
            limit=self._max_connections,
            limit_per_host=0,  # the scheduler bounds work per endpoint
            resolver=self._resolver,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            trust_env=False,
            auto_decompress=False,
            # identity: the answer's first KiB is kept as sent, and it is not decompressed
            headers={"user-agent": USER_AGENT, "content-type": "application/json", "accept-encoding": "identity"},
            # The whole attempt is bounded by SUCCESS_WITHIN_S below; connecting alone by CONNECT_WITHIN_S.
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_WITHIN_S),
            max_line_size=MAX_ANSWER_LINE_BYTES,
            max_field_size=MAX_ANSWER_LINE_BYTES,
        )
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()
        resolver, self._resolver = self._resolver, None
        if resolver is not None:
            await resolver.close()

    async def send(self, url: str, body: bytes, headers: dict[str, str]) -> Outcome:
        """POST ``body``; a 2xx within ``SUCCESS_WITHIN_S`` is success. Never raises for network trouble."""
        assert self._session is not None, "Sender is not open"
        started = time.perf_counter()
        target = _checked_url(url, self._allow_private)
        if isinstance(target, str):
            return Outcome(status_code=None, latency_s=0.0, error=f"refused by the SSRF guard: {target}")
        try:
            async with asyncio.timeout(SUCCESS_WITHIN_S):
                # allow_redirects=False: SPEC §7, a 3xx is a failure
                response = await self._session.post(target, data=body, headers=headers, allow_redirects=False)
        except aiohttp.ServerTimeoutError as exc:  # before TimeoutError, which it also is
            connecting = isinstance(exc, aiohttp.ConnectionTimeoutError)
            return Outcome(status_code=None, latency_s=time.perf_counter() - started, timed_out=True, unreachable=True,
                           error=f"no connection within {CONNECT_WITHIN_S:g} s" if connecting else _describe(exc, target))
        except TimeoutError:
            return Outcome(status_code=None, latency_s=time.perf_counter() - started, timed_out=True, unreachable=True,
                           error=f"no answer within {SUCCESS_WITHIN_S:g} s")
        except (aiohttp.ClientConnectionError, OSError) as exc:  # refused, reset, unreachable
            if _cause(exc, NameNotResolved):  # no answer from DNS: a timeout, like a host that does not connect
                return Outcome(status_code=None, latency_s=time.perf_counter() - started, timed_out=True,
                               unreachable=True, error=f"the name did not resolve within {RESOLVE_WITHIN_S:g} s")
            # (unless our own SSRF guard refused the name: that says nothing about the target)
            return Outcome(status_code=None, latency_s=time.perf_counter() - started, error=_describe(exc, target),
                           unreachable=not _cause(exc, NonPublicAddress))
        except (aiohttp.ClientError, ValueError) as exc:  # ValueError: a URL aiohttp cannot use
            return Outcome(status_code=None, latency_s=time.perf_counter() - started, error=_describe(exc, target))
        # The status is the answer (SPEC §7: a 2xx within 15 s). The body is read for the log
        # only, within what is left of the 15 s: a 2xx whose body then stalls or is cut short
        # is still a 2xx (counted a failure, it was sent again though its receiver had it).
        retry_after = parse_retry_after(response.headers.get("retry-after"), at=time.time())
        head = bytearray()
        trouble: str | None = None
        try:
            async with asyncio.timeout(max(0.0, SUCCESS_WITHIN_S - (time.perf_counter() - started))):
                async with response:
                    await _read_head(response, head)
        except TimeoutError:
            trouble = f"the answer's body did not come within {SUCCESS_WITHIN_S:g} s"
        except (aiohttp.ClientError, OSError) as exc:
            trouble = f"the answer's body could not be read: {_describe(exc, target)}"[:500]
        finally:
            response.close()
        return Outcome(status_code=response.status, latency_s=time.perf_counter() - started, error=trouble,
                       response=bytes(head), retry_after_s=retry_after)


def _cause(exc: BaseException, kind: type[OSError]) -> bool:
    """Whether ``exc`` is ``kind``, or aiohttp's connection error made of one."""
    return isinstance(exc, kind) or isinstance(getattr(exc, "os_error", None), kind)


async def _read_head(response: aiohttp.ClientResponse, head: bytearray) -> None:
    """The first KiB of the body into ``head``, for the attempt log (what came before a failure
    stays there); the rest is not read."""
    while len(head) < RESPONSE_KEEP_BYTES:
        chunk = await response.content.read(RESPONSE_KEEP_BYTES - len(head))
        if not chunk:
            break
        head += chunk
