"""`vla-rl report`: evaluation records (``eval.json``) side by side, per suite and per task, beside the
published LIBERO baselines with their protocols, and two records compared paired.

A record's tasks group into suites by their name (``libero_spatial/3`` is in ``libero_spatial``; a task
without a suite is its own). The paired comparison takes two records that ran the same episodes (the
same tasks and initial states, or the same seeds and worlds) and tests, per task and overall, whether
one succeeds where the other fails more often than chance allows: McNemar's exact test on the discordant
pairs, which is what comparing two checkpoints on one set of initial states calls for. Records of other
episodes are refused for pairing with one line.

Where one checkpoint was evaluated under several delays, a table of its success by delay; given
fine-tuning runs (``--learning_curves``), their held-out success against env steps.

Writes ``report.md``, ``report.json``, ``report.png`` (success per suite with 95% Wilson intervals, the
published figures of the same suites as markers) and ``learning_curves.png``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sim.libero_protocol import SUITES
from vla_core.files import write_text_atomic
from vla_rl.eval_record import rates, suite_of
from vla_rl.statistics import mcnemar_exact


@dataclass
class ReportConfig:
    """Evaluation records side by side, and two of them compared paired."""

    records: list[str] = field(default_factory=list)  # eval.json files (or the folders holding them)
    # finetune_summary.json files (or their run folders): success against env steps, one curve each
    learning_curves: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # a name per record (default: its folder's name)
    output_dir: str = "outputs/report"  # report.md, report.json, report.png go here
    # Compare the first two records paired (McNemar per task and overall): they must have run the same episodes.
    paired: bool = True


@dataclass(frozen=True)
class Published:
    """A published LIBERO result: success in % per suite, and the protocol it was measured under."""

    model: str
    protocol: str
    success: dict[str, float]


_SUITES = SUITES[:4]  # the published figures have no libero_90 column
PUBLISHED = tuple(
    Published(model, protocol, dict(zip(_SUITES, figures, strict=True)))
    for model, protocol, figures in (
        ("OpenVLA", "openpi", (84.7, 88.4, 79.2, 53.7)),
        ("Diffusion Policy (from scratch)", "openpi", (78.3, 92.5, 68.3, 50.5)),
        ("pi0-FAST", "openpi", (96.4, 96.8, 88.6, 60.2)),
        ("OpenVLA-OFT", "openpi", (97.6, 98.4, 97.9, 94.5)),
        ("pi0.5 (openpi)", "openpi", (98.8, 98.2, 98.0, 92.4)),
        ("pi0.5 + PPO (RLinf)", "rlinf", (99.6, 100.0, 98.8, 93.0)),
        ("pi0 + PPO (RLinf)", "rlinf", (98.4, 99.4, 96.2, 90.2)),
        ("OpenVLA-OFT + GRPO (SimpleVLA-RL)", "simplevla", (99.4, 99.1, 99.2, 98.5)),
    )
)  # the baseline table of the project's anchors; openpi's protocol is also OpenVLA's and OpenVLA-OFT's


def load_record(path: str) -> dict[str, Any]:
    """An eval.json (or the folder holding one); one line naming the fix when it is not one."""
    file = Path(path) / "eval.json" if Path(path).is_dir() else Path(path)
    try:
        record = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable evaluation record (eval.json): {err}") from None
    if "per_episode" not in record or any("task" not in e for e in record["per_episode"]):
        raise ValueError(
            f"{path}: an evaluation record without per-episode tasks (an older vla-rl eval); evaluate again"
        )
    return record


def episode_key(e: dict[str, Any]) -> tuple:
    """What identifies an episode across two runs of one plan: its task and initial state (a protocol run), and its
    draw (``--draws_per_state``), or its task, seed and world."""
    if "initial_state" in e:
        return (e["task"], e["initial_state"]) + ((e["draw"],) if "draw" in e else ())
    return e["task"], e.get("seed"), e["world"]


def paired(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """McNemar's exact test per task and overall on two records of the same episodes."""
    a = {episode_key(e): e["success"] for e in first["per_episode"]}
    b = {episode_key(e): e["success"] for e in second["per_episode"]}
    if a.keys() != b.keys():
        raise ValueError(
            f"the two records ran different episodes ({len(a.keys() - b.keys())} only in the first, "
            f"{len(b.keys() - a.keys())} only in the second): evaluate both with the same task, seed, protocol and "
            "episodes (--rerun=<the first's eval.json> with the other checkpoint), or pass --paired=false"
        )
    tasks = sorted({k[0] for k in a})
    out = {}
    for name, keys in [*[(t, [k for k in a if k[0] == t]) for t in tasks], ("overall", list(a))]:
        only_first = sum(a[k] and not b[k] for k in keys)
        only_second = sum(b[k] and not a[k] for k in keys)
        out[name] = {"pairs": len(keys), "only_first": only_first, "only_second": only_second,
                     "first_rate": sum(a[k] for k in keys) / len(keys), "second_rate": sum(b[k] for k in keys) / len(keys),
                     "p_value": mcnemar_exact(only_first, only_second)}  # fmt: skip
    return out


