"""The draft and target authenticate their callers: bearer tokens from a rotating file, allowed certificate
names, per-caller session quotas; health stays open, and greedy output through it all equals the target's."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
from argparse import Namespace

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specsplit.draft_service.server import start_server as start_draft
from specsplit.lmkit import errors
from specsplit.lmkit.auth import Tokens
from specsplit.lmkit.caller_check import CallerPolicy, caller_policy
from specsplit.lmkit.grpc_server import ComputeThread, start_in_process
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.processes import start_service
from specsplit.lmkit.security import ClientTls, ServerTls, open_channel
from specsplit.lmkit.sessions import SessionLimits
from specsplit.lmkit.wire_version import metadata as wire_metadata
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import Orchestrator
from specsplit.target_service.server import SERVICE_NAME as TARGET_SERVICE
from specsplit.target_service.server import start_server as start_target
from specsplit.target_service.servicer import TargetServicer
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from tests.conftest import run_async, wait_until
from tests.services.test_greedy_e2e import generate_ids

pytestmark = pytest.mark.services
VERSION = wire_metadata()  # what an orchestrator of this build states on every call

GREEDY = pb.SamplingParams()


def _bearer(token: str):
    return (("authorization", f"Bearer {token}"),)


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "tokens"
    path.write_text("alice token-of-alice\nbob token-of-bob\n")
    return path


@pytest.fixture(scope="module")
def guarded(tiny_services, token_file, background_loop):
    """The tiny target and draft engines behind servers that require a token of ``token_file``."""
    target, target_port = background_loop.run(start_target(
        tiny_services.target_engine, policy=CallerPolicy("target", Tokens(path=str(token_file)))))
    draft, draft_port = background_loop.run(start_draft(
        tiny_services.draft_engine, policy=CallerPolicy("draft", Tokens(path=str(token_file)))))
    yield {"target": f"127.0.0.1:{target_port}", "draft": f"127.0.0.1:{draft_port}"}
    background_loop.run(target.stop(0))
    background_loop.run(draft.stop(0))


def _stub(service: str, channel):
    return (pb_grpc.TargetServiceStub if service == "target" else pb_grpc.DraftServiceStub)(channel)


def _open_message(service: str, session_id: str):
    if service == "target":
        return pb.TargetOpen(session_id=session_id, tokens=[1, 2, 3], sampling=GREEDY, mode=pb.VERIFICATION_MODE_GREEDY)
    return pb.DraftOpen(session_id=session_id, tokens=[1, 2, 3], sampling=GREEDY, drafter=pb.DRAFTER_KIND_NGRAM)


async def _call(service: str, address: str, method: str, metadata=()):
    """One call of ``method`` (Info, Session's open, or Sessions' open); its answer (AioRpcError when refused)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = _stub(service, channel)
        if method == "Info":
            return await stub.Info(pb.InfoRequest(), metadata=metadata, timeout=10)
        if method == "Session":
            call = stub.Session(metadata=(*metadata, *VERSION), timeout=10)
            request = pb.TargetRequest if service == "target" else pb.DraftRequest
            message = request(open=_open_message(service, "auth-own"))
        else:
            call = stub.Sessions(metadata=(*metadata, *VERSION), timeout=10)
            calls, one = (pb.TargetCalls, pb.TargetCall) if service == "target" else (pb.DraftCalls, pb.DraftCall)
            message = calls(calls=[one(session_id="auth-mux", open=_open_message(service, ""))])
        try:
            await call.write(message)
            answer = await call.read()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            answer = grpc.aio.EOF  # the server ended the call first (a refusal): its status tells why
        if answer is grpc.aio.EOF:
            raise grpc.aio.AioRpcError(await call.code(), grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       await call.details())
        await call.done_writing()
        return answer


