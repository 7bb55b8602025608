"""Raw documents to token shards (the format: components/data/shards.py), in parallel worker
processes, resumably; scripts.prepare_data is the command line (scripts.bench.data times it).

The work is cut into units: a byte range of a .jsonl file, some row groups of a .parquet file, a
whole .json or .txt file, a range of rows of a Hugging Face dataset, a file of a streamed one.
Unit "fffff-ppppp" is part p of input file f; it becomes one shard per split, written under
temporary names and renamed, then marked done (units/<unit>.json). prepare.json, written first,
holds the settings and the units. So a killed run leaves its done units done and the same command
does the rest; a finished folder is left as it is; another tokenizer, other settings, or a source
file that changed after some of its units were done are refused, naming what differs, and so is an
unfinished folder begun under other document rules (checks.DOCUMENT_RULES).

    units.py   where the inputs are cut into units (local files, a Hugging Face dataset) and
               which split a document goes to: the planning, in the main process
    worker.py  one unit read, checked and tokenized into its shards, in a worker process
    run.py     the settings prepare.json records, resuming, the worker pool and index.json
               (prepare); it imports worker, which imports units
"""

from scripts.lib.prepare_shards.run import (Plan, prepare, settings_for, tokenizer_record,
                                            usable_cpus, wait_in_order)
from scripts.lib.prepare_shards.units import (PrepareError, file_units, held_out,
                                              hf_rows_or_files, hf_units, layout_splits, listing,
                                              load_hf, local_files)

__all__ = [
    "Plan",
    "PrepareError",
    "file_units",
    "held_out",
    "hf_rows_or_files",
    "hf_units",
    "layout_splits",
    "listing",
    "load_hf",
    "local_files",
    "prepare",
    "settings_for",
    "tokenizer_record",
    "usable_cpus",
    "wait_in_order",
]
