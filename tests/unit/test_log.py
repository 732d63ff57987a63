"""mlfabric's logging (mlfabric/_core/log.py), in one process: MLFABRIC_LOG_LEVEL, the warning
about misspelled MLFABRIC_* variables, the once-per-size-class record of logged paths, and
leaving an application's own logging configuration alone."""
import logging
import os
import re

import pytest

from mlfabric._core import config, log
from mlfabric.errors import MlfabricError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)

    def messages(self):
        return [r.getMessage() for r in self.records]


@pytest.fixture
def records():
    """A handler on the mlfabric logger collecting its records (at every level), removed after."""
    handler = _Records()
    logger = logging.getLogger("mlfabric")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


@pytest.mark.parametrize("raw, level", [(None, "WARNING"), ("", "WARNING"), ("debug", "DEBUG"),
                                        ("info", "INFO"), (" Warning ", "WARNING"),
                                        ("ERROR", "ERROR")])
def test_level_from_the_environment(monkeypatch, raw, level):
    if raw is None:
        monkeypatch.delenv("MLFABRIC_LOG_LEVEL", raising=False)
    else:
        monkeypatch.setenv("MLFABRIC_LOG_LEVEL", raw)
    assert config.log_level() == level


@pytest.mark.parametrize("raw", ["verbose", "10", "warn", "critical"])
def test_a_bad_level_is_an_error(monkeypatch, raw):
    monkeypatch.setenv("MLFABRIC_LOG_LEVEL", raw)
    with pytest.raises(MlfabricError, match=r"MLFABRIC_LOG_LEVEL must be one of debug, info, "
                                            r"warning, error, got '%s'" % raw):
        config.log_level()
    # init() compares settings before it raises, so that no rank waits for one that raised
    assert ("MLFABRIC_LOG_LEVEL", "error: MLFABRIC_LOG_LEVEL must be one of debug, info, "
            f"warning, error, got '{raw}'") in config.shaping_settings(2)


def test_misspelled_settings_name_the_closest_known_one(records):
    env = {"MLFABRIC_TIMOUT": "5", "MLFABRIC_SHM_BLOKC": "1", "MLFABRIC_SHM": "1",
           "MLFABRIC_LOGLEVEL": "info", "MLFABRIC_ZZZZZZZZZZZZ": "1", "MLFABRIC_TEST_COMM": "x",
           "OTHER_TIMOUT": "1"}
    assert log.unknown_settings(env) == [("MLFABRIC_LOGLEVEL", "MLFABRIC_LOG_LEVEL"),
                                         ("MLFABRIC_SHM_BLOKC", "MLFABRIC_SHM_BLOCK"),
                                         ("MLFABRIC_TIMOUT", "MLFABRIC_TIMEOUT"),
                                         ("MLFABRIC_ZZZZZZZZZZZZ", None)]
    log.warn_unknown_settings(env)
    assert [r.levelno for r in records.records] == [logging.WARNING] * 4
    text = records.messages()
    assert "MLFABRIC_TIMOUT is not an mlfabric setting (ignored); did you mean " \
           "MLFABRIC_TIMEOUT?" in text
    assert "MLFABRIC_ZZZZZZZZZZZZ is not an mlfabric setting (ignored)" in text


def test_every_setting_read_in_the_tree_is_known():
    """config.KNOWN lists every MLFABRIC_* name the package and setup.py read (else init()
    would warn about a real setting)."""
    names = set()
    paths = [os.path.join(ROOT, "setup.py")]
    for dirpath, _, files in os.walk(os.path.join(ROOT, "mlfabric")):
        paths += [os.path.join(dirpath, f) for f in files if f.endswith(".py")]
    for path in paths:
        with open(path) as f:
            names.update(re.findall(r"MLFABRIC_[A-Z0-9_]+", f.read()))
    names -= {"MLFABRIC_WITH_CUDA"}  # a C macro setup.py defines, not a variable
    names = {n for n in names if n != "MLFABRIC_" and not n.startswith(config.UNCHECKED_PREFIXES)}
    assert names <= config.KNOWN, sorted(names - config.KNOWN)


def test_size_classes_are_powers_of_two():
    assert [log.size_class(n) for n in (0, 1, 2, 3, 4, 4095, 4096, 8191, 8192)] == \
        [0, 1, 2, 2, 3, 12, 13, 13, 14]
    assert log.human(512) == "512 B" and log.human(4 << 20) == "4.0 MiB"
    assert log.human(3 << 30) == "3.0 GiB"


