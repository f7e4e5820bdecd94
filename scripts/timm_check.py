#!/usr/bin/env python3
"""timm's training loader path with the one-line swap, in a venv of its own.

Creates (or reuses) ``benchmarks/.cache/venv-timm`` with torch 2.14.1, torchvision 0.29.1
and timm (torchvision works here only with that torch; the project's own environment stays
on its torch and is not touched), makes this checkout's ``tensorsocket`` importable there,
then for each loader combination that timm's train.py uses on a CPU starts 2 training jobs
at once (scripts/timm_job.py), each doing ``loader_train = tensorsocket.share(loader_train,
name=...)``, and prints one row per combination.

    python3 scripts/timm_check.py                  # build/reuse the venv, run every combination
    python3 scripts/timm_check.py --only pf-mixup  # one combination
    python3 scripts/timm_check.py --setup-only     # just the venv

How tensorsocket gets into the venv: ``pip install -e <repo>`` builds the C core and
copies it over ``tensorsocket/_core*.so`` in the checkout, in place (same inode), which
would rewrite a file of the package under other processes that have it loaded. So by
default the venv gets a link to the checkout's ``tensorsocket/`` instead (what ``-e``
gives, without the rebuild; the in-tree ``_core`` only needs libc and CPython 3.11, so the
project environment's build serves the venv too). ``--pip-editable`` does the literal
``pip install -e <repo> --no-deps``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / "benchmarks" / ".cache" / "venv-timm"
JOB = REPO / "scripts" / "timm_job.py"
TORCH = "torch==2.14.1"
TORCHVISION = "torchvision==0.29.1"
TIMM = "timm==1.0.31"  # what `pip install torch==2.14.1 torchvision==0.29.1 timm` picked here
EXTRA = ["pyzmq", "msgpack", "numpy", "pillow"]
# name: job flags, share() consumer options: the loader set-ups train.py makes on a CPU
# (--no-prefetcher or not, --mixup/--cutmix or not, --use-multi-epochs-loader)
COMBOS = {
    "plain": (["--no-prefetcher"], {}),
    "multi-epochs": (["--no-prefetcher", "--multi-epochs-loader"], {}),
    "mixup-fn": (["--no-prefetcher", "--mixup"], {}),
    "mixup-fn-copy": (["--no-prefetcher", "--mixup"], {"copy": True}),
    "pf": ([], {}),
    "pf-mixup": (["--mixup"], {}),
}
_PROBE = ("import json, sys, torch, torchvision, timm, tensorsocket; print(json.dumps({"
          "'python': sys.version.split()[0], 'torch': torch.__version__, "
          "'torchvision': torchvision.__version__, 'timm': timm.__version__, "
          "'tensorsocket': tensorsocket.__file__}))")


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """Run a command, raising with its output's tail if it fails."""
    out = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if out.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed (rc {out.returncode}):\n"
                           f"{(out.stdout + out.stderr)[-3000:]}")
    return out


def _site_packages(python: Path) -> Path:
    """The venv's site-packages directory."""
    out = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    return Path(out.stdout.strip())


def _probe(python: Path) -> dict | None:
    """Versions seen by the venv's python (None if its imports fail); run from / so that
    the checkout in the working directory does not shadow anything."""
    out = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True, cwd="/")
    if out.returncode != 0:
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def _link_checkout(python: Path) -> None:
    """Make the checkout's tensorsocket importable in the venv without building it."""
    link = _site_packages(python) / "tensorsocket"
    if link.is_symlink() or link.exists():
        if link.is_symlink() and link.resolve() == (REPO / "tensorsocket").resolve():
            return
        if link.is_symlink():
            link.unlink()
        else:
            shutil.rmtree(link)
    link.symlink_to(REPO / "tensorsocket", target_is_directory=True)


def ensure_venv(root: Path, pip_editable: bool) -> tuple[Path, dict]:
    """The venv's python and its versions, creating and filling the venv if needed."""
    python = root / "bin" / "python"
    info = _probe(python) if python.exists() else None
    want = {"torch": TORCH.split("==")[1], "torchvision": TORCHVISION.split("==")[1],
            "timm": TIMM.split("==")[1]}
    if info is None or any(not str(info[k]).startswith(v) for k, v in want.items()):
        print(f"building {root} ({TORCH} {TORCHVISION} {TIMM}; several minutes, ~5.5 GB)",
              flush=True)
        if not python.exists():
            venv.EnvBuilder(with_pip=True).create(root)
        pip = [str(python), "-m", "pip", "install", "-q"]
        _run(pip + [TORCH, TORCHVISION, TIMM] + EXTRA, timeout=3600)
    if pip_editable:
        _run([str(python), "-m", "pip", "install", "-q", "-e", str(REPO), "--no-deps"],
             timeout=900)
    elif not (_site_packages(python) / "__editable__.tensorsocket-0.1.0.pth").exists():
        _link_checkout(python)
    info = _probe(python)
    if info is None:
        raise RuntimeError(f"{python}: importing torch/torchvision/timm/tensorsocket fails")
    if not info["tensorsocket"].startswith(str(REPO)) and \
            not Path(info["tensorsocket"]).resolve().is_relative_to(REPO):
        raise RuntimeError(f"the venv imports tensorsocket from {info['tensorsocket']}, "
                           f"not from {REPO}")
    return python, info


