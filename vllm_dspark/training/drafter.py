"""A plain-torch DSpark drafter with the DeepSpec / vLLM checkpoint layout.

Used to train the bundled tiny drafter, to measure offline acceptance, and as
a vLLM-free reference (it runs anywhere torch runs, e.g. on a GPU box without
vLLM). State-dict names match what vLLM's ``Qwen3DSparkForCausalLM`` loads:
``embed_tokens``, ``layers.*``, ``norm``, ``fc``, ``hidden_norm``, ``lm_head``,
``markov_head.markov_w1/markov_w2`` and ``confidence_head.proj``.

Layout (DSpark paper §3; shared/docs/dspark-paper-and-reference.md §3):
  * context features = outputs of target layers ``target_layer_ids``,
    concatenated, fused by ``fc`` then ``hidden_norm``;
  * every draft layer is a pre-norm Qwen3 block whose attention takes K/V from
    ``[context ; block]`` through the *same* k/v projections (KV injection),
    non-causal inside the block;
  * a block is ``[anchor, MASK x (block_size-1)]`` at positions
    ``anchor .. anchor+block_size-1``; position k predicts token anchor+k+1;
  * Markov head: ``logits_k = lm_head(h_k) + W2(W1[x_{k-1}])``, x_0 = anchor;
  * confidence head: ``sigmoid(proj([h_k ; W1[x_{k-1}]]))``.
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn


def build_drafter_config(
    target_config,
    *,
    num_layers: int,
    block_size: int,
    target_layer_ids: list[int],
    mask_token_id: int,
    markov_rank: int,
):
    """A draft config: a deep copy of the target's with the DSpark keys set."""
    cfg = copy.deepcopy(target_config)
    cfg.architectures = ["Qwen3DSparkModel"]
    cfg.num_hidden_layers = num_layers
    cfg.layer_types = ["full_attention"] * num_layers
    cfg.num_target_layers = target_config.num_hidden_layers
    cfg.target_hidden_size = target_config.hidden_size
    cfg.target_layer_ids = list(target_layer_ids)
    cfg.block_size = block_size
    cfg.mask_token_id = mask_token_id
    cfg.markov_rank = markov_rank
    cfg.markov_head_type = "vanilla"
    cfg.enable_confidence_head = True
    cfg.confidence_head_with_markov = True
    cfg.tie_word_embeddings = False
    return cfg


class _MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)


class _ConfidenceHead(nn.Module):
    def __init__(self, in_dim: int):
        super().__init__()
        self.proj = nn.Linear(in_dim, 1, bias=True)