def report(cfg: ReportConfig) -> dict[str, Any]:
    """Build the report (see the module doc); returns what report.json holds."""
    if not cfg.records and not cfg.learning_curves:
        raise ValueError("--records is empty: name eval.json files, e.g. --records='[a/eval.json,b/eval.json]'")
    if cfg.names and len(cfg.names) != len(cfg.records):
        raise ValueError(f"--names has {len(cfg.names)} names for {len(cfg.records)} records: give one each, or none")
    records = [load_record(p) for p in cfg.records]
    names = cfg.names or [Path(p).parent.name if Path(p).suffix == ".json" else Path(p).name for p in cfg.records]
    rows = []
    for name, record in zip(names, records, strict=True):
        episodes = record["per_episode"]
        protocol = (record.get("protocol") or {}).get("name")
        rows.append({"name": name, "checkpoint": record["checkpoint"], "protocol": protocol,
                     "delay": record.get("delay"), "overall": rates(episodes, lambda e: "overall")["overall"],
                     "suites": rates(episodes, lambda e: suite_of(e["task"])),
                     "tasks": rates(episodes, lambda e: e["task"])})  # fmt: skip
    result: dict[str, Any] = {"records": rows, "by_delay": by_delay(rows),
                              "learning_curves": [load_curve(p) for p in cfg.learning_curves]}  # fmt: skip
    if cfg.paired and len(records) >= 2:
        result["paired"] = {"first": names[0], "second": names[1], "tests": paired(records[0], records[1])}
    suites = sorted({s for row in rows for s in row["suites"]})
    result["published"] = [
        {"model": p.model, "protocol": p.protocol, "success": {s: p.success[s] for s in suites if s in p.success}}
        for p in PUBLISHED
        if any(s in p.success for s in suites)
    ]
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "report.json", json.dumps(result, indent=2))
    write_text_atomic(out / "report.md", markdown(result, suites))
    if rows:
        plot(result, suites, out / "report.png")
    if result["learning_curves"]:
        plot_curves(result["learning_curves"], out / "learning_curves.png")
    return result


def delay_label(delay: dict[str, Any] | None) -> str:
    """A record's delay as one label: none, fixed d, uniform lo-hi, histogram <file>."""
    if not delay or (delay.get("kind") == "fixed" and not delay.get("steps")):
        return "none"
    if delay["kind"] == "fixed":
        return f"fixed {delay['steps']}"
    if delay["kind"] == "uniform":
        return f"uniform {delay['low']}-{delay['high']}"
    return f"histogram {Path(delay.get('latencies_file', '')).name}"


