"""Every TRL touch point of `arpo_trl.trainer` is where the TRL release `TRL_CHECKED` had it: the undocumented
`GRPOTrainer` state that `TRLState` reads and writes, and the private hooks `ARPOTrainer` overrides. A TRL upgrade
that moves one fails here, naming it, instead of silently breaking training (trees logged with another batch's
rewards, a vLLM server never synced, tool results trained on)."""

from __future__ import annotations

import inspect
import math
import warnings
from collections import deque

import pytest
import trl
from transformers import Trainer
from trl import GRPOTrainer
from trl.models.utils import unwrap_model_for_generation

from arpo_trl import ARPOConfig, ARPOTrainer
from arpo_trl.rewards import completion_text
from arpo_trl.trl_state import TRL_CHECKED, TRLState

M = 4  # num_generations
ROWS = 8  # completions per step: 2 prompts × M


def moved(touch_point: str, detail: str) -> str:
    return (f"TRL touch point `{touch_point}` moved (checked against TRL {TRL_CHECKED}, installed TRL "
            f"{trl.__version__}): {detail}. Update arpo_trl.trl_state.TRLState and this test.")


def check(ok: bool, touch_point: str, detail: str) -> None:
    if not ok:
        pytest.fail(moved(touch_point, detail), pytrace=False)


def parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


@pytest.mark.parametrize(("touch_point", "function", "expected"), [
    ("GRPOTrainer._tokenize_prompts", GRPOTrainer._tokenize_prompts, ["self", "prompts"]),
    ("GRPOTrainer._generate_and_score_completions", GRPOTrainer._generate_and_score_completions, ["self", "inputs"]),
    ("GRPOTrainer._generate", GRPOTrainer._generate, ["self", "prompts"]),
    ("GRPOTrainer._prepare_inputs", GRPOTrainer._prepare_inputs, ["self", "generation_batch"]),
    ("GRPOTrainer.training_step", GRPOTrainer.training_step, ["self", "model", "inputs", "num_items_in_batch"]),
    ("GRPOTrainer._compute_loss", GRPOTrainer._compute_loss, ["self", "model", "inputs"]),
    ("GRPOTrainer._calculate_rewards", GRPOTrainer._calculate_rewards,
     ["self", "inputs", "prompts", "completions", "completion_ids_list"]),
    ("Trainer._save_rng_state", Trainer._save_rng_state, ["self", "output_dir"]),
    ("Trainer._load_rng_state", Trainer._load_rng_state, ["self", "checkpoint"]),
])
def test_private_methods_keep_their_signatures(touch_point, function, expected):
    check(parameters(function) == expected, touch_point, f"parameters {parameters(function)}, expected {expected}")


def test_logps_hook_keeps_its_leading_parameters():
    """`EntropyBalancedUpdate` overrides it, passing every argument on; tests/test_aepo.py checks that TRL's loss reads
    the advantages after calling it."""
    leading = parameters(GRPOTrainer._get_per_token_logps_and_entropies)[:7]
    expected = ["self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy"]
    check(leading == expected, "GRPOTrainer._get_per_token_logps_and_entropies", f"parameters start {leading}")


def test_constructor_and_helper_keywords():
    check("rollout_func" in parameters(GRPOTrainer.__init__), "GRPOTrainer(rollout_func=)", "no rollout_func keyword")
    wanted = {"model", "accelerator", "gather_deepspeed3_params", "gradient_checkpointing_kwargs"}
    missing = wanted - set(parameters(unwrap_model_for_generation))
    check(not missing, "trl.models.utils.unwrap_model_for_generation", f"keywords {sorted(missing)} are gone")


def test_model_card_class_attributes():
    for name, kind in (("_tag_names", list), ("_name", str), ("_paper", dict)):
        check(isinstance(getattr(GRPOTrainer, name, None), kind), f"GRPOTrainer.{name}", f"not a {kind.__name__}")
    keys = set(GRPOTrainer._paper)
    check({"title", "id", "citation"} <= keys, "GRPOTrainer._paper", f"keys {sorted(keys)}")


def test_vllm_backend_is_built_from_args_use_vllm():
    """`TRLState.constructing` hides args.use_vllm from TRL's __init__; that only works while TRL builds its
    backend from args.use_vllm (building it needs `vllm`, not installed here, so the source is read)."""
    source = inspect.getsource(GRPOTrainer.__init__)
    check("self.use_vllm = args.use_vllm" in source, "GRPOTrainer.use_vllm", "no longer copied from args.use_vllm")
    check("self.vllm_generation = VLLMGeneration(" in source, "GRPOTrainer.vllm_generation",
          "__init__ no longer builds it")


