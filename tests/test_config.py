"""ARPOConfig defaults and validation."""

import pytest

from arpo_trl import ARPOConfig


def _config(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=8, use_cpu=True, bf16=False,
                report_to="none")
    base.update(kw)
    return ARPOConfig(**base)


def test_defaults_follow_the_reference(tmp_path):
    config = _config(tmp_path)
    assert config.initial_rollouts == 4
    assert (config.branch_factor, config.branch_threshold, config.entropy_weight) == (2, 0.5, 0.2)
    assert (config.entropy_window, config.entropy_top_k, config.max_tool_calls) == (20, None, 3)
    assert (config.entropy_estimator, config.segment_entropy) == ("auto", "mean")
    assert (config.branch_policy, config.advantage_attribution) == ("entropy", "soft")
    assert _config(tmp_path, branch_policy="none").initial_rollouts == 8
    assert (config.vllm_mode, config.vllm_weight_sync) == ("colocate", "auto")  # TRL's default mode


@pytest.mark.parametrize("kw,field", [
    ({"initial_rollouts": 9}, "initial_rollouts"),
    ({"initial_rollouts": 0}, "initial_rollouts"),
    ({"branch_factor": 0}, "branch_factor"),
    ({"entropy_window": 0}, "entropy_window"),
    ({"branch_threshold": 1.5}, "branch_threshold"),
    ({"branch_threshold": -0.1}, "branch_threshold"),
    ({"entropy_weight": float("nan")}, r"entropy_weight \(β\) must be a finite number"),
    ({"entropy_weight": float("inf")}, "entropy_weight"),
    ({"branch_policy": "greedy"}, "branch_policy"),
    ({"advantage_attribution": "medium"}, "advantage_attribution"),
    ({"entropy_top_k": 0}, "entropy_top_k"),
    ({"branch_policy": "none", "initial_rollouts": 4}, "initial_rollouts"),
    ({"per_device_train_batch_size": 4, "steps_per_generation": 1}, "num_generations"),
    ({"vllm_weight_sync": "rsync"}, "vllm_weight_sync"),
    ({"vllm_request_timeout": 0}, "vllm_request_timeout"),
    ({"vllm_max_concurrent_requests": 0}, "vllm_max_concurrent_requests"),
    ({"use_vllm": True, "vllm_mode": "remote"}, "vllm_mode"),
    ({"use_vllm": True, "entropy_estimator": "exact"}, "entropy_estimator"),
    ({"entropy_estimator": "top10"}, "entropy_estimator"),
    ({"segment_entropy": "max"}, "segment_entropy"),
    ({"rollout_speculation": "always"}, "rollout_speculation"),
    ({"rollout_speculation": "branches"}, "rollout_speculation 'branches' was removed; write 'auto'"),
])
def test_invalid_values_name_the_field(tmp_path, kw, field):
    with pytest.raises(ValueError, match=field):
        _config(tmp_path, **kw)


def test_max_failed_tool_steps_must_not_be_negative(tmp_path):
    with pytest.raises(ValueError, match=r"max_failed_tool_steps must be >= 0 steps \(0: never stop\), got -1"):
        ARPOConfig(output_dir=str(tmp_path), max_failed_tool_steps=-1, report_to="none", use_cpu=True, bf16=False)


@pytest.mark.parametrize("field, value, replacement", [
    ("speculative_fill_ups", "false", "rollout_speculation: auto"), ("fill_up_hedge", "0.5", "rollout_speculation"),
    ("speculative_branches", "true", "rollout_speculation: auto"),
])
def test_a_removed_field_is_refused_in_one_line_saying_what_to_write(tmp_path, capsys, field, value, replacement):
    """In a recipe or as a flag, through `arpo-trl train`: the field, that it was removed and what replaces it."""
    from arpo_trl.cli import main

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"output_dir: {tmp_path / 'run'}\n{field}: {value}\n")
    for argv in (["train", "--config", str(recipe)], ["train", "--output_dir", str(tmp_path), f"--{field}", value]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert exit_info.value.code != 0 and f"{field} was removed; write {replacement}" in error


def test_every_field_arpo_adds_has_a_two_line_help_and_a_row_in_the_docs():
    """Help strings stay short (the measurement or the long story goes to docs/configuration.md), and the docs name
    every field a user can set beyond GRPOConfig's."""
    import dataclasses
    from pathlib import Path

    from trl import GRPOConfig

    inherited = {f.name for f in dataclasses.fields(GRPOConfig)}
    own = [f for f in dataclasses.fields(ARPOConfig) if f.name not in inherited]
    docs = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text()
    assert [f.name for f in own if len(f.metadata["help"]) > 230] == []
    assert [f.name for f in own if f"`{f.name}`" not in docs] == []


def test_arpo_fields_sit_in_one_section_in_code_docstring_and_docs_alike():
    """`ARPOConfig`'s own fields are grouped in sections: a `# ---- <title>` comment in the class body, a `> <title>:`
    line of the docstring, a `### <title>` table in docs/configuration.md. Each field is in exactly one section, the
    same one in all three, and the class lists them in the docstring's order."""
    import inspect
    import re
    from pathlib import Path

    own = list(ARPOConfig.__annotations__)  # the fields its body declares (use_vllm and vllm_mode are GRPOConfig's too)
    doc = re.sub(r"\s+", " ", ARPOConfig.__doc__)
    docstring = {title: re.findall(r"`([a-z_]+)`", names)
                 for title, names in re.findall(r"> ([^:>]+): ((?:`[a-z_]+`(?:, )?)+)\.", doc)}
    source, code, title = inspect.getsource(ARPOConfig), {}, None
    for line in source.splitlines():
        if heading := re.match(r"    # ---- (.+?) -+$", line):
            title = heading.group(1)
            code[title] = []
        elif field_line := re.match(r"    ([a-z_]+): .*= field\(", line):
            code[title].append(field_line.group(1))
    docs = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text()
    tables = {heading: {name for row in body.splitlines() if row.startswith("| `")
                        for name in re.findall(r"`([a-z_]+)`", row.split("|")[1])}
              for heading, body in re.findall(r"^### (.+?)\n(.*?)(?=^#|\Z)", docs, re.M | re.S)}
    assert list(docstring) == list(code) and docstring == code, (docstring, code)
    assert sorted(name for names in code.values() for name in names) == sorted(own)
    assert [name for names in code.values() for name in names] == own  # the class in the docstring's order
    for title, names in code.items():
        assert set(names) <= tables.get(title, set()), (title, set(names) - tables.get(title, set()))
