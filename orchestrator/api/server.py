"""``specsplit serve``: the public Generate API in front of a draft and a target service."""

from __future__ import annotations

import argparse
import logging

from specsplit.lmkit import entry, event_loop, logs, models
from specsplit.lmkit.auth import Tokens
from specsplit.lmkit.grpc_server import (
    add_servicer,
    add_tls_flags,
    create_server,
    serve_until_signal,
    server_tls,
    set_serving,
    start_in_process,
    write_port_file,
)
from specsplit.lmkit.heap import freeze_startup_heap
from specsplit.lmkit.kinds import DrafterKind, VerificationMode
from specsplit.lmkit.message_limits import generate_request_bytes
from specsplit.lmkit.metrics import serve_metrics
from specsplit.lmkit.security import BearerTokenInterceptor, ClientTls
from specsplit.orchestrator.api.config import (
    DEFAULT_DRAFTER,
    DEFAULT_K,
    DEFAULT_SAMPLING_MODE,
    DEFAULT_TREE_BRANCHES,
    HttpLimits,
    OrchestratorConfig,
)
from specsplit.orchestrator.api.generation import Orchestrator
from specsplit.orchestrator.api.servicer import GeneratorServicer
from specsplit.orchestrator.api.tool_parsers import FORMATS
from specsplit.orchestrator.decode.links import LinkPolicy
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generator"].full_name
DEFAULT_PORT = 50050
log = logging.getLogger(__name__)


