"""How requests join the cached engine's running batch, each step before it samples.

A request whose prefix is a held row's text (`Request.held`: an ARPO probe, answered at its budget one step ago) takes
that row over. The others are looked up in the prefix cache, and what it does not hold is prefilled, the requests of
one step together (`prefill.py`); the engine then writes their rows into the batch (`RunningBatch.join`).
"""

from __future__ import annotations

import torch

from arpo_trl.generation.kv_budget import KVAccounting
from arpo_trl.generation.prefill import FORWARD_COST_TOKENS, PrefillJob, prefill
from arpo_trl.generation.prefix_cache import KV, CachedPrefix, PrefixCache, common_prefix_length, crop
from arpo_trl.generation.running_batch import Request, RunningBatch


class Admission:
    """The cached engine's admission of joining requests: handed its prefix cache, counters and KV accounting (which
    keeps the prefix cache within the budget), and at each step the running batch."""

    def __init__(self, prefix_cache: PrefixCache, counters, kv: KVAccounting):
        self.prefix_cache = prefix_cache
        self.counters = counters
        self.kv = kv

    def adopt(self, running: RunningBatch, joining: list[Request]) -> tuple[list[Request], list[int]]:
        """A request whose prefix is a held row's text (an ARPO probe's continuation: its k tokens were answered one
        step ago) takes that row over: its last token is fed and its next-token logits are at hand, so nothing is
        prefilled or copied. Returns the requests still to admit, and the held rows no request took (for the engine
        to release to the prefix cache)."""
        rows = running.requests
        held = {tuple(request.prefix + request.ids): row for row, request in enumerate(rows) if request.held}
        spans, rest = [request.span for request in rows if not request.held], []
        for request in joining:
            if (row := held.get(tuple(request.prefix))) is None or not self.kv.budget.fits(spans + [request.span]):
                rest.append(request)  # its row goes to the prefix cache if the KV budget cannot hold it grown
                continue
            del held[tuple(request.prefix)]
            spans.append(request.span)
            rows[row] = request
            self._count(len(request.prefix))
            self.counters.adopted_rows += 1
        return rest, sorted(held.values())

    def admit(self, model, requests: list[Request],
              forward_cost_tokens: float = FORWARD_COST_TOKENS) -> list[tuple[Request, KV, torch.Tensor]]:
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
            if saved < forward_cost_tokens:  # another round would cost more than it saves
                jobs.update((index, self._job(requests[index], entry, shared)) for index, entry, shared in later)
                later = []
            self._prefill(model, jobs, admitted, forward_cost_tokens)
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

    def _prefill(self, model, jobs: dict[int, PrefillJob], admitted: dict[int, tuple[KV, torch.Tensor]],
                 forward_cost_tokens: float) -> None:
        results, positions = prefill(model, list(jobs.values()), forward_cost_tokens)
        for (index, job), (kv, logits) in zip(jobs.items(), results):
            self.kv.keep(CachedPrefix(tuple(job.tokens), kv, logits))
            admitted[index] = kv, logits
            self._count(job.start)
        self.counters.prefill_tokens += sum(positions)  # padding included
        self.counters.prefill_forwards += len(positions)

    def _count(self, reused: int) -> None:
        self.counters.reused_tokens += reused
        self.counters.requests += 1
