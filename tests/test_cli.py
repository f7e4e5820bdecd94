"""The command line: status, top and clean against real producer and consumer processes."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import pwd
import select
import signal
import struct
import subprocess
import sys
import termios
import time
import uuid

import pytest

from conftest import ROOT, shm_segments, run as run_python
from tensorsocket.control.endpoints import runtime_dir


def cli(*args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python -m tensorsocket ARGS` as a user would."""
    return run_python([sys.executable, "-m", "tensorsocket", *args], capture_output=True,
                      text=True, timeout=timeout, cwd=ROOT,
                      env={**os.environ, **env} if env else None)


def wait_for(predicate, timeout: float = 30, what: str = "condition") -> None:
    """Poll until predicate() is true."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def status_json(name: str, interval: float = 0.5) -> dict:
    """`tensorsocket status --json --name NAME` parsed."""
    r = cli("status", "--json", "--name", name, "--interval", str(interval))
    assert r.returncode in (0, 1), r.stderr
    return json.loads(r.stdout)


@pytest.fixture
def procs(procs):
    """Role processes stopped with Ctrl-C at the end (consumers first), so the producer
    removes its ring as it does for a user; the conftest fixture then SIGKILLs any left."""
    yield procs
    for p in reversed(procs.procs):
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
            try:
                p.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                pass


def start_shared_loader(procs, name: str, batch_sizes: list[int]) -> tuple:
    """A producer over 8-sample loader batches, paced at ~25 batches/s, and one
    consumer per batch size, each running until killed (an epoch lasts 20 minutes: the
    producer must outlive every test, also under ASan on a loaded machine)."""
    prod = procs.start("producer", "--name", name, "--kind", "samples", "--samples", "240000",
                       "--loader-bs", "8", "--delay", "0.04", "--min-consumers",
                       str(len(batch_sizes)))
    procs.wait_ready(prod)
    consumers = [procs.start("consumer", "--name", name, "--kind", "samples", "--samples",
                             "240000", "--batch-size", str(bs)) for bs in batch_sizes]
    # The ring is made at the first batch, after "ready": on a loaded machine later than
    # a CLI started at once would look.
    wait_for(lambda: shm_segments(name), what=f"the ring of producer {name!r}")
    return prod, consumers


def test_status_shows_producer_and_consumers(name, procs):
    """status --json: the producer's pid, rate, ring and bytes per batch; each consumer's
    pid, own batch size, cursor and rate. The text form names the same."""
    prod, consumers = start_shared_loader(procs, name, [4, 16])

    def both_receive() -> bool:
        doc = status_json(name, interval=0)
        return bool(doc["producers"]) and \
            sum(c["delivered"] > 2 for c in doc["producers"][0]["consumers"]) == 2

    wait_for(both_receive, what="two consumers receiving")
    doc = status_json(name, interval=0.6)
    assert doc["format"] == 1 and doc["interval"] == 0.6
    (p,) = doc["producers"]
    assert p["name"] == name and p["pid"] == prod.pid
    assert p["alive"] and p["state"] == "running" and p["device"] == "cpu"
    assert p["epoch"] == 0 and p["batch_index"] >= 2 and p["published"] >= 3
    assert 5 < p["rate"] < 60, p["rate"]  # paced at 25 batches/s by --delay 0.04
    assert p["slot_count"] >= 4 and 0 <= p["occupied"] <= p["slot_count"]
    # A loader batch: 8 int64 ids + 8 float32 x 4 values, plus its structure.
    assert 8 * 8 + 8 * 4 * 4 <= p["batch_bytes"] <= p["slot_bytes"]
    assert p["cpu_seconds"] > 0 and p["cpu_rate"] is not None
    assert p["active_consumers"] == 2
    by_pid = {c["pid"]: c for c in p["consumers"]}
    assert set(by_pid) == {c.pid for c in consumers}
    assert [by_pid[c.pid]["batch_size"] for c in consumers] == [4, 16]
    for c in by_pid.values():
        assert c["alive"] and c["state"] == "active" and c["reason"] == ""
        assert c["cursor"] is not None and 0 <= c["lag"] <= p["slot_count"]
        assert c["rate"] > 0 and 0 <= c["waiting"] <= 1

    text = cli("status", "--name", name)
    assert text.returncode == 0, text.stderr
    assert f"producer {name!r}  pid {prod.pid}  running" in text.stdout
    for c in consumers:
        assert str(c.pid) in text.stdout
    assert "batches/s" in text.stdout and "slots held" in text.stdout


def test_status_marks_a_dead_consumer(name, procs):
    """A SIGKILLed consumer shows as dead or is gone from the table within a few
    seconds; the other keeps receiving."""
    _, (c1, c2) = start_shared_loader(procs, name, [8, 8])
    wait_for(lambda: sum(c["delivered"] > 0 for c in
                         (status_json(name, 0)["producers"] or [{"consumers": []}])[0]
                         ["consumers"]) == 2, what="two consumers receiving")
    c1.send_signal(signal.SIGKILL)
    c1.wait()

    def c1_gone_or_dead() -> bool:
        cons = {c["pid"]: c for c in status_json(name, 0)["producers"][0]["consumers"]}
        return c1.pid not in cons or not cons[c1.pid]["alive"] or cons[c1.pid]["state"] != \
            "active"

    wait_for(c1_gone_or_dead, timeout=20, what="the killed consumer to show")
    (p,) = status_json(name, 0.5)["producers"]
    alive = [c for c in p["consumers"] if c["alive"]]
    assert [c["pid"] for c in alive] == [c2.pid] and alive[0]["rate"] > 0


def test_status_without_producers(tmp_path):
    """No producer: a clear line, exit 0; an unknown --name: exit 1; a bad name: one line
    and a hint, no traceback."""
    missing = f"t-{uuid.uuid4().hex[:10]}"
    r = cli("status", "--name", missing, "--interval", "0")
    assert r.returncode == 1 and f"no producer named {missing!r}" in r.stdout
    assert json.loads(cli("status", "--json", "--name", missing).stdout)["producers"] == []
    bad = cli("status", "--name", "no/slashes")
    assert bad.returncode == 2
    assert bad.stderr.splitlines()[0].startswith("tensorsocket status: error: invalid producer "
                                                 "name 'no/slashes'")
    assert "hint:" in bad.stderr and "Traceback" not in bad.stderr
    neg = cli("status", "--interval", "-1")
    assert neg.returncode == 2 and "takes a number of seconds >= 0" in neg.stderr


@pytest.mark.parametrize("args, takes", [
    (["status", "--interval", "-1"], "a number of seconds >= 0 (not a finite number of "
                                     "seconds >= 0)"),
    (["status", "--interval", "inf"], "a number of seconds >= 0 (not a finite number of "
                                      "seconds >= 0)"),
    (["top", "--interval", "0"], "a number of seconds > 0 (0 is refused: the view would be "
                                 "redrawn without pause)"),
    (["top", "--interval", "soon"], "a number of seconds > 0 (not a number)"),
    (["top", "--iterations", "0"], "an int >= 1 (0 is under 1)"),
    (["top", "--iterations", "2.5"], "an int >= 1 (not an integer)"),
])
def test_numeric_options_are_parsed_as_settings_are(capsys, args, takes):
    """The numbers the commands take are parsed by the kinds of the settings
    (config.Kind): a bad one is one error line naming the option, the value, what it
    takes and why not, then the usage hint; exit 2."""
    from tensorsocket.cli.main import main

    assert main(args) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == (f"tensorsocket {args[0]}: error: argument {args[1]}: {args[2]} is not "
                        f"valid: it takes {takes}"), lines
    assert lines[1].startswith(f"hint: usage: tensorsocket {args[0]}"), lines


def test_clean_removes_only_dead_producers_files(name, procs):
    """clean --dry-run lists a SIGKILLed producer's segment, socket and lock and removes
    nothing; clean removes them; a live producer's files are never touched."""
    dead = name
    live = f"t-{uuid.uuid4().hex[:10]}"
    rdir = runtime_dir()
    try:
        killed = procs.start("producer", "--name", dead, "--batches", "100000",
                             "--min-consumers", "0", "--delay", "0.05")
        running = procs.start("producer", "--name", live, "--batches", "100000",
                              "--min-consumers", "0", "--delay", "0.05")
        wait_for(lambda: shm_segments(dead) and shm_segments(live), what="both rings")
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        dead_files = [f"/dev/shm/{shm_segments(dead)[0]}", str(rdir / f"{dead}.sock"),
                      str(rdir / f"{dead}.lock")]
        live_files = [f"/dev/shm/{shm_segments(live)[0]}", str(rdir / f"{live}.sock"),
                      str(rdir / f"{live}.lock")]
        assert all(os.path.exists(f) for f in dead_files + live_files)

        dry = cli("clean", "--dry-run")
        assert dry.returncode == 0, dry.stderr
        for f in dead_files:
            assert f in dry.stdout
        for f in live_files:
            assert f not in dry.stdout
        assert "run without --dry-run" in dry.stdout
        assert all(os.path.exists(f) for f in dead_files + live_files)

        r = cli("clean")
        assert r.returncode == 0, r.stdout + r.stderr
        for f in dead_files:
            assert "removed" in r.stdout and f in r.stdout
            assert not os.path.exists(f)
        assert all(os.path.exists(f) for f in live_files)
        assert running.poll() is None
        (p,) = status_json(live, 0.5)["producers"]
        assert p["alive"] and p["rate"] > 0  # still publishing
        again = cli("clean", "--name", dead)
        assert again.returncode == 0 and "nothing to clean" in again.stdout
    finally:
        procs.kill_all()
        for seg in shm_segments(live):
            os.unlink(f"/dev/shm/{seg}")
        for path in rdir.glob(live + ".*"):
            path.unlink()


