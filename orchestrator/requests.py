"""Validation of public ``GenerateRequest`` messages into ``GenerationRequest``.

Every field is checked; a bad one raises ``errors.InvalidArgument`` with a
message that names the field and the accepted range.
"""

from __future__ import annotations

import secrets

from lmkit import errors
from lmkit.kinds import DrafterKind
from lmkit.proto.specsplit.v1 import specsplit_pb2 as pb
from lmkit.wire import sampling_from_proto
from orchestrator.generation import GenerationRequest, Orchestrator


def parse_request(msg: pb.GenerateRequest, orch: Orchestrator) -> tuple[GenerationRequest, list[int]]:
    """Validate a request against the server's limits; return it with the prompt's token ids."""
    config = orch.config
    if not msg.prompt:
        raise errors.InvalidArgument("prompt is empty; send the text to continue")
    max_new = msg.max_new_tokens if msg.HasField("max_new_tokens") else config.default_max_new_tokens
    if not 1 <= max_new <= config.max_new_tokens_limit:
        raise errors.InvalidArgument(f"max_new_tokens must be in [1, {config.max_new_tokens_limit}], got {max_new}")
    sampling = sampling_from_proto(msg.sampling)
    if not msg.sampling.HasField("seed"):
        sampling = type(sampling)(sampling.temperature, sampling.top_k, sampling.top_p, secrets.randbelow(2**63))
    stop = tuple(msg.stop)
    if len(stop) > config.max_stop_strings:
        raise errors.InvalidArgument(f"{len(stop)} stop strings sent; at most {config.max_stop_strings} are allowed")
    if any(not s for s in stop):
        raise errors.InvalidArgument("stop strings must not be empty")
    k = msg.k if msg.HasField("k") else config.default_k
    if k > orch.max_block:
        raise errors.InvalidArgument(f"k = {k} is larger than the services' max block {orch.max_block}")
    drafter = _drafter(msg.drafter, config.default_drafter)
    if k > 0 and orch.draft is not None and drafter not in orch.drafters:
        available = ", ".join(d.name for d in orch.drafters)
        raise errors.InvalidArgument(f"drafter {drafter.name} is not served by the draft service (it runs {available})")
    traits = orch.drafter_traits.get(drafter)
    if msg.draft_probs and not (traits is not None and traits.has_probs):
        names = "/".join(sorted(t.kind.name for t in orch.drafter_traits.values() if t.has_probs)) or "model"
        raise errors.InvalidArgument(f"draft_probs needs a {names} drafter; {drafter.name} sends token ids only")
    chain = _chain(msg.chain, drafter, orch.drafters if k > 0 and orch.draft is not None else None)
    prompt_ids = orch.encode(msg.prompt, msg.chat)
    limit = orch.target.info.max_context
    if limit and len(prompt_ids) >= limit:
        raise errors.InvalidArgument(
            f"the prompt is {len(prompt_ids)} tokens but the model's context is {limit}; shorten the prompt"
        )
    adaptive = msg.adaptive_k if msg.HasField("adaptive_k") else config.default_adaptive_k
    overlap = msg.overlap if msg.HasField("overlap") else config.default_overlap
    request = GenerationRequest(
        msg.prompt, msg.chat, max_new, sampling, stop, k, drafter, msg.draft_probs, adaptive, chain, overlap
    )
    if k > 0 and orch.draft is not None:
        orch.check_features(request)
    return request, prompt_ids


def _chain(values, drafter: DrafterKind, served: list[DrafterKind] | None) -> tuple[DrafterKind, ...]:
    """Validate GenerateRequest.chain (``served`` is None when no draft will run)."""
    if not values:
        return ()
    if drafter is not DrafterKind.CHAIN:
        raise errors.InvalidArgument(f"chain is only for the CHAIN drafter, but drafter is {drafter.name}")
    chain = tuple(_drafter(v, DrafterKind.CHAIN) for v in values)
    if DrafterKind.CHAIN in chain or len(set(chain)) != len(chain):
        raise errors.InvalidArgument("chain must list distinct member drafters (not CHAIN), e.g. [NGRAM, LAYERSKIP]")
    missing = [d.name for d in chain if served is not None and d not in served]
    if missing:
        raise errors.InvalidArgument(f"chain members {missing} are not served by the draft service")
    return chain


def _drafter(value: int, default: DrafterKind) -> DrafterKind:
    if value == pb.DRAFTER_KIND_UNSPECIFIED:
        return default
    try:
        return DrafterKind(value)
    except ValueError:
        names = ", ".join(f"{k.name} ({k.value})" for k in DrafterKind)
        raise errors.InvalidArgument(f"drafter {value} is unknown; send one of {names}") from None
