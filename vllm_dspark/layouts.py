"""DSpark checkpoint layouts, read once into one description.

Published DSpark drafters come in three layouts this plugin loads (README,
"Checkpoints"); :func:`describe` reads a drafter's ``config.json`` (a dict,
before vLLM builds anything) into a :class:`DrafterSpec`, and refuses what it
cannot load with a message naming the layout it looks like, the key that
decided it and what to do:

- ``native``: DeepSpec's own (``architectures: ["Qwen3DSparkModel"]``), every
  DSpark key at the top level;
- ``trainer``: SpecForge / TorchSpec (``architectures: ["DSparkDraftModel"]``,
  ``model_type: "qwen3"``), the DSpark keys in ``dflash_config`` (read first,
  as vLLM reads them) or at the top level; embeddings and LM head may be
  absent from the weights (vLLM shares the target's);
- ``speculators``: vLLM's speculators library (``speculators_model_type:
  "dspark"``), the backbone in ``transformer_layer_config``, the target layers
  as ``aux_hidden_state_layer_ids`` (capture indices: native id + 1), and
  optionally a reduced draft vocabulary (``draft_vocab_size`` with ``d2t``).
  vLLM's own config code translates it into the native keys.

:func:`apply` then puts the description's keys on the draft ``hf_config``
vLLM built, so vLLM's Qwen3DSparkModel, vLLM's DFlash machinery and the
proposer all read one set of native keys whatever the layout.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vllm_dspark.config import DSparkConfigError

NATIVE, TRAINER, SPECULATORS = "native", "trainer", "speculators"
ATTR = "dspark_drafter"  # the description, as a dict, on the draft hf_config
_V2 = "vLLM's in-tree V2 runner (VLLM_USE_V2_MODEL_RUNNER=1, on GPU)"
# DeepSeek-V4 keeps its DSpark settings in the target's config under these
# (other dspark_* keys, such as vLLM's dspark_draft_topk, may sit in any drafter's).
_BUNDLED_KEYS = frozenset({"dspark_block_size", "dspark_target_layer_ids", "dspark_markov_rank",
                           "dspark_noise_token_id"})


@dataclass(frozen=True)
class DrafterSpec:
    layout: str
    block_size: int
    target_layer_ids: tuple[int, ...]  # native meaning: the output of target layer i
    mask_token_id: int
    markov_rank: int
    markov_head_type: str
    enable_confidence_head: bool
    confidence_head_with_markov: bool
    vocab_size: int  # input (and Markov-embedding) vocabulary: the target's
    draft_vocab_size: int  # what the LM head predicts; < vocab_size: reduced, with d2t
    hidden_size: int
    target_hidden_size: int
    speculative_tokens: int | None = None  # the checkpoint's own K, where it states one

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size < self.vocab_size

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "target_layer_ids": list(self.target_layer_ids)}

    @classmethod
    def of(cls, hf_config) -> "DrafterSpec":
        """The description :func:`apply` left on a draft hf_config."""
        raw = getattr(hf_config, ATTR, None)
        if raw is None:
            raise DSparkConfigError("the draft config was not read through vllm_dspark.layouts.describe")
        return cls(**{**raw, "target_layer_ids": tuple(raw["target_layer_ids"])})


def _refuse(path: str, looks_like: str, key: str, fix: str) -> DSparkConfigError:
    return DSparkConfigError(
        f"speculative_config.model={path!r} looks like {looks_like} (decided by config key {key}); "
        f"vllm_dspark cannot load it: {fix}"
    )


def _nested(cfg: dict, section: str, key: str):
    inner = cfg.get(section)
    return inner.get(key) if isinstance(inner, dict) else None


def _layout_of(cfg: dict, path: str) -> tuple[str, str]:
    """(layout, the key that decided it), or a refusal."""
    archs = list(cfg.get("architectures") or [])
    smt = cfg.get("speculators_model_type")
    if smt is not None:
        if smt == "dspark":
            return SPECULATORS, "speculators_model_type='dspark'"
        raise _refuse(path, f"a speculators {smt!r} checkpoint, not DSpark", f"speculators_model_type={smt!r}",
                      f"serve it with speculative_config method {smt!r} instead of 'dspark'.")
    if "Qwen3DSparkModel" in archs:
        return NATIVE, "architectures=['Qwen3DSparkModel']"
    if "DSparkDraftModel" in archs and cfg.get("model_type") == "qwen3":
        return TRAINER, "architectures=['DSparkDraftModel'] with model_type='qwen3'"
    bundled = sorted(_BUNDLED_KEYS & set(cfg))
    if bundled:
        raise _refuse(path, "a DeepSeek-V4 target with its DSpark drafter bundled (no separate drafter)",
                      repr(bundled[0]), f"this CPU build cannot run it; use {_V2}, with the target "
                      "itself as the model.")
    if "DSparkDraftModel" in archs:
        raise _refuse(path, "a DeepSeek-V4 DSpark drafter", f"model_type={cfg.get('model_type')!r}",
                      f"only Qwen3 drafters run here (model_type 'qwen3'); use {_V2}.")
    others = {"DFlashDraftModel": ("a DFlash drafter (no Markov head)", "use speculative_config method 'dflash'."),
              "K3DSparkModel": ("a Kimi-K3 (MLA) DSpark drafter", f"only Qwen3 drafters run here; use {_V2}."),
              "Gemma4DSparkModel": ("a Gemma-4 DSpark drafter", f"only Qwen3 drafters run here; use {_V2}."),
              "Qwen3OmniDSparkModel": ("a Qwen3-Omni DSpark drafter", f"only Qwen3 text drafters run here; use {_V2}.")}
    for arch, (what, fix) in others.items():
        if arch in archs:
            raise _refuse(path, what, f"architectures={archs}", fix)
    if cfg.get("model_type") == "k3_dspark":
        raise _refuse(path, "a Kimi-K3 (MLA) DSpark drafter", "model_type='k3_dspark'",
                      f"only Qwen3 drafters run here; use {_V2}.")
    raise DSparkConfigError(
        f"speculative_config.model={path!r} is not a DSpark checkpoint: its config.json has "
        f"architectures={archs} and no speculators_model_type. Expected one of the layouts in the README "
        "(architectures ['Qwen3DSparkModel'] or ['DSparkDraftModel'], or speculators_model_type 'dspark'); "
        "point `model` at a DSpark drafter (e.g. examples/models/tiny-qwen3-dspark)."
    )


def describe(cfg: dict, path: str) -> DrafterSpec:
    """The drafter's description from its raw config.json; every refusal and
    every missing or inconsistent key raises DSparkConfigError naming it."""
    layout, decided_by = _layout_of(cfg, path)
    where = {NATIVE: "at the top level", TRAINER: "in dflash_config or at the top level",
             SPECULATORS: "at the top level"}[layout]
    body = cfg.get("transformer_layer_config") if layout == SPECULATORS else cfg
    if not isinstance(body, dict):
        raise DSparkConfigError(f"DSpark checkpoint {path!r} ({layout} layout) has no transformer_layer_config "
                                "object: the speculators format keeps the drafter's backbone there.")

    def key(name: str, default=None, required: bool = False):
        value = None
        if layout == TRAINER:
            nested, top = _nested(cfg, "dflash_config", name), cfg.get(name)
            if nested is not None and top is not None and nested != top:
                raise DSparkConfigError(
                    f"DSpark checkpoint {path!r} ({layout} layout) gives {name}={nested!r} in dflash_config "
                    f"but {name}={top!r} at the top level; make them agree (vLLM reads dflash_config's)."
                )
            value = nested if nested is not None else top
        else:
            value = cfg.get(name)
        if value is None and required:
            raise DSparkConfigError(
                f"DSpark checkpoint {path!r} ({layout} layout, by {decided_by}) lacks {name!r} {where}; "
                f"its config.json needs block_size, {_layer_key(layout)}, mask_token_id and markov_rank."
            )
        return default if value is None else value

    anchor = key("sample_from_anchor", default=layout != SPECULATORS)  # the speculators format defaults to false
    if anchor is not True:
        raise DSparkConfigError(
            f"DSpark checkpoint {path!r} ({layout} layout) has sample_from_anchor=false"
            + (" (absent means false in the speculators format)" if layout == SPECULATORS else "")
            + ": its blocks predict from the mask slots only (DFlash's 1+N layout), while vllm_dspark "
            f"predicts from the anchor slot too. Use a drafter trained with sample_from_anchor=true, or {_V2}."
        )
    if layout == SPECULATORS:
        aux = key("aux_hidden_state_layer_ids", required=True)
        layer_ids = tuple(int(i) - 1 for i in aux)
    else:
        layer_ids = tuple(int(i) for i in key("target_layer_ids", required=True))
    vocab = body.get("vocab_size")
    hidden = body.get("hidden_size")
    if vocab is None or hidden is None:
        raise DSparkConfigError(f"DSpark checkpoint {path!r} ({layout} layout) lacks vocab_size or hidden_size "
                                + ("in transformer_layer_config." if layout == SPECULATORS else "in config.json."))
    methods = (_nested(cfg, "speculators_config", "proposal_methods") or [{}]) if layout == SPECULATORS else [{}]
    stated_k = methods[0].get("speculative_tokens") if isinstance(methods[0], dict) else None
    return DrafterSpec(
        layout=layout,
        block_size=int(key("block_size", required=True)),
        target_layer_ids=layer_ids,
        mask_token_id=int(key("mask_token_id", required=True)),
        markov_rank=int(key("markov_rank", required=True)),
        markov_head_type=str(key("markov_head_type", default="vanilla")),
        enable_confidence_head=bool(key("enable_confidence_head", default=False)),
        confidence_head_with_markov=bool(key("confidence_head_with_markov", default=False)),
        vocab_size=int(vocab),
        draft_vocab_size=int(cfg.get("draft_vocab_size") or body.get("draft_vocab_size") or vocab),
        hidden_size=int(hidden),
        target_hidden_size=int(cfg.get("target_hidden_size") or body.get("target_hidden_size") or hidden),
        speculative_tokens=None if stated_k is None else int(stated_k),
    )


def _layer_key(layout: str) -> str:
    return "aux_hidden_state_layer_ids" if layout == SPECULATORS else "target_layer_ids"


def apply(spec: DrafterSpec, hf_config) -> None:
    """Put the description's native keys on vLLM's draft hf_config (where a
    layout kept them nested or under other names), and the description itself.
    Where vLLM already read target layers (its speculators translation), they
    must be the description's."""
    seen = getattr(hf_config, "target_layer_ids", None)
    if seen is not None and [int(i) for i in seen] != list(spec.target_layer_ids):
        raise DSparkConfigError(
            f"vLLM read target_layer_ids={list(seen)} from this {spec.layout}-layout drafter, where vllm_dspark "
            f"reads {list(spec.target_layer_ids)}: the installed vLLM translates the layout differently from "
            "the pinned one (see vllm_dspark/version.py)."
        )
    for name in ("block_size", "mask_token_id", "markov_rank", "markov_head_type", "enable_confidence_head",
                 "confidence_head_with_markov", "draft_vocab_size", "target_hidden_size"):
        setattr(hf_config, name, getattr(spec, name))
    hf_config.target_layer_ids = list(spec.target_layer_ids)
    setattr(hf_config, ATTR, spec.as_dict())


