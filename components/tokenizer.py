"""Tokenizers: a built-in byte tokenizer (needs no files) and a wrapper for a Hugging Face tokenizer.json.

Each also says how many UTF-8 bytes every id stands for (`byte_lengths()`), for bits per byte.
"""

import functools
import typing
import hashlib
import json
import re
import warnings
from pathlib import Path
from typing import Iterable, Protocol

import tokenizers

from components.config.schema import TokenizerName
from components.rank_warnings import SameOnEveryRank

TOKENIZER_NAMES = typing.get_args(TokenizerName)
TOKENIZER_FILE = "tokenizer.json"  # what a folder given as a tokenizer's path holds

# Tried in order when the caller names no token. "<|endoftext|>" is in both lists because GPT-2 style
# tokenizers use that one token to mark both ends of a document.
DEFAULT_BOS_TOKENS = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|startoftext|>", "<|endoftext|>")
DEFAULT_EOS_TOKENS = ("<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|endoftext|>", "<|im_end|>")

# What errors call the settings: the trainer's config keys by default; another tool (prepare_data)
# passes its own option names, so that a message never names an option the tool does not take.
CONFIG_KEYS = {"name": "[tokenizer] name", "path": "[tokenizer] path",
               "bos_token": "[tokenizer] bos_token", "eos_token": "[tokenizer] eos_token"}


def _given(option: str, value: str) -> str:
    """"[tokenizer] bos_token = '<s>'" for a config key, "--bos-token '<s>'" for a flag."""
    return f"{option} {value!r}" if option.startswith("-") else f"{option} = {value!r}"


class Tokenizer(Protocol):
    bos_id: int
    eos_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def fingerprint(self) -> str: ...
    def byte_lengths(self) -> list[int]: ...


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

    def byte_lengths(self) -> list[int]:
        """Bytes per id: 1 for each byte, 0 for bos, eos and pad."""
        return [1] * 256 + [0] * (self.vocab_size - 256)


