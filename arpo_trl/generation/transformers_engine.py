"""`TransformersEngine`, the waves engine: the model being trained samples a batch of prefixes at a time with
`model.generate` (waves sized to the KV budget), its logprobs and entropies recorded from its own logits."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch
from transformers import GenerationConfig, StoppingCriteria

from arpo_trl.entropy import (
    DEFAULT_SERVER_TOP_K,
    SampledDistributionRecorder,
    check_entropy_args,
    resolve_estimator,
    sampling_warpers,
)
from arpo_trl.entropy.recorder import NEUTRAL_WARPERS
from arpo_trl.generation.engine import (
    GenerationCounters,
    GenerationEngine,
    SamplingSettings,
    Segment,
    check_budgets,
    check_generation_kwargs,
    stop_window,
    tail_has_stop,
)
from arpo_trl.generation.kv_budget import KVBudgetSetting, log_budget, wave_batches
from arpo_trl.generation.model_context import eval_mode, model_for_generation
from arpo_trl.tools.tags import first_stop


class _StopPerRow(StoppingCriteria):
    """Marks a row done when it reaches its own token budget or its recent text contains a stop string."""

    def __init__(self, prompt_width: int, budgets: Sequence[int], stop: Sequence[str], decode, window: int):
        self.prompt_width = prompt_width
        self.budgets = torch.tensor(list(budgets))
        self.stop = list(stop)
        self.decode = decode
        self.window = window

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        new = input_ids[:, self.prompt_width :]
        done = self.budgets.to(input_ids.device) <= new.shape[1]
        if self.stop:
            hits = [tail_has_stop(self.decode, row, self.stop, self.window) for row in new.tolist()]
            done |= torch.tensor(hits, device=input_ids.device)
        return done


class TransformersEngine(GenerationEngine):
    """Samples with `model.generate`; entropy and logprobs come from the model's own logits.

    `model_context`, if given, is entered around each call and yields the model to use (the trainer passes
    TRL's `unwrap_model_for_generation`), so the engine always sees the current weights.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        sampling: SamplingSettings = SamplingSettings(),
        model_context: Callable[[], AbstractContextManager] | None = None,
        max_batch_size: int | None = None,
        synced_gpus: bool = False,
        kv_budget=None,
    ):
        self.model = model
        self.synced_gpus = synced_gpus  # every rank runs each call's decoding steps (sharded parameters)
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        extra = check_generation_kwargs(sampling.generation_kwargs)
        check_entropy_args(sampling.entropy_estimator, sampling.entropy_top_k)
        self.entropy_estimator = resolve_estimator(sampling.entropy_estimator, True, "TransformersEngine")
        self.entropy_top_k = sampling.entropy_top_k or DEFAULT_SERVER_TOP_K
        self.eos_token_ids = eos = sampling.eos_ids(tokenizer, "TransformersEngine")
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
        self.pad_token_id = pad
        # generation_kwargs override our settings, as they override GRPOTrainer's; the warpers among them are run by
        # the recorder (HF's own stay neutral), so that the recorded logprobs are those of the distribution sampled
        warp = {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                "min_p": sampling.min_p}
        warp.update({key: extra.pop(key) for key in list(warp) if key in extra})
        greedy = extra.pop("do_sample", True) is False
        self.temperature = t = 0.0 if greedy else float(warp["temperature"] or 0.0)
        top_p = 1.0 if warp["top_p"] is None else warp["top_p"]
        self.warper_settings = (t, warp["top_k"] or 0, top_p, warp["min_p"])
        self.sampling = {
            "do_sample": t > 0, **(NEUTRAL_WARPERS if t > 0 else {}), "repetition_penalty": sampling.repetition_penalty,
            "eos_token_id": eos, "pad_token_id": pad, **extra,
        }
        self.model_context = model_context
        self.max_batch_size = max_batch_size
        self.kv_setting = kv_budget or KVBudgetSetting()  # KV bytes, from free memory by default (waves: per call)
        self.counters = GenerationCounters()  # accumulated over the engine's life
        self.budget_logged = False  # `log_budget`: one line per engine

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(
        self, prefixes: Sequence[Sequence[int]], max_new_tokens: Sequence[int], stop: Sequence[str]
    ) -> list[Segment]:
        check_budgets(prefixes, max_new_tokens)
        with model_for_generation(self.model, self.model_context) as model, eval_mode(model), torch.no_grad():
            budget, segments = log_budget(self, self.kv_setting.resolve(model)), []
            for batch in wave_batches(budget, list(map(len, prefixes)), max_new_tokens, self.max_batch_size):
                rows, budgets = prefixes[batch], max_new_tokens[batch]
                segments += self._generate_batch(model, rows, budgets, stop)
                held = len(rows) * budget.batch_bytes([max(map(len, rows)) + max(budgets)])  # model.generate's KV
                self.counters.kv_peak_bytes = max(self.counters.kv_peak_bytes, held)
        return segments

    def _generate_batch(self, model, prefixes, budgets, stop) -> list[Segment]:
        device = next(model.parameters()).device
        width = max(len(p) for p in prefixes)
        input_ids = torch.full((len(prefixes), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for row, prefix in enumerate(prefixes):  # left padding
            input_ids[row, width - len(prefix) :] = torch.tensor(prefix)
            attention[row, width - len(prefix) :] = 1
        recorder = SampledDistributionRecorder(sampling_warpers(*self.warper_settings), self.temperature,
                                               self.entropy_estimator, self.entropy_top_k, self.vocab_size)
        criteria = _StopPerRow(width, budgets, stop, self._decode, stop_window(self.tokenizer, stop))
        config = GenerationConfig(max_new_tokens=max(budgets), **self.sampling)
        out = model.generate(
            input_ids=input_ids.to(device), attention_mask=attention.to(device), generation_config=config,
            logits_processor=recorder.processors(), stopping_criteria=[criteria], synced_gpus=self.synced_gpus or None,
        )
        new = out[:, width:].cpu()
        check_recorder_ran(len(recorder.entropies), new.shape[1], model)
        self.counters.prefill_tokens += len(prefixes) * width  # every wave re-prefills its rows, padded
        self.counters.decode_tokens += len(prefixes) * max(new.shape[1] - 1, 0)
        self.counters.requests += len(prefixes)
        self.counters.prefill_forwards += 1
        logprobs, entropies = recorder.finish(new[:, -1].to(device))
        return [
            self._segment(new[row].tolist(), logprobs[row].tolist(), entropies[row].tolist(), budgets[row], stop)
            for row in range(len(prefixes))
        ]

    def _segment(self, ids: list[int], logprobs, entropies, budget: int, stop) -> Segment:
        ids = ids[:budget]
        eos_at = next((i for i, t in enumerate(ids) if t in self.eos_token_ids), None)
        scan = ids if eos_at is None else ids[: eos_at + 1]
        found = first_stop(scan, self._decode, stop)
        if found is not None:
            end, reason = found[0], "stop"
        elif eos_at is not None:
            end, reason = eos_at + 1, "eos"
        else:
            end, reason = len(ids), "length"
        return Segment(ids[:end], logprobs[:end], entropies[:end], reason)


def check_recorder_ran(steps: int, new_tokens: int, model) -> None:
    """The per-token logprobs and entropies come from our logits processor; a `generate` that did not call it once
    per new token would leave them missing or misaligned, so it is refused here, naming the likely cause."""
    if steps != new_tokens:
        raise RuntimeError(
            f"TransformersEngine: {type(model).__name__}.generate returned {new_tokens} new tokens but called ARPO's "
            f"logits processor {steps} times, so the tokens' logprobs and entropies are missing. Likely causes: a "
            "custom or remote-code `generate` that ignores `logits_processor`, or assisted decoding (assistant_model "
            "or prompt_lookup_num_tokens in generation_kwargs). Use the standard transformers `generate`, or a vLLM "
            "server (use_vllm=True)."
        )
