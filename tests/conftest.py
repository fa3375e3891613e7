import faulthandler
import os

# Tests run offline and headless.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])

import pytest
from extras import extras_required


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Where every extra is installed (CI), a skipped test is a failure: nothing may vanish silently."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and extras_required() and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.longrepr = f"skipped under CI=true, where every extra is installed and nothing may skip: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """The same for a whole file skipped at import (``pytest.importorskip`` at module level)."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and extras_required():
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, where every extra is installed and nothing may skip: {reason}"


_real_stderr = None  # the terminal's stderr, dup'ed before any test's output capture replaces fd 2


def pytest_configure(config):
    global _real_stderr
    _real_stderr = os.fdopen(os.dup(2), "w")


@pytest.fixture(autouse=True)
def native_crash_stacks_reach_the_terminal():
    """A segfault in any test prints every thread's stack where the run's log can show it. Needed because
    a test that used `vla_core.crash_log.into` leaves faulthandler on fd 2, which is the capture file
    while a test runs, and is lost with the process."""
    faulthandler.enable(file=_real_stderr, all_threads=True)
    yield


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory):
    """Six scripted lift episodes recorded through `vla-rl record`'s code path."""
    from sim.config import EnvConfig
    from vla_rl.record import RecordConfig, record

    root = tmp_path_factory.mktemp("data") / "lift"
    summary = record(RecordConfig(env=EnvConfig(num_envs=6), num_episodes=6, output_dir=str(root), seed=7))
    return root, summary


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_dataset, tmp_path_factory):
    """A diffusion policy trained for a few steps on the tiny dataset (for plumbing, not skill)."""
    from vla_rl.train import DatasetConfig, TrainConfig, train

    out = tmp_path_factory.mktemp("train") / "run"
    cfg = TrainConfig(
        dataset=DatasetConfig(root=str(tiny_dataset[0])), output_dir=str(out), steps=60, batch_size=16,
        save_every=20, log_every=10, log_with="none", num_threads=2, warmup_steps=5,
    )  # fmt: skip
    return out, train(cfg)


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for a module of tiny models (a thread pool only adds wake-ups, and stalls on a busy
    machine); a module asks for it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
