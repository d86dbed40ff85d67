from collections import OrderedDict

import pytest
import torch
from peft import PeftModel

from fedlora.lora import (LoRAFactors, LoRAMode, attach_lora, build_lora_model, from_message, get_adapters,
                          save_adapters, set_adapters, to_message)
from fedlora.models import MODELS, ModelUnavailableError, build_backbone, logits

TINY = ["vit-tiny", "timm-vit-tiny"]
X = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def _random_adapters(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    return OrderedDict((layer, LoRAFactors(torch.randn(a.shape, generator=g), torch.randn(b.shape, generator=g)))
                       for layer, (a, b) in get_adapters(model).items())


@pytest.mark.parametrize("name", TINY)
def test_ffa_init_is_identical_across_clients_and_leaves_the_base_model_unchanged(name):
    base = build_backbone(name, num_classes=10, seed=3).eval()
    with torch.no_grad():
        expected = logits(base, X)
    client_a = build_lora_model(name, num_classes=10, rank=4, alpha=8, seed=3).eval()
    client_b = build_lora_model(name, num_classes=10, rank=4, alpha=8, seed=3).eval()
    for (la, (a1, b1)), (lb, (a2, b2)) in zip(get_adapters(client_a).items(), get_adapters(client_b).items()):
        assert la == lb and torch.equal(a1, a2) and torch.equal(b1, b2)
        assert not b1.any()  # B = 0
        assert a1.std().item() == pytest.approx(4 ** -0.5, rel=0.25)  # A ~ N(0, 1/r)
    for p1, p2 in zip(client_a.parameters(), client_b.parameters()):
        assert torch.equal(p1, p2)
    with torch.no_grad():
        assert torch.equal(logits(client_a, X), expected)  # B = 0: the adapted model is the base model
    other = build_lora_model(name, num_classes=10, rank=4, alpha=8, seed=4)
    assert not torch.equal(next(iter(get_adapters(other).values())).A, next(iter(get_adapters(client_a).values())).A)


@pytest.mark.parametrize("mode", ["ffa", "flex"])
def test_ffa_trains_only_b_and_flex_trains_both(mode):
    model = build_lora_model("vit-tiny", num_classes=10, rank=2, alpha=4, mode=mode)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert any("lora_B" in n for n in trainable)
    assert any("lora_A" in n for n in trainable) == (mode == "flex")
    before = get_adapters(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for _ in range(2):  # with B = 0 the first gradient of A is zero; the second is not
        opt.zero_grad()
        torch.nn.functional.cross_entropy(logits(model, X), torch.tensor([0, 1, 2])).backward()
        opt.step()
    after = get_adapters(model)
    layer = next(iter(before))
    assert torch.equal(before[layer].A, after[layer].A) == (mode == "ffa")
    assert not torch.equal(before[layer].B, after[layer].B)


@pytest.mark.parametrize("name", TINY)
def test_adapter_round_trip_gives_identical_outputs(name):
    source = build_lora_model(name, num_classes=10, rank=4, alpha=8, mode="flex").eval()
    set_adapters(source, _random_adapters(source))
    target = build_lora_model(name, num_classes=10, rank=4, alpha=8, mode="flex").eval()
    with torch.no_grad():
        assert not torch.allclose(logits(source, X), logits(target, X))
        set_adapters(target, get_adapters(source))
        assert torch.equal(logits(source, X), logits(target, X))


def test_message_round_trip():
    model = build_lora_model("vit-tiny", num_classes=10, rank=4, alpha=8)
    adapters = _random_adapters(model)
    ffa, flex = to_message(adapters, mode=LoRAMode.FFA), to_message(adapters, mode=LoRAMode.FLEX)
    assert all(n.endswith("lora_B") for n in ffa) and len(flex) == 2 * len(ffa)
    base = get_adapters(model)
    from_ffa = from_message(ffa, base)  # FFA's A stays the frozen init
    for layer in adapters:
        assert torch.equal(from_ffa[layer].A, base[layer].A) and torch.equal(from_ffa[layer].B, adapters[layer].B)
    assert all(torch.equal(x, y) for layer in adapters for x, y in zip(from_message(flex, base)[layer], adapters[layer]))


@pytest.mark.parametrize("name", TINY)
def test_peft_save_and_load(tmp_path, name):
    model = build_lora_model(name, num_classes=10, rank=4, alpha=8, mode="flex", seed=2).eval()
    set_adapters(model, _random_adapters(model))
    save_adapters(model, tmp_path)
    assert (tmp_path / "adapter_config.json").exists()
    loaded = PeftModel.from_pretrained(build_backbone(name, num_classes=10, seed=2), str(tmp_path)).eval()
    with torch.no_grad():
        assert torch.equal(logits(model, X), logits(loaded, X))
    for layer, (a, b) in get_adapters(model).items():
        assert torch.equal(get_adapters(loaded)[layer].A, a) and torch.equal(get_adapters(loaded)[layer].B, b)


def test_all_targets_adapt_every_attention_and_mlp_linear():
    qv = get_adapters(build_lora_model("vit-tiny", num_classes=10, rank=2, alpha=4))
    full = get_adapters(build_lora_model("vit-tiny", num_classes=10, rank=2, alpha=4, targets="all"))
    assert len(qv) == 2 * 6 and len(full) == 6 * 6
    assert {layer.rsplit(".", 1)[1] for layer in full} == {"q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2"}
    timm_full = get_adapters(build_lora_model("timm-vit-tiny", num_classes=10, rank=2, alpha=4, targets="all"))
    assert {layer.rsplit(".", 1)[1] for layer in timm_full} == {"qkv", "proj", "fc1", "fc2"}
    assert not any(layer.startswith("patch_embed") for layer in timm_full)  # the conv "proj" is not adapted


def test_pretrained_weights_offline_fail_with_one_clear_sentence(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("fedlora.models.unreachable_reason", lambda: "huggingface.co is unreachable")
    with pytest.raises(ModelUnavailableError, match='use model = "vit-tiny"') as error:
        build_backbone("vit-b16", num_classes=100)
    assert "\n" not in str(error.value)
    assert {spec.pretrained for spec in MODELS.values()} == {True, False}


@pytest.mark.parametrize("make, match", [
    (lambda: build_lora_model("vit-tiny", num_classes=10, rank=0, alpha=8), "rank must be positive"),
    (lambda: build_lora_model("vit-tiny", num_classes=10, rank=500, alpha=8), "exceeds the smaller side"),
    (lambda: build_lora_model("vit-tiny", num_classes=10, rank=2, alpha=8, targets="mlp"), "Unknown LoRA targets"),
    (lambda: build_lora_model("vit-huge", num_classes=10, rank=2, alpha=8), "Unknown model"),
    (lambda: build_backbone("vit-tiny", num_classes=1), "at least 2 classes"),
    (lambda: attach_lora(build_backbone("vit-tiny", num_classes=10), family="transformers", head="classifier",
                         rank=2, alpha=0), "alpha must be positive"),
])
def test_bad_input_is_one_clear_value_error(make, match):
    with pytest.raises(ValueError, match=match) as error:
        make()
    assert "\n" not in str(error.value)


def test_set_adapters_rejects_wrong_shapes_and_layers():
    model = build_lora_model("vit-tiny", num_classes=10, rank=2, alpha=4)
    adapters = get_adapters(model)
    layer = next(iter(adapters))
    wrong = OrderedDict(adapters)
    wrong[layer] = LoRAFactors(adapters[layer].A, torch.zeros(7, 2))
    with pytest.raises(ValueError, match="must have shape"):
        set_adapters(model, wrong)
    with pytest.raises(ValueError, match="do not match"):
        set_adapters(model, OrderedDict(list(adapters.items())[1:]))
