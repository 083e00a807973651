"""`CachedTransformersEngine`: the model being trained, generating request by request with a persistent KV cache.

The events scheduler calls `agenerate` once per path segment. Requests join the running batch as they come and leave
it when they finish; every step decodes one token for all running rows in one forward,
writing keys and values in place (`KVBatch`). A request's prefix is looked up in a `PrefixCache`, so a continuation
after a tool result prefills only the result, and a fork starts from its parent's state. The cache lives for one
rollout, so every rollout samples the current weights (LoRA included); a request that joins after the weights changed
finds it dropped (`WeightsVersion`). How and why: docs/in_process_engine.md.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from transformers.generation.logits_process import LogitsProcessorList

from arpo_trl.entropy import sampling_warpers
from arpo_trl.generation.admission import Admission
from arpo_trl.generation.engine import (
    EngineTraits,
    SamplingSettings,
    Segment,
    check_budgets,
    stop_window,
    tail_has_stop,
)
from arpo_trl.generation.event_loop import run_coroutine
from arpo_trl.generation.kv_batch import LEFT_SLACK, KVBatch
from arpo_trl.generation.kv_budget import KVAccounting, log_budget
from arpo_trl.generation.model_context import eval_mode, model_for_generation
from arpo_trl.generation.prefix_cache import KV, CachedPrefix, PrefixCache
from arpo_trl.generation.running_batch import Request, RunningBatch
from arpo_trl.generation.sampling import distributions, keyed_uniforms, penalized, sample_tokens
from arpo_trl.generation.support import SUPPORTED_KEYS, check_full_attention
from arpo_trl.generation.transformers_engine import TransformersEngine


class CachedTransformersEngine(TransformersEngine):
    """`TransformersEngine`'s sampling settings and segment rules, generated event-driven with a KV cache.

    `max_cached_tokens` bounds the positions the prefix cache keeps between requests of one rollout (None: unbounded).
    `kv_budget` (a `KVBudgetSetting`) bounds the running rows' KV and the prefix cache together (`kv_budget.py`;
    default: half the memory free when a rollout starts): requests wait for room. `counters` accumulate over the
    engine's life (positions, forwards, and each phase's seconds).

    The engine owns its running batch (`running`) and hands it to its parts: `admission` (who joins, and how their
    prefixes are prefilled) and `kv` (the KV budget's accounting).
    """

    # A token's draw depends on its path's seed and its position alone. Not `compute_bound`, though a CPU row costs
    # compute: fill-ups run ahead from the rollout's start made the quickstart's rollouts faster than waiting for a
    # prompt's first decision (docs/in_process_engine.md, "What was removed").
    traits = EngineTraits(event_driven=True, request_options=frozenset({"seed"}))

    def __init__(self, model, tokenizer, *, sampling: SamplingSettings | None = None,
                 max_cached_tokens: int | None = None, **kwargs):
        sampling = sampling or SamplingSettings()
        super().__init__(model, tokenizer, sampling=sampling, **kwargs)
        if unsupported := set(sampling.generation_kwargs or {}) - SUPPORTED_KEYS:
            raise ValueError(f"generation_kwargs: {sorted(unsupported)} are not supported by CachedTransformersEngine "
                             f"(it samples itself; supported: {sorted(SUPPORTED_KEYS)}).")
        # the parent resolved temperature, top-k/p, min-p and the estimator (generation_kwargs included)
        self.repetition_penalty = self.sampling.get("repetition_penalty")
        self.prefix_cache = PrefixCache(max_cached_tokens)
        self.running = RunningBatch()
        self.kv = KVAccounting(self.running, self.prefix_cache, self.counters)
        self.admission = Admission(self.prefix_cache, self.counters, self.kv)
        self._warpers = LogitsProcessorList(sampling_warpers(*self.warper_settings))
        self._pending: list[Request] = []  # arrived, not yet running
        self._held = HeldModel()
        self._weights: WeightsVersion | None = None  # the weights the cached KV and logits were computed with
        self._driver: asyncio.Task | None = None
        self._scoped = False  # inside `rollout_scope`: the prefix cache outlives a wave

    # --- the interface the schedulers use -------------------------------------------------------------------

    def generate(self, prefixes: Sequence[Sequence[int]], max_new_tokens: Sequence[int],
                 stop: Sequence[str], seeds: Sequence[int | None] | None = None) -> list[Segment]:
        """A wave, for the waves scheduler and evaluation: its requests share the batch and each other's prefixes;
        the cache is freed afterwards, unless a `rollout_scope` keeps it for the rollout's next waves. `seeds`: per
        prefix, its path's seed (`agenerate`)."""
        check_budgets(prefixes, max_new_tokens)
        seeds = [None] * len(prefixes) if seeds is None else list(seeds)
        if len(seeds) != len(prefixes):
            raise ValueError(f"generate: one seed per prefix is required, got {len(seeds)} for {len(prefixes)}.")

        async def wave() -> list[Segment]:
            try:
                segments = (self.agenerate(p, b, stop, s) for p, b, s in zip(prefixes, max_new_tokens, seeds))
                return list(await asyncio.gather(*segments))
            finally:
                await self.aclose(keep_cache=self._scoped)

        return run_coroutine(wave())  # in a thread where an event loop runs already (Jupyter)

    @contextlib.contextmanager
    def rollout_scope(self):
        """One rollout of waves (`WaveScheduler`): the prefix cache outlives each wave until the scope ends, so that
        a continuation or a fork in a later wave prefills only its new tokens (dropped if the weights change)."""
        self._scoped = True
        try:
            yield self
        finally:
            self._scoped = False
            self._forget_cache()

    async def agenerate(self, prefix: Sequence[int], max_new_tokens: int, stop: Sequence[str],
                        seed: int | None = None) -> Segment:
        """Continue `prefix`. `seed`: its path's, which with each token's position keys the token's draw
        (`sampling.keyed_uniforms`), so that the same seed and prefix give the same tokens whatever else runs beside
        them and however the path's segment is split into requests; None: one drawn from torch's global generator."""
        check_budgets([prefix], [max_new_tokens])
        if not prefix:
            raise ValueError("agenerate: the prefix must hold at least one token.")
        if seed is None:
            seed = int(torch.randint(0, 2 ** 62, ()).item())
        elif isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 64:
            raise ValueError(f"agenerate: seed must be an integer in [0, 2**64), got {seed!r}.")
        request = Request(list(prefix), max_new_tokens, list(stop), asyncio.get_running_loop().create_future(),
                          stop_window(self.tokenizer, stop), text=list(prefix), seed=seed)
        self._pending.append(request)
        if self._driver is None or self._driver.done():
            self._driver = asyncio.create_task(self._drive())
        return await request.future

    async def aclose(self, keep_cache: bool = False) -> None:
        """End of a rollout (or of a wave): stop the driver, free the KV cache (`keep_cache`: all but the prefix
        cache) and give the model back."""
        if self._driver is not None and not self._driver.done():
            self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._driver
        self._driver = None
        if keep_cache and self.running.kv is not None:  # a wave's held rows: the next wave's continuations find them
            self._release([row for row, request in enumerate(self.running.requests) if request.held], fed=True)
        self._fail_all(RuntimeError("CachedTransformersEngine closed with requests in flight"))
        if not keep_cache:
            self._forget_cache()
        self._held.release()

    def _forget_cache(self) -> None:
        self.prefix_cache.clear()
        self._weights = self.kv.budget = None  # the next rollout measures the free memory anew

    # --- the driver: one batched step at a time, yielding to the event loop in between ----------------------

    async def _drive(self) -> None:
        try:
            while self._pending or self.running.requests:
                self._step(self._current_model())
                if self.running.all_held():  # the callers' code runs next: their mode
                    self._held.restore_mode()
                await asyncio.sleep(0)  # let paths react: tool results, new requests join before the next step
        except asyncio.CancelledError:
            raise
        except BaseException as error:
            self._fail_all(error)
        finally:
            self._held.restore_mode()

    def _fail_all(self, error: BaseException) -> None:
        _fail(self._pending + self.running.requests, error)
        self._pending = []
        self.running.clear()

    def _current_model(self):
        """The held model in eval mode. When requests join after its weights changed, what was computed with the
        old ones goes: the prefix cache, the held rows, and the requests running (failed)."""
        model = self._model()
        if self._pending and self._weights.changed():
            _fail(self.running.requests, RuntimeError(
                "CachedTransformersEngine: the model's weights changed while this request was generating, so its "
                "tokens would mix two policies. Change the weights between requests, or after aclose()."))
            self.running.clear()
            self._forget_cache()
            self._held.release()  # taken again: a model context gathers the new weights, the head is packed anew
            model = self._model()
        self._held.in_eval_mode(model)
        return model

    def _model(self):
        model, taken = self._held.take(self.model, self.model_context)
        if taken:
            check_full_attention(model)
            if self._weights is not None and not self._weights.same_parameters(model):
                self._forget_cache()  # computed with another model's parameters
        if self._weights is None:
            self._weights = WeightsVersion(model)
        return model

    @torch.no_grad()
    def _step(self, model) -> None:
        timed = self.counters.timed
        pending, self._pending = self._pending, []
        if self.kv.budget is None:  # the rollout's, at its first step
            self.kv.budget = log_budget(self, self.kv_setting.resolve(model, LEFT_SLACK + 1, batch_share=0.5))
        joining = [request for request in pending if not request.future.done()]  # not cancelled
        if any(request.held for request in self.running.requests):
            with timed("admit"):
                joining, unclaimed = self.admission.adopt(self.running, joining)
                self._release(unclaimed, fed=True)
        joining, waiting = self.kv.gate(joining)  # those the KV budget holds; the others wait, ahead of later ones
        self._pending = waiting + self._pending
        if joining:
            with timed("admit"):  # prefix-cache lookups, prefill forwards, rows written into the batch
                try:
                    self._join(self.admission.admit(model, joining))
                except BaseException:
                    self._pending += joining  # answered with the error by the driver, not left waiting
                    raise
        if not self.running.requests:
            return
        with timed("sample"):  # a token per row; the rows that finished are released
            self._release(self._sample())
        if self.running.requests:
            with timed("decode"):
                self._decode_step(model)
            self.counters.decode_steps += 1

    def _join(self, rows: list[tuple[Request, KV, torch.Tensor]]) -> None:
        """Add the admitted rows to the batch (written into its preallocated buffers)."""
        self.running.join(rows, lambda: KVBatch(self.kv.room, self.kv.allocated))

    def _sample(self) -> list[int]:
        """One token per running row; returns the rows that finished."""
        rows = self.running.requests
        scores = penalized(self.running.logits, self.repetition_penalty, rows)
        tempered, entropies, sampled = self._distributions(scores)
        if sampled is not None:  # F⁻¹(u), u keyed by the path's seed and the token's position
            uniforms = keyed_uniforms([r.seed for r in rows], [len(r.text) for r in rows])
            tokens = sample_tokens(sampled, uniforms)
        else:  # greedy
            sampled, tokens = tempered, scores.argmax(-1)
        chosen = sampled.gather(-1, tokens[:, None]).squeeze(1).tolist()
        finished = []
        for row, (request, token, entropy) in enumerate(zip(rows, tokens.tolist(), entropies.tolist())):
            self._append(request, token, chosen[row], entropy)
            if request.future.done() or self._is_done(request):
                finished.append(row)
        self.running.tokens = tokens
        return finished

    def _distributions(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return distributions(scores, self.temperature, self._warpers, self.entropy_estimator, self.entropy_top_k,
                             self.vocab_size)

    def _append(self, request: Request, token: int, logprob: float, entropy: float) -> None:
        request.ids.append(token), request.logprobs.append(logprob), request.entropies.append(entropy)
        request.text.append(token)

    def _is_done(self, request: Request) -> bool:
        return len(request.ids) >= request.budget or request.ids[-1] in self.eos_token_ids or tail_has_stop(
            self._decode, request.ids, request.stop, request.stop_window)

    def _release(self, finished: list[int], fed: bool = False) -> None:
        """Answer the finished rows, keep their KV in the prefix cache, and take them out of the batch. `fed`: the
        rows' last tokens are in their KV (after a decode step), whose next-token logits are kept with it.

        A row that stopped at its budget alone, as an ARPO probe does after k tokens, is answered but held for one
        step (`_adopt`): its path goes on at once with the same text, and the continuation then needs no prefill of
        the probe's last token, nor the copies of its row out of the batch and back."""
        if not finished:
            return
        gone = []
        for row in finished:
            request = self.running.requests[row]
            if not request.held and request.future.done():  # cancelled
                gone.append(row)
                continue
            if not request.held:
                segment = self._segment(request.ids, request.logprobs, request.entropies, request.budget, request.stop)
                request.future.set_result(segment)
                if segment.finish_reason == "length" and len(segment.token_ids) == len(request.ids):
                    request.held = True  # fed by this step's decode if not yet; `_adopt` decides at the next
                    continue
            self._store(row, fed)
            gone.append(row)
        if not fed and self.running.all_held(but=frozenset(gone)):
            held = [row for row in range(len(self.running)) if row not in gone]  # a forward only to feed them costs
            for row in held:  # what their continuations' prefill would: released as before
                self._store(row, fed=False)
            gone += held
        if gone:
            self.running.remove(gone)

    def _store(self, row: int, fed: bool) -> None:
        """Keep a row's KV in the prefix cache; `fed`: its last token is in it, with the next-token logits."""
        request = self.running.requests[row]
        tokens = request.prefix + (request.ids if fed else request.ids[:-1])
        logits = self.running.logits[row: row + 1].clone() if fed else None
        self.kv.keep(CachedPrefix(tuple(tokens), self.running.kv.row(row), logits))

    def _decode_step(self, model) -> None:
        """Run the sampled token of every row in one forward; each layer writes its new column in place."""
        batch = self.running
        mask = batch.kv.open_columns()
        out = model(input_ids=batch.tokens[:, None], attention_mask=mask, position_ids=batch.positions[:, None],
                    cache=batch.kv.cache, use_cache=True)
        batch.kv.close_columns()
        self.counters.decode_tokens += len(batch)
        batch.positions = batch.positions + 1
        batch.logits = out.logits[:, -1].float()


def _fail(requests: list[Request], error: BaseException) -> None:
    for request in requests:
        if not request.future.done():
            request.future.set_exception(error)


# ---- the model it holds ----------------------------------------------------------------------------------------------
# The model the engine holds while its requests run: taken once through
# `model_for_generation` (the trainer's model context, SDPA decoding, the packed head) and kept until the engine lets it
# go, in eval mode only while requests run, so that the callers' code between steps sees the model in its own mode.


class HeldModel:
    """Holds a model (through its context where given) from `take` to `release`."""

    def __init__(self):
        self._stack: contextlib.ExitStack | None = None
        self._held = None
        self._mode: contextlib.ExitStack | None = None  # the held model in eval mode, while requests run

    def take(self, model, model_context: Callable[[], AbstractContextManager] | None) -> tuple[object, bool]:
        """The held model (`model` through `model_context`, once), and whether it was taken just now: the context may
        have gathered other weights."""
        if self._held is not None:
            return self._held, False
        self._stack = contextlib.ExitStack()
        self._held = self._stack.enter_context(model_for_generation(model, model_context))
        return self._held, True

    def in_eval_mode(self, model) -> None:
        """`model` (the held one) in eval mode until `restore_mode`."""
        if self._mode is None:
            self._mode = contextlib.ExitStack()
            self._mode.enter_context(eval_mode(model))

    def restore_mode(self) -> None:
        if self._mode is not None:
            self._mode.close()
        self._mode = None

    def release(self) -> None:
        """Give the model back (its context exits: merged or gathered weights go, the head is unpacked)."""
        self.restore_mode()
        if self._stack is not None:
            self._stack.close()
        self._stack = self._held = None

# ---- which weights its cache was computed with -----------------------------------------------------------------------
# Which weights the cached engine's KV and logits were computed with, and whether they changed since: checked when
# requests join, so that a caller of the async API who updates the model between two requests samples the new policy.
#
# Three signals, each cheap (some 20 microseconds per hundred parameters on a CPU): an update in place bumps a
# parameter's version counter (`add_`, `copy_`, a foreach optimizer step); new storage (`param.data = ...`) changes its
# data pointer; and a fused optimizer step (torch's `fused=True`, the `adamw_torch_fused` default of transformers'
# Trainer), which writes in place without bumping the counters, is noted on the parameters it updated by a process-wide
# post-step hook on `torch.optim.Optimizer` (an attribute holding the step's number; the optimizer itself may be gone by
# the next look).

_STEP = "_arpo_optimizer_step"  # on a parameter: the number of the last optimizer step that updated it
_steps = 0  # optimizer steps taken in this process since the hook was registered
_hook: object | None = None


def _note_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    global _steps
    _steps += 1
    for group in optimizer.param_groups:
        for param in group["params"]:
            setattr(param, _STEP, _steps)


def _watch_optimizers() -> None:
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_post_hook(_note_step)


def _has_storage(param: torch.Tensor) -> bool:
    try:
        param.data_ptr()
    except RuntimeError:
        return False
    return True


class WeightsVersion:
    """The state of a model's parameters when taken; `changed()` tells whether any was updated since."""

    def __init__(self, model: torch.nn.Module):
        _watch_optimizers()
        self.params = list(model.parameters())
        self.ids = [id(param) for param in self.params]
        self._counted = [param for param in self.params if not param.is_inference()]  # the others have no counter
        self._stored = [param for param in self.params if _has_storage(param)]  # not a wrapper such as a DTensor
        self.stamp = self._stamp()
        self.steps = _steps

    def _stamp(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return tuple(param.data_ptr() for param in self._stored), tuple(param._version for param in self._counted)

    def same_parameters(self, model: torch.nn.Module) -> bool:
        """Whether `model` has the parameters this version was taken of (a model context may yield another model)."""
        return [id(param) for param in model.parameters()] == self.ids

    def changed(self) -> bool:
        return self._stamp() != self.stamp or self._stepped()

    def _stepped(self) -> bool:
        """Whether an optimizer step updated one of these parameters since the last look."""
        if self.steps == _steps:
            return False
        since, self.steps = self.steps, _steps
        return any(getattr(param, _STEP, 0) > since for param in self.params)