def add_orchestrator_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="127.0.0.1:50052",
                        help="target service address; several replicas separated by commas (a pool: each session "
                             "on the least loaded, moved to another when its replica fails)")
    parser.add_argument("--draft", default="127.0.0.1:50051",
                        help="draft service address, or replicas separated by commas; '' = target-only")
    parser.add_argument("--tokenizer", default=models.DEFAULT_MODEL, help="tokenizer (model reference) of the target")
    parser.add_argument("--k", type=int, default=DEFAULT_K, help="default draft block size")
    parser.add_argument(
        "--drafter", default=DEFAULT_DRAFTER.name.lower(), choices=[k.name.lower() for k in DrafterKind],
        help="default drafter",
    )
    parser.add_argument(
        "--fixed-k", action="store_true", help="draft exactly k each round instead of adapting k in [0, k]"
    )
    parser.add_argument(
        "--no-overlap", action="store_true",
        help="draft and verify in turn instead of drafting block i+1 while the target verifies block i",
    )
    parser.add_argument(
        "--tree-branches", type=int, default=DEFAULT_TREE_BRANCHES,
        help="continuations a round may verify together as a token tree (kept where they pay; GREEDY and "
        "TOKEN_ONLY rounds only); 1 = chains only",
    )
    parser.add_argument(
        "--sampling-mode", default=DEFAULT_SAMPLING_MODE.name.lower().replace("_", "-"), choices=["coupled", "token-only"],
        help="how sampled requests that name no mode are verified (docs/protocol.md, Seeds)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=128, help="default max new tokens per request")
    parser.add_argument("--max-new-tokens-limit", type=int, default=4096,
                        help="the most new tokens a request may ask for (larger requests get INVALID_ARGUMENT / 400)")
    parser.add_argument("--served-model-name", action="append", default=[],
                        help="a model name the HTTP API answers to (repeatable); default: the target's model name")
    parser.add_argument(
        "--generation-config", default="auto", choices=["auto", "ignore"],
        help="auto: the target's generation_config.json sampling defaults (temperature, top_k, top_p, "
        "repetition_penalty) apply where a request leaves them unset; ignore: they do not",
    )
    parser.add_argument("--chat-template", default="",
                        help="a Jinja chat template file to render conversations (and tools) with, instead of the "
                             "tokenizer's own; hermes-tools: the bundled ChatML template with Hermes-style tools "
                             "(for the default model)")
    parser.add_argument("--tool-call-parser", default="hermes", choices=sorted(FORMATS),
                        help="how the model writes tool calls: the grammar of a forced call and the parser of the "
                             "output (hermes: <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='accept tool_choice "auto" (the default with tools): free text with the tool calls '
                             "parsed out of it")
    parser.add_argument("--ngram-min", type=int, default=2)
    parser.add_argument("--ngram-max", type=int, default=4)
    parser.add_argument("--connect-timeout-s", type=float, default=120.0, help="wait this long for the services")
    parser.add_argument("--max-concurrent", type=int, default=64,
                        help="generations in flight at most; more get RESOURCE_EXHAUSTED")
    parser.add_argument("--max-concurrent-per-caller", type=int, default=0,
                        help="generations one caller (bearer token, else client address) may run at once; "
                             "more get RESOURCE_EXHAUSTED / 429 (0: no bound but --max-concurrent)")
    parser.add_argument("--max-n", type=int, default=16,
                        help="samples one request may ask for (GenerateRequest.n, OpenAI's n); each counts as a "
                             "generation against --max-concurrent; more get INVALID_ARGUMENT / 400")
    parser.add_argument("--max-generation-s", type=float, default=600.0,
                        help="a generation running longer ends with DEADLINE_EXCEEDED / 504 (0: no bound)")
    parser.add_argument("--grpc-stalled-send-s", type=float, default=30.0,
                        help="a Generate client that reads nothing of its stream this long loses it (and its slot)")
    parser.add_argument("--max-prompt-bytes", type=int, default=0,
                        help="UTF-8 bytes a prompt (all its turns) may have, checked before tokenizing "
                             "(0: the target's context length times the tokenizer's longest token)")
    parser.add_argument("--tokenize-threads", type=int, default=2,
                        help="threads that tokenize prompts, render chat templates and compile grammars, off the "
                             "event loop")
    parser.add_argument("--grammar-timeout-s", type=float, default=10.0,
                        help="a request's grammar that takes longer to compile is refused (400 / INVALID_ARGUMENT); "
                             "0: no bound")
    parser.add_argument("--draft-timeout-s", type=float, default=5.0, help="a propose slower than this drops the draft")
    parser.add_argument("--draft-deadline-s", type=float, default=0.0,
                        help="how long a round waits for a draft block before the target steps alone "
                             "(0: from the draft link's measured round trip, jitter and cost)")
    parser.add_argument("--target-deadline-s", type=float, default=30.0,
                        help="a target down this long fails in-flight generations with UNAVAILABLE")
    parser.add_argument("--resolve-every-s", type=float, default=10.0,
                        help="a --target/--draft of dns:///NAME:PORT is a pool of every address NAME resolves to, "
                             "resolved again this often (replicas added and removed while serving)")
    parser.add_argument("--load-every-s", type=float, default=1.0,
                        help="read each pool replica's Stats this often and place new sessions by the sessions and "
                             "KV budget it reports (every orchestrator's); 0: by this orchestrator's sessions alone")
    parser.add_argument("--shared-stream-from", type=int, default=4,
                        help="carry new sessions on one shared stream per service (one message per batched step) "
                             "once this many generations are in flight, else on streams of their own; "
                             "1: always, 0: never")


def config_from_args(args) -> OrchestratorConfig:
    return OrchestratorConfig(
        target_address=args.target,
        draft_address=args.draft,
        tokenizer=args.tokenizer,
        default_k=args.k,
        default_drafter=DrafterKind[args.drafter.upper()],
        default_adaptive_k=not args.fixed_k,
        default_overlap=not args.no_overlap,
        default_tree_branches=args.tree_branches,
        default_sampling_mode=VerificationMode[args.sampling_mode.upper().replace("-", "_")],
        default_max_new_tokens=args.max_new_tokens,
        max_new_tokens_limit=args.max_new_tokens_limit,
        served_model_names=tuple(args.served_model_name),
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        connect_timeout_s=args.connect_timeout_s,
        max_concurrent=args.max_concurrent,
        max_concurrent_per_caller=args.max_concurrent_per_caller,
        max_n=args.max_n,
        max_generation_s=args.max_generation_s,
        grpc_stalled_send_s=args.grpc_stalled_send_s,
        max_prompt_bytes=args.max_prompt_bytes,
        tokenize_threads=args.tokenize_threads,
        grammar_timeout_s=args.grammar_timeout_s,
        peer_tls=ClientTls(ca=args.peer_tls_ca, cert=args.peer_tls_cert, key=args.peer_tls_key),
        peer_token_file=args.peer_token_file,
        link_policy=LinkPolicy(draft_timeout_s=args.draft_timeout_s, draft_deadline_s=args.draft_deadline_s,
                               target_deadline_s=args.target_deadline_s),
        shared_stream_from=args.shared_stream_from,
        resolve_every_s=args.resolve_every_s,
        load_every_s=args.load_every_s,
        generation_config=args.generation_config,
        chat_template=args.chat_template,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
    )


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="specsplit serve", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in containers)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to bind; 0 picks a free one")
    parser.add_argument("--port-file", default="", help="write the bound port here once serving")
    parser.add_argument("--reflection", action="store_true", help="enable gRPC server reflection")
    parser.add_argument("--http-port", type=int, default=None,
                        help="also serve the OpenAI-compatible HTTP API (/v1/chat/completions, ...) on this port")
    add_http_flags(parser)
    parser.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (0 = off)")
    parser.add_argument("--grace-s", type=float, default=10.0, help="seconds in-flight generations get on SIGTERM")
    logs.add_log_flags(parser)
    add_tls_flags(parser)
    parser.add_argument("--peer-tls-ca", default="", help="CA that signed the draft/target certificates (TLS to them)")
    parser.add_argument("--peer-tls-cert", default="", help="our client certificate for mTLS to draft/target")
    parser.add_argument("--peer-tls-key", default="", help="private key of --peer-tls-cert")
    parser.add_argument("--peer-token-file", default="",
                        help="send `authorization: Bearer <token>` to the draft and target: the file's first token, "
                             "re-read when it changes (or SPECSPLIT_PEER_TOKEN)")
    add_public_token_flags(parser)
    add_orchestrator_flags(parser)
    return parser


