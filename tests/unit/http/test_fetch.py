"""The image fetch guard (``_http/_fetch.py``, docs/vision.md) against a real local HTTP
server that plays a public image host: it serves an image, redirects to loopback, private
and link-local addresses, sends too much, or never answers. The local host itself is
trusted by name (``trust``: as an operator's internal image server would be); every
host it redirects to is checked."""

from __future__ import annotations

import ipaddress
import os
from functools import partial
from pathlib import Path

import pytest
import trio

from trioserve._core._exceptions import InvalidRequestError
from trioserve._core._media import RemoteImage
from trioserve._http._fetch import (
    FetchPolicy,
    _open_under,
    address_rule,
    fetch,
    parse_allow,
    read_local,
    resolve_images,
)

from ..._image_host import IMAGE, Host


@pytest.fixture
async def host(nursery: trio.Nursery) -> Host:
    server = Host()
    listeners = await nursery.start(partial(trio.serve_tcp, server.handle, 0, host="127.0.0.1"))
    server.port = listeners[0].socket.getsockname()[1]
    return server


def policy(host: Host, **overrides: object) -> FetchPolicy:
    settings: dict[str, object] = {"enabled": True, "trust": parse_allow([f"127.0.0.1:{host.port}"])}
    settings.update(overrides)
    return FetchPolicy(**settings)  # type: ignore[arg-type]


async def refused(url: str, fetch_policy: FetchPolicy) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        await fetch(url, fetch_policy, param="messages[0].content[1].image_url.url")
    assert caught.value.param == "messages[0].content[1].image_url.url"
    return caught.value


async def test_an_image_from_an_allowed_host_and_a_relative_redirect(host: Host) -> None:
    assert await fetch(f"http://127.0.0.1:{host.port}/img", policy(host), param="p") == IMAGE
    assert await fetch(f"http://127.0.0.1:{host.port}/relative", policy(host), param="p") == IMAGE


@pytest.mark.parametrize(
    ("path", "rule"),
    [
        ("/to-loopback", "loopback"),
        ("/to-private", "private"),
        ("/to-metadata", "link-local"),
        ("/to-mapped", "loopback"),
    ],
)
async def test_a_redirect_into_the_servers_network_is_refused_naming_the_rule(
    host: Host, path: str, rule: str
) -> None:
    error = await refused(f"http://127.0.0.1:{host.port}{path}", policy(host))
    assert error.code == "media_url_refused"
    assert f"a {rule} address" in error.message
    assert host.requests == [path]  # the redirect was never followed


async def test_an_allow_list_refuses_every_other_host(host: Host) -> None:
    listed = policy(host, trust=frozenset(), allow=parse_allow([f"http://127.0.0.1:{host.port}/"]))
    # listed hosts are fetched (an allow-listed host is not checked against the rules either)
    assert await fetch(f"http://127.0.0.1:{host.port}/img", listed, param="p") == IMAGE
    error = await refused(f"http://127.0.0.1:{host.port}/to-private", listed)
    assert "not in the server's allowed hosts" in error.message


async def test_with_no_allow_list_every_hop_is_checked(host: Host) -> None:
    public = FetchPolicy(enabled=True)
    for url, rule in [
        (f"http://localhost:{host.port}/img", "loopback"),  # a name that resolves to 127.0.0.1
        ("http://10.0.0.7/x.png", "private"),
        ("http://169.254.169.254/latest/", "link-local"),
        ("http://100.64.1.1/x.png", "CGNAT"),
        ("http://[::1]/x.png", "loopback"),
        ("http://0.0.0.0/x.png", "unspecified"),
    ]:
        error = await refused(url, public)
        assert rule in error.message, (url, error.message)
    assert host.requests == []  # nothing was ever fetched


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("ftp://example.com/x.png", "http or https"),
        ("file:///etc/passwd", "http or https"),
        ("http://user:pw@example.com/x.png", "credentials"),
        ("http:///x.png", "no host"),
        ("http://example.com:99999/x.png", "not a valid URL"),
    ],
)
async def test_urls_that_are_not_plain_http_are_refused(url: str, says: str) -> None:
    error = await refused(url, FetchPolicy(enabled=True))
    assert says in error.message


async def test_fetching_off_is_a_400_that_says_how(host: Host) -> None:
    error = await refused(f"http://127.0.0.1:{host.port}/img", FetchPolicy())
    assert error.code == "media_fetch_disabled"
    assert "data URL" in error.message
    assert host.requests == []


async def test_too_many_redirects_and_too_many_bytes(host: Host) -> None:
    error = await refused(f"http://127.0.0.1:{host.port}/loop", policy(host))
    assert "more than 3 times" in error.message
    assert host.requests.count("/loop") == 4
    for path in ("/big-declared", "/big-chunked"):
        error = await refused(f"http://127.0.0.1:{host.port}{path}", policy(host, max_bytes=100_000))
        assert error.code == "image_too_large"


