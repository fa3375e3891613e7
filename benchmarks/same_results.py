"""Do two runs of a command give the same results? Compares two output folders file by file.

    python benchmarks/same_results.py outputs/before outputs/after [--ignore=vla_rl_version,estimate_window]

Every JSON file and every ``model.safetensors`` under the first folder must exist under the second
with equal content: JSON values equal (per-episode outcomes, success counts, loss curves, every
logged statistic), ignoring what a run cannot repeat (keys that hold times, rates, dates and the
code revision) and the two folders' own paths; weights equal bit for bit. Datasets compare by their
metadata and statistics JSON. ``--ignore`` names more keys to skip wherever they are (a config field
renamed between the two versions, the version string), and the final line names them. Prints one
line per file that differs, then the final line ``same=<true|false> json_files=<n> weight_files=<m>
differing=<k> ignored_keys=<keys>``; exits 1 when anything differs.

vla-rl's pipeline on the CPU is deterministic, so a refactor that keeps behaviour shows here as
``same=true`` on a full benchmark run before and after it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Keys whose values depend on the clock, the machine or the checkout, not on the computation.
VOLATILE = ("second", "minute", "per_s", "time", "date", "git", "revision", "hostname", "created")


IGNORED: set[str] = set()  # keys skipped on request (--ignore)


def _volatile(key: str) -> bool:
    return key in IGNORED or any(word in key.lower() for word in VOLATILE)


def differences(a, b, where: str, roots: tuple[str, str]) -> list[str]:
    """Where JSON values ``a`` and ``b`` differ (paths under the two roots count as equal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{where}.{k}: only in the first" for k in a.keys() - b.keys() if not _volatile(k)]
        out += [f"{where}.{k}: only in the second" for k in b.keys() - a.keys() if not _volatile(k)]
        for k in sorted(a.keys() & b.keys()):
            if not _volatile(k):
                out += differences(a[k], b[k], f"{where}.{k}", roots)
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} items against {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{where}[{i}]", roots)]
    if isinstance(a, str) and isinstance(b, str):
        a, b = a.replace(roots[0], "<root>"), b.replace(roots[1], "<root>")
    return [] if a == b else [f"{where}: {a!r} against {b!r}"]


def same_weights(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    x, y = load_file(str(a)), load_file(str(b))
    return x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and x[k].equal(y[k]) for k in x)


def compare(first: Path, second: Path) -> tuple[list[str], int, int]:
    """(lines describing each difference, JSON files compared, weight files compared)."""
    roots = (str(first.resolve()), str(second.resolve()))
    lines, json_files, weight_files = [], 0, 0
    for path in sorted(first.rglob("*")):
        relative = path.relative_to(first)
        other = second / relative
        if (path.suffix == ".json" or path.name == "model.safetensors") and not other.is_file():
            lines.append(f"{relative}: missing in {second}")
            continue
        if path.suffix == ".json":
            json_files += 1
            found = differences(json.loads(path.read_text()), json.loads(other.read_text()), "", roots)
            lines += [f"{relative}{d}" for d in found[:5]] + (
                [f"{relative}: ... {len(found) - 5} more"] if len(found) > 5 else []
            )
        elif path.name == "model.safetensors":
            weight_files += 1
            if not same_weights(path, other):
                lines.append(f"{relative}: the weights differ")
    return lines, json_files, weight_files


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    ignore = [a for a in args if a.startswith("--ignore=")]
    folders = [a for a in args if not a.startswith("--ignore=")]
    if len(folders) != 2 or not all(Path(a).is_dir() for a in folders):
        print("usage: python benchmarks/same_results.py FIRST_OUTPUT_DIR SECOND_OUTPUT_DIR [--ignore=KEY,...]",
              file=sys.stderr)  # fmt: skip
        return 2
    IGNORED.clear()
    IGNORED.update(k for a in ignore for k in a.partition("=")[2].split(",") if k)
    lines, json_files, weight_files = compare(Path(folders[0]), Path(folders[1]))
    print("\n".join(lines))
    same = not lines and json_files + weight_files > 0
    print(f"same={str(same).lower()} json_files={json_files} weight_files={weight_files} differing={len(lines)} "
          f"ignored_keys={','.join(sorted(IGNORED)) or '-'}")  # fmt: skip
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
