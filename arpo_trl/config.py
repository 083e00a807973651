"""`ARPOConfig`: TRL's `GRPOConfig` plus the knobs of ARPO's entropy-based adaptive rollout.

Defaults follow the authors' released scripts (docs/reference.md#defaults) where TRL has no default of its own:
N = M/2 global paths (M is TRL's `num_generations`, 8 by default, so N = 4; the paper's runs use M=16, N=8), Z=2,
τ=0.5, β=0.2, k=20 tokens, call limit 3; entropy is exact where the backend has logits (docs/differences.md). The
fields' checks are in `config_checks.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from arpo_trl.config_checks import check_arpo_config, resolve_engine_default
from arpo_trl.preflight import adopt_checkpointing_default
from arpo_trl.rollout import BRANCH_POLICIES, SCHEDULERS
from arpo_trl.rollout.tool_calls import TOOL_CALL_FORMATS
from arpo_trl.server.weight_sync import SYNC_MODES
from arpo_trl.training.advantages import ATTRIBUTIONS


@dataclass
class ARPOConfig(GRPOConfig):
    r"""
    Configuration for [`ARPOTrainer`]. Every [`~trl.GRPOConfig`] field applies; `num_generations` is the
    global rollout budget M (trajectories per prompt, global samples plus branches).
    """

    initial_rollouts: int | None = field(
        default=None,
        metadata={
            "help": "N: trajectory-level ('global') samples started per prompt; the remaining M-N of the "
            "`num_generations` budget is spent on branches. Defaults to `num_generations // 2` (M when "
            "`branch_policy='none'`). Must satisfy 1 <= N <= M."
        },
    )
    branch_factor: int = field(
        default=2,
        metadata={
            "help": "Z: paths leaving a fork, the source included, so a fork adds Z-1 copies (reference "
            "`beam_size`). Z=1 disables branching."
        },
    )
    branch_threshold: float = field(
        default=0.5,
        metadata={"help": "τ: base fork probability; a fork happens with P = clip(τ + β·ΔH, 0, 1). In [0, 1]."},
    )
    entropy_weight: float = field(
        default=0.2,
        metadata={"help": "β: weight of the normalised entropy change ΔH in the fork probability."},
    )
    entropy_window: int = field(
        default=20,
        metadata={"help": "k: number of tokens at the start of a segment whose entropy is measured (>= 1)."},
    )
    entropy_estimator: str = field(
        default="auto",
        metadata={
            "help": "Per-token entropy estimator (arpo_trl/entropy/estimators.py). 'exact': -Σ p·log p over the "
            "vocabulary (needs logits: the transformers backend). 'top_k_tail': from the top-k logprobs plus their "
            "tail mass 1-Σp spread evenly over the tokens not returned (the largest entropy consistent with them; "
            "monotone under flattening). 'top_k': the reference's Σ -p·log p over the top k, not renormalised, no "
            "tail (not monotone in the true entropy). 'auto': 'exact' on transformers, 'top_k_tail' on a vLLM server."
        },
    )
    entropy_top_k: int | None = field(
        default=None,
        metadata={
            "help": "k of the top-k estimators: logprobs requested per token from a vLLM server (its "
            "`--max-logprobs` must allow it). `None`: 20, vLLM's default `--max-logprobs`, the most a server "
            "started without that flag allows (the reference used 10); ignored by 'exact'."
        },
    )
    segment_entropy: str = field(
        default="mean",
        metadata={
            "help": "Segment statistic of the fork rule over its first k tokens, normalised by ln|V|. 'mean': k × "
            "the mean over the tokens generated (the reference's value for segments of k tokens or more; a shorter "
            "segment, e.g. a quick call, reads at its own tokens' level). 'sum': the reference's sum of the first k "
            "entropies, which reads a segment shorter than k as low entropy for its length alone."
        },
    )
    max_tool_calls: int = field(
        default=3,
        metadata={
            "help": "Tool calls executed per trajectory; the next call tag ends the trajectory with EOS "
            "(reference `call_limit`)."
        },
    )
    branch_policy: str = field(
        default="entropy",
        metadata={
            "help": "'entropy' (ARPO), 'random' (ablation: fork with probability τ, ΔH ignored), 'aepo' (AEPO's "
            "entropy-balanced rollout: entropy pre-monitoring sets the global samples, `pre_monitoring_beta`, and a "
            "path that forked at its last l tool results forks with P = clip(1 - τ/(1 - λ·l) + β·ΔH, 0, 1), "
            "`branch_penalty`; docs/aepo.md) or 'none' (trajectory-level sampling with N = M: the GRPO-with-tools "
            "baseline).",
            "choices": list(BRANCH_POLICIES),
        },
    )
    branch_penalty: float = field(
        default=0.05,
        metadata={
            "help": "λ of AEPO's branch penalty P̂(l) = λ·l (branch_policy='aepo'): l is the number of fork decisions "
            "in a row that forked on a path's line; the fork score (u + β·ΔH) is scaled by 1 - λ·l. 0.05 as the "
            "authors' code; 0 = no penalty."
        },
    )
    pre_monitoring_beta: float | None = field(
        default=0.5,
        metadata={
            "help": "β of AEPO's entropy pre-monitoring (branch_policy='aepo'): per prompt, one trajectory that does "
            "not fork is generated first, and m = floor(M·σ(β·(H_root - mean H_tool))) + 1 of the M are global samples "
            "(H_root: its first segment's entropy; mean H_tool: over all its segments); the rest are branches. 0.5 as "
            "the authors' code. None: N = `initial_rollouts` global samples, as the released AEPO scripts run it."
        },
    )
    entropy_balanced_clipping: bool = field(
        default=False,
        metadata={
            "help": "AEPO's stop-gradient clipping (any branch policy): a token with advantage > 0 whose ratio is "
            "above 1 + epsilon_high keeps its gradient, rescaled to (1 + epsilon_high)·A·∇log π, instead of PPO's "
            "zero; the loss value is unchanged. Needs a clipped loss_type (grpo, bnpo, dr_grpo, dapo, luspo), "
            "token-level importance sampling and beta=0. docs/aepo.md."
        },
    )
    entropy_advantage_weight: float = field(
        default=0.0,
        metadata={
            "help": "a of AEPO's entropy-aware advantage (any branch policy): each trained token's advantage is "
            "multiplied by 1 + a·(H_t - mean H)/std H, with H the policy's token entropy standardised over the "
            "trained tokens of the loss batch. 0 = off; 0.2 in the authors' code. docs/aepo.md."
        },
    )
    advantage_attribution: str = field(
        default="soft",
        metadata={
            "help": "'soft' (paper default): plain GRPO over the M trajectories, shared prefixes trained in "
            "every copy. 'hard': a token shared by d trajectories gets the mean advantage of those d and is "
            "trained once (token-sum loss types, or grpo/sapo with beta=0; no sequence-level ratio or mask: "
            "docs/reference.md#advantages).",
            "choices": list(ATTRIBUTIONS),
        },
    )
    tree_packing: bool = field(
        default=True,
        metadata={
            "help": "Forward each micro-batch tree-packed: the rows' shared token prefixes (a group's prompt, an ARPO "
            "tree's trunk and branches) are computed once, in the policy pass with its backward and in the old-logprob "
            "and reference passes, with the same log-probabilities and gradients as unpacked rows. Prompt groups are "
            "regrouped into whole micro-batches only inside one optimizer step and only where that changes no "
            "gradient (not with bnpo, an entropy bonus, top_entropy_quantile or entropy_advantage_weight). Falls "
            "back to unpacked rows, saying why, where a tree mask is not exact (architectures other than "
            "Llama/Qwen2/Qwen3/Mistral, sliding windows, length-dependent RoPE, PEFT prompt learning, attention other "
            "than sdpa/eager/flex_attention), and per chunk where packs would cost more than rows. "
            "docs/tree_packing.md.",
        },
    )
    tree_packing_max_length: int | None = field(
        default=4096,
        metadata={
            "help": "Most slots in one packed sequence (tree_packing): a micro-batch whose tree is larger is split "
            "into several packs, each repeating the ancestors it needs, so the L x L attention mask stays bounded. A "
            "row longer than this gets a pack of its own. None: one pack per micro-batch. With FlexAttention on a GPU "
            "a pack is padded to a multiple of 128 slots, so it can exceed this by up to 127.",
        },
    )
    log_trees: bool = field(
        default=True,
        metadata={
            "help": "Write every training rollout tree to `<output_dir>/trees.jsonl` (nodes, forks, ΔH, tool calls, "
            "rewards, advantages, per-token entropy), log a node table and a tree picture to wandb when it is "
            "active, and draw tree pictures and the entropy-around-tools plot into `<output_dir>/trees/` at the end "
            "of training (view them with `arpo-trl view`).",
        },
    )
    tool_call_format: str = field(
        default="auto",
        metadata={
            "help": "How the model calls tools. 'auto' (default): 'chat_template' when a tool is a plain function "
            "(as `GRPOTrainer(tools=[fn])` calls it), else 'tags'. 'tags' (the paper's): `<python>…</python>`, "
            "answered with ` <result>…</result>`. 'chat_template': the tokenizer's native function calling for "
            "instruct models (Hermes-style, as Qwen2.5/Qwen3): the prompt lists each tool's JSON schema "
            "(`Tool.schema()`) through the chat template, the model writes `<tool_call>{\"name\": …, "
            "\"arguments\": {…}}</tool_call>`, and the result is appended as the template renders a tool message. "
            "Needs conversational prompts and a template that renders `tools`.",
            "choices": list(TOOL_CALL_FORMATS),
        },
    )
    tool_call_open: str = field(
        default="<tool_call>",
        metadata={"help": "tool_call_format='chat_template': the marker that opens a call in the model's output."},
    )
    tool_call_close: str = field(
        default="</tool_call>",
        metadata={"help": "tool_call_format='chat_template': the marker that closes a call (generation stops there)."},
    )
    tool_timeout: float = field(
        default=30.0,
        metadata={
            "help": "Seconds the sampler waits for one tool call before inserting a timeout message "
            "(PythonTool also enforces its own, killing the process)."
        },
    )
    max_failed_tool_steps: int = field(
        default=10,
        metadata={"help": "Stop training when a tool has failed every one of its calls in this many training steps "
                  "in a row (its first error is raised; each such tool is also reported once, at its first such "
                  "step). 0: never stop."},
    )
    max_tool_workers: int = field(
        default=8,
        metadata={"help": "Tool calls run concurrently across paths in a thread pool of this size."},
    )
    rollout_scheduler: str = field(
        default="auto",
        metadata={
            "help": "How the rollout's requests are scheduled. 'events': every path advances on its own (its next "
            "request goes out as soon as its own tool result or fork decision is ready; vLLM server mode). 'waves': "
            "requests ready together are generated as one batch (deterministic for a seed). 'auto': events where the "
            "engine supports it (a vLLM server, the cached in-process engine), else waves.",
            "choices": list(SCHEDULERS),
        },
    )
    use_transformers_continuous_batching: bool | None = field(  # TRL's knob; its default False becomes None
        default=None,
        metadata={
            "help": "The in-process engine (without a vLLM server). True: the cached engine, event-driven with a "
            "prefix KV cache (docs/in_process_engine.md); False: the waves engine (left-padded model.generate per "
            "wave); None: the cached engine wherever it can run (not with sharded parameters over several processes, "
            "generation_kwargs it does not sample with, cache_implementation, or non-full-attention layers), else the "
            "waves engine. Trees are seed-reproducible under rollout_scheduler='waves' with either engine.",
        },
    )
    speculative_fill_ups: bool = field(
        default=True,
        metadata={
            "help": "Start fill-ups (the global paths that complete a prompt's M when forking falls short) before they "
            "are certain to be needed, as many as forking is expected not to fill; a fork takes their slot back and "
            "they are confirmed oldest first, so the trees are unchanged. Shortens the rollout's critical path for "
            "some discarded tokens. On the cached in-process engine, event-driven, they wait for the prompt's first "
            "fork decision (that engine drafts a late path's first segment from its siblings' text in a few steps), "
            "and so they do on colocated vLLM on a CPU, where every row costs compute and a dropped one is time lost. "
            "False: fill-ups start only once certain.",
        },
    )
    fill_up_hedge: float | None = field(
        default=0.9,
        metadata={
            "help": "With speculative_fill_ups: also start the fill-ups a prompt needs with this probability (a "
            "quantile of how many its forks will fail to fill), not only as many as expected, so that a prompt whose "
            "paths fork less than average does not start one hundreds of tokens late (the rollout's critical path). "
            "Costs the tokens of the extra ones that a fork then makes unnecessary (about 3 percent of a paper-like "
            "rollout's). None: the expected count only (cheaper on a compute-bound in-process engine).",
        },
    )
    speculative_branches: bool = field(
        default=False,
        metadata={
            "help": "Start an uncertain fork's Z-1 copies at the tool result, beside the probe whose entropy decides "
            "whether they are kept (dropped otherwise). False (default): they start once the probe keeps them, from "
            "the same state, so nothing is discarded, and that fork level's chain is k tokens longer. Either way a "
            "fork that is certain before the probe reads anything (its uniform draw below the P of zero entropy) "
            "starts at once, confirmed. The trees are the same in distribution; docs/in_process_engine.md measures "
            "both.",
        },
    )
    max_draft_tokens: int = field(
        default=8,
        metadata={
            "help": "Cached in-process engine: n-gram drafts per row and decode step, from the rollout's own text, "
            "verified so that tokens are sampled exactly as without them (docs/in_process_engine.md); fed only where "
            "they pay at the rows' own acceptance rates (few rows running, or late paths whose siblings' text is ahead "
            "of them). 0: off. Unused with a repetition penalty, the waves engine or a server.",
        },
    )
    max_minutes: float | None = field(
        default=None,
        metadata={
            "help": "Wall-clock budget of the training run, in minutes. Every run prints its first step's time and the "
            "expected total after step 1; with a budget it also says how many steps fit and stops after the last one "
            "that fits (the model is saved and the pictures drawn as at `max_steps`). None: run all `max_steps`."
        },
    )
    seed_sampler: int | None = field(
        default=None,
        metadata={"help": "Seed of the rollouts' keyed draws (forks; the cached engine's tokens); defaults to `seed` "
                          "plus the process index (docs/differences.md#seeds)."},
    )

    use_vllm: bool | None = field(
        default=None,
        metadata={
            "help": "Generate with vLLM. Unset: on one CUDA process with `vllm` importable, ARPO generates with vLLM "
            "colocated in the training process (one log line says so); otherwise with the in-process transformers "
            "engines (the CPU and test path). docs/one_gpu.md has the table.",
        },
    )
    vllm_mode: str | None = field(
        default=None,
        metadata={
            "help": "With use_vllm: 'colocate' (TRL's default: vLLM inside the training process, one device, synced "
            "before each rollout, asleep during training with `vllm_enable_sleep_mode`) or 'server' (a vLLM server "
            "at `vllm_server_base_url`, or `vllm_server_host` + `vllm_server_port`). Unset: 'server' when "
            "`vllm_server_base_url` is set, else 'colocate'.",
            "choices": ["colocate", "server"],
        },
    )
    vllm_weight_sync: str = field(
        default="auto",
        metadata={
            "help": "How the vLLM server (use_vllm=True, vllm_mode='server') gets the new weights each step: "
            "'lora' (save the adapter, hot-load it with /v1/load_lora_adapter; no NCCL), 'reload' (full weights "
            "saved and reloaded from disk via /collective_rpc; untied embeddings only), 'nccl' (TRL's CUDA "
            "transfer), 'none' (never), or 'auto' (lora with PEFT, else nccl on CUDA, else reload).",
            "choices": list(SYNC_MODES),
        },
    )
    vllm_sync_dir: str | None = field(
        default=None,
        metadata={
            "help": "Folder for the weight versions of 'lora'/'reload' sync; the server must see the same path. "
            "Defaults to `<output_dir>/vllm_sync`."
        },
    )
    vllm_request_timeout: float = field(
        default=600.0,
        metadata={"help": "Seconds one request to the vLLM server may take, its retries of transient faults included "
                          "(docs/server_mode.md#the-server-contract), before the rollout fails."},
    )
    vllm_max_concurrent_requests: int = field(
        default=64,
        metadata={"help": "Completion requests in flight at once (one per active path) in server mode."},
    )
    max_prompt_length: int | None = field(
        default=None,
        metadata={
            "help": "Longest prompt (tokens, chat template applied) `arpo-trl train` accepts: a dataset with a longer "
            "one is an error before training, never silently truncated. Default: the model's context length minus "
            "max_completion_length."
        },
    )
    reward_timeout: float = field(
        default=2.0,
        metadata={
            "help": "Seconds math-verify may spend on one answer in `arpo_math` / `accuracy` (its worker process is "
            "then killed and the answer scores 0; counted in `rewards/<reward>/timeouts`). See docs/rewards.md."
        },
    )
    reward_batch_timeout: float = field(
        default=8.0,
        metadata={"help": "Seconds one math reward call may take over all its answers; those left score 0."},
    )

    def __post_init__(self):
        adopt_checkpointing_default(self)
        resolve_engine_default(self)
        super().__post_init__()
        check_arpo_config(self)