async def test_a_host_that_never_answers_times_out(host: Host) -> None:
    error = await refused(f"http://127.0.0.1:{host.port}/slow", policy(host, timeout=0.3))
    assert error.code == "media_fetch_failed"
    assert "0.3 s" in error.message


async def test_a_cancel_closes_the_fetch_at_once(host: Host) -> None:
    """The caller's scope cancelled mid-fetch (a client that left): the connection to
    the image host is closed at once."""
    with trio.CancelScope() as scope:

        async def cancel_when_asked() -> None:
            await host.slow.wait()
            scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_when_asked)
            await fetch(f"http://127.0.0.1:{host.port}/slow", policy(host, timeout=60), param="p")
    assert scope.cancelled_caught
    with trio.fail_after(2):
        await host.closed.wait()


def test_the_address_rules() -> None:
    cases = {
        "127.0.0.1": "loopback",
        "10.0.0.1": "private",
        "192.168.1.1": "private",
        "172.16.0.1": "private",
        "169.254.169.254": "link-local",
        "100.64.0.1": "shared address space (CGNAT)",
        "0.0.0.0": "unspecified",
        "224.0.0.1": "multicast",
        "::1": "loopback",
        "fe80::1": "link-local",
        "fec0::1": "site-local",
        "fd00::1": "private",
        "::ffff:10.0.0.1": "private",
        "8.8.8.8": None,
        "2606:4700:4700::1111": None,
        # IPv6 addresses that carry an IPv4 one are judged by it (a NAT64 gateway or a
        # tunnel would connect there): NAT64, local-use NAT64, 6to4, Teredo, compatible
        "64:ff9b::7f00:1": "loopback (the IPv4 127.0.0.1 inside NAT64 64:ff9b::/96)",
        "64:ff9b::a9fe:a9fe": "link-local (the IPv4 169.254.169.254 inside NAT64 64:ff9b::/96)",
        "64:ff9b:1::a00:1": "private (the IPv4 10.0.0.1 inside local-use NAT64 64:ff9b:1::/48)",
        "2002:c0a8:101::1": "private (the IPv4 192.168.1.1 inside 6to4 2002::/16)",
        # Teredo's client address is stored inverted: 80ff:fffe is 127.0.0.1
        "2001:0:4136:e378:8000:63bf:80ff:fffe": "loopback (the IPv4 127.0.0.1 inside Teredo 2001::/32)",
        "::a00:1": "private (the IPv4 10.0.0.1 inside IPv4-compatible ::/96)",
        # a public IPv4 through the well-known NAT64 prefix is public (IPv6-only hosts
        # with DNS64 reach every IPv4 site this way); the tunnels stay refused
        "64:ff9b::808:808": None,
        "2002:808:808::1": "private",
    }
    for text, rule in cases.items():
        assert address_rule(ipaddress.ip_address(text)) == rule, text


async def test_an_ipv4_inside_an_ipv6_literal_is_refused_by_its_ipv4_rule(host: Host) -> None:
    for url, rule in [
        (f"http://[64:ff9b::7f00:1]:{host.port}/img", "loopback"),
        ("http://[64:ff9b::a9fe:a9fe]/latest/meta-data/", "link-local"),
        ("http://[2002:a00:1::1]/x.png", "private"),
        ("http://[::a00:1]/x.png", "private"),
    ]:
        error = await refused(url, FetchPolicy(enabled=True))
        assert error.code == "media_url_refused"
        assert f"a {rule} (the IPv4" in error.message, (url, error.message)
    assert host.requests == []


async def test_a_compressed_answer_is_asked_against_and_never_inflated(host: Host) -> None:
    """The fetch asks for ``Accept-Encoding: identity``; a host that sends gzip all the
    same (64 MiB of zeros in 64 KiB) is refused by name, nothing inflated."""
    error = await refused(f"http://127.0.0.1:{host.port}/gzip-bomb", policy(host, max_bytes=1 << 20))
    assert host.headers[-1]["accept-encoding"] == "identity"
    assert error.code == "media_fetch_failed"
    assert "Content-Encoding 'gzip'" in error.message