@pytest.mark.parametrize("method", ["Info", "Session", "Sessions"])
@pytest.mark.parametrize("service", ["target", "draft"])
@pytest.mark.parametrize("metadata", [(), _bearer("token-of-mallory"), (("authorization", "token-of-alice"),)])
def test_a_caller_without_a_valid_token_is_unauthenticated(guarded, service, method, metadata):
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        run_async(_call(service, guarded[service], method, metadata))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "--auth-token-file" in refused.value.details() and "--peer-token-file" in refused.value.details()


@pytest.mark.parametrize("method", ["Info", "Session", "Sessions"])
@pytest.mark.parametrize("service", ["target", "draft"])
def test_a_caller_with_a_token_is_served_and_health_needs_none(guarded, service, method, tiny_services):
    answer = run_async(_call(service, guarded[service], method, _bearer("token-of-bob")))
    assert answer.ByteSize() > 0

    async def health():
        async with grpc.aio.insecure_channel(guarded[service]) as channel:
            return await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)

    assert run_async(health()).status == health_pb2.HealthCheckResponse.SERVING
    engine = tiny_services.target_engine if service == "target" else tiny_services.draft_engine
    assert wait_until(lambda: engine.sessions.stats()[0] == 0)


def test_a_rotated_token_file_takes_effect_without_a_restart(tiny_services, tmp_path, background_loop):
    path = tmp_path / "tokens"
    path.write_text("first-token\n")
    server, port = background_loop.run(start_target(
        tiny_services.target_engine, policy=CallerPolicy("target", Tokens(path=str(path), grace_s=0.0))))
    address = f"127.0.0.1:{port}"

    def accepts(token: str) -> bool:
        try:
            run_async(_call("target", address, "Info", _bearer(token)))
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
            return False
        return True

    try:
        assert accepts("first-token") and not accepts("second-token")
        path.write_text("second-token\n")
        assert wait_until(lambda: accepts("second-token"), timeout_s=5)
        assert not accepts("first-token")  # no grace window here
    finally:
        background_loop.run(server.stop(0))


def test_one_caller_is_capped_while_another_still_gets_in(guarded, tiny_services):
    engine = tiny_services.target_engine
    original = engine.sessions.limits
    engine.sessions.limits = SessionLimits(max_block=original.max_block, max_sessions=8, max_sessions_per_caller=2)

    async def go():
        async with grpc.aio.insecure_channel(guarded["target"]) as channel:
            stub = pb_grpc.TargetServiceStub(channel)

            async def open_as(token: str, session_id: str):
                call = stub.Session(metadata=(*_bearer(token), *VERSION))
                await call.write(pb.TargetRequest(open=_open_message("target", session_id)))
                return call, await call.read()

            held = [await open_as("token-of-alice", f"alice-{i}") for i in range(2)]
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await open_as("token-of-alice", "alice-2")
            bob, opened = await open_as("token-of-bob", "bob-0")
            for call, _ in [*held, (bob, opened)]:
                call.cancel()
            return refused.value, opened

    try:
        refused, bob_opened = run_async(go())
    finally:
        engine.sessions.limits = original
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "caller 'alice' holds its maximum of 2 sessions" in refused.details()
    assert "--max-sessions-per-caller" in refused.details()
    assert bob_opened.opened.session_id == "bob-0"
    assert wait_until(lambda: engine.sessions.stats()[0] == 0)


@pytest.mark.parametrize("shared_stream_from", [0, 1])
def test_greedy_with_tokens_on_equals_target_only(guarded, token_file, tiny_target_dir, tiny_reference, tmp_path,
                                                 shared_stream_from):
    """The whole speculative path, each hop authenticated, on own streams and on the shared Sessions stream."""
    peer_file = tmp_path / "peer-token"
    peer_file.write_text("token-of-alice\n")
    prompts_ids, expected = tiny_reference
    config = OrchestratorConfig(guarded["target"], guarded["draft"], str(tiny_target_dir),
                                peer_token_file=str(peer_file), shared_stream_from=shared_stream_from)

    async def go():
        orch = await Orchestrator.connect(config)
        try:
            return [await generate_ids(orch, ids, 4, DrafterKind.MODEL, 24) for ids in prompts_ids]
        finally:
            await orch.close()

    assert run_async(go()) == expected


