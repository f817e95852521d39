"""Train the bundled tiny pair: a BPE tokenizer, a Qwen3 target and its DSpark drafter.

    python -m vllm_dspark.training.train --out examples/models

Everything comes from text every Python install has (stdlib sources for code,
pydoc topics for prose), so this runs offline. Training is step-budgeted, not
time-budgeted, so a seed reproduces the same run (on the same Python, torch and
thread count). The default settings finish in under 30 minutes on 2 CPU cores.
A larger "benchmark-size" pair is the same command with bigger --hidden/--layers
and other --target-name/--drafter-name.
"""

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_dspark.training.corpus import split_corpus
from vllm_dspark.training.tokenizer import EOS_TOKEN, MASK_TOKEN, save_tokenizer, train_tokenizer


@dataclass
class TrainSettings:
    seed: int = 0
    threads: int = 2
    vocab_size: int = 2048
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 704
    seq_len: int = 256
    target_steps: int = 1800
    target_batch: int = 16
    target_lr: float = 3e-3
    draft_layers: int = 2
    block_size: int = 7
    target_layer_ids: tuple[int, ...] = (0, 1, 2)
    markov_rank: int = 32
    draft_steps: int = 3600
    draft_batch: int = 8
    anchors: int = 32
    draft_lr: float = 3e-3
    # Fraction of drafter batches drawn from the target's own sampled
    # continuations: the drafter then sees the text it will be asked to draft.
    self_distill_frac: float = 0.5
    self_distill_seqs: int = 1024
    # 1: start the draft layers from the target's top layers.
    init_from_target: int = 1
    target_name: str = "tiny-qwen3"
    drafter_name: str = "tiny-qwen3-dspark"


def _log(msg: str) -> None:
    print(f"[train {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class _Progress:
    def __init__(self, name: str, total: int, every: int):
        self.name, self.total, self.every, self.t0 = name, total, every, time.time()

    def step(self, i: int, **metrics: float) -> None:
        if (i + 1) % self.every and i + 1 != self.total:
            return
        el = time.time() - self.t0
        eta = el / (i + 1) * (self.total - i - 1)
        vals = " ".join(f"{k}={v:.3f}" for k, v in metrics.items())
        _log(f"{self.name} {i + 1}/{self.total} {vals} ({el:.0f}s, eta {eta:.0f}s)")


def _lr_at(step: int, total: int, peak: float) -> float:
    warm = max(1, total // 20)
    if step < warm:
        return peak * (step + 1) / warm
    frac = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _windows(stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator):
    starts = torch.randint(0, stream.numel() - seq_len, (batch,), generator=gen)
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])


