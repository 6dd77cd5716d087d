"""The connection handshake as a pure state machine: bytes in, bytes out.

Each TCP connection starts with three messages (a SIGMA-style signed
Diffie-Hellman exchange)::

    M1 dialer -> listener   protocol, e_D, n_D, encrypt_D
    M2 listener -> dialer   core2 = [e_L, n_L, encrypt_L, pk_L], sig_L, mac_L
    M3 dialer -> listener   core3 = [pk_D], sig_D, mac_D

``e_*`` are fresh X25519 public keys and ``n_*`` fresh 32-byte nonces; ``pk_*``
are the Ed25519 keys behind the peer ids. The transcript hashes are::

    th2 = SHA-256(DOMAIN || len(M1) || M1 || len(core2) || core2)
    th3 = SHA-256(th2 || len(core3) || core3)

and each side signs its own role label followed by its transcript hash
(``sig_L`` over ``LISTENER_LABEL || th2``, ``sig_D`` over
``DIALER_LABEL || th3``). Both sides' ephemeral keys and nonces are in what each
side signs, so a recorded signature is useless in another handshake (replay),
and the role labels differ, so a listener's signature cannot be played back as
a dialer's (reflection). The signed bytes are exactly the bytes received,
never a re-encoding.

Session keys: HKDF-SHA256 over the X25519 shared secret (followed by the
swarm key of a private swarm, if any), salted with ``th3``, with the session
mode in ``info``; 64 bytes split into the dialer-to-listener and the
listener-to-dialer key. The session is encrypted when either side asks for it;
both flags are signed, so nobody in the middle can downgrade it.

A private swarm (``swarm_key``) adds ``mac_* = HMAC-SHA256(swarm_key, label ||
th)`` to M2 and M3: a peer without the key cannot complete a handshake with a
peer that has it, in either role.

Each message travels as a 2-byte big-endian length and a msgpack document of
at most ``MAX_MESSAGE_SIZE`` bytes. Every malformed, oversized, unexpected or
unverifiable input raises ``ProtocolError``, after which the state machine
refuses all further input.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ._errors import ProtocolError, SelfDialError
from ._identity import PUBLIC_KEY_SIZE, SIGNATURE_SIZE, Identity, PeerID, verify_signature
from ._wire import expect_bytes, expect_list, expect_str, pack, unpack

PROTOCOL = "swarm-handshake/1"
DOMAIN = b"swarm/handshake/v1"
LISTENER_LABEL = b"swarm/handshake/v1/listener-signature"
DIALER_LABEL = b"swarm/handshake/v1/dialer-signature"
_LISTENER_MAC_LABEL = b"swarm/handshake/v1/listener-swarm-key"
_DIALER_MAC_LABEL = b"swarm/handshake/v1/dialer-swarm-key"
_SESSION_INFO = b"swarm/session/v1/"

#: Largest handshake message; the real ones are under 300 bytes.
MAX_MESSAGE_SIZE = 1024
NONCE_SIZE = 32
KEY_SIZE = 32
_MAC_SIZE = 32
_LENGTH = struct.Struct(">H")

RandomBytes = Callable[[int], bytes]


@dataclass(frozen=True)
class HandshakeResult:
    """What a completed handshake proved and agreed.

    ``remote_peer`` is proven: the remote signed this handshake's transcript
    with the key behind it. ``send_key``/``receive_key`` are this side's
    AES-256-GCM keys, one per direction.
    """

    remote_peer: PeerID
    remote_public_key: bytes
    encrypt: bool
    send_key: bytes
    receive_key: bytes
    transcript_hash: bytes


class _State(enum.Enum):
    START = "start"
    WAIT_M1 = "wait for M1"
    WAIT_M2 = "wait for M2"
    WAIT_M3 = "wait for M3"
    DONE = "done"
    FAILED = "failed"


def _length_prefixed(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def _frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


def _mac(key: bytes, label: bytes, transcript_hash: bytes) -> bytes:
    return hmac.new(key, label + transcript_hash, hashlib.sha256).digest()


def _public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _expect_bool(obj: Any, what: str) -> bool:
    if not isinstance(obj, bool):
        raise ProtocolError(f"{what}: expected a boolean, got {type(obj).__name__}")
    return obj


class Handshake:
    """One side of one connection's handshake; it knows no sockets (h11-style).

    The dialer (``initiator=True``) sends ``start()``'s bytes first. Then each
    side passes whatever it receives to ``receive_data`` and sends what that
    returns, until ``complete``. Bytes that arrived after the last handshake
    message (the dialer may pipeline session frames) are in ``unused_data``.

    ``expected_peer`` (dialer only) is the peer id the caller meant to reach; a
    remote that proves any other identity is refused with ``ProtocolError``,
    except one that proves *our own* identity (we dialed ourselves): that is
    ``SelfDialError``, on both sides, and blames nobody.
    ``random_bytes`` supplies the ephemeral key and nonce (tests inject it).

    ``proven_peer`` is set as soon as the remote's signature over this
    handshake verifies, so a caller can blame a remote that proved who it is
    and then failed (e.g. without the swarm key); before that, nothing the
    remote claimed is proven and nobody can be blamed.
    """

    def __init__(
        self,
        identity: Identity,
        *,
        initiator: bool,
        encrypt: bool = True,
        expected_peer: PeerID | None = None,
        swarm_key: bytes | None = None,
        random_bytes: RandomBytes = os.urandom,
    ) -> None:
        if expected_peer is not None and not initiator:
            raise ValueError("only the dialer knows which peer it expects")
        self._identity = identity
        self._initiator = initiator
        self._encrypt = encrypt
        self._expected_peer = expected_peer
        self._swarm_key = swarm_key
        self._ephemeral = X25519PrivateKey.from_private_bytes(random_bytes(KEY_SIZE))
        self._ephemeral_public = _public_bytes(self._ephemeral)
        self._nonce = random_bytes(NONCE_SIZE)
        self._state = _State.START if initiator else _State.WAIT_M1
        self._buffer = bytearray()
        self._m1 = b""
        self._th2 = b""
        self._remote_ephemeral = b""
        self._remote_encrypt = False
        self._result: HandshakeResult | None = None
        self.unused_data = b""
        self.proven_peer: PeerID | None = None

    @property
    def complete(self) -> bool:
        return self._state is _State.DONE

    @property
    def result(self) -> HandshakeResult:
        """The outcome; raises ``RuntimeError`` before the handshake is complete."""
        if self._result is None:
            raise RuntimeError("the handshake is not complete")
        return self._result

    def start(self) -> bytes:
        """The bytes the dialer sends first (M1); ``b""`` for the listener."""
        if not self._initiator:
            return b""
        if self._state is not _State.START:
            raise RuntimeError("start() was already called")
        self._m1 = pack([PROTOCOL, self._ephemeral_public, self._nonce, self._encrypt])
        self._state = _State.WAIT_M2
        return _frame(self._m1)

    def receive_data(self, data: bytes | bytearray | memoryview) -> bytes:
        """Consume received bytes; return the bytes to send (possibly empty).

        Raises ``ProtocolError`` if the remote breaks the protocol; the handshake
        is then failed for good and every later call raises it too.
        """
        if self._state is _State.FAILED:
            raise ProtocolError("the handshake already failed")
        if self._state is _State.START:
            raise RuntimeError("the dialer must call start() first")
        if self._state is _State.DONE:
            self.unused_data += bytes(data)
            return b""
        self._buffer += data
        out = bytearray()
        try:
            while self._state is not _State.DONE:
                message = self._next_message()
                if message is None:
                    break
                out += self._handle(message)
        except BaseException:
            self._state = _State.FAILED
            raise
        if self._state is _State.DONE:
            self.unused_data = bytes(self._buffer)
            self._buffer.clear()
        return bytes(out)

    def _next_message(self) -> bytes | None:
        if len(self._buffer) < _LENGTH.size:
            return None
        (size,) = _LENGTH.unpack_from(self._buffer)
        if size == 0 or size > MAX_MESSAGE_SIZE:
            raise ProtocolError(f"handshake message of {size} bytes (limit {MAX_MESSAGE_SIZE})")
        end = _LENGTH.size + size
        if len(self._buffer) < end:
            return None
        message = bytes(self._buffer[_LENGTH.size : end])
        del self._buffer[:end]
        return message

    def _handle(self, message: bytes) -> bytes:
        if self._state is _State.WAIT_M1:
            return self._on_m1(message)
        if self._state is _State.WAIT_M2:
            return self._on_m2(message)
        if self._state is _State.WAIT_M3:
            self._on_m3(message)
            return b""
        raise ProtocolError(f"unexpected handshake message in state {self._state.value}")

    # Listener side.

    def _on_m1(self, m1: bytes) -> bytes:
        fields = expect_list(unpack(m1, max_size=MAX_MESSAGE_SIZE), 4, "handshake M1")
        protocol = expect_str(fields[0], "M1 protocol", max_size=64)
        if protocol != PROTOCOL:
            raise ProtocolError(f"remote speaks {protocol!r}, expected {PROTOCOL!r}")
        self._remote_ephemeral = expect_bytes(fields[1], "M1 ephemeral key", size=KEY_SIZE)
        expect_bytes(fields[2], "M1 nonce", size=NONCE_SIZE)
        self._remote_encrypt = _expect_bool(fields[3], "M1 encrypt flag")
        self._m1 = m1
        core2 = pack(
            [self._ephemeral_public, self._nonce, self._encrypt, self._identity.public_key]
        )
        self._th2 = _transcript2(m1, core2)
        signature = self._identity.sign(LISTENER_LABEL + self._th2)
        mac = (
            b""
            if self._swarm_key is None
            else _mac(self._swarm_key, _LISTENER_MAC_LABEL, self._th2)
        )
        self._state = _State.WAIT_M3
        return _frame(pack([core2, signature, mac]))

    def _on_m3(self, m3: bytes) -> None:
        fields = expect_list(unpack(m3, max_size=MAX_MESSAGE_SIZE), 3, "handshake M3")
        core3 = expect_bytes(fields[0], "M3 core", max_size=MAX_MESSAGE_SIZE)
        signature = expect_bytes(fields[1], "M3 signature", size=SIGNATURE_SIZE)
        mac = expect_bytes(fields[2], "M3 swarm key proof", max_size=_MAC_SIZE)
        core = expect_list(unpack(core3, max_size=MAX_MESSAGE_SIZE), 1, "M3 core")
        public_key = expect_bytes(core[0], "M3 public key", size=PUBLIC_KEY_SIZE)
        th3 = _transcript3(self._th2, core3)
        if not verify_signature(public_key, signature, DIALER_LABEL + th3):
            raise ProtocolError("the dialer's handshake signature does not verify")
        proven = PeerID.from_public_key(public_key)
        if proven == self._identity.peer_id:
            raise SelfDialError("this peer dialed itself")
        self.proven_peer = proven
        self._check_mac(mac, _DIALER_MAC_LABEL, th3)
        self._finish(public_key, th3, send_first=False)

    # Dialer side.

    def _on_m2(self, m2: bytes) -> bytes:
        fields = expect_list(unpack(m2, max_size=MAX_MESSAGE_SIZE), 3, "handshake M2")
        core2 = expect_bytes(fields[0], "M2 core", max_size=MAX_MESSAGE_SIZE)
        signature = expect_bytes(fields[1], "M2 signature", size=SIGNATURE_SIZE)
        mac = expect_bytes(fields[2], "M2 swarm key proof", max_size=_MAC_SIZE)
        core = expect_list(unpack(core2, max_size=MAX_MESSAGE_SIZE), 4, "M2 core")
        self._remote_ephemeral = expect_bytes(core[0], "M2 ephemeral key", size=KEY_SIZE)
        expect_bytes(core[1], "M2 nonce", size=NONCE_SIZE)
        self._remote_encrypt = _expect_bool(core[2], "M2 encrypt flag")
        public_key = expect_bytes(core[3], "M2 public key", size=PUBLIC_KEY_SIZE)
        remote = PeerID.from_public_key(public_key)
        th2 = _transcript2(self._m1, core2)
        # Only we can sign a transcript that holds our fresh M1, so a valid
        # signature by our own key means the address we dialed is this peer.
        if remote == self._identity.peer_id and verify_signature(
            public_key, signature, LISTENER_LABEL + th2
        ):
            expected = "a peer" if self._expected_peer is None else self._expected_peer.short()
            raise SelfDialError(f"dialing {expected} reached this peer itself")
        if self._expected_peer is not None and remote != self._expected_peer:
            raise ProtocolError(
                f"expected peer {self._expected_peer.short()}, the remote proved {remote.short()}"
            )
        if not verify_signature(public_key, signature, LISTENER_LABEL + th2):
            raise ProtocolError("the listener's handshake signature does not verify")
        self.proven_peer = remote
        self._check_mac(mac, _LISTENER_MAC_LABEL, th2)
        core3 = pack([self._identity.public_key])
        th3 = _transcript3(th2, core3)
        own_signature = self._identity.sign(DIALER_LABEL + th3)
        own_mac = b"" if self._swarm_key is None else _mac(self._swarm_key, _DIALER_MAC_LABEL, th3)
        self._finish(public_key, th3, send_first=True)
        return _frame(pack([core3, own_signature, own_mac]))

    def _check_mac(self, mac: bytes, label: bytes, transcript_hash: bytes) -> None:
        if self._swarm_key is None:
            if mac:
                raise ProtocolError("the remote belongs to a private swarm (it proved a swarm key)")
            return
        if not hmac.compare_digest(mac, _mac(self._swarm_key, label, transcript_hash)):
            raise ProtocolError("the remote did not prove this swarm's key")

    def _finish(self, remote_public_key: bytes, th3: bytes, *, send_first: bool) -> None:
        try:
            shared = self._ephemeral.exchange(
                X25519PublicKey.from_public_bytes(self._remote_ephemeral)
            )
        except ValueError as e:  # a low-order point gives an all-zero secret
            raise ProtocolError(f"bad ephemeral key: {e}") from e
        encrypt = self._encrypt or self._remote_encrypt
        mode = b"encrypted" if encrypt else b"authenticated"
        okm = HKDF(
            algorithm=hashes.SHA256(), length=2 * KEY_SIZE, salt=th3, info=_SESSION_INFO + mode
        ).derive(shared + (self._swarm_key or b""))
        dialer_to_listener, listener_to_dialer = okm[:KEY_SIZE], okm[KEY_SIZE:]
        send, receive = (
            (dialer_to_listener, listener_to_dialer)
            if send_first
            else (listener_to_dialer, dialer_to_listener)
        )
        self._result = HandshakeResult(
            remote_peer=PeerID.from_public_key(remote_public_key),
            remote_public_key=remote_public_key,
            encrypt=encrypt,
            send_key=send,
            receive_key=receive,
            transcript_hash=th3,
        )
        self._state = _State.DONE


_EXPORT_INFO = b"swarm/session/v1/export/"


def exported_key(result: HandshakeResult, *, dialer: bool, label: bytes) -> bytes:
    """A 32-byte key for ``label`` that both ends of the session derive alike.

    HKDF-SHA256 over both session keys (dialer-to-listener first), salted with
    the transcript hash, ``label`` in ``info``: for protocols that run beside
    the connection (the lossy all-reduce's datagrams) and must be bound to the
    same proven peers, swarm key included. Knowing an exported key reveals
    nothing about the session keys or about keys exported for other labels.
    ``dialer`` is this side's role in the handshake.
    """
    first, second = (
        (result.send_key, result.receive_key) if dialer else (result.receive_key, result.send_key)
    )
    return HKDF(
        algorithm=hashes.SHA256(),
        length=KEY_SIZE,
        salt=result.transcript_hash,
        info=_EXPORT_INFO + label,
    ).derive(first + second)


def _transcript2(m1: bytes, core2: bytes) -> bytes:
    return hashlib.sha256(DOMAIN + _length_prefixed(m1) + _length_prefixed(core2)).digest()


def _transcript3(th2: bytes, core3: bytes) -> bytes:
    return hashlib.sha256(th2 + _length_prefixed(core3)).digest()
