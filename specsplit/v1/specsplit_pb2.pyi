from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerificationMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERIFICATION_MODE_UNSPECIFIED: _ClassVar[VerificationMode]
    VERIFICATION_MODE_GREEDY: _ClassVar[VerificationMode]
    VERIFICATION_MODE_TOKEN_ONLY: _ClassVar[VerificationMode]
    VERIFICATION_MODE_DRAFT_PROBS: _ClassVar[VerificationMode]
    VERIFICATION_MODE_COUPLED: _ClassVar[VerificationMode]

class DrafterKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFTER_KIND_UNSPECIFIED: _ClassVar[DrafterKind]
    DRAFTER_KIND_MODEL: _ClassVar[DrafterKind]
    DRAFTER_KIND_NGRAM: _ClassVar[DrafterKind]
    DRAFTER_KIND_LAYERSKIP: _ClassVar[DrafterKind]
    DRAFTER_KIND_QUANTIZED: _ClassVar[DrafterKind]
    DRAFTER_KIND_CHAIN: _ClassVar[DrafterKind]
    DRAFTER_KIND_EAGLE: _ClassVar[DrafterKind]
    DRAFTER_KIND_RECYCLING: _ClassVar[DrafterKind]
    DRAFTER_KIND_MEDUSA: _ClassVar[DrafterKind]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP_STRING: _ClassVar[FinishReason]
    FINISH_REASON_CONTEXT: _ClassVar[FinishReason]
VERIFICATION_MODE_UNSPECIFIED: VerificationMode
VERIFICATION_MODE_GREEDY: VerificationMode
VERIFICATION_MODE_TOKEN_ONLY: VerificationMode
VERIFICATION_MODE_DRAFT_PROBS: VerificationMode
VERIFICATION_MODE_COUPLED: VerificationMode
DRAFTER_KIND_UNSPECIFIED: DrafterKind
DRAFTER_KIND_MODEL: DrafterKind
DRAFTER_KIND_NGRAM: DrafterKind
DRAFTER_KIND_LAYERSKIP: DrafterKind
DRAFTER_KIND_QUANTIZED: DrafterKind
DRAFTER_KIND_CHAIN: DrafterKind
DRAFTER_KIND_EAGLE: DrafterKind
DRAFTER_KIND_RECYCLING: DrafterKind
DRAFTER_KIND_MEDUSA: DrafterKind
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP_STRING: FinishReason
FINISH_REASON_CONTEXT: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "min_tokens", "ignore_eos", "eos_token_ids", "prompt_length")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    ignore_eos: bool
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_length: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., prompt_length: _Optional[int] = ...) -> None: ...

class DraftProbs(_message.Message):
    __slots__ = ("rows", "vocab_size", "sparse", "values", "indices", "row_nnz")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    ROW_NNZ_FIELD_NUMBER: _ClassVar[int]
    rows: int
    vocab_size: int
    sparse: bool
    values: bytes
    indices: bytes
    row_nnz: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rows: _Optional[int] = ..., vocab_size: _Optional[int] = ..., sparse: _Optional[bool] = ..., values: _Optional[bytes] = ..., indices: _Optional[bytes] = ..., row_nnz: _Optional[_Iterable[int]] = ...) -> None: ...

class HiddenFeatures(_message.Message):
    __slots__ = ("position", "rows", "width", "values")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    position: int
    rows: int
    width: int
    values: bytes
    def __init__(self, position: _Optional[int] = ..., rows: _Optional[int] = ..., width: _Optional[int] = ..., values: _Optional[bytes] = ...) -> None: ...

class Successors(_message.Message):
    __slots__ = ("k", "tokens", "ids")
    K_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    k: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, k: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "token", "top", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    token: str
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., token: _Optional[str] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., rank: _Optional[int] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "token")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    token: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., token: _Optional[str] = ...) -> None: ...