def _encode(tokenizer, docs) -> torch.Tensor:
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    ids: list[int] = []
    for enc in tokenizer([d.text for d in docs], add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def heldout_windows(stream: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    """Evenly spaced, non-overlapping held-out windows (deterministic)."""
    stride = max(seq_len, (stream.numel() - seq_len) // count)
    starts = range(0, stream.numel() - seq_len, stride)
    return torch.stack([stream[s : s + seq_len] for s in list(starts)[:count]])


@torch.no_grad()
def lm_loss(model, windows: torch.Tensor, batch: int = 16) -> float:
    total, n = 0.0, 0
    for i in range(0, len(windows), batch):
        x = windows[i : i + batch]
        logits = model(x).logits[:, :-1].float()
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").item()
        n += x[:, 1:].numel()
    return total / n


def unigram_loss(train: torch.Tensor, heldout: torch.Tensor, vocab: int) -> float:
    counts = torch.bincount(train, minlength=vocab).double() + 1.0
    logp = (counts / counts.sum()).log()
    return -logp[heldout].mean().item()


def build_target_config(s: TrainSettings, tokenizer):
    from transformers import Qwen3Config

    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    return Qwen3Config(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
        dtype="bfloat16",
        architectures=["Qwen3ForCausalLM"],
    )


def train_target(s: TrainSettings, cfg, stream: torch.Tensor, gen: torch.Generator):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(s.seed)
    model = Qwen3ForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=s.target_lr, betas=(0.9, 0.95), weight_decay=0.1)
    prog = _Progress("target", s.target_steps, every=25)
    model.train()
    for step in range(s.target_steps):
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, s.target_steps, s.target_lr)
        x = _windows(stream, s.target_batch, s.seq_len, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x).logits[:, :-1]
        loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        prog.step(step, loss=loss.item())
    return model.eval()


@torch.no_grad()
def sample_continuations(target, stream, s: TrainSettings, gen: torch.Generator) -> torch.Tensor:
    """Target-sampled (T=1) continuations of corpus prefixes, [n, seq_len]."""
    prompt_len = s.seq_len // 4
    out = []
    for i in range(0, s.self_distill_seqs, 64):
        x = _windows(stream, min(64, s.self_distill_seqs - i), prompt_len, gen)
        step = target(x, use_cache=True)
        for _ in range(s.seq_len - prompt_len):
            probs = torch.softmax(step.logits[:, -1].float(), dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen)
            x = torch.cat([x, nxt], dim=1)
            step = target(nxt, past_key_values=step.past_key_values, use_cache=True)
        out.append(x)
        _log(f"self-distill data {i + len(x)}/{s.self_distill_seqs}")
    return torch.cat(out)


def target_features(target, x: torch.Tensor, layer_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """(concatenated outputs of target layers ``layer_ids`` [B,S,n*H], logits [B,S,V]).

    HF's hidden_states[i] is the input of layer i, i.e. the output of layer i-1."""
    out = target(x, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    return feats, out.logits


POSITION_DECAY = 4.0  # DeepSpec's loss_decay_gamma: weight exp(-k/4) at block position k
CE_W, L1_W, CONF_W = 0.1, 0.9, 1.0  # the paper's loss mix


def block_attention_mask(anchors: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """[B, N*k, S + N*k] bool for N packed blocks per sequence (anchors [B,N]):
    a block sees the context strictly before its anchor (the anchor's own
    target state does not exist yet when drafting) and the whole of itself."""
    b, n = anchors.shape
    q = n * block_size
    see_ctx = torch.arange(seq_len)[None, None, :] < anchors.repeat_interleave(block_size, dim=1)[..., None]
    blk = torch.arange(q) // block_size
    see_blk = (blk[:, None] == blk[None, :]).expand(b, q, q)
    return torch.cat([see_ctx, see_blk], dim=-1)


def dspark_loss(drafter, target, x: torch.Tensor, n_anchors: int, gen: torch.Generator):
    """The DSpark training loss on a batch of windows x [B,S] (teacher forced)."""
    cfg = drafter.config
    b, s = x.shape
    k = cfg.block_size
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        feats, t_logits = target_features(target, x, cfg.target_layer_ids)
    anchors = torch.stack([torch.randperm(s - 1, generator=gen)[:n_anchors].sort().values for _ in range(b)])
    offs = torch.arange(k)
    pos = anchors[..., None] + offs  # [B,N,k] position of each block slot
    valid = pos + 1 < s  # a slot is supervised while its label is inside the window
    labels = torch.gather(x, 1, (pos + 1).clamp(max=s - 1).view(b, -1)).view(pos.shape)
    anchor_ids = torch.gather(x, 1, anchors)
    prev = torch.cat([anchor_ids[..., None], labels[..., :-1]], dim=-1)
    block_ids = torch.full_like(pos, cfg.mask_token_id)
    block_ids[..., 0] = anchor_ids
    q = n_anchors * k
    mask = block_attention_mask(anchors, s, k)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = drafter.backbone(feats, torch.arange(s).expand(b, s), block_ids.view(b, q), pos.view(b, q), mask)
        logits, conf = drafter.heads(hidden, prev.view(b, q))
    tl = torch.gather(t_logits, 1, pos.clamp(max=s - 1).view(b, q, 1).expand(b, q, t_logits.shape[-1]))
    logp_d = torch.log_softmax(logits.float(), dim=-1)
    p_t = torch.softmax(tl.float(), dim=-1)
    l1 = (logp_d.exp() - p_t).abs().sum(-1)
    ce = F.nll_loss(logp_d.view(-1, logp_d.shape[-1]), labels.view(-1), reduction="none").view(b, q)
    accept = (1 - 0.5 * l1).clamp(0, 1).detach()
    bce = F.binary_cross_entropy_with_logits(conf.float(), accept, reduction="none")
    w = (torch.exp(-offs / POSITION_DECAY).expand(b, n_anchors, k) * valid).reshape(b, q)
    loss = (w * (CE_W * ce + L1_W * l1 + CONF_W * bce)).sum() / w.sum()
    acc_k = (accept.view(b, n_anchors, k) * valid).sum((0, 1)) / valid.sum((0, 1))
    tau = 1 + torch.cumprod(acc_k, 0).sum()
    return loss, {"loss": loss.item(), "acc0": acc_k[0].item(), "tau_est": tau.item()}


def train_drafter(s: TrainSettings, target, tokenizer, stream, distill, gen):
    from vllm_dspark.training.drafter import DSparkDrafter, build_drafter_config

    cfg = build_drafter_config(
        target.config,
        num_layers=s.draft_layers,
        block_size=s.block_size,
        target_layer_ids=list(s.target_layer_ids),
        mask_token_id=tokenizer.convert_tokens_to_ids(MASK_TOKEN),
        markov_rank=s.markov_rank,
    )
    torch.manual_seed(s.seed + 1)
    drafter = DSparkDrafter(cfg)
    drafter.copy_frozen_from_target(target)
    if s.init_from_target:
        drafter.init_layers_from_target(target)
    for p in target.parameters():
        p.requires_grad_(False)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.draft_lr, betas=(0.9, 0.95), weight_decay=0.0)
    prog = _Progress("drafter", s.draft_steps, every=25)
    drafter.train()
    for step in range(s.draft_steps):
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, s.draft_steps, s.draft_lr)
        use_distill = distill is not None and torch.rand((), generator=gen).item() < s.self_distill_frac
        if use_distill:
            x = distill[torch.randint(0, len(distill), (s.draft_batch,), generator=gen)]
        else:
            x = _windows(stream, s.draft_batch, s.seq_len, gen)
        loss, metrics = dspark_loss(drafter, target, x, s.anchors, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        prog.step(step, **metrics)
    return drafter.eval()


def save_drafter(drafter, out_dir: Path) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in drafter.state_dict().items() if not k.startswith("rotary_emb")}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    drafter.config.save_pretrained(str(out_dir))


def main(argv: list[str] | None = None) -> dict:
    defaults = TrainSettings()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("examples/models"))
    for name, value in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, tuple):
            ap.add_argument(flag, type=int, nargs="+", default=list(value))
        else:
            ap.add_argument(flag, type=type(value), default=value)
    args = ap.parse_args(argv)
    s = TrainSettings(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in vars(args).items() if k != "out"})

    t0 = time.time()
    torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    gen = torch.Generator().manual_seed(s.seed)
    train_docs, heldout_docs = split_corpus()
    _log(f"corpus: {len(train_docs)} train / {len(heldout_docs)} held-out documents")
    tokenizer = train_tokenizer((d.text for d in train_docs), s.vocab_size)
    train_stream, heldout_stream = _encode(tokenizer, train_docs), _encode(tokenizer, heldout_docs)
    _log(f"tokenizer: vocab {len(tokenizer)}; {train_stream.numel()} train / {heldout_stream.numel()} held-out tokens")

    cfg = build_target_config(s, tokenizer)
    target = train_target(s, cfg, train_stream, gen)
    eval_windows = heldout_windows(heldout_stream, s.seq_len, 64)
    report = {
        "settings": asdict(s),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "machine": platform.machine(),
        "train_tokens": train_stream.numel(),
        "heldout_tokens": heldout_stream.numel(),
        "target_heldout_loss": lm_loss(target, eval_windows),
        "unigram_heldout_loss": unigram_loss(train_stream, heldout_stream, s.vocab_size),
    }
    _log(f"target held-out loss {report['target_heldout_loss']:.3f} (unigram {report['unigram_heldout_loss']:.3f})")
    target_dir = args.out / s.target_name
    target.to(torch.bfloat16).save_pretrained(str(target_dir))
    target.float()
    save_tokenizer(tokenizer, target_dir)

    distill = sample_continuations(target, train_stream, s, gen) if s.self_distill_frac > 0 else None
    drafter = train_drafter(s, target, tokenizer, train_stream, distill, gen)
    drafter_dir = args.out / s.drafter_name
    save_drafter(drafter, drafter_dir)
    save_tokenizer(tokenizer, drafter_dir)
    report["wall_seconds"] = round(time.time() - t0, 1)
    (drafter_dir / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    _log(f"done in {report['wall_seconds']:.0f}s: {target_dir}, {drafter_dir}")
    return report


if __name__ == "__main__":
    main()