class HFTokenizer:
    """A tokenizer.json (the `tokenizers` library's format), used without its post-processor's specials:
    the data pipeline adds bos/eos itself, so every tokenizer frames documents the same way.

    bos/eos, unless named: the tokenizer_config.json beside the file (a Hugging Face model folder's
    bos_token/eos_token), else the tokens the post-processor frames a sequence with (e.g. "<s> $A
    </s>", or Llama-3's "<|begin_of_text|> $A"), else the first of the common names that the
    tokenizer has. `found` says where each came from."""

    def __init__(self, path: str | Path, bos_token: str | None = None, eos_token: str | None = None,
                 options: dict[str, str] | None = None):
        """path: the tokenizer.json, or a folder holding one (a Hugging Face model folder).
        options: what errors call bos_token and eos_token (CONFIG_KEYS')."""
        self._fingerprint: str | None = None
        self._options = {**CONFIG_KEYS, **(options or {})}
        self.path = Path(path).expanduser()
        if self.path.is_dir():
            if not (self.path / TOKENIZER_FILE).is_file():
                raise FileNotFoundError(f"tokenizer folder {self.path} holds no {TOKENIZER_FILE}")
            self.path = self.path / TOKENIZER_FILE
        elif not self.path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {self.path}")
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as e:  # the library raises a bare Exception for a malformed file
            raise ValueError(f"tokenizer file {self.path}: not a tokenizer.json the tokenizers "
                             f"library can read ({' '.join(str(e).split())})") from None
        # A document's text is text: "<s>" or "<|endoftext|>" written in it (HTML, code about
        # tokenizers) is encoded as its characters, not as the special id that frames documents,
        # as ByteTokenizer and torchtitan's tiktoken do. Added tokens that are not special match.
        self._tokenizer.encode_special_tokens = True
        self._encode_whole()
        # the ids, not how many there are: a vocabulary with gaps (ids past its size) must
        # still fit the model's rows, which the trainer checks against this before any batch
        ids = self._tokenizer.get_vocab(with_added_tokens=True).values()
        self.vocab_size: int = max(self._tokenizer.get_vocab_size(with_added_tokens=True),
                                   max(ids, default=-1) + 1)
        config, framing = self._config_specials(), self._framing_specials()
        self.found: dict[str, str] = {}
        self.bos_id: int = self._resolve("bos", bos_token, config["bos"], framing["bos"],
                                         DEFAULT_BOS_TOKENS)
        self.eos_id: int = self._resolve("eos", eos_token, config["eos"], framing["eos"],
                                         DEFAULT_EOS_TOKENS)

    def __getstate__(self) -> dict:
        # `tokenizers` pickles a tokenizer as its JSON, which leaves encode_special_tokens out:
        # a spawned worker's copy (macOS; prepare_data's and [data] num_workers' pools) encoded
        # "<s>" written in a document as the bos id. It travels beside it and is set again.
        return {**self.__dict__, "_encode_special_tokens": self._tokenizer.encode_special_tokens}

    def __setstate__(self, state: dict) -> None:
        encode_special_tokens = state.pop("_encode_special_tokens")
        self.__dict__.update(state)
        self._tokenizer.encode_special_tokens = encode_special_tokens

    def _encode_whole(self) -> None:
        """Truncation and padding saved in the file turned off (encode_whole), with a warning."""
        found = encode_whole(self._tokenizer)
        if not found:
            return
        warnings.warn(f"{self.path} sets {' and '.join(found)}: "
                      f"{'both' if len(found) == 2 else 'it is'} off here; documents are encoded "
                      "whole", SameOnEveryRank)

    def _config_specials(self) -> dict[str, str | None]:
        """bos_token/eos_token of a tokenizer_config.json beside the file: a string, or a dict
        with "content" (transformers writes either); None where absent or unreadable."""
        found = {"bos": None, "eos": None}
        config = self.path.with_name("tokenizer_config.json")
        try:
            values = json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}
        except (OSError, ValueError):
            return found
        for role in found:
            value = values.get(f"{role}_token") if isinstance(values, dict) else None
            value = value.get("content") if isinstance(value, dict) else value
            found[role] = value if isinstance(value, str) and value else None
        return found

    def _framing_specials(self) -> dict[str, str | None]:
        """The special tokens the post-processor puts before and after a single sequence."""
        found = {"bos": None, "eos": None}
        processor = json.loads(self._tokenizer.to_str()).get("post_processor") or {}
        processors = processor.get("processors", [processor])  # "Sequence" holds a list
        for proc in processors:
            kind = proc.get("type")
            if kind in ("BertProcessing", "RobertaProcessing"):  # [CLS] $A [SEP], <s> $A </s>
                found["bos"], found["eos"] = proc["cls"][0], proc["sep"][0]
            elif kind == "TemplateProcessing":
                pieces, specials = proc.get("single", []), proc.get("special_tokens", {})
                # a template names a special by a key that maps to its token(s)
                tokens = [specials.get(key, {}).get("tokens", [key])
                          if (key := p.get("SpecialToken", {}).get("id")) else None
                          for p in pieces]  # None: the sequence ($A)
                at = tokens.index(None) if None in tokens else len(tokens)
                before = [t[0] for t in tokens[:at] if len(t) == 1]
                after = [t[0] for t in tokens[at + 1:] if len(t) == 1]
                found["bos"] = before[-1] if before else found["bos"]
                found["eos"] = after[0] if after else found["eos"]
        return found

    def _resolve(self, role: str, named: str | None, config: str | None, framing: str | None,
                 defaults: tuple[str, ...]) -> int:
        key = self._options[f"{role}_token"]
        if named:
            token_id = self._tokenizer.token_to_id(named)
            if token_id is None:
                raise ValueError(f"{_given(key, named)}: {self.path} has no such token"
                                 + self._specials_hint())
            self.found[role] = f"{named!r} (id {token_id}, {key}{self._ordinary(token_id)})"
            return token_id
        candidates = [(config, "tokenizer_config.json"), (framing, "the post-processor")]
        candidates += [(name, "a common name") for name in defaults]
        for candidate, source in candidates:
            token_id = self._tokenizer.token_to_id(candidate) if candidate else None
            if token_id is not None:
                self.found[role] = f"{candidate!r} (id {token_id}, {source}{self._ordinary(token_id)})"
                return token_id
        raise ValueError(
            f"{self.path}: no {role} token found (not in a tokenizer_config.json beside it nor in "
            f"its post-processor; none of {', '.join(map(repr, defaults))}): name the one that "
            f"marks a document's {'start' if role == 'bos' else 'end'} with {key}"
            + self._specials_hint())

    def _ordinary(self, token_id: int) -> str:
        """A warning for a bos/eos that is not a special token: a text's own words encode to it
        too, and then read as a document's boundary ("", else). Only special tokens' names are
        encoded as characters (encode_special_tokens): an added token that is not special (added
        with add_tokens) matches its name written in a document."""
        added = self._tokenizer.get_added_tokens_decoder().get(token_id)
        if added is not None and added.special:
            return ""
        if added is not None:
            return (f"; warning: an added token that is not special, which {added.content!r} "
                    'written in a document encodes to ("special": true in its entry of the '
                    "file's added_tokens keeps such text as characters)")
        return "; warning: an ordinary token of the vocabulary, which a text's own words may encode to"

    def _specials_hint(self) -> str:
        specials = [t.content for t in self._tokenizer.get_added_tokens_decoder().values()
                    if t.special]
        if not specials:
            return " (the tokenizer has no special tokens)"
        more = f", ... ({len(specials)} in all)" if len(specials) > 12 else ""
        return f" (its special tokens: {', '.join(map(repr, specials[:12]))}{more})"

    def describe(self) -> str:
        return (f"tokenizer {self.path}: {self.vocab_size:,} ids, bos {self.found['bos']}, "
                f"eos {self.found['eos']}")

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # One call into Rust for many texts (threads there unless TOKENIZERS_PARALLELISM=false).
        return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def fingerprint(self) -> str:
        """What the ids mean: every token's id, and the ids that frame documents. Not the file's
        bytes, which another `tokenizers` version may serialise differently. Computed once (a
        resumed run asks twice; sorting a 128k vocabulary takes ~0.1 s)."""
        if self._fingerprint is None:
            vocab = self._tokenizer.get_vocab(with_added_tokens=True)
            self._fingerprint = _sha256({"tokens": sorted((i, t) for t, i in vocab.items()),
                                         "bos_id": self.bos_id, "eos_id": self.eos_id})
        return self._fingerprint

    def id_to_token(self, token_id: int) -> str | None:
        return self._tokenizer.id_to_token(token_id)

    def byte_lengths(self) -> list[int]:
        """UTF-8 bytes per id in decoded text (0 for special tokens, which decode() drops).

        Byte-level BPE (GPT-2, Llama 3; a ByteLevel decoder): each character of a token stands
        for one byte (GPT-2's byte-to-character map), so the lengths of any id sequence add up
        to exactly the bytes it decodes to, also where a token holds part of a character.
        SentencePiece-style tokenizers (Metaspace or a "▁" -> " " Replace, <0xNN> byte
        fallback): "▁" counts as the space it decodes to and <0xNN> as one byte; decoding drops
        the space such a tokenizer puts before a text's first word, so their sum over a text
        that does not start with a space is its byte length + 1. Other decoders: the token's
        own UTF-8 length."""
        spec = json.loads(self._tokenizer.to_str()).get("decoder")
        decoders = _decoder_specs(spec)
        kinds = {d.get("type") for d in decoders}
        replacements = [(d["replacement"], " ") for d in decoders if d.get("type") == "Metaspace"]
        replacements += [(d["pattern"]["String"], d["content"]) for d in decoders
                         if d.get("type") == "Replace" and "String" in d.get("pattern", {})]
        specials = {i for i, token in self._tokenizer.get_added_tokens_decoder().items()
                    if token.special}
        byte_of = {c: b for b, c in _bytes_to_unicode().items()}
        lengths = []
        for i in range(self.vocab_size):
            token = self._tokenizer.id_to_token(i)
            if token is None or i in specials:
                lengths.append(0)
            elif "ByteLevel" in kinds and all(c in byte_of for c in token):
                lengths.append(len(token))
            elif "ByteFallback" in kinds and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):
                lengths.append(1)
            else:  # also what the ByteLevel decoder does with a token outside its alphabet
                for old, new in replacements:
                    token = token.replace(old, new)
                lengths.append(len(token.encode("utf-8")))
        return lengths


