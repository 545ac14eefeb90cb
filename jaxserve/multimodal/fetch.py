"""http(s) image URLs fetched the way an open server must (issue 52): vLLM's host allow-list, no SSRF.

    --allowed-media-domains   vLLM's flag: given, a URL whose host is not one of the names is refused
                              before any connection; every redirect hop is checked the same way
    public addresses only     without the flag, the host must be (or resolve, every address it has, to) a
                              public address: private, loopback, link-local, multicast, reserved,
                              unspecified and shared (100.64/10) ones are refused before any connection,
                              IPv4-mapped, 6to4, Teredo and NAT64 IPv6 judged by the IPv4 inside;
                              checked again for every redirect hop. Hosts named in --allowed-media-domains
                              are the operator's own choice and may be private (an internal image store)
    pinned                    the host is resolved once, here, and the connection goes to that checked
                              address: the URL's host is swapped for the IP while the Host header and the
                              TLS SNI / certificate check keep the name (httpx's `sni_hostname` extension).
                              So a DNS answer that changes between the check and the connection (DNS
                              rebinding) cannot send the request elsewhere. This is simpler than a custom
                              httpx transport and as sound. No proxy from the environment (trust_env off):
                              a proxy would resolve the name itself, past the check

Every refusal is a ValueError naming `where`: a 400 over HTTP.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

MAX_REDIRECTS = 3
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # the well-known prefix: the last 32 bits are an IPv4 address


def normalize_domains(domains: Any) -> frozenset[str] | None:
    """--allowed-media-domains as host names to compare with (lower case, no trailing dot); None: any host."""
    if domains is None:
        return None
    if isinstance(domains, str) or not all(isinstance(d, str) and d.strip(" .") for d in domains):
        raise ValueError(f"allowed_media_domains: expected a list of host names, got {domains!r}")
    return frozenset(d.strip().rstrip(".").lower() for d in domains)


def non_public(address: str) -> str | None:
    """Why `address` (an IP) is not a public one to fetch from ("loopback", "private", ...); None: public."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 scope id (fe80::1%eth0) dropped
    if isinstance(ip, ipaddress.IPv6Address):  # an IPv4 address inside: the one really reached
        embedded = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if embedded is None and ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            return non_public(str(embedded))
    for kind in ("unspecified", "loopback", "link_local", "multicast", "private", "reserved"):
        if getattr(ip, f"is_{kind}"):
            return kind.replace("_", "-")
    return None if ip.is_global else "non-global"  # 100.64.0.0/10 (shared), ...


def _addresses(host: str, port: int, where: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"{where}: cannot resolve the host {host!r} ({e})") from None
    return list(dict.fromkeys(str(info[4][0]) for info in infos))  # in the resolver's order, once each


def check_name(url: Any, where: str, allowed: frozenset[str] | None) -> str:
    """The host of `url` (an httpx.URL) if its scheme and name are allowed, judged without DNS or a
    connection: --allowed-media-domains, and an IP literal's address."""
    if url.scheme not in ("http", "https"):
        raise ValueError(f"{where}: redirected to a non-http(s) URL {str(url)[:64]!r}")
    host = url.host.rstrip(".").lower()
    if not host:
        raise ValueError(f"{where}: the URL has no host")
    if allowed is not None and host not in allowed:
        raise ValueError(f"{where}: the host {host!r} is not in --allowed-media-domains "
                         f"({', '.join(sorted(allowed))})")
    if allowed is None and _is_ip(host):
        _check_public(host, host, where)
    return host


def check_target(url: Any, where: str, allowed: frozenset[str] | None) -> list[str]:
    """The addresses (all checked) to connect to for `url` (an httpx.URL); ValueError naming `where`
    for a scheme, a host or an address not allowed. No connection is opened here."""
    host = check_name(url, where, allowed)
    addresses = _addresses(url.raw_host.decode("ascii").rstrip("."), url.port or _port(url), where)
    if allowed is None:  # (hosts the operator listed are trusted wherever they resolve)
        for address in addresses:
            _check_public(host, address, where)
    return addresses


def precheck(url: str, where: str, allowed: frozenset[str] | None) -> None:
    """check_name for a URL string: run on every image of a request before the first is fetched."""
    import httpx

    try:
        check_name(httpx.URL(url), where, allowed)
    except httpx.InvalidURL as e:
        raise ValueError(f"{where}: not a valid URL ({e})") from None


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    return True


def _check_public(host: str, address: str, where: str) -> None:
    reason = non_public(address)
    if reason is not None:
        raise ValueError(f"{where}: the host {host!r} is (or resolves to) {address}, a {reason} address: only "
                         "public addresses are fetched (name a trusted host in --allowed-media-domains to fetch "
                         "from it)")


def _port(url: Any) -> int:
    return 443 if url.scheme == "https" else 80


def fetch(url: str, where: str, *, timeout: float, max_bytes: int, allowed: frozenset[str] | None) -> bytes:
    """The body at `url` (at most `max_bytes`), redirects followed by hand (each hop checked); ValueError
    naming `where` for anything refused or failed."""
    import httpx

    try:
        target = httpx.URL(url)
    except httpx.InvalidURL as e:
        raise ValueError(f"{where}: not a valid URL ({e})") from None
    try:
        with httpx.Client(timeout=timeout, follow_redirects=False, trust_env=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                addresses = check_target(target, where, allowed)  # before any connection to this hop
                response = _send(client, target, addresses)
                try:
                    if response.is_redirect:
                        target = target.join(response.headers["location"])
                        continue
                    if response.status_code != 200:
                        raise ValueError(f"{where}: fetching the image answered HTTP {response.status_code}")
                    return _read_capped(response, where, max_bytes)
                finally:
                    response.close()
            raise ValueError(f"{where}: more than {MAX_REDIRECTS} redirects")
    except httpx.TimeoutException:
        raise ValueError(f"{where}: fetching the image timed out after {timeout} s") from None
    except httpx.InvalidURL as e:  # a redirect's Location
        raise ValueError(f"{where}: redirected to an invalid URL ({e})") from None
    except httpx.HTTPError as e:
        raise ValueError(f"{where}: cannot fetch the image ({type(e).__name__}: {e})") from None


def _send(client: Any, target: Any, addresses: list[str]) -> Any:
    """A streamed GET of `target` at the first of `addresses` that accepts (the checked ones only)."""
    import httpx

    headers = {"Host": target.netloc.decode("ascii")}  # the name (and port) as the URL gave them
    error: Exception | None = None
    for address in addresses:
        request = client.build_request("GET", target.copy_with(host=address.split("%", 1)[0]), headers=headers,
                                       extensions={"sni_hostname": target.raw_host.decode("ascii")})
        try:
            return client.send(request, stream=True)
        except httpx.ConnectError as e:  # the next address the name has (IPv6 unreachable, ...)
            error = e
    assert error is not None  # _addresses returns at least one address or raises
    raise error


def _read_capped(response: Any, where: str, max_bytes: int) -> bytes:
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ValueError(f"{where}: the image is larger than {max_bytes} bytes")
    chunks, size = [], 0
    for chunk in response.iter_bytes():
        size += len(chunk)
        if size > max_bytes:  # stop reading: a body without (or lying in) content-length
            raise ValueError(f"{where}: the image is larger than {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
