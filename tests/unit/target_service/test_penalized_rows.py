"""A token tree's rows are penalized each with its own root path, never a sibling's tokens."""

from __future__ import annotations

import pytest
import torch

from specsplit.lmkit.kinds import VerificationMode
from specsplit.lmkit.sampling import SamplingParams
from specsplit.target_service.engine import TargetSession, penalized

pytestmark = pytest.mark.unit

VOCAB = 6


def test_tree_nodes_count_their_root_path_only():
    raw = torch.zeros(4, VOCAB)
    params = SamplingParams(frequency_penalty=1.0, prompt_length=1)
    session = TargetSession("s", [0], params, VerificationMode.GREEDY, cache=None)
    # nodes: 0 -> token 1 (root child), 1 -> token 2 (root child, sibling of node 0), 2 -> token 3 under node 0
    out = penalized(session, raw, [1, 2, 3], [-1, -1, 0])
    assert out[0].tolist() == [0.0] * VOCAB  # the root row: nothing generated yet
    assert out[1].tolist() == [0.0, -1.0, 0.0, 0.0, 0.0, 0.0]  # after node 0 (token 1)
    assert out[2].tolist() == [0.0, 0.0, -1.0, 0.0, 0.0, 0.0]  # after node 1 (token 2): not its sibling's token
    assert out[3].tolist() == [0.0, -1.0, 0.0, -1.0, 0.0, 0.0]  # after nodes 0 and 2