def _sha256(what: dict) -> str:
    return hashlib.sha256(json.dumps(what, ensure_ascii=False).encode()).hexdigest()


def _decoder_specs(spec: dict | None) -> list[dict]:
    """A tokenizer.json decoder and, for a Sequence, the decoders in it."""
    if not spec:
        return []
    if spec.get("type") == "Sequence":
        return [d for inner in spec.get("decoders", []) for d in _decoder_specs(inner)]
    return [spec]


@functools.cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from the 256 byte values to printable characters, the alphabet in which
    byte-level BPE vocabularies are written (tokenizers' ByteLevel uses the same map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable}
    chars.update({b: chr(256 + n) for n, b in enumerate(others)})
    return dict(sorted(chars.items()))


BYTE_SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>")  # ids 256, 257, 258


def encode_whole(tokenizer: tokenizers.Tokenizer) -> list[str]:
    """Turns off the truncation and padding a tokenizer.json saved (sentence-transformers saves
    them, and so does a tokenizer saved after enable_truncation); returns what was on, e.g.
    ["truncation (max_length 8)"], empty where neither was. With them on, every document was cut
    to max_length ids and the shorter ones padded with pad ids, which the trainer and
    prepare_data framed and trained on as text: the trainer frames whole documents and cuts
    windows itself. export_hf ships the tokenizer so too."""
    truncation, padding = tokenizer.truncation, tokenizer.padding
    found = []
    if truncation is not None:
        found.append(f"truncation (max_length {truncation['max_length']})")
    if padding is not None:
        length = f"length {padding['length']}" if padding.get("length") else "to the longest"
        found.append(f"padding ({length}, with {padding['pad_token']!r})")
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return found


def with_training_framing(tokenizer_json: str, bos: str, eos: str) -> str:
    """A tokenizer.json whose post-processor frames text as training did, for an exported
    folder (transformers applies it when asked for special tokens, its default): a text gets bos
    first, as every document began; a pair is two documents, "bos A eos bos B", joined as
    training joined them. No eos after the last text, so that a prompt continues its document
    (append eos to score a whole document as training did). ByteLevel post-processors (offsets
    only) are kept; any other framing (e.g. "<s> $A </s>") is replaced: the model never saw it.
    The rest of the file is unchanged."""
    from tokenizers import processors

    tokenizer = tokenizers.Tokenizer.from_str(tokenizer_json)
    ids = {token: tokenizer.token_to_id(token) for token in (bos, eos)}
    missing = [token for token, token_id in ids.items() if token_id is None]
    if missing:
        raise ValueError(f"the tokenizer has no token {missing[0]!r} to frame documents with")
    spec = json.loads(tokenizer_json)
    old = spec.get("post_processor") or {}
    kept = [p for p in old.get("processors", [old]) if p.get("type") == "ByteLevel"]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=[f"{bos}:0", "$A:0"], pair=[f"{bos}:0", "$A:0", f"{eos}:0", f"{bos}:1", "$B:1"],
        special_tokens=list(ids.items()))
    framing = json.loads(tokenizer.to_str())["post_processor"]
    spec["post_processor"] = {"type": "Sequence", "processors": kept + [framing]} if kept else framing
    return tokenizers.Tokenizer.from_str(json.dumps(spec)).to_str(pretty=True)


