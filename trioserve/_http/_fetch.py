"""Fetching a remote image safely (docs/vision.md, "The flow"): off unless the operator
turns it on; http(s) only; every address a host resolves to — and every redirect hop's —
checked to be globally routable (no loopback, private, link-local, CGNAT, multicast,
reserved or unspecified address: the server must not become a proxy into its own
network, vLLM #57157, CVE-2025-6242); the connection made to the address that was
checked (a second DNS answer cannot swap it: no rebinding); a cap on redirects, bytes
and time; all of it inside the caller's cancel scope (a client that leaves cancels
the fetch at once).

Hosts the operator lists in ``allow`` are the only ones fetched when that list is not
empty; hosts in ``allow`` or ``trust`` are fetched without their addresses checked (the
operator named them: an internal image server). Every redirect hop is a new URL under
the same rules.
"""

from __future__ import annotations

import io
import ipaddress
import math
import os
import stat
import urllib.parse
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import trio

from .._core._errors import unwrap_group
from .._core._exceptions import InvalidRequestError
from .._core._media import Media, RemoteImage

__all__ = ["FetchPolicy", "address_rule", "fetch", "parse_allow", "read_local", "resolve_images"]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_CGNAT = ipaddress.ip_network("100.64.0.0/10")


@dataclass(frozen=True, slots=True)
class FetchPolicy:
    #: remote URLs are fetched at all (``--media-fetch``)
    enabled: bool = False
    #: ``host`` or ``host:port`` entries (lower case); empty: any public host
    allow: frozenset[str] = field(default_factory=frozenset)
    #: ``host`` or ``host:port`` entries whose addresses are not checked
    trust: frozenset[str] = field(default_factory=frozenset)
    max_bytes: int = 20 << 20
    timeout: float = 10.0
    max_redirects: int = 3
    #: ``file://`` URLs are read only under this directory (``--media-dir``; ``None``: never)
    root: Path | None = None


_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
_COMPATIBLE = ipaddress.ip_network("::/96")


def _embedded(address: ipaddress.IPv6Address) -> tuple[list[ipaddress.IPv4Address], str, bool]:
    """The IPv4 addresses an IPv6 address carries, the prefix's name, and whether the
    verdict is theirs alone (a NAT64 or IPv4-mapped address reaches exactly its IPv4;
    the tunnelling prefixes are judged by their IPv6 rules too)."""
    low = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address.ipv4_mapped is not None:
        return [address.ipv4_mapped], "IPv4-mapped", True
    if address in _NAT64:
        return [low], "NAT64 64:ff9b::/96", True
    if address in _NAT64_LOCAL:
        return [low], "local-use NAT64 64:ff9b:1::/48", False
    if address.sixtofour is not None:
        return [address.sixtofour], "6to4 2002::/16", False
    if address.teredo is not None:
        return list(address.teredo), "Teredo 2001::/32", False
    if address in _COMPATIBLE and int(address) > 1:
        return [low], "IPv4-compatible ::/96", False
    return [], "", False


def address_rule(address: IPAddress) -> str | None:
    """The rule an address breaks, in words (``None``: it is globally routable). An IPv6
    address that embeds an IPv4 one (IPv4-mapped or -compatible, NAT64, 6to4, Teredo) is
    judged by its IPv4 first: a NAT64 gateway or a tunnel would connect to it."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded, prefix, only = _embedded(address)
        for inner in embedded:
            rule = _rule(inner)
            if rule is not None:
                # (a mapped address is its IPv4, written in IPv6)
                return rule if prefix == "IPv4-mapped" else f"{rule} (the IPv4 {inner} inside {prefix})"
        if embedded and only:
            return None
    return _rule(address)


def _rule(address: IPAddress) -> str | None:
    if address.is_loopback:
        return "loopback"
    if address.is_unspecified:
        return "unspecified"
    if address.is_link_local:
        return "link-local"
    if isinstance(address, ipaddress.IPv6Address) and address.is_site_local:
        # fec0::/10: deprecated (RFC 3879) but still routed inside some sites, and
        # Python calls it global
        return "site-local"
    if isinstance(address, ipaddress.IPv4Address) and address in _CGNAT:
        return "shared address space (CGNAT)"
    if address.is_private:
        return "private"
    if address.is_multicast:
        return "multicast"
    if address.is_reserved:
        return "reserved"
    if not address.is_global:
        return "not globally routable"
    return None


def _refuse(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code="media_url_refused")


def _target(url: str, param: str) -> tuple[str, str, int]:
    """``(scheme, host, port)`` of an http(s) URL, or a 400."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise _refuse(param, f"the image URL is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise _refuse(param, f"an image URL must be http or https, not {parts.scheme or 'none'!r}")
    if not parts.hostname:
        raise _refuse(param, "the image URL names no host")
    if parts.username is not None or parts.password is not None:
        raise _refuse(param, "an image URL may not carry credentials")
    return parts.scheme, parts.hostname.lower(), port or (443 if parts.scheme == "https" else 80)