def test_loss_mask_and_row_normalisation_are_trls():
    """`TRLState.loss_mask` rebuilds `_compute_loss`'s mask, and hard attribution's grpo/sapo scaling undoes exactly
    those losses' per-row division (source read: the lines it relies on)."""
    source = inspect.getsource(GRPOTrainer._compute_loss)
    check('mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]' in source,
          "GRPOTrainer._compute_loss", "its loss mask is no longer completion_mask * tool_mask")
    check('if self.loss_type in ["grpo", "sapo"]:\n            loss = ((per_token_loss * mask).sum(-1) / '
          'mask.sum(-1).clamp(min=1.0)).mean()' in source, "GRPOTrainer._compute_loss",
          "grpo/sapo no longer divide each row by its own mask.sum(-1)")


class SyncRecorder:
    """Stands in for the weight-sync object (`LoRAAdapterSync`...) TRL calls before each rollout."""

    def __init__(self, trainer):
        self.trainer, self.steps, self.last_seconds = trainer, [], None

    def sync_weights(self):
        self.steps.append(self.trainer.state.global_step)
        self.last_seconds = 0.25


class RecordingState(TRLState):
    """Keeps the (B,) group advantages TRL computed, before hard attribution spreads them over the tokens."""

    def advantages(self, output):
        self.group_advantages = super().advantages(output).clone()
        return self.group_advantages


class Recorder(ARPOTrainer):
    def _arpo_rollout(self, prompts, trainer=None):
        self.rollout_prompts = getattr(self, "rollout_prompts", []) + [list(prompts)]
        return super()._arpo_rollout(prompts, trainer)

    def _generate_and_score_completions(self, inputs):
        self.outputs = getattr(self, "outputs", []) + [super()._generate_and_score_completions(inputs)]
        return self.outputs[-1]


def length_reward(completions, **kwargs):
    return [len(completion_text(c)) / 10 for c in completions]


