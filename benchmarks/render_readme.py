"""Render the README's "Performance" section from a results file of suite.py.

    python benchmarks/render_readme.py                      # the newest full results file
    python benchmarks/render_readme.py benchmarks/results/X.json
    python benchmarks/render_readme.py --check              # exit 1 if README is stale

Everything between the markers ``<!-- performance:begin -->`` and
``<!-- performance:end -->`` in README.md is replaced: no figure is typed by hand.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # verdicts.py, when this file is imported from elsewhere
from verdicts import evaluate  # noqa: E402
ROOT = HERE.parent
README = ROOT / "README.md"
BEGIN, END = "<!-- performance:begin -->", "<!-- performance:end -->"
MODES = ("independent", "shared", "original")


def newest_results() -> Path:
    """The newest full (not --quick) results file."""
    files = sorted(p for p in (HERE / "results").glob("*.json") if not p.stem.endswith("-quick"))
    if not files:
        raise SystemExit("no results file in benchmarks/results/: run benchmarks/suite.py")
    return max(files, key=lambda p: json.loads(p.read_text())["machine"]["date"])


def _num(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def _workers(cfg: dict) -> str:
    """How many loader workers each mode had (older results files do not say)."""
    per_n = cfg.get("producer_workers")
    if not per_n:
        return f"Every loader has {cfg.get('workers')} worker(s)."
    shared = ", ".join(f"{w} at N={n}" for n, w in sorted(per_n.items(), key=lambda x: int(x[0])))
    return (f"Each independent DataLoader has {cfg.get('workers')} worker(s); the one shared "
            f"loader has what the N jobs have together, at most the cores ({shared}).")


def _calibration(cal: dict, ns: list[int]) -> str:
    """The run's own calibration: the loader's CPU cost per batch, L, against a training
    step's, T, and what the model below predicts from them with no cost of sharing."""
    load, train = cal.get("loader_ms_per_batch"), cal.get("train_ms_per_batch")
    if not load or not train:
        return ""
    if cal.get("clock") != "thread CPU time":  # schema 1: wall time, loader in one process
        return (f" Calibrated in the same run (one process, one thread, wall time): the "
                f"loader takes {load:.0f} ms per batch and a training step {train:.1f} ms.")
    k = load / train
    model = ", ".join(f"N={n}: {n * (k + 1) / (k + n):.2f}x and {(k + n) / (n * (k + 1)):.2f}x"
                      for n in ns if n > 1)
    return (f" Calibrated in the same run (CPU time of one thread; the loader in a forked "
            f"process with its heap padded as the producer's workers pad theirs): the loader "
            f"costs L = {load:.0f} ms per batch and a training step T = {train:.1f} ms, so "
            f"L = {k:.1f} T. With sharing itself free, the model below predicts shared / "
            f"independent throughput and CPU per sample of {model}.")


