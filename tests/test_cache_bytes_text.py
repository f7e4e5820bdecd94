"""cache_bytes as text (issue 36, item 6): ``share(cache_bytes="64M")`` is what its
signature (``int | str``) and TENSORSOCKET_CACHE_BYTES=2G promise. One parser reads the
argument's text and the variable's (tensorsocket.config.parse_size); bad text is refused
by an error that names cache_bytes and the forms it takes. share() runs in the test
process: the producer it forks is a real process, whose log shows the budget."""

from __future__ import annotations

import time

import psutil
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import tensorsocket
from tensorsocket import TensorProducer, config

ENV = "TENSORSOCKET_CACHE_BYTES"
SAMPLES = 32
BUDGET = 64 << 20  # "64M"


def _wait_gone(pid: int, timeout: float = 30) -> None:
    """Return once process pid is gone (or a zombie); fail after timeout."""
    deadline = time.monotonic() + timeout
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"process {pid} still runs"
        time.sleep(0.05)


def _cached_run(name: str, **share_kw) -> str:
    """share() a shuffling loader for 2 epochs, read both (every sample once each, by
    id), and return the producer's log as it was during the second epoch (a producer
    that ends cleanly removes its log)."""
    loader = DataLoader(TensorDataset(torch.arange(SAMPLES)), batch_size=4, shuffle=True)
    consumer = tensorsocket.share(loader, name=name, epochs=2, idle_timeout=30, timeout=60,
                                  **share_kw)
    text = ""
    try:
        for _ in range(2):
            ids = []
            for (batch,) in consumer:
                ids.extend(int(i) for i in batch)
                if not text and consumer.epoch == 1:  # (the producer runs until read)
                    text = consumer.producer_log.read_text()
            assert sorted(ids) == list(range(SAMPLES))
        pid = consumer.producer_pid
    finally:
        consumer.close()
    _wait_gone(pid)
    return text


def test_share_takes_the_text_its_variable_takes(name, monkeypatch):
    """share(cache_bytes="64M") and TENSORSOCKET_CACHE_BYTES=64M each give the producer a
    budget of 64 MiB: its log says so, and epoch 1 on is served from the cache."""
    monkeypatch.delenv(ENV, raising=False)
    text = _cached_run(name, cache_bytes="64M")
    assert f"(cache_bytes={BUDGET})" in text, text
    assert "epoch 1 on is served" in text, text

    monkeypatch.setenv(ENV, "64M")
    text = _cached_run(f"{name}-env")
    assert f"(cache_bytes={BUDGET} (from {ENV}))" in text, text
    assert "epoch 1 on is served" in text, text


@pytest.mark.parametrize("text, value", [
    ("64M", 64 << 20), ("64m", 64 << 20), ("64MiB", 64 << 20), ("2G", 2 << 30),
    (" 2 GiB ", 2 << 30), ("1T", 1 << 40), ("65536", 65536), ("0", 0), ("off", 0),
])
def test_the_argument_and_the_variable_read_text_alike(text, value):
    """The same text gives the same bytes as an argument (share()'s and
    TensorProducer's) and as the variable."""
    assert config.get("cache_bytes", environ={ENV: text}) == value
    assert config.get("cache_bytes", text, environ={}) == value


def test_a_producer_takes_cache_bytes_as_text(name, monkeypatch):
    """TensorProducer(cache_bytes=) takes the same setting, so the same text."""
    monkeypatch.delenv(ENV, raising=False)
    with TensorProducer([torch.zeros(1)], name=name, min_consumers=0,
                        cache_bytes="2G") as producer:
        assert producer.cache_bytes == 2 << 30


@pytest.mark.parametrize("text, why", [
    ("64X", "unknown unit 'X'"),
    ("lots", "not a size in bytes"),
    ("1.5GiB", "1536M for 1.5G"),
    ("-64M", "negative"),
])
def test_bad_text_is_refused_naming_the_knob_and_the_forms(name, monkeypatch, text, why):
    """Bad text is refused before anything starts, by a ValueError that names
    cache_bytes, its variable, why, and the forms it takes; as an argument of share()
    and of TensorProducer alike."""
    monkeypatch.delenv(ENV, raising=False)
    loader = DataLoader(TensorDataset(torch.arange(SAMPLES)), batch_size=4)
    for make in (lambda: tensorsocket.share(loader, name=name, cache_bytes=text),
                 lambda: TensorProducer(loader, name=name, cache_bytes=text)):
        with pytest.raises(ValueError) as raised:
            make()
        message = str(raised.value)
        assert f"cache_bytes={text!r} is not valid" in message, message
        assert ENV in message and why in message, message
        assert "'64M'" in message and "'2G'" in message and "1024" in message, message
