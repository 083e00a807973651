"""How requests join the cached engine's running batch, each step before it samples.

A request whose prefix is a held row's text (`Request.held`: an ARPO probe, answered at its budget one step ago) takes
that row over. The others are looked up in the prefix cache, and what it does not hold is prefilled, the requests of
one step together (`prefill.py`); their rows are then written into the batch (`KVBatch.add`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from arpo_trl.generation.kv_batch import KVBatch
from arpo_trl.generation.prefill import PrefillJob, prefill
from arpo_trl.generation.prefix_cache import KV, CachedPrefix, common_prefix_length, crop, kv_length
from arpo_trl.generation.speculation import PRIOR_ACCEPTANCE


@dataclass
class Request:
    """One segment asked of the engine, from its arrival to its answer (`ids`: the tokens generated so far)."""

    prefix: list[int]
    budget: int
    stop: list[str]
    future: asyncio.Future
    stop_window: int = 0  # tokens of decoded tail that can hold a stop string
    ids: list[int] = field(default_factory=list)
    text: list[int] = field(default_factory=list)  # prefix + ids, indexed for drafts
    cached: int = 0  # leading prefix tokens the prefix cache held at admission (their n-grams are indexed already)
    logprobs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    alpha: float = PRIOR_ACCEPTANCE  # the row's draft acceptance rate (`SpeculativeDecoding`), the rollout's at join
    held: bool = False  # answered at its budget alone; its row waits one step for the continuation (`_adopt`)
    seed: int = 0  # its path's: with a token's position, it keys the token's draw (`sampling.keyed_uniforms`)


class Admission:
    """The cached engine's admission of joining requests. Mixed into `CachedTransformersEngine`, whose batch state
    (`_rows`, `_batch`, `_positions`, `_logits`, `_rejected`), prefix cache, counters, `_release`, KV budget
    (`_budget`, `_span`, `_keep`, `_room`: `kv_budget.KVAccounting`) and cost model (`costs`) it uses."""

    def _adopt(self, joining: list[Request]) -> list[Request]:
        """A request whose prefix is a held row's text (an ARPO probe's continuation: its k tokens were answered one
        step ago) takes that row over: its last token is fed and its next-token logits are at hand, so nothing is
        prefilled or copied. The held rows no request took go to the prefix cache. Returns the requests to admit."""
        held = {tuple(request.prefix + request.ids): row for row, request in enumerate(self._rows) if request.held}
        spans, rest = [self._span(request) for request in self._rows if not request.held], []
        for request in joining:
            if (row := held.get(tuple(request.prefix))) is None or not self._budget.fits(spans + [self._span(request)]):
                rest.append(request)  # its row goes to the prefix cache if the KV budget cannot hold it grown
                continue
            del held[tuple(request.prefix)]
            spans.append(self._span(request))
            request.alpha = self._rows[row].alpha
            self._rows[row] = request
            self._count(len(request.prefix))
            self.counters.adopted_rows += 1
        self._release(sorted(held.values()), fed=True)
        return rest

    def _admit(self, model, requests: list[Request]) -> list[tuple[Request, KV, torch.Tensor]]:
        """Prefill what the cache does not hold, all joining requests together; returns their rows, in order.

        In rounds: a request that would share a longer prefix with another one prefilled in this step than with the
        cache waits for the next round (if the positions saved pay for its forward); one whose prefix equals an
        earlier one's takes its result (a fork's copies, a prompt's samples)."""
        admitted: dict[int, tuple[KV, torch.Tensor]] = {}
        waiting, twins = list(range(len(requests))), []
        while waiting:
            jobs: dict[int, PrefillJob] = {}
            first, later, saved = {}, [], 0
            for index in waiting:
                request = requests[index]
                entry, shared = self.prefix_cache.lookup(request.prefix)
                request.cached = shared
                if shared == len(request.prefix) and (logits := entry.logits_after(shared)) is not None:
                    admitted[index] = crop(entry.kv, shared), logits  # nothing to prefill
                    self._count(shared)
                elif (twin := first.setdefault(tuple(request.prefix), index)) != index:
                    twins.append((index, twin))
                    request.cached = len(request.prefix)  # its twin indexes the prefix
                elif (gain := max((common_prefix_length(job.tokens, request.prefix) for job in jobs.values()),
                                  default=0) - shared) > 0:
                    later.append((index, entry, shared))
                    saved += gain
                else:
                    jobs[index] = self._job(request, entry, shared)
            if saved < self.costs.forward_cost_tokens:  # another round would cost more than it saves
                jobs.update((index, self._job(requests[index], entry, shared)) for index, entry, shared in later)
                later = []
            self._prefill(model, jobs, requests, admitted)
            for index, twin in [pair for pair in twins if pair[1] in admitted]:
                admitted[index] = admitted[twin]
                self._count(len(requests[index].prefix))
            twins = [pair for pair in twins if pair[1] not in admitted]  # their twins wait for the next round
            waiting = [index for index, _, _ in later]
        return [(request, *admitted[index]) for index, request in enumerate(requests)]

    @staticmethod
    def _job(request: Request, entry: CachedPrefix | None, shared: int) -> PrefillJob:
        shared = min(shared, len(request.prefix) - 1)  # at least one token is run, for the next-token logits
        return PrefillJob(request.prefix, crop(entry.kv, shared) if entry and shared else None, shared)

    def _prefill(self, model, jobs: dict[int, PrefillJob], requests: list[Request],
                 admitted: dict[int, tuple[KV, torch.Tensor]]) -> None:
        results, positions = prefill(model, list(jobs.values()), self.costs.forward_cost_tokens)
        for (index, job), (kv, logits) in zip(jobs.items(), results):
            self._keep(CachedPrefix(tuple(job.tokens), kv, logits))
            admitted[index] = kv, logits
            self._count(job.start)
        self.counters.prefill_tokens += sum(positions)  # padding included
        self.counters.prefill_forwards += len(positions)

    def _count(self, reused: int) -> None:
        self.counters.reused_tokens += reused
        self.counters.requests += 1

    def _join(self, joining: list[tuple[Request, KV, torch.Tensor]]) -> None:
        """Add the admitted rows to the batch (written into its preallocated buffers)."""
        if self._batch is None:
            self._batch = KVBatch(self._room, self._allocated)
        self._batch.add([kv for _, kv, _ in joining])
        positions = torch.tensor([kv_length(kv) for _, kv, _ in joining], device=joining[0][2].device)
        logits = torch.cat([logits for _, _, logits in joining])
        rejected = torch.zeros_like(positions, dtype=torch.bool)
        self._positions = positions if self._positions is None else torch.cat([self._positions, positions])
        self._logits = logits if self._logits is None else torch.cat([self._logits, logits])
        self._rejected = rejected if self._rejected is None else torch.cat([self._rejected, rejected])
        self._rows += [request for request, _, _ in joining]
        if self.speculating:
            for request, _, _ in joining:
                self.drafts.add(request.text, request.cached - 1)
                request.alpha = self.acceptance.rate
