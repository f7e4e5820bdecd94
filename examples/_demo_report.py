"""The comparison that examples/demo.py prints (and draws, with --plot): the same jobs
run once with a DataLoader each and once through one shared loader, measured side by side.

``measure_run()`` turns one run's child reports into its figures; ``model_speedup()``
says what a model of the measured per-batch costs predicts; ``table()`` prints
both runs; ``plot()`` draws them with matplotlib.
"""

from __future__ import annotations

import textwrap
from typing import TextIO

MODES = ("baseline", "shared")
# Other processes' CPU during a run, as a fraction of the run's own, over which the
# comparison is flagged as skewed.
OTHER_WORK_FRACTION = 0.1
TITLES = {"baseline": "a DataLoader each", "shared": "one shared loader"}


def measure_run(jobs: list[dict], producer: dict | None, wall_s: float,
                cpu_s: float) -> dict:
    """One run's figures from its jobs' results (each with samples, first, last in
    CLOCK_MONOTONIC seconds, and train_cpu_s: its CPU and its loader workers' while it
    trained), the producer's (its loading CPU, work_cpu_s), the run's wall time and the CPU
    seconds of all its processes from start to exit. The run's training window starts when
    its loading starts, every process set up (the producer's first, else the jobs' first
    first: the start signal, all jobs got it together), and ends when its last job
    finished."""
    start = producer["first"] if producer is not None else min(j["first"] for j in jobs)
    end = max(j["last"] for j in jobs)
    window = max(end - start, 1e-9)
    samples = sum(j["samples"] for j in jobs)
    train_cpu_s = sum(j["train_cpu_s"] for j in jobs) + (producer or {}).get("work_cpu_s", 0.0)
    trained = sum(j["batches"] for j in jobs)  # batches trained on, all jobs together
    if producer is None:  # each job's DataLoader workers loaded the batches it trained on
        loading_s, loaded = sum(j["workers_cpu_s"] for j in jobs), trained
    else:  # the producer's workers loaded each batch once
        loading_s, loaded = producer["workers_cpu_s"], producer["batches"]
    return {
        "wall_s": wall_s,
        "train_s": window,
        "samples": samples,
        "samples_per_s": samples / window,
        "samples_per_s_per_job": [j["samples"] / max(j["last"] - start, 1e-9) for j in jobs],
        "cpu_s": cpu_s,
        "train_cpu_s": train_cpu_s,
        "cpu_ms_per_sample": 1e3 * train_cpu_s / samples if samples else None,
        "loader_ms_per_batch": 1e3 * loading_s / loaded if loaded else None,
        "trainer_ms_per_batch": 1e3 * sum(j["trainer_cpu_s"] for j in jobs) / trained
        if trained else None,
        # the producer process itself (receiving from its workers, publishing, the ring)
        "producer_ms_per_batch": 1e3 * producer["own_cpu_s"] / loaded
        if producer is not None and loaded else None,
        "final_loss": [j["final_loss"] for j in jobs],
        "every_sample_once": all(e["missing"] == 0 and e["repeated"] == 0
                                 for j in jobs for e in j["epochs"]),
    }


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f} ms"


def model_speedup(loader_s: float, train_s: float, jobs: int, cores: int,
                  job_workers: int, producer_workers: int) -> tuple[float, bool]:
    """The model's ratio of samples/s, shared over baseline, for a loader costing `loader_s`
    and a training step `train_s` CPU seconds per batch, and whether the cores limit both
    sides (then it is N (L + T) / (L + N T)). Each side runs at the rate its slowest part
    allows: the loader's workers (L / workers per batch, pipelined with training), training
    (T per batch), or the machine's cores (all jobs' CPU per batch over `cores`). N jobs
    each loading for itself need N (L + T) per batch of every job; one shared loader needs
    L + N T. A prediction, not a bound: it leaves out what a DataLoader costs the job that
    receives its batches, and what publishing costs."""
    baseline_pace = 1.0 / max(loader_s / job_workers, train_s)
    baseline_cores = cores / (jobs * (loader_s + train_s))
    shared_pace = 1.0 / max(loader_s / producer_workers, train_s)
    shared_cores = cores / (loader_s + jobs * train_s)
    ratio = min(shared_pace, shared_cores) / min(baseline_pace, baseline_cores)
    return ratio, baseline_cores <= baseline_pace and shared_cores <= shared_pace


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or a == 0 else f"{b / a:.2f}x"


