"""Who may attach to a producer: the peer's credentials on ipc://, a secret on TCP.

ipc:// (the default): the socket file lies in this user's runtime directory, mode
0700, so other users cannot even connect to it. The producer still checks what the
kernel says of every peer that says hello, as far as libzmq hands it on: for a unix
socket, libzmq reads SO_PEERCRED when the connection is accepted and gives it as the
"Peer-Address" property of each message, ``<host>:<uid>:<gid>:<pid>`` (libzmq 4.3.5;
a ZAP handler gets the same string, and nothing more). The hello must come from a
process of the producer's own user and claim that process's own pid: a consumer
speaks for its own process only (the pid is what the producer watches to evict a
dead consumer). This covers an explicit ``address="ipc://PATH"`` outside the runtime
directory too. (libzmq's ZMQ_IPC_FILTER_UID/PID options would drop other peers
silently at connect; the check here answers them with an error instead.)

TCP: any local user can connect to a loopback port, and libzmq gives no credentials
of a TCP peer (its "Peer-Address" is the IP address only), so a consumer must prove
that it knows the producer's secret: a random token (or ``auth_token=`` /
``$TENSORSOCKET_AUTH_TOKEN``) the producer writes to ``<runtime dir>/<name>.secret``,
mode 0600, created with O_EXCL | O_NOFOLLOW and removed when the producer ends.
Consumers of the same user read it there; where they cannot (another runtime
directory, another container), both sides are given the same ``auth_token``.

The secret never crosses the socket, and the producer proves itself first: whatever
listens on the port may be another user's process that bound it before the producer
(a port squatter). Both sides derive a key from the secret (PBKDF2-HMAC-SHA256,
KEY_ITERATIONS rounds, so that a guess at a weak auth_token costs that much), then, as
CPython's multiprocessing.connection does with its authkey, answer each other's
random challenge with an HMAC-SHA256 of it: the consumer sends a ``challenge`` (its
nonce, nothing else); the producer answers ``proof`` (its own nonce and its MAC of
both, labelled "producer"); only if that MAC is right does the consumer send its
hello, carrying its MAC of both nonces labelled "consumer". A squatter thus gets a
random nonce and nothing from which the secret could be found; a replayed or
reflected MAC does not fit another connection's nonces or the other role. The
producer keeps the nonces it sent per connection (MAX_CHALLENGES, for
CHALLENGE_TIMEOUT seconds). A hello whose proof answers no challenge on its connection
(the producer closed the one its challenge was answered on, and the consumer's zmq socket
connected again) is answered RECHALLENGE, and the consumer challenges again on the new
connection: every exchange has fresh nonces, so nothing more is revealed. This is
authentication, not encryption: the control messages after it carry no secret, and
batches never cross the socket.

A hello refused so is answered with an ``auth`` error that says what to do, and
nothing of the producer (no segment name, loader or dataset): the ``welcome`` that
carries those goes to an accepted consumer only. The consumer shows the text of an error
from a peer that has not proved that it is the producer (a squatter's) as that peer's
words, quoted, escaped and cut to a few hundred characters (tensorsocket.control.client).
An ipc producer whose peers come without credentials (not on Linux) falls back to the
secret when it has one, else to the runtime directory's permissions.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import secrets
import stat
import time
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from .. import config
from ..validation import MAX_TOKEN_CHARS, check_token
from .endpoints import Endpoint

if TYPE_CHECKING:
    from .protocol import Hello, Info

SECRET_SUFFIX = ".secret"
KEY_ITERATIONS = 100_000  # PBKDF2 rounds from the secret to the key (~50 ms, once)
_KEY_SALT = b"tensorsocket control plane v7"
NONCE_BYTES = 32  # a challenge's random bytes (sent as hex)
MAX_CHALLENGES = 4096  # challenges a producer keeps unanswered (the oldest go first)
CHALLENGE_TIMEOUT = 10.0  # seconds a challenge may wait for its hello
ANSWERS_KEPT = 4  # producer nonces kept per consumer nonce (a challenge sent again)
AUTH = "auth"  # the error code of a refused hello or info
RECHALLENGE = "rechallenge"  # ... of one whose proof answers no challenge on its connection
_ADVICE = (
    "run the consumer as the producer's user with the same runtime directory "
    "(TENSORSOCKET_RUNTIME_DIR) and name=/port=, so that it reads the producer's secret "
    "file, or give the consumer the producer's auth_token= (TENSORSOCKET_AUTH_TOKEN)")


def secret_path(endpoint: Endpoint) -> Path:
    """The file in which the producer of `endpoint` keeps its secret."""
    return endpoint.runtime_dir / f"{endpoint.name}{SECRET_SUFFIX}"


def producer_secret(endpoint: Endpoint, token: Any = config.UNSET) -> str | None:
    """The secret a producer at `endpoint` requires: the auth_token setting, else a new
    random one for a TCP address; None for an ipc address without auth_token (its
    peers' credentials are checked instead)."""
    chosen = config.get("auth_token", token)
    if chosen is not None:
        return check_token(chosen)
    if endpoint.address.startswith("ipc://"):
        return None
    return secrets.token_hex(32)


def write_secret(path: Path, secret: str) -> None:
    """Write the secret to a new file of mode 0600 that nobody else could have prepared
    (O_EXCL, O_NOFOLLOW). The caller holds the name's lock, so a file already there was
    left by an earlier producer of the name that died: it is replaced."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        path.unlink()
        fd = os.open(path, flags, 0o600)
    try:
        os.write(fd, secret.encode("ascii") + b"\n")
    finally:
        os.close(fd)


def read_secret(path: Path) -> tuple[str | None, str]:
    """(the secret in `path`, or None; why not, when None). Only a regular file of this
    user that nobody else may read counts."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, f"found no secret file {path}"
    except OSError as e:
        return None, f"cannot read the secret file {path}: {e.strerror}"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or \
                stat.S_IMODE(st.st_mode) & 0o077:
            return None, (f"ignored the secret file {path}: not a file of this user with "
                          "mode 0600")
        data = os.read(fd, MAX_TOKEN_CHARS + 2)
    finally:
        os.close(fd)
    try:
        return check_token(data.decode("ascii").strip()), ""
    except (UnicodeDecodeError, ValueError):
        return None, f"ignored the secret file {path}: it holds no valid secret"


@functools.lru_cache(maxsize=8)
def derive_key(secret: str) -> bytes:
    """The MAC key of a secret (see the module docstring)."""
    return hashlib.pbkdf2_hmac("sha256", secret.encode("ascii"), _KEY_SALT, KEY_ITERATIONS)


def new_nonce() -> str:
    """A fresh random challenge."""
    return secrets.token_hex(NONCE_BYTES)


def is_nonce(value: str) -> bool:
    """Whether `value` is a challenge as new_nonce makes them."""
    return len(value) == 2 * NONCE_BYTES and all(ch in "0123456789abcdef" for ch in value)


def mac(key: bytes, role: str, consumer_nonce: str, producer_nonce: str) -> str:
    """What `role` ("producer" or "consumer") answers to the two challenges."""
    data = f"tensorsocket {role} {consumer_nonce} {producer_nonce}".encode("ascii")
    return hmac.new(key, data, hashlib.sha256).hexdigest()


class ClientSecret:
    """The producer's secret as a consumer knows it: the auth_token setting if given,
    else what the producer's secret file holds now (read again when the producer's
    proof does not fit it: a producer started after the consumer writes a new one)."""

    def __init__(self, endpoint: Endpoint, token: Any = config.UNSET) -> None:
        value, source = config.lookup("auth_token", token)
        self._token = check_token(value) if value is not None else None
        self._source = "the auth_token= argument" if source == "argument" else \
            f"${config.SETTINGS['auth_token'].env}"
        self._path = secret_path(endpoint)
        self.lock_path = endpoint.lock_path  # held by the name's producer while it runs
        self.tcp = not endpoint.address.startswith("ipc://")
        self._note = ""

    def current(self) -> str | None:
        """The secret known now (None: none known)."""
        if self._token is not None:
            self._note = f"this consumer used {self._source}"
            return self._token
        secret, why = read_secret(self._path)
        self._note = f"this consumer used the secret from {self._path}" if secret else \
            f"this consumer {why}"
        return secret

    def note(self) -> str:
        """Where the secret last used came from (empty for ipc endpoints, which
        check credentials rather than secrets)."""
        return self._note if self.tcp else ""

    def answer(self, address: str, consumer_nonce: str, proof: Any,
               secret: str | None) -> str | None:
        """This consumer's MAC for the hello, once the producer's `proof` (its reply to
        our challenge) shows that it knows the secret (`secret`: as read before the
        challenge); None for an ipc producer that has no secret (its peers' credentials
        decide). AuthenticationError if the proof does not fit the secret (read again
        once: a producer started meanwhile writes a new one)."""
        from ..errors import AuthenticationError

        if proof.mac is None and not self.tcp:
            return None
        tried: list[str] = []
        if secret is None:
            secret = self.current()
        while secret is not None and secret not in tried:
            tried.append(secret)
            key = derive_key(secret)
            if proof.mac is not None and hmac.compare_digest(
                    proof.mac.encode("utf-8", "replace"),
                    mac(key, "producer", consumer_nonce, proof.nonce).encode("ascii")):
                return mac(key, "consumer", consumer_nonce, proof.nonce)
            secret = self.current()
        if not tried:
            raise AuthenticationError(
                f"this consumer has no secret for the producer at {address} ({self._note}): "
                f"{_ADVICE}")
        raise AuthenticationError(
            f"the process listening at {address} did not prove that it knows the "
            "producer's secret, so this consumer sent it nothing: it is not the producer "
            "(another user's process may hold the port: choose another port=), or the "
            f"producer was given another auth_token ({self._note}); {_ADVICE}")


def peer_credentials(frame: zmq.Frame) -> tuple[int, int, int] | None:
    """(uid, gid, pid) of the process at the other end of a unix socket, from the
    message's "Peer-Address" property; None where libzmq gives none."""
    try:
        address = frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError):
        return None
    parts = str(address).rsplit(":", 3)
    if len(parts) != 4:
        return None
    try:
        uid, gid, pid = (int(part) for part in parts[1:])
    except ValueError:
        return None
    return uid, gid, pid