class TokenMask(_message.Message):
    __slots__ = ("rows", "bits")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    bits: bytes
    def __init__(self, rows: _Optional[int] = ..., bits: _Optional[bytes] = ...) -> None: ...

class ServiceTiming(_message.Message):
    __slots__ = ("compute_us", "service_us", "read_us", "forward_us")
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    SERVICE_US_FIELD_NUMBER: _ClassVar[int]
    READ_US_FIELD_NUMBER: _ClassVar[int]
    FORWARD_US_FIELD_NUMBER: _ClassVar[int]
    compute_us: int
    service_us: int
    read_us: int
    forward_us: int
    def __init__(self, compute_us: _Optional[int] = ..., service_us: _Optional[int] = ..., read_us: _Optional[int] = ..., forward_us: _Optional[int] = ...) -> None: ...

class ForwardReport(_message.Message):
    __slots__ = ("batch_size", "batch_width", "batch_tokens", "batch_packed", "others_committed", "cost_base_us", "cost_per_token_us")
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_WIDTH_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BATCH_PACKED_FIELD_NUMBER: _ClassVar[int]
    OTHERS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    COST_BASE_US_FIELD_NUMBER: _ClassVar[int]
    COST_PER_TOKEN_US_FIELD_NUMBER: _ClassVar[int]
    batch_size: int
    batch_width: int
    batch_tokens: int
    batch_packed: bool
    others_committed: int
    cost_base_us: float
    cost_per_token_us: float
    def __init__(self, batch_size: _Optional[int] = ..., batch_width: _Optional[int] = ..., batch_tokens: _Optional[int] = ..., batch_packed: _Optional[bool] = ..., others_committed: _Optional[int] = ..., cost_base_us: _Optional[float] = ..., cost_per_token_us: _Optional[float] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "vocab_size", "vocab_fingerprint", "device", "forward", "tp_degree", "max_context", "max_block", "token_trees", "hidden_size", "num_layers", "drafters", "drafter_info", "max_request_bytes", "wire_version", "min_wire_version", "sampling_defaults")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    FORWARD_FIELD_NUMBER: _ClassVar[int]
    TP_DEGREE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCK_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TREES_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_INFO_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    WIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    MIN_WIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    vocab_size: int
    vocab_fingerprint: str
    device: str
    forward: str
    tp_degree: int
    max_context: int
    max_block: int
    token_trees: bool
    hidden_size: int
    num_layers: int
    drafters: _containers.RepeatedScalarFieldContainer[DrafterKind]
    drafter_info: _containers.RepeatedCompositeFieldContainer[DrafterInfo]
    max_request_bytes: int
    wire_version: int
    min_wire_version: int
    sampling_defaults: SamplingDefaults
    def __init__(self, model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., vocab_fingerprint: _Optional[str] = ..., device: _Optional[str] = ..., forward: _Optional[str] = ..., tp_degree: _Optional[int] = ..., max_context: _Optional[int] = ..., max_block: _Optional[int] = ..., token_trees: _Optional[bool] = ..., hidden_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., drafters: _Optional[_Iterable[_Union[DrafterKind, str]]] = ..., drafter_info: _Optional[_Iterable[_Union[DrafterInfo, _Mapping]]] = ..., max_request_bytes: _Optional[int] = ..., wire_version: _Optional[int] = ..., min_wire_version: _Optional[int] = ..., sampling_defaults: _Optional[_Union[SamplingDefaults, _Mapping]] = ...) -> None: ...

class SamplingDefaults(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "repetition_penalty")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ...) -> None: ...