def unscored_first(completions, **kwargs):
    """None (unscored, NaN in TRL's logs) for the first completion of each batch."""
    return [None] + [1.0] * (len(completions) - 1)


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tokenizer, addition_dataset, tmp_path_factory):
    """Two steps with the undocumented state exercised the way server mode uses it: TRL's own vLLM backend off while
    TRL is built, then `use_vllm` on again and our sync object installed; hard attribution, so (B, T) advantages."""
    mp = pytest.MonkeyPatch()
    mp.delenv("TRL_EXPERIMENTAL_SILENCE", raising=False)  # ARPOTrainer must set it itself
    args = ARPOConfig(
        output_dir=str(tmp_path_factory.mktemp("touch")), per_device_train_batch_size=ROWS, num_generations=M,
        initial_rollouts=2, max_completion_length=16, max_steps=2, learning_rate=1e-3, logging_steps=1,
        use_cpu=True, bf16=False, report_to="none", save_strategy="no", seed=0, beta=0.0,
        advantage_attribution="hard", log_trees=True, reward_weights=[1.0, 0.5],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Recorder(model=str(tiny_model_dir), reward_funcs=[length_reward, unscored_first], args=args,
                           train_dataset=addition_dataset, processing_class=tokenizer)
    mp.undo()
    built = {"warnings": [str(w.message) for w in caught], "weight_sync": trainer._trl.weight_sync,
             "use_vllm": trainer.use_vllm, "tokenizer": trainer._trl.tokenizer}
    trainer._trl = RecordingState(trainer)
    trainer._trl.set_use_vllm(True)
    sync = SyncRecorder(trainer)
    trainer._trl.install_weight_sync(sync)
    trainer.train()
    return trainer, sync, built


def test_construction_touch_points(trained, tokenizer):
    trainer, _, built = trained
    check(not any("rollout_func" in w for w in built["warnings"]), "TRL_EXPERIMENTAL_SILENCE",
          f"TRL warned about rollout_func although ARPOTrainer set it: {built['warnings']}")
    check(built["weight_sync"] is None, "GRPOTrainer.vllm_generation", "TRL built one although it saw use_vllm=False")
    check(built["use_vllm"] is False, "GRPOTrainer.use_vllm", f"{built['use_vllm']!r} after __init__, expected False")
    check(built["tokenizer"] is tokenizer, "GRPOTrainer._tokenizer", "is not the processing_class tokenizer")
    check(trainer._trl.eos_token_ids == [tokenizer.eos_token_id], "GRPOTrainer.eos_token_ids",
          f"{trainer._trl.eos_token_ids}, expected [{tokenizer.eos_token_id}]")
    check((trainer._trl.group_size(True), trainer._trl.group_size(False)) == (M, M),
          "GRPOTrainer.num_generations / num_generations_eval", "not the args' group size")
    args = trainer.args
    for name in ("loss_type", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode"):
        check(getattr(trainer, name, object()) == getattr(args, name), f"GRPOTrainer.{name}", "not args' value")
    for name in ("is_deepspeed_enabled", "is_fsdp_enabled"):
        check(getattr(trainer, name, None) is False, f"Trainer.{name}", "not a bool set in __init__")
    trainer._trl.check_vespo_sampling_mode()  # reads those attributes; loss_type is not "vespo" here


def test_weight_sync_hook(trained):
    trainer, sync, _ = trained
    check(sync.steps == [0, 1], "GRPOTrainer.vllm_generation.sync_weights()",
          f"called at steps {sync.steps}, expected once before each step's rollout: [0, 1]")
    loaded = trainer._last_loaded_step
    check(loaded == 1, "GRPOTrainer._last_loaded_step", f"{loaded!r} after 2 steps, expected 1")
    logged = [e["arpo/weight_sync_seconds"] for e in trainer.state.log_history if "arpo/weight_sync_seconds" in e]
    check(logged == [0.25, 0.25], "GRPOTrainer._metrics", f"arpo/weight_sync_seconds logged as {logged}")


def test_rollout_func_gets_each_prompt_m_times_in_a_row(trained, tokenizer):
    trainer, _, _ = trained
    for prompts in trainer.rollout_prompts:
        distinct = trainer._trl.distinct_prompts(prompts, M)
        check(prompts == [p for p in distinct for _ in range(M)] and len(distinct) == ROWS // M,
              "rollout_func(prompts, trainer)", f"prompts are not {ROWS // M} prompts repeated {M} times in a row")
        ids = trainer._trl.tokenize_prompts(distinct)
        text = tokenizer.decode(ids[0])
        check(distinct[0][-1]["content"] in text and text.endswith("<|im_start|>assistant\n"),
              "GRPOTrainer._tokenize_prompts", f"prompt_ids decode to {text!r}, not the chat-templated prompt")


def test_scored_batch_and_logs(trained):
    trainer, _, _ = trained
    output = trainer.outputs[-1]
    rows, width = trainer._trl.completion_shape(output)
    advantages = TRLState.advantages(output)  # after hard attribution (RecordingState keeps the ones before)
    check(rows == ROWS and advantages.shape == (ROWS, width), "_generate_and_score_completions output",
          f"completion_ids {tuple(output['completion_ids'].shape)}, advantages {tuple(advantages.shape)}")
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    check(len(losses) == 2 and all(math.isfinite(loss) for loss in losses), "GRPOTrainer._compute_loss",
          f"losses {losses} from (B, T) advantages")
    logs = trainer._logs
    check(isinstance(logs["advantages"], deque) and len(logs["advantages"]) == ROWS, "GRPOTrainer._logs['advantages']",
          f"{type(logs['advantages']).__name__} of {len(logs['advantages'])}, expected a deque of {ROWS}")
    group = trainer._trl.group_advantages
    check(group.shape == (ROWS,), "_generate_and_score_completions output['advantages']",
          f"shape {tuple(group.shape)}, expected ({ROWS},) before hard attribution")
    check(trainer._trl.logged_advantages(ROWS) == pytest.approx(group.tolist(), abs=1e-6),
          "GRPOTrainer._logs['advantages']", "not this step's per-sample advantages in row order")
    names = trainer.reward_func_names
    check(names == ["length_reward", "unscored_first"] and trainer.reward_weights.tolist() == [1.0, 0.5],
          "GRPOTrainer.reward_func_names / reward_weights", f"{names}, {trainer.reward_weights}")
    check(all(len(logs["rewards"][name]) == ROWS for name in names), "GRPOTrainer._logs['rewards']",
          "not a deque of this step's per-sample rewards per reward function")
    rewards = trainer._trl.logged_rewards(ROWS)
    last = [e for e in trainer.state.log_history if "reward" in e][-1]
    check(sum(rewards) / ROWS == pytest.approx(last["reward"], abs=1e-5), "GRPOTrainer._logs['rewards']",
          f"weighted rewards average {sum(rewards) / ROWS}, TRL logged reward {last['reward']}")
    check(any("arpo/forks_per_group" in e for e in trainer.state.log_history), "GRPOTrainer._metrics",
          "metrics appended to _metrics['train'] were not logged")
