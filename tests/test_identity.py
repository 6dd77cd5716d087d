import os
import stat

import pytest

from swarm import ConfigError, Identity, PeerID, verify_signature


def test_peer_id_is_derived_from_public_key() -> None:
    a = Identity.from_seed(b"a" * 32)
    assert a.peer_id == PeerID.from_public_key(a.public_key)
    assert Identity.from_seed(b"a" * 32).peer_id == a.peer_id
    assert Identity.from_seed(b"b" * 32).peer_id != a.peer_id
    assert len(a.peer_id) == 20


def test_signatures_verify_only_for_their_key_and_message() -> None:
    a, b = Identity.generate(), Identity.generate()
    sig = a.sign(b"hello")
    assert verify_signature(a.public_key, sig, b"hello")
    assert not verify_signature(a.public_key, sig, b"hellO")
    assert not verify_signature(b.public_key, sig, b"hello")
    assert not verify_signature(a.public_key[:5], sig, b"hello")
    assert not verify_signature(a.public_key, sig[:10], b"hello")


def test_identity_file_is_created_0600_and_reused(tmp_path: pytest.TempPathFactory) -> None:
    path = os.path.join(str(tmp_path), "keys", "id.pem")
    first = Identity.load_or_create(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = Identity.load_or_create(path)
    assert again.peer_id == first.peer_id
    assert [f for f in os.listdir(os.path.dirname(path))] == ["id.pem"]


def test_identity_file_readable_by_others_is_refused(tmp_path: pytest.TempPathFactory) -> None:
    path = os.path.join(str(tmp_path), "id.pem")
    Identity.load_or_create(path)
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        Identity.load_or_create(path)


def test_identity_file_with_garbage_is_refused(tmp_path: pytest.TempPathFactory) -> None:
    path = os.path.join(str(tmp_path), "id.pem")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"not a key")
    os.close(fd)
    with pytest.raises(ConfigError, match="does not hold a private key"):
        Identity.load_or_create(path)


def test_peer_id_hex_round_trip() -> None:
    pid = Identity.generate().peer_id
    assert PeerID.from_hex(str(pid)) == pid
    with pytest.raises(ValueError):
        PeerID.from_hex("zz")
