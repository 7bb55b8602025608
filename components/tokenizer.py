"""Tokenizers: a built-in byte tokenizer (needs no files) and a wrapper for a Hugging Face tokenizer.json."""

import hashlib
import json
from pathlib import Path
from typing import Iterable, Protocol

import tokenizers

TOKENIZER_NAMES = ("byte", "hf")

# Tried in order when the caller names no token. "<|endoftext|>" is in both lists because GPT-2 style
# tokenizers use that one token to mark both ends of a document.
DEFAULT_BOS_TOKENS = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|startoftext|>", "<|endoftext|>")
DEFAULT_EOS_TOKENS = ("<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|endoftext|>", "<|im_end|>")


class Tokenizer(Protocol):
    bos_id: int
    eos_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def fingerprint(self) -> str: ...


class ByteTokenizer:
    """The UTF-8 bytes of the text are the ids, so any text round-trips and no file is needed."""

    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        # A window may cut a multi-byte character in half; "replace" keeps decoding such slices usable.
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def fingerprint(self) -> str:
        return _sha256({"byte_tokenizer": self.vocab_size, "bos_id": self.bos_id, "eos_id": self.eos_id})


class HFTokenizer:
    """A tokenizer.json (the `tokenizers` library's format), used without its post-processor's specials:
    the data pipeline adds bos/eos itself, so every tokenizer frames documents the same way."""

    def __init__(self, path: str | Path, bos_token: str | None = None, eos_token: str | None = None):
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {self.path}")
        self._tokenizer = tokenizers.Tokenizer.from_file(str(self.path))
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_id: int = self._resolve("bos", bos_token, DEFAULT_BOS_TOKENS)
        self.eos_id: int = self._resolve("eos", eos_token, DEFAULT_EOS_TOKENS)

    def _resolve(self, role: str, token: str | None, defaults: tuple[str, ...]) -> int:
        candidates = (token,) if token else defaults
        for candidate in candidates:
            token_id = self._tokenizer.token_to_id(candidate)
            if token_id is not None:
                return token_id
        raise ValueError(
            f"{self.path}: no {role} token found (looked for {', '.join(map(repr, candidates))}); "
            f"name the tokenizer's {role} token with [tokenizer] {role}_token")

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # One call into Rust for many texts (threads there unless TOKENIZERS_PARALLELISM=false).
        return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def fingerprint(self) -> str:
        """What the ids mean: every token's id, and the ids that frame documents. Not the file's
        bytes, which another `tokenizers` version may serialise differently."""
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        return _sha256({"tokens": sorted((i, t) for t, i in vocab.items()), "bos_id": self.bos_id,
                        "eos_id": self.eos_id})


def _sha256(what: dict) -> str:
    return hashlib.sha256(json.dumps(what, ensure_ascii=False).encode()).hexdigest()


def build_tokenizer(name: str, path: str | None = None, bos_token: str | None = None,
                    eos_token: str | None = None) -> ByteTokenizer | HFTokenizer:
    """Empty strings count as "not given", so config defaults of "" can be passed straight through."""
    if name == "byte":
        return ByteTokenizer()
    if name == "hf":
        if not path:
            raise ValueError('tokenizer "hf" needs the path of a tokenizer.json: set [tokenizer] path')
        return HFTokenizer(path, bos_token=bos_token or None, eos_token=eos_token or None)
    raise ValueError(f"unknown tokenizer name {name!r}: expected one of {', '.join(TOKENIZER_NAMES)}")
