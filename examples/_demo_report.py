"""The comparison that examples/demo.py prints (and draws, with --plot): the same jobs
run once with a DataLoader each and once through one shared loader, measured side by side.

``measure_run()`` turns one run's child reports into its figures; ``ideal_speedup()``
says what sharing can give at best for the measured per-batch costs; ``table()`` prints
both runs; ``plot()`` draws them with matplotlib.
"""

from __future__ import annotations

from typing import TextIO

MODES = ("baseline", "shared")
TITLES = {"baseline": "a DataLoader each", "shared": "one shared loader"}


def measure_run(jobs: list[dict], producer: dict | None, wall_s: float,
                cpu_s: float) -> dict:
    """One run's figures from its jobs' results (each with samples, first, last in
    CLOCK_MONOTONIC seconds, and train_cpu_s: its CPU and its loader workers' while it
    trained), the producer's (its loading CPU, work_cpu_s), the run's wall time and the CPU
    seconds of all its processes from start to exit. The run's training window starts when
    its last job started (every loader is set up, every job asks for batches) and ends
    when its last job finished."""
    start = max(j["first"] for j in jobs)
    end = max(j["last"] for j in jobs)
    window = max(end - start, 1e-9)
    samples = sum(j["samples"] for j in jobs)
    train_cpu_s = sum(j["train_cpu_s"] for j in jobs) + (producer or {}).get("work_cpu_s", 0.0)
    return {
        "wall_s": wall_s,
        "train_s": window,
        "samples": samples,
        "samples_per_s": samples / window,
        "samples_per_s_per_job": [j["samples"] / max(j["last"] - start, 1e-9) for j in jobs],
        "cpu_s": cpu_s,
        "train_cpu_s": train_cpu_s,
        "cpu_ms_per_sample": 1e3 * train_cpu_s / samples if samples else None,
        "final_loss": [j["final_loss"] for j in jobs],
        "every_sample_once": all(e["missing"] == 0 and e["repeated"] == 0
                                 for j in jobs for e in j["epochs"]),
    }


def ideal_speedup(loader_s: float, train_s: float, jobs: int, cores: int,
                  job_workers: int, producer_workers: int) -> float:
    """The best ratio of samples/s, shared over baseline, for a loader costing `loader_s`
    and a training step `train_s` CPU seconds per batch: each side runs at the rate its
    bottleneck allows, the loader's workers (L / workers per batch, pipelined with
    training), training (T per batch), or the machine's cores (all jobs' CPU per batch
    over `cores`). N jobs each loading for itself need N (L + T) per batch of every job;
    one shared loader needs L + N T."""
    baseline_per_job = min(1.0 / max(loader_s / job_workers, train_s),
                           cores / (jobs * (loader_s + train_s)))
    shared_per_job = min(1.0 / max(loader_s / producer_workers, train_s),
                         cores / (loader_s + jobs * train_s))
    return shared_per_job / baseline_per_job


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or a == 0 else f"{b / a:.2f}x"


def table(runs: dict[str, dict], ideal: float, jobs: int, epochs: int,
          out: TextIO) -> None:
    """Both runs side by side, the ratios, and one sentence that says what they mean."""
    b, s = runs["baseline"], runs["shared"]
    rows = [
        ("wall time, start-up included", f"{b['wall_s']:.1f} s", f"{s['wall_s']:.1f} s",
         _ratio(b["wall_s"], s["wall_s"])),
        ("training time (first to last batch)", f"{b['train_s']:.1f} s",
         f"{s['train_s']:.1f} s", _ratio(b["train_s"], s["train_s"])),
        ("samples/s, all jobs", f"{b['samples_per_s']:.0f}", f"{s['samples_per_s']:.0f}",
         _ratio(b["samples_per_s"], s["samples_per_s"])),
        ("samples/s, per job", " ".join(f"{v:.0f}" for v in b["samples_per_s_per_job"]),
         " ".join(f"{v:.0f}" for v in s["samples_per_s_per_job"]), ""),
        ("CPU seconds while training", f"{b['train_cpu_s']:.1f}", f"{s['train_cpu_s']:.1f}",
         _ratio(b["train_cpu_s"], s["train_cpu_s"])),
        ("CPU seconds, start-up included", f"{b['cpu_s']:.1f}", f"{s['cpu_s']:.1f}",
         _ratio(b["cpu_s"], s["cpu_s"])),
        ("CPU ms per sample, training", f"{b['cpu_ms_per_sample']:.1f}",
         f"{s['cpu_ms_per_sample']:.1f}", _ratio(b["cpu_ms_per_sample"],
                                                  s["cpu_ms_per_sample"])),
        (f"every sample once per epoch ({jobs} jobs x {epochs})",
         "yes" if b["every_sample_once"] else "NO", "yes" if s["every_sample_once"] else "NO",
         ""),
    ]
    head = ("", TITLES["baseline"], TITLES["shared"], "shared / each")
    widths = [max(len(r[k]) for r in rows + [head]) for k in range(4)]
    print(file=out)
    for r in [head] + rows:
        print("  " + r[0].ljust(widths[0]) + "  " + "  ".join(
            c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)), file=out)
    speedup = s["samples_per_s"] / b["samples_per_s"]
    saved = b["train_cpu_s"] - s["train_cpu_s"]
    print(f"\n  Sharing one loader trained the {jobs} jobs {speedup:.2f}x as fast in all (the "
          f"best these costs allow on this machine: {ideal:.2f}x) and saved {saved:.1f} CPU "
          f"seconds while training ({100 * saved / b['train_cpu_s']:.0f}% of the baseline's).",
          file=out, flush=True)


def plot(runs: dict[str, dict], ideal: float, path: str) -> None:
    """Two bar charts, samples/s and CPU seconds, baseline against shared, into `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [TITLES[m] for m in MODES]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    rates = [runs[m]["samples_per_s"] for m in MODES]
    left.bar(labels, rates, color=["#999999", "#2a7ab9"])
    left.axhline(rates[0] * ideal, color="#2a7ab9", linestyle="--", linewidth=1,
                 label=f"best possible ({ideal:.2f}x)")
    left.set_title("samples/s, all jobs (higher is better)")
    left.legend(loc="lower right", fontsize=8)
    right.bar(labels, [runs[m]["train_cpu_s"] for m in MODES], color=["#999999", "#2a7ab9"])
    right.set_title("CPU seconds while training (lower is better)")
    for ax in (left, right):
        for bar in ax.patches:
            ax.annotate(f"{bar.get_height():.0f}", (bar.get_x() + bar.get_width() / 2,
                                                    bar.get_height()),
                        ha="center", va="bottom", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