def table(runs: dict[str, dict], model: tuple[float, bool], costs: dict, jobs: int,
          epochs: int, cores: int, out: TextIO) -> None:
    """Both runs side by side, the ratios, and what they mean against the model."""
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
        ("  loader workers, per batch loaded", _ms(b["loader_ms_per_batch"]),
         _ms(s["loader_ms_per_batch"]), ""),
        ("  producer process, per batch", "-", _ms(s["producer_ms_per_batch"]), ""),
        ("  job processes, per batch and job", _ms(b["trainer_ms_per_batch"]),
         _ms(s["trainer_ms_per_batch"]), ""),
        ("CPU seconds, start-up included", f"{b['cpu_s']:.1f}", f"{s['cpu_s']:.1f}",
         _ratio(b["cpu_s"], s["cpu_s"])),
        ("CPU seconds of other processes meanwhile", _num(b["other_cpu_s"]),
         _num(s["other_cpu_s"]), ""),
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
    ratio, cores_bound = model
    cpu = (f"saved {saved:.1f} CPU seconds while training ({100 * saved / b['train_cpu_s']:.0f}%"
           " of the baseline's)") if saved >= 0 else \
        f"used {-saved:.1f} CPU seconds more while training"
    lb, ls = b["loader_ms_per_batch"], s["loader_ms_per_batch"]
    busy = [f"{m} run {runs[m]['other_cpu_s']:.1f} CPU seconds" for m in MODES
            if (runs[m]["other_cpu_s"] or 0) > OTHER_WORK_FRACTION * runs[m]["cpu_s"]]
    notes = [f"Other processes kept this machine busy ({', '.join(busy)}, against "
             f"{b['cpu_s']:.1f} and {s['cpu_s']:.1f} of the runs' own): the runs did not "
             "get the same machine, so the ratios above are skewed. Run the demo again on a "
             "quiet machine."] if busy else []
    for text in (
            f"Sharing one loader trained the {jobs} jobs {speedup:.2f}x as fast in all and "
            f"{cpu}.",
            f"With L = {1e3 * costs['loader_s']:.0f} ms of loading and T = "
            f"{1e3 * costs['train_s']:.0f} ms of training per batch, measured alone before "
            f"the runs (one thread each), the model in examples/_demo_report.py predicts "
            f"{ratio:.2f}x on these {cores} cores"
            + (" (N(L+T)/(L+NT): every core busy in both runs)" if cores_bound else
               " (limited by the loaders' workers, not the cores)")
            + f". In the runs, the loader workers spent {_ms(lb)} per batch in the "
            f"baseline and {_ms(ls)} in the shared run.", *notes):
        print("\n" + textwrap.fill(text, 96, initial_indent="  ", subsequent_indent="  "),
              file=out, flush=True)


def plot(runs: dict[str, dict], ideal: float, path: str) -> None:
    """Two bar charts, samples/s and CPU seconds, baseline against shared, into `path`;
    `ideal`: the model's prediction, drawn as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [TITLES[m] for m in MODES]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    rates = [runs[m]["samples_per_s"] for m in MODES]
    left.bar(labels, rates, color=["#999999", "#2a7ab9"])
    left.axhline(rates[0] * ideal, color="#2a7ab9", linestyle="--", linewidth=1,
                 label=f"model's prediction ({ideal:.2f}x)")
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
