"""--kv-budget-bytes in positions of the model: what the target's session table admits against."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from specsplit.lmkit.kvcache import kv_bytes_per_token
from specsplit.target_service.server import kv_budget_tokens

pytestmark = pytest.mark.unit


def test_the_budget_flag_in_positions():
    config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4)
    model = LlamaForCausalLM(config)
    per = kv_bytes_per_token(model)
    assert kv_budget_tokens(model, 0, 1) == 0  # no budget
    assert kv_budget_tokens(model, 10 * per + 1, 1) == 10
    with pytest.raises(ValueError, match="holds no position"):
        kv_budget_tokens(model, per - 1, 1)
    with pytest.raises(ValueError, match="must be >= 0"):
        kv_budget_tokens(model, -1, 1)


def test_bad_budget_and_chunk_flags_stop_both_services_before_anything_loads():
    from specsplit.draft_service import server as draft_server
    from specsplit.target_service import server as target_server

    with pytest.raises(ValueError, match=r"--prefill-chunk must be auto or an int >= 0 \(0: a prompt's prefill is one"):
        target_server.run(target_server.build_parser().parse_args(["--prefill-chunk", "-1"]))
    with pytest.raises(SystemExit):  # argparse: "expected auto or a token count, got 'half'"
        target_server.build_parser().parse_args(["--prefill-chunk", "half"])
    assert target_server.build_parser().parse_args(["--prefill-chunk", "auto"]).prefill_chunk == "auto"
    with pytest.raises(ValueError, match=r"--prefill-chunk must be an int >= 0 \(0: a prompt's prefill is one forward\)"):
        draft_server.run(draft_server.build_parser().parse_args(["--prefill-chunk", "-1"]))
    with pytest.raises(ValueError, match=r"--kv-budget-bytes must be >= 0 \(0: no budget\), got -5"):
        draft_server.run(draft_server.build_parser().parse_args(["--kv-budget-bytes", "-5"]))
    assert draft_server.draft_limits(draft_server.build_parser().parse_args(["--kv-budget-bytes", "4096"])) \
        .kv_budget_bytes == 4096
