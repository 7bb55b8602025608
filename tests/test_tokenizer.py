"""The byte tokenizer and a real tokenizer.json, trained here, round-trip text and find their specials;
the bytes each id stands for add up to the decoded text's (bits per byte); the byte tokenizer as a
tokenizer.json encodes alike."""

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from components.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer, byte_tokenizer_json

ALPHABET = "abcdefghij klmnop\nqrstuvwxyz ABC 0123456789 .,;:!? éüßñ ÆØ Ωπ 漢字かな 🙂🚀"


def random_text(rng: random.Random, length: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(length))


def test_byte_tokenizer_ids_are_utf8_bytes_and_round_trip(rng):
    tokenizer = build_tokenizer("byte")
    for _ in range(20):
        text = random_text(rng, rng.randint(0, 80))
        ids = tokenizer.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert tokenizer.decode(ids) == text


def test_byte_tokenizer_specials():
    tokenizer = ByteTokenizer()
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, tokenizer.vocab_size) == (256, 257, 258, 259)
    ids = tokenizer.encode("héllo")
    assert all(0 <= i < 256 for i in ids)
    assert tokenizer.decode([tokenizer.bos_id, *ids, tokenizer.eos_id, tokenizer.pad_id]) == "héllo"
    # A window can end inside a multi-byte character; decoding it must not raise.
    assert tokenizer.decode(tokenizer.encode("é")[:1]) == "\ufffd"


def train_byte_level_bpe(rng: random.Random, specials: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([random_text(rng, 200) for _ in range(50)], trainer)
    return tokenizer


def test_hf_tokenizer_round_trips_and_adds_no_specials(tmp_path, rng):
    trained = train_byte_level_bpe(rng, ["<unk>", "<s>", "</s>"])
    bos, eos = trained.token_to_id("<s>"), trained.token_to_id("</s>")
    # A post-processor that frames every encoding: the wrapper must not apply it, the data pipeline frames.
    trained.post_processor = processors.TemplateProcessing(single="<s> $A </s>",
                                                           special_tokens=[("<s>", bos), ("</s>", eos)])
    path = tmp_path / "tokenizer.json"
    trained.save(str(path))

    tokenizer = build_tokenizer("hf", str(path))
    assert isinstance(tokenizer, HFTokenizer)
    assert (tokenizer.bos_id, tokenizer.eos_id) == (bos, eos)
    for _ in range(10):
        text = random_text(rng, rng.randint(1, 120))
        ids = tokenizer.encode(text)
        assert ids == trained.encode(text, add_special_tokens=False).ids
        assert bos not in ids and eos not in ids
        assert tokenizer.decode(ids) == text
        assert tokenizer.decode([bos, *ids, eos]) == text


def test_hf_tokenizer_vocab_size_counts_added_tokens_and_names_can_be_given(tmp_path, rng):
    trained = train_byte_level_bpe(rng, [])
    trained.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>", "<|my_eos|>"])
    path = tmp_path / "tokenizer.json"
    trained.save(str(path))

    default = build_tokenizer("hf", str(path))
    assert default.bos_id == trained.token_to_id("<|begin_of_text|>")
    assert default.eos_id == trained.token_to_id("<|end_of_text|>")
    assert default.vocab_size == trained.get_vocab_size(with_added_tokens=True)
    assert default.vocab_size > max(default.bos_id, default.eos_id)

    named = build_tokenizer("hf", str(path), bos_token="<|end_of_text|>", eos_token="<|my_eos|>")
    assert named.bos_id == trained.token_to_id("<|end_of_text|>")
    assert named.eos_id == trained.token_to_id("<|my_eos|>")

    # Config defaults of "" mean "not given".
    assert build_tokenizer("hf", str(path), bos_token="", eos_token="").eos_id == default.eos_id
    assert "warning" not in default.describe() + named.describe()
    # an ordinary token as a boundary: a text's own words may encode to it, now said in the line
    # the trainer logs (it was taken without a word)
    ordinary = next(t for t, i in trained.get_vocab().items() if i > 300 and t.isalpha())
    word_bos = build_tokenizer("hf", str(path), bos_token=ordinary)
    assert (f"bos {ordinary!r} (id {trained.token_to_id(ordinary)}, [tokenizer] bos_token; "
            "warning: an ordinary token of the vocabulary, which a text's own words may encode "
            "to), eos '<|end_of_text|>'") in word_bos.describe()


def test_hf_tokenizer_with_one_endoftext_token_uses_it_for_both_ends(tmp_path, rng):
    trained = train_byte_level_bpe(rng, ["<|endoftext|>"])
    path = tmp_path / "tokenizer.json"
    trained.save(str(path))
    tokenizer = build_tokenizer("hf", str(path))
    assert tokenizer.bos_id == tokenizer.eos_id == trained.token_to_id("<|endoftext|>")


def test_hf_tokenizer_errors_name_the_file_the_keys_and_the_specials(tmp_path, rng):
    missing = tmp_path / "nowhere" / "tokenizer.json"
    with pytest.raises(FileNotFoundError, match="nowhere/tokenizer.json"):
        build_tokenizer("hf", str(missing))

    path = tmp_path / "tokenizer.json"
    train_byte_level_bpe(rng, ["<pad>", "<s>", "<doc_end>"]).save(str(path))  # a bos, no eos
    with pytest.raises(ValueError, match=r"tokenizer\.json: no eos token found .*'</s>'.*: name "
                       r"the one that marks a document's end with \[tokenizer\] eos_token \(its "
                       r"special tokens: '<pad>', '<s>', '<doc_end>'\)$"):
        build_tokenizer("hf", str(path))
    with pytest.raises(ValueError, match=r"\[tokenizer\] bos_token = '<BOS>': .*tokenizer\.json "
                       r"has no such token \(its special tokens: '<pad>', '<s>', '<doc_end>'\)"):
        build_tokenizer("hf", str(path), bos_token="<BOS>", eos_token="<s>")
    assert build_tokenizer("hf", str(path), eos_token="<doc_end>").eos_id == 2
    # a file the tokenizers library cannot read was its bare Exception, a traceback naming no file
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer file .*bad\.json: not a tokenizer\.json the "
                       r"tokenizers library can read \(key must be a string"):
        build_tokenizer("hf", str(tmp_path / "bad.json"))


