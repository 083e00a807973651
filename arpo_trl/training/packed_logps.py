"""`TreePackedTraining`: TRL's per-token log-probabilities computed on tree-packed micro-batches.

Mixed into `ARPOTrainer` before `GRPOTrainer`. Every training-side forward of TRL 1.16 (the policy pass of
`_compute_loss` with its backward, the old-logprob pass and the reference pass of `_generate_and_score_completions`)
goes through `_get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, ...)`, so that
is the one hook overridden here: it packs the rows, runs the model once on the packs and gathers the results back
into the (B, T) layout TRL's loss code reads, which then runs unchanged (docs/tree_packing.md).
"""

from __future__ import annotations

import logging
import time

import torch

from arpo_trl.training.compatibility import base_model, packing_blocker
from arpo_trl.training.grouping import (
    ROW_INDEX,
    optimizer_step_window,
    regroup,
    regroup_blocker,
    without_row_index,
)
from arpo_trl.training.packing import ForwardCost, PackedBatch, pack_rows

logger = logging.getLogger(__name__)


def real_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor,
              prompt_width: int) -> tuple[list[list[int]], list[int]] | None:
    """Each row's real tokens and prompt length, or None when a row's attended tokens are not one contiguous run
    (a hole would shift positions differently than a tree can) or a row has no prompt token."""
    mask = attention_mask.bool()
    counts = mask.sum(1)
    first = mask.int().argmax(1)
    last = mask.size(1) - 1 - mask.flip(1).int().argmax(1)
    prompt_lengths = mask[:, :prompt_width].sum(1)
    if bool(((last - first + 1) != counts).any()) or bool((prompt_lengths == 0).any()):
        return None
    ids = input_ids.tolist()
    rows = [ids[r][f:f + n] for r, (f, n) in enumerate(zip(first.tolist(), counts.tolist()))]
    return rows, prompt_lengths.tolist()


FLEX_GPU_PACK_MULTIPLE = 128  # FlexAttention's default block: no Inductor GPU kernel below it (docs/gpu_checks.md)


def pack_length_multiple(attn_implementation: str, device: torch.device | str) -> int:
    """FlexAttention off the CPU gets packs of whole 128-slot blocks: on an H200 (torch 2.11) Inductor lowered no GPU
    kernel for a sequence shorter than 128 slots (`NoValidChoicesError`, whatever the block mask's block size), and
    whole-block packs are what the GPU tests checked."""
    if attn_implementation == "flex_attention" and torch.device(device).type != "cpu":
        return FLEX_GPU_PACK_MULTIPLE
    return 1


def tree_mask(packed: PackedBatch, attn_implementation: str, dtype: torch.dtype, device):
    """The packs' tree mask in the form the attention implementation reads: a FlexAttention block mask, bool for
    SDPA, additive float for eager (transformers passes a prepared 4D mask through as is)."""
    if attn_implementation == "flex_attention":
        return packed.block_mask(device)
    visible = packed.visible(device)
    if attn_implementation == "sdpa":
        return visible
    return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, torch.finfo(dtype).min)


