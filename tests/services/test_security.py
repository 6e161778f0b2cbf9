"""TLS, mTLS and the bearer token, with certificates made in the test: clients without them are refused."""

from __future__ import annotations

import datetime
import ipaddress

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specsplit.lmkit import errors
from specsplit.lmkit.auth import Tokens
from specsplit.lmkit.grpc_server import ComputeThread, start_in_process
from specsplit.lmkit.security import ClientTls, ServerTls
from specsplit.orchestrator.api import openai_server
from specsplit.orchestrator.api.config import OrchestratorConfig
from specsplit.orchestrator.api.generation import Orchestrator
from specsplit.orchestrator.api.server import build_parser, public_tokens, start_server
from specsplit.target_service.server import SERVICE_NAME as TARGET_SERVICE
from specsplit.target_service.servicer import TargetServicer
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from tests.conftest import run_async

pytestmark = pytest.mark.services


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(subject: str, key, issuer_name, issuer_key, ca: bool, server: bool,
           addresses: tuple[str, ...] = ("127.0.0.1",)) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        san = [x509.DNSName("localhost"), *(x509.IPAddress(ipaddress.ip_address(a)) for a in addresses)]
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""
    return write_pki(tmp_path_factory.mktemp("pki"))


def write_pki(out, addresses: tuple[str, ...] = ("127.0.0.1",)) -> dict[str, str]:
    """A CA, a server certificate for ``addresses`` and a client certificate as PEM files in ``out``; name -> path."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _issue("specsplit test CA", ca_key, _name("specsplit test CA"), ca_key, ca=True, server=False)
    files = {"ca": ca}
    for who, server in (("server", True), ("client", False)):
        key = ec.generate_private_key(ec.SECP256R1())
        files[who] = _issue(who, key, ca.subject, ca_key, ca=False, server=server, addresses=addresses)
        (out / f"{who}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    for who, cert in files.items():
        (out / f"{who}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return {name: str(out / name) for name in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


def tls_target(loop, engine, tls: ServerTls):
    servicer = TargetServicer(ComputeThread("tls-target"))
    servicer.attach(engine)
    return loop.run(start_in_process(servicer, pb_grpc.add_TargetServiceServicer_to_server, TARGET_SERVICE, tls=tls))


async def generate_once(config: OrchestratorConfig) -> str:
    orch = await Orchestrator.connect(config)
    try:
        from specsplit.lmkit.kinds import DrafterKind
        from tests.services.test_greedy_e2e import generate_ids

        return await generate_ids(orch, [1, 2, 3], 0, DrafterKind.NGRAM, 4)
    finally:
        await orch.close()


def test_tls_target_serves_a_client_that_trusts_its_ca_only(pki, tiny_services, tiny_target_dir, background_loop):
    server, port = tls_target(background_loop, tiny_services.target_engine, ServerTls(pki["server.pem"], pki["server.key"]))
    try:
        good = OrchestratorConfig(f"127.0.0.1:{port}", "", str(tiny_target_dir), peer_tls=ClientTls(ca=pki["ca.pem"]))
        assert len(run_async(generate_once(good))) == 4
        plain = OrchestratorConfig(f"127.0.0.1:{port}", "", str(tiny_target_dir), connect_timeout_s=2)
        with pytest.raises(errors.Unavailable, match="could not reach"):
            run_async(generate_once(plain))
    finally:
        background_loop.run(server.stop(0))


def test_mtls_target_refuses_a_client_without_a_certificate(pki, tiny_services, tiny_target_dir, background_loop):
    tls = ServerTls(pki["server.pem"], pki["server.key"], ca=pki["ca.pem"])
    server, port = tls_target(background_loop, tiny_services.target_engine, tls)
    address = f"127.0.0.1:{port}"
    try:
        anonymous = OrchestratorConfig(address, "", str(tiny_target_dir), connect_timeout_s=2,
                                       peer_tls=ClientTls(ca=pki["ca.pem"]))
        with pytest.raises(errors.Unavailable):
            run_async(generate_once(anonymous))
        with_cert = ClientTls(ca=pki["ca.pem"], cert=pki["client.pem"], key=pki["client.key"])
        assert len(run_async(generate_once(OrchestratorConfig(address, "", str(tiny_target_dir), peer_tls=with_cert)))) == 4
    finally:
        background_loop.run(server.stop(0))


@pytest.fixture(scope="module")
def token_api(tiny_services, tiny_target_dir, background_loop):
    config = OrchestratorConfig(tiny_services.target_address, tiny_services.draft_address, str(tiny_target_dir))
    orch = background_loop.run(Orchestrator.connect(config))
    server, port = background_loop.run(start_server(orch, tokens=Tokens(fixed="s3cret")))
    yield f"127.0.0.1:{port}"
    background_loop.run(server.stop(0))
    background_loop.run(orch.close())


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),), (("authorization", "s3cret"),)])
def test_public_api_refuses_a_missing_or_wrong_token(token_api, metadata):
    async def go():
        async with grpc.aio.insecure_channel(token_api) as channel:
            return [r async for r in pb_grpc.GeneratorStub(channel).Generate(
                pb.GenerateRequest(prompt="hi", max_new_tokens=2), metadata=metadata)]

    with pytest.raises(grpc.aio.AioRpcError) as info:
        run_async(go())
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in info.value.details()


def test_public_api_serves_the_right_token_and_open_health(token_api):
    async def go():
        async with grpc.aio.insecure_channel(token_api) as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            replies = [r async for r in pb_grpc.GeneratorStub(channel).Generate(
                pb.GenerateRequest(prompt="hi", max_new_tokens=2), metadata=(("authorization", "Bearer s3cret"),))]
            return health, replies

    health, replies = run_async(go())
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert replies[-1].HasField("stats")


def test_a_rotated_public_token_file_takes_effect_on_grpc_and_http_without_restart(
    tiny_services, tiny_target_dir, background_loop, tmp_path
):
    """The public API's --auth-token-file is re-read like the services': the new token is accepted and the old
    one refused (no grace) on both Generate and HTTP, with no restart."""
    import urllib.error
    import urllib.request

    token_file = tmp_path / "token"
    token_file.write_text("old-token\n")
    args = build_parser().parse_args(["--auth-token-file", str(token_file), "--auth-token-grace-s", "0"])
    tokens = public_tokens(args)
    config = OrchestratorConfig(tiny_services.target_address, tiny_services.draft_address, str(tiny_target_dir))
    orch = background_loop.run(Orchestrator.connect(config))
    server, port = background_loop.run(start_server(orch, tokens=tokens))
    http = background_loop.run(openai_server.start_http_server(openai_server.build_app(orch, tokens), "127.0.0.1", 0))

    def grpc_code(token: str) -> grpc.StatusCode:
        async def go():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                [r async for r in pb_grpc.GeneratorStub(channel).Generate(
                    pb.GenerateRequest(prompt="hi", max_new_tokens=2), metadata=(("authorization", f"Bearer {token}"),))]
        try:
            run_async(go())
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    def http_status(token: str) -> int:
        request = urllib.request.Request(f"http://127.0.0.1:{http.port}/v1/models",
                                         headers={"Authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code

    try:
        assert (grpc_code("old-token"), http_status("old-token")) == (grpc.StatusCode.OK, 200)
        token_file.write_text("new-token\n")
        assert (grpc_code("new-token"), http_status("new-token")) == (grpc.StatusCode.OK, 200)
        assert (grpc_code("old-token"), http_status("old-token")) == (grpc.StatusCode.UNAUTHENTICATED, 401)
    finally:
        background_loop.run(http.stop())
        background_loop.run(server.stop(0))
        background_loop.run(orch.close())


def test_tls_flags_are_checked():
    with pytest.raises(ValueError, match="go together"):
        ServerTls(cert="a.pem")
    with pytest.raises(ValueError, match="needs --tls-cert"):
        ServerTls(ca="ca.pem")
    with pytest.raises(ValueError, match="needs --peer-tls-ca"):
        ClientTls(cert="c.pem", key="c.key")


def test_health_port_answers_plaintext_probes_while_the_main_port_requires_mtls(pki, tmp_path):
    """Kubernetes gRPC probes cannot present certificates: --health-port serves health alone, plaintext."""
    from specsplit.lmkit.processes import start_service
    from specsplit.target_service.ranks import free_port

    health_port = free_port()
    tls = ["--tls-cert", pki["server.pem"], "--tls-key", pki["server.key"], "--tls-ca", pki["ca.pem"]]
    draft = start_service("specsplit.draft_service.server", "draft", [*tls, "--health-port", str(health_port)], tmp_path, 120)

    async def probe():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as only_health:
                await pb_grpc.DraftServiceStub(channel).Info(pb.InfoRequest(), timeout=10)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{draft.port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as plaintext:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return health.status, only_health.value.code(), plaintext.value.code()

    try:
        status, other, plaintext = run_async(probe())
    finally:
        draft.stop()
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert other == grpc.StatusCode.UNIMPLEMENTED  # the probe port exposes nothing but health
    assert plaintext == grpc.StatusCode.UNAVAILABLE  # the service port still refuses plaintext
