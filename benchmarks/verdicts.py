"""The issue's targets, checked against one results document of suite.py."""

from __future__ import annotations

from typing import Any


def _row(rows: list[dict], **match: Any) -> dict | None:
    for r in rows or ():
        if all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def _verdict(target: str, value: float | None, ok: bool | None, measured: str) -> dict:
    status = "n/a" if ok is None else ("met" if ok else "MISS")
    return {"target": target, "value": value, "ok": ok, "status": status, "measured": measured}


def collocated_verdicts(doc: dict | None, n: int = 3) -> list[dict]:
    """N = 3: aggregate throughput >= 2x independent; CPU-s per sample <= 0.4x."""
    rows = (doc or {}).get("summary") or []
    shared = _row(rows, mode="shared", consumers=n) or {}
    ratios = shared.get("vs_independent") or {}
    thr, cpu = ratios.get("samples_per_s"), ratios.get("cpu_s_per_sample")
    return [
        _verdict(f"collocated N={n}: shared throughput >= 2x independent DataLoaders", thr,
                 None if thr is None else thr >= 2.0,
                 f"{_fmt(thr)}x{_per_repeat(doc, n, 'aggregate_samples_per_s', '.2f')}"),
        _verdict(f"collocated N={n}: CPU-seconds per sample <= 0.4x independent", cpu,
                 None if cpu is None else cpu <= 0.4,
                 f"{_fmt(cpu, '.3f')}x{_per_repeat(doc, n, 'cpu_s_per_sample', '.3f')}"),
    ]


def _per_repeat(doc: dict | None, n: int, metric: str, spec: str) -> str:
    """ " (per repeat: a, b, c)": shared / independent of each repeat at N, in run order."""
    runs = [r for r in (doc or {}).get("runs") or [] if r.get("consumers") == n and r.get("ok")]
    base = {r["repeat"]: r.get(metric) for r in runs if r["mode"] == "independent"}
    cells = [format(r[metric] / base[r["repeat"]], spec) for r in runs
             if r["mode"] == "shared" and r.get(metric) and base.get(r["repeat"])]
    return f" (per repeat: {', '.join(cells)})" if len(cells) > 1 else ""


def handoff_verdicts(doc: dict | None) -> list[dict]:
    """32 MiB >= 0.8x memcpy per consumer and flat in N; tiny >= 20,000 batches/s;
    >= 10x the original on tiny and >= 2x on 32 MiB; >= iceoryx2 per consumer."""
    doc = doc or {}
    res = doc.get("results") or []
    large = [r for r in res if r["kind"] == "32MiB" and r.get("ratio_vs_memcpy") is not None]
    out = []
    if large:
        worst = min(r["ratio_vs_memcpy"] for r in large)
        best = max(r["ratio_vs_memcpy"] for r in large)
        per_n = ", ".join(f"N={r['consumers']}: {r['ratio_vs_memcpy']:.2f}" for r in large)
        out.append(_verdict("handoff 32 MiB: >= 0.8x memcpy per consumer, every N", worst,
                            worst >= 0.8, per_n))
        flat = worst / best if best else None
        out.append(_verdict("handoff 32 MiB: flat in N (worst/best N >= 0.8)", flat,
                            None if flat is None else flat >= 0.8, f"{_fmt(flat)}"))
    else:
        out.append(_verdict("handoff 32 MiB: >= 0.8x memcpy per consumer", None, None, "n/a"))
    tiny = _row(res, kind="tiny", consumers=1)
    bps = tiny.get("batches_per_s") if tiny else None
    out.append(_verdict("handoff tiny: >= 20,000 batches/s", bps,
                        None if bps is None else bps >= 20000, f"{_fmt(bps, ',.0f')} batches/s"))
    comp = doc.get("comparison") or []
    for kind, want in (("tiny", 10.0), ("32MiB", 2.0)):
        rows = [c for c in comp if c["kind"] == kind]
        ratios = [c["ours_over_original"] for c in rows if c.get("ours_over_original")]
        errors = [f"N={c['consumers']}: {c['original_error']}" for c in rows
                  if c.get("original_error")]
        if ratios:
            worst = min(ratios)
            detail = ", ".join(f"N={c['consumers']}: {_fmt(c.get('ours_over_original'), '.1f')}x"
                               for c in rows if c.get("ours_over_original"))
            if errors:
                detail += "; original failed at " + "; ".join(errors)
            out.append(_verdict(f"vs original TensorSocket, {kind}: >= {want:g}x", worst,
                                worst >= want, detail))
        elif errors:
            out.append(_verdict(f"vs original TensorSocket, {kind}: >= {want:g}x", None, None,
                                "original failed: " + "; ".join(errors)))
    return out + _iceoryx2_verdicts(doc.get("comparison_iceoryx2") or [])


def _iceoryx2_verdicts(rows: list[dict]) -> list[dict]:
    """Per consumer, at every N and batch size, >= iceoryx2's rate in the same run; tiny at
    one consumer: consumer CPU per batch <= iceoryx2's."""
    out = []
    for kind in ("tiny", "32MiB"):
        mine = [c for c in rows if c["kind"] == kind and c.get("ours_over_iceoryx2")]
        if mine:
            worst = min(c["ours_over_iceoryx2"] for c in mine)
            detail = ", ".join(f"N={c['consumers']}: {c['ours_over_iceoryx2']:.2f}x"
                               for c in mine)
            out.append(_verdict(f"vs iceoryx2, {kind}: >= 1x per consumer, every N", worst,
                                worst >= 1.0, detail))
    one = _row(rows, kind="tiny", consumers=1)
    if one and one.get("ours_consumer_cpu_us_per_batch") and \
            one.get("iceoryx2_consumer_cpu_us_per_batch"):
        ours, theirs = one["ours_consumer_cpu_us_per_batch"], \
            one["iceoryx2_consumer_cpu_us_per_batch"]
        out.append(_verdict("vs iceoryx2, tiny N=1: consumer CPU per batch <= iceoryx2's",
                            ours / theirs, ours <= theirs, f"{ours:.2f} vs {theirs:.2f} us"))
    return out


def evaluate(results: dict) -> list[dict]:
    """Every target, in the order of the issue."""
    return collocated_verdicts(results.get("collocated")) + \
        handoff_verdicts(results.get("handoff"))
