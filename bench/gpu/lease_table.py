"""The lease's summary (bench/gpu/lease.py): each part's JSON read back into one table, the A/B's
candidates judged by the adoption rule, and the lease's exit status.

The adoption rule (bench/README.md). A candidate wins when the median of its paired speedups
over the A/B's interleaved rounds (the default's step time over its own, round by round) is at
least `WIN` and their lower quartile is above 1; it loses when their median and upper quartile
are both below 1. A winner whose bf16 tie holds is adopted into the GPU's defaults ("adopt"); a
loser leaves the product with its tie sweep ("remove"); anything else, a winner whose tie has
not run included, is "inconclusive" and stays a candidate. A lever's tie is its bf16 sweep
(``python bench/bf16_sweep.py --gpu-levers --NAME VALUE``), read from its section of
bench/RESULTS.md ("N of N ties run hold; M of M controls fail"); an XLA option's, `XLA_TIES`.
"""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path

from bench.common import RESULTS
from bench.gpu.kernel_profile import LEVERS
from twinstep.ops.levers import Levers

WIN = 1.01  # the least median speedup a candidate is adopted for
# what holds an XLA option's bf16 tie, and whether it holds (None: nothing checks it yet). An
# option changes how XLA:GPU runs the same HLO, which no CPU sweep can run.
XLA_TIES = {
    "xla_gpu_enable_command_buffer=+CONVOLUTION":
        ("none needed: the same kernels, launched from a CUDA graph", True),
    "xla_gpu_experimental_enable_conv_fusion=true":
        ("none yet: bench/gpu/bf16_hlo.py does not read cuDNN's fused convolutions", None),
}
GOALS = {"train_vs_bare": 0.95, "data_vs_bare": 1.3}  # issue 69's, of the device path


def section(text: str, heading: str) -> str | None:
    """The body of ``## heading`` in a Markdown text, None when it has none."""
    m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    return m[1] if m else None


def tie(name: str, results: str) -> tuple[str, bool | None]:
    """(what holds candidate ``name``'s bf16 tie and how it stands, whether it holds: None
    when it has not run or nothing checks it)."""
    if name in XLA_TIES:
        return XLA_TIES[name]
    given = LEVERS[name][0]
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in given.items())
    command = f"python bench/bf16_sweep.py --gpu-levers {flags}"
    body = section(results, "bf16 tie sweep, " + Levers.chosen(gpu=True, **given).describe())
    m = body and re.search(r"(\d+) of (\d+) ties run hold( \(\d+ not run\))?; (\d+) of (\d+)"
                           r"\s+controls fail", body)
    if not m:
        return f"`{command}`: not run", None
    holds = m[1] == m[2] != "0" and not m[3] and m[4] == m[5] != "0"
    return f"`{command}`: {'holds' if holds else 'fails'}", holds


def verdict(paired, holds: bool | None) -> str:
    """The adoption rule on (median, lower, upper quartile) of the paired speedups and whether
    the candidate's tie holds: "adopt", "remove" or "inconclusive: why"."""
    median, q1, q3 = paired
    if median < 1 and q3 < 1:
        return "remove"
    if median >= WIN and q1 > 1:
        return "adopt" if holds else ("inconclusive: it wins; its tie "
                                      + ("fails" if holds is False else "has not run"))
    return "inconclusive: " + ("under 1 %" if 1 <= median < WIN else "the rounds disagree")


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _met(value: float, goal: float) -> str:
    return f"goal ≥ {goal:g}: {'met' if value >= goal else 'not met'}"


def feed_row(d: dict, twin: bool) -> tuple[list, list]:
    """([result, verdict], failed checks) of the feed's JSON. The twin decodes both ways on
    the CPU: a batch that differs from one at a time there is a broken decoder (a failed
    check)."""
    got, checks = [], []
    if "decode_cpu_core" in d:
        batch = d.get("decode_gpu", d.get("decode_batch_cpu_core", 0))
        diff = d["batch_vs_libjpeg"]
        got.append(f"decode {'nvJPEG' if 'decode_gpu' in d else 'batch, CPU'} {batch:,.0f} "
                   f"img/s, libjpeg-turbo {d['decode_cpu_core']:,.0f} on a core; Δ max "
                   f"{diff['max']}, mean {diff['mean']:.2f} levels")
        if twin and diff["max"]:
            checks.append(f"feed: the batch decode differs from one at a time by {diff['max']} "
                          f"levels on the CPU")
    if "host" in d:
        got.append(f"host {d['host']:,.0f} img/s on {d['workers']} loader "
                   f"process{'es' * (d['workers'] != 1)} (packed "
                   f"{d.get('host packed', 0):,.0f}, Pillow {d.get('pillow', 0):,.0f})")
    verdict_ = ""
    if "devices" in d:
        got.append(f"GPU share {d['devices']:,.0f} img/s")
        fed = min(d["host"], d["devices"])
        verdict_ = (f"feeds {fed:,.0f} img/s, "
                    f"{'host' if d['host'] <= d['devices'] else 'GPU'}-bound")
    if checks:
        verdict_ = "CHECK FAILED: " + checks[0]
    return ["; ".join(got) or "nothing written", verdict_], checks


def train_row(d: dict) -> list:
    """[result, verdict] of the train part's JSON: the device path's ratios to the goals."""
    bare = next(iter(d.get("bare", {}).values()), None)
    got = [f"bare step {bare['img_per_s']:,.0f} img/s"] if bare else []
    said = []
    for r in d.get("runs", []):
        got.append(f"{r['path']}: train {r['train_img_per_s']:,.0f}, loader alone "
                   f"{r['data_img_per_s']:,.0f}")
        if r["path"] == "device" and "train_vs_bare" in r:
            said += [f"train/bare {r['train_vs_bare']:.2f} "
                     f"({_met(r['train_vs_bare'], GOALS['train_vs_bare'])})",
                     f"device feed/step {r['data_vs_bare']:.2f}× "
                     f"({_met(r['data_vs_bare'], GOALS['data_vs_bare'])})"]
    return ["; ".join(got) or "nothing written", "; ".join(said)]