class DrafterInfo(_message.Message):
    __slots__ = ("kind", "name", "forward", "has_probs", "needs_model", "free", "needs_features", "feature_layers", "feature_width", "successors_k")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    FORWARD_FIELD_NUMBER: _ClassVar[int]
    HAS_PROBS_FIELD_NUMBER: _ClassVar[int]
    NEEDS_MODEL_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    NEEDS_FEATURES_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    SUCCESSORS_K_FIELD_NUMBER: _ClassVar[int]
    kind: DrafterKind
    name: str
    forward: str
    has_probs: bool
    needs_model: bool
    free: bool
    needs_features: bool
    feature_layers: _containers.RepeatedScalarFieldContainer[int]
    feature_width: int
    successors_k: int
    def __init__(self, kind: _Optional[_Union[DrafterKind, str]] = ..., name: _Optional[str] = ..., forward: _Optional[str] = ..., has_probs: _Optional[bool] = ..., needs_model: _Optional[bool] = ..., free: _Optional[bool] = ..., needs_features: _Optional[bool] = ..., feature_layers: _Optional[_Iterable[int]] = ..., feature_width: _Optional[int] = ..., successors_k: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("active_sessions", "sessions_opened", "rounds", "fed_tokens", "shared_tokens", "kv_reserved", "kv_budget")
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_OPENED_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    FED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHARED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_RESERVED_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_FIELD_NUMBER: _ClassVar[int]
    active_sessions: int
    sessions_opened: int
    rounds: int
    fed_tokens: int
    shared_tokens: int
    kv_reserved: int
    kv_budget: int
    def __init__(self, active_sessions: _Optional[int] = ..., sessions_opened: _Optional[int] = ..., rounds: _Optional[int] = ..., fed_tokens: _Optional[int] = ..., shared_tokens: _Optional[int] = ..., kv_reserved: _Optional[int] = ..., kv_budget: _Optional[int] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class SessionState(_message.Message):
    __slots__ = ("session_id", "position", "cached_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    position: int
    cached_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., position: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class CallError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class CloseSession(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftOpen(_message.Message):
    __slots__ = ("session_id", "tokens", "sampling", "mode", "return_probs", "drafter", "chain", "ngram_min", "ngram_max", "feature_width", "fork_from", "reserve_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    RETURN_PROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    NGRAM_MIN_FIELD_NUMBER: _ClassVar[int]
    NGRAM_MAX_FIELD_NUMBER: _ClassVar[int]
    FEATURE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    FORK_FROM_FIELD_NUMBER: _ClassVar[int]
    RESERVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    mode: VerificationMode
    return_probs: bool
    drafter: DrafterKind
    chain: _containers.RepeatedScalarFieldContainer[DrafterKind]
    ngram_min: int
    ngram_max: int
    feature_width: int
    fork_from: str
    reserve_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., mode: _Optional[_Union[VerificationMode, str]] = ..., return_probs: _Optional[bool] = ..., drafter: _Optional[_Union[DrafterKind, str]] = ..., chain: _Optional[_Iterable[_Union[DrafterKind, str]]] = ..., ngram_min: _Optional[int] = ..., ngram_max: _Optional[int] = ..., feature_width: _Optional[int] = ..., fork_from: _Optional[str] = ..., reserve_tokens: _Optional[int] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("position", "tokens", "k", "free_k", "max_branches", "features", "successors")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    FREE_K_FIELD_NUMBER: _ClassVar[int]
    MAX_BRANCHES_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    SUCCESSORS_FIELD_NUMBER: _ClassVar[int]
    position: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    k: int
    free_k: int
    max_branches: int
    features: HiddenFeatures
    successors: _containers.RepeatedCompositeFieldContainer[Successors]
    def __init__(self, position: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., k: _Optional[int] = ..., free_k: _Optional[int] = ..., max_branches: _Optional[int] = ..., features: _Optional[_Union[HiddenFeatures, _Mapping]] = ..., successors: _Optional[_Iterable[_Union[Successors, _Mapping]]] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("open", "propose")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    open: DraftOpen
    propose: ProposeRequest
    def __init__(self, open: _Optional[_Union[DraftOpen, _Mapping]] = ..., propose: _Optional[_Union[ProposeRequest, _Mapping]] = ...) -> None: ...

class DraftBlock(_message.Message):
    __slots__ = ("position", "tokens", "parents", "probs", "drafter", "quality", "second_guess", "timing")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    QUALITY_FIELD_NUMBER: _ClassVar[int]
    SECOND_GUESS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    position: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    probs: DraftProbs
    drafter: DrafterKind
    quality: MatchQuality
    second_guess: SecondGuess
    timing: ServiceTiming
    def __init__(self, position: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., probs: _Optional[_Union[DraftProbs, _Mapping]] = ..., drafter: _Optional[_Union[DrafterKind, str]] = ..., quality: _Optional[_Union[MatchQuality, _Mapping]] = ..., second_guess: _Optional[_Union[SecondGuess, _Mapping]] = ..., timing: _Optional[_Union[ServiceTiming, _Mapping]] = ...) -> None: ...

class MatchQuality(_message.Message):
    __slots__ = ("length", "occurrences")
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    OCCURRENCES_FIELD_NUMBER: _ClassVar[int]
    length: int
    occurrences: int
    def __init__(self, length: _Optional[int] = ..., occurrences: _Optional[int] = ...) -> None: ...

class SecondGuess(_message.Message):
    __slots__ = ("index", "token")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    index: int
    token: int
    def __init__(self, index: _Optional[int] = ..., token: _Optional[int] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("opened", "block")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    opened: SessionState
    block: DraftBlock
    def __init__(self, opened: _Optional[_Union[SessionState, _Mapping]] = ..., block: _Optional[_Union[DraftBlock, _Mapping]] = ...) -> None: ...

class DraftCall(_message.Message):
    __slots__ = ("session_id", "open", "propose", "close")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    open: DraftOpen
    propose: ProposeRequest
    close: CloseSession
    def __init__(self, session_id: _Optional[str] = ..., open: _Optional[_Union[DraftOpen, _Mapping]] = ..., propose: _Optional[_Union[ProposeRequest, _Mapping]] = ..., close: _Optional[_Union[CloseSession, _Mapping]] = ...) -> None: ...

class DraftCalls(_message.Message):
    __slots__ = ("calls",)
    CALLS_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[DraftCall]
    def __init__(self, calls: _Optional[_Iterable[_Union[DraftCall, _Mapping]]] = ...) -> None: ...

class DraftReply(_message.Message):
    __slots__ = ("session_id", "opened", "block", "error", "closed")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OPENED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    opened: SessionState
    block: DraftBlock
    error: CallError
    closed: SessionState
    def __init__(self, session_id: _Optional[str] = ..., opened: _Optional[_Union[SessionState, _Mapping]] = ..., block: _Optional[_Union[DraftBlock, _Mapping]] = ..., error: _Optional[_Union[CallError, _Mapping]] = ..., closed: _Optional[_Union[SessionState, _Mapping]] = ...) -> None: ...

class DraftReplies(_message.Message):
    __slots__ = ("replies",)
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[DraftReply]
    def __init__(self, replies: _Optional[_Iterable[_Union[DraftReply, _Mapping]]] = ...) -> None: ...

class TargetOpen(_message.Message):
    __slots__ = ("session_id", "tokens", "sampling", "mode", "feature_layers", "return_logprobs", "top_logprobs", "prompt_logprobs", "reserve_tokens", "fork_from", "successors_k")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESERVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORK_FROM_FIELD_NUMBER: _ClassVar[int]
    SUCCESSORS_K_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    mode: VerificationMode
    feature_layers: _containers.RepeatedScalarFieldContainer[int]
    return_logprobs: bool
    top_logprobs: int
    prompt_logprobs: int
    reserve_tokens: int
    fork_from: str
    successors_k: int
    def __init__(self, session_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., mode: _Optional[_Union[VerificationMode, str]] = ..., feature_layers: _Optional[_Iterable[int]] = ..., return_logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., reserve_tokens: _Optional[int] = ..., fork_from: _Optional[str] = ..., successors_k: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("position", "draft_tokens", "parents", "draft_probs", "allowed")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_FIELD_NUMBER: _ClassVar[int]
    position: int
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: DraftProbs
    allowed: TokenMask
    def __init__(self, position: _Optional[int] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Union[DraftProbs, _Mapping]] = ..., allowed: _Optional[_Union[TokenMask, _Mapping]] = ...) -> None: ...

class TargetRequest(_message.Message):
    __slots__ = ("open", "verify")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    open: TargetOpen
    verify: VerifyRequest
    def __init__(self, open: _Optional[_Union[TargetOpen, _Mapping]] = ..., verify: _Optional[_Union[VerifyRequest, _Mapping]] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("position", "accepted", "next_token", "path", "features", "successors", "logprobs", "prompt_logprobs", "timing", "forward")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    SUCCESSORS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    FORWARD_FIELD_NUMBER: _ClassVar[int]
    position: int
    accepted: int
    next_token: int
    path: _containers.RepeatedScalarFieldContainer[int]
    features: HiddenFeatures
    successors: Successors
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    timing: ServiceTiming
    forward: ForwardReport
    def __init__(self, position: _Optional[int] = ..., accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., path: _Optional[_Iterable[int]] = ..., features: _Optional[_Union[HiddenFeatures, _Mapping]] = ..., successors: _Optional[_Union[Successors, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., timing: _Optional[_Union[ServiceTiming, _Mapping]] = ..., forward: _Optional[_Union[ForwardReport, _Mapping]] = ...) -> None: ...

class TargetResponse(_message.Message):
    __slots__ = ("opened", "result")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    opened: SessionState
    result: VerifyResult
    def __init__(self, opened: _Optional[_Union[SessionState, _Mapping]] = ..., result: _Optional[_Union[VerifyResult, _Mapping]] = ...) -> None: ...

class TargetCall(_message.Message):
    __slots__ = ("session_id", "open", "verify", "close")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    open: TargetOpen
    verify: VerifyRequest
    close: CloseSession
    def __init__(self, session_id: _Optional[str] = ..., open: _Optional[_Union[TargetOpen, _Mapping]] = ..., verify: _Optional[_Union[VerifyRequest, _Mapping]] = ..., close: _Optional[_Union[CloseSession, _Mapping]] = ...) -> None: ...

class TargetCalls(_message.Message):
    __slots__ = ("calls",)
    CALLS_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[TargetCall]
    def __init__(self, calls: _Optional[_Iterable[_Union[TargetCall, _Mapping]]] = ...) -> None: ...

class TargetReply(_message.Message):
    __slots__ = ("session_id", "opened", "result", "error", "closed")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OPENED_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    opened: SessionState
    result: VerifyResult
    error: CallError
    closed: SessionState
    def __init__(self, session_id: _Optional[str] = ..., opened: _Optional[_Union[SessionState, _Mapping]] = ..., result: _Optional[_Union[VerifyResult, _Mapping]] = ..., error: _Optional[_Union[CallError, _Mapping]] = ..., closed: _Optional[_Union[SessionState, _Mapping]] = ...) -> None: ...

class TargetReplies(_message.Message):
    __slots__ = ("replies",)
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[TargetReply]
    def __init__(self, replies: _Optional[_Iterable[_Union[TargetReply, _Mapping]]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: str
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[str] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_token_ids", "chat", "messages", "tools", "max_new_tokens", "stop", "sampling", "mode", "draft_probs", "drafter", "chain", "k", "adaptive_k", "overlap", "tree_branches", "return_token_ids", "return_logprobs", "top_logprobs", "prompt_logprobs", "request_id", "grammar", "n")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_K_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    TREE_BRANCHES_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    chat: bool
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools: str
    max_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    sampling: SamplingParams
    mode: VerificationMode
    draft_probs: bool
    drafter: DrafterKind
    chain: _containers.RepeatedScalarFieldContainer[DrafterKind]
    k: int
    adaptive_k: bool
    overlap: bool
    tree_branches: int
    return_token_ids: bool
    return_logprobs: bool
    top_logprobs: int
    prompt_logprobs: int
    request_id: str
    grammar: Grammar
    n: int
    def __init__(self, prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., chat: _Optional[bool] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tools: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., mode: _Optional[_Union[VerificationMode, str]] = ..., draft_probs: _Optional[bool] = ..., drafter: _Optional[_Union[DrafterKind, str]] = ..., chain: _Optional[_Iterable[_Union[DrafterKind, str]]] = ..., k: _Optional[int] = ..., adaptive_k: _Optional[bool] = ..., overlap: _Optional[bool] = ..., tree_branches: _Optional[int] = ..., return_token_ids: _Optional[bool] = ..., return_logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., request_id: _Optional[str] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., n: _Optional[int] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "ebnf", "strict")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    EBNF_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: GrammarChoices
    ebnf: str
    strict: bool
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[GrammarChoices, _Mapping]] = ..., ebnf: _Optional[str] = ..., strict: _Optional[bool] = ...) -> None: ...

class GrammarChoices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("request_id", "prompt_tokens", "new_tokens", "tokens_per_s", "wall_s", "drafter", "mode", "seed", "k", "adaptive_k", "mean_k", "overlap", "rounds", "drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length", "overlap_hits", "tree_rounds", "tree_nodes", "branch_accepted", "draft_compute_s", "target_compute_s", "mean_batch_size", "feature_bytes", "feature_bytes_per_round", "draft_fallback_rounds", "draft_reattached", "target_reopens", "forced_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_K_FIELD_NUMBER: _ClassVar[int]
    MEAN_K_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_HITS_FIELD_NUMBER: _ClassVar[int]
    TREE_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    BRANCH_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    TARGET_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    MEAN_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    FEATURE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FEATURE_BYTES_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FALLBACK_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_REATTACHED_FIELD_NUMBER: _ClassVar[int]
    TARGET_REOPENS_FIELD_NUMBER: _ClassVar[int]
    FORCED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_tokens: int
    new_tokens: int
    tokens_per_s: float
    wall_s: float
    drafter: DrafterKind
    mode: VerificationMode
    seed: int
    k: int
    adaptive_k: bool
    mean_k: float
    overlap: bool
    rounds: int
    drafted_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    mean_accepted_length: float
    overlap_hits: int
    tree_rounds: int
    tree_nodes: int
    branch_accepted: int
    draft_compute_s: float
    target_compute_s: float
    mean_batch_size: float
    feature_bytes: int
    feature_bytes_per_round: float
    draft_fallback_rounds: int
    draft_reattached: int
    target_reopens: int
    forced_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., new_tokens: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., wall_s: _Optional[float] = ..., drafter: _Optional[_Union[DrafterKind, str]] = ..., mode: _Optional[_Union[VerificationMode, str]] = ..., seed: _Optional[int] = ..., k: _Optional[int] = ..., adaptive_k: _Optional[bool] = ..., mean_k: _Optional[float] = ..., overlap: _Optional[bool] = ..., rounds: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ..., overlap_hits: _Optional[int] = ..., tree_rounds: _Optional[int] = ..., tree_nodes: _Optional[int] = ..., branch_accepted: _Optional[int] = ..., draft_compute_s: _Optional[float] = ..., target_compute_s: _Optional[float] = ..., mean_batch_size: _Optional[float] = ..., feature_bytes: _Optional[int] = ..., feature_bytes_per_round: _Optional[float] = ..., draft_fallback_rounds: _Optional[int] = ..., draft_reattached: _Optional[int] = ..., target_reopens: _Optional[int] = ..., forced_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "logprobs", "prompt_logprobs", "finish_reason", "stats", "index")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: FinishReason
    stats: GenerationStats
    index: int
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., index: _Optional[int] = ...) -> None: ...
