"""Configuration of the orchestrator, built from flags in one place."""

from __future__ import annotations

from dataclasses import dataclass

from specsplit.lmkit.kinds import DrafterKind, VerificationMode
from specsplit.lmkit.models import DEFAULT_MODEL
from specsplit.lmkit.security import ClientTls
from specsplit.orchestrator.api.tool_parsers import FORMATS
from specsplit.orchestrator.decode.links import LinkPolicy

# Chosen by measurement on the bundled SmolLM2 target (docs/drafters.md, "Choosing the
# default drafter"): prompt lookup costs ~0 per token and drafts long runs on
# input-grounded tasks, while proposing nothing (plain decoding) on open prose.
DEFAULT_DRAFTER = DrafterKind.NGRAM
DEFAULT_K = 8
DEFAULT_TREE_BRANCHES = 4  # continuations a round may verify together; the policy keeps those that pay
MAX_TREE_BRANCHES = 16
# How sampled requests are verified unless they ask (docs/protocol.md, "Seeds"): chosen from the
# acceptance figures of experiments/coupling/ (its README).
DEFAULT_SAMPLING_MODE = VerificationMode.COUPLED


@dataclass(frozen=True)
class OrchestratorConfig:
    target_address: str
    draft_address: str = ""  # empty: target-only decoding
    tokenizer: str = DEFAULT_MODEL  # must share the target's vocabulary
    default_k: int = DEFAULT_K
    default_drafter: DrafterKind = DEFAULT_DRAFTER
    default_adaptive_k: bool = True
    default_overlap: bool = True  # draft the next block while the target verifies this one
    default_tree_branches: int = DEFAULT_TREE_BRANCHES  # 1 = chains only
    default_sampling_mode: VerificationMode = DEFAULT_SAMPLING_MODE  # for sampled requests that name none
    default_max_new_tokens: int = 128
    max_new_tokens_limit: int = 4096  # the most a request may ask for (--max-new-tokens-limit)
    max_stop_strings: int = 16
    max_concurrent: int = 64  # generations in flight; beyond it RESOURCE_EXHAUSTED
    max_concurrent_per_caller: int = 0  # generations one caller (bearer token, else address) may run; 0: no bound
    max_n: int = 16  # samples of one request (GenerateRequest.n); each is a generation for the bounds above
    max_generation_s: float = 600.0  # a generation running longer ends with DEADLINE_EXCEEDED; 0: no bound
    grpc_stalled_send_s: float = 30.0  # a Generate stream write blocked this long (client not reading) ends it
    max_prompt_bytes: int = 0  # UTF-8 bytes of a prompt (all turns); 0: the context length x the longest token
    max_stop_chars: int = 256  # characters of one stop string
    tokenize_threads: int = 2  # threads that tokenize prompts and render chat templates, off the event loop
    grammar_timeout_s: float = 10.0  # a request's grammar compiling longer is refused (on those threads); 0: no bound
    ngram_min: int = 2
    ngram_max: int = 4
    connect_timeout_s: float = 120.0
    link_policy: LinkPolicy = LinkPolicy()
    peer_tls: ClientTls = ClientTls()  # TLS/mTLS towards the draft and target services
    peer_token_file: str = ""  # the bearer token sent to the draft and target (else SPECSPLIT_PEER_TOKEN)
    served_model_names: tuple[str, ...] = ()  # names the HTTP API answers to; empty: the target's model name
    # A new session goes on the shared Sessions stream of each service once this many generations are in flight
    # (it included), else on streams of its own: one message a step for many sessions, and no shared stream's
    # extra hand-offs for a session alone. 1: always shared; 0: never.
    shared_stream_from: int = 4
    resolve_every_s: float = 10.0  # a dns:///NAME:PORT pool's name is resolved again this often
    load_every_s: float = 1.0  # each pool replica's Stats (sessions, KV) are read this often; 0: own sessions only
    # "auto": the target's generation_config.json sampling defaults fill what a request leaves unset; "ignore": not.
    generation_config: str = "auto"
    chat_template: str = ""  # a Jinja chat template file used instead of the tokenizer's; empty: the tokenizer's
    tool_call_parser: str = "hermes"  # how the model writes tool calls (orchestrator.api.tool_parsers.FORMATS)
    enable_auto_tool_choice: bool = False  # tool_choice "auto": free text with its tool calls parsed out

    def __post_init__(self) -> None:
        if not self.target_address:
            raise ValueError("--target is required: the target service's address, e.g. 127.0.0.1:50052")
        if self.default_k < 0:
            raise ValueError(f"--k must be >= 0, got {self.default_k}")
        if self.max_new_tokens_limit < 1:
            raise ValueError(f"--max-new-tokens-limit must be >= 1, got {self.max_new_tokens_limit}")
        if not 1 <= self.default_max_new_tokens <= self.max_new_tokens_limit:
            raise ValueError(
                f"--max-new-tokens must be in [1, {self.max_new_tokens_limit}], got {self.default_max_new_tokens}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= --ngram-min <= --ngram-max, got {self.ngram_min}, {self.ngram_max}")
        if not 1 <= self.default_tree_branches <= MAX_TREE_BRANCHES:
            raise ValueError(f"--tree-branches must be in [1, {MAX_TREE_BRANCHES}], got {self.default_tree_branches}")
        if self.max_concurrent < 1:
            raise ValueError(f"--max-concurrent must be >= 1, got {self.max_concurrent}")
        if self.max_concurrent_per_caller < 0:
            raise ValueError(f"--max-concurrent-per-caller must be >= 0 (0: no bound), got {self.max_concurrent_per_caller}")
        if self.max_n < 1:
            raise ValueError(f"--max-n must be >= 1, got {self.max_n}")
        if self.max_generation_s < 0:
            raise ValueError(f"--max-generation-s must be >= 0 (0: no bound), got {self.max_generation_s}")
        if self.grpc_stalled_send_s <= 0:
            raise ValueError(f"--grpc-stalled-send-s must be > 0, got {self.grpc_stalled_send_s}")
        if self.max_prompt_bytes < 0:
            raise ValueError(f"--max-prompt-bytes must be >= 0 (0: from the context length), got {self.max_prompt_bytes}")
        if self.grammar_timeout_s < 0:
            raise ValueError(f"--grammar-timeout-s must be >= 0 (0: no bound), got {self.grammar_timeout_s}")
        if self.max_stop_chars < 1 or self.tokenize_threads < 1:
            raise ValueError("max_stop_chars and --tokenize-threads must be >= 1")
        if self.default_sampling_mode not in (VerificationMode.TOKEN_ONLY, VerificationMode.COUPLED):
            raise ValueError(
                f"--sampling-mode must be token-only or coupled (draft-probs is per request), got {self.default_sampling_mode}"
            )
        if self.resolve_every_s <= 0:
            raise ValueError(f"--resolve-every-s must be > 0, got {self.resolve_every_s}")
        if self.load_every_s < 0:
            raise ValueError(f"--load-every-s must be >= 0 (0: place by this orchestrator's sessions), got {self.load_every_s}")
        if self.shared_stream_from < 0:
            raise ValueError(f"--shared-stream-from must be >= 0 (0: never), got {self.shared_stream_from}")
        if self.generation_config not in ("auto", "ignore"):
            raise ValueError(f"--generation-config must be auto or ignore, got {self.generation_config!r}")
        if self.tool_call_parser not in FORMATS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(FORMATS)}, got {self.tool_call_parser!r}")
        if self.connect_timeout_s <= 0:
            raise ValueError("--connect-timeout-s must be > 0")


@dataclass(frozen=True)
class HttpLimits:
    """Bounds of the OpenAI-compatible HTTP API (``orchestrator.api.http_guard``; ``--http-*`` flags)."""

    max_body_bytes: int = 8 * 1024 * 1024
    header_timeout_s: float = 10.0  # from connection (or the last response) to the end of the headers
    body_timeout_s: float = 30.0  # from the end of the headers to the end of the body
    keep_alive_s: float = 5.0  # an idle kept-alive connection is closed after this
    max_connections: int = 1024  # open connections and requests at once; more get 503 (uvicorn's limit_concurrency)
    stalled_send_s: float = 30.0  # a response write blocked this long (the client stopped reading) ends it
    trusted_hosts: tuple[str, ...] = ()  # allowed Host header values (host, or host:port); empty: any

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1 or self.max_connections < 1:
            raise ValueError("--http-max-body-bytes and --http-max-connections must be >= 1")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s", "stalled_send_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--http-{name[:-2].replace('_', '-')}-s must be > 0, got {getattr(self, name)}")