def test_hf_tokenizer_vocab_size_covers_ids_past_the_count(tmp_path):
    """A vocabulary with gaps (21 entries, specials at 600 and 601) counted 21 ids: the check
    against the model's rows passed, and the first batch failed on id 600 with a traceback."""
    vocab = {f"w{i}": i for i in range(19)} | {"<s>": 600, "</s>": 601}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    loaded = HFTokenizer(tmp_path / "tokenizer.json")
    assert (loaded.vocab_size, loaded.bos_id, loaded.eos_id) == (602, 600, 601)
    assert len(loaded.byte_lengths()) == 602


def test_hf_tokenizer_takes_bos_eos_from_tokenizer_config_json(tmp_path, rng):
    """A Hugging Face model folder's tokenizer_config.json names them (a string, or a dict with
    "content"); it outranks the common names."""
    trained = train_byte_level_bpe(rng, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    path = tmp_path / "tokenizer.json"
    trained.save(str(path))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": None, "eos_token": {"content": "<|im_end|>", "special": True}}))
    lines = []
    tokenizer = build_tokenizer("hf", str(path), log=lines.append)
    assert tokenizer.bos_id == trained.token_to_id("<|endoftext|>")  # config: none; a common name
    assert tokenizer.eos_id == trained.token_to_id("<|im_end|>")
    assert lines == [f"tokenizer {path}: {trained.get_vocab_size()} ids, bos '<|endoftext|>' "
                     "(id 0, a common name), eos '<|im_end|>' (id 2, tokenizer_config.json)"]


@pytest.mark.parametrize("processor", ["template", "sequence", "bert"])
def test_hf_tokenizer_takes_bos_eos_from_the_post_processor(tmp_path, rng, processor):
    """Names no common list has ([CLS]/[SEP], <doc>/</doc>): the post-processor frames a
    sequence with them."""
    bos, eos = ("[CLS]", "[SEP]") if processor == "bert" else ("<doc>", "</doc>")
    trained = train_byte_level_bpe(rng, ["<pad>", bos, eos])
    ids = {t: trained.token_to_id(t) for t in (bos, eos)}
    if processor == "bert":
        trained.post_processor = processors.BertProcessing((eos, ids[eos]), (bos, ids[bos]))
    else:
        template = processors.TemplateProcessing(
            single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} $B:1 {eos}:1",
            special_tokens=list(ids.items()))
        trained.post_processor = (processors.Sequence([processors.ByteLevel(), template])
                                  if processor == "sequence" else template)
    path = tmp_path / "tokenizer.json"
    trained.save(str(path))
    lines = []
    tokenizer = build_tokenizer("hf", str(path), log=lines.append)
    assert (tokenizer.bos_id, tokenizer.eos_id) == (ids[bos], ids[eos])
    assert f"bos '{bos}' (id {ids[bos]}, the post-processor)" in lines[0]