def weight_names(folder: Path) -> set[str]:
    """Tensor names in a checkpoint folder's safetensors files, from their
    headers alone (no tensor is read)."""
    names: set[str] = set()
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            names.update(k for k in json.loads(f.read(size)) if k != "__metadata__")
    return names


def check_weights(spec: DrafterSpec, folder: Path, path: str) -> None:
    """What the description needs from the weights is there (a reduced draft
    vocabulary maps its ids through d2t and brings its own LM head)."""
    names = weight_names(folder)
    if not names:
        raise DSparkConfigError(f"DSpark checkpoint {path!r} has no *.safetensors weights in {folder}.")
    if spec.reduced_vocab:
        lacking = [w for w in ("d2t", "lm_head.weight") if not any(n.endswith(w) for n in names)]
        if lacking:
            raise DSparkConfigError(
                f"DSpark checkpoint {path!r} has draft_vocab_size={spec.draft_vocab_size} < vocab_size="
                f"{spec.vocab_size} (a reduced draft vocabulary) but its weights lack {lacking}: the draft ids "
                "map to target ids through d2t, with the drafter's own LM head; re-export it with both "
                "(python -m vllm_dspark.convert ... --draft-vocab N)."
            )


def _looks_like_hub_id(path: str) -> bool:
    return path.count("/") == 1 and not path.startswith((".", "/", "~"))


