"""Smoke tests of the benchmark scripts: each runs as a user runs it, with --quick, and
its result document is checked for what the script promises (not for the figures, which a
loaded test machine does not give).

benchmarks/shared_prefix.py --quick (3 jobs over 96 small JPEGs, 2 epochs, three modes:
own loaders, share() with a per-job transform, share() with the producer's cache) takes
about 1 to 2 minutes on a loaded 2-core machine: marked slow.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tools import harness

ROOT = Path(__file__).resolve().parent.parent
SHARED_PREFIX = ROOT / "benchmarks" / "shared_prefix.py"
MODES = ["own", "shared", "shared+cache"]


def _segments_of(pid: int) -> list[str]:
    """Shared-memory objects named after the benchmark run `pid` (its producers' rings)."""
    return [e for e in os.listdir("/dev/shm") if f"bench-prefix-{pid}-" in e]


@pytest.mark.slow
def test_shared_prefix_quick(short_tmp, tmp_path):
    """The three modes run to the end, every job of each gets every sample once per epoch
    (the script's own check, which fails the mode), and the document holds the
    calibration, each mode's figures and the ratios; no ring is left behind."""
    out = tmp_path / "shared_prefix.json"
    env = harness.child_env({"XDG_RUNTIME_DIR": str(short_tmp)})
    env.pop("TENSORSOCKET_NAME", None)
    p = harness.spawn(harness.python_argv(SHARED_PREFIX, "--quick", "--json", out), env=env,
                      cwd=tmp_path)
    try:
        stdout, stderr = p.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        p.kill_tree()
        p.communicate()
        raise
    assert p.returncode == 0, f"rc={p.returncode}\n{stdout[-3000:]}\n{stderr[-3000:]}"
    doc = json.loads(out.read_text())
    assert doc["schema"] == "tensorsocket-shared-prefix/1"
    cal = doc["calibration"]
    assert cal["ld_ms"] > 0 and len(cal["la_ms"]) == len(cal["t_ms"]) == 3
    assert all(x > 0 for x in cal["la_ms"] + cal["t_ms"])
    # calibrated before every mode and after the last (--quick: one repeat each)
    assert [r["phase"] for r in cal["repeats"]] == [f"before {m}" for m in MODES] + [
        "after the last mode"]
    assert doc["ideal"]["cache_vs_own"] > doc["ideal"]["shared_vs_own"] > 1
    assert [(m["mode"], m["round"]) for m in doc["modes"]] == [(m, 1) for m in MODES]
    assert len(doc["ratios"]["rounds"]) == 1  # --quick: one round
    for m in doc["modes"]:
        assert m["ok"], m["error"]
        assert m["warnings"] == [], m["warnings"]
        assert len(m["jobs"]) == 3
        assert all(len(j["epochs"]) == 2 and all(e["ok"] for e in j["epochs"])
                   for j in m["jobs"])
        assert m["samples"] == 3 * 2 * 96
        assert m["epoch1_samples_per_s"] > 0 and m["later_samples_per_s"] > 0
        assert m["cpu_ms_per_sample"] > 0 and m["peak_rss_total_mb"] > 0
        for part in ("epoch1", "later"):  # the jobs' own CPU: the step, and the rest
            assert m["job_process_cpu"][part]["step_ms"] > 0
            assert m["job_process_cpu"][part]["rest_ms"] > 0
    shared = {m["mode"]: m for m in doc["modes"]}
    # The producer (re-parented to the benchmark, a subreaper) is one of the mode's
    # processes: more than the 3 jobs and their own forks of the own mode's count.
    assert shared["shared"]["processes"] > 3 and shared["shared+cache"]["processes"] > 3
    for key in ("shared_vs_own_epoch1", "cache_vs_own_later", "cache_vs_shared_later"):
        assert doc["ratios"][key] is not None and doc["ratios"][key] > 0
    assert "shared/own, epoch 1" in stdout and "cache/own, epochs 2+" in stdout
    assert _segments_of(p.pid) == []