def test_a_path_is_logged_once_per_size_class(records, monkeypatch):
    monkeypatch.setattr(log, "_seen", set())
    for nbytes in (4000, 4000, 3000, 4096, 5000, 8191, 1 << 20, (1 << 20) + 1):
        log.path_chosen("allreduce", "shm", nbytes, "float32", 2, "staged")
    log.path_chosen("allreduce", "shm", 4000, "float64", 2, "staged")        # another dtype
    log.path_chosen("allreduce", "ring", 4000, "float32", 2)                # another backend
    log.path_chosen("broadcast", "shm", 4000, "float32", 2, "staged")       # another collective
    log.path_chosen("allreduce", "shm", 4000, "float32", 2, "zero-copy shared buffer")
    log.path_chosen("allreduce", "shm", 4000, "float32", 2, "staged")       # seen
    assert records.messages() == [
        "allreduce 3.9 KiB float32 on 2 ranks -> shm (staged)",          # [2 KiB, 4 KiB)
        "allreduce 4.0 KiB float32 on 2 ranks -> shm (staged)",          # [4 KiB, 8 KiB)
        "allreduce 1.0 MiB float32 on 2 ranks -> shm (staged)",
        "allreduce 3.9 KiB float64 on 2 ranks -> shm (staged)",
        "allreduce 3.9 KiB float32 on 2 ranks -> ring",
        "broadcast 3.9 KiB float32 on 2 ranks -> shm (staged)",
        "allreduce 3.9 KiB float32 on 2 ranks -> shm (zero-copy shared buffer)"]
    assert {r.name for r in records.records} == {"mlfabric.comm"}
    assert {r.levelno for r in records.records} == {logging.INFO}


@pytest.fixture
def bare_logger(monkeypatch):
    """The mlfabric loggers as an application that configured nothing leaves them; restored
    after."""
    logger = logging.getLogger("mlfabric")
    runtime = logging.getLogger("mlfabric.runtime")
    saved = (logger.handlers[:], logger.level, logger.propagate, runtime.level)
    logger.handlers[:] = []
    logger.setLevel(logging.NOTSET)
    runtime.setLevel(logging.NOTSET)
    monkeypatch.setattr(log, "_handler", None)
    monkeypatch.setattr(log, "paths", False)
    yield logger
    logger.handlers[:], lvl, logger.propagate, rlvl = saved
    logger.setLevel(lvl)
    runtime.setLevel(rlvl)


def test_configure_adds_a_rank_handler_once(bare_logger, monkeypatch):
    monkeypatch.setenv("MLFABRIC_LOG_LEVEL", "info")
    monkeypatch.delenv("MLFABRIC_DEBUG", raising=False)
    root = logging.getLogger()
    root_state = (root.handlers[:], root.level)
    log.configure(3)
    log.configure(3)
    assert len(bare_logger.handlers) == 1 and bare_logger.level == logging.INFO
    assert not bare_logger.propagate and log.paths
    assert (root.handlers[:], root.level) == root_state  # the root logger is left alone
    record = logging.LogRecord("mlfabric.comm", logging.INFO, __file__, 1,
                               "allreduce %s -> %s", ("4.0 MiB float32", "shm (staged)"), None)
    assert bare_logger.handlers[0].format(record) == \
        "[mlfabric rank 3] INFO comm: allreduce 4.0 MiB float32 -> shm (staged)"


def test_default_level_is_warning_and_paths_are_not_logged(bare_logger, monkeypatch):
    monkeypatch.delenv("MLFABRIC_LOG_LEVEL", raising=False)
    monkeypatch.delenv("MLFABRIC_DEBUG", raising=False)
    log.configure(0)
    assert bare_logger.level == logging.WARNING and not log.paths


def test_mlfabric_debug_means_debug_for_the_runtime(bare_logger, monkeypatch):
    monkeypatch.delenv("MLFABRIC_LOG_LEVEL", raising=False)
    monkeypatch.setenv("MLFABRIC_DEBUG", "1")
    log.configure(0)
    assert logging.getLogger("mlfabric.runtime").isEnabledFor(logging.DEBUG)
    assert not logging.getLogger("mlfabric.comm").isEnabledFor(logging.INFO)


def test_an_application_configuration_is_left_alone(bare_logger, monkeypatch):
    monkeypatch.setenv("MLFABRIC_LOG_LEVEL", "debug")
    mine = logging.NullHandler()
    bare_logger.addHandler(mine)
    bare_logger.setLevel(logging.INFO)
    log.configure(1)
    assert bare_logger.handlers == [mine] and bare_logger.level == logging.INFO
    assert log.paths  # the application's level: info


def test_configure_rejects_a_bad_level(bare_logger, monkeypatch):
    monkeypatch.setenv("MLFABRIC_LOG_LEVEL", "loud")
    with pytest.raises(MlfabricError, match="MLFABRIC_LOG_LEVEL"):
        log.configure(0)
    assert bare_logger.handlers == []
