"""``specsplit bench --suite pools``: its replica-count flags."""

from __future__ import annotations

import pytest

from specsplit.bench.pools import counts

pytestmark = pytest.mark.unit


def test_replica_counts_are_positive_integers_or_a_message_naming_the_flag():
    assert counts("1,2, 3", "--pool-targets") == [1, 2, 3]
    for bad in ("", "0,1", "-1"):
        with pytest.raises(ValueError, match="--pool-targets: replica counts >= 1"):
            counts(bad, "--pool-targets")