# Every field of a producer and of its consumer table, as the text shows them.
PRODUCER_FIELDS = ["loader batches/s", "epoch:batch", "slots held", "window", "max_lag",
                   "lag detaches", "waiting for slots", "loader CPU", "saves about"]


def test_top_plain_prints_snapshots(name, procs):
    """top --plain: one snapshot per refresh, with the producer and its consumer; in 80
    columns every field is there, wrapped onto more lines, none longer than 80."""
    prod, (cons,) = start_shared_loader(procs, name, [8])
    r = cli("top", "--plain", "--name", name, "--interval", "0.3", "--iterations", "3",
            env={"COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("tensorsocket top") == 3
    assert r.stdout.count(f"producer {name!r}  pid {prod.pid}") == 3
    assert str(cons.pid) in r.stdout
    assert max(len(line) for line in r.stdout.splitlines()) <= 80, r.stdout
    for f in PRODUCER_FIELDS:
        assert r.stdout.count(f) >= 3, f


def _run_in_terminal(args: list[str], keys: bytes = b"", after: float = 0.0,
                     seen: bytes = b"", timeout: float = 30,
                     columns: int = 120) -> tuple[int, bytes]:
    """Run the CLI on a pseudo-terminal of 40 lines and `columns` columns (as a person in
    a terminal would); optionally type keys once `after` seconds have passed and `seen` is
    on the screen (a loaded machine may take longer than `after` to draw the first frame).
    Returns (exit status, screen bytes)."""
    pid, fd = pty.fork()
    if pid == 0:  # child
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
        env = {**os.environ, "TERM": "xterm", "LINES": "40", "COLUMNS": str(columns)}
        os.chdir(ROOT)
        os.execve(sys.executable, [sys.executable, "-m", "tensorsocket", *args], env)
    out = bytearray()
    start = time.monotonic()
    typed = not keys
    try:
        while time.monotonic() - start < timeout:
            if not typed and time.monotonic() - start >= after and seen in out:
                os.write(fd, keys)
                typed = True
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
        else:
            os.kill(pid, signal.SIGKILL)
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    return os.waitstatus_to_exitcode(status), bytes(out)


def test_top_full_screen_in_a_terminal(name, procs):
    """top on a terminal draws with curses (alternate screen) and quits on q; on an
    80-column terminal the producer's fields wrap instead of being cut off."""
    prod, _ = start_shared_loader(procs, name, [8])
    code, screen = _run_in_terminal(["top", "--name", name, "--interval", "0.3"], keys=b"q",
                                    after=1.0, seen=b"saves about", columns=80)
    assert code == 0, screen[-2000:]
    assert b"\x1b[?1049h" in screen  # curses switched to the alternate screen ...
    assert b"\x1b[?1049l" in screen  # ... and restored the terminal on q
    assert name.encode() in screen and str(prod.pid).encode() in screen
    for f in ("waiting for slots", "lag detaches", "saves about"):
        assert f.encode() in screen, f


def test_status_output_into_a_closed_pipe(name, procs):
    """`tensorsocket status | head -1` ends quietly, without a traceback."""
    start_shared_loader(procs, name, [8])
    r = subprocess.run(f"{sys.executable} -m tensorsocket status --name {name} | head -1",
                       shell=True, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("producer"), r.stdout
    assert "Traceback" not in r.stderr and "Broken pipe" not in r.stderr, r.stderr


def test_config_lists_the_environment_and_flags_typos():
    """config: each variable with its value here or its default; a bad value or an unknown
    TENSORSOCKET_* name is reported and exits 1; --markdown is docs/configuration.md."""
    ok = cli("config", env={"TENSORSOCKET_MAX_LAG": "6"})
    assert ok.returncode == 0, ok.stderr
    line = next(ln for ln in ok.stdout.splitlines() if ln.startswith("TENSORSOCKET_MAX_LAG"))
    assert "max_lag=" in line and "6  (set)" in line
    assert "default: 60" in next(ln for ln in ok.stdout.splitlines()
                                 if ln.startswith("TENSORSOCKET_TIMEOUT "))
    bad = cli("config", env={"TENSORSOCKET_MAX_LAG": "lots", "TENSORSOCKET_SLOTS": "8"})
    assert bad.returncode == 1
    assert "TENSORSOCKET_MAX_LAG='lots' is not valid" in bad.stderr
    assert "TENSORSOCKET_SLOTS is not a tensorsocket setting" in bad.stderr
    md = cli("config", "--markdown")
    assert md.returncode == 0 and md.stdout == (ROOT / "docs" / "configuration.md").read_text()


def test_config_flags_idle_timeout_0_and_an_address_other_machines_reach():
    """TENSORSOCKET_IDLE_TIMEOUT=0 is a problem (share() refuses idle_timeout=0 too);
    TENSORSOCKET_ADDRESS=tcp://0.0.0.0:PORT is a warning (it works, and may be meant), as
    a producer given that address warns. Both passed silently before."""
    zero = cli("config", env={"TENSORSOCKET_IDLE_TIMEOUT": "0"})
    assert zero.returncode == 1
    assert "problem: environment variable TENSORSOCKET_IDLE_TIMEOUT='0' is not valid: it " \
        "takes seconds > 0, or `none` (never)" in zero.stderr
    exposed = cli("config", env={"TENSORSOCKET_ADDRESS": "tcp://0.0.0.0:5555"})
    assert exposed.returncode == 0, exposed.stderr
    assert "warning: TENSORSOCKET_ADDRESS=tcp://0.0.0.0:5555: control plane bound to " \
        "tcp://0.0.0.0:5555, which is reachable from other machines" in exposed.stderr
    local = cli("config", env={"TENSORSOCKET_ADDRESS": "tcp://127.0.0.1:5555"})
    assert local.returncode == 0 and "warning" not in local.stderr


def test_config_never_shows_the_auth_token():
    """`tensorsocket config` printed TENSORSOCKET_AUTH_TOKEN in clear (a shared terminal, a
    pasted bug report); it shows only that it is set and its length, a bad one too, and
    so do the logs that list the settings taken from the environment."""
    from tensorsocket import config

    token = "s3cret-" + "x" * 20
    shown = cli("config", env={"TENSORSOCKET_AUTH_TOKEN": token})
    assert shown.returncode == 0, shown.stderr
    assert "s3cret" not in shown.stdout + shown.stderr
    assert f"<hidden, {len(token)} characters>  (set)" in shown.stdout
    bad = cli("config", env={"TENSORSOCKET_AUTH_TOKEN": "s3cret x"})
    assert bad.returncode == 1 and "s3cret" not in bad.stdout + bad.stderr
    assert "TENSORSOCKET_AUTH_TOKEN=<hidden, 8 characters> is not valid" in bad.stderr
    logged = config.describe_origins({"auth_token": "TENSORSOCKET_AUTH_TOKEN"},
                                     {"TENSORSOCKET_AUTH_TOKEN": token})
    assert "s3cret" not in logged and "TENSORSOCKET_AUTH_TOKEN=<hidden" in logged


def test_planted_files_in_dev_shm_are_not_taken_for_ours(name):
    """Anyone may create files in /dev/shm, under any name. Names no producer makes (a pid
    out of range or no number: status, top, clean and a producer of the name died of
    OverflowError on them), and links and directories under a producer's name, are
    ignored; a file of another user under our segment name is never listed or removed
    as a dead producer's of ours. All of them stay where they are."""
    import torch

    from tensorsocket import TensorProducer

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no process has now
    prefix = f"/dev/shm/tensorsocket-{os.getuid()}-{name}-"
    files = [prefix + "9" * 23, prefix + "abc", prefix + str((1 << 22) + 1)]  # PID_MAX_LIMIT + 1
    link, folder = prefix + "4194001", prefix + "4194002"
    foreign = prefix + str(gone.pid)
    planted = files + [link, folder] + ([foreign] if os.geteuid() == 0 else [])
    try:
        for path in files:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        os.symlink("/dev/null", link)
        os.mkdir(folder, 0o700)
        if os.geteuid() == 0:  # only root can give a file away
            os.close(os.open(foreign, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            os.chown(foreign, _other_uid(), -1)
        runs = [cli("status", "--interval", "0", env={"COLUMNS": "200"}),
                cli("status", "--json", "--interval", "0"),
                cli("top", "--plain", "--iterations", "1", "--interval", "0.1"),
                cli("clean", "--dry-run"),
                cli("clean", "--name", name)]
        for r in runs:
            assert r.returncode == 0, r.args[3:] + [r.stderr]
            assert "Traceback" not in r.stderr and prefix[len("/dev/shm/"):] not in r.stdout, \
                r.args[3:]
        assert all(o["name"] != name for o in json.loads(runs[1].stdout)["other_users"])
        assert "nothing to clean" in runs[4].stdout
        p = TensorProducer([torch.zeros(2)], name=name, min_consumers=0)
        assert sum(1 for _ in p) == 1
        p.close()
        assert all(os.path.lexists(path) for path in planted)
    finally:
        for path in planted:
            if os.path.isdir(path) and not os.path.islink(path):
                os.rmdir(path)
            elif os.path.lexists(path):
                os.unlink(path)


@pytest.mark.parametrize("command", ["status", "top", "clean", "config"])
def test_every_command_has_help(command):
    """--help describes each command and exits 0."""
    r = cli(command, "--help")
    assert r.returncode == 0 and f"usage: tensorsocket {command}" in r.stdout


@pytest.mark.parametrize("command", ["status", "top", "clean", "config"])
def test_an_unknown_option_shows_the_commands_usage(command):
    """An option a subcommand does not know: one error line naming that subcommand and a
    hint with its usage (not the top-level one), exit 2."""
    r = cli(command, "--bogus")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2, r.stderr
    assert lines[0] == f"tensorsocket {command}: error: unrecognized arguments: --bogus"
    assert lines[1].startswith(f"hint: usage: tensorsocket {command} [-h]"), lines[1]
    assert "COMMAND" not in r.stderr


def test_a_missing_name_lists_the_live_producers(name, procs):
    """status --name X and top --name X with no producer X: say so, hint at the live
    producers, exit 1; top's full-screen view waits for X and says so."""
    start_shared_loader(procs, name, [8])
    missing = f"t-{uuid.uuid4().hex[:10]}"
    for args in (["status", "--interval", "0"], ["status", "--json"],
                 ["top", "--plain", "--iterations", "2"], ["top", "--iterations", "2"],
                 ["top"]):
        r = cli(*args, "--name", missing, timeout=30)
        assert r.returncode == 1, (args, r.stdout, r.stderr)
        if "--json" not in args:
            assert r.stdout.strip() == f"no producer named {missing!r} on this machine " \
                                       "(for this user)", (args, r.stdout)
        hint = r.stderr.strip().splitlines()[-1]
        assert hint.startswith("hint: live producers: ") and name in hint.split(": ")[2] \
            .split(", "), (args, r.stderr)
        assert "Traceback" not in r.stderr
    code, screen = _run_in_terminal(["top", "--name", missing, "--interval", "0.3"],
                                    keys=b"q", after=0.5, seen=b"waiting for it")
    assert code == 0, screen[-2000:]
    assert f"no producer named {missing!r}".encode() in screen
    assert b"live producers:" in screen and name.encode() in screen


@pytest.fixture
def private_tmp(tmp_path):
    """tmp_path with mode 0700, as a runtime directory's parent may be."""
    tmp_path.chmod(0o700)
    return tmp_path


def test_a_bad_runtime_dir_is_one_line(private_tmp):
    """clean with a TENSORSOCKET_RUNTIME_DIR that cannot be used: the message,
    which says how to fix it, on one line; no exception class, no --debug hint; exit 1.
    status and top do not need the directory and work."""
    a_file = private_tmp / "file"
    a_file.write_text("")
    shared = private_tmp / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    cases = {str(a_file): "is not a directory", str(shared): "chmod 700",
             str(private_tmp / "no" / "dir"): "its parent directory does not exist",
             "relative/dir": "fix or unset it"}
    for value, fix in cases.items():
        env = {"TENSORSOCKET_RUNTIME_DIR": value}
        for args in (["clean", "--dry-run"],):
            r = cli(*args, env=env)
            assert r.returncode == 1, (value, args, r.stdout, r.stderr)
            lines = r.stderr.strip().splitlines()
            assert len(lines) == 1, (value, args, r.stderr)
            assert lines[0].startswith(f"tensorsocket {args[0]}: error: ") and fix in lines[0]
            assert "Error:" not in lines[0] and "--debug" not in r.stderr
        assert cli("status", "--interval", "0", env=env).returncode == 0
        assert cli("top", "--plain", "--iterations", "1", "--interval", "0.2",
                   env=env).returncode == 0


def _status(**fields) -> "object":
    """A ProducerStatus of a busy producer with two consumers, wide values everywhere."""
    from tensorsocket.cli.status import ConsumerStatus, ProducerStatus

    consumers = [ConsumerStatus(index=i, pid=4194301 + i, alive=True, state=state,
                                reason=reason, batch_size=bs, cursor=1234567, lag=3,
                                delivered=1234567, delivered_bytes=3 * 2**30, rate=950.5,
                                batch_rate=949.9, waiting=0.25, idle_seconds=0.1)
                 for i, (state, reason, bs) in enumerate([("active", "", 256),
                                                          ("active", "", None),
                                                          ("detached", "lagged", None)])]
    p = ProducerStatus(name="imagenet-train-shared-loader", segment="s", pid=4194300,
                       alive=True, state="running", epoch=123, batch_index=45678,
                       published=1234570, batches_published=1234447, epochs_ended=123,
                       rate=1001.0, batch_rate=1000.0, slot_count=4096, occupied=4095,
                       slot_bytes=512 * 2**20, batch_bytes=300 * 2**20, device="cuda:7",
                       window=16, max_lag=64, lag_detached=12, publish_wait_fraction=0.42,
                       cpu_seconds=123456.7, cpu_rate=12.5, loader_cpu_seconds=123400.1,
                       loader_cpu_rate=12.34, cpu_saved_rate=12.34, consumers=consumers)
    for k, v in fields.items():
        setattr(p, k, v)
    return p


def test_render_wraps_a_producer_at_80_columns():
    """The text of status and top in 80 columns: every field of a producer with wide
    values is there, on lines of at most 80 characters; unlimited width keeps each group
    of fields on one line."""
    from tensorsocket.cli.status import render

    p = _status()
    narrow = render([p], width=80)
    assert max(len(line) for line in narrow) <= 80, "\n".join(narrow)
    text = "\n".join(narrow)
    for f in PRODUCER_FIELDS + ["pid 4194300", "running", "device cuda:7", "123:45678",
                                "1000.0 loader batches/s", "4095/4096 slots held",
                                "512.0 MiB each", "batch 300.0 MiB", "window 16",
                                "max_lag 64", "lag detaches 12", "waiting for slots 42%",
                                "12.34 cores now", "2 consumer(s) saves about 12.34 cores",
                                "detached (lagged)",
                                "949.9", "1234567 (3.0 GiB)"]:
        assert f in text, f
    header = next(i for i, ln in enumerate(narrow) if ln.startswith("  consumer  "))
    assert narrow[header + 1].split() == ["batches/s"]  # a two-row header
    assert "entries delivered" in text  # in a second table: a wide one would not fit
    wide = render([p])
    assert len(wide) < len(narrow)
    assert "waiting for slots 42%" in wide[1] and "max_lag 64" in wide[1]
    table = next(i for i, ln in enumerate(wide) if ln.startswith("  consumer  "))
    assert "loader batches/s" in wide[table] and "entries delivered" in wide[table]
    assert render([_status(max_lag=None)])[1].count("max_lag -") == 1


def test_status_counts_loader_batches_and_epoch_ends(name, procs):
    """status --json: published = batches_published + epochs_ended (one marker per epoch);
    batch_rate leaves the markers out of rate; max_lag null means none; the text labels
    the consumer columns as loader batches and ring entries."""
    prod = procs.start("producer", "--name", name, "--kind", "samples", "--samples", "160",
                       "--loader-bs", "8", "--delay", "0.02", "--epochs", "500",
                       "--min-consumers", "1")
    procs.wait_ready(prod)
    procs.start("consumer", "--name", name, "--kind", "samples", "--samples", "160",
                "--batch-size", "4", "--epochs", "500")
    wait_for(lambda: (status_json(name, 0)["producers"] or [{"epochs_ended": 0}])[0]
             ["epochs_ended"] >= 2, what="two epochs")
    (p,) = status_json(name, 2.0)["producers"]
    assert p["published"] == p["batches_published"] + p["epochs_ended"]
    newest_is_batch = p["batch_bytes"] is not None
    assert p["epochs_ended"] == p["epoch"] + (0 if newest_is_batch else 1)
    assert p["batches_published"] == 20 * p["epoch"] + (p["batch_index"] + 1 if newest_is_batch
                                                        else 20)
    assert p["max_lag"] is None
    assert 0.85 < p["batch_rate"] / p["rate"] < 0.99, (p["batch_rate"], p["rate"])
    (c,) = p["consumers"]
    assert c["batch_size"] == 4 and c["delivered"] > 0
    assert 0 < c["batch_rate"] < c["rate"], (c["batch_rate"], c["rate"])
    text = cli("status", "--name", name, env={"COLUMNS": "200"}).stdout
    assert "loader batches/s" in text and "entries delivered" in text


def _other_uid() -> int:
    """A uid that is not ours."""
    return 65534 if os.getuid() != 65534 else 65533


def test_status_lists_other_users_producers(name, monkeypatch):
    """Another user's segment (mode 0600) is listed with its owner, name and pid, as not
    readable, in text and JSON, and never touched by clean."""
    uid = _other_uid()
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = f"uid {uid}"
    path = f"/dev/shm/tensorsocket-{uid}-{name}-4194000"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.close(fd)
    try:
        r = cli("status", "--json", "--name", name, "--interval", "0")
        assert r.returncode == 1  # no producer of ours by that name
        doc = json.loads(r.stdout)
        assert doc["producers"] == []
        (o,) = doc["other_users"]
        assert o["user"] == user and o["uid"] == uid and o["name"] == name
        assert o["pid"] == 4194000 and o["segment"] == os.path.basename(path)
        assert "another user's producer" in o["note"]
        r = cli("status", "--interval", "0", env={"COLUMNS": "200"})
        assert r.returncode == 0, r.stderr
        line = next(ln for ln in r.stdout.splitlines() if name in ln)
        assert f"producer {name!r}" in line and "pid 4194000" in line
        assert f"user {user}" in line and "another user's producer" in line
        clean = cli("clean", "--dry-run", "--name", name)
        assert clean.returncode == 0 and "nothing to clean" in clean.stdout
        assert os.path.exists(path)

        from tensorsocket.cli import status

        monkeypatch.setattr(status.os, "access", lambda path, mode: False)
        (seen,) = status.other_users(name)
        assert seen.note == "not readable: another user's producer"
    finally:
        os.unlink(path)
