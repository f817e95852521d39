"""Convert a DSpark drafter between checkpoint layouts (layouts.py).

    python -m vllm_dspark.convert SRC DST --to {native,trainer,speculators}
        [--target TARGET] [--draft-vocab N [--freq-corpus FILE ...]]

Any layout reads; the weights keep their tensor names (vLLM's loader takes
the same names in all three) and their bits. What changes is config.json,
and:

- ``--to trainer`` with ``--target``: embed_tokens and lm_head are dropped
  when they equal the target's (the trainer layout shares them; vLLM shares
  them on load); ``--to native`` with ``--target`` puts missing ones back.
- ``--draft-vocab N`` (to any layout): a reduced draft vocabulary of the N
  target ids most frequent in ``--freq-corpus`` (text files, tokenized with
  the drafter's tokenizer; default: the tiny pair's own training split from
  vllm_dspark.training.corpus), kept in id order. lm_head and the Markov
  head's output rows are cut to those ids, ``d2t[i] = id_i - i`` maps draft
  id i back (target id = draft id + d2t[draft id], as in the speculators
  format) and ``t2d`` marks the kept ids.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from vllm_dspark.layouts import NATIVE, SPECULATORS, TRAINER, describe, locate, read_config

# Keys that describe DSpark rather than the backbone (the speculators format
# keeps the backbone in transformer_layer_config).
DSPARK_KEYS = ("block_size", "target_layer_ids", "mask_token_id", "markov_rank", "markov_head_type",
               "enable_confidence_head", "confidence_head_with_markov", "target_hidden_size", "draft_vocab_size",
               "sample_from_anchor")
_NESTED = ("mask_token_id", "target_layer_ids", "markov_rank", "markov_head_type", "enable_confidence_head",
           "confidence_head_with_markov", "block_size")
_SHARED = ("embed_tokens.weight", "lm_head.weight")
_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")


def to_native_config(cfg: dict, path: str) -> dict:
    """Any layout's config.json as the native one (the description's keys at
    the top level, the backbone's keys as they were)."""
    spec = describe(cfg, path)
    if spec.layout == SPECULATORS:
        out = dict(cfg["transformer_layer_config"])
        out.update({k: cfg[k] for k in DSPARK_KEYS if k in cfg})
    else:
        out = {k: v for k, v in cfg.items() if k != "dflash_config"}
    for key in _NESTED:
        out[key] = getattr(spec, key)
    out["target_layer_ids"] = list(spec.target_layer_ids)
    for key in ("aux_hidden_state_layer_ids", "speculators_model_type", "speculators_config", "sample_from_anchor"):
        out.pop(key, None)  # sample_from_anchor: true, the native default
    if spec.reduced_vocab:
        out["draft_vocab_size"] = spec.draft_vocab_size
    out["architectures"] = ["Qwen3DSparkModel"]
    return out


def from_native_config(native: dict, layout: str, target: str | None = None) -> dict:
    if layout == NATIVE:
        return dict(native)
    if layout == TRAINER:
        out = {k: v for k, v in native.items() if k not in _NESTED}
        out["architectures"] = ["DSparkDraftModel"]
        out["model_type"] = "qwen3"
        out["dflash_config"] = {**{k: native[k] for k in _NESTED if k in native},
                                "attention_mode": "gqa", "projector_type": "dspark"}
        return out
    body = {k: v for k, v in native.items() if k not in DSPARK_KEYS and k != "architectures"}
    dspark = {k: native[k] for k in DSPARK_KEYS if k in native and k != "target_layer_ids"}
    block = int(native["block_size"])
    return {
        "speculators_model_type": "dspark",
        **dspark,
        "aux_hidden_state_layer_ids": [i + 1 for i in native["target_layer_ids"]],
        "sample_from_anchor": True,
        "speculators_config": {
            "algorithm": "dspark",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": block}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target},
        },
        "transformer_layer_config": body,
    }