class _InjectedAttention(nn.Module):
    """Qwen3 attention whose keys/values also cover the fused context."""

    def __init__(self, cfg):
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)

    def forward(self, x, ctx, q_rope, kv_rope, mask):
        # x [B,Q,H] (normed block states), ctx [B,S,H] (fused context)
        # q_rope/kv_rope: (cos, sin) for [B,Q] / [B,S+Q]; mask [B,1,Q,S+Q] bool
        from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

        b, q_len, _ = x.shape
        kv_in = torch.cat([ctx, x], dim=1)
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(kv_in).view(b, -1, self.num_kv_heads, self.head_dim))
        v = self.v_proj(kv_in).view(b, -1, self.num_kv_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, _ = apply_rotary_pos_emb(q, q, *q_rope)
        k, _ = apply_rotary_pos_emb(k, k, *kv_rope)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.num_kv_heads != self.num_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class _DraftLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

        self.self_attn = _InjectedAttention(cfg)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x, ctx, q_rope, kv_rope, mask):
        x = x + self.self_attn(self.input_layernorm(x), ctx, q_rope, kv_rope, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DSparkDrafter(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import (
            Qwen3RMSNorm,
            Qwen3RotaryEmbedding,
        )

        self.config = cfg
        h, v, r = cfg.hidden_size, cfg.vocab_size, cfg.markov_rank
        n_feat = len(cfg.target_layer_ids) * cfg.target_hidden_size
        self.embed_tokens = nn.Embedding(v, h)
        self.layers = nn.ModuleList(_DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = Qwen3RMSNorm(h, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(n_feat, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, v, bias=False)
        self.markov_head = _MarkovHead(v, r)
        self.confidence_head = _ConfidenceHead(h + r)
        self.rotary_emb = Qwen3RotaryEmbedding(cfg)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def copy_frozen_from_target(self, target) -> None:
        """Embedding and LM head are frozen copies of the target's."""
        self.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight.data)
        self.lm_head.weight.data.copy_(target.get_output_embeddings().weight.data)
        for p in (self.embed_tokens.weight, self.lm_head.weight):
            p.requires_grad_(False)

    def init_layers_from_target(self, target) -> None:
        """Start each draft layer from one of the target's top layers (same
        shapes and parameter names): a warm start for the backbone."""
        top = target.model.layers[-len(self.layers):]
        for mine, theirs in zip(self.layers, top):
            missing, unexpected = mine.load_state_dict(theirs.state_dict(), strict=False)
            assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)

    def backbone(self, ctx_feats, ctx_pos, block_ids, block_pos, mask):
        """Parallel pass. ctx_feats [B,S,n*Ht], ctx_pos [B,S], block_ids/pos [B,Q],
        mask [B,Q,S+Q] bool (True = may attend). Returns normed states [B,Q,H]."""
        x = self.embed_tokens(block_ids)
        ctx = self.hidden_norm(self.fc(ctx_feats.to(x.dtype)))
        q_rope = self.rotary_emb(x, block_pos)
        kv_rope = self.rotary_emb(x, torch.cat([ctx_pos, block_pos], dim=1))
        attn_mask = mask.unsqueeze(1)
        for layer in self.layers:
            x = layer(x, ctx, q_rope, kv_rope, attn_mask)
        return self.norm(x)

    def heads(self, hidden, prev_ids):
        """Markov-corrected logits [...,V] and confidence logits [...] for
        hidden [...,H] given the previous token of each position [...]."""
        e = self.markov_head.markov_w1(prev_ids)
        logits = self.lm_head(hidden) + self.markov_head.markov_w2(e)
        conf = self.confidence_head.proj(torch.cat([hidden, e], dim=-1)).squeeze(-1)
        return logits, conf

    @torch.no_grad()
    def propose(self, ctx_feats, anchor_id: int, anchor_pos: int, temperature: float,
                generator: torch.Generator | None = None):
        """Draft one block for a single sequence (batch 1).

        ctx_feats [S, n*Ht] are the target features of positions 0..S-1 with
        S == anchor_pos. Returns (tokens [K], draft_probs [K,V] or None at
        temperature 0, confidences [K]).
        """
        k = self.block_size
        dev = ctx_feats.device
        block_ids = torch.full((1, k), self.config.mask_token_id, device=dev)
        block_ids[0, 0] = anchor_id
        block_pos = torch.arange(anchor_pos, anchor_pos + k, device=dev)[None]
        ctx_pos = torch.arange(ctx_feats.shape[0], device=dev)[None]
        mask = torch.ones(1, k, ctx_feats.shape[0] + k, dtype=torch.bool, device=dev)
        hidden = self.backbone(ctx_feats[None], ctx_pos, block_ids, block_pos, mask)[0]
        base = self.lm_head(hidden)
        prev = torch.tensor(anchor_id, device=dev)
        tokens, probs, prevs = [], [], []
        for i in range(k):
            prevs.append(prev)
            z = base[i] + self.markov_head.markov_w2(self.markov_head.markov_w1(prev))
            if temperature <= 0:
                prev = z.argmax()
            else:
                p = torch.softmax(z.float() / temperature, dim=-1)
                prev = torch.multinomial(p, 1, generator=generator)[0]
                probs.append(p)
            tokens.append(prev)
        prev_ids = torch.stack(prevs)
        _, conf = self.heads(hidden, prev_ids)
        draft_probs = torch.stack(probs) if probs else None
        return torch.stack(tokens), draft_probs, torch.sigmoid(conf.float())
