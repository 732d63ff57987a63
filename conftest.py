"""pytest options of this project's suite: `--run-slow` runs the tests marked slow (whole runs of
long external suites, such as Horovod's at 2 and 3 ranks), which the default run (the README's
test command, and CI) leaves out with a reason."""
import pytest


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run the tests marked slow (tens of minutes)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