def _collocated(doc: dict) -> list[str]:
    rows = doc.get("summary") or []
    by = {(r["mode"], r["consumers"]): r for r in rows}
    ns = sorted({r["consumers"] for r in rows})
    cal = doc.get("calibration") or {}
    cfg = doc.get("config") or {}
    out = [
        f"**Collocated training** (`benchmarks/collocated.py`): N processes each train a "
        f"small CNN on the CPU ({cal.get('model_params', '?'):,} parameters, one thread each) "
        f"on batches of {cfg.get('batch_size')} JPEG-decoded, randomly cropped and flipped "
        f"{cfg.get('crop')}x{cfg.get('crop')} images; medians of {doc.get('repeats')} runs. "
        + _workers(cfg) + _calibration(cal, ns),
        "",
        "| N | samples/s independent | samples/s shared | samples/s original | "
        "shared / independent | CPU s/sample independent | CPU s/sample shared | "
        "CPU ratio | peak RSS independent | peak RSS shared |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(mode: str, n: int, key: str, spec: str) -> str:
        r = by.get((mode, n))
        if r is None:
            return "—"
        if r.get("status") == "error":
            return "failed"
        return _num(r.get(key), spec)

    for n in ns:
        shared = by.get(("shared", n)) or {}
        ratios = shared.get("vs_independent") or {}
        out.append(
            f"| {n} | {cell('independent', n, 'aggregate_samples_per_s', '.1f')} "
            f"| {cell('shared', n, 'aggregate_samples_per_s', '.1f')} "
            f"| {cell('original', n, 'aggregate_samples_per_s', '.1f')} "
            f"| {_num(ratios.get('samples_per_s'), '.2f')}x "
            f"| {cell('independent', n, 'cpu_s_per_sample', '.4f')} "
            f"| {cell('shared', n, 'cpu_s_per_sample', '.4f')} "
            f"| {_num(ratios.get('cpu_s_per_sample'), '.2f')}x "
            f"| {cell('independent', n, 'peak_rss_total_mb', ',.0f')} MB "
            f"| {cell('shared', n, 'peak_rss_total_mb', ',.0f')} MB |")
    # The same failure at several N differs only in its count of consumers: say it once,
    # with how many of the runs at each N it ended.
    errors: dict[str, dict[int, int]] = {}
    runs_at: dict[int, int] = {}
    for r in doc.get("runs") or []:
        if r.get("mode") != "original":
            continue
        runs_at[r["consumers"]] = runs_at.get(r["consumers"], 0) + 1
        if r.get("error"):
            text = re.sub(r"^check failed in (\d+) of \1 consumers", "check failed in every "
                          "consumer", r["error"])[:200]
            at = errors.setdefault(text, {})
            at[r["consumers"]] = at.get(r["consumers"], 0) + 1

    def where(at: dict[int, int]) -> str:
        return ", ".join(f"{n}" if k == runs_at[n] else f"{n} ({k} of {runs_at[n]} runs)"
                         for n, k in sorted(at.items()))
    if errors:
        out += ["", "The original TensorSocket in this workload: " + "; ".join(
            f"N={where(at)}: `{text}`" for text, at in errors.items())]
    return out


SUPPLEMENTARY = ("worker-top-pad", "producer-unpadded")  # file suffixes, as in _allocator_note


def _allocator_pair() -> tuple[Path | None, Path | None] | None:
    """The newest supplementary collocated runs: every loader worker of both modes
    padded (``*-worker-top-pad.json``), and the shared producer's workers with glibc's
    defaults (``*-producer-unpadded.json``)."""
    found = [sorted((HERE / "results" / "supplementary").glob(f"*-{suffix}.json"))
             for suffix in SUPPLEMENTARY]
    if not any(found):
        return None
    return found[0][-1] if found[0] else None, found[1][-1] if found[1] else None


def _ratios(doc: dict) -> str:
    """Shared / independent at each N of a collocated document."""
    rows = {(r["mode"], r["consumers"]): r for r in doc.get("summary") or []}
    cells = []
    for n in sorted({r["consumers"] for r in doc.get("summary") or []}):
        v = (rows.get(("shared", n)) or {}).get("vs_independent") or {}
        cells.append(f"N={n}: {_num(v.get('samples_per_s'), '.2f')}x samples/s, CPU per "
                     f"sample {_num(v.get('cpu_s_per_sample'), '.2f')}x")
    return "; ".join(cells)


def _allocator_note(pair: tuple[Path | None, Path | None] | None, main: dict) -> list[str]:
    """How the loader workers' heaps were set up in the table, and the same comparison
    with every worker padded and with the producer's padding off."""
    cfg = main.get("config") or {}
    pad = cfg.get("producer_worker_heap_pad")
    text = ("**The loader workers' allocator** (benchmarks/README.md, \"The allocator\"): a "
            "DataLoader worker's CPU per batch depends on the malloc heap it inherits when "
            "forked. ")
    if pad:
        text += (f"In the table, the shared producer pads its workers' heaps "
                 f"(`worker_heap_pad`, {pad >> 20} MiB: its default) and the independent "
                 f"DataLoaders keep glibc's defaults, as a user's own would. ")
    elif pad is not None:
        text += "In the table, every loader worker keeps glibc's defaults. "
    if pair is None:
        return ["", text.rstrip()]
    padded, unpadded = pair
    docs = [(p, json.loads(p.read_text())) for p in (padded, unpadded) if p is not None]
    first = docs[0][1]
    fcfg = first.get("config") or {}
    text += (f"Supplementary runs of {first.get('started', '')[:10]} "
             f"({fcfg.get('measured_batches')} batches, medians of {first.get('repeats')} "
             f"runs; absolute rates differ from the table's), shared / independent: ")
    for path, doc in docs:
        dcfg = doc.get("config") or {}
        if path is padded:
            text += (f"every worker of both modes padding its heap (`--worker-top-pad "
                     f"{dcfg.get('worker_top_pad', 0)}`): {_ratios(doc)}. ")
        else:
            text += (f"The producer's workers with glibc's defaults too (`--producer-heap-pad "
                     f"0`, as before the producer padded them): {_ratios(doc)}. ")
    links = " and ".join(f"[`{p.name}`]({p.relative_to(ROOT)})" for p, _ in docs)
    return ["", text + f"Files: {links}."]


def _stream_note(doc: dict) -> str:
    """The streaming-copy baseline of the 32 MiB batch, where the results have it."""
    rows = [r for r in doc.get("results") or [] if r.get("stream_copy_gb_per_s")]
    if not rows:
        return ""
    ratios = ", ".join(f"N={r['consumers']}: {_num(r.get('ratio_vs_stream_copy'), '.2f')}x"
                       for r in rows)
    return (" The producer fills large slots with streaming stores (`csrc/base/ts_copy.c`); that "
            f"copy alone runs at {rows[0]['stream_copy_gb_per_s']:.1f} GB/s here, and the "
            f"32 MiB handoff reaches {ratios} of it.")


def _handoff(doc: dict) -> list[str]:
    comp = {(c["kind"], c["consumers"]): c for c in doc.get("comparison") or []}
    out = [
        "**Handoff** (`benchmarks/handoff.py --with-original --with-iceoryx2`): a loader that "
        "costs nothing, so only the handoff is timed; per consumer, median over consumers and "
        "repeats; memcpy of the same bytes measured in the same run; iceoryx2's Python "
        "publish-subscribe (a WaitSet, lossless) run interleaved with ours, with the same "
        "memory at one consumer (benchmarks/README.md, \"Against iceoryx2\"); CPU: one "
        "consumer's, per batch." + _stream_note(doc),
        "",
        "| batch | N | ours batches/s | ours GB/s | vs memcpy | iceoryx2 batches/s | "
        "ours / iceoryx2 | consumer CPU us/b ours / iceoryx2 | original batches/s | "
        "ours / original |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    ice = {(c["kind"], c["consumers"]): c for c in doc.get("comparison_iceoryx2") or []}
    for r in doc.get("results") or []:
        c = comp.get((r["kind"], r["consumers"])) or {}
        i = ice.get((r["kind"], r["consumers"])) or {}
        orig = c.get("original_batches_per_s")
        orig_cell = _num(orig, ",.0f") if orig is not None else (
            "failed" if c.get("original_error") else "—")
        iox = i.get("iceoryx2_batches_per_s")
        iox_cell = _num(iox, ",.0f") if iox is not None else (
            "failed" if i.get("iceoryx2_error") else "—")
        cpu = (f"{_num(i.get('ours_consumer_cpu_us_per_batch'), '.1f')} / "
               f"{_num(i.get('iceoryx2_consumer_cpu_us_per_batch'), '.1f')}") if i else "—"
        out.append(
            f"| {r['kind']} | {r['consumers']} | {_num(r.get('batches_per_s'), ',.0f')} "
            f"| {_num(r.get('gb_per_s'), '.2f')} | {_num(r.get('ratio_vs_memcpy'), '.2f')}x "
            f"| {iox_cell} | {_num(i.get('ours_over_iceoryx2'), '.2f')}x | {cpu} "
            f"| {orig_cell} | {_num(c.get('ours_over_original'), '.1f')}x |")
    errors = sorted({f"{c['kind']} N={c['consumers']}: {c['original_error']}"
                     for c in comp.values() if c.get("original_error")})
    if errors:
        out += ["", "Where the original failed: " + "; ".join(f"`{e[:200]}`" for e in errors)]
    return out


def render(results: dict, path: Path) -> str:
    """The Markdown of the section for this results document."""
    m = results["machine"]
    rel = path.relative_to(ROOT)
    lines = [
        BEGIN,
        "<!-- generated by benchmarks/render_readme.py from "
        f"{rel}; do not edit by hand -->",
        f"Measured {m['date'][:10]} on {m['cores']} cores ({m['cpu']}), "
        f"{m['memory_bytes'] / 2**30:.0f} GiB, torch {m['torch']}, commit {m['commit']}, "
        "with `python benchmarks/suite.py`. Results: "
        f"[`{rel}`]({rel})." + "".join(
            f" The {step} results were measured at commit {commit}"
            + (f" on {results['kept_dates'][step]}" if step in (results.get("kept_dates") or {})
               else "") + "."
            for step, commit in sorted((results.get("kept_from") or {}).items())),
        "",
    ]
    png = path.with_suffix(".png")
    if png.exists():
        lines += [f"![benchmark plot]({png.relative_to(ROOT)})", ""]
    if results.get("collocated"):
        lines += (_collocated(results["collocated"])
                  + _allocator_note(_allocator_pair(), results["collocated"]) + [""])
    if results.get("handoff"):
        lines += _handoff(results["handoff"]) + [""]
    lines += ["| target | measured | |", "|---|---|---|"]
    # Recomputed from the stored runs, so the table follows verdicts.py as it is now.
    for v in evaluate(results):
        lines.append(f"| {v['target']} | {v['measured']} | {v['status']} |")
    lines.append(END)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="?", type=Path, help="results file (default: newest)")
    ap.add_argument("--check", action="store_true", help="only check the README is current")
    args = ap.parse_args(argv)
    path = (args.results or newest_results()).resolve()
    section = render(json.loads(path.read_text()), path)
    text = README.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = head + section + tail
    if args.check:
        if new != text:
            print("README.md's performance section is stale: run benchmarks/render_readme.py")
            return 1
        return 0
    README.write_text(new)
    print(f"README.md performance section rendered from {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
