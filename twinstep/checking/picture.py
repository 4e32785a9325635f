"""Reports as pictures (docs/tie.md#the-picture). A tie's (``twinstep tie --plot``,
``twinstep plot REPORT.json``): every parameter's relative error and its bound along the
network's depth on a log scale, the BN sites and the loss marked, the verdict in the title. A
whole-step tie's (``--recipe`` / ``--render``): every state tensor's error over its bound at
each step, by part of the state. The certification's (``twinstep certify --plot``): every
check's error as a multiple of its bound, the negative controls beside them.
"""

from __future__ import annotations

import textwrap

from twinstep.processes import disk

FLOOR = 1e-18  # where an error of exactly 0 is drawn (log scale)


def is_tie_report(report) -> bool:
    """Whether ``report`` (a JSON object) is a one-step tie's (`twinstep tie NET --json`)."""
    return isinstance(report, dict) and {"parameters", "bn_sites", "loss",
                                         "verdict"} <= set(report)


def is_steps_report(report) -> bool:
    """Whether ``report`` is a whole-step tie's (`twinstep tie --recipe | --render --json`)."""
    return isinstance(report, dict) and {"steps", "config", "verdict"} <= set(report)


def is_certification_report(report) -> bool:
    """Whether ``report`` is the certification's (`twinstep certify --json`)."""
    return isinstance(report, dict) and {"checks", "controls", "ok"} <= set(report)


def draw_tie(report: dict, out: str) -> str:
    """Draw the tie ``report`` (`TieReport.to_json`) into the PNG ``out``, written whole or not
    at all; returns its path. Parameters in the net's order (the order of its state dict: input
    to classifier); a BN site is drawn at its first parameter's place."""
    fig = disk.png_figure(out, "--plot", (12, 4.6))
    ax = fig.subplots()
    params = report["parameters"]
    place = {p["name"]: i for i, p in enumerate(params)}
    fig.subplots_adjust(left=0.07, right=0.99, bottom=0.11, top=0.84)
    ax.set_yscale("log")
    x = range(len(params))
    ax.step(x, [max(p["bound"], FLOOR) for p in params], where="mid", color="0.45", lw=1,
            label="bound")
    for ok, colour, label in ((True, "tab:green", "within its bound"),
                              (False, "tab:red", "over its bound")):
        xs = [i for i, p in enumerate(params) if p["ok"] == ok]
        ax.scatter(xs, [max(params[i]["rel_err"], FLOOR) for i in xs], s=9, color=colour,
                   label=f"parameter {label} ({len(xs)})", zorder=3)
    sites = [(place.get(b["name"] + ".weight", place.get(b["name"], None)), b)
             for b in report["bn_sites"]]
    sites = [(i, b) for i, b in sites if i is not None]
    ax.scatter([i for i, _ in sites], [max(b["mean_rel_err"], b["var_rel_err"], FLOOR)
                                       for _, b in sites], marker="v", s=22, facecolor="none",
               edgecolor=["tab:blue" if b["ok"] else "tab:red" for _, b in sites],
               label=f"BN site: batch mean / var ({len(sites)})", zorder=4)
    loss = report["loss"]
    ax.scatter([len(params)], [max(loss["rel_err"], FLOOR)], marker="*", s=90,
               color="tab:green" if loss["ok"] else "tab:red", label="loss", zorder=5)
    ax.hlines(loss["bound"], len(params) - 0.5, len(params) + 0.5, color="0.45", lw=1)
    ax.axhline(FLOOR, ls=":", color="0.6", lw=0.8)
    ax.text(0, FLOOR * 1.6, "exactly 0", fontsize=7, color="0.4")
    ax.set_xlim(-1, len(params) + 1)
    ax.set_xlabel("parameter, input to classifier (the state dict's order)")
    ax.set_ylabel("relative error (replicas vs one device)")
    ax.grid(alpha=0.3, which="major")
    ax.legend(fontsize=8, loc="lower right", ncol=2, framealpha=0.9)
    c = report["config"]
    verdict = report["verdict"]
    fig.suptitle(f"{c['net']}: R = {c['replicas']} x N = {c['batch']} vs one device at R N = "
                 f"{c['replicas'] * c['batch']}, {c['res']}², {c['precision']}, "
                 f"control {c['control']}\n" + textwrap.fill(verdict, 150, max_lines=2),
                 fontsize=10,
                 color="tab:green" if report["ok"] else "tab:red")
    return disk.publish_png(fig, out)


