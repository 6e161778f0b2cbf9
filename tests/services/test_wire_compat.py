"""Builds of different wire versions either work together or refuse each other by name, never misread.

A client built from the published contract (protos/baseline/) is served as today's client is.

The old client's stubs are generated at test time from the baseline .proto and run in a process of their
own (both builds register the same proto file name, so one process cannot hold both). Its generation must
equal a current client's: text, token ids, finish reason and the stats that do not depend on timing. The
negative control builds the same client from a baseline with two fields' numbers swapped (what a
renumbering does to a client in the field) and shows the comparison catches the misreading. An
orchestrator built from the baseline is refused by today's target at its session's first call; today's
orchestrator refuses a service that states no version at connect; both messages name both versions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_tools import protoc

from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc

pytestmark = pytest.mark.services

REPO = Path(__file__).resolve().parents[2]
BASELINE = REPO / "protos" / "baseline"
CONTRACT = "specsplit/v1/specsplit.proto"
STATS = ("prompt_tokens", "new_tokens", "rounds", "drafted_tokens", "accepted_tokens", "k", "drafter", "mode",
         "adaptive_k", "overlap")
TIMED = ("rounds", "drafted_tokens", "accepted_tokens")  # what a draft late for its deadline changes

# The client, as an internal client built from the baseline would send it: greedy, 8 tokens, k = 4.
OLD_CLIENT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import grpc
from specsplit.v1 import specsplit_pb2 as pb, specsplit_pb2_grpc as pb_grpc
assert pb.__file__.startswith(sys.argv[1]), pb.__file__
request = pb.GenerateRequest(prompt=sys.argv[3], chat=False, max_new_tokens=8, k=4, adaptive_k=False,
                             drafter=pb.DRAFTER_KIND_NGRAM, sampling=pb.SamplingParams(temperature=0),
                             return_token_ids=True)
with grpc.insecure_channel(sys.argv[2]) as channel:
    replies = list(pb_grpc.GeneratorStub(channel).Generate(request, timeout=120))
final = replies[-1]
print(json.dumps({"text": "".join(r.text for r in replies), "ids": [t for r in replies for t in r.token_ids],
                  "finish_reason": pb.FinishReason.Name(final.finish_reason),
                  "stats": {name: getattr(final.stats, name) for name in sys.argv[4].split(",")}}))
"""
PROMPT = "a b a b a b a b"


def build_stubs(proto_root: Path, out: Path) -> Path:
    """Stubs of ``proto_root``'s contract under ``out`` (a package ``specsplit.v1`` of their own)."""
    out.mkdir(parents=True)
    args = ["grpc_tools.protoc", f"--proto_path={proto_root}", f"--python_out={out}", f"--grpc_python_out={out}",
            CONTRACT]
    assert protoc.main(args) == 0
    (out / "specsplit" / "__init__.py").touch()
    (out / "specsplit" / "v1" / "__init__.py").touch()
    return out


def old_client(stubs: Path, address: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-c", OLD_CLIENT, str(stubs), address, PROMPT, ",".join(STATS)],
                         capture_output=True, text=True, timeout=180, env=env, cwd=stubs)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def current_client(address: str) -> dict:
    request = pb.GenerateRequest(prompt=PROMPT, chat=False, max_new_tokens=8, k=4, adaptive_k=False,
                                 drafter=pb.DRAFTER_KIND_NGRAM, sampling=pb.SamplingParams(temperature=0),
                                 return_token_ids=True)
    with grpc.insecure_channel(address) as channel:
        replies = list(pb_grpc.GeneratorStub(channel).Generate(request, timeout=120))
    final = replies[-1]
    return {"text": "".join(r.text for r in replies), "ids": [t for r in replies for t in r.token_ids],
            "finish_reason": pb.FinishReason.Name(final.finish_reason),
            "stats": {name: getattr(final.stats, name) for name in STATS}}


def test_a_client_built_from_the_baseline_is_served_as_a_current_one(public_api, tmp_path):
    stubs = build_stubs(BASELINE, tmp_path / "baseline-stubs")
    old, new = old_client(stubs, public_api), current_client(public_api)
    assert new["finish_reason"] == "FINISH_REASON_LENGTH" and len(new["ids"]) == 8
    assert new["stats"]["k"] == 4 and new["stats"]["new_tokens"] == 8 and new["stats"]["rounds"] > 0
    # how many rounds and draft tokens it took depends on whether each draft met its round's deadline (timing,
    # under load); every field the client sent and the text it got back must match
    for reply in (old, new):
        assert reply["stats"]["rounds"] > 0
        for name in TIMED:
            reply["stats"].pop(name)
    assert old == new, (old, new)