def ab_rows(d: dict, names, results: str, twin: bool) -> tuple[list, list, dict]:
    """([result, verdict], its candidates' rows, {candidate: its A/B with "tie" and "verdict"})
    of the A/B's profile JSON."""
    rows, judged = [], {}
    for name in names:
        r = dict(d.get("ab", {}).get(name) or {})
        said, holds = tie(name, results)
        if "paired" in r:
            m, q1, q3 = r["paired"]
            result = f"{m:.3f} [{q1:.3f}, {q3:.3f}] over {r['rounds']} rounds"
            r["verdict"] = verdict(r["paired"], holds)
        else:
            result = (f"refused by this XLA: {r['refused']}" if "refused" in r else
                      f"failed: {r['error'][:200]}" if "error" in r else "not reached")
            r["verdict"] = "inconclusive: not timed"
        r["tie"] = said
        judged[name] = r
        rows.append([f"ab: {name}", f"speedup; tie: {said}", result,
                     r["verdict"] + " (the CPU twin's times: no verdict)" * twin])
    own = [f"default {d['img_per_s']:,.0f} img/s, {d['step_ms']:.1f} ms/step, batch "
           f"{d['batch']} at {d['res']}²", ""]
    return own, rows, judged


def nets_rows(d: dict, asked) -> tuple[list, list]:
    """([result, verdict], a row per net) of the nets part's JSON; the nets not measured in
    one row."""
    done = d.get("rows", [])
    rows = [[f"nets: {r['net']}", f"step at {r['res']}², batch {r['batch']}",
             f"{r['img_per_s']:,.0f} img/s, {r['step_ms']:.1f} ms/step",
             _met(r["img_per_s"], r["goal_img_per_s"]) if r.get("goal_img_per_s") else ""]
            for r in done]
    missing = [n for n in asked if n not in {r["net"] for r in done}]
    if missing:
        rows.append(["nets: not measured", "", ", ".join(missing), ""])
    return [f"{len(done)} of {len(asked)} nets", ""], rows


MEASURES = {"feed": "nvJPEG against libjpeg-turbo; the device loader's host and GPU img/s",
            "train": "`twinstep train`, device and Pillow loaders, against the bare step",
            "ab": "the step, then each candidate against it, interleaved: its speedup's "
                  "median [quartiles] over the rounds",
            "nets": "each net's step"}


def summarise(parts: list, files: dict, *, twin: bool, deadline: int, device_path: bool,
              candidates, nets, results_path: Path = RESULTS) -> dict:
    """The lease's summary: ``parts`` (lease.schedule's rows) with each part's JSON (``files``:
    {part: path}) read back into table rows, the A/B's ``candidates`` judged, the nets part's
    ``nets`` each measured or listed as not, and the exit status."""
    results = results_path.read_text() if results_path.exists() else ""
    table, checks, judged, incomplete, failed, device = [], [], {}, [], [], None
    for p in parts:
        data = _load(files[p["part"]]) if p["part"] in files else None
        device = device or (data or {}).get("device")
        if p["status"] == "ran" and data is None:
            p["status"] = "failed: wrote no JSON"
        own, rows = ["", ""], []
        if data is not None:
            if p["part"] == "feed":
                own, checks = feed_row(data, twin)
            elif p["part"] == "train":
                own = train_row(data)
            elif p["part"] == "ab":
                own, rows, judged = ab_rows(data, candidates, results, twin)
            else:
                own, rows = nets_rows(data, nets)
        if p["part"] == "train" and not device_path:
            incomplete.append("train: no device path (nvImageCodec does not import)")
            own[1] = "; ".join(filter(None, [own[1], "no device path: nvImageCodec does not "
                                             "import"]))
        table.append([p["part"], MEASURES[p["part"]], *own, f"{p['wall_s']:.0f}", p["status"]])
        table += [[*r, "", ""] for r in rows]
        if p["status"].startswith("failed"):
            failed.append(p["part"])
        elif p["status"] != "ran":
            incomplete.append(f"{p['part']}: {p['status']}")
    code = 3 if failed else 1 if checks else 4 if incomplete else 0
    card = (re.search(r"\b([A-Z]+\d+\w*)", device or "") or [None, device or "unknown"])[1]
    return {"twin": twin, "device": device, "deadline_s": deadline,
            "wall_s": round(sum(p["wall_s"] for p in parts), 1), "parts": parts,
            "files": {k: str(v) for k, v in files.items()},
            "candidates": judged, "checks_failed": checks, "incomplete": incomplete,
            "exit": code, "table": table,
            "lease_dir": f"bench/leases/{datetime.date.today()}-{card.lower()}/"}


EXITS = {0: "every part ran", 1: "a check failed", 3: "a part failed",
         4: "a part was cut or skipped"}


def render(s: dict) -> str:
    """The summary as one line and its Markdown table: what the lease prints last."""
    head = (f"lease{' (CPU twin)' * s['twin']} on {s['device'] or 'an unknown device'}: "
            f"parts {s['wall_s']:.0f} s of the {s['deadline_s']} s deadline; exit "
            f"{s['exit']}, {EXITS[s['exit']]}. Commit its files as {s['lease_dir']}")
    lines = ["| part | measures | result | verdict | wall s | status |",
             "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in s["table"]]
    return head + "\n\n" + "\n".join(lines)