def byte_tokenizer_json() -> str:
    """The byte tokenizer as a tokenizer.json (for an exported Hugging Face folder): the same ids
    for any text, bos/eos/pad at 256/257/258 under Llama 3's names (so HFTokenizer finds them),
    and training's framing (with_training_framing). Byte-level BPE without merges: each byte is
    its own token. (A text that holds one of those names literally is encoded as bytes, as
    ByteTokenizer does, where the folder's tokenizer_config.json sets split_special_tokens.)"""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers

    vocab = {c: b for b, c in _bytes_to_unicode().items()}
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in BYTE_SPECIAL_TOKENS])
    return with_training_framing(tokenizer.to_str(), *BYTE_SPECIAL_TOKENS[:2])


def build_tokenizer(name: str, path: str | None = None, bos_token: str | None = None,
                    eos_token: str | None = None, log=None,
                    options: dict[str, str] | None = None) -> ByteTokenizer | HFTokenizer:
    """Empty strings count as "not given", so config defaults of "" can be passed straight through.
    log, when given, gets one line saying which bos/eos a tokenizer.json's are and why. options:
    what errors call name, path, bos_token and eos_token (CONFIG_KEYS' by default)."""
    options = {**CONFIG_KEYS, **(options or {})}
    if name == "byte":
        # its bos/eos are ids of its own, not tokens: a name given for one was ignored unsaid
        for key, token in (("bos_token", bos_token), ("eos_token", eos_token)):
            if token:
                raise ValueError(
                    f"{_given(options[key], token)} is set, but {_given(options['name'], 'byte')} "
                    f"has no tokens to name (its bos and eos are ids {ByteTokenizer.bos_id} and "
                    f"{ByteTokenizer.eos_id}): leave {options[key]} out, or use a tokenizer.json")
        return ByteTokenizer()
    if name == "hf":
        if not path:
            raise ValueError('tokenizer "hf" needs the path of a tokenizer.json (or of a folder holding '
                             f'one): set {options["path"]}')
        tokenizer = HFTokenizer(path, bos_token=bos_token or None, eos_token=eos_token or None,
                                options=options)
        if log is not None:
            log(tokenizer.describe())
        return tokenizer
    raise ValueError(f"unknown tokenizer name {name!r}: expected one of {', '.join(TOKENIZER_NAMES)}")
