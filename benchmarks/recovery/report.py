"""The recovery benchmark's results as markdown: one table per arm, one line of totals."""

from __future__ import annotations


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _n(v: int | None) -> str:
    return "-" if v is None else str(v)


def arm_table(arm: dict) -> str:
    g = arm["goodput"]
    bit = arm.get("bitwise", {})
    lines = [
        f"### {arm['arm']} (restart: {arm['restart']}, {arm['launches']} launches)",
        "",
        f"Goodput **{g['goodput']:.1%}**: {g['useful_s']:.0f} s of unique steps in "
        f"{g['wall_s']:.0f} s wall; {g['unique_steps']} unique steps, {g['steps_redone']} "
        f"redone; final step {arm['final_step']}; final weights bitwise equal to an "
        f"uninterrupted run: **{bit.get('equal')}**"
        + (f" (differ: {', '.join(bit['differing'])})" if bit.get("differing") else "")
        + (f" ({bit['error']})" if bit.get("error") else ""),
        "",
        "| at (s) | fault | detect | exit | restart | resumed | training | "
        "last step | resumed from | redone |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in arm["recoveries"]:
        lines.append(
            f"| {r['injected_s']:.0f} | {r['kind']} | {_s(r['detect_s'])} | {_s(r['exit_s'])} "
            f"| {_s(r['restart_s'])} | {_s(r['resumed_s'])} | **{_s(r['training_s'])}** "
            f"| {r['last_step_before']} | {_n(r['resumed_step'])} | **{_n(r['steps_redone'])}** |"
        )
    lines += [f"- {note}" for note in arm["notes"]]
    return "\n".join(lines) + "\n"


def markdown(results: dict) -> str:
    s = results["settings"]
    head = (
        f"## Recovery under faults ({results['date']}, torch {results['torch']}, "
        f"{results['host_cpus']} CPUs)\n\n"
        f"{s['ranks']} ranks on {s['nodes']} simulated nodes (gloo, CPU), "
        f"{s['minutes']:g} min an arm, a fault every {s['fault_every_s']:g} s "
        f"({', '.join(s['faults'])} in turn), steps paced to {s['step_s']} s, "
        f"plain checkpoint every {s['plain_ckpt_every_s']:g} s, guardrails "
        f"`checkpoint={{'every_s': {s['guard_ckpt_every_s']:g}}}`, process-group and watchdog "
        f"timeout {s['hang_timeout_s']:g} s. Seconds are from the fault's injection.\n\n"
    )
    return head + "\n".join(arm_table(arm) for arm in results["arms"])
