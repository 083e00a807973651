"""Cold-start SFT: transcripts are in ARPO's format with results the real Python tool printed, and `arpo-trl sft`
trains a (tiny) model with LoRA and saves a merged full model that `arpo-trl train` can load."""

import pytest
from transformers import AutoModelForCausalLM

from arpo_trl.cli import main
from arpo_trl.commands.sft import tool_transcripts
from arpo_trl.data import SHORT_PYTHON_SYSTEM_PROMPT
from arpo_trl.rewards import arpo_math_reward, validate_format


@pytest.mark.parametrize("task", ["arithmetic", "basic_arithmetic", "chain_sum"])
def test_transcripts_are_well_formed_and_correct(task):
    data = tool_transcripts(task, size=32, seed=3, system_prompt=SHORT_PYTHON_SYSTEM_PROMPT)
    assert len(data) == 32 and data[0]["prompt"][0] == {"role": "system", "content": SHORT_PYTHON_SYSTEM_PROMPT}
    texts = [row["completion"][0]["content"] for row in data]
    assert all(validate_format(text) is None for text in texts)
    # ARPO's own reward scores every transcript as correct: the boxed answer is the ground truth
    assert arpo_math_reward(data["completion"], ground_truth=data["ground_truth"]) == [1.0] * 32
    for text, truth in zip(texts, data["ground_truth"]):  # the result block is what Python printed
        printed = text.split("<result>\n")[1].split("\n</result>")[0]
        assert float(printed) == pytest.approx(float(truth), rel=1e-9, abs=1e-6)


def test_task_without_expression_is_refused():
    with pytest.raises(ValueError, match="task: reasoning-gym task 'leg_counting' has no `expression` in its "
                                         "metadata; use 'arithmetic' or one of"):
        tool_transcripts("leg_counting", size=2)
    with pytest.raises(ValueError, match="task_config: the arithmetic task has no option 'max_termz'"):
        tool_transcripts("arithmetic", size=2, task_config={"max_termz": 2})


def test_sft_command_saves_a_merged_model(tiny_model_dir, tmp_path):
    out = tmp_path / "sft"
    main(["sft", "--model_name_or_path", str(tiny_model_dir), "--num_examples", "16", "--max_steps", "2",
          "--per_device_train_batch_size", "4", "--use_peft", "--lora_r", "4", "--lora_target_modules", "q_proj",
          "v_proj", "--use_cpu", "true", "--bf16", "false", "--report_to", "none", "--save_strategy", "no",
          "--output_dir", str(out), "--system_prompt", "python_short"])
    assert (out / "model.safetensors").is_file() and not (out / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    changed = [name for name, p in merged.state_dict().items() if not p.equal(base.state_dict()[name])]
    assert changed and all("q_proj" in n or "v_proj" in n for n in changed)  # LoRA merged into its targets only


def test_sft_user_mistake_is_one_line(tmp_path, capsys, monkeypatch):
    """The same on a new machine (an empty model cache) as on one that has converted SmolLM2 before."""
    monkeypatch.setenv("ARPO_TRL_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(SystemExit) as exit_code:
        main(["sft", "--model_name_or_path", "smollm2", "--task", "leg_counting", "--output_dir", str(tmp_path / "out"),
              "--use_cpu", "true", "--bf16", "false"])  # no CPU notice: alone, this test's stderr is the error only
    assert exit_code.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("arpo-trl: error:"), err
    assert not (tmp_path / "empty-cache").exists() or not any((tmp_path / "empty-cache").iterdir())