class Gate:
    """The producer's side: answers challenges and checks hellos (see the module
    docstring)."""

    def __init__(self, address: str, secret: str | None) -> None:
        self._ipc = address.startswith("ipc://")
        self._key = derive_key(secret) if secret is not None else None
        self._challenges: OrderedDict[bytes, tuple[str, str, float]] = OrderedDict()
        # consumer nonce -> (the producer nonces answered for it, on any connection, the
        # last few; when last answered): a hello whose proof answers one of them on
        # another connection (closed since) is asked to challenge again, not refused.
        self._answered: OrderedDict[str, tuple[list[str], float]] = OrderedDict()

    def challenge(self, ident: bytes, consumer_nonce: str) -> tuple[str, str | None]:
        """(this producer's nonce, its proof) for a consumer's challenge on connection
        `ident`; the proof is None if this producer has no secret (ipc)."""
        # A challenge sent again on the same connection (the consumer heard nothing yet)
        # gets the same answer, so that a hello made from either answer is let in.
        prior = self._challenges.pop(ident, None)
        nonce = prior[1] if prior is not None and prior[0] == consumer_nonce else new_nonce()
        now = time.monotonic()
        self._challenges[ident] = (consumer_nonce, nonce, now)
        while len(self._challenges) > MAX_CHALLENGES:
            self._challenges.popitem(last=False)
        answered = self._answered.pop(consumer_nonce, ([], now))[0]
        if nonce not in answered:
            answered = [*answered, nonce][-ANSWERS_KEPT:]
        self._answered[consumer_nonce] = (answered, now)
        while len(self._answered) > MAX_CHALLENGES:
            self._answered.popitem(last=False)
        if self._key is None:
            return nonce, None
        return nonce, mac(self._key, "producer", consumer_nonce, nonce)

    def refusal(self, ident: bytes, frame: zmq.Frame,
                hello: Hello | Info) -> tuple[str, str] | None:
        """None if this hello (or info) from connection `ident` may be answered, else the
        error reply's code and text: "auth", or RECHALLENGE for a proof that answers no
        challenge on its connection (its consumer challenges again on it: the connection
        the challenge was answered on may have been closed, and its zmq socket sent the
        hello on a new one)."""
        challenge = self._challenges.pop(ident, None)
        creds = peer_credentials(frame) if self._ipc else None
        if creds is not None:
            uid, _, pid = creds
            if uid != os.getuid():
                return AUTH, (
                    f"this producer takes consumers of its own user (uid {os.getuid()}) "
                    f"only, and the process that connected (pid {pid}) runs as uid {uid}: "
                    "run the consumer as the same user as the producer")
            if pid != hello.pid:
                return AUTH, (
                    f"the {hello.kind} claims pid {hello.pid} but comes from pid {pid}: a "
                    "consumer speaks for its own process only (a consumer in another "
                    "PID namespace, another container, cannot attach over ipc://; run "
                    "both in the same one)")
            return None
        if self._key is None:
            return None  # an ipc peer without credentials: the 0700 directory decides
        if hello.proof is None:
            return AUTH, (f"this producer requires proof of its secret, and the {hello.kind} "
                          f"has none: {_ADVICE}")
        if challenge is None or time.monotonic() - challenge[2] > CHALLENGE_TIMEOUT:
            return RECHALLENGE, (
                f"the {hello.kind} answers no challenge of this producer on its connection "
                f"(or one older than {CHALLENGE_TIMEOUT:g} s): send a challenge first, on "
                "this connection (the one a challenge was answered on may have been closed)")
        proof = hello.proof.encode("utf-8", "replace")
        if self._answers(proof, challenge[0], challenge[1]):
            return None
        # The consumer sent its challenge again on a new connection (the first one closed
        # once answered) and made its hello of the first answer: no refusal of it.
        for other in self._answered.get(challenge[0], ([], 0.0))[0]:
            if other != challenge[1] and self._answers(proof, challenge[0], other):
                return RECHALLENGE, (
                    f"the {hello.kind} answers this producer's challenge on another "
                    "connection, closed since: send a challenge again, on this connection")
        return AUTH, f"the {hello.kind}'s proof is not of this producer's secret: {_ADVICE}"

    def _answers(self, proof: bytes, consumer_nonce: str, nonce: str) -> bool:
        """Whether `proof` is the consumer's MAC of these nonces with this secret."""
        assert self._key is not None
        expected = mac(self._key, "consumer", consumer_nonce, nonce)
        return hmac.compare_digest(proof, expected.encode("ascii"))

    def forget(self, now: float) -> None:
        """Drop challenges (and the answers kept per consumer nonce) older than
        CHALLENGE_TIMEOUT."""
        while self._answered:
            consumer_nonce, (_, since) = next(iter(self._answered.items()))
            if now - since <= CHALLENGE_TIMEOUT:
                break
            del self._answered[consumer_nonce]
        while self._challenges:
            ident, (_, _, since) = next(iter(self._challenges.items()))
            if now - since <= CHALLENGE_TIMEOUT:
                return
            del self._challenges[ident]