def test_hf_tokenizer_with_only_a_bos_in_its_template_finds_eos_by_name(tmp_path, rng):
    trained = train_byte_level_bpe(rng, ["<|begin_of_text|>", "<|end_of_text|>"])
    trained.post_processor = processors.TemplateProcessing(  # Llama-3's: bos only
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)])
    path = tmp_path / "tokenizer.json"
    trained.save(str(path))
    tokenizer = build_tokenizer("hf", str(path))
    assert (tokenizer.bos_id, tokenizer.eos_id) == (0, 1)
    assert tokenizer.found == {"bos": "'<|begin_of_text|>' (id 0, the post-processor)",
                               "eos": "'<|end_of_text|>' (id 1, a common name)"}


def test_hf_tokenizer_path_may_be_the_folder_holding_tokenizer_json(tmp_path, rng):
    """As [tokenizer] path's doc says (and a Hugging Face model folder is): the trainer, the
    scripts and prepare_data all take the folder."""
    from components.config.parse import load_config
    from scripts.lib.checkpoints import run_tokenizer

    train_byte_level_bpe(rng, ["<s>", "</s>", "<eod>"]).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<eod>"}')
    tokenizer = build_tokenizer("hf", str(tmp_path))
    assert tokenizer.path == tmp_path / "tokenizer.json"
    assert (tokenizer.bos_id, tokenizer.eos_id) == (0, 2)  # eos from the config beside it
    cfg = load_config(["--tokenizer.name", "hf", "--tokenizer.path", str(tmp_path)])
    assert run_tokenizer(cfg).fingerprint() == tokenizer.fingerprint()
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"tokenizer folder .*/empty holds no "
                                                r"tokenizer\.json"):
        build_tokenizer("hf", str(tmp_path / "empty"))


def test_each_tool_names_its_own_options_and_the_byte_tokenizer_refuses_token_names(tmp_path, rng):
    """prepare_data's errors named the trainer's --tokenizer.bos_token and [tokenizer] bos_token,
    which it does not take; and a bos/eos named for the byte tokenizer was ignored unsaid."""
    path = tmp_path / "tokenizer.json"
    train_byte_level_bpe(rng, ["<pad>", "<doc_end>"]).save(str(path))  # no bos, no eos
    flags = {"name": "--tokenizer", "path": "--tokenizer", "bos_token": "--bos-token",
             "eos_token": "--eos-token"}
    with pytest.raises(ValueError, match=r"no bos token found .*: name the one that marks a "
                       r"document's start with --bos-token \(its special tokens"):
        build_tokenizer("hf", str(path), options=flags)
    with pytest.raises(ValueError, match=r"^--eos-token '<x>': .*tokenizer\.json has no such"):
        build_tokenizer("hf", str(path), bos_token="<pad>", eos_token="<x>", options=flags)
    with pytest.raises(ValueError, match=r"^\[tokenizer\] eos_token = '<x>': .*tokenizer\.json"):
        build_tokenizer("hf", str(path), bos_token="<pad>", eos_token="<x>")

    for role in ("bos_token", "eos_token"):
        with pytest.raises(ValueError) as refused:
            build_tokenizer("byte", **{role: "<s>"})
        assert str(refused.value) == (
            f"[tokenizer] {role} = '<s>' is set, but [tokenizer] name = 'byte' has no tokens to "
            f"name (its bos and eos are ids 256 and 257): leave [tokenizer] {role} out, or use a "
            "tokenizer.json")
    with pytest.raises(ValueError, match=r"^--bos-token '<s>' is set, but --tokenizer 'byte' has "
                       "no tokens to name"):
        build_tokenizer("byte", bos_token="<s>", options=flags)
    assert isinstance(build_tokenizer("byte", bos_token="", eos_token=""), ByteTokenizer)