def draw_steps(report: dict, out: str) -> str:
    """Draw the whole-step tie ``report`` (`trajectory.StepsReport.to_json`) into the PNG
    ``out``: at each step every state tensor's error over its bound (at most 1 to hold), side
    by side by part of the state (params, buffers, each optimizer state, EMA, ...), and the
    loss's; returns its path."""
    fig = disk.png_figure(out, "--plot", (12, 4.6))
    ax = fig.subplots()
    fig.subplots_adjust(left=0.07, right=0.99, bottom=0.11, top=0.84)
    ax.set_yscale("log")
    parts = list(dict.fromkeys(r["name"].rsplit("/", 1)[0] for s in report["steps"]
                               for r in s["rows"]))
    width, top = 0.8 / (len(parts) + 1), 10.0  # a step's parts side by side, the loss last
    for k, part in enumerate([*parts, "loss"]):
        xs, ys, bad = [], [], []
        for s in report["steps"]:
            rows = [s["loss"]] if part == "loss" else [
                r for r in s["rows"] if r["name"].rsplit("/", 1)[0] == part]
            xs += [s["step"] - 0.4 + (k + 0.5) * width] * len(rows)
            ys += [max(r["rel_err"] / r["bound"], FLOOR) if r["bound"] else FLOOR for r in rows]
            bad += [not r["ok"] for r in rows]
        top = max(top, 3 * max(ys))
        ax.scatter(xs, ys, s=40 if part == "loss" else 7, marker="*" if part == "loss" else "o",
                   color=f"C{k}", edgecolor=["tab:red" if b else "none" for b in bad],
                   label=f"{part} ({len(ys) // len(report['steps'])})", zorder=3)
    ax.axhline(1.0, color="0.45", lw=1, label="the bound")
    ax.axhline(FLOOR, ls=":", color="0.6", lw=0.8)
    ax.set_ylim(FLOOR / 3, top)
    ax.set_xticks([s["step"] for s in report["steps"]])
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("error / bound (replicas vs one device)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="lower left", ncol=4, framealpha=0.9)
    c = report["config"]
    what = report.get("render") or c["recipe"]
    fig.suptitle(f"{what}: R = {c['replicas']} x N = {c['batch']} vs one device, "
                 f"{len(report['steps'])} whole steps, {c['res']}², {c['precision']}, control "
                 f"{c['control']}\n" + textwrap.fill(report["verdict"], 150, max_lines=2),
                 fontsize=10, color="tab:green" if report["ok"] else "tab:red")
    return disk.publish_png(fig, out)


def draw(report: dict, out: str) -> str:
    """Draw whichever report ``report`` is (a tie's, a whole-step tie's, the
    certification's); ValueError if none."""
    for is_kind, drawer in ((is_tie_report, draw_tie), (is_steps_report, draw_steps),
                            (is_certification_report, draw_certification)):
        if is_kind(report):
            return drawer(report, out)
    raise ValueError("neither a tie's, a whole-step tie's nor a certification's report")


def draw_certification(report: dict, out: str) -> str:
    """Draw the certification ``report`` (`certification.Report.to_json`) into the PNG ``out``:
    each check's error over its bound (at most 1 to hold), grouped by op and check, and each
    negative control's (above 1 to be caught); returns its path."""
    fig = disk.png_figure(out, "--plot", (12, 4.6))
    ax = fig.subplots()
    fig.subplots_adjust(left=0.07, right=0.99, bottom=0.11, top=0.88)
    ax.set_yscale("log")
    kinds = sorted({c["check"] for c in report["checks"]})
    for k, kind in enumerate(kinds):
        rows = [(i, c) for i, c in enumerate(report["checks"]) if c["check"] == kind]
        ax.scatter([i for i, _ in rows], [max(c["err"] / c["tol"], FLOOR) for _, c in rows],
                   s=9, color=f"C{k}", label=f"{kind} ({len(rows)})", zorder=3)
    start = len(report["checks"]) + 3
    controls = report["controls"]
    ax.scatter(range(start, start + len(controls)),
               [max(c["err"] / c["tol"], FLOOR) for c in controls], marker="x", s=30,
               color=["tab:red" if c["caught"] else "black" for c in controls],
               label=f"negative control, must be above 1 ({len(controls)})", zorder=4)
    ax.axhline(1.0, color="0.45", lw=1, label="the bound")
    ax.axvline(start - 1.5, color="0.7", lw=0.8, ls=":")
    ax.set_xlabel("check (grouped by op, then the controls)")
    ax.set_ylabel("error / bound")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left", ncol=3, framealpha=0.9)
    held = sum(c["ok"] for c in report["checks"])
    caught = sum(c["caught"] for c in controls)
    fig.suptitle(f"op library certification (float64): {held}/{len(report['checks'])} checks "
                 f"hold, {caught}/{len(controls)} controls caught", fontsize=10,
                 color="tab:green" if report["ok"] else "tab:red")
    return disk.publish_png(fig, out)