def add_public_token_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the public API's bearer token (gRPC ``Generate`` and HTTP)."""
    parser.add_argument("--auth-token-file", default="",
                        help="require `authorization: Bearer <token>` on Generate and the HTTP API with a token of "
                             "this file (one a line, `TOKEN` or `NAME TOKEN`; re-read when it changes); or "
                             "SPECSPLIT_AUTH_TOKEN")
    parser.add_argument("--auth-token-grace-s", type=float, default=120.0,
                        help="seconds a token removed from --auth-token-file is still accepted")


def public_tokens(args) -> Tokens | None:
    """The tokens the public API accepts; None: no check."""
    return Tokens.load(args.auth_token_file, "SPECSPLIT_AUTH_TOKEN", args.auth_token_grace_s)


def public_interceptors(tokens: Tokens | None) -> tuple:
    return (BearerTokenInterceptor(tokens, (f"/{SERVICE_NAME}/",)),) if tokens is not None else ()


def max_generate_bytes(orchestrator: Orchestrator) -> int:
    """The largest ``Generate`` request worth reading: the target's context of the tokenizer's longest tokens."""
    return generate_request_bytes(orchestrator.target.info.max_context, orchestrator.longest_token_bytes)


def add_http_flags(parser: argparse.ArgumentParser) -> None:
    """The bounds of the HTTP API (``HttpLimits``): sizes, timeouts, connections, hosts."""
    limits = HttpLimits()
    parser.add_argument("--http-max-body-bytes", type=int, default=limits.max_body_bytes,
                        help="largest request body; counted while it streams in, larger gets 413")
    parser.add_argument("--http-header-timeout-s", type=float, default=limits.header_timeout_s,
                        help="a connection whose request headers take longer is closed")
    parser.add_argument("--http-body-timeout-s", type=float, default=limits.body_timeout_s,
                        help="a request body that takes longer to arrive gets 408")
    parser.add_argument("--http-keep-alive-s", type=float, default=limits.keep_alive_s,
                        help="an idle kept-alive connection is closed after this")
    parser.add_argument("--http-max-connections", type=int, default=limits.max_connections,
                        help="connections and requests open at once; more get 503")
    parser.add_argument("--http-stalled-send-s", type=float, default=limits.stalled_send_s,
                        help="a client that reads nothing of its response this long loses it (and its slot)")
    parser.add_argument("--trusted-host", action="append", default=[],
                        help="a Host header value the HTTP API answers to (repeatable; host or host:port); "
                             "default: any")