def test_build_tokenizer_rejects_unknown_names_and_a_missing_path():
    with pytest.raises(ValueError, match=r"unknown tokenizer name 'sentencepiece'.*byte, hf"):
        build_tokenizer("sentencepiece")
    with pytest.raises(ValueError, match=r"\[tokenizer\] path"):
        build_tokenizer("hf")
    with pytest.raises(ValueError, match=r"\[tokenizer\] path"):
        build_tokenizer("hf", "")


# ---- bytes per token (bits per byte) ---------------------------------------------------------

def byte_sum(tokenizer, ids) -> int:
    lengths = tokenizer.byte_lengths()
    return sum(lengths[i] for i in ids)


def test_byte_tokenizer_byte_lengths(rng):
    tokenizer = ByteTokenizer()
    lengths = tokenizer.byte_lengths()
    assert len(lengths) == tokenizer.vocab_size and lengths[255] == 1 and lengths[256:] == [0] * 3
    text = random_text(rng, 100)
    ids = [tokenizer.bos_id, *tokenizer.encode(text), tokenizer.eos_id]
    assert byte_sum(tokenizer, ids) == len(text.encode("utf-8"))


def test_byte_level_bpe_byte_lengths_add_up_to_the_decoded_bytes(tmp_path, rng):
    """Exact, also where tokens hold parts of a character: characters never seen in training
    are split into single bytes, each of which alone decodes to a replacement character."""
    trained = train_byte_level_bpe(rng, ["<s>", "</s>"])
    trained.add_tokens(["<|tool|>"])  # an added token that decodes to itself
    trained.save(str(tmp_path / "tokenizer.json"))
    tokenizer = HFTokenizer(tmp_path / "tokenizer.json")
    assert len(tokenizer.byte_lengths()) == tokenizer.vocab_size
    assert tokenizer.byte_lengths()[tokenizer.bos_id] == 0
    partial = set()
    for _ in range(30):
        text = random_text(rng, rng.randint(1, 150)) + rng.choice(["", " <|tool|> x", "龍🦀ǅ"])
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        partial |= {i for i in ids if "\ufffd" in tokenizer.decode([i])}
        framed = [tokenizer.bos_id, *ids, tokenizer.eos_id]
        assert byte_sum(tokenizer, framed) == len(text.encode("utf-8")), text
    assert partial  # some tokens held part of a multi-byte character


def test_special_tokens_written_in_a_text_are_text(tmp_path, rng):
    """"<s>" in a document (HTML strikethrough, text about tokenizers) became the bos id that
    frames documents, and its bytes went uncounted in bits per byte. Special tokens' names are
    now encoded as characters, as ByteTokenizer (and torchtitan's tiktoken) do; an added token
    that is not special still matches."""
    trained = train_byte_level_bpe(rng, ["<s>", "</s>"])
    trained.add_tokens(["<|tool|>"])
    trained.save(str(tmp_path / "tokenizer.json"))
    tokenizer = HFTokenizer(tmp_path / "tokenizer.json")
    tool = tokenizer._tokenizer.token_to_id("<|tool|>")
    for text in ["price <s>10</s> 8", "</s><s>", "a <|tool|> b <s>"]:
        ids = tokenizer.encode(text)
        assert tokenizer.bos_id not in ids and tokenizer.eos_id not in ids, (text, ids)
        assert (tool in ids) == ("<|tool|>" in text)
        assert tokenizer.decode(ids) == text
        assert tokenizer.encode_batch([text]) == [ids]
        assert byte_sum(tokenizer, [tokenizer.bos_id, *ids, tokenizer.eos_id]) == len(text.encode())
    path = tmp_path / "byte.json"  # export_hf's byte tokenizer, loaded by this class
    path.write_text(byte_tokenizer_json())
    text = "<|begin_of_text|> <|end_of_text|>"
    assert HFTokenizer(path).encode(text) == ByteTokenizer().encode(text)


