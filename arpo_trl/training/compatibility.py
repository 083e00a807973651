"""Where a tree mask gives the same log-probabilities as unpacked rows, and why not elsewhere."""

from __future__ import annotations

from peft import PeftModel

from arpo_trl.generation.support import non_full_attention

# Decoder-only architectures whose attention reads positions only through RoPE (a row's constant position offset under
# TRL's left padding cancels) and takes a prepared 4D mask as is (transformers >= 5). Packed against unpacked
# exactness is tested for llama and qwen2/qwen3 (tests/test_tree_packing.py).
TREE_MASK_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")
# flash-attention varlen and paged kernels take no 4D mask; FlexAttention takes the tree as a block mask
TREE_MASK_ATTENTION = ("sdpa", "eager", "flex_attention")
# RoPE variants that pick their frequencies from the largest position id of each forward (transformers'
# `dynamic_rope_update`): packed position ids are token depths, so a pack and TRL's padded rows would see different
# frequencies, and so could the old-logprob and the policy pass of the same rows. The other types are static.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def base_model(model):
    """The transformers model under DDP/accelerate and PEFT wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model.get_base_model() if isinstance(model, PeftModel) else model


def rope_types(config) -> set[str]:
    """Every `rope_type` of a text config: one set of RoPE parameters, or one per layer type."""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(parameters, dict):
        return set()
    sets = [parameters] if "rope_type" in parameters or "type" in parameters else list(parameters.values())
    return {str(p.get("rope_type", p.get("type", "default"))) for p in sets if isinstance(p, dict)}


def prompt_learning(model) -> bool:
    """A PEFT prompt/prefix/p-tuning adapter: PEFT prepends virtual tokens (or past key values) and their 2D mask to
    every forward and drops `position_ids`, which a tree mask cannot take."""
    while hasattr(model, "module"):
        model = model.module
    config = getattr(model, "active_peft_config", None) if isinstance(model, PeftModel) else None
    return bool(getattr(config, "is_prompt_learning", False))


def packing_blocker(model, use_liger_kernel: bool = False) -> str | None:
    """Why `model` cannot run on a tree mask (a sentence for the fallback warning), or None when it can."""
    if prompt_learning(model):
        return ("a PEFT prompt-learning adapter (prompt, prefix or p-tuning) prepends virtual tokens with a 2D mask "
                "and drops position_ids")
    config = base_model(model).config.get_text_config()
    model_type = getattr(config, "model_type", None)
    if model_type not in TREE_MASK_ARCHITECTURES:
        return (f"architecture {model_type!r} is not one of {TREE_MASK_ARCHITECTURES} (RoPE models whose attention "
                "takes a 4D mask; absolute position embeddings would see packed depths differently)")
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in TREE_MASK_ATTENTION:
        return (f"attn_implementation={implementation!r} takes no 4D tree mask (use one of {TREE_MASK_ATTENTION})")
    if other := non_full_attention(config):
        return f"{other} attention is not expressed by a tree mask (layer_types / sliding_window)"
    if dynamic := sorted(rope_types(config) & set(LENGTH_DEPENDENT_ROPE)):
        return (f"rope_type {dynamic[0]!r} chooses its frequencies from the longest position in each forward, which "
                "packed depths and padded rows set differently")
    if use_liger_kernel:
        return "Liger kernels are not checked against tree masks"
    return None
