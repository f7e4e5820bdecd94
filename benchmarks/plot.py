"""The suite's plot: throughput and CPU per sample against N, ours against the baselines."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {"shared": ("tensorsocket (shared)", "tab:blue", "o"),
         "independent": ("independent DataLoaders", "tab:gray", "s"),
         "original": ("original TensorSocket 0.0.5", "tab:orange", "^")}


def _series(rows: list[dict], mode: str, key: str) -> tuple[list[int], list[float]]:
    pts = sorted((r["consumers"], r[key]) for r in rows
                 if r["mode"] == mode and r.get(key) is not None)
    return [n for n, _ in pts], [v for _, v in pts]


def plot_results(results: dict, out: Path) -> Path:
    """Write a 2x2 PNG: collocated samples/s and CPU-s/sample vs N; handoff GB/s per
    consumer (32 MiB) and batches/s (tiny) vs N."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    col = (results.get("collocated") or {}).get("summary") or []
    for mode, (label, color, marker) in STYLE.items():
        for ax, key in ((axes[0][0], "aggregate_samples_per_s"),
                        (axes[0][1], "cpu_s_per_sample")):
            xs, ys = _series(col, mode, key)
            if xs:
                ax.plot(xs, ys, marker=marker, color=color, label=label)
    axes[0][0].set(title="Collocated training: aggregate samples/s", xlabel="training jobs N",
                   ylabel="samples/s (all jobs)")
    axes[0][1].set(title="Collocated training: CPU-seconds per sample", xlabel="training jobs N",
                   ylabel="CPU s / sample (all processes)")
    hand = results.get("handoff") or {}
    impls = (("shared", hand.get("results") or []),
             ("original", (hand.get("original") or {}).get("results") or []))
    for mode, rows in impls:
        label, color, marker = STYLE[mode]
        for ax, kind, key in ((axes[1][0], "32MiB", "gb_per_s"),
                              (axes[1][1], "tiny", "batches_per_s")):
            pts = sorted((r["consumers"], r[key]) for r in rows
                         if r["kind"] == kind and r.get(key) is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color,
                        label=label.replace(" (shared)", ""))
    memcpy = [r for r in hand.get("results") or [] if r["kind"] == "32MiB"]
    if memcpy and memcpy[0].get("memcpy_gb_per_s"):
        axes[1][0].axhline(memcpy[0]["memcpy_gb_per_s"], color="black", linestyle="--",
                           label="memcpy (same run)")
    axes[1][0].set(title="Handoff, 32 MiB batches: GB/s per consumer", xlabel="consumers N",
                   ylabel="GB/s per consumer")
    axes[1][1].set(title="Handoff, tiny batches: batches/s per consumer", xlabel="consumers N",
                   ylabel="batches/s (log)", yscale="log")
    for row in axes:
        for ax in row:
            ax.grid(alpha=0.3)
            ax.set_xticks([1, 2, 3, 4])
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    m = results.get("machine") or {}
    fig.suptitle(f"tensorsocket benchmark suite — {m.get('cores')} x {m.get('cpu')}, "
                 f"{(m.get('date') or '')[:10]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
