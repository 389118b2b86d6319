"""The figures of bench.schedules: medians and ratios, parity, memory bounds, and the printed table.

Targets are measured and reported, never asserted: each schedule <= 1.0x its torch
counterpart; the best pp = 2 step <= 0.85x `ScheduleGPipe` and <= 0.56x one process;
1F1B's saved activations per rank <= pp / m of AFAB's plus the parameters.
"""

from __future__ import annotations

import math

from bench import common, pp

SIDES = ("rewrite", "torch")
MEMORY_KEYS = ("saved_peak_bytes", "allocated_peak_bytes", "param_bytes", "kept_between_steps_bytes")
TARGET_VS_GPIPE, TARGET_VS_ONE_PROCESS = 0.85, 0.56


def _placement(name: str, world: int) -> str:
    k = pp.VIRTUAL_STAGES.get(name, 1)
    if k == 1:
        return "1 per rank"
    held = [pp.held_stages(name, r, world) for r in range(world)]
    return f"{k} per rank, " + ("V" if name == "zbv" else "looped") + ": " + ", ".join(
        f"r{r}: {'+'.join(map(str, h))}" for r, h in enumerate(held))


def summarize(runs: list[dict], one_process_s: float, pp_size: int = 2) -> dict:
    """Medians over steps of the slowest rank, ratios, parity and the memory targets."""
    m = common.MICROBATCHES
    keys = list(runs[0]["times"])
    steps = len(runs[0]["times"][keys[0]])
    # A step ends when its slowest rank ends.
    per_step = {key: [max(r["times"][key][i] for r in runs) for i in range(steps)] for key in keys}
    gpipe_s = common.median(per_step["torch afab"]) if "torch afab" in per_step else None
    out: dict = {"pp": pp_size, "microbatches": m, "one_process_median_s": one_process_s,
                 "gpipe_median_s": gpipe_s, "raw": runs}
    names = [n for n in pp.TORCH_SCHEDULES if any(k.split(" ", 1)[1] == n for k in keys)]
    for name in names:
        entry: dict = {"torch_schedule": pp.TORCH_SCHEDULES[name], "stages": _placement(name, pp_size)}
        for impl in SIDES:
            key = f"{impl} {name}"
            if key not in per_step:
                continue
            med = common.median(per_step[key])
            losses = [r["parity"][key]["loss"] for r in runs if r["parity"][key]["loss"] is not None]
            entry[impl] = {
                "median_s": med, "min_s": min(per_step[key]), "max_s": max(per_step[key]),
                "vs_one_process": med / one_process_s,
                "vs_gpipe": med / gpipe_s if gpipe_s else None,
                "loss": losses[0] if losses else None,
                "grad_norm": math.sqrt(sum(r["parity"][key]["grad_sq"] for r in runs)),
                **{what: [r["memory"][key][what] for r in runs] for what in MEMORY_KEYS},
            }
        if "rewrite" in entry and "torch" in entry:
            ours, ref = entry["rewrite"], entry["torch"]
            entry["ratio_rewrite_torch"] = ours["median_s"] / ref["median_s"]
            paired = [a / b for a, b in zip(per_step[f"rewrite {name}"], per_step[f"torch {name}"])]
            entry["ratio_per_step_min_max"] = [min(paired), max(paired)]
            entry["parity"] = {
                "loss_equal": ours["loss"] == ref["loss"],
                "loss_abs_diff": abs(ours["loss"] - ref["loss"]),
                "grad_norm_rel_diff": abs(ours["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"],
            }
        out[name] = entry
    _memory_bounds(out, names, pp_size, m)
    out["targets"] = _targets(out, names)
    return out


def _memory_bounds(out: dict, names: list[str], pp_size: int, m: int) -> None:
    """Per rank, against pp/m x AFAB's peak + the parameters: the 1F1B target, and for information the others."""
    for name in names:
        if name == "afab":
            continue
        for impl in SIDES:
            if impl not in out[name] or impl not in out.get("afab", {}):
                continue
            afab, entry = out["afab"][impl], out[name][impl]
            for what in ("saved", "allocated"):
                peak, base = entry[f"{what}_peak_bytes"], afab[f"{what}_peak_bytes"]
                bound = [pp_size / m * a + p for a, p in zip(base, entry["param_bytes"])]
                entry[f"{what}_bound_bytes"] = bound
                entry[f"{what}_vs_afab"] = [o / a for o, a in zip(peak, base)]
                entry[f"{what}_within_bound"] = [o <= b for o, b in zip(peak, bound)]
            entry["memory_target_met"] = all(entry["saved_within_bound"])


def _targets(out: dict, names: list[str]) -> dict:
    targets: dict = {"each_vs_counterpart": {
        n: out[n]["ratio_rewrite_torch"] for n in names if "ratio_rewrite_torch" in out[n]}}
    side = "rewrite" if any("rewrite" in out[n] for n in names) else "torch"
    timed = {n: out[n][side]["median_s"] for n in names if side in out[n]}
    if timed and out["gpipe_median_s"]:
        best = min(timed, key=timed.get)
        vs_gpipe = timed[best] / out["gpipe_median_s"]
        vs_one = timed[best] / out["one_process_median_s"]
        targets["best"] = {"side": side, "schedule": best, "median_s": timed[best],
                           "vs_gpipe": vs_gpipe, "vs_gpipe_met": vs_gpipe <= TARGET_VS_GPIPE,
                           "vs_one_process": vs_one, "vs_one_process_met": vs_one <= TARGET_VS_ONE_PROCESS}
    return targets


def _per_rank(values, scale: float = 2**20, fmt: str = "{:.1f}") -> str:
    return ", ".join(fmt.format(v / scale) for v in values)


def table(res: dict) -> str:
    """Markdown: one row per schedule and side, then the targets."""
    names = [n for n in pp.TORCH_SCHEDULES if n in res]
    lines = [
        "| schedule | stages | impl | step median (min-max) | / counterpart (per-step range) | / ScheduleGPipe "
        "| / one process | saved activations, peak MiB per rank | allocated in step, peak MiB per rank "
        "| kept between steps MiB | loss; parity with counterpart |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        e = res[name]
        for impl in SIDES:
            if impl not in e:
                continue
            r = e[impl]
            label = "rewrite" if impl == "rewrite" else f"torch `{e['torch_schedule']}`"
            ratio, parity = "", f"{r['loss']:.6f}"
            if impl == "rewrite" and "ratio_rewrite_torch" in e:
                lo, hi = e["ratio_per_step_min_max"]
                ratio = f"{e['ratio_rewrite_torch']:.2f} ({lo:.2f}-{hi:.2f})"
                par = e["parity"]
                parity += ("; loss equal" if par["loss_equal"] else f"; loss differs by {par['loss_abs_diff']:.1e}")
                parity += f", grad norm rel. diff {par['grad_norm_rel_diff']:.1e}"
            vs_gpipe = f"{r['vs_gpipe']:.2f}" if r["vs_gpipe"] is not None else ""
            lines.append(
                f"| {name} | {e['stages']} | {label} | {r['median_s']:.3f} s ({r['min_s']:.3f}-{r['max_s']:.3f}) "
                f"| {ratio} | {vs_gpipe} | {r['vs_one_process']:.2f} | {_per_rank(r['saved_peak_bytes'])} "
                f"| {_per_rank(r['allocated_peak_bytes'])} | {_per_rank(r['kept_between_steps_bytes'])} | {parity} |"
            )
    lines += ["", f"one process, 1 thread: {res['one_process_median_s']:.3f} s"]
    if res.get("gpipe_median_s"):
        lines.append(f"ScheduleGPipe: {res['gpipe_median_s']:.3f} s")
    t = res["targets"]
    for name, ratio in t["each_vs_counterpart"].items():
        lines.append(f"target {name} <= 1.0x {res[name]['torch_schedule']}: {ratio:.2f} "
                     f"({'met' if ratio <= 1.0 else 'not met'})")
    if "best" in t:
        b = t["best"]
        lines.append(
            f"target best pp={res['pp']} step ({b['side']} {b['schedule']}, {b['median_s']:.3f} s): "
            f"{b['vs_gpipe']:.2f}x ScheduleGPipe (<= {TARGET_VS_GPIPE}: {'met' if b['vs_gpipe_met'] else 'not met'}), "
            f"{b['vs_one_process']:.2f}x one process (<= {TARGET_VS_ONE_PROCESS}: "
            f"{'met' if b['vs_one_process_met'] else 'not met'})")
    m = res["microbatches"]
    lines.append(f"memory per rank against {res['pp']}/{m} x AFAB's + parameter bytes "
                 f"(the target is 1f1b's saved activations; the others for information)")
    for name in names:
        for impl in SIDES:
            o = res[name].get(impl, {})
            for what in ("saved", "allocated") if "saved_bound_bytes" in o else ():
                lines.append(
                    f"  {name}, {impl}, {what}: {_per_rank(o[f'{what}_peak_bytes'])} MiB, bound "
                    f"{_per_rank(o[f'{what}_bound_bytes'])} MiB: "
                    f"{', '.join('within' if ok else 'OVER' for ok in o[f'{what}_within_bound'])}; "
                    f"/ afab {_per_rank(o[f'{what}_vs_afab'], 1, '{:.3f}')} (pp/m = {res['pp'] / m:.3f})"
                )
    return "\n".join(lines)
