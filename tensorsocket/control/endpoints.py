"""Rendezvous: where a producer named N listens and how its segments are named.

With no arguments both sides use the name ``default`` (or
``$TENSORSOCKET_NAME``) and meet at an ipc:// socket in a per-user runtime
directory of mode 0700 (``$TENSORSOCKET_RUNTIME_DIR``, else
``$XDG_RUNTIME_DIR/tensorsocket``, else ``/tmp/tensorsocket-<uid>``). A
``port`` gives a loopback TCP endpoint instead; an explicit ``address`` (or
``$TENSORSOCKET_ADDRESS`` when neither ``port`` nor ``address`` is passed) is
used as given. See tensorsocket.config for the settings and their variables.

Who listens on a TCP port (tcp_listeners, holder_note, listener_note): for the errors of a
producer that cannot bind its port and of a consumer that no producer answered, when
another process holds the port (a port squatter, or another program). The kernel lists
every listening TCP socket of this network namespace, with the uid of its owner, in
/proc/net/tcp and /proc/net/tcp6, which any user may read: enough to tell "nothing listens
there" from "a process of uid N listens there", without connecting to the port.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import os
import pwd
import stat
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

from .. import config
from ..validation import check_address, check_name, check_port, exposed_address_warning

DEFAULT_NAME = config.SETTINGS["name"].default


@dataclass(frozen=True)
class Endpoint:
    """Where a producer is found: its name, control address and lock file."""

    name: str
    address: str
    runtime_dir: Path

    @property
    def socket_path(self) -> Path | None:
        """File of an ipc:// endpoint (None for tcp://)."""
        if self.address.startswith("ipc://"):
            return Path(self.address[len("ipc://"):])
        return None

    @property
    def lock_path(self) -> Path:
        """File a live producer holds an exclusive flock on."""
        return self.runtime_dir / f"{self.name}.lock"

    def segment_name(self, pid: int) -> str:
        """POSIX shm name of the ring of producer pid."""
        return f"/{segment_prefix(self.name)}{pid}"


def segment_prefix(name: str) -> str:
    """Prefix (without the leading '/') of every segment of producer `name`."""
    return f"tensorsocket-{os.getuid()}-{name}-"


def runtime_dir() -> Path:
    """This user's private directory for sockets and locks.

    ``$TENSORSOCKET_RUNTIME_DIR`` if set: that directory, created mode 0700 if
    missing; an existing one must be a directory (not a symlink) owned by this
    user with no access for group or others, else PermissionError. Otherwise
    ``$XDG_RUNTIME_DIR/tensorsocket`` if XDG_RUNTIME_DIR is a directory of this
    user, else ``/tmp/tensorsocket-<uid>`` (both created 0700, and tightened to
    0700 if they exist with a looser mode).
    """
    chosen = config.get("runtime_dir")
    if chosen is not None:
        return _chosen_dir(Path(chosen))
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and _private_dir(Path(base), create=False):
        path = Path(base) / "tensorsocket"
    else:
        path = Path("/tmp") / f"tensorsocket-{os.getuid()}"
    if not _private_dir(path, create=True):
        raise PermissionError(
            f"{path} exists but is not a directory private to this user (owner and mode 0700); "
            "remove it, or set TENSORSOCKET_RUNTIME_DIR to a directory of your own"
        )
    return path


def _chosen_dir(path: Path) -> Path:
    """The directory TENSORSOCKET_RUNTIME_DIR names, created 0700 if missing and
    checked (never changed) if it exists."""
    var = config.SETTINGS["runtime_dir"].env
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{var}={path}: its parent directory does not exist; create it, or point "
            f"{var} elsewhere") from None
    st = os.lstat(path)
    problem = None
    if not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory (a symlink is refused too)"
    elif st.st_uid != os.getuid():
        problem = f"is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    elif stat.S_IMODE(st.st_mode) & 0o077:
        problem = (f"has mode {stat.S_IMODE(st.st_mode):04o}: others may use it "
                   f"(chmod 700 {path})")
    if problem is not None:
        raise PermissionError(
            f"{var}={path} {problem}; the runtime directory must be private to this user")
    return path


def _private_dir(path: Path, create: bool) -> bool:
    """True if path is a real directory owned by us; tightens or creates it when asked."""
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        return False
    if create and stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return True


def resolve(
    name: str | None = None,
    port: int | str | None = None,
    address: str | None = None,
    *,
    for_producer: bool = False,
) -> Endpoint:
    """The endpoint for these arguments (see the module docstring).

    name: the argument, else ``$TENSORSOCKET_NAME``, else ``"default"``.
    port: loopback TCP on this port (not with address); a producer named
    ``default`` becomes ``port<N>``. address: ``ipc://PATH`` or
    ``tcp://HOST:PORT``; with neither port nor address, ``$TENSORSOCKET_ADDRESS``
    if set, else an ipc socket ``<runtime dir>/<name>.sock``. for_producer:
    warn about a TCP address reachable from other machines.
    """
    name = config.get("name", name)
    if port is not None:
        port_no = check_port(port)
        if address is not None:
            raise ValueError("give either port= or address=, not both")
        address = f"tcp://127.0.0.1:{port_no}"
        if name == DEFAULT_NAME:
            name = f"port{port_no}"
    else:
        address = config.get("address", address)
        if address is not None:
            try:
                check_address(address)
            except ValueError as e:
                raise ValueError(f"address={address!r} is not valid: {e}") from None
    check_name(name)
    rdir = runtime_dir()
    if address is None:
        address = f"ipc://{rdir / (name + '.sock')}"
        if len(address) - len("ipc://") > 100:
            raise ValueError(f"socket path too long for ipc://: {address}; set "
                             "TENSORSOCKET_RUNTIME_DIR to a shorter directory")
    elif address.startswith("tcp://"):
        exposed = exposed_address_warning(address)
        if for_producer and exposed is not None:
            warnings.warn(f"tensorsocket {exposed}", stacklevel=3)
    return Endpoint(name=name, address=address, runtime_dir=rdir)