def run_combo(python: Path, combo: str, data: Path, args: argparse.Namespace,
              workdir: Path) -> dict:
    """Start args.jobs jobs of one combination at once; their results and the command."""
    name = f"timm-check-{combo}-{os.getpid()}"
    env = dict(os.environ, TENSORSOCKET_IDLE_TIMEOUT="10", PYTHONFAULTHANDLER="1",
               PYTHONUNBUFFERED="1")
    procs, cmds = [], []
    for job in range(args.jobs):
        out = workdir / f"{combo}.{job}.json"
        cmd = [str(python), str(JOB), "--combo", combo, "--name", name, "--data", str(data),
               "--out", str(out), "--epochs", str(args.epochs),
               "--batch-size", str(args.batch_size), "--workers", str(args.workers),
               "--options", json.dumps(COMBOS[combo][1])] + COMBOS[combo][0]
        cmds.append(cmd)
        err = open(workdir / f"{combo}.{job}.stderr", "w")
        procs.append((subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, cwd="/",
                                       env=env), out, err))
    jobs = []
    deadline = time.monotonic() + args.timeout
    for proc, out, err in procs:
        try:
            rc = proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = f"killed after {args.timeout} s"
            proc.wait()
        err.close()
        res = json.loads(out.read_text()) if out.exists() else {}
        res["rc"] = rc
        res["output"] = Path(err.name).read_text()
        jobs.append(res)
    shell = " & ".join(shlex.join(c) for c in cmds) + " & wait"
    return {"combo": combo, "jobs": jobs, "command": shell}


def verdict(result: dict) -> tuple[str, str]:
    """('works' or 'FAILS', one-line detail) for one combination's jobs."""
    problems, notes = [], set()
    for i, job in enumerate(result["jobs"]):
        if job.get("error"):
            problems.append(f"job{i}: {job['error']}")
        elif job["rc"] != 0:
            tail = [ln for ln in job["output"].splitlines() if ln.strip()][-6:]
            problems.append(f"job{i}: rc {job['rc']}: " + " | ".join(tail))
        problems += [f"job{i}: {p}" for p in job.get("problems", [])]
        notes.update(job.get("warnings", []))
    detail = "; ".join(problems) if problems else "every id once per epoch per job"
    if notes:
        detail += " [warned: " + " / ".join(sorted(notes)) + "]"
    return ("FAILS" if problems else "works"), detail


def main() -> int:
    """Build/reuse the venv, run the combinations, print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--venv", type=Path, default=VENV)
    p.add_argument("--only", action="append", choices=sorted(COMBOS))
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--images", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per combination")
    p.add_argument("--setup-only", action="store_true")
    p.add_argument("--pip-editable", action="store_true",
                   help="pip install -e the checkout (rebuilds tensorsocket/_core*.so in place)")
    p.add_argument("--json", type=Path, help="also write the full results here")
    args = p.parse_args()

    t0 = time.monotonic()
    python, info = ensure_venv(args.venv, args.pip_editable)
    print(f"venv {args.venv}: python {info['python']}, torch {info['torch']}, torchvision "
          f"{info['torchvision']}, timm {info['timm']}; tensorsocket from "
          f"{Path(info['tensorsocket']).resolve().parent} ({time.monotonic() - t0:.0f} s)",
          flush=True)
    if args.setup_only:
        return 0
    results = []
    with tempfile.TemporaryDirectory(prefix="timm-check-") as tmp:
        work = Path(tmp)
        data = work / "data"
        _run([str(python), str(JOB), "--make-data", str(data), "--images", str(args.images)],
             cwd="/")
        for combo in args.only or list(COMBOS):
            t = time.monotonic()
            res = run_combo(python, combo, data, args, work)
            res["wall_s"] = round(time.monotonic() - t, 1)
            res["verdict"] = verdict(res)
            results.append(res)
            print(f"  {combo}: {res['verdict'][0]} ({res['wall_s']} s)", flush=True)
    width = max(len(r["combo"]) for r in results)
    print(f"\n{'combination':<{width}}  prefetcher  mixup                 result  time   detail")
    for r in results:
        flags, opts = COMBOS[r["combo"]]
        pf = "--no-prefetcher" not in flags
        how = ("FastCollateMixup" if pf else "Mixup in loop") if "--mixup" in flags else "-"
        how += " +copy=True" if opts.get("copy") else ""
        state, detail = r["verdict"]
        print(f"{r['combo']:<{width}}  {'on' if pf else 'off':<10}  {how:<20}  {state:<6}  "
              f"{r['wall_s']:>4.0f}s  {detail}")
    print(f"total {time.monotonic() - t0:.0f} s; one combination's command: "
          f"{results[0]['command']}")
    if args.json:
        args.json.write_text(json.dumps({"versions": info, "results": results}, indent=1))
    return 0 if all(r["verdict"][0] == "works" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
