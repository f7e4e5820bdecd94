"""Configuration: arguments first, then TENSORSOCKET_* environment variables, then the
defaults; one registry (tensorsocket.config), documented in docs/configuration.md."""

from __future__ import annotations

import inspect
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, popen
from tensorsocket import ProducerNotFound, TensorConsumer, TensorProducer, config
from tensorsocket.config import SETTINGS, UNSET
from tensorsocket.control.endpoints import resolve, runtime_dir


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No TENSORSOCKET_* setting of the calling shell leaks into these tests."""
    for setting in SETTINGS.values():
        monkeypatch.delenv(setting.env, raising=False)


# -- the registry and its documentation -------------------------------------------------


def test_docs_are_generated_from_the_registry(capsys):
    """docs/configuration.md is exactly what `tensorsocket config --markdown` prints, and
    holds the table of every setting."""
    from tensorsocket.cli import config_command
    from tensorsocket.cli.main import main

    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert doc == config_command.markdown(), \
        "docs/configuration.md is stale: tensorsocket config --markdown > docs/configuration.md"
    table = config_command.markdown_table()
    assert table in doc
    for s in SETTINGS.values():
        assert f"`{s.env}`" in table
    assert main(["config", "--markdown"]) == 0
    assert capsys.readouterr().out == doc


def test_registry_matches_the_signatures(name):
    """Every setting's argument exists on its side(s), defaults to "not given" there, and
    the default the registry documents is the one used."""
    from tensorsocket import share

    sides = {"producer": TensorProducer, "consumer": TensorConsumer, "share()": share}
    envs = [s.env for s in SETTINGS.values()]
    assert len(set(envs)) == len(envs) and all(e.startswith("TENSORSOCKET_") for e in envs)
    for s in SETTINGS.values():
        assert s.meaning and s.accepts and s.default_text
        classes = [TensorProducer, TensorConsumer] if s.sides == "both" else [sides[s.sides]]
        for cls in classes:
            if s.argument is None:
                continue
            param = inspect.signature(cls).parameters[s.argument]
            assert param.default in (UNSET, None), (cls.__name__, s.argument, param.default)
            if s.none_is_value:
                assert param.default is UNSET, f"{s.argument}=None must stay a choice"
    # The defaults of the objects themselves, with nothing given.
    p = TensorProducer([torch.zeros(2)], name=name)
    try:
        assert (p.min_consumers, p.start_timeout, p.publish_timeout, p.max_lag, p.lag_policy,
                p.device, p.device_fallback, p.release_timeout) == \
            (1, None, None, None, "raise", "cpu", True, 30.0)
        assert (p._settings.ring_slots, p._settings.slot_bytes, p._settings.ring_bytes) == \
            (None, None, None)
    finally:
        p.close()
    assert resolve().name == "default"
    assert SETTINGS["timeout"].default == 60.0  # the consumer's (checked end to end below)


@pytest.mark.parametrize("key, text, value", [
    ("name", "job-7", "job-7"),
    ("address", "tcp://127.0.0.1:5555", "tcp://127.0.0.1:5555"),
    ("address", "ipc:///tmp/x.sock", "ipc:///tmp/x.sock"),
    ("runtime_dir", "/run/ts/", "/run/ts"),
    ("timeout", "2.5", 2.5),
    ("timeout", "0", 0.0),
    ("timeout", "none", None),
    ("timeout", "inf", None),
    ("batch_timeout", "Forever", None),
    ("consumer_device", "auto", None),
    ("consumer_device", "cuda:1", "cuda:1"),
    ("producer_device", "cuda", "cuda"),
    ("min_consumers", "0", 0),
    ("ring_slots", " 6 ", 6),
    ("slot_bytes", "64M", 64 << 20),
    ("ring_bytes", "2GiB", 2 << 30),
    ("slot_bytes", "4096", 4096),
    ("max_lag", "none", None),
    ("max_lag", "8", 8),
    ("lag_policy", "rejoin", "rejoin"),
    ("device_fallback", "off", False),
    ("device_fallback", "YES", True),
    ("release_timeout", "none", None),
    ("idle_timeout", "2.5", 2.5),
    ("idle_timeout", "none", None),
])
def test_environment_values_parse(key, text, value):
    assert config.get(key, environ={SETTINGS[key].env: text}) == value
    assert config.lookup(key, environ={SETTINGS[key].env: text})[1] == "environment"


@pytest.mark.parametrize("key, text, accepts", [
    ("name", "a/b", "letters, digits"),
    ("address", "localhost:5555", "ipc://PATH"),
    ("runtime_dir", "relative/dir", "absolute path"),
    ("timeout", "soon", "seconds >= 0"),
    ("timeout", "-1", "seconds >= 0"),
    ("start_timeout", "nan", "seconds >= 0"),
    ("consumer_device", "gpu0", "`cuda:N`"),
    ("producer_device", "auto", "`cuda:N`"),
    ("min_consumers", "65", "0..64"),
    ("ring_slots", "lots", "2..4096"),
    ("ring_slots", "1", "2..4096"),
    ("slot_bytes", "0", "bytes > 0"),
    ("slot_bytes", "1.5M", "bytes > 0"),
    ("ring_bytes", "5 MB", "bytes > 0"),
    ("max_lag", "0", "1..4094"),
    ("lag_policy", "drop", "`rejoin`"),
    ("device_fallback", "maybe", "`false`"),
    ("idle_timeout", "0", "seconds > 0"),  # as share(idle_timeout=0) refuses it
    ("idle_timeout", "-2", "seconds > 0"),
])
def test_bad_environment_values_name_the_variable(key, text, accepts):
    env = SETTINGS[key].env
    with pytest.raises(ValueError) as ei:
        config.get(key, environ={env: text})
    msg = str(ei.value)
    assert f"{env}={text!r}" in msg and accepts in msg


def test_lookup_order():
    env = {"TENSORSOCKET_TIMEOUT": "5"}
    assert config.lookup("timeout", environ={}) == (60.0, "default")
    assert config.lookup("timeout", environ=env) == (5.0, "environment")
    assert config.lookup("timeout", 2, environ=env) == (2, "argument")
    # None is a choice for a timeout (forever) and wins over the environment ...
    assert config.lookup("timeout", None, environ=env) == (None, "argument")
    assert config.lookup("max_lag", None, environ={"TENSORSOCKET_MAX_LAG": "3"})[0] is None
    # ... but only means "not given" where it means "automatic".
    assert config.lookup("ring_slots", None, environ={"TENSORSOCKET_RING_SLOTS": "6"}) == \
        (6, "environment")
    assert config.get("name", None, environ={"TENSORSOCKET_NAME": "n1"}) == "n1"
    # Empty counts as unset.
    assert config.lookup("timeout", environ={"TENSORSOCKET_TIMEOUT": " "}) == (60.0, "default")


def test_check_environment_finds_typos_and_bad_values():
    problems = config.check_environment({"TENSORSOCKET_TIMEOTU": "5",
                                         "TENSORSOCKET_MAX_LAG": "x",
                                         "TENSORSOCKET_LIBCUDA": "/lib/x.so",
                                         "TENSORSOCKET_NAME": "ok"})
    assert len(problems) == 2
    assert "TENSORSOCKET_TIMEOTU is not a tensorsocket setting" in problems[1]
    assert "TENSORSOCKET_MAX_LAG='x'" in problems[0]


def test_environment_warnings_flag_an_address_other_machines_reach():
    """TENSORSOCKET_ADDRESS=tcp://0.0.0.0:... parses (it may be meant) but is flagged, as
    a producer given that address= warns; loopback and ipc addresses are not."""
    for address in ("tcp://0.0.0.0:5555", "tcp://10.1.2.3:5555", "tcp://[::]:5555",
                    "tcp://node7:5555"):
        (warning,) = config.environment_warnings({"TENSORSOCKET_ADDRESS": address})
        assert f"TENSORSOCKET_ADDRESS={address}" in warning
        assert "reachable from other machines" in warning and "127.0.0.1" in warning
        assert config.check_environment({"TENSORSOCKET_ADDRESS": address}) == []
    for address in ("tcp://127.0.0.1:5555", "tcp://localhost:5555", "tcp://[::1]:5555",
                    "ipc:///tmp/x.sock", ""):
        assert config.environment_warnings({"TENSORSOCKET_ADDRESS": address}) == []
    assert config.environment_warnings({"TENSORSOCKET_ADDRESS": "nonsense"}) == []
    assert config.environment_warnings({}) == []


def test_a_tcp_port_out_of_range_is_refused_from_the_environment_and_the_argument():
    """TENSORSOCKET_ADDRESS=tcp://localhost:99999 was accepted and the producer listened on
    a port of ZeroMQ's choosing (the port= argument refused 99999); the variable and the
    address= argument now say what is wrong, as port= does."""
    from tensorsocket.control import endpoints

    for port in ("99999", "0", "65536"):
        address = f"tcp://localhost:{port}"
        (problem,) = config.check_environment({"TENSORSOCKET_ADDRESS": address})
        assert f"TENSORSOCKET_ADDRESS={address!r} is not valid" in problem
        assert f"port {int(port)} is outside 1..65535" in problem
        with pytest.raises(ValueError, match=rf"address='{address}' is not valid: port "):
            endpoints.resolve("x", address=address)
        with pytest.raises(ValueError, match=f"port {int(port)} is outside 1..65535"):
            endpoints.resolve("x", port=port)
    with pytest.raises(ValueError, match="not an ipc://PATH or tcp://HOST:PORT"):
        endpoints.resolve("x", address="udp://localhost:5555")
    for address in ("tcp://localhost:1", "tcp://[::1]:65535", "ipc:///tmp/x.sock"):
        assert config.check_environment({"TENSORSOCKET_ADDRESS": address}) == []
        assert endpoints.resolve("x", address=address).address == address


# -- the producer and consumer use it ------------------------------------------------------

PRODUCER_ENV = {"TENSORSOCKET_RING_SLOTS": "6", "TENSORSOCKET_SLOT_BYTES": "1M",
                "TENSORSOCKET_MIN_CONSUMERS": "0", "TENSORSOCKET_START_TIMEOUT": "2.5",
                "TENSORSOCKET_PUBLISH_TIMEOUT": "7", "TENSORSOCKET_MAX_LAG": "3",
                "TENSORSOCKET_LAG_POLICY": "rejoin", "TENSORSOCKET_RELEASE_TIMEOUT": "none",
                "TENSORSOCKET_DEVICE_FALLBACK": "0"}


def test_producer_takes_the_environment_when_no_argument(monkeypatch, name):
    for var, text in PRODUCER_ENV.items():
        monkeypatch.setenv(var, text)
    monkeypatch.setenv("TENSORSOCKET_NAME", name)
    p = TensorProducer([torch.zeros(4)] * 3)
    try:
        assert p.endpoint.name == name
        assert (p.min_consumers, p.start_timeout, p.publish_timeout, p.max_lag,
                p.lag_policy, p.release_timeout, p.device_fallback) == \
            (0, 2.5, 7.0, 3, "rejoin", None, False)
        assert sum(1 for _ in p) == 3  # min_consumers=0: it does not wait
        stats = p.stats()
        assert stats["slots"] == 6 and stats["slot_bytes"] == 1 << 20
    finally:
        p.close()


def test_arguments_beat_the_environment(monkeypatch, name):
    for var, text in PRODUCER_ENV.items():
        monkeypatch.setenv(var, text)
    monkeypatch.setenv("TENSORSOCKET_NAME", "not-this-one")
    p = TensorProducer([torch.zeros(4)] * 3, name=name, ring_slots=5, slot_bytes=1 << 17,
                       min_consumers=0, start_timeout=None, max_lag=None, lag_policy="raise",
                       release_timeout=1.0, publish_timeout=None, device_fallback=True)
    try:
        assert p.endpoint.name == name
        assert (p.start_timeout, p.publish_timeout, p.max_lag, p.lag_policy,
                p.release_timeout, p.device_fallback) == (None, None, None, "raise", 1.0, True)
        assert sum(1 for _ in p) == 3
        stats = p.stats()
        assert stats["slots"] == 5 and stats["slot_bytes"] == 1 << 17
    finally:
        p.close()
    # consumer_max_buffer_size= (the original's name of ring_slots=) is an argument too.
    p = TensorProducer([torch.zeros(4)], None, None, None, None, None, 4, name=name,
                       max_lag=None)
    try:
        list(p)
        assert p.stats()["slots"] == 4
    finally:
        p.close()


def test_errors_about_a_value_from_the_environment_name_it(monkeypatch, name):
    monkeypatch.setenv("TENSORSOCKET_MAX_LAG", "3")
    with pytest.raises(ValueError, match=r"max_lag=3 \(from TENSORSOCKET_MAX_LAG\) must "
                                         "exceed the late-joiner window of 5"):
        TensorProducer([], name=name, rubber_band=5)
    monkeypatch.setenv("TENSORSOCKET_RING_SLOTS", "lots")
    with pytest.raises(ValueError, match="TENSORSOCKET_RING_SLOTS='lots'.*2..4096"):
        TensorProducer([], name=name)
    monkeypatch.setenv("TENSORSOCKET_NAME", "no/slashes")
    with pytest.raises(ValueError, match="TENSORSOCKET_NAME='no/slashes'"):
        TensorConsumer(timeout=1)


@pytest.mark.parametrize("key", [k for k, s in SETTINGS.items()
                                 if s.accepts == SETTINGS["timeout"].accepts])
def test_timeout_arguments_are_checked_as_their_variables_are(key):
    """A timeout argument takes what its variable takes: inf waits forever (None), as
    `inf` does in the variable; NaN and negative numbers are refused, naming both."""
    env = SETTINGS[key].env
    assert config.get(key, float("inf"), environ={}) is None
    assert config.get(key, environ={env: "inf"}) is None
    assert config.get(key, 2.5, environ={}) == 2.5 and config.get(key, 0, environ={}) == 0
    for bad in (float("nan"), -1, -0.5, float("-inf")):
        with pytest.raises(ValueError) as ei:
            config.get(key, bad, environ={})
        msg = str(ei.value)
        assert f"{SETTINGS[key].argument}={bad!r}" in msg and env in msg
        assert "seconds >= 0" in msg
        with pytest.raises(ValueError, match="seconds >= 0"):
            config.get(key, environ={env: repr(bad)})
    for wrong in ("5", True):
        with pytest.raises(TypeError, match=f"{SETTINGS[key].argument}= takes a number"):
            config.get(key, wrong, environ={})


def test_consumer_timeouts_inf_nan_negative(name):
    """TensorConsumer(timeout=inf) waits forever like None; nan or a negative timeout is
    refused at once, naming the knob and its variable."""
    for bad in (float("nan"), -1.0):
        with pytest.raises(ValueError, match="TENSORSOCKET_TIMEOUT"):
            TensorConsumer(name=name, timeout=bad)
        with pytest.raises(ValueError, match="TENSORSOCKET_BATCH_TIMEOUT"):
            TensorConsumer(name=name, timeout=0.1, batch_timeout=bad)
    p = TensorProducer([torch.zeros(2)], name=name, min_consumers=1, start_timeout=30)
    try:
        import threading

        t = threading.Thread(target=lambda: [None for _ in p])
        t.start()
        with TensorConsumer(name=name, timeout=float("inf"),
                            batch_timeout=float("inf")) as c:
            assert c.answer_timeout is None and c.batch_timeout is None
            assert [b.tolist() for b in c] == [[0.0, 0.0]]
        t.join(30)
    finally:
        p.close()


def test_consumer_timeout_from_the_environment(monkeypatch, name):
    """TENSORSOCKET_TIMEOUT bounds the wait for a producer; a timeout= argument wins."""
    monkeypatch.setenv("TENSORSOCKET_TIMEOUT", "0.3")
    t0 = time.monotonic()
    with pytest.raises(ProducerNotFound, match="within 0.3 s"):
        TensorConsumer(name=name)
    assert time.monotonic() - t0 < 2.5
    monkeypatch.setenv("TENSORSOCKET_TIMEOUT", "30")
    t0 = time.monotonic()
    with pytest.raises(ProducerNotFound, match="within 0.2 s"):
        TensorConsumer(name=name, timeout=0.2)
    assert time.monotonic() - t0 < 2.5
    monkeypatch.setenv("TENSORSOCKET_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="TENSORSOCKET_TIMEOUT='soon'"):
        TensorConsumer(name=name)


def test_address_from_the_environment(monkeypatch, name, tmp_path):
    monkeypatch.setenv("TENSORSOCKET_ADDRESS", "tcp://127.0.0.1:45678")
    assert resolve(name).address == "tcp://127.0.0.1:45678"
    # port= or address= arguments override it.
    assert resolve(name, port=45600).address == "tcp://127.0.0.1:45600"
    sock = f"ipc://{tmp_path}/x.sock"
    assert resolve(name, address=sock).address == sock
    monkeypatch.setenv("TENSORSOCKET_ADDRESS", "5555")
    with pytest.raises(ValueError, match="TENSORSOCKET_ADDRESS='5555'"):
        resolve(name)


def test_runtime_dir_from_the_environment(monkeypatch, tmp_path):
    """TENSORSOCKET_RUNTIME_DIR is used as is: created 0700, or refused unless it is a
    directory of this user closed to others; it wins over XDG_RUNTIME_DIR."""
    var = "TENSORSOCKET_RUNTIME_DIR"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert runtime_dir() == tmp_path / "tensorsocket"
    chosen = tmp_path / "rt"
    monkeypatch.setenv(var, str(chosen))
    assert runtime_dir() == chosen
    assert stat.S_IMODE(os.lstat(chosen).st_mode) == 0o700
    assert resolve("n1").address == f"ipc://{chosen}/n1.sock"
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    monkeypatch.setenv(var, str(open_dir))
    with pytest.raises(PermissionError, match=f"{var}={open_dir} has mode 0755.*chmod 700"):
        runtime_dir()
    assert stat.S_IMODE(os.lstat(open_dir).st_mode) == 0o755  # refused, never changed
    link = tmp_path / "link"
    link.symlink_to(chosen)
    monkeypatch.setenv(var, str(link))
    with pytest.raises(PermissionError, match="is not a directory"):
        runtime_dir()
    monkeypatch.setenv(var, str(tmp_path / "missing" / "rt"))
    with pytest.raises(FileNotFoundError, match="parent directory does not exist"):
        runtime_dir()
    monkeypatch.setenv(var, "relative")
    with pytest.raises(ValueError, match="TENSORSOCKET_RUNTIME_DIR='relative'"):
        runtime_dir()


# -- end to end: two processes that meet only through the environment ------------------

PRODUCER = """
import json, torch
from tensorsocket import TensorProducer

