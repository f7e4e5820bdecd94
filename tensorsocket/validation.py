"""Checks of what users name things with: producer names, ports and control addresses,
secrets (auth_token) and devices.

A leaf (the standard library only): tensorsocket.config parses its variables with these
checks, and the modules that use a value (control.endpoints, control.auth, data.delivery,
data.segments, the producer) check an argument with the same ones, so that both accept
the same values. Each raises ValueError (TypeError for a device of another type) with a
message naming the argument.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

__all__ = [
    "MAX_TOKEN_CHARS",
    "MIN_TOKEN_CHARS",
    "check_address",
    "check_name",
    "check_port",
    "check_token",
    "exposed_address_warning",
    "parse_device",
]

MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 1024
_NAME_RE = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]{0,63}")  # the whole name (fullmatch)


def check_name(name: str) -> str:
    """Validate a producer name (used in file and segment names)."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(
            f"invalid producer name {name!r}: use 1-64 letters, digits, '_', '.' or '-'"
        )
    return name


def check_port(port: int | str) -> int:
    """port as an int, if it is a TCP port number (1..65535); else ValueError."""
    try:
        port_no = int(port)
    except (TypeError, ValueError):
        raise ValueError(f"port must be an integer, got {port!r}") from None
    if not 0 < port_no < 65536:
        raise ValueError(f"port {port_no} is outside 1..65535")
    return port_no


def check_address(address: str) -> str:
    """address, if it is ipc://PATH or tcp://HOST:PORT with a port in 1..65535; else
    ValueError saying what is wrong (a port out of range would not be refused by ZeroMQ:
    tcp://HOST:99999 listened on a port of its own choosing)."""
    if re.fullmatch(r"ipc://.+", address):
        return address
    tcp = re.fullmatch(r"tcp://(.+):(\d+)", address)
    if tcp is None:
        raise ValueError("not an ipc://PATH or tcp://HOST:PORT address")
    check_port(tcp.group(2))
    return address


def exposed_address_warning(address: str) -> str | None:
    """Why a producer should not listen at `address` (a tcp:// address other machines
    reach), or None for a loopback or ipc:// address."""
    if not address.startswith("tcp://"):
        return None
    host = address[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    if _is_loopback(host):
        return None
    return (f"control plane bound to {address}, which is reachable from other machines; "
            "use a loopback address (tcp://127.0.0.1:PORT) unless you mean it")


def _is_loopback(host: str) -> bool:
    """True for localhost and loopback IP addresses."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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


def parse_device(device: Any, knob: str = "device") -> tuple[str, int | None]:
    """("cpu", None), ("cuda", None) for "cuda" without an index, or ("cuda", N).

    Accepts None (returns ("auto", None)), "cpu", "cuda", "cuda:N", an int N
    and torch.device objects.
    """
    if device is None:
        return "auto", None
    if isinstance(device, bool):
        raise TypeError(f"{knob}= must be 'cpu', 'cuda', 'cuda:N' or an int, not a bool")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"{knob}={device}: a CUDA device index is >= 0")
        return "cuda", device
    text = str(device)  # torch.device prints as "cuda:0"
    kind, _, index = text.partition(":")
    if kind == "cpu" and not index:
        return "cpu", None
    if kind == "cuda":
        if not index:
            return "cuda", None
        if index.isdigit():
            return "cuda", int(index)
    raise ValueError(f"{knob}={device!r} is not a device: use 'cpu', 'cuda' or 'cuda:N'")