async def _resolve(host: str, port: int) -> list[IPAddress]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        infos = await trio.socket.getaddrinfo(host, port, type=trio.socket.SOCK_STREAM)
    except OSError as exc:
        raise InvalidRequestError(
            f"the image URL's host {host!r} could not be resolved: {exc}",
            param=None,
            code="media_fetch_failed",
        ) from None
    return list(dict.fromkeys(ipaddress.ip_address(info[4][0]) for info in infos))


async def _checked_address(policy: FetchPolicy, host: str, port: int, param: str) -> IPAddress:
    """The address to connect to: every address the host has, checked (one bad: the
    URL is refused — a host with one private address among public ones is not safe)."""
    named = f"{host}:{port}"
    listed = host in policy.allow or named in policy.allow
    trusted = listed or host in policy.trust or named in policy.trust
    if policy.allow and not trusted:
        raise _refuse(
            param,
            f"the image URL's host {host}:{port} is not in the server's allowed hosts (--media-fetch-allow)",
        )
    addresses = await _resolve(host, port)
    if not addresses:
        raise InvalidRequestError(
            f"the image URL's host {host!r} has no address", param=param, code="media_fetch_failed"
        )
    if not trusted:
        for address in addresses:
            rule = address_rule(address)
            if rule is not None:
                raise _refuse(
                    param,
                    f"the image URL's host {host} resolves to {address}, a {rule} address: images are "
                    "fetched from public addresses only",
                )
    return addresses[0]


async def fetch(
    url: str, policy: FetchPolicy, *, param: str, client: httpx.AsyncClient | None = None
) -> bytes:
    """The bytes at ``url`` under ``policy``; a 400 (``param`` named) for anything
    refused or failed. Cancellable at any point (the connection is closed)."""
    if not policy.enabled:
        raise InvalidRequestError(
            "image URLs are not fetched by this server: send the image as a data URL "
            "(data:image/png;base64,…), or start the server with --media-fetch",
            param=param,
            code="media_fetch_disabled",
        )
    own = client is None
    http = client or httpx.AsyncClient(timeout=policy.timeout, follow_redirects=False, trust_env=False)
    try:
        with trio.move_on_after(policy.timeout if policy.timeout > 0 else math.inf) as timer:
            return await _fetch(http, url, policy, param)
        assert timer.cancelled_caught
        raise InvalidRequestError(
            f"the image URL did not answer within {policy.timeout:g} s (--media-fetch-timeout)",
            param=param,
            code="media_fetch_failed",
        )
    finally:
        if own:
            await http.aclose()


async def _fetch(http: httpx.AsyncClient, url: str, policy: FetchPolicy, param: str) -> bytes:
    for hop in range(policy.max_redirects + 1):
        scheme, host, port = _target(url, param)
        address = await _checked_address(policy, host, port, param)
        # connect to the address just checked; the Host header and TLS name stay the host's
        literal = f"[{address}]" if address.version == 6 else str(address)
        parts = urllib.parse.urlsplit(url)
        direct = urllib.parse.urlunsplit((scheme, f"{literal}:{port}", parts.path or "/", parts.query, ""))
        request = http.build_request(
            "GET",
            direct,
            # identity: a compressed body would be inflated by httpx before any cap
            # could see it (a 64 KiB gzip is 64 MiB once read)
            headers={"Host": parts.netloc.rsplit("@", 1)[-1], "Accept-Encoding": "identity"},
            extensions={"sni_hostname": host},
        )
        try:
            response = await http.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise InvalidRequestError(
                f"the image URL could not be fetched: {exc}", param=param, code="media_fetch_failed"
            ) from None
        try:
            if response.is_redirect:
                location = response.headers.get("location")
                if not location:
                    raise InvalidRequestError(
                        "the image URL redirected without a Location", param=param, code="media_fetch_failed"
                    )
                url = urllib.parse.urljoin(url, location)
                if hop == policy.max_redirects:
                    raise _refuse(param, f"the image URL redirected more than {policy.max_redirects} times")
                continue
            if response.status_code != 200:
                raise InvalidRequestError(
                    f"the image URL answered {response.status_code}", param=param, code="media_fetch_failed"
                )
            encoding = response.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("", "identity"):
                raise InvalidRequestError(
                    f"the image URL answered with Content-Encoding {encoding!r} though the server "
                    "asked for none (Accept-Encoding: identity); images are fetched as they are stored",
                    param=param,
                    code="media_fetch_failed",
                )
            declared = response.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > policy.max_bytes:
                raise _too_large(param, policy.max_bytes)
            # the bytes as they arrive (never decoded), counted chunk by chunk
            return await _read_capped(response.aiter_raw(), policy.max_bytes, param)
        finally:
            await response.aclose()
    raise AssertionError("unreachable")  # pragma: no cover


def _too_large(param: str, limit: int) -> InvalidRequestError:
    return InvalidRequestError(
        f"the image is larger than {limit} bytes (--max-image-bytes)", param=param, code="image_too_large"
    )


