"""Which address a peer listening on a wildcard (``0.0.0.0``) tells others to dial.

The rule (``announce_host``), in order:

1. A peer that listens on a specific address announces that address.
2. Joining (an initial peer is known): the local address of the route toward
   the first initial peer, i.e. the source address a connection to it uses.
   That is loopback only when the initial peer itself is on loopback (then
   everyone who can reach the initial peer is on this machine too).
3. Starting a swarm (no initial peer): the local address of the route toward
   the internet (no packet is sent: a UDP ``connect`` only picks the route);
   on a machine without a default route, the address of the first
   non-loopback interface (by interface index).
4. Otherwise there is nothing another machine could dial: ``ConfigError``,
   whose message says to pass ``--announce HOST:PORT``.

A loopback address is never announced to peers that are not on this machine:
the machine's host name (which often resolves to 127.0.1.1) is not consulted.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

from ._errors import ConfigError

#: Any address outside this machine (TEST-NET-1): only used to find the outgoing route.
ROUTE_PROBE = "192.0.2.1"
#: ``ioctl`` request that reads an interface's IPv4 address (linux/sockios.h).
_SIOCGIFADDR = 0x8915


def is_wildcard(host: str) -> bool:
    """True for the addresses that mean "every interface"."""
    return host in ("0.0.0.0", "::", "")


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8 and ::1 (False for names and malformed text)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def route_source(toward: str) -> str | None:
    """The local address of the route toward ``toward`` (an IP); None without one.

    Sends nothing: connecting a UDP socket only selects the route.
    """
    family = socket.AF_INET6 if ":" in toward else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((toward, 9))
            address: str = probe.getsockname()[0]
    except OSError:  # ENETUNREACH: no route (e.g. no default route)
        return None
    return None if is_wildcard(address) else address


def interface_addresses() -> list[str]:
    """The IPv4 addresses of this machine's interfaces, in interface-index order
    (Linux ``SIOCGIFADDR``; interfaces without an IPv4 address are skipped)."""
    found: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
            except OSError:  # EADDRNOTAVAIL: no IPv4 address on it
                continue
            found.append(socket.inet_ntoa(reply[20:24]))
    return found


def announce_host(host: str, toward: str | None = None) -> str:
    """The host others should dial, for a peer listening on ``host``
    (module docstring: the rule). ``toward`` is the first initial peer's IP.

    Raises ``ConfigError`` (saying to pass ``--announce``) when the machine has
    no address that another machine could dial.
    """
    if not is_wildcard(host):
        return host
    if toward is not None:
        source = route_source(toward)
        if source is not None and (not is_loopback(source) or is_loopback(toward)):
            return source
        raise ConfigError(
            f"no route from this machine toward the initial peer {toward}: "
            "pass --announce HOST:PORT with the address others should dial"
        )
    source = route_source(ROUTE_PROBE)
    if source is not None and not is_loopback(source):
        return source
    for address in interface_addresses():
        if not is_loopback(address):
            return address
    raise ConfigError(
        "this machine has no network address other than loopback, so no other machine "
        "could dial it: pass --announce HOST:PORT with the address others should dial "
        "(or --host 127.0.0.1 for a swarm on this machine only)"
    )
