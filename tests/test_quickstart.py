import json

import pytest


@pytest.mark.slow
def test_quickstart_reaches_60_percent(tmp_path):
    """The README's main job on its embedded default: >= 60% success over >= 50 episodes."""
    from vla_rl.quickstart import QuickstartConfig, quickstart

    cfg = QuickstartConfig(output_dir=str(tmp_path / "qs"))
    result = quickstart(cfg)
    assert result["episodes"] >= 50
    assert result["success_rate"] >= 0.6, json.dumps({k: result[k] for k in ("success_rate", "success_ci95")})
    assert (tmp_path / "qs" / "eval" / "rollouts.mp4").stat().st_size > 10_000
