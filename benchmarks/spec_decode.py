"""Speculative decoding: time per output token with and without it, on a copy-heavy workload.

The workload is built deterministically from real text that ships with Python (the docstrings of
a few standard-library modules): prompts that ask the model to quote, edit or extract from a
passage, so good outputs repeat long runs of their prompt -- the case n-gram lookup speeds up.
Each setting runs the same requests at batch 1 (one request at a time) and batch 8 (eight at
once), greedy, and reports the mean time per output token (first to last token of a request,
over its tokens after the first), the speed-up over no speculation, and the acceptance counters.
Greedy outputs must be identical with and without speculation; the script checks that too.

  python benchmarks/spec_decode.py --smoke                       # CPU, a tiny random model, seconds
  python benchmarks/spec_decode.py --model DIR                   # n-gram vs none
  python benchmarks/spec_decode.py --model DIR --draft-model DIR2  # and a draft model
  python benchmarks/spec_decode.py --model DIR --draft-layers 8    # draft: DIR's first 8 layers
  python benchmarks/spec_decode.py --model benchmarks/configs/qwen3-0.6b --load-format dummy --tokenizer SMOLLM2_DIR

--draft-layers N drafts with the target's own first N layers (and its final norm and LM head), a
real draft model of the same vocabulary made from the one real checkpoint at hand (early exit, as
in LayerSkip's self-speculation). --batch-sizes 1,8,16,32,64 --disable-by-batch-size 1000 keeps
speculation on at every batch size, to find where it stops paying (disable_by_batch_size).

With random (dummy) weights the outputs are not copies of anything, so n-gram acceptance there
only measures the cost of speculating; real acceptance needs real weights (SmolLM2:
`python bin/minivllm download`, then --model the directory it prints).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import tempfile

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def passages(num: int, words_per_passage: int = 120) -> list[str]:
    """Paragraph-sized passages from standard-library docstrings, in a fixed order."""
    import argparse as m1, collections as m2, difflib as m3, heapq as m4, json as m5, textwrap as m6  # noqa: E401
    import pickle as m7, string as m8, subprocess as m9, threading as m10, unittest as m11, zipfile as m12  # noqa: E401
    text = "\n".join(inspect.getdoc(m) or "" for m in (m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12))
    words = text.split()
    out = []
    for i in range(num):
        start = (i * 97) % max(1, len(words) - words_per_passage)
        out.append(" ".join(words[start:start + words_per_passage]))
    return out


TASKS = [
    "Repeat the following text exactly, word for word.\n\nText:\n{p}\n\nRepeated text:\n",
    "Rewrite the following text, changing nothing except that every occurrence of \"the\" becomes \"THE\".\n\n"
    "Text:\n{p}\n\nRewritten text:\n",
    "Copy the sentences of the following text that contain a comma, in their order.\n\nText:\n{p}\n\nSentences:\n",
    "Summarize the following text by quoting its most important sentences verbatim.\n\nText:\n{p}\n\nQuotes:\n",
]


def build_prompts(num: int) -> list[str]:
    return [TASKS[i % len(TASKS)].format(p=p) for i, p in enumerate(passages(num))]


def truncated_model(model_dir: str, num_layers: int, out_dir: str) -> str:
    """A copy of `model_dir` keeping only its first `num_layers` decoder layers."""
    import shutil

    from safetensors.torch import load_file, save_file

    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(model_dir):
        if not name.endswith(".safetensors") and os.path.isfile(os.path.join(model_dir, name)) \
                and name != "model.safetensors.index.json":
            shutil.copy(os.path.join(model_dir, name), out_dir)
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    if not 0 < num_layers < config["num_hidden_layers"]:
        raise SystemExit(f"--draft-layers must be in [1, {config['num_hidden_layers'] - 1}]")
    config["num_hidden_layers"] = num_layers
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    weights = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            weights.update(load_file(os.path.join(model_dir, name)))
    keep = {}
    for key, tensor in weights.items():
        parts = key.split(".")
        layer = int(parts[parts.index("layers") + 1]) if "layers" in parts else -1
        if layer < num_layers:
            keep[key] = tensor
    save_file(keep, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def run_setting(llm, prompts: list, params, batch: int) -> tuple[list[list[int]], float]:
    """Run prompts `batch` at a time; returns the token ids and the mean time per output token."""
    tokens, tpots = [], []
    for i in range(0, len(prompts), batch):
        for out in llm.generate(prompts[i:i + batch], params, use_tqdm=False):
            ids = out.outputs[0].token_ids
            tokens.append(ids)
            m = out.metrics
            if len(ids) > 1 and m is not None and m.first_token_time and m.last_token_time:
                tpots.append((m.last_token_time - m.first_token_time) / (len(ids) - 1))
    return tokens, float(np.mean(tpots)) if tpots else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="target model directory")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--tokenizer", help="tokenizer directory, when the model directory has none "
                        "(benchmarks/configs/*: e.g. SmolLM2's; its ids fit any larger vocabulary)")
    parser.add_argument("--draft-model", help="a draft model directory (same vocabulary) to compare too")
    parser.add_argument("--dtype", default="auto", help="e.g. float32: greedy identity without bf16 ties")
    parser.add_argument("--only", help="comma-separated settings to run (none, ngram, draft_N_layers, draft_model)")
    parser.add_argument("--draft-layers", help="draft with the target's first N layers (comma-separated: several drafts)")
    parser.add_argument("--disable-by-batch-size", type=int, help="speculate only up to this many running requests")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=5)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--smoke", action="store_true", help="a tiny random model on the CPU, a few prompts")
    parser.add_argument("--json", help="write the results here as JSON")
    args = parser.parse_args()

    sys.path.insert(0, REPO_ROOT)
    from minivllm import LLM, SamplingParams

    skip_tokenizer = False
    if args.smoke:
        from tests.tiny_models import build_tiny_model

        tmp = tempfile.mkdtemp(prefix="spec-bench-")
        args.model = build_tiny_model(os.path.join(tmp, "target"), arch="llama", seed=0)
        if args.draft_model == "tiny":
            args.draft_model = build_tiny_model(os.path.join(tmp, "draft"), arch="llama", seed=3, num_hidden_layers=1)
        args.num_prompts, args.max_tokens, args.max_model_len = 4, 24, 512
        prompts: list = [{"prompt_token_ids": ([5 + i, 9, 13, 21, 34] * 12)[: 40 + 3 * i]} for i in range(4)]
        skip_tokenizer = True
    else:
        if not args.model:
            parser.error("--model is required (or --smoke)")
        prompts = build_prompts(args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    k = args.num_speculative_tokens
    settings = {"none": None,
                "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": args.prompt_lookup_min,
                          "prompt_lookup_max": args.prompt_lookup_max}}
    for layers in map(int, args.draft_layers.split(",") if args.draft_layers else []):
        draft_dir = truncated_model(args.model, layers, tempfile.mkdtemp(prefix="draft-layers-"))
        settings[f"draft_{layers}_layers"] = {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": k}
    if args.draft_model:
        settings["draft_model"] = {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": k}

    if args.only:
        settings = {name: spec for name, spec in settings.items() if name in args.only.split(",")}
    for spec in settings.values():
        if spec is not None and args.disable_by_batch_size:
            spec["disable_by_batch_size"] = args.disable_by_batch_size
    results = {}
    reference: dict[int, list[list[int]]] = {}
    for name, spec in settings.items():
        llm = LLM(args.model, tokenizer=args.tokenizer, load_format=args.load_format, max_model_len=args.max_model_len, dtype=args.dtype,
                  skip_tokenizer_init=skip_tokenizer, speculative_config=spec)
        try:
            run_setting(llm, prompts[:2], params, 2)  # warm-up (compilation, graphs, caches)
            for batch in batch_sizes:
                before = llm.get_stats()
                tokens, tpot = run_setting(llm, prompts, params, batch)
                after = llm.get_stats()
                drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
                draft_tokens = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
                accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
                if name == "none":
                    reference[batch] = tokens
                same = tokens == reference.get(batch)
                row = results.setdefault(name, {})[batch] = {
                    "tpot_ms": 1000 * tpot,
                    "output_tokens": sum(map(len, tokens)),
                    "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
                    "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
                    "draft_tokens": draft_tokens,
                    "identical_to_no_speculation": same,
                }
                base = results.get("none", {}).get(batch)
                speedup = base["tpot_ms"] / row["tpot_ms"] if base and name != "none" else None
                row["speedup"] = speedup
                print(f"{name:16s} batch {batch:3d}: {row['tpot_ms']:7.2f} ms/token"
                      + (f", {speedup:.2f}x" if speedup else "")
                      + (f", acceptance {row['acceptance_rate']:.1%}, mean acceptance length "
                         f"{row['mean_acceptance_length']:.2f}" if drafts else "")
                      + ("" if same else "  OUTPUTS DIFFER FROM NO SPECULATION"), flush=True)
        finally:
            llm.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