def http_limits_from_args(args) -> HttpLimits:
    return HttpLimits(
        max_body_bytes=args.http_max_body_bytes, header_timeout_s=args.http_header_timeout_s,
        body_timeout_s=args.http_body_timeout_s, keep_alive_s=args.http_keep_alive_s,
        max_connections=args.http_max_connections, stalled_send_s=args.http_stalled_send_s,
        trusted_hosts=tuple(args.trusted_host),
    )


async def start_server(orchestrator: Orchestrator, address: str = "127.0.0.1:0", tokens: Tokens | None = None):
    """An in-process public server over a connected orchestrator; returns (server, port)."""
    servicer = GeneratorServicer(orchestrator)
    return await start_in_process(
        servicer, pb_grpc.add_GeneratorServicer_to_server, SERVICE_NAME, address,
        interceptors=public_interceptors(tokens),
        max_receive_bytes=max_generate_bytes(orchestrator),
    )


async def serve(args) -> None:
    config = config_from_args(args)
    serve_metrics(args.metrics_port, args.host, "orchestrator")
    tokens = public_tokens(args)
    interceptors = public_interceptors(tokens)
    orchestrator = await Orchestrator.connect(config)  # first: the receive bound comes from the target's context
    try:
        server, port, health = create_server(
            f"{args.host}:{args.port}", [SERVICE_NAME], args.reflection, server_tls(args), interceptors,
            max_generate_bytes(orchestrator),
        )
    except BaseException:
        await orchestrator.close()
        raise
    await set_serving(health, [SERVICE_NAME], False)
    add_servicer(pb_grpc.add_GeneratorServicer_to_server, GeneratorServicer(orchestrator), server)
    http = await _start_http(args, orchestrator, tokens) if args.http_port is not None else None
    try:
        await server.start()
        freeze_startup_heap("orchestrator")
        await set_serving(health, [SERVICE_NAME], True)
        write_port_file(args.port_file, port)
        log.info("orchestrator serving on %s:%d", args.host, port)
        await serve_until_signal(server, health, args.grace_s, http.stop if http else None)
    finally:
        if http is not None:
            await http.stop()
        await orchestrator.close()


async def _start_http(args, orchestrator: Orchestrator, tokens: Tokens | None):
    """The OpenAI-compatible HTTP API on --http-port, same host, TLS and token as the gRPC API."""
    from specsplit.orchestrator.api import openai_server

    limits = http_limits_from_args(args)
    app = openai_server.build_app(orchestrator, tokens, limits)
    http = await openai_server.start_http_server(app, args.host, args.http_port, server_tls(args), args.grace_s,
                                                 limits)
    log.info("OpenAI-compatible HTTP API on %s:%d", args.host, http.port)
    return http


def run(args) -> int:
    event_loop.run(serve(args))
    return 0


def main(argv: list[str] | None = None) -> None:
    """``python -m specsplit.orchestrator.api.server``: ``specsplit serve`` without ``--ray``."""
    entry.run_and_exit("serve", run, build_parser().parse_args(argv), log_prefix="orchestrator")


if __name__ == "__main__":
    main()