def test_a_renumbered_client_is_caught_by_the_same_comparison(public_api, tmp_path):
    """Negative control: the baseline with max_new_tokens and k swapped, as a renumbering leaves a client."""
    text = (BASELINE / CONTRACT).read_text()
    swapped = text.replace("optional uint32 max_new_tokens = 3;", "optional uint32 max_new_tokens = 6;")
    swapped = swapped.replace("optional uint32 k = 6;", "optional uint32 k = 3;")
    assert swapped.count("= 6;") == text.count("= 6;") and swapped != text
    root = tmp_path / "renumbered"
    (root / CONTRACT).parent.mkdir(parents=True)
    (root / CONTRACT).write_text(swapped)
    old = old_client(build_stubs(root, tmp_path / "renumbered-stubs"), public_api)
    assert old != current_client(public_api)
    assert len(old["ids"]) == 4  # the server read k = 4 as max_new_tokens


# An orchestrator built from the baseline: it reads the target's Info, then opens a session as it always did.
OLD_ORCHESTRATOR = """
import os
import sys
sys.path.insert(0, sys.argv[1])
import grpc
from specsplit.v1 import specsplit_pb2 as pb, specsplit_pb2_grpc as pb_grpc
with grpc.insecure_channel(sys.argv[2]) as channel:
    stub = pb_grpc.TargetServiceStub(channel)
    info = stub.Info(pb.InfoRequest(), timeout=30)
    print(info.model_id, info.max_context, info.max_block)
    opening = pb.TargetRequest(open=pb.TargetOpen(session_id="old", tokens=[1, 2, 3],
                                                  sampling=pb.SamplingParams(temperature=0)))
    try:
        print(list(stub.Session(iter([opening]), timeout=30)))
    except grpc.RpcError as exc:
        print(exc.code().name)
        print(exc.details())
    sys.stdout.flush()
    os._exit(0)  # all it read is printed; closing grpc after a stream refused unread has stalled past the timeout
"""


def test_services_and_the_generator_state_their_wire_versions(tiny_services, public_api):
    from specsplit.lmkit import wire_version

    with grpc.insecure_channel(tiny_services.target_address) as channel:
        target = pb_grpc.TargetServiceStub(channel).Info(pb.InfoRequest(), timeout=30)
    with grpc.insecure_channel(tiny_services.draft_address) as channel:
        draft = pb_grpc.DraftServiceStub(channel).Info(pb.InfoRequest(), timeout=30)
    with grpc.insecure_channel(public_api) as channel:
        generator = pb_grpc.GeneratorStub(channel).Info(pb.InfoRequest(), timeout=30)
    assert (target.wire_version, target.min_wire_version) == (wire_version.WIRE_VERSION, 2)
    assert (draft.wire_version, draft.min_wire_version) == (wire_version.WIRE_VERSION, 2)
    assert (generator.wire_version, generator.min_wire_version) == (wire_version.WIRE_VERSION, 1)
    assert generator.model_id == target.model_id and generator.max_context == target.max_context


def test_an_orchestrator_built_from_the_baseline_is_refused_by_name(tiny_services, tmp_path):
    """It reads Info right (the numbers are its own) and its session is refused before the target reads it."""
    stubs = build_stubs(BASELINE, tmp_path / "baseline-stubs")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-c", OLD_ORCHESTRATOR, str(stubs), tiny_services.target_address],
                         capture_output=True, text=True, timeout=120, env=env, cwd=stubs)
    assert run.returncode == 0, run.stderr
    identity, code, details = run.stdout.strip().split("\n")
    engine = tiny_services.target_engine
    assert identity == f"{engine.model_id} {engine.max_context} {engine.limits.max_block}"
    assert code == "FAILED_PRECONDITION"
    assert "speaks specsplit.v1 wire version 2 and accepts orchestrators of version 2 or later" in details
    assert "the orchestrator speaks wire version 1 (it states none" in details


@pytest.mark.parametrize("rpc", ["Session", "Sessions"])
@pytest.mark.parametrize("service", ["target", "draft"])
def test_a_session_stream_is_refused_or_served_by_the_version_stated(tiny_services, service, rpc):
    from specsplit.lmkit.wire_version import METADATA_KEY

    address, stub_type = {
        "target": (tiny_services.target_address, pb_grpc.TargetServiceStub),
        "draft": (tiny_services.draft_address, pb_grpc.DraftServiceStub),
    }[service]

    def first_reply(metadata):
        with grpc.insecure_channel(address) as channel:
            call = getattr(stub_type(channel), rpc)(iter([]), metadata=metadata, timeout=30)
            try:
                return list(call), None
            except grpc.RpcError as exc:
                return None, exc

    served, error = first_reply(((METADATA_KEY, "3"),))  # a newer orchestrator speaks down to this service
    assert error is None and served == []
    for metadata, code, says in [
        ((), grpc.StatusCode.FAILED_PRECONDITION, "wire version 1 (it states none"),
        (((METADATA_KEY, "1"),), grpc.StatusCode.FAILED_PRECONDITION, "the orchestrator speaks wire version 1"),
        (((METADATA_KEY, "two"),), grpc.StatusCode.INVALID_ARGUMENT, "must be a positive integer; got 'two'"),
    ]:
        _, error = first_reply(metadata)
        assert error is not None and error.code() == code and says in error.details(), metadata