def locate(path: str, revision: str | None = None) -> Path:
    """The local folder of ``path``: the path itself, or for a hub id
    ("org/name") its snapshot in the Hugging Face cache, as vLLM would use it
    (the cache first; the hub only if the cache lacks it and HF_HUB_OFFLINE
    is off). Only config.json is fetched here; vLLM fetches the weights."""
    folder = Path(path).expanduser()
    if folder.exists() or not _looks_like_hub_id(path):
        return folder
    from huggingface_hub import constants, hf_hub_download

    try:
        return Path(hf_hub_download(path, "config.json", revision=revision, local_files_only=True)).parent
    except Exception as e:  # not in the cache
        if constants.HF_HUB_OFFLINE:
            raise DSparkConfigError(
                f"speculative_config.model={path!r} is read as a Hugging Face hub id, but the local cache "
                f"({constants.HF_HUB_CACHE}) has no config.json for it and HF_HUB_OFFLINE is set: download it "
                f"first (huggingface-cli download {path}) or point `model` at a local drafter folder."
            ) from e
    try:
        return Path(hf_hub_download(path, "config.json", revision=revision)).parent
    except Exception as e:
        raise DSparkConfigError(
            f"speculative_config.model={path!r} is read as a Hugging Face hub id, but its config.json could "
            f"not be fetched ({type(e).__name__}: {e}); check the id and the network, or point `model` at a "
            "local drafter folder."
        ) from e


