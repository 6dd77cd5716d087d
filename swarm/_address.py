"""Peer addresses: ``host:port`` as users type them."""

from __future__ import annotations

import ipaddress
import socket

from ._errors import ConfigError

Address = tuple[str, int]


def parse_address(text: str) -> Address:
    """Parse ``HOST:PORT`` (``[v6]:PORT`` for IPv6) into ``(ip, port)``.

    Host names are resolved once, here, because the DHT speaks IP addresses.
    Raises ``ConfigError`` with a message that says what is wrong.
    """
    host, sep, port_text = text.strip().rpartition(":")
    if not sep or not host:
        raise ConfigError(f"address {text!r} is not HOST:PORT (for example 127.0.0.1:31337)")
    host = host.strip("[]")
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"address {text!r}: port {port_text!r} is not a number") from None
    if not 1 <= port <= 65535:
        raise ConfigError(f"address {text!r}: port {port} is outside 1-65535")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        try:
            host = str(socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0][4][0])
        except (socket.gaierror, UnicodeError):
            raise ConfigError(f"address {text!r}: cannot resolve host {host!r}") from None
    return host, port


def format_address(host: str, port: int) -> str:
    if ":" in host:
        return f"[{host}]:{port}"
    return f"{host}:{port}"
