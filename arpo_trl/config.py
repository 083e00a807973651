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
from arpo_trl.generation.support import IN_PROCESS_ENGINES
from arpo_trl.preflight import adopt_checkpointing_default
from arpo_trl.rollout.tool_calls import TOOL_CALL_FORMATS
from arpo_trl.runtime import SCHEDULERS, SPECULATION_MODES
from arpo_trl.server.weight_sync import SYNC_MODES
from arpo_trl.training.advantages import ATTRIBUTIONS


@dataclass
class ARPOConfig(GRPOConfig):
    r"""
    Configuration for [`ARPOTrainer`]. Every [`~trl.GRPOConfig`] field applies; `num_generations` is the
    global rollout budget M (trajectories per prompt, global samples plus branches). ARPO's own fields, by section
    (in this order below, and in docs/configuration.md):

    > The rollout rule (paper §3.1): `initial_rollouts`, `branch_factor`, `branch_threshold`, `entropy_weight`,
      `entropy_window`, `entropy_estimator`, `entropy_top_k`, `segment_entropy`, `max_tool_calls`, `branch_policy`,
      `seed_sampler`.
    > AEPO (docs/aepo.md): `branch_penalty`, `pre_monitoring_beta`, `entropy_balanced_clipping`,
      `entropy_advantage_weight`.
    > Attribution, rewards and training: `advantage_attribution`, `tree_packing`, `tree_packing_max_length`,
      `reward_timeout`, `reward_batch_timeout`, `max_prompt_length`.
    > Engines and the runtime: `in_process_engine`, `rollout_scheduler`, `rollout_speculation`.
    > vLLM: `use_vllm`, `vllm_mode`, `vllm_weight_sync`, `vllm_sync_dir`, `vllm_request_timeout`,
      `vllm_max_concurrent_requests`.
    > Tools: `tool_call_format`, `tool_call_open`, `tool_call_close`, `tool_timeout`, `max_failed_tool_steps`,
      `max_tool_workers`.
    > Logging and the run: `log_trees`, `max_minutes`.
    """

    # ---- The rollout rule (paper §3.1) -------------------------------------------------------------------------------
    initial_rollouts: int | None = field(
        default=None,
        metadata={
            "help": "N, the global samples started per prompt (1 <= N <= M); the other M-N of `num_generations` go to "
            "branches. Default: M // 2 (M when branch_policy='none')."
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
        metadata={"help": "β: weight of the normalised entropy change ΔH in the fork probability (a finite number)."},
    )
    entropy_window: int = field(
        default=20,
        metadata={"help": "k: number of tokens at the start of a segment whose entropy is measured (>= 1)."},
    )
    entropy_estimator: str = field(
        default="auto",
        metadata={
            "help": "Per-token entropy: 'exact' (logits), 'top_k_tail' (top-k logprobs and their tail), 'top_k' (the "
            "reference's) or 'auto' (exact in process, top_k_tail on vLLM). docs/configuration.md."},
    )
    entropy_top_k: int | None = field(
        default=None,
        metadata={
            "help": "k of the top-k estimators: logprobs asked of vLLM per token (within its --max-logprobs). None: "
            "20, vLLM's default limit (the reference used 10); unused by 'exact'."},
    )
    segment_entropy: str = field(
        default="mean",
        metadata={
            "help": "The fork rule's statistic over a segment's first k tokens, / ln|V|: 'mean' (k × their mean; a "
            "short segment reads at its own level) or 'sum' (the reference's). docs/configuration.md."},
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
            "help": "'entropy' (ARPO), 'random' (p = τ, the ablation), 'aepo' (docs/aepo.md), 'none' (GRPO with "
            "tools), or your own fork policy as 'module:function' (docs/fork_policies.md).",
        },
    )
    seed_sampler: int | None = field(
        default=None,
        metadata={"help": "Seed of the rollouts' keyed draws (forks; the cached engine's tokens); defaults to `seed` "
                          "plus the process index (docs/differences.md#seeds)."},
    )

    # ---- AEPO (docs/aepo.md) -----------------------------------------------------------------------------------------
    branch_penalty: float = field(
        default=0.05,
        metadata={
            "help": "AEPO's λ (branch_policy='aepo'): the fork score u + β·ΔH is scaled by 1 - λ·l, l the forks in a "
            "row on the path's line; 0.05 as the authors' code, 0: no penalty."
        },
    )
    pre_monitoring_beta: float | None = field(
        default=0.5,
        metadata={
            "help": "AEPO (branch_policy='aepo'): β of the pre-monitoring, m = floor(M·σ(β·(H_root − mean H_tool))) "
            "+ 1 global samples; 0.5 as the authors' code. None: N global samples. docs/aepo.md."},
    )
    entropy_balanced_clipping: bool = field(
        default=False,
        metadata={
            "help": "AEPO's stop-gradient clipping (any policy): a token with A > 0 clipped above 1 + epsilon_high "
            "keeps a (1 + epsilon_high)-scaled gradient. Needs a clipped loss, token ratios, beta=0. docs/aepo.md."},
    )
    entropy_advantage_weight: float = field(
        default=0.0,
        metadata={
            "help": "a of AEPO's entropy-aware advantage (any policy): A·(1 + a·standardised token entropy) over the "
            "batch's trained tokens. 0: off; 0.2 in the authors' code. docs/aepo.md."},
    )

    # ---- Attribution, rewards and training ---------------------------------------------------------------------------
    advantage_attribution: str = field(
        default="soft",
        metadata={
            "help": "'soft' (the paper's): plain GRPO over the M, shared prefixes trained in every copy. 'hard': a "
            "shared token gets the mean advantage of the trajectories that contain it, trained once.",
            "choices": list(ATTRIBUTIONS),
        },
    )
    tree_packing: bool = field(
        default=True,
        metadata={
            "help": "Forward shared prefixes once (a tree attention mask): the same log-probs and gradients as "
            "unpacked rows; falls back, saying why, where not exact. docs/tree_packing.md.",
        },
    )
    tree_packing_max_length: int | None = field(
        default=4096,
        metadata={
            "help": "Most slots in one pack (tree_packing): a larger micro-batch tree is split into packs that "
            "repeat the ancestors they need. None: one pack per micro-batch. docs/tree_packing.md.",
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
    max_prompt_length: int | None = field(
        default=None,
        metadata={
            "help": "Longest prompt in tokens (chat template applied); a longer one is an error before training, never "
            "truncated. Default: the model's context length minus max_completion_length."
        },
    )

    # ---- Engines and the runtime -------------------------------------------------------------------------------------
    in_process_engine: str = field(
        default="auto",
        metadata={
            "help": "The engine without vLLM: 'cached' (event-driven, prefix KV cache), 'waves' (left-padded "
            "model.generate per wave) or 'auto' (cached wherever it can run, else waves; docs/in_process_engine.md).",
            "choices": list(IN_PROCESS_ENGINES),
        },
    )
    rollout_scheduler: str = field(
        default="auto",
        metadata={
            "help": "'events' (each path sends its next request when its own tool result is ready), 'waves' (ready "
            "requests batched together) or 'auto' (events where the engine can).",
            "choices": list(SCHEDULERS),
        },
    )
    rollout_speculation: str = field(
        default="auto",
        metadata={
            "help": "'auto': the event scheduler runs likely fill-ups ahead of the rule, trees unchanged; 'off': none. "
            "docs/architecture.md.",
            "choices": list(SPECULATION_MODES),
        },
    )

    # ---- vLLM --------------------------------------------------------------------------------------------------------
    use_vllm: bool | None = field(
        default=None,
        metadata={
            "help": "Generate with vLLM. Unset: colocated vLLM on one CUDA process with `vllm` importable (logged), "
            "else the in-process transformers engines (CPU, tests). docs/one_gpu.md.",
        },
    )
    vllm_mode: str | None = field(
        default=None,
        metadata={
            "help": "With use_vllm: 'colocate' (vLLM in the training process, synced before each rollout) or 'server' "
            "(at vllm_server_base_url or host:port). Unset: 'server' if vllm_server_base_url is set, else 'colocate'.",
            "choices": ["colocate", "server"],
        },
    )
    vllm_weight_sync: str = field(
        default="auto",
        metadata={
            "help": "How a vLLM server gets new weights each step: 'lora' (hot-load the adapter), 'reload' (from "
            "disk), 'nccl' (TRL's), 'none', or 'auto' (lora with PEFT, else nccl on CUDA, else reload).",
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

    # ---- Tools -------------------------------------------------------------------------------------------------------
    tool_call_format: str = field(
        default="auto",
        metadata={
            "help": "'tags' (the paper's `<python>…</python>`), 'chat_template' (the tokenizer's native function "
            "calling; needs conversational prompts) or 'auto' (chat_template for plain-function tools, else tags).",
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
        metadata={"help": "Stop (raising a tool's first error) when it failed every call in this many training "
                  "steps in a row; each such tool is reported at its first such step. 0: never stop."},
    )
    max_tool_workers: int = field(
        default=8,
        metadata={"help": "Tool calls run concurrently across paths in a thread pool of this size."},
    )

    # ---- Logging and the run -----------------------------------------------------------------------------------------
    log_trees: bool = field(
        default=True,
        metadata={
            "help": "Write every rollout tree to <output_dir>/trees.jsonl, log them to wandb when active, and draw "
            "tree pictures and the entropy-around-tools plot at the end (`arpo-trl view`).",
        },
    )
    max_minutes: float | None = field(
        default=None,
        metadata={
            "help": "Wall-clock budget in minutes: after step 1 the run says how many steps fit and stops after the "
            "last that fits (saved as at max_steps). None: all max_steps."},
    )

    def __post_init__(self):
        adopt_checkpointing_default(self)
        resolve_engine_default(self)
        super().__post_init__()
        check_arpo_config(self)