def read_config(folder: Path, path: str) -> dict:
    """config.json of a drafter folder, with a clear error if it is not one."""
    cfg = folder / "config.json"
    if not folder.exists():
        raise DSparkConfigError(
            f"speculative_config.model={path!r} does not exist; give the path of a "
            "DSpark drafter folder (with config.json and model.safetensors) or a hub id."
        )
    if not cfg.is_file():
        raise DSparkConfigError(
            f"speculative_config.model={path!r} has no config.json; it is not a "
            "DSpark checkpoint folder."
        )
    try:
        return json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise DSparkConfigError(f"{cfg} is not valid JSON ({e}); re-export the drafter.") from None


def read_drafter(path: str, revision: str | None = None) -> DrafterSpec:
    """Locate, describe and check a drafter before vLLM reads it."""
    folder = locate(path, revision)
    spec = describe(read_config(folder, path), path)
    check_weights(spec, folder, path)
    return spec


def validate_against_target(spec: DrafterSpec, *, path: str, target_vocab_size: int, target_hidden_size: int,
                            target_num_layers: int, num_speculative_tokens: int) -> None:
    """Check the drafter against the target before any weight is loaded."""
    if spec.vocab_size != target_vocab_size:
        raise DSparkConfigError(
            f"DSpark drafter {path!r} has vocab_size={spec.vocab_size} but the "
            f"target has {target_vocab_size}; train the drafter against this target's tokenizer."
        )
    if not 0 < spec.draft_vocab_size <= spec.vocab_size:
        raise DSparkConfigError(
            f"DSpark drafter {path!r} has draft_vocab_size={spec.draft_vocab_size}; it must be in "
            f"1..{spec.vocab_size} (the target's vocabulary)."
        )
    if spec.target_hidden_size != target_hidden_size:
        raise DSparkConfigError(
            f"DSpark drafter {path!r} expects target hidden size {spec.target_hidden_size} but the "
            f"target has hidden_size={target_hidden_size}; it was trained for another target."
        )
    ids = list(spec.target_layer_ids)
    if not ids or ids != sorted(set(ids)) or ids[0] < -1 or ids[-1] >= target_num_layers:
        shown = f"aux_hidden_state_layer_ids={[i + 1 for i in ids]}" if spec.layout == SPECULATORS else \
            f"target_layer_ids={ids}"
        raise DSparkConfigError(
            f"DSpark drafter {path!r} has {shown}; they must be strictly increasing and within "
            f"[-1, {target_num_layers - 1}] as target_layer_ids (aux ids: +1) for a target with "
            f"{target_num_layers} layers."
        )
    if not 1 <= num_speculative_tokens <= spec.block_size:
        raise DSparkConfigError(
            f"speculative_config.num_speculative_tokens={num_speculative_tokens} is out of "
            f"range for this drafter: use 1..{spec.block_size} (its block_size)."
        )


def kv_share(draft_cfg, target_cfg) -> float:
    """The drafter's share of each token's KV cache: its attention layers sit
    in the target's KV group, so at the same KV bytes a DSpark engine holds
    1 - share of the tokens an engine without speculation holds."""

    def per_token(cfg) -> int:
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cfg.num_hidden_layers * heads * head_dim

    drafter = per_token(draft_cfg)
    return drafter / (drafter + per_token(target_cfg))
