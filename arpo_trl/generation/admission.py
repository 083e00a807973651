"""How requests join the cached engine's running batch: looked up in the prefix cache, then prefilled.

Two ways, both prefilling only what the prefix cache does not hold:

* **In the step's forward** (the default, `one_forward_per_step`): a request whose whole prefix is cached with its
  logits (a fork's, a prompt's second sample) joins at once; the others' new tokens ride in the decode forward of the
  running rows (`ragged.py`), and they join with the logits it gives. A request whose prefix another request of the
  step extends further than the cache does (its twin, or a longer shared prefix) waits a step, and then finds that
  request's prefill in the cache: one more step for it, no forward.
* **In forwards of their own** (`prefill.py`), before the decode forward: grouped by length, in rounds where waiting
  for another's prefill pays.
"""

from __future__ import annotations

import torch

from arpo_trl.generation.kv_batch import KVBatch
from arpo_trl.generation.prefill import FORWARD_COST_TOKENS, PrefillJob, prefill
from arpo_trl.generation.prefix_cache import KV, CachedPrefix, common_prefix_length, crop

Joined = tuple  # (request, KV of its prefix, next-token logits [1, vocab])


class Admission:
    """Mixed into `CachedTransformersEngine`, whose prefix cache, batch state and counters it uses."""

    def _plan(self, requests: list) -> tuple[list[Joined], list[tuple], list]:
        """For a step whose forward prefills: the requests that join now (cached with logits), the prefill jobs
        (request, `PrefillJob`) for the forward, and the requests that wait a step for a job's prefill."""
        ready, jobs, waiting = [], [], []
        for request in requests:
            entry, shared = self.prefix_cache.lookup(request.prefix)
            request.cached = shared
            if shared == len(request.prefix) and (logits := entry.logits_after(shared)) is not None:
                ready.append((request, crop(entry.kv, shared), logits))
                self._count(shared)
            elif max((common_prefix_length(job.tokens, request.prefix) for _, job in jobs), default=0) > shared:
                waiting.append(request)
            else:
                jobs.append((request, self._job(request, entry, shared)))
        return ready, jobs, waiting

    def _admit(self, model, requests: list) -> list[Joined]:
        """Prefill what the cache does not hold in forwards of their own, all joining requests together; returns
        their rows, in order.

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
            if saved < FORWARD_COST_TOKENS:  # another round would cost more than it saves
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
    def _job(request, entry: CachedPrefix | None, shared: int) -> PrefillJob:
        shared = min(shared, len(request.prefix) - 1)  # at least one token is run, for the next-token logits
        return PrefillJob(request.prefix, crop(entry.kv, shared) if entry and shared else None, shared)

    def _prefill(self, model, jobs: dict[int, PrefillJob], requests: list,
                 admitted: dict[int, tuple[KV, torch.Tensor]]) -> None:
        results, positions = prefill(model, list(jobs.values()))
        for (index, job), (kv, logits) in zip(jobs.items(), results):
            self.prefix_cache.store(CachedPrefix(tuple(job.tokens), kv, logits))
            admitted[index] = kv, logits
            self._count(job.start)
        self.counters.prefill_tokens += sum(positions)  # padding included
        self.counters.prefill_forwards += len(positions)

    def _count(self, reused: int) -> None:
        self.counters.reused_tokens += reused
        self.counters.requests += 1

    def _join(self, joining: list[Joined]) -> None:
        """Add the admitted rows to the batch (written into its preallocated buffers)."""
        if self._batch is None:
            self._batch = KVBatch()
        self._batch.add([kv for _, kv, _ in joining])
        self._extend(joining)

    def _join_prefilled(self, jobs: list[tuple], logits: torch.Tensor) -> None:
        """After a forward that prefilled `jobs` into the batch's last rows: their entries in the prefix cache (a fork
        of one of them prefills nothing), and their rows with the logits [jobs, vocab] it gave."""
        first = self._batch.rows - len(jobs)
        joined = []
        for index, (request, job) in enumerate(jobs):
            kv, row_logits = self._batch.row(first + index), logits[index: index + 1]
            self.prefix_cache.store(CachedPrefix(tuple(job.tokens), kv, row_logits))
            self._count(job.start)
            joined.append((request, kv, row_logits))
        self.counters.prefill_tokens += sum(job.new for _, job in jobs)
        self.counters.prefill_forwards += 1
        self._extend(joined)

    def _extend(self, joining: list[Joined]) -> None:
        """The rows' bookkeeping, once their KV is in the batch's last rows."""
        positions = torch.tensor([kv[0][0].shape[2] for _, kv, _ in joining], device=joining[0][2].device)
        logits = torch.cat([logits for _, _, logits in joining])
        excluded = torch.full_like(positions, -1)
        self._positions = positions if self._positions is None else torch.cat([self._positions, positions])
        self._logits = logits if self._logits is None else torch.cat([self._logits, logits])
        self._excluded = excluded if self._excluded is None else torch.cat([self._excluded, excluded])
        self._rows += [request for request, _, _ in joining]
        if self.speculating:
            for request, _, _ in joining:
                self.drafts.add(request.text, request.cached - 1)
                request.alpha = self.acceptance.rate


def empty_kv(model) -> KV:
    """A KV of no positions in the model's cache layout, for a request that nothing in the prefix cache begins."""
    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    parameter = next(model.parameters())
    empty = parameter.new_empty((1, heads, 0, head_dim))
    return [(empty, empty) for _ in range(config.num_hidden_layers)]