class Loader:
    batch_size = 2
    def __len__(self):
        return 6
    def __iter__(self):
        for b in range(6):
            yield torch.full((2, 3), float(b))

producer = TensorProducer(Loader())  # nothing given: all from the environment
print(json.dumps({"ready": True, "address": producer.endpoint.address}), flush=True)
for _ in range(2):
    for _ in producer:
        pass
stats = producer.stats()
print(json.dumps({"drained": producer.join(timeout=30), "slots": stats["slots"],
                  "batches": stats["batches"]}), flush=True)
"""

CONSUMER = """
import json
from tensorsocket import TensorConsumer

with TensorConsumer() as c:  # nothing given: all from the environment
    epochs = [[int(b[0, 0]) for b in c] for _ in range(2)]
    out = {"epochs": epochs, "len": len(c), "address": c.endpoint.address,
           "timeout": c.answer_timeout, "slots": c.ring.info()["slot_count"]}
print(json.dumps(out), flush=True)
"""


def test_processes_meet_through_the_environment_only(procs, name, tmp_path):
    """A producer and a consumer process given no arguments at all find each other by
    TENSORSOCKET_NAME in TENSORSOCKET_RUNTIME_DIR, and take their other settings from
    the environment too."""
    rt = tmp_path / "rt"
    env = {**os.environ, "TENSORSOCKET_NAME": name, "TENSORSOCKET_RUNTIME_DIR": str(rt),
           "TENSORSOCKET_RING_SLOTS": "5", "TENSORSOCKET_START_TIMEOUT": "60",
           "TENSORSOCKET_TIMEOUT": "45"}

    def start(script: str) -> subprocess.Popen:
        p = popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                  stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        procs.procs.append(p)  # killed at teardown if still running
        return p

    prod = start(PRODUCER)
    ready = procs.wait_ready(prod)
    assert ready["address"] == f"ipc://{rt}/{name}.sock"
    assert sorted(p.name for p in rt.iterdir()) == [f"{name}.lock", f"{name}.sock"]
    # Without the variable, the same name is looked up elsewhere and not found.
    with pytest.raises(ProducerNotFound):
        TensorConsumer(name=name, timeout=0.3)
    r = procs.result(start(CONSUMER))
    p = procs.result(prod)
    assert r["epochs"] == [list(range(6))] * 2 and r["len"] == 6
    assert r["address"] == ready["address"] and r["timeout"] == 45.0 and r["slots"] == 5
    assert p == {"drained": True, "slots": 5, "batches": 12}
    assert list(rt.iterdir()) == []  # socket and lock removed at teardown
    assert Path(rt).stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("key, text, bad", [
    ("min_consumers", "3", 65),
    ("ring_slots", "6", 1),
    ("max_lag", "8", 5000),
    ("slot_bytes", "64K", 0),
    ("worker_heap_pad", "0", -1),
    ("start_grace", "2.5", -1.0),
    ("park_hold", "0", float("inf")),
    ("heartbeat_timeout", "3", 2.0),
    ("idle_timeout", "none", 0),
    ("lag_policy", "rejoin", "drop"),
    ("device_fallback", "false", 2),
])
def test_one_kind_checks_the_argument_and_parses_the_variable(key, text, bad):
    """Each setting's kind of value decides for both sources: the value its variable's
    text gives is accepted as an argument, and a bad argument is refused as the variable
    would be, by an error naming the argument and its variable."""
    setting = SETTINGS[key]
    value = config.get(key, environ={setting.env: text})
    if value is not None:
        assert config.get(key, value, environ={}) == value
    with pytest.raises(ValueError) as ei:  # ArgumentTypeError is a ValueError too
        config.get(key, bad, environ={})
    assert f"{setting.argument}=" in str(ei.value)
    assert setting.env in str(ei.value) or isinstance(ei.value, config.ArgumentTypeError)
    if key != "lag_policy":  # a number of some kind: text is the wrong type of argument
        with pytest.raises(config.ArgumentTypeError, match=f"{setting.argument}= takes"):
            config.get(key, "5", environ={})
