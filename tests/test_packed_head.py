"""`generation.cpu.packed_head`: while an engine holds the model on the CPU, the LM head multiplies with a
weight packed once (oneDNN); the same product as `F.linear`, the model's own forward afterwards, the packed
copy gone."""

import gc

import pytest
import torch
from peft import LoraConfig, get_peft_model

from arpo_trl.generation import CachedTransformersEngine
from arpo_trl.generation.cpu.packed_head import packable_head, packed_head
from arpo_trl.generation.engine import SamplingSettings
from arpo_trl.generation.model_context import model_for_generation
from arpo_trl.generation.transformers_engine import TransformersEngine
from tests.tiny import tiny_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")


@pytest.fixture
def model(tokenizer):
    return tiny_model(tokenizer, tie=False).eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _mkldnn_tensors() -> int:
    return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor) and obj.is_mkldnn)


def test_the_packed_head_computes_the_same_logits_and_is_gone_afterwards(model):
    ids = torch.randint(0, model.config.vocab_size, (3, 7))
    expected = _logits(model, ids)
    head = model.get_output_embeddings()
    before = _mkldnn_tensors()
    with packed_head(model) as packed:
        assert packed and "forward" in vars(head)
        torch.testing.assert_close(_logits(model, ids), expected, atol=1e-5, rtol=1e-5)
        hidden = torch.randn(5, 4, model.config.hidden_size)[:, 1:3]  # not contiguous
        torch.testing.assert_close(head(hidden), torch.nn.functional.linear(hidden, head.weight), atol=1e-5, rtol=1e-5)
        assert _mkldnn_tensors() == before + 1
    assert "forward" not in vars(head)
    gc.collect()
    assert _mkldnn_tensors() == before


def test_a_weight_changed_between_holds_is_seen(model):
    ids = torch.randint(0, model.config.vocab_size, (2, 5))
    with packed_head(model):
        _logits(model, ids)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(-2.0)
    with packed_head(model):
        torch.testing.assert_close(_logits(model, ids), model(input_ids=ids).logits.detach(), atol=1e-5, rtol=1e-5)


def test_autograd_and_other_dtypes_go_to_the_plain_product(model):
    ids = torch.randint(0, model.config.vocab_size, (2, 5))
    model.zero_grad()
    model(input_ids=ids).logits.square().mean().backward()
    expected = model.get_output_embeddings().weight.grad.clone()
    model.zero_grad()
    with packed_head(model):
        model(input_ids=ids).logits.square().mean().backward()
        head = model.get_output_embeddings()
        with pytest.raises(RuntimeError, match="same dtype"):  # as F.linear says, not a silent cast
            head(torch.ones(2, model.config.hidden_size, dtype=torch.float64))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            assert head(torch.ones(2, model.config.hidden_size)).dtype == torch.bfloat16
    torch.testing.assert_close(head.weight.grad, expected)


def test_what_is_not_packed(model, tokenizer):
    assert packable_head(model.double()) is None  # float64: the exactness tests' dtype
    model = model.float()
    model.get_output_embeddings().forward = lambda x: x  # e.g. accelerate's offloading hook
    with packed_head(model) as packed:
        assert not packed
    assert packable_head(object()) is None
    head = model.get_output_embeddings()
    del head.forward
    head.weight.ds_id = 7  # a ZeRO-3 parameter: its hooks gather it at each forward
    assert packable_head(model) is None
    del head.weight.ds_id
    head.weight = torch.nn.Parameter(torch.empty(0))  # a ZeRO-3 partition outside its gathering
    assert packable_head(model) is None


def test_a_lora_wrapped_head_packs_its_base_layer_and_keeps_the_adapter(model):
    config = LoraConfig(r=4, target_modules=["lm_head", "q_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, config).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    expected = _logits(peft_model, ids)
    with packed_head(peft_model) as packed:
        assert packed and "forward" in vars(model.lm_head.base_layer)
        torch.testing.assert_close(_logits(peft_model, ids), expected, atol=1e-5, rtol=1e-5)
    assert "forward" not in vars(model.lm_head.base_layer)


@pytest.mark.parametrize("engine_class", [TransformersEngine, CachedTransformersEngine])
def test_both_engines_generate_through_the_packed_head(model, tokenizer, engine_class):
    held = []
    head = model.get_output_embeddings()
    head.register_forward_hook(lambda module, args, out: held.append("forward" in vars(module)))
    engine = engine_class(model, tokenizer, sampling=SamplingSettings())
    engine.generate([[5, 6, 7], [8, 9]], [4, 4], stop=[])
    assert held and all(held)
    assert "forward" not in vars(head)
    with model_for_generation(model) as same:
        assert same is model and "forward" in vars(head)
