"""Where every extra is installed (`make test`, CI), nothing may skip: a skip or a missing extra fails."""

import shutil
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

HERE = Path(__file__).parent

SKIPPING_TESTS = """
import pytest
from extras import require

def test_skips_itself():
    pytest.skip("a reason")

def test_needs_a_missing_extra():
    require("a_module_that_is_not_installed", "ros")
"""

SKIPPED_FILE = """
import pytest
pytest.importorskip("a_module_that_is_not_installed")

def test_never_collected():
    pass
"""


@pytest.fixture
def project(pytester):
    for name in ("conftest.py", "extras.py"):
        shutil.copy(HERE / name, pytester.path / name)
    pytester.makepyfile(test_skipping=SKIPPING_TESTS, test_skipped_file=SKIPPED_FILE)
    return pytester


def test_skips_fail_where_every_extra_is_required(project, monkeypatch):
    monkeypatch.setenv("VLA_RL_REQUIRE_EXTRAS", "1")
    result = project.runpytest_inprocess("-p", "no:cacheprovider", "--continue-on-collection-errors")
    result.assert_outcomes(failed=2, errors=1)  # the file skipped at import fails at collection
    result.stdout.fnmatch_lines(["*skipped under CI=true*"])
    result.stdout.fnmatch_lines(["*No module named 'a_module_that_is_not_installed'*"])


def test_ci_true_requires_them_too(project, monkeypatch):
    monkeypatch.delenv("VLA_RL_REQUIRE_EXTRAS", raising=False)
    monkeypatch.setenv("CI", "true")
    project.runpytest_inprocess("-p", "no:cacheprovider", "--continue-on-collection-errors").assert_outcomes(
        failed=2, errors=1
    )


def test_a_partial_install_still_skips_with_the_extra_named(project, monkeypatch):
    monkeypatch.delenv("VLA_RL_REQUIRE_EXTRAS", raising=False)
    monkeypatch.delenv("CI", raising=False)
    result = project.runpytest_inprocess("-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(skipped=3)
    assert 'needs the ros extra: pip install -e ".[ros]"' in result.stdout.str()
