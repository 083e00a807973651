"""docs/coming_from_grpo.md lists every `GRPOConfig` field and `GRPOTrainer` argument of the installed TRL, each marked
works / works and branches / refused, and every refusal it lists fires with the message it gives."""

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
from tiny import tiny_model
from transformers import TrainingArguments
from trl import GRPOConfig, GRPOTrainer

from arpo_trl import ARPOConfig, ARPOTrainer
from arpo_trl.dropin.grpo_fields import REFUSED_FIELDS

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "coming_from_grpo.md").read_text(encoding="utf-8")
ROW = re.compile(r"^\| `(\w+)` \| (works and branches|works|refused) \|(.*)\|$", re.MULTILINE)
MARKS = {name: (status, note.strip()) for name, status, note in ROW.findall(PAGE)}
TRAINING_ARGUMENTS = [f.name for f in dataclasses.fields(TrainingArguments)]
GRPO_FIELDS = [f.name for f in dataclasses.fields(GRPOConfig) if f.name not in set(TRAINING_ARGUMENTS)]
GRPO_ARGUMENTS = [name for name in inspect.signature(GRPOTrainer.__init__).parameters if name != "self"]
TRIGGERS = {"max_tool_calling_iterations": 3, "vllm_structured_outputs_regex": "[0-9]+",
            "use_transformers_continuous_batching": True, "use_transformers_paged": True}


def test_every_grpo_field_and_argument_is_marked():
    assert not [name for name in GRPO_FIELDS + GRPO_ARGUMENTS if name not in MARKS]
    missing = [name for name in TRAINING_ARGUMENTS if f"`{name}`" not in PAGE.split("## `TrainingArguments` fields")[1]]
    assert not missing
    assert set(MARKS) == set(GRPO_FIELDS) | set(GRPO_ARGUMENTS)  # nothing listed that TRL does not have


def test_arpo_trainer_takes_every_grpo_trainer_argument():
    ours = inspect.signature(ARPOTrainer.__init__).parameters
    takes_rest = any(p.kind is p.VAR_KEYWORD for p in ours.values())
    assert all(name in ours or takes_rest for name in GRPO_ARGUMENTS)
    assert ours["reward_funcs"].default is None  # optional, as in TRL


@pytest.mark.parametrize("name", sorted(REFUSED_FIELDS))
def test_each_refused_field_is_refused_with_the_pages_reason(tmp_path, name):
    assert MARKS[name] == ("refused", REFUSED_FIELDS[name][1])
    assert set(TRIGGERS) == set(REFUSED_FIELDS)
    with pytest.raises(ValueError) as error:
        ARPOConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=8, **{name: TRIGGERS[name]})
    message = str(error.value)
    assert "\n" not in message and REFUSED_FIELDS[name][1] in message


def test_the_refused_argument_is_refused_with_the_pages_reason(tmp_path, tokenizer, addition_dataset):
    refused = [name for name in GRPO_ARGUMENTS if MARKS[name][0] == "refused"]
    assert refused == ["rollout_func"]
    with pytest.raises(ValueError, match=re.escape(MARKS["rollout_func"][1])):
        ARPOTrainer(model=tiny_model(tokenizer), reward_funcs=len,
                    args=ARPOConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=8),
                    train_dataset=addition_dataset, processing_class=tokenizer, rollout_func=lambda *a: None)
    refused_fields = {name for name in GRPO_FIELDS if MARKS[name][0] == "refused"}
    assert refused_fields == set(REFUSED_FIELDS)


def test_the_readme_links_the_page():
    assert "(docs/coming_from_grpo.md)" in (ROOT / "README.md").read_text(encoding="utf-8")