def test_an_orchestrator_refuses_a_service_that_states_no_version(background_loop, tiny_target_dir):
    """A service from before versions were stated answers Info without them: the orchestrator refuses it at
    connect, naming both versions, instead of reading the timings it would not send."""
    from specsplit.lmkit import errors
    from specsplit.lmkit.grpc_server import start_in_process
    from specsplit.orchestrator.api.config import OrchestratorConfig
    from specsplit.orchestrator.api.generation import Orchestrator

    class Unversioned(pb_grpc.TargetServiceServicer):
        async def Info(self, request, context):
            return pb.ModelInfo(model_id="old-target", vocab_size=49152, max_context=2048, max_block=16)

    server, port = background_loop.run(start_in_process(
        Unversioned(), pb_grpc.add_TargetServiceServicer_to_server, "specsplit.v1.TargetService"))
    try:
        config = OrchestratorConfig(f"127.0.0.1:{port}", "", str(tiny_target_dir), connect_timeout_s=10)
        with pytest.raises(errors.FailedPrecondition) as refused:
            background_loop.run(Orchestrator.connect(config))
    finally:
        background_loop.run(server.stop(0))
    message = str(refused.value)
    assert f"the target at 127.0.0.1:{port} speaks specsplit.v1 wire version 1 (it states none" in message
    assert "this orchestrator speaks wire version 2 and accepts targets of version 2 or later" in message


@pytest.mark.parametrize("noticed", [True, False], ids=["channel-noticed", "channel-still-ready"])
def test_a_target_restarted_at_its_address_as_an_older_build_is_checked_again(background_loop, tiny_target_dir,
                                                                              noticed):
    """The orchestrator's target stops and a build that states no version starts at the same address: the next
    generation is refused by name (FAILED_PRECONDITION, both versions) before any session uses it, instead of
    reading the timings the old build would not send; the current build back at the address serves again. Where
    the channel has not noticed the restart yet (still READY: a loaded machine), the open that the old build does
    not implement makes the orchestrator ask again, with the same refusal."""

    import asyncio

    from specsplit.lmkit import errors
    from specsplit.lmkit.grpc_server import start_in_process
    from specsplit.lmkit.kinds import DrafterKind
    from specsplit.lmkit.sampling import SamplingParams
    from specsplit.orchestrator.api.config import OrchestratorConfig
    from specsplit.orchestrator.api.generation import GenerationRequest, Orchestrator
    from specsplit.target_service.server import start_server
    from tests.conftest import make_engines

    class Unversioned(pb_grpc.TargetServiceServicer):
        async def Info(self, request, context):
            return pb.ModelInfo(model_id="old-target", vocab_size=49152, max_context=2048, max_block=16)

    target, _ = make_engines(str(tiny_target_dir), None)
    server, port = background_loop.run(start_server(target))
    address = f"127.0.0.1:{port}"
    orch = background_loop.run(Orchestrator.connect(OrchestratorConfig(address, "", str(tiny_target_dir))))
    request = GenerationRequest("", False, 8, SamplingParams(), (), 0, DrafterKind.NGRAM, False)

    async def generate() -> list[int]:
        return [t async for event in orch.generate(request, orch.encode(PROMPT, False)) for t in event.token_ids]

    try:
        served = background_loop.run(generate())
        assert len(served) == 8
        background_loop.run(server.stop(0))
        server, _ = background_loop.run(start_in_process(
            Unversioned(), pb_grpc.add_TargetServiceServicer_to_server, "specsplit.v1.TargetService", address))
        if not noticed:  # the channel reconnects to the old build before the next open: READY, nothing failed
            (replica,) = orch.target.replicas
            background_loop.run(asyncio.wait_for(replica.channel.channel_ready(), 30))
            assert not replica.may_have_restarted
        with pytest.raises(errors.FailedPrecondition) as refused:
            background_loop.run(generate())
        message = str(refused.value)
        assert f"the target at {address} speaks specsplit.v1 wire version 1 (it states none" in message, message
        background_loop.run(server.stop(0))
        server, _ = background_loop.run(start_server(target, address))
        for _ in range(50):  # the channel reconnects; the replica is checked again and serves
            try:
                assert background_loop.run(generate()) == served
                break
            except errors.SpecsplitError:
                background_loop.run(asyncio.sleep(0.2))
        else:
            pytest.fail("the current build back at the address was never served")
    finally:
        background_loop.run(server.stop(0))
        background_loop.run(orch.close())
