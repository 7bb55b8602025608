"""Training data, from a source to batches of (inputs, labels).

    build.py            build_data: the batches of one split of the [data] section's source
    sources.py          text documents: the embedded stdlib corpus, local files, Hub datasets
    checks.py           local text files checked (or cleaned) once: UTF-8, JSON, the text field
    document_reader.py  raw .jsonl/.json/.txt files read into documents, each bad one named
    document_tokens.py  documents tokenized and framed, in worker processes
    windows.py          text windows of seq_len + 1 tokens, synthetic windows, Batches
    shards.py           the token shard format (written by scripts/lib/prepare_shards/)
    shard_batches.py    shards and mixtures of them, read in a shuffled, layout-independent order
    prefetch.py         batches made ahead by a background thread
"""

import typing

Split = typing.Literal["train", "validation"]
SPLITS = typing.get_args(Split)