def by_delay(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each checkpoint's success under each delay its records ran (only when some checkpoint ran several)."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        table.setdefault(row["checkpoint"], {})[delay_label(row["delay"])] = row["overall"]
    if all(len(delays) < 2 for delays in table.values()):
        return []
    return [{"checkpoint": c, "delay": d, **r} for c, delays in table.items() for d, r in delays.items()]


def load_curve(path: str) -> dict[str, Any]:
    """A fine-tuning run's periodic evaluations (``finetune_summary.json``): success against env steps."""
    file = Path(path) / "finetune_summary.json" if Path(path).is_dir() else Path(path)
    try:
        summary = json.loads(file.read_text())
        evals = summary["evals"]
    except (OSError, json.JSONDecodeError, KeyError) as err:
        raise ValueError(f"{path}: not a readable finetune_summary.json with evaluations ({err})") from None
    return {"name": file.parent.name, "algo": summary.get("algo"),
            "points": [{k: e[k] for k in ("iteration", "env_steps", "success_rate", "success_ci95", "episodes")}
                       for e in evals]}  # fmt: skip


def plot_curves(curves: list[dict[str, Any]], path: Path) -> None:
    """Held-out success against env steps, one line per run, its 95% intervals shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for curve in curves:
        xs = [p["env_steps"] for p in curve["points"]]
        ax.plot(
            xs, [p["success_rate"] for p in curve["points"]], marker="o", label=f"{curve['name']} ({curve['algo']})"
        )
        ax.fill_between(xs, [p["success_ci95"][0] for p in curve["points"]], [p["success_ci95"][1] for p in curve["points"]],
                        alpha=0.2)  # fmt: skip
    ax.set_xlabel("env steps")
    ax.set_ylabel("held-out success")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _rate(r: dict[str, Any] | None) -> str:
    if r is None:
        return "-"
    lo, hi = r["success_ci95"]
    return f"{r['success_rate']:.1%} ({r['successes']}/{r['episodes']}) [{lo:.0%}, {hi:.0%}]"


def markdown(result: dict[str, Any], suites: list[str]) -> str:
    rows = result["records"]
    if not rows:
        suites = []
    lines = ["# Evaluation report", "", "## By suite (success, successes/episodes, 95% Wilson interval)", "",
             "| record | protocol | " + " | ".join(suites) + " | overall |", "|---" * (len(suites) + 3) + "|"]  # fmt: skip
    for row in rows:
        cells = [_rate(row["suites"].get(s)) for s in suites]
        lines.append(
            f"| {row['name']} | {row['protocol'] or '-'} | " + " | ".join(cells) + f" | {_rate(row['overall'])} |"
        )
    if result["published"]:
        lines += ["", "Published (%, as reported; compare protocols before numbers):", "",
                  "| model | protocol | " + " | ".join(suites) + " |", "|---" * (len(suites) + 2) + "|"]  # fmt: skip
        for p in result["published"]:
            lines.append(
                f"| {p['model']} | {p['protocol']} | "
                + " | ".join(str(p["success"].get(s, "-")) for s in suites)
                + " |"
            )
    tasks = sorted({t for row in rows for t in row["tasks"]})
    lines += [
        "",
        "## By task",
        "",
        "| task | " + " | ".join(r["name"] for r in rows) + " |",
        "|---" * (len(rows) + 1) + "|",
    ]
    for t in tasks:
        lines.append(f"| {t} | " + " | ".join(_rate(r["tasks"].get(t)) for r in rows) + " |")
    if result["by_delay"]:
        lines += ["", "## By delay", "", "| checkpoint | delay | success |", "|---|---|---|"]
        lines += [f"| {r['checkpoint']} | {r['delay']} | {_rate(r)} |" for r in result["by_delay"]]
    for curve in result["learning_curves"]:
        lines += ["", f"## Learning curve: {curve['name']} ({curve['algo']})", "", "| iteration | env steps | success |",
                  "|---|---|---|"]  # fmt: skip
        lines += [f"| {p['iteration']} | {p['env_steps']} | {_rate({**p, 'successes': round(p['success_rate'] * p['episodes'])})} |"
                  for p in curve["points"]]  # fmt: skip
    if "paired" in result:
        pair = result["paired"]
        lines += ["", f"## Paired: {pair['first']} against {pair['second']} (McNemar, exact, two-sided)", "",
                  "| task | pairs | first only | second only | first | second | p |", "|---" * 7 + "|"]  # fmt: skip
        for name, t in pair["tests"].items():
            lines.append(f"| {name} | {t['pairs']} | {t['only_first']} | {t['only_second']} | {t['first_rate']:.1%} | "
                         f"{t['second_rate']:.1%} | {t['p_value']:.3g} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], suites: list[str], path: Path) -> None:
    """Success per suite and record, 95% intervals as error bars; published figures of the suites as markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["records"]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.6 * len(suites) * max(1, len(rows)) / 2), 3.5))
    width = 0.8 / max(1, len(rows))
    for i, row in enumerate(rows):
        xs = [k + i * width for k in range(len(suites))]
        ys = [row["suites"].get(s, {}).get("success_rate", float("nan")) for s in suites]
        err = [[y - row["suites"].get(s, {"success_ci95": [y, y]})["success_ci95"][0] for s, y in zip(suites, ys, strict=True)],
               [row["suites"].get(s, {"success_ci95": [y, y]})["success_ci95"][1] - y for s, y in zip(suites, ys, strict=True)]]  # fmt: skip
        ax.bar(xs, ys, width, yerr=err, capsize=3, label=row["name"])
    for p in result["published"]:
        ax.plot([k + 0.4 - width / 2 for k in range(len(suites))], [p["success"].get(s, float("nan")) / 100 for s in suites],
                "_", markersize=14, label=f"{p['model']} ({p['protocol']})")  # fmt: skip
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(suites))], suites, rotation=15)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("success")
    ax.legend(fontsize=6, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
