"""Private swarms: peers with the swarm key, peers without it and peers with
another key, on real UDP and TCP sockets on 127.0.0.1; and the key file as the
CLI reads it (real processes)."""

from __future__ import annotations

import os
import stat
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from cli_harness import run_cli, run_to_completion
from kademlia.node import Node

from dht import DHTConfig, DHTNode, open_dht_node
from dht._records import encode_key, key_id, make_record
from swarm import (
    AsyncPeer,
    BootstrapError,
    ConfigError,
    Identity,
    PeerConfig,
    ProtocolError,
    Stream,
    open_peer,
)
from swarm._swarm_key import create_swarm_key, load_swarm_key

KEY = b"K" * 32
OTHER_KEY = b"O" * 32
FAST = DHTConfig(rpc_timeout=0.5, bootstrap_timeout=1.0)
HOST = "127.0.0.1"


def config(key: bytes | None, *initial: str) -> PeerConfig:
    return PeerConfig(initial_peers=initial, dht=FAST, swarm_key=key)


async def echo(stream: Stream) -> None:
    await stream.send(await stream.receive())


@asynccontextmanager
async def keyed_swarm() -> AsyncIterator[tuple[AsyncPeer, AsyncPeer]]:
    async with open_peer(config=config(KEY)) as a, open_peer(config=config(KEY, a.address)) as b:
        a.connections.set_handler("echo", echo)
        yield a, b


async def _direct_rpcs(outsider: DHTNode, target: AsyncPeer) -> list[tuple[bool, Any]]:
    """The outsider asks ``target`` straight away: ping, find_value, store."""
    proto = outsider._server.proto
    node = Node(target.peer_id, HOST, target.port)
    dkey = key_id(encode_key("secret"))
    record = make_record(
        "planted", "evil", outsider.now() + 60, signer=outsider.identity, limits=FAST.limits
    )

    async def ask() -> list[tuple[bool, Any]]:
        return [
            await proto.call_ping(node),
            await proto.call_find_value(node, Node(dkey)),
            await proto.call_store(node, record),
        ]

    return await outsider._loop.call(ask)


@pytest.mark.parametrize("outsider_key", [None, OTHER_KEY], ids=["no-key", "other-key"])
async def test_outsiders_can_neither_read_store_bootstrap_nor_connect(
    outsider_key: bytes | None,
) -> None:
    async with keyed_swarm() as (a, b):
        # The keyed peers form a swarm: records and connections work.
        assert await a.dht.store("secret", "for members", a.dht.now() + 60)
        value = await b.dht.get("secret", latest=True)
        assert value is not None and value.value == "for members"
        assert await b.connections.call(a.peer_id, a.endpoint, "echo", 7, timeout=5) == 7

        # An outsider cannot bootstrap off them...
        with pytest.raises(BootstrapError):
            async with open_peer(config=config(outsider_key, a.address)):
                pass
        async with open_dht_node(
            Identity.generate(), config=DHTConfig(rpc_timeout=0.5, swarm_key=outsider_key)
        ) as outsider:
            # ...gets no answer at all to ping, find_value or store...
            dropped_before = a.dht.dropped_datagrams
            resent_before = outsider._server.proto.resent_requests
            answers = await _direct_rpcs(outsider, a)
            assert [ok for ok, _ in answers] == [False, False, False]
            # every copy of the three requests (unanswered ones are sent again)
            copies = 3 + outsider._server.proto.resent_requests - resent_before
            assert copies > 3 and a.dht.dropped_datagrams == dropped_before + copies
            assert await a.dht.get("planted") is None
            # ...and cannot complete a connection handshake in either role.
            outsider_id = Identity.generate()
            outsider_config = PeerConfig(dht=FAST, swarm_key=outsider_key)
            async with open_peer(outsider_id, outsider_config) as peer:
                peer.connections.set_handler("echo", echo)
                with pytest.raises(ProtocolError, match="swarm"):
                    await peer.connections.call(a.peer_id, a.endpoint, "echo", 1, timeout=5)
                with pytest.raises(ProtocolError, match="swarm"):
                    await a.connections.call(peer.peer_id, peer.endpoint, "echo", 1, timeout=5)
        # The members still serve each other.
        assert await b.connections.call(a.peer_id, a.endpoint, "echo", 8, timeout=5) == 8


def test_peer_config_copies_the_key_into_both_layers() -> None:
    c = config(KEY)
    assert c.connections.swarm_key == KEY and c.dht.swarm_key == KEY
    assert KEY.decode() not in repr(c)  # a secret never reaches a log line
    with pytest.raises(ConfigError, match="set the key in one place"):
        PeerConfig(dht=DHTConfig(swarm_key=OTHER_KEY), swarm_key=KEY)
    with pytest.raises(ConfigError, match="16 bytes"):
        DHTConfig(swarm_key=b"short")


def test_key_file_is_created_0600_never_overwritten_and_refused_if_others_can_read(
    tmp_path: Path,
) -> None:
    path = tmp_path / "swarm.key"
    key = create_swarm_key(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_swarm_key(path) == key and len(key) == 32
    with pytest.raises(ConfigError, match="exists already"):
        create_swarm_key(path)
    assert load_swarm_key(path) == key
    for mode in (0o640, 0o604, 0o620):
        os.chmod(path, mode)
        with pytest.raises(ConfigError, match="chmod 600"):
            load_swarm_key(path)
    os.chmod(path, 0o600)
    (tmp_path / "bad.key").write_bytes(b"not a key\n")
    os.chmod(tmp_path / "bad.key", 0o600)
    with pytest.raises(ConfigError, match="not a swarm key"):
        load_swarm_key(tmp_path / "bad.key")
    with pytest.raises(ConfigError, match="swarm keygen"):
        load_swarm_key(tmp_path / "missing.key")


async def test_cli_private_swarm_and_world_readable_key(tmp_path: Path) -> None:
    path = str(tmp_path / "swarm.key")
    made = await run_to_completion("keygen", "--swarm-key", path)
    assert made.returncode == 0, made.stderr
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = await run_to_completion("keygen", "--swarm-key", path)
    assert again.returncode == 2 and b"exists already" in again.stderr

    async with run_cli("dht", "--host", HOST, "--swarm-key", path) as bootstrap:
        line = await bootstrap.read_line_containing("join with:")
        assert line.endswith(f"--swarm-key {path}")
        address = line.split("--initial-peer", 1)[1].split()[0]
        status = await run_to_completion(
            "status", "--initial-peer", address, "--swarm-key", path, "--json"
        )
        assert status.returncode == 0, status.stderr

        os.chmod(path, 0o644)
        refused = await run_to_completion("dht", "--host", HOST, "--swarm-key", path)
        assert refused.returncode == 2
        lines = refused.stderr.decode().strip().splitlines()
        assert len(lines) == 1 and "chmod 600" in lines[0], lines
        assert await bootstrap.stop() == 0


def test_train_passes_the_key_to_its_peer_and_join_command(tmp_path: Path) -> None:
    from swarm.cli import _join_command, _peer_config, build_parser

    path = str(tmp_path / "swarm.key")
    key = create_swarm_key(path)
    args = build_parser().parse_args(["train", "--host", HOST, "--swarm-key", path])
    peer_config = _peer_config(args)
    assert peer_config.connections.swarm_key == key and peer_config.dht.swarm_key == key
    assert f"--swarm-key {path}" in _join_command(args, "127.0.0.1:1234", "digits")