def open_lock_file(path: Path) -> int:
    """Open (creating it mode 0600) the lock file at `path` for reading and writing; the
    fd. A symbolic link or anything but a regular file there is refused with
    PermissionError, never followed: we write our pid into lock files."""
    problem = None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        problem = "is a symbolic link"
    else:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            problem = "is not a regular file"
    if problem is not None:
        raise PermissionError(
            f"lock file {path} {problem}, which tensorsocket never makes there; it was left "
            f"alone (nothing written through it): remove it (rm {path}) and start again")
    return fd


def file_is_at(fd: int, path: Path) -> bool:
    """Whether open file `fd` is the file at `path` now, not one removed (or replaced)
    since it was opened: a lock taken on a removed lock file is no lock of the name."""
    try:
        there = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    here = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def lock_held(path: Path) -> bool:
    """True while some process holds an flock on `path` (a live producer holds its name's
    lock for its whole life). A missing file is not held; a file that cannot be opened
    counts as held, so a caller that removes unheld files errs on the safe side. The probe
    takes a shared lock for an instant, which does not disturb other probes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # drops the shared lock at once
    return False


# -- who listens on a TCP port (see the module docstring) ---------------------------

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column


def tcp_listeners(host: str, port: int) -> list[int] | None:
    """The uids of the sockets listening on `host`:`port` (or on a wildcard address that
    covers it; any address if `host` is a name); None where /proc/net/tcp cannot be
    read."""
    try:
        wanted = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        wanted = None
    uids: list[int] = []
    read = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        read = True
        for line in lines:
            fields = line.split()
            if len(fields) < 8 or fields[3] != _LISTEN:
                continue
            address, _, port_hex = fields[1].partition(":")
            try:
                if int(port_hex, 16) != port:
                    continue
                bound = _address(address)
                uid = int(fields[7])
            except ValueError:
                continue
            if wanted is None or _covers(bound, wanted):
                uids.append(uid)
    return uids if read else None


def _address(hexed: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp prints it: 32-bit words in host byte order."""
    words = [int(hexed[i:i + 8], 16) for i in range(0, len(hexed), 8)]
    raw = b"".join(struct.pack("=I", w) for w in words)
    return ipaddress.ip_address(raw)


def _covers(bound: ipaddress.IPv4Address | ipaddress.IPv6Address,
            wanted: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether a socket bound to `bound` takes connections to `wanted`."""
    if bound.is_unspecified or bound == wanted:
        return True
    mapped = getattr(bound, "ipv4_mapped", None)
    return mapped is not None and mapped == wanted


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a tcp:// address; None for another transport or a port not given."""
    if not address.startswith("tcp://"):
        return None
    host, _, port = address[len("tcp://"):].rpartition(":")
    try:
        return host, int(port)
    except ValueError:
        return None


def _who(uid: int) -> str:
    """A listener's owner, for a message."""
    try:
        name = f" ({pwd.getpwuid(uid).pw_name})"
    except (KeyError, OSError):
        name = ""
    if uid == os.getuid():
        return f"a process of this user (uid {uid}{name})"
    return f"another user's process (uid {uid}{name})"


def holder_note(address: str) -> str:
    """For a producer that cannot bind `address`: a sentence on who listens there, or ''."""
    where = _host_port(address)
    uids = tcp_listeners(*where) if where is not None else None
    if not uids:
        return ""
    return f" {_who(uids[0])} listens there (a producer of another name, or no producer)."


def listener_note(address: str, lock_path: Path | None) -> str:
    """For a consumer that no producer answered at `address` in time: a sentence on what
    listens on its TCP port (''; for ipc://, or where that is not known). Something that
    listens there while no producer of the name holds its lock (`lock_path`) is not the
    producer: it holds the port (a squatter, or another program), and no producer can
    listen there while it does."""
    where = _host_port(address)
    uids = tcp_listeners(*where) if where is not None else None
    if uids is None or where is None:
        return ""
    port = where[1]
    if not uids:
        return f" Nothing listens on port {port} now."
    uid = uids[0]
    producer = lock_path is not None and lock_held(lock_path)
    if producer and uid == os.getuid():
        return (f" A producer of the name runs (it holds {lock_path.name}) and a process of "
                f"this user listens on port {port}, but it did not answer: it may be "
                "stopped (SIGSTOP) or starved of CPU.")
    alone = ""
    if lock_path is not None and not producer:
        alone = f" while no producer of the name runs (none holds {lock_path.name})"
    return (f" Something else holds port {port}: {_who(uid)} listens there{alone}, and it "
            "did not answer as a tensorsocket producer; no producer can listen on that "
            "port while it does: choose another port= for the producer and its consumers.")