def test_an_orchestrator_without_the_token_is_told_which_flag_to_set(guarded, tiny_target_dir):
    config = OrchestratorConfig(guarded["target"], "", str(tiny_target_dir), connect_timeout_s=5)
    with pytest.raises(errors.Unauthenticated, match="refused the orchestrator .*--peer-token-file"):
        run_async(Orchestrator.connect(config))


# -- mTLS: an allowed client identity ------------------------------------------------------------------------------


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _certificate(subject: str, sans: list[x509.GeneralName], key, issuer: x509.Name, issuer_key, ca: bool):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def named_pki(tmp_path_factory):
    """A CA; a server certificate for 127.0.0.1; client certificates named `orchestrator.specsplit` and `intruder`."""
    out = tmp_path_factory.mktemp("named-pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("test CA", [], ca_key, _name("test CA"), ca_key, ca=True)
    (out / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    names = {
        "server": [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
        "orchestrator": [x509.DNSName("orchestrator.specsplit")],
        "intruder": [x509.DNSName("intruder.specsplit")],
    }
    for who, sans in names.items():
        key = ec.generate_private_key(ec.SECP256R1())
        (out / f"{who}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        cert = _certificate(who, sans, key, ca.subject, ca_key, ca=False)
        (out / f"{who}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return out


def test_mtls_refuses_a_certificate_of_the_ca_without_an_allowed_name(named_pki, tiny_services, tiny_target_dir,
                                                                     background_loop):
    servicer = TargetServicer(ComputeThread("san-target"))
    servicer.attach(tiny_services.target_engine)
    tls = ServerTls(str(named_pki / "server.pem"), str(named_pki / "server.key"), ca=str(named_pki / "ca.pem"))
    policy = CallerPolicy("target", allowed_sans=frozenset({"orchestrator.specsplit"}))
    server, port = background_loop.run(start_in_process(
        servicer, pb_grpc.add_TargetServiceServicer_to_server, TARGET_SERVICE, tls=tls, policy=policy))

    def client(who: str) -> ClientTls:
        return ClientTls(ca=str(named_pki / "ca.pem"), cert=str(named_pki / f"{who}.pem"),
                         key=str(named_pki / f"{who}.key"))

    async def info(who: str):
        async with open_channel(f"127.0.0.1:{port}", client(who)) as channel:
            return await pb_grpc.TargetServiceStub(channel).Info(pb.InfoRequest(), timeout=10)

    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            run_async(info("intruder"))
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "intruder.specsplit" in refused.value.details() and "--tls-allowed-sans" in refused.value.details()
        assert run_async(info("orchestrator")).vocab_size > 0
        config = OrchestratorConfig(f"127.0.0.1:{port}", "", str(tiny_target_dir), peer_tls=client("orchestrator"))

        async def generate():
            orch = await Orchestrator.connect(config)
            try:
                return await generate_ids(orch, [1, 2, 3], 0, DrafterKind.NGRAM, 4)
            finally:
                await orch.close()

        assert len(run_async(generate())) == 4
    finally:
        background_loop.run(server.stop(0))


def test_the_flags_protect_a_real_service_process(tmp_path):
    """`serve-draft --auth-token-file`: the flag wiring, end to end in its own process."""
    path = tmp_path / "tokens"
    path.write_text("process-token\n")
    draft = start_service("specsplit.draft_service.server", "draft", ["--auth-token-file", str(path)], tmp_path, 120)
    address = f"127.0.0.1:{draft.port}"
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            run_async(_call("draft", address, "Info"))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert run_async(_call("draft", address, "Info", _bearer("process-token"))).drafters
    finally:
        draft.stop()


def test_allowed_sans_need_mtls():
    args = Namespace(tls_allowed_sans="a.example", tls_ca="", auth_token_file="", auth_token_grace_s=1.0)
    with pytest.raises(ValueError, match="needs --tls-ca"):
        caller_policy(args, "draft")

