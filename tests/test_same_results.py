"""benchmarks/same_results.py: two output folders compared file by file (JSON values, weights bit for bit)."""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import same_results


def _run(root: Path, loss: float = 0.5, weight: float = 1.0, seconds: float = 3.0, version: str = "0.2.0") -> Path:
    (root / "train" / "model").mkdir(parents=True)
    summary = {"loss_curve": [[10, loss]], "seconds": seconds, "checkpoint": str(root / "train"), "version": version}
    (root / "train" / "summary.json").write_text(json.dumps(summary))
    save_file({"w": torch.full((3,), weight)}, str(root / "train" / "model" / "model.safetensors"))
    return root


def test_the_same_results_in_two_folders_are_the_same(tmp_path, capsys):
    """Times and each folder's own paths may differ; results and weights may not."""
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b", seconds=9.0)
    assert same_results.main([str(a), str(b), "--ignore=version"]) == 0
    assert (
        capsys.readouterr()
        .out.strip()
        .endswith("same=true json_files=1 weight_files=1 differing=0 ignored_keys=version")
    )


def test_a_changed_value_weight_or_file_is_named(tmp_path, capsys):
    a = _run(tmp_path / "a")
    for name, kwargs, expected in [
        ("loss", {"loss": 0.25}, "train/summary.json.loss_curve[0][1]: 0.5 against 0.25"),
        ("weights", {"weight": 1.0 + 1e-7}, "train/model/model.safetensors: the weights differ"),
        ("version", {"version": "0.3.0"}, "train/summary.json.version: '0.2.0' against '0.3.0'"),
    ]:
        b = _run(tmp_path / name, **kwargs)
        assert same_results.main([str(a), str(b)]) == 1
        out = capsys.readouterr().out
        assert expected in out and "same=false" in out
    (tmp_path / "loss" / "train" / "summary.json").unlink()
    assert same_results.main([str(a), str(tmp_path / "loss")]) == 1
    assert "train/summary.json: missing in" in capsys.readouterr().out
