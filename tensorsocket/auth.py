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
of a TCP peer (its "Peer-Address" is the IP address only), so a hello must carry the
producer's secret: a random token (or ``auth_token=`` / ``$TENSORSOCKET_AUTH_TOKEN``)
the producer writes to ``<runtime dir>/<name>.secret``, mode 0600, created with
O_EXCL | O_NOFOLLOW and removed when the producer ends. Consumers of the same user
read it there; where they cannot (another runtime directory, another container), both
sides are given the same ``auth_token``.

A hello refused so is answered with an ``auth`` error that says what to do, and
nothing of the producer (no segment name, loader or dataset): the ``welcome`` that
carries those goes to an accepted consumer only. An ipc producer whose peers come
without credentials (not on Linux) falls back to the secret when it has one, else
to the runtime directory's permissions.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from pathlib import Path
from typing import Any

import zmq

from . import config
from .endpoints import Endpoint

SECRET_SUFFIX = ".secret"
MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 1024
_ADVICE = (
    "run the consumer as the producer's user with the same runtime directory "
    "(TENSORSOCKET_RUNTIME_DIR) and name=/port=, so that it reads the producer's secret "
    "file, or give the consumer the producer's auth_token= (TENSORSOCKET_AUTH_TOKEN)")


def secret_path(endpoint: Endpoint) -> Path:
    """The file in which the producer of `endpoint` keeps its secret."""
    return endpoint.runtime_dir / f"{endpoint.name}{SECRET_SUFFIX}"


def check_token(token: Any) -> str:
    """A token given by the user, checked (ValueError saying what is wrong)."""
    if not isinstance(token, str):
        raise ValueError(f"auth_token must be a str, got {type(token).__name__}")
    if not MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_CHARS:
        raise ValueError(f"auth_token must have {MIN_TOKEN_CHARS} to {MAX_TOKEN_CHARS} "
                         f"characters, got {len(token)}")
    if not all("!" <= ch <= "~" for ch in token):
        raise ValueError("auth_token must be printable ASCII without spaces")
    return token


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


class ClientSecret:
    """What a consumer sends as its secret: the auth_token setting if given, else what
    the producer's secret file holds now (read again at each hello: a producer started
    after the consumer writes a new one)."""

    def __init__(self, endpoint: Endpoint, token: Any = config.UNSET) -> None:
        value, source = config.lookup("auth_token", token)
        self._token = check_token(value) if value is not None else None
        self._source = "the auth_token= argument" if source == "argument" else \
            f"${config.SETTINGS['auth_token'].env}"
        self._path = secret_path(endpoint)
        self._tcp = not endpoint.address.startswith("ipc://")
        self._note = ""

    def current(self) -> str | None:
        """The secret to send now (None: none known)."""
        if self._token is not None:
            self._note = f"this consumer sent {self._source}"
            return self._token
        secret, why = read_secret(self._path)
        self._note = f"this consumer sent the secret from {self._path}" if secret else \
            f"this consumer {why}"
        return secret

    def note(self) -> str:
        """Where the secret last sent came from (empty for ipc endpoints, which
        check credentials rather than secrets)."""
        return self._note if self._tcp else ""


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
    """The producer's check of a hello (see the module docstring)."""

    def __init__(self, address: str, secret: str | None) -> None:
        self._ipc = address.startswith("ipc://")
        self._secret = secret

    def refusal(self, frame: zmq.Frame, hello: Any) -> str | None:
        """None if this hello (or info: a protocol.Message with pid and secret) may be
        answered, else why not (for the error reply)."""
        creds = peer_credentials(frame) if self._ipc else None
        if creds is not None:
            uid, _, pid = creds
            if uid != os.getuid():
                return (f"this producer takes consumers of its own user (uid {os.getuid()}) "
                        f"only, and the process that connected (pid {pid}) runs as uid {uid}: "
                        "run the consumer as the same user as the producer")
            if pid != hello.pid:
                return (f"the {hello.kind} claims pid {hello.pid} but comes from pid {pid}: a "
                        "consumer speaks for its own process only (a consumer in another "
                        "PID namespace, another container, cannot attach over ipc://; run "
                        "both in the same one)")
            return None
        if self._secret is None:
            return None  # an ipc peer without credentials: the 0700 directory decides
        given = hello.secret
        if given is None:
            return f"this producer requires its secret, and the {hello.kind} has none: {_ADVICE}"
        if not hmac.compare_digest(given.encode("utf-8", "replace"),
                                   self._secret.encode("ascii")):
            return f"the secret in the {hello.kind} is not this producer's: {_ADVICE}"
        return None