class TreePackedTraining:
    """Active with `ARPOConfig.tree_packing`; falls back to TRL's unpacked rows (warning once) where a tree mask is
    not exact: see `arpo_trl.training.compatibility`."""

    _packing_checked: dict[int, str | None] | None = None  # per model object: why it falls back, or None
    _logp_seconds = 0.0  # time in this hook so far (old/reference passes inside generation count as training)
    _rollout_seconds = 0.0  # time in generation and scoring so far, those passes excluded
    _training_seconds = 0.0  # training time of the optimizer step under way
    _warned_rows = False
    _warned_regroup = False
    _warned_cost = False

    def _packing_fallback(self, model) -> str | None:
        if self._packing_checked is None:
            self._packing_checked = {}
        checked = self._packing_checked
        if id(model) not in checked:
            reason = packing_blocker(model, self.args.use_liger_kernel)
            if reason is not None and not any(checked.values()):  # one warning, not one per model (policy, ref)
                logger.warning("ARPO: tree_packing falls back to unpacked rows: %s.", reason)
            checked[id(model)] = reason
        return checked[id(model)]

    # TRL 1.16: every training-side forward (policy, old, reference) calls this; the narrowest hook to pack rows
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        started = time.perf_counter()
        rows = None
        if (self.args.tree_packing and not compute_aux_loss and self._packing_fallback(model) is None
                and all(value is None for value in multimodal.values())):  # images, token types: TRL's rows
            rows = real_rows(input_ids, attention_mask, input_ids.size(1) - logits_to_keep)
            if rows is None and not self._warned_rows:
                self._warned_rows = True
                logger.warning("ARPO: tree_packing falls back to unpacked rows for a micro-batch with a row whose "
                               "attended tokens are not one contiguous run, or that has no prompt token.")
        if rows is None:
            out = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal)
            forwarded = input_ids.numel()
        else:
            out, forwarded = self._packed_logps(model, input_ids, attention_mask, *rows, logits_to_keep,
                                                batch_size or input_ids.size(0), compute_entropy)
        self._record_forward(input_ids.size(0), forwarded, compute_entropy, time.perf_counter() - started)
        return out

    def _packed_logps(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: list[list[int]],
                      prompt_lengths: list[int], width: int, batch_size: int, compute_entropy: bool):
        """TRL's chunks of `batch_size` rows (so the memory peak stays where TRL puts it), each packed, or forwarded
        as TRL's rows where its packs would cost more (`packing.ForwardCost`)."""
        logps, entropies, forwarded = [], [], 0
        config = self._packing_config(model)
        multiple = pack_length_multiple(config._attn_implementation, self.accelerator.device)
        cost = ForwardCost.of(base_model(model), config, config._attn_implementation)
        for start in range(0, len(rows), batch_size):
            chunk = slice(start, start + batch_size)
            packed = pack_rows(rows[chunk], prompt_lengths[chunk], width, self.args.tree_packing_max_length, multiple)
            if cost.packed(packed) < cost.unpacked(len(rows[chunk]), input_ids.size(1)):
                chunk_logps, chunk_entropies = self._forward_packed(model, packed, compute_entropy)
                forwarded += packed.input_ids.numel()
            else:
                self._note_unpacked_chunk(packed, input_ids[chunk])
                chunk_logps, chunk_entropies, _ = super()._get_per_token_logps_and_entropies(
                    model, input_ids[chunk], attention_mask[chunk], width, compute_entropy=compute_entropy)
                forwarded += input_ids[chunk].numel()
            logps.append(chunk_logps)
            entropies.append(chunk_entropies)
        return (torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None), forwarded

    def _note_unpacked_chunk(self, packed: PackedBatch, input_ids: torch.Tensor) -> None:
        if not self._warned_cost:
            self._warned_cost = True
            logger.info("ARPO: tree_packing forwards a chunk as TRL's rows: its %d packs of %d slots would cost more "
                        "than %d rows of %d tokens (attention over a pack's every slot pair; a row longer than "
                        "tree_packing_max_length sets every pack's length).", *packed.input_ids.shape,
                        *input_ids.shape)

    def _forward_packed(self, model, packed: PackedBatch, compute_entropy: bool):
        device = self.accelerator.device
        config = self._packing_config(model)
        dtype = base_model(model).get_input_embeddings().weight.dtype
        mask = tree_mask(packed, config._attn_implementation, dtype, device)
        with self.accelerator.autocast():
            # TRL 1.16's fused LM head (trl.trainer.utils.add_fused_lm_head) scores `shift_labels` as given, one
            # label per slot, with TRL's temperature and head options: the same numbers as its unpacked forward.
            outputs = model(input_ids=packed.input_ids.to(device), attention_mask=mask,
                            position_ids=packed.position_ids.to(device), shift_labels=packed.labels.to(device),
                            fused_lm_head=True)
        packed.gather_index = packed.gather_index.to(device)
        entropies = packed.gather(outputs.entropy) if compute_entropy else None
        return packed.gather(outputs.log_probs), entropies

    @staticmethod
    def _packing_config(model):
        return base_model(model).config.get_text_config()

    def _record_forward(self, rows: int, forwarded: int, is_loss_pass: bool, seconds: float) -> None:
        """`arpo/tokens_forwarded_per_group`: positions the policy pass of `_compute_loss` forwards (padding
        included: it is computed too), per prompt group of M rows."""
        self._logp_seconds += seconds
        if is_loss_pass and self.model.training:
            groups = rows / self._trl.group_size(True)
            self._trl.log_metric("train", "arpo/tokens_forwarded_per_group", forwarded / groups)

    def _generate_and_score_completions(self, inputs):  # TRL 1.16: (inputs) -> the generation batch's dict
        started, logp_before = time.perf_counter(), self._logp_seconds
        output = super()._generate_and_score_completions(inputs)
        if self.model.training and self.args.tree_packing:
            output[ROW_INDEX] = torch.arange(self._trl.completion_shape(output)[0], device=self.accelerator.device)
        logp_seconds = self._logp_seconds - logp_before  # old/ref passes: training work
        self._rollout_seconds += time.perf_counter() - started - logp_seconds
        return output

    def _prepare_inputs(self, generation_batch):  # TRL 1.16: shuffles and splits a new generation batch here
        before = self._trl.buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        fresh = self._trl.buffered_inputs
        if fresh is not before and fresh and ROW_INDEX in fresh[0]:
            position = next(i for i, batch in enumerate(fresh) if batch is inputs)
            self._trl.buffered_inputs = self._regrouped(fresh)
            inputs = self._trl.buffered_inputs[position]
        return inputs

    def _regrouped(self, batches: list[dict]) -> list[dict]:
        """TRL's micro-batches with each group's rows together within every optimizer step's micro-batches, where
        that leaves each step's rows and loss weights as they are (`grouping.py`); else TRL's split as it is."""
        args = self.args
        window = optimizer_step_window(args.steps_per_generation, args.gradient_accumulation_steps)
        reason = self._packing_fallback(self.model) or regroup_blocker(args)
        if reason is None and window is None:
            reason = (f"steps_per_generation={args.steps_per_generation} and gradient_accumulation_steps="
                      f"{args.gradient_accumulation_steps} cut TRL's micro-batches unevenly into optimizer steps")
        if reason is not None:
            if not self._warned_regroup:
                self._warned_regroup = True
                logger.info("ARPO: tree_packing packs TRL's micro-batches as shuffled, without regrouping prompt "
                            "groups (fewer shared prefixes per pack): %s.", reason)
            return without_row_index(batches)
        group_size = self._trl.group_size(True)
        return [batch for start in range(0, len(batches), window)
                for batch in regroup(batches[start:start + window], group_size)]

    def training_step(self, model, inputs, num_items_in_batch):  # transformers: one micro-batch's forward+backward
        """`arpo/training_seconds`: per optimizer step, the time of its micro-batches' training steps less the
        rollout and scoring inside them (the old-logprob and reference passes count as training)."""
        started, rollout_before = time.perf_counter(), self._rollout_seconds
        loss = super().training_step(model, inputs, num_items_in_batch)
        rollout = self._rollout_seconds - rollout_before
        spent = self._training_seconds + time.perf_counter() - started - rollout
        self._training_seconds = spent
        if self.accelerator.sync_gradients:
            self._trl.log_metric("train", "arpo/training_seconds", spent)
            self._training_seconds = 0.0
        return loss