@pytest.mark.parametrize("decoder", ["metaspace", "llama2_sequence"])
def test_sentencepiece_style_byte_lengths_count_the_leading_space(tmp_path, rng, decoder):
    """Metaspace ("▁") pieces with <0xNN> byte fallback, as Llama 2's tokenizer.json: exact but
    for the space the tokenizer puts before a text's first word, which decoding drops."""
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    if decoder == "metaspace":
        tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(
            replacement="▁", prepend_scheme="first")])
    else:
        tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "),
                                               decoders.ByteFallback(), decoders.Fuse(),
                                               decoders.Strip(" ", 1, 0)])
    ascii_only = "abcdefghij klmnop qrstuvwxyz ABC 0123456789 .,;:!?"
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    tokenizer.train_from_iterator(["".join(rng.choice(ascii_only) for _ in range(200))
                                   for _ in range(50)], trainer)
    spec = json.loads(tokenizer.to_str())  # the byte tokens go into the vocabulary, as Llama 2's
    vocab = spec["model"]["vocab"]
    vocab.update({t: len(vocab) + i for i, t in enumerate(byte_tokens)})
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    wrapped = HFTokenizer(tmp_path / "tokenizer.json")
    lengths = wrapped.byte_lengths()
    fell_back = False
    for _ in range(30):
        text = random_text(rng, rng.randint(1, 100))  # non-ASCII characters fall back to bytes
        ids = wrapped.encode(text)
        fell_back |= any(wrapped.id_to_token(i).startswith("<0x") for i in ids)
        # decoding drops a leading space: the one added before the first word, or the text's own
        assert wrapped.decode(ids) == text.removeprefix(" ")
        expected = len(text.encode("utf-8")) + (not text.startswith(" "))
        assert sum(lengths[i] for i in [wrapped.bos_id, *ids]) == expected, text
    assert fell_back


def test_byte_tokenizer_as_tokenizer_json_encodes_alike(tmp_path, rng):
    """What export_hf.py ships for a byte-tokenizer run: the same ids for any text."""
    path = tmp_path / "tokenizer.json"
    path.write_text(byte_tokenizer_json())
    wrapped, byte = HFTokenizer(path), ByteTokenizer()
    assert (wrapped.bos_id, wrapped.eos_id, wrapped.vocab_size) == (256, 257, 259)
    assert wrapped.byte_lengths() == byte.byte_lengths()
    for _ in range(50):
        ranges = [(0, 0x80), (0x80, 0x800), (0x800, 0xD800), (0x10000, 0x110000)]
        text = "".join(chr(rng.randrange(*rng.choice(ranges))) for _ in range(rng.randint(0, 30)))
        assert wrapped.encode(text) == byte.encode(text)
        assert wrapped.decode(wrapped.encode(text)) == text
    assert Tokenizer.from_file(str(path)).encode("ab").ids == [256, 97, 98]  # bos, as trained


def test_truncation_or_padding_saved_in_a_tokenizer_json_is_turned_off(tmp_path, rng):
    """A tokenizer.json saved with truncation/padding enabled (as sentence-transformers saves
    them, or after enable_truncation) cut every document to max_length ids and padded the short
    ones with pad ids, in the trainer and in prepare_data alike (both frame with frame_texts),
    without a word. Both are now turned off on load, with one warning naming the file and what
    it set."""
    from components.data.document_tokens import frame_texts

    trained = train_byte_level_bpe(rng, ["<s>", "</s>"])
    trained.save(str(tmp_path / "plain.json"))
    trained.enable_truncation(max_length=8)
    trained.enable_padding(pad_id=trained.token_to_id("</s>"), pad_token="</s>")
    trained.save(str(tmp_path / "tokenizer.json"))
    plain = HFTokenizer(tmp_path / "plain.json")
    with pytest.warns(UserWarning) as caught:
        saved = HFTokenizer(tmp_path / "tokenizer.json")
    [warning] = caught
    assert str(warning.message) == (
        f"{tmp_path / 'tokenizer.json'} sets truncation (max_length 8) and padding (to the "
        "longest, with '</s>'): both off here; documents are encoded whole")
    documents = [random_text(rng, 300), "a"]  # one long (> 8 ids), one short
    assert len(plain.encode(documents[0])) > 8
    assert saved.encode(documents[0]) == plain.encode(documents[0])  # not cut to 8 ids
    tokens, lengths = frame_texts(saved, documents)
    expected, expected_lengths = frame_texts(plain, documents)
    assert lengths.tolist() == expected_lengths.tolist()  # no document cut, none padded
    assert tokens.tolist() == expected.tolist()

    trained.no_padding()  # one of them set: named alone
    trained.save(str(tmp_path / "truncating.json"))
    with pytest.warns(UserWarning, match=r"truncating\.json sets truncation \(max_length 8\): it "
                                         "is off here; documents are encoded whole"):
        assert HFTokenizer(tmp_path / "truncating.json").encode(documents[0]) == \
            plain.encode(documents[0])