async def _read_capped(chunks: object, limit: int, param: str) -> bytes:
    body = bytearray()
    async for chunk in chunks:  # type: ignore[attr-defined]
        body += chunk
        if len(body) > limit:
            raise _too_large(param, limit)
    return bytes(body)


async def resolve_images(images: Sequence[Media], policy: FetchPolicy) -> tuple[Media, ...]:
    """A request's images with every URL replaced by its bytes: remote ones fetched
    (:func:`fetch`) and local ones read (:func:`read_local`), all at once, inside the
    caller's cancel scope. The first refusal cancels the others and is raised."""
    out: list[Media] = list(images)

    async def get(index: int, image: RemoteImage) -> None:
        if image.url.lower().startswith("file:"):
            out[index] = await read_local(image.url, policy, param=image.param)
        else:
            out[index] = await fetch(image.url, policy, param=image.param)

    remote = [(i, image) for i, image in enumerate(images) if isinstance(image, RemoteImage)]
    if len(remote) == 1:
        await get(*remote[0])
    elif remote:
        with unwrap_group():  # (the first refusal, as itself)
            async with trio.open_nursery() as nursery:
                for index, image in remote:
                    nursery.start_soon(get, index, image)
    return tuple(out)


async def read_local(url: str, policy: FetchPolicy, *, param: str) -> bytes:
    """A ``file://`` URL's bytes, only under ``policy.root`` (``--media-dir``): the path
    resolved (symbolic links and ``..`` followed) must stay inside it; the file is then
    opened component by component from the root with ``O_NOFOLLOW`` (a link swapped in
    after the check is not followed) and ``O_NONBLOCK`` (a FIFO does not block the
    thread), and read only if it is a regular file. Any path the system cannot take
    (a NUL byte, a name too long…) is a 400."""
    if policy.root is None:
        raise InvalidRequestError(
            "local files are not read by this server: send the image as a data URL, or start the "
            "server with --media-dir DIR (file:// URLs under DIR)",
            param=param,
            code="media_file_refused",
        )
    try:
        parts = urllib.parse.urlsplit(url)
        name = urllib.request.url2pathname(parts.path)
    except ValueError as exc:
        raise _bad_path(param, str(exc)) from None
    if parts.netloc not in ("", "localhost"):
        raise InvalidRequestError(
            "a file:// URL must name a local path (file:///path)", param=param, code="invalid_image_url"
        )
    if "\x00" in name:
        raise _bad_path(param, "it holds a NUL byte (%00)")
    root = policy.root

    def read() -> bytes:
        try:
            path = Path(os.path.realpath(name))
            base = Path(os.path.realpath(root))
        except (OSError, ValueError) as exc:
            raise _bad_path(param, str(exc)) from None
        if not path.is_relative_to(base) or path == base:
            raise InvalidRequestError(
                "the file is outside the directory this server reads images from (--media-dir)",
                param=param,
                code="media_file_refused",
            )
        try:
            fd = _open_under(str(base), path.relative_to(base).parts)
        except OSError as exc:
            raise InvalidRequestError(
                f"the image file could not be read: {exc.strerror}", param=param, code="media_fetch_failed"
            ) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise InvalidRequestError(
                "the image file is not a regular file (a FIFO, device or directory is never read)",
                param=param,
                code="media_file_refused",
            )
        with os.fdopen(fd, "rb", buffering=0) as file:
            try:
                data = _read_up_to(file, policy.max_bytes + 1)
            except OSError as exc:
                raise InvalidRequestError(
                    f"the image file could not be read: {exc.strerror}",
                    param=param,
                    code="media_fetch_failed",
                ) from None
        if len(data) > policy.max_bytes:
            raise _too_large(param, policy.max_bytes)
        return data

    return await trio.to_thread.run_sync(read)


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _open_under(base: str, names: Sequence[str]) -> int:
    """``base/names…`` opened for reading with no symbolic link followed on the way (each
    directory opened from the one before, ``O_NOFOLLOW``), non-blocking (a FIFO opens at
    once, and is then refused)."""
    directory = os.open(base, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        for name in names[:-1]:
            inner = os.open(name, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW, dir_fd=directory)
            os.close(directory)
            directory = inner
        return os.open(names[-1], os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | _NOFOLLOW, dir_fd=directory)
    finally:
        os.close(directory)


def _read_up_to(file: io.RawIOBase, limit: int) -> bytes:
    body = bytearray()
    while len(body) < limit:
        chunk = file.read(min(1 << 20, limit - len(body)))
        if not chunk:
            break
        body += chunk
    return bytes(body)


def _bad_path(param: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"the file:// URL's path cannot name a file: {why}", param=param, code="invalid_image_url"
    )


def parse_allow(entries: Iterable[str]) -> frozenset[str]:
    """``--media-fetch-allow`` entries, normalised (lower case, no scheme)."""
    out = set()
    for entry in entries:
        entry = entry.strip().lower()
        if "://" in entry:
            entry = entry.split("://", 1)[1]
        out.add(entry.rstrip("/"))
    return frozenset(e for e in out if e)
