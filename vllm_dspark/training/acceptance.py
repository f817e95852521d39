"""Offline acceptance of a DSpark drafter (batch 1, plain torch, full blocks).

    python -m vllm_dspark.training.acceptance --out runs/acceptance.json

For each held-out prompt it runs the DSpark loop: draft a block from the last
committed token, verify all of it with standard speculative sampling, commit
the accepted prefix plus one target token. It reports tau (mean tokens
committed per verification round, bonus included; the maximum is
block_size + 1), per-position conditional acceptance, and, at temperature 0,
whether the output is token-identical to plain greedy decoding.
"""

import argparse
import json
import time
from pathlib import Path

import torch

from vllm_dspark.training.train import target_features


def load_pair(target_dir: str, drafter_dir: str):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer, Qwen3ForCausalLM

    from vllm_dspark.training.drafter import DSparkDrafter

    target = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    drafter = DSparkDrafter(AutoConfig.from_pretrained(drafter_dir)).eval()
    missing, unexpected = drafter.load_state_dict(load_file(f"{drafter_dir}/model.safetensors"), strict=False)
    missing = [m for m in missing if not m.startswith("rotary_emb")]
    if missing or unexpected:
        raise ValueError(f"drafter checkpoint mismatch: missing={missing} unexpected={unexpected}")
    drafter.float()
    return target, drafter, AutoTokenizer.from_pretrained(target_dir)


def _pick(logits: torch.Tensor, temperature: float, gen) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    return int(torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=gen))


def verify_block(draft, q, target_logits, temperature: float, gen) -> tuple[int, int]:
    """Standard speculative sampling over one block. draft [K], q [K,V] (None at
    T=0), target_logits [K+1,V]. Returns (accepted count n, next token)."""
    k = len(draft)
    if temperature <= 0:
        match = (target_logits[:k].argmax(-1) == draft).int()
        n = int(match.cumprod(0).sum())
        return n, int(target_logits[n].argmax())
    p = torch.softmax(target_logits.float() / temperature, -1)
    for i in range(k):
        x = int(draft[i])
        if torch.rand((), generator=gen) * q[i, x] < p[i, x]:  # u < p/q
            continue
        residual = (p[i] - q[i]).clamp(min=0)
        mass = residual.sum()
        probs = residual / mass if mass > 1e-12 else p[i]
        return i, int(torch.multinomial(probs, 1, generator=gen))
    return k, int(torch.multinomial(p[k], 1, generator=gen))


@torch.no_grad()
def speculative_generate(target, drafter, prompt: list[int], new_tokens: int, temperature: float, gen):
    layer_ids = drafter.config.target_layer_ids
    ids = torch.tensor(prompt)
    feats, logits = target_features(target, ids[None], layer_ids)
    anchor = _pick(logits[0, -1], temperature, gen)
    out, rounds = [anchor], []
    while len(out) < new_tokens:
        a_pos = len(ids)
        draft, q, conf = drafter.propose(feats[0, :a_pos], anchor, a_pos, temperature, gen)
        cand = torch.cat([ids, torch.tensor([anchor]), draft])
        feats, logits = target_features(target, cand[None], layer_ids)
        n, nxt = verify_block(draft, q, logits[0, a_pos:], temperature, gen)
        rounds.append({"accepted": n, "confidence": conf.tolist()})
        out += draft[:n].tolist() + [nxt]
        ids = cand[: a_pos + 1 + n]
        anchor = nxt
    return out[:new_tokens], rounds


@torch.no_grad()
def greedy_generate(target, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor(prompt)[None]
    step = target(ids, use_cache=True)
    out = []
    for _ in range(new_tokens):
        nxt = step.logits[0, -1].argmax()
        out.append(int(nxt))
        step = target(nxt.view(1, 1), past_key_values=step.past_key_values, use_cache=True)
    return out


def summarize(rounds: list[dict], block: int) -> dict:
    accepted = torch.tensor([r["accepted"] for r in rounds])
    reached = torch.stack([(accepted >= k).sum() for k in range(block)]).float()
    passed = torch.stack([(accepted > k).sum() for k in range(block)]).float()
    return {
        "rounds": len(rounds),
        "tau": float((accepted + 1).float().mean()),
        "conditional_acceptance": (passed / reached.clamp(min=1)).tolist(),
    }


def main(argv: list[str] | None = None) -> dict:
    from vllm_dspark.training.prompts import DEFAULT_PROMPTS, load_prompts

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="examples/models/tiny-qwen3")
    ap.add_argument("--drafter", default="examples/models/tiny-qwen3-dspark")
    ap.add_argument("--prompt-file", type=Path, default=None)
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, drafter, tok = load_pair(args.target, args.drafter)
    prompts = [tok(p["text"], add_special_tokens=False)["input_ids"] for p in load_prompts(args.prompt_file or DEFAULT_PROMPTS, limit=args.prompts)]
    report = {"target": args.target, "drafter": args.drafter, "prompts": len(prompts),
              "new_tokens": args.new_tokens, "block_size": drafter.block_size, "by_temperature": {}}
    for temp in args.temperatures:
        gen = torch.Generator().manual_seed(args.seed)
        t0, rounds, identical = time.time(), [], 0
        for i, prompt in enumerate(prompts):
            out, r = speculative_generate(target, drafter, prompt, args.new_tokens, temp, gen)
            rounds += r
            if temp <= 0:
                identical += out == greedy_generate(target, prompt, args.new_tokens)
            if (i + 1) % 50 == 0:
                print(f"[acceptance] T={temp} {i + 1}/{len(prompts)} ({time.time() - t0:.0f}s)", flush=True)
        res = summarize(rounds, drafter.block_size)
        if temp <= 0:
            res["greedy_identical"] = f"{identical}/{len(prompts)}"
        report["by_temperature"][str(temp)] = res
        print(f"[acceptance] T={temp}: tau={res['tau']:.2f} over {res['rounds']} rounds "
              f"{res.get('greedy_identical', '')}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