def test_spawned_tokenizer_workers_encode_a_special_tokens_name_as_text(tmp_path, rng, monkeypatch):
    """Workers are spawned off Linux (document_tokens.worker_context: macOS), which pickles the
    HFTokenizer: `tokenizers` pickles its JSON, which lost `encode_special_tokens = True`, so
    "<s>" written in a document became the bos id that frames documents (a fake document
    boundary) with [data] num_workers > 0 or in prepare_data's workers, but stayed text with
    num_workers = 0. The flag now travels with the pickle."""
    import multiprocessing
    import pickle

    from components.data import document_tokens
    from components.data.document_tokens import TokenizerPool, frame_texts

    train_byte_level_bpe(rng, ["<s>", "</s>"]).save(str(tmp_path / "tokenizer.json"))
    tokenizer = HFTokenizer(tmp_path / "tokenizer.json")
    text = "alpha <s> beta </s> gamma"
    assert tokenizer.bos_id not in tokenizer.encode(text)
    copied = pickle.loads(pickle.dumps(tokenizer))  # what spawning a worker does to it
    assert copied.encode(text) == tokenizer.encode(text)
    assert copied.encode_batch([text]) == tokenizer.encode_batch([text])
    monkeypatch.setattr(document_tokens, "worker_context",
                        lambda: multiprocessing.get_context("spawn"))
    pool = TokenizerPool(tokenizer, 1)
    try:
        [(_, (tokens, _lengths))] = list(pool.map(iter([((0, 0), 0, None, [text])])))
    finally:
        pool.close()
    assert tokens.tolist() == frame_texts(tokenizer, [text])[0].tolist()


def test_a_bos_eos_added_as_a_token_that_is_not_special_is_warned_of(tmp_path, rng):
    """A tokenizer whose document marker was added with add_tokens (special=False): a document
    that writes "<|endoftext|>" gets the very id that frames documents (a fake document
    boundary), and the warning given for a bos/eos that a text's own words encode to was not
    given, because it checked for an added token, not a special one. The log line now warns,
    and says how to keep such text as characters; a special token's line is unchanged."""
    from tokenizers import AddedToken

    trained = train_byte_level_bpe(rng, [])
    trained.add_tokens([AddedToken("<|endoftext|>", special=False)])
    path = tmp_path / "tokenizer.json"
    trained.save(str(path))
    loaded = build_tokenizer("hf", str(path))
    eos = trained.token_to_id("<|endoftext|>")
    assert loaded.eos_id == eos and eos in loaded.encode("alpha <|endoftext|> beta")
    assert (f"eos '<|endoftext|>' (id {eos}, a common name; warning: an added token that is not "
            "special, which '<|endoftext|>' written in a document encodes to (\"special\": true "
            "in its entry of the file's added_tokens keeps such text as characters))"
            ) in loaded.describe()
    assert "warning" in loaded.found["bos"]
    spec = json.loads(path.read_text())  # what the warning says to do
    for entry in spec["added_tokens"]:
        entry["special"] = True
    path.write_text(json.dumps(spec))
    special = build_tokenizer("hf", str(path))
    assert "warning" not in special.describe()
    assert eos not in special.encode("alpha <|endoftext|> beta")
