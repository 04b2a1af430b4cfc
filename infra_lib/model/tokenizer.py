"""Byte-level BPE: text to token ids and back, plus the chat template.

Encoding in four steps:
1. cut out special tokens (``<|im_start|>`` ...), which are never split;
2. pre-tokenise the rest with a regular expression (words, numbers, punctuation, spaces);
3. map each piece's UTF-8 bytes to printable characters (GPT-2's byte alphabet);
4. merge adjacent symbols pair by pair, lowest merge rank first, until no merge applies.

Decoding joins the tokens' strings and maps the characters back to bytes.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import regex

# GPT-2's split: contractions, letters, numbers, other symbols, spaces.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# The same, with every digit its own piece (SmolLM, StarCoder).
DIGITS_PATTERN = r"\p{N}"


@functools.lru_cache(maxsize=8)
def _compiled_template(source: str):
    """A chat template compiled once (milliseconds a call otherwise; a server renders one per request)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(source)


@functools.lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """Byte -> printable character: printable Latin-1 bytes map to themselves, the rest to
    characters from U+0100 on, so every byte sequence becomes a visible string."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class Tokenizer:
    """A byte-level BPE tokenizer.

    Args:
        tokens: token strings in id order (in the byte alphabet).
        merges: merge rules, highest priority first, as ``(left, right)`` pairs.
        special: ids of special tokens (matched verbatim in text, never split).
        bos_id / eos_id: the begin- and end-of-turn tokens.
        chat_template: a Jinja template over ``messages`` (ChatML for SmolLM2).
        split_digits: pre-tokenise every digit on its own.
    """

    def __init__(
        self,
        tokens: list[str],
        merges: list[tuple[str, str]],
        special: list[int],
        bos_id: int,
        eos_id: int,
        chat_template: str | None = None,
        split_digits: bool = False,
    ):
        self.tokens = list(tokens)
        self.vocab = {t: i for i, t in enumerate(self.tokens)}
        self.ranks = {pair: rank for rank, pair in enumerate(merges)}
        self.special = {self.tokens[i]: i for i in special}
        self.special_ids = frozenset(special)
        self.bos_id, self.eos_id = bos_id, eos_id
        self.chat_template = chat_template
        self.split_digits = split_digits
        self._word = regex.compile(GPT2_PATTERN)
        self._digit = regex.compile(DIGITS_PATTERN)
        ordered = sorted(self.special, key=len, reverse=True)  # longest first
        self._special_split = regex.compile("(" + "|".join(regex.escape(s) for s in ordered) + ")") if ordered else None
        self._to_char = byte_alphabet()
        self._to_byte = {c: b for b, c in self._to_char.items()}
        self._bpe_cached = functools.lru_cache(maxsize=65536)(self._bpe)

    def __len__(self) -> int:
        return len(self.tokens)

    # --- encoding ------------------------------------------------------------------------------

    def pre_tokenize(self, text: str) -> list[str]:
        pieces = []
        for chunk in self._digit_split(text) if self.split_digits else [text]:
            pieces.extend(self._word.findall(chunk))
        return pieces

    def _digit_split(self, text: str) -> list[str]:
        out, last = [], 0
        for m in self._digit.finditer(text):
            if m.start() > last:
                out.append(text[last : m.start()])
            out.append(m.group())
            last = m.end()
        if last < len(text):
            out.append(text[last:])
        return out

    def _bpe(self, word: str) -> tuple[int, ...]:
        """Merge the characters of one pre-tokenised piece into token ids."""
        symbols = list(word)
        while len(symbols) > 1:
            pairs = [(self.ranks.get((a, b), None), i) for i, (a, b) in enumerate(zip(symbols, symbols[1:]))]
            ranked = [(r, i) for r, i in pairs if r is not None]
            if not ranked:
                break
            best = min(ranked)[0]
            merged, i = [], 0
            while i < len(symbols):  # apply the best merge everywhere, left to right
                if i + 1 < len(symbols) and self.ranks.get((symbols[i], symbols[i + 1])) == best:
                    merged.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        try:
            return tuple(self.vocab[s] for s in symbols)
        except KeyError as missing:
            raise ValueError(f"symbol {missing} is not in the vocabulary (a broken vocabulary/merges pair)") from None

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Token ids for ``text``. With ``allow_special`` the special tokens' text (e.g.
        ``<|im_end|>``) becomes that token; otherwise it is encoded as plain characters."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        parts = self._special_split.split(text) if (allow_special and self._special_split) else [text]
        ids: list[int] = []
        for part in parts:
            if not part:
                continue
            if allow_special and part in self.special:
                ids.append(self.special[part])
                continue
            for piece in self.pre_tokenize(part):
                ids.extend(self._bpe_cached("".join(self._to_char[b] for b in piece.encode("utf-8"))))
        return ids

    # --- decoding ------------------------------------------------------------------------------

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a special token's text as UTF-8)."""
        text = self.tokens[token_id]
        if token_id in self.special_ids:
            return text.encode("utf-8")
        return bytes(self._to_byte[c] for c in text)

    def decode(self, ids, skip_special: bool = False) -> str:
        for i in ids:
            if not 0 <= int(i) < len(self.tokens):
                raise ValueError(f"token id {i} is outside the vocabulary of {len(self.tokens)}")
        data = b"".join(self.token_bytes(int(i)) for i in ids if not (skip_special and int(i) in self.special_ids))
        return data.decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special: bool = True) -> "StreamDecoder":
        return StreamDecoder(self, skip_special)

    # --- chat ----------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation, rendered with the model's own template."""
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise ValueError("messages must be a list of {'role': str, 'content': str} dicts")
        if not messages:
            raise ValueError("messages is empty")
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        return _compiled_template(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.tokens[self.bos_id],
            eos_token=self.tokens[self.eos_id],
        )

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), allow_special=True)

    # --- construction --------------------------------------------------------------------------

    @classmethod
    def from_gguf_fields(cls, fields: dict) -> "Tokenizer":
        """From the ``tokenizer.ggml.*`` metadata of a GGUF file (``fields``: key -> value)."""
        model = fields.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"only byte-level BPE ('gpt2') GGUF tokenizers are supported, got {model!r}")
        tokens = list(fields["tokenizer.ggml.tokens"])
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
        types = list(fields.get("tokenizer.ggml.token_type", []))
        special = [i for i, t in enumerate(types) if t in (3, 4)]  # CONTROL, USER_DEFINED
        return cls(
            tokens,
            merges,
            special,
            int(fields["tokenizer.ggml.bos_token_id"]),
            int(fields["tokenizer.ggml.eos_token_id"]),
            fields.get("tokenizer.chat_template"),
            split_digits=fields.get("tokenizer.ggml.pre") in ("smollm", "starcoder"),
        )

    @classmethod
    def from_tokenizer_json(cls, path: str | Path, config: dict | None = None) -> "Tokenizer":
        """From a Hugging Face ``tokenizer.json`` (byte-level BPE) and, if present beside it,
        ``tokenizer_config.json`` (chat template, bos/eos)."""
        path = Path(path)
        data = json.loads(path.read_text(encoding="utf-8"))
        model = data.get("model", {})
        if model.get("type") != "BPE":
            raise ValueError(f"{path}: only BPE tokenizers are supported, got {model.get('type')!r}")
        pre = json.dumps(data.get("pre_tokenizer"))
        if "ByteLevel" not in pre:
            raise ValueError(f"{path}: only byte-level BPE is supported (no ByteLevel pre-tokenizer found)")
        vocab = model["vocab"]
        added = {a["content"]: a["id"] for a in data.get("added_tokens", [])}
        size = max(list(vocab.values()) + list(added.values())) + 1
        tokens = [""] * size
        for text, i in {**vocab, **added}.items():
            tokens[i] = text
        merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
        special = sorted(a["id"] for a in data.get("added_tokens", []) if a.get("special", True))
        settings = config
        if settings is None and (path.parent / "tokenizer_config.json").exists():
            settings = json.loads((path.parent / "tokenizer_config.json").read_text(encoding="utf-8"))
        settings = settings or {}

        def token_id(key, default):
            value = settings.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            return (added.get(value) if value in added else vocab.get(value, default)) if value else default

        return cls(
            tokens,
            merges,
            special,
            token_id("bos_token", special[0] if special else 0),
            token_id("eos_token", special[0] if special else 0),
            settings.get("chat_template"),
            split_digits='"Digits"' in pre,
        )


class StreamDecoder:
    """Turns token ids into text one token at a time, holding back bytes of a character that
    is not complete yet (one emoji can span several tokens)."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._pending = b""

    def push(self, token_id: int) -> str:
        if self.skip_special and token_id in self.tokenizer.special_ids:
            return ""
        self._pending += self.tokenizer.token_bytes(token_id)
        for cut in range(len(self._pending), max(len(self._pending) - 4, -1), -1):
            try:
                text = self._pending[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            self._pending = self._pending[cut:]
            return text
        return self.flush()  # not UTF-8 at all: show replacement characters rather than stall

    def flush(self) -> str:
        text, self._pending = self._pending.decode("utf-8", errors="replace"), b""
        return text
