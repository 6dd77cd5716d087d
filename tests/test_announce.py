"""The announce rule's pieces that need no namespace (``swarm._announce``);
tests/test_netbed.py runs it where the machine has no default route."""

from __future__ import annotations

import pytest

from swarm._announce import announce_host, interface_addresses, is_loopback, route_source


def test_a_specific_host_is_announced_as_it_is() -> None:
    assert announce_host("10.1.2.3", toward="127.0.0.1") == "10.1.2.3"
    assert announce_host("127.0.0.1") == "127.0.0.1"


def test_loopback_only_toward_a_peer_on_loopback() -> None:
    assert announce_host("0.0.0.0", toward="127.0.0.1") == "127.0.0.1"
    assert route_source("127.0.0.1") == "127.0.0.1"


def test_interfaces_include_loopback() -> None:
    assert "127.0.0.1" in interface_addresses()


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("10.0.0.1", False), ("x", False)],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
