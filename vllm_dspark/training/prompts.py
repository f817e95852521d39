"""Held-out prompts (code and prose) for acceptance reports, tests and benchmarks.

    python -m vllm_dspark.training.prompts --tokenizer examples/models/tiny-qwen3

writes ``examples/prompts/heldout.jsonl``: one JSON object per line with
``kind`` ("code" or "prose") and ``text``. They come from the documents the
training script held out, so no model saw them.
"""

import argparse
import json
from pathlib import Path

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "examples" / "prompts" / "heldout.jsonl"


def build_heldout_prompts(tokenizer, per_kind: int = 128, prompt_tokens: int = 48) -> list[dict]:
    """Evenly spaced windows of the held-out text, alternating code and prose."""
    from vllm_dspark.training.corpus import split_corpus

    _, heldout = split_corpus()
    by_kind: dict[str, list[dict]] = {}
    for kind in ("code", "prose"):
        ids: list[int] = []
        for doc in (d for d in heldout if d.kind == kind):
            ids.extend(tokenizer(doc.text, add_special_tokens=False)["input_ids"])
        stride = (len(ids) - prompt_tokens) // per_kind
        by_kind[kind] = [
            {"kind": kind, "text": tokenizer.decode(ids[i * stride : i * stride + prompt_tokens])}
            for i in range(per_kind)
        ]
    return [p for pair in zip(by_kind["code"], by_kind["prose"]) for p in pair]


def load_prompts(path: Path = DEFAULT_PROMPTS, limit: int | None = None) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(
            f"No prompt file at {path}. Create it with "
            "`python -m vllm_dspark.training.prompts`."
        )
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[:limit] if limit is not None else rows


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default="examples/models/tiny-qwen3")
    ap.add_argument("--out", type=Path, default=DEFAULT_PROMPTS)
    ap.add_argument("--per-kind", type=int, default=128)
    args = ap.parse_args(argv)
    prompts = build_heldout_prompts(AutoTokenizer.from_pretrained(args.tokenizer), args.per_kind)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    print(f"wrote {len(prompts)} prompts to {args.out}")


if __name__ == "__main__":
    main()
