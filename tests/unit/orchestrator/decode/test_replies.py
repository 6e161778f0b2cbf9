"""The services' replies as the loop reads them: every field the loop uses comes over, absent ones as defaults."""

from __future__ import annotations

import pytest

from specsplit.lmkit.kinds import DrafterKind
from specsplit.orchestrator.decode.replies import DraftedBlock, VerifiedBlock, drafted_of, verified_of
from specsplit.v1 import specsplit_pb2 as pb

pytestmark = pytest.mark.unit


def test_a_draft_reply_becomes_a_drafted_block_with_its_tree_guess_match_drafter_and_times():
    reply = pb.DraftBlock(
        position=7, tokens=[4, 5, 6], parents=[-1, 0, 0], probs=pb.DraftProbs(rows=3),
        drafter=DrafterKind.NGRAM.value, quality=pb.MatchQuality(length=5, occurrences=2),
        second_guess=pb.SecondGuess(index=1, token=9),
        timing=pb.ServiceTiming(compute_us=1500, service_us=2000, read_us=250),
    )
    drafted = drafted_of(reply)
    assert drafted == DraftedBlock(
        position=7, tokens=[4, 5, 6], parents=[-1, 0, 0], probs=reply.probs, second_guess=(1, 9), match=(5, 2),
        drafter=DrafterKind.NGRAM, compute_s=0.0015, service_s=0.002, read_s=0.00025,
    )
    assert drafted.probs.rows == 3  # carried to the target as it came


def test_an_empty_reply_has_no_probs_guess_match_or_drafter():
    assert drafted_of(pb.DraftBlock(position=3)) == DraftedBlock(3, [])


def test_a_drafter_the_draft_did_not_announce_reads_as_none():
    assert drafted_of(pb.DraftBlock(drafter=9_999)).drafter is None


def test_a_verify_result_becomes_a_verified_block_with_its_forward_report():
    result = pb.VerifyResult(
        position=12, accepted=2, next_token=8, path=[0, 2],
        timing=pb.ServiceTiming(compute_us=3000, service_us=4000, forward_us=2500),
        forward=pb.ForwardReport(batch_size=4, batch_width=5, batch_tokens=11, batch_packed=True,
                                 others_committed=6, cost_base_us=1000, cost_per_token_us=50),
        logprobs=[pb.TokenLogprob(token_id=8, logprob=-0.5)],
        features=pb.HiddenFeatures(values=b"\0" * 64),
        successors=pb.Successors(k=2),
    )
    verified = verified_of(result)
    assert (verified.position, verified.accepted, verified.next_token, verified.path) == (12, 2, 8, [0, 2])
    assert (verified.compute_s, verified.service_s, verified.forward_s) == pytest.approx((0.003, 0.004, 0.0025))
    assert (verified.batch_size, verified.batch_width, verified.batch_tokens, verified.batch_packed) == (4, 5, 11, True)
    assert verified.others_committed == 6 and verified.cost_fit == pytest.approx((0.001, 0.00005))
    assert [lp.token_id for lp in verified.logprobs] == [8]
    assert verified.feature_bytes == 64 and verified.features.values == result.features.values
    assert verified.successors.k == 2


def test_a_bare_result_is_a_verified_chain_without_payloads():
    assert verified_of(pb.VerifyResult(accepted=1, next_token=3)) == VerifiedBlock(0, 1, 3)
