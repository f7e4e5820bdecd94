"""collocated.py's summary of its runs: whether the shared and original consumers trained
on the independent jobs' images, the medians per (mode, N) and their ratios to
independent, and the table printed on stdout."""

from __future__ import annotations

from bench_common import log, median

OTHER_LOAD_WARN = 0.2  # cores busy outside the run (other work on the machine): flagged


def compare_data(runs: list[dict]) -> None:
    """data_matches_independent: whether every consumer of a run trained on exactly the
    images (bit for bit, in the same order) that the independent run of the same repeat
    and N trained on (the augmentation is deterministic per sample and epoch)."""
    for r in runs:
        base = next((b for b in runs if b["mode"] == "independent" and b["ok"]
                     and b["repeat"] == r["repeat"] and b["consumers"] == r["consumers"]),
                    None)
        if r["mode"] == "independent":
            r["data_matches_independent"] = (len(r.get("data_checksums") or []) == 1
                                             if r["ok"] else None)
        elif base is None or not r.get("data_checksums") or not r["ok"]:
            r["data_matches_independent"] = None
        else:
            r["data_matches_independent"] = r["data_checksums"] == base["data_checksums"]
        if r["data_matches_independent"] is False:
            r["ok"] = False
            r["check_failed"] = True
            r["error"] = ("data check failed: the consumers' images differ from those of "
                          "the independent run (data_checksums)")
            log(f"{r['mode']} N={r['consumers']} repeat {r['repeat'] + 1}: {r['error']}")




METRICS = ("aggregate_samples_per_s", "cpu_s_per_sample", "cpu_s_per_sample_total",
           "peak_rss_total_mb", "rss_per_consumer_mb", "peak_pss_total_mb", "shm_peak_mb",
           "run_cores", "other_load_cores")


def summarize(runs: list[dict], modes: list[str], counts: list[int]) -> list[dict]:
    out = []
    for n in counts:
        for mode in modes:
            rs = [r for r in runs if r["mode"] == mode and r["consumers"] == n]
            ok = [r for r in rs if r["ok"]]
            flagged = [r for r in rs if r.get("check_failed")
                       and r.get("aggregate_samples_per_s") is not None]
            use, status = (ok, "ok") if ok else ((flagged, "check_failed") if flagged
                                                 else ([], "error"))
            s = {"mode": mode, "consumers": n, "runs": len(rs), "ok_runs": len(ok),
                 "status": status,
                 "errors": sorted({r["error"] for r in rs if r["error"]})}
            for m in METRICS:
                s[m] = median([r.get(m) for r in use])
            windows = {r.get("cpu_window") for r in use} - {None}
            s["cpu_window"] = (windows.pop() if len(windows) == 1
                               else ("mixed" if windows else None))
            out.append(s)
    for s in out:
        base = next((b for b in out if b["mode"] == "independent"
                     and b["consumers"] == s["consumers"] and b["status"] == "ok"), None)

        def ratio(key: str, s=s, base=base):
            if base is None or s[key] is None or not base[key]:
                return None
            return s[key] / base[key]

        s["vs_independent"] = {"samples_per_s": ratio("aggregate_samples_per_s"),
                               "cpu_s_per_sample": ratio("cpu_s_per_sample"),
                               "peak_rss_total": ratio("peak_rss_total_mb")}
    return out


def fmt_spec(x, spec: str) -> str:
    if x is not None:
        return format(x, spec)
    width = spec.split(".")[0]
    return "-".rjust(int(width) if width.isdigit() else 1)


def print_table(summary: list[dict], repeats: int) -> None:
    print()
    print(f"medians over {repeats} repeat(s); 'vs ind' = this mode / independent at the same N")
    hdr = (f"{'mode':<12}{'N':>2} {'ok':>5} {'samples/s':>10} {'vs ind':>7} "
           f"{'CPU ms/smp':>10} {'vs ind':>7} {'total':>6} {'RSS MB':>8} {'RSS/job':>8} "
           f"{'PSS MB':>7} {'shm MB':>7}  status")
    print(hdr)
    print("-" * len(hdr))
    notes = []
    for s in summary:
        v = s["vs_independent"]
        cpu = s["cpu_s_per_sample"]
        cpu_tot = s["cpu_s_per_sample_total"]
        rss_job = (s["peak_rss_total_mb"] / s["consumers"]
                   if s["peak_rss_total_mb"] is not None else None)
        status = s["status"]
        if status == "check_failed":
            status = "CHECK FAILED (numbers flagged)"
        elif status == "error":
            status = "ERROR"
        if s["errors"]:
            notes.append(f"{s['mode']} N={s['consumers']}: {s['errors'][0][:300]}")
        print(f"{s['mode']:<12}{s['consumers']:>2} {s['ok_runs']:>2}/{s['runs']:<2} "
              f"{fmt_spec(s['aggregate_samples_per_s'], '10.1f')} "
              f"{fmt_spec(v['samples_per_s'], '7.2f')} "
              f"{fmt_spec(cpu and cpu * 1e3, '10.2f')} {fmt_spec(v['cpu_s_per_sample'], '7.2f')} "
              f"{fmt_spec(cpu_tot and cpu_tot * 1e3, '6.2f')} "
              f"{fmt_spec(s['peak_rss_total_mb'], '8.0f')} {fmt_spec(rss_job, '8.0f')} "
              f"{fmt_spec(s['peak_pss_total_mb'], '7.0f')} {fmt_spec(s['shm_peak_mb'], '7.1f')}  "
              f"{status}")
    print("CPU ms/smp: CPU of all the run's processes per trained sample, steady state "
          "(common measured window); total: whole run incl. start-up.")
    print("RSS MB: sum of the processes' peak RSS; RSS/job: that / N; PSS MB: peak sum of "
          "PSS; shm MB: peak /dev/shm objects mapped.")
    whole = [f"{s['mode']} N={s['consumers']}" for s in summary
             if s.get("cpu_window") in ("whole-run", "mixed")]
    if whole:
        print("CPU ms/smp includes start-up (the consumers' measured windows overlapped too "
              "little) for: " + ", ".join(whole))
    busy = [s for s in summary if (s.get("other_load_cores") or 0) > OTHER_LOAD_WARN]
    if busy:
        print("WARNING: other work used the machine's CPUs during these (medians, cores): "
              + ", ".join(f"{s['mode']} N={s['consumers']} {s['other_load_cores']:.2f}"
                          for s in busy))
    if notes:
        print()
        print("errors / failed checks (first of each):")
        for line in notes:
            print(f"  {line}")
