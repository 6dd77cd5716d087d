"""``swarm dht`` as a user runs it: real processes on 127.0.0.1."""

import signal

from cli_harness import free_udp_port, run_cli, run_to_completion


async def test_two_dht_peers_join_and_stop_cleanly() -> None:
    async with run_cli("dht", "--host", "127.0.0.1") as first:
        line = await first.read_line_containing("join with:")
        address = line.rsplit("--initial-peer", 1)[1].strip()
        assert address.startswith("127.0.0.1:")
        async with run_cli("dht", "--host", "127.0.0.1", "--initial-peer", address) as second:
            await second.read_line_containing("join with:")
            assert await second.stop(signal.SIGINT) == 0
        assert await first.stop(signal.SIGTERM) == 0


async def test_unreachable_bootstrap_peer_exits_2_with_one_line() -> None:
    port = await free_udp_port()
    result = await run_to_completion(
        "dht", "--host", "127.0.0.1", "--initial-peer", f"127.0.0.1:{port}"
    )
    assert result.returncode == 2
    lines = result.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "no initial peer answered" in lines[0], lines


async def test_bad_address_exits_2_with_one_line() -> None:
    for bad in ("nonsense", "127.0.0.1:99999", "127.0.0.1:port"):
        result = await run_to_completion("dht", "--initial-peer", bad)
        assert result.returncode == 2
        lines = result.stderr.decode().strip().splitlines()
        assert len(lines) == 1 and "error" in lines[0], lines


async def test_bad_usage_exits_2() -> None:
    result = await run_to_completion("dht", "--port", "not-a-number")
    assert result.returncode == 2
    result = await run_to_completion("frobnicate")
    assert result.returncode == 2


async def test_identity_file_keeps_peer_id_across_restarts(tmp_path: object) -> None:
    path = f"{tmp_path}/peer.key"
    ids = []
    for _ in range(2):
        async with run_cli("dht", "--host", "127.0.0.1", "--identity", path) as peer:
            line = await peer.read_line_containing("listening on")
            ids.append(line.split()[1])
            assert await peer.stop() == 0
    assert ids[0] == ids[1]
