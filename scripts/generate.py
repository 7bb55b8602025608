"""Sample text from a checkpoint with this repo's Llama (KV cache; CPU or GPU).

    python3 -m scripts.generate --checkpoint outputs/debug/checkpoint --prompt "def " \\
        [--max-new-tokens 200] [--temperature 0.8 --top-k 50 --top-p 0.95] [--seed 0] \\
        [--num-samples 1] [--batch-size B] [--device auto|cpu|cuda] \\
        [--dtype auto|float32|bfloat16] [--no-cache]

--checkpoint: a DCP step folder, the folder of a run's step-<N> folders (the latest), or a
Hugging Face folder written by export_hf.py (or any LlamaForCausalLM folder this Llama can run).
The tokenizer is the run's ([tokenizer] in the checkpoint's config.toml) or the folder's
tokenizer.json. The prompt is framed as training framed documents: bos, then its tokens;
generation stops at eos or after --max-new-tokens. --temperature 0 is greedy. A sample prints as
the prompt's ids and its new ids decoded together; a prompt that its ids do not decode back to
(text the tokenizer drops or normalises) gets a warning showing what the model sees.

The --num-samples samples decode together, --batch-size of them at a time (default: all) as the
rows of one batch: the prompt runs once, then one step per token for the rows still going; a row
stops at its own eos and leaves the batch. The KV cache grows with the batch (2 x layers x kv heads x head_dim x positions
values per row). Sample i draws from its own generator, seeded from --seed and i, so it does not
depend on --batch-size or --num-samples (a seed gives other samples than the sequential
sampling before the batching did).
"""

import argparse
import sys
import time

if not __package__:  # run as a file: the repository root (models) is not importable
    sys.exit("run from the repository root as a module: python3 -m scripts.generate ...")

from scripts.lib import checkpoints  # noqa: E402
from scripts.lib.checkpoints import DTYPES, pick_device, pick_dtype  # noqa: E402
from models.generation import check_sampling, generate_batch, row_generators  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m scripts.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="a DCP step folder, a run's checkpoint folder (latest) or a Hugging "
                             "Face folder")
    parser.add_argument("--prompt", default="", help="text to continue (default: none, bos only)")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0,
                        help="sample among the k likeliest (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="sample among the likeliest ids whose probabilities reach p (1: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=None,
                        help="samples decoded together (default: all); the KV cache grows with it")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    parser.add_argument("--no-cache", action="store_true",
                        help="recompute the whole sequence for every token (slow; for checking)")
    parser.add_argument("--tokenizer", default=None,
                        help="a tokenizer.json instead of the run's / the folder's")
    opts = parser.parse_args(argv)

    try:
        check_sampling(opts.max_new_tokens, opts.temperature, opts.top_k, opts.top_p)
        if opts.num_samples < 1:
            raise ValueError(f"--num-samples {opts.num_samples}: expected >= 1")
        if opts.batch_size is not None and opts.batch_size < 1:
            raise ValueError(f"--batch-size {opts.batch_size}: expected >= 1")
        batch_size = min(opts.batch_size or opts.num_samples, opts.num_samples)
        device = pick_device(opts.device)
        loaded = checkpoints.load_model(opts.checkpoint, device, pick_dtype(opts.dtype, device),
                                        tokenizer_path=opts.tokenizer)
        tokenizer = loaded.tokenizer
        prompt_ids = tokenizer.encode(opts.prompt)
        prompt = [tokenizer.bos_id, *prompt_ids]
        seen = tokenizer.decode(prompt_ids)
        if seen != opts.prompt:  # normalised, or text the tokenizer cannot encode dropped
            print(f"generate: warning: the tokenizer does not give back the prompt: the model "
                  f"sees {seen!r}", file=sys.stderr)
        generators = row_generators(opts.seed, opts.num_samples, device)
        print(f"generate: {loaded.folder}, {device.type}, {loaded.model.output.weight.dtype}, "
              f"{len(prompt)} prompt tokens", file=sys.stderr)
        for first in range(0, opts.num_samples, batch_size):
            rows = generators[first:first + batch_size]
            start = time.perf_counter()
            samples = generate_batch(loaded.model, prompt, opts.max_new_tokens, len(rows),
                                     temperature=opts.temperature, top_k=opts.top_k,
                                     top_p=opts.top_p, eos_id=tokenizer.eos_id, generators=rows,
                                     use_cache=not opts.no_cache, logit_scale=loaded.logit_scale,
                                     softcap=loaded.softcap, vocab_limit=tokenizer.vocab_size)
            seconds = time.perf_counter() - start
            for sample, new in enumerate(samples, start=first + 1):
                if opts.num_samples > 1:
                    print(f"--- sample {sample}", flush=True)
                # decoded with the prompt's ids, not after its text: a SentencePiece decoder
                # drops the space of a word that starts a decode ("▁word"), gluing it to the
                # prompt; and the text starts as the model saw the prompt (seen)
                print(tokenizer.decode([*prompt_ids, *new]), flush=True)
                stop = "eos" if len(new) < opts.max_new_tokens else "max tokens"
                print(f"({len(new)} tokens, {stop})", file=sys.stderr)
            tokens = sum(map(len, samples))
            print(f"(batch of {len(rows)}: {tokens} tokens in {seconds:.2f} s, "
                  f"{tokens / max(seconds, 1e-9):.1f} tokens/s)", file=sys.stderr)
    except (FileNotFoundError, ValueError) as e:
        print(f"generate: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