async def test_local_files_only_under_the_media_dir(tmp_path: Path) -> None:
    root = tmp_path / "images"
    root.mkdir()
    (root / "cat.png").write_bytes(IMAGE)
    (tmp_path / "secret.txt").write_bytes(b"not for clients")
    (root / "link.png").symlink_to(tmp_path / "secret.txt")
    allowed = FetchPolicy(root=root)
    assert await read_local((root / "cat.png").as_uri(), allowed, param="p") == IMAGE
    for url in (
        (tmp_path / "secret.txt").as_uri(),  # outside the root
        (root / ".." / "secret.txt").as_uri(),  # out by ".."
        (root / "link.png").as_uri(),  # out by a symbolic link
    ):
        with pytest.raises(InvalidRequestError) as caught:
            await read_local(url, allowed, param="p")
        assert caught.value.code == "media_file_refused", url
        assert "--media-dir" in caught.value.message
    with pytest.raises(InvalidRequestError) as caught:  # no root: never
        await read_local((root / "cat.png").as_uri(), FetchPolicy(), param="p")
    assert caught.value.code == "media_file_refused"
    with pytest.raises(InvalidRequestError) as caught:  # over the size cap
        await read_local((root / "cat.png").as_uri(), FetchPolicy(root=root, max_bytes=10), param="p")
    assert caught.value.code == "image_too_large"
    with pytest.raises(InvalidRequestError) as caught:  # another host's file
        await read_local("file://example.com/cat.png", allowed, param="p")
    assert caught.value.code == "invalid_image_url"


async def test_resolving_a_requests_images_keeps_their_order(host: Host, tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(b"local image")
    images = (
        b"inline",
        RemoteImage(f"http://127.0.0.1:{host.port}/img", "messages[0].content[1]"),
        RemoteImage((tmp_path / "a.png").as_uri(), "messages[0].content[2]"),
    )
    resolved = await resolve_images(images, policy(host, root=tmp_path))
    assert resolved == (b"inline", IMAGE, b"local image")
    # one refusal ends them all, naming its own part
    bad = (*images, RemoteImage(f"http://127.0.0.1:{host.port}/to-private", "messages[1].content[0]"))
    with pytest.raises(InvalidRequestError) as caught:
        await resolve_images(bad, policy(host, root=tmp_path))
    assert caught.value.param == "messages[1].content[0]"


async def local_refusal(url: str, allowed: FetchPolicy) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        await read_local(url, allowed, param="messages[0].content[0].image_url.url")
    assert caught.value.param == "messages[0].content[0].image_url.url"
    return caught.value


async def test_a_malformed_local_path_is_a_400(tmp_path: Path) -> None:
    allowed = FetchPolicy(root=tmp_path)
    (tmp_path / "cat.png").write_bytes(IMAGE)
    error = await local_refusal(f"{tmp_path.as_uri()}/cat.png%00.txt", allowed)
    assert error.code == "invalid_image_url"
    assert "NUL" in error.message
    error = await local_refusal(f"{tmp_path.as_uri()}/{'a' * 5000}.png", allowed)  # (ENAMETOOLONG)
    assert error.code == "media_fetch_failed"
    error = await local_refusal(f"{tmp_path.as_uri()}/missing.png", allowed)
    assert error.code == "media_fetch_failed"


async def test_only_regular_files_are_read_and_a_fifo_does_not_block(tmp_path: Path) -> None:
    """A FIFO under the media dir (no writer: a blocking open would wait for ever) and a
    directory are refused at once."""
    os.mkfifo(tmp_path / "pipe.png")
    (tmp_path / "folder.png").mkdir()
    allowed = FetchPolicy(root=tmp_path)

    async def unblock_after(seconds: float) -> None:
        # (only where the open blocks, as before this fix: a writer lets it return)
        await trio.sleep(seconds)
        fd = os.open(tmp_path / "pipe.png", os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(unblock_after, 10)
        with trio.fail_after(5):
            error = await local_refusal((tmp_path / "pipe.png").as_uri(), allowed)
        nursery.cancel_scope.cancel()
    assert error.code == "media_file_refused"
    assert "not a regular file" in error.message
    error = await local_refusal((tmp_path / "folder.png").as_uri(), allowed)
    assert error.code == "media_file_refused"


def test_a_link_swapped_in_after_the_check_is_not_followed(tmp_path: Path) -> None:
    """The file is opened from the root one component at a time with O_NOFOLLOW: a
    symbolic link in its place (put there after the path was resolved) fails to open."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "cat.png").write_bytes(IMAGE)
    (tmp_path / "link.png").symlink_to(tmp_path / "sub" / "cat.png")
    (tmp_path / "linked").symlink_to(tmp_path / "sub")
    fd = _open_under(str(tmp_path), ("sub", "cat.png"))
    try:
        assert os.read(fd, len(IMAGE) + 1) == IMAGE
    finally:
        os.close(fd)
    for names in (("link.png",), ("linked", "cat.png")):
        # (ELOOP; a link to a directory opened as one: ENOTDIR)
        with pytest.raises(OSError, match=r"symbolic links|Not a directory"):
            _open_under(str(tmp_path), names)
