"""The benchmark suite in one command: handoff and collocated training, ours against
the baselines (independent DataLoaders, the original TensorSocket, memcpy), measured in
one run on this machine.

    python benchmarks/suite.py                  # full (about 40 minutes on 2 cores)
    python benchmarks/suite.py --quick          # a few minutes, fewer batches and repeats
    python benchmarks/suite.py --skip-original  # without the original TensorSocket

It runs ``handoff.py --with-original --with-iceoryx2 --no-floor`` and ``collocated.py``
one after the other
(never side by side: they would measure each other), shows their progress, and
writes ``benchmarks/results/<date>-<machine>.json`` (machine, both result sets and
the verdicts against the targets) plus a PNG plot beside it. ``render_readme.py``
turns a results file into the README's "Performance" section.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"


def machine_info() -> dict:
    """What the numbers were measured on."""
    import torch

    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(next(line.split()[1] for line in f if line.startswith("MemTotal"))) * 1024
    except (OSError, StopIteration):
        pass
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip() or None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "commit": commit,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def _shown(path: Path) -> Path:
    """`path` relative to the checkout where it lies in it (--out may point elsewhere)."""
    try:
        return path.resolve().relative_to(ROOT)
    except ValueError:
        return path


def machine_tag(info: dict) -> str:
    """A short file-name-safe name for the machine: '2cpu-intel-xeon-...'."""
    cpu = re.sub(r"\(r\)|\(tm\)|cpu|@.*$", "", info["cpu"].lower())
    cpu = re.sub(r"[^a-z0-9]+", "-", cpu).strip("-")[:40]
    return f"{info['cores']}cpu-{cpu}"


def run_step(title: str, cmd: list[str], timeout: float) -> dict:
    """Run one benchmark script with --json into a temp file, passing its output through
    (that is the progress), and return its JSON (or an error record)."""
    print(f"\n=== {title}: {' '.join(cmd[1:])}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        t0 = time.monotonic()
        try:
            proc = subprocess.run([*cmd, "--json", str(out)], cwd=ROOT, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"{title} did not finish within {timeout:.0f} s"}
        elapsed = time.monotonic() - t0
        if proc.returncode != 0 and not out.exists():
            return {"error": f"{title} exited with {proc.returncode} after {elapsed:.0f} s"}
        data = json.loads(out.read_text())
        data["elapsed_s"] = elapsed
        data["exit_code"] = proc.returncode
        return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer batches and repeats")
    ap.add_argument("--skip-original", action="store_true",
                    help="leave out the original TensorSocket (no venv is created)")
    ap.add_argument("--only", default="handoff,collocated",
                    help="comma-separated subset of handoff,collocated")
    ap.add_argument("--repeats", type=int, help="repeats per configuration (default: each "
                    "script's own, 3; 1 with --quick)")
    ap.add_argument("--collocated-batches", type=int, metavar="N",
                    help="measured batches per consumer in collocated.py (its default: 60); "
                         "longer runs give steadier medians on a noisy machine")
    ap.add_argument("--skip-iceoryx2", action="store_true",
                    help="leave out iceoryx2, the handoff's peer (where it is not installed "
                         "handoff.py skips it anyway, saying so)")
    ap.add_argument("--keep", type=Path, metavar="RESULTS_JSON",
                    help="take the steps not run (see --only) from this results file, "
                         "saying which commit and date measured them")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    args = ap.parse_args(argv)

    info = machine_info()
    print(f"benchmark suite on {info['cores']} x {info['cpu']}, torch {info['torch']}, "
          f"commit {info['commit']}", flush=True)
    quick = ["--quick"] if args.quick else []
    if args.repeats:
        quick += ["--repeats", str(args.repeats)]
    steps = [s for s in args.only.split(",") if s]
    results: dict = {"machine": info, "quick": args.quick, "repeats": args.repeats}
    if "handoff" in steps:
        cmd = [sys.executable, str(HERE / "handoff.py"), *quick]
        if not args.skip_original:
            cmd.append("--with-original")
        if not args.skip_iceoryx2:
            cmd += ["--with-iceoryx2", "--no-floor"]
        results["handoff"] = run_step("handoff", cmd, timeout=3600)
    if "collocated" in steps:
        modes = "independent,shared" + ("" if args.skip_original else ",original")
        cmd = [sys.executable, str(HERE / "collocated.py"), "--modes", modes, *quick]
        if args.collocated_batches:
            cmd += ["--batches", str(args.collocated_batches)]
        results["collocated"] = run_step("collocated training", cmd, timeout=5400)

    from verdicts import evaluate  # noqa: E402  (benchmarks/ is on sys.path as the script dir)

    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{info['date'][:10]}-{machine_tag(info)}" + ("-quick" if args.quick else "")
    path = args.out / f"{stem}.json"
    # Re-running one step (--only) keeps the other step of today's file on this machine
    # (or of the --keep file), and says which commit measured it, and when.
    source = args.keep if args.keep is not None else path
    if source.exists():
        old = json.loads(source.read_text())
        for step in ("handoff", "collocated"):
            if step not in steps and old.get(step):
                results[step] = old[step]
                kept = old.get("kept_from") or {}
                results.setdefault("kept_from", {})[step] = kept.get(
                    step, old["machine"].get("commit"))
                dates = old.get("kept_dates") or {}
                results.setdefault("kept_dates", {})[step] = dates.get(
                    step, old["machine"]["date"][:10])
                print(f"{step}: kept from {_shown(source)} (commit "
                      f"{results['kept_from'][step]}, {results['kept_dates'][step]})",
                      flush=True)
    results["verdicts"] = evaluate(results)
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nresults: {_shown(path)}")
    try:
        from plot import plot_results

        png = plot_results(results, path.with_suffix(".png"))
        print(f"plot:    {_shown(png)}")
    except ImportError as e:
        print(f"plot:    skipped ({e}; pip install matplotlib)")
    print("\nverdicts:")
    for v in results["verdicts"]:
        print(f"  [{v['status']:>4}] {v['target']}: {v['measured']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