def token_frequencies(tokenizer_dir: Path, files: list[Path] | None, vocab: int):
    """Token counts over ``files`` (default: the tiny pair's training split)."""
    import torch
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    if files:
        texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    else:
        from vllm_dspark.training.corpus import split_corpus

        texts = [d.text for d in split_corpus()[0]]
    counts = torch.zeros(vocab, dtype=torch.long)
    for enc in tok.encode_batch(texts):
        counts += torch.bincount(torch.tensor(enc.ids, dtype=torch.long), minlength=vocab)[:vocab]
    return counts


def reduce_vocab(weights: dict, counts, n: int) -> dict:
    """Cut the draft's output rows to the n most frequent ids (id order)."""
    import torch

    vocab = counts.numel()
    if not 0 < n < vocab:
        raise SystemExit(f"--draft-vocab must be in 1..{vocab - 1} (the drafter's vocabulary is {vocab}); got {n}")
    if "d2t" in weights:
        raise SystemExit("the source already has a reduced draft vocabulary (d2t); convert from a full one")
    order = sorted(range(vocab), key=lambda i: (-int(counts[i]), i))
    kept = torch.tensor(sorted(order[:n]), dtype=torch.long)
    out = dict(weights)
    for name in ("lm_head.weight", "markov_head.markov_w2.weight"):
        out[name] = weights[name][kept].contiguous()
    out["d2t"] = kept - torch.arange(n)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    out["t2d"] = t2d
    return out


def _target_weights(target: Path) -> dict:
    """The target's input embedding and LM head (tied: the embedding)."""
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(target.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    embed = tensors["model.embed_tokens.weight"]
    return {"embed_tokens.weight": embed, "lm_head.weight": tensors.get("lm_head.weight", embed)}


def convert(src: str, dst: str, layout: str, target: str | None = None, draft_vocab: int | None = None,
            freq_corpus: list[Path] | None = None) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    folder = locate(src)
    cfg = read_config(folder, src)
    native = to_native_config(cfg, src)
    weights = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    shared = _target_weights(Path(target)) if target else {}
    if draft_vocab is not None:
        if "lm_head.weight" not in weights:
            if not shared:
                raise SystemExit("the source shares the target's lm_head: give --target to cut it to the draft vocabulary")
            weights["lm_head.weight"] = shared["lm_head.weight"].to(weights["fc.weight"].dtype)
        weights = reduce_vocab(weights, token_frequencies(folder, freq_corpus, int(native["vocab_size"])), draft_vocab)
        native["draft_vocab_size"] = draft_vocab
    reduced = "d2t" in weights
    if shared and layout == TRAINER:
        for name in _SHARED:
            if name in weights and torch.equal(weights[name], shared[name].to(weights[name].dtype)):
                del weights[name]
    elif shared and layout == NATIVE:
        for name in _SHARED:
            if name not in weights and not (reduced and name == "lm_head.weight"):
                weights[name] = shared[name].to(weights["fc.weight"].dtype).clone()
    out = Path(dst)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(from_native_config(native, layout, target), indent=2) + "\n")
    for name in _FILES:
        if (folder / name).is_file():
            shutil.copyfile(folder / name, out / name)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m vllm_dspark.convert", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="drafter folder or hub id, any layout")
    ap.add_argument("dst", help="output folder")
    ap.add_argument("--to", required=True, choices=[NATIVE, TRAINER, SPECULATORS])
    ap.add_argument("--target", help="the target model folder (shared embeddings, the verifier's name)")
    ap.add_argument("--draft-vocab", type=int, help="reduce the draft vocabulary to this many ids")
    ap.add_argument("--freq-corpus", type=Path, nargs="+", help="text files to count token frequencies in")
    args = ap.parse_args(argv)
    out = convert(args.src, args.dst, args.to, args.target, args.draft_vocab, args.freq_corpus)
    spec = describe(read_config(out, str(out)), str(out))
    print(f"wrote {out} ({spec.layout} layout, block {spec.block_size}, draft vocabulary "
          f"{spec.draft_vocab_size} of {spec.vocab_size})")


if __name__ == "__main__":
    main()
