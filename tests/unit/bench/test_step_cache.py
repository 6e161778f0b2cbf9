"""The step suite's cache part flushes a buffer twice the largest cache Linux reports."""

import pytest

from specsplit.bench import step

pytestmark = pytest.mark.unit


def test_the_largest_reported_cache_is_the_last_level(tmp_path):
    for index, size in (("index0", "48K"), ("index2", "1024K"), ("index3", "32768K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    assert step._last_level_cache_bytes(tmp_path) == 32 << 20


def test_a_machine_that_reports_no_cache_is_flushed_with_64_mib(tmp_path):
    (tmp_path / "index0").mkdir()  # no size file
    assert step._last_level_cache_bytes(tmp_path) == 64 << 20
    assert step._last_level_cache_bytes(tmp_path / "missing") == 64 << 20
