"""Tests for fedlora.training: local training with a fresh optimizer per call, and evaluation."""

import pytest
import torch
from torch import nn

from fedlora.algorithms import LoRAMode
from fedlora.data import make_synthetic_cifar, to_torch
from fedlora.lora import build_lora_model
from fedlora.models import build_backbone, logits
from fedlora.training import (
    LOCAL_OPTIMIZERS,
    clients_at_once,
    compute_dtype,
    evaluate,
    local_train,
    local_train_clients,
    resolved_precision,
    stacked_linears,
    store_backbone,
    to_host,
)
from tests.helpers import DEVICES


class Batches:
    """A to_torch-like dataset: a list of indices gives {"pixel_values", "labels"}."""

    def __init__(self, n: int = 64, scale: float = 1.0):
        generator = torch.Generator().manual_seed(0)
        self.labels = torch.arange(n) % 2
        self.pixels = torch.randn(n, 3, 2, 2, generator=generator) + scale * self.labels.view(-1, 1, 1, 1)
        self.pixels *= scale  # wide features: large gradients on the head

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, rows):
        return {"pixel_values": self.pixels[rows], "labels": self.labels[rows]}


def linear_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 2))


@pytest.mark.parametrize("optimizer, lr", [("sgd", 0.1), ("adam", 0.05)])
def test_local_training_learns_with_either_optimizer(optimizer, lr):
    data, model = Batches(), linear_model()
    before, _ = evaluate(model, data)
    local_train(model, data, steps=60, batch_size=16, lr=lr, generator=torch.Generator().manual_seed(1),
                optimizer=optimizer)
    after, _ = evaluate(model, data)
    assert after > max(before, 0.8), (before, after)


def test_adam_steps_do_not_scale_with_the_gradient():
    """Features 100 times wider: SGD's first step is far longer (its lr must shrink with them); Adam's is not."""
    moved = {}
    for optimizer in LOCAL_OPTIMIZERS:
        for scale in (1.0, 100.0):
            model = linear_model()
            start = model[1].weight.detach().clone()
            local_train(model, Batches(scale=scale), steps=1, batch_size=16, lr=1e-3,
                        generator=torch.Generator().manual_seed(1), optimizer=optimizer)
            moved[optimizer, scale] = (model[1].weight - start).norm().item()
    assert moved["sgd", 100.0] > 10 * moved["sgd", 1.0]
    assert moved["adam", 100.0] == pytest.approx(moved["adam", 1.0], rel=0.05)


def test_local_training_refuses_an_empty_partition_and_an_unknown_optimizer():
    with pytest.raises(ValueError, match="empty partition"):
        local_train(linear_model(), Batches(n=0), steps=1, batch_size=4, lr=0.1, generator=torch.Generator())
    with pytest.raises(ValueError, match="Unknown local optimizer 'lamb'; choose one of: sgd, adam."):
        local_train(linear_model(), Batches(), steps=1, batch_size=4, lr=0.1, generator=torch.Generator(),
                    optimizer="lamb")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_name, mode, optimizer", [("vit-tiny", LoRAMode.FFA, "adam"),
                                                         ("timm-vit-tiny", LoRAMode.FLEX, "sgd")])
def test_clients_trained_together_compute_what_each_computes_alone(model_name, mode, optimizer, device,
                                                                   monkeypatch):
    """Adapters (FFA: B; Flex: A and B) and head of three clients, each from its own batches and augmentation,
    trained in one pass per step: each client's change and loss equal its own training's, within 1e-4 (fp32; on a
    GPU without TF32, whose 10-bit products would differ by more between batch shapes)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = build_lora_model(model_name, num_classes=10, rank=2, alpha=4.0, mode=mode, train_head=True).to(device)
    data = [to_torch(make_synthetic_cifar(40, num_classes=10, seed=s), 32, train=True, device=device)
            for s in range(3)]
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    train = {"steps": 3, "batch_size": 4, "lr": 0.01, "optimizer": optimizer}
    together, losses = local_train_clients(model, data, generators=[torch.Generator().manual_seed(m) for m in range(3)],
                                           augment_seeds=[10 + m for m in range(3)], **train)
    assert all(torch.equal(p, start[n]) for n, p in model.named_parameters())  # the model is left as it was
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert together.keys() == trainable and any("lora_A" in n for n in trainable) == (mode is LoRAMode.FLEX)
    for m in range(3):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(start[n])
        torch.manual_seed(10 + m)
        loss = local_train(model, data[m], generator=torch.Generator().manual_seed(m), **train)
        alone = {n: p.detach() - start[n] for n, p in model.named_parameters() if n in trainable}
        error = sum(((together[n][m] - start[n]) - alone[n]).norm() ** 2 for n in alone) ** 0.5
        assert error <= 1e-4 * sum(alone[n].norm() ** 2 for n in alone) ** 0.5
        assert losses[m] == pytest.approx(loss, rel=1e-5)
    assert len({round(loss, 6) for loss in losses}) == 3  # three different clients, not one three times


def test_only_linear_layers_train_together():
    model = nn.Sequential(nn.Flatten(), nn.LayerNorm(12), nn.Linear(12, 2))
    with pytest.raises(ValueError, match="'1' is a LayerNorm with trainable parameters"):
        with stacked_linears(model, 2):
            pass
    model[1].requires_grad_(False)
    with stacked_linears(model, 2) as stacked:
        assert {n: tuple(t.shape) for n, t in stacked.items()} == {"2.weight": (2, 2, 12), "2.bias": (2, 2)}
        out = model(torch.randn(6, 3, 2, 2))  # three examples of each client
        assert out.shape == (6, 2)
    assert type(model[2]) is nn.Linear  # put back


def test_precision_auto_is_bf16_backbone_on_gpus_with_bf16_only_and_client_batch_auto_batches_on_gpus_only(
        monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for bf16_supported, on_gpu in ((True, "bf16-backbone"), (False, "fp32")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_supported)
        assert resolved_precision("auto", cuda) == on_gpu and resolved_precision("auto", cpu) == "fp32"
        assert [resolved_precision(p, cuda) for p in ("bf16", "bf16-backbone", "fp32")] == ["bf16", "bf16-backbone",
                                                                                              "fp32"]
    assert compute_dtype("auto", cpu) == torch.float32 and compute_dtype("fp32", cpu) == torch.float32
    assert compute_dtype("bf16", cpu) == torch.bfloat16
    assert compute_dtype("bf16-backbone", cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="Unknown precision 'fp16'; choose one of: auto, bf16, bf16-backbone, fp32."):
        compute_dtype("fp16", cpu)
    assert clients_at_once(0, cpu) == 1 and clients_at_once(0, torch.device("cuda")) == 16
    assert clients_at_once(4, cpu) == 4


@pytest.mark.parametrize("device", DEVICES)
def test_precision_auto_stores_the_backbone_in_bf16_on_a_gpu_with_bf16_and_nothing_in_bf16_elsewhere(device):
    model = build_lora_model("vit-tiny", num_classes=10, rank=2, alpha=4.0, mode=LoRAMode.FFA).to(device)
    model = store_backbone(model, "auto")
    bf16 = device == "cuda" and torch.cuda.is_bf16_supported()
    frozen = {p.dtype for n, p in model.named_parameters() if not p.requires_grad and "lora_" not in n}
    trained = {p.dtype for p in model.parameters() if p.requires_grad}
    assert frozen == {torch.bfloat16 if bf16 else torch.float32} and trained == {torch.float32}


@pytest.mark.parametrize("model_name", ["vit-tiny", "timm-vit-tiny"])
@pytest.mark.parametrize("together", [False, True])
def test_bf16_autocast_trains_on_a_cpu_and_keeps_what_is_privatized_in_float32(together, model_name):
    """The bf16 paths (a GPU's) run on a CPU: the products in bfloat16, the adapters, head and loss in float32; they
    train the same clients to nearly, not exactly, the fp32 result. bf16-backbone also stores the frozen backbone
    in bfloat16, so that its blocks' outputs (the residual stream) are bfloat16 where autocast alone keeps them
    float32."""
    data = [to_torch(make_synthetic_cifar(8, num_classes=10, seed=s), 32, train=True) for s in range(2)]
    results, streams = {}, {}
    for precision in ("fp32", "bf16", "bf16-backbone"):
        model = store_backbone(build_lora_model(model_name, num_classes=10, rank=2, alpha=4.0, mode=LoRAMode.FLEX,
                                                train_head=True), precision)
        start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        blocks = model.base_model.model.vit.layers if model_name == "vit-tiny" else model.base_model.model.blocks
        blocks[0].register_forward_hook(lambda module, args, out: streams.update({precision: out.dtype}))
        train = {"steps": 1, "batch_size": 2, "lr": 0.01, "optimizer": "adam", "precision": precision}
        if together:
            trained, losses = local_train_clients(model, data, generators=[torch.Generator().manual_seed(m)
                                                                           for m in range(2)],
                                                  augment_seeds=[3, 4], **train)
            params = {n: t[0] for n, t in trained.items()}
        else:
            torch.manual_seed(3)
            losses = [local_train(model, data[0], generator=torch.Generator().manual_seed(0), **train)]
            params = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        assert all(t.dtype == torch.float32 for t in params.values()) and set(params) == set(start)
        frozen = {p.dtype for n, p in model.named_parameters() if not p.requires_grad and "lora_" not in n}
        assert frozen == {torch.bfloat16 if precision == "bf16-backbone" else torch.float32}
        results[precision] = params, losses[0]
    assert streams == {"fp32": torch.float32, "bf16": torch.float32, "bf16-backbone": torch.bfloat16}
    fp32, loss32 = results["fp32"]
    change = sum((fp32[n] - start[n]).norm() ** 2 for n in fp32) ** 0.5
    for precision in ("bf16", "bf16-backbone"):
        params, loss = results[precision]
        assert loss == pytest.approx(loss32, rel=0.05) and loss != loss32
        gap = sum((params[n] - fp32[n]).norm() ** 2 for n in fp32) ** 0.5
        assert 0 < gap < 0.25 * change


def test_a_bf16_backbone_spares_peft_s_copies_of_each_lora_input_without_changing_a_value():
    """PEFT copies a LoRA layer's input to its factors' dtype (float32), and autocast copies it back to bfloat16 for
    the product: bf16-backbone turns that off, and the scores are the same bit for bit."""
    model = store_backbone(build_lora_model("vit-tiny", num_classes=10, rank=2, alpha=4.0, mode=LoRAMode.FLEX),
                           "bf16-backbone")
    layers = [m for m in model.modules() if hasattr(m, "cast_input_dtype_enabled")]
    assert len(layers) == 12 and not any(m.cast_input_dtype_enabled for m in layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    images, scores = torch.randn(2, 3, 32, 32), []
    for enabled in (False, True):
        for m in layers:
            m.cast_input_dtype_enabled = enabled
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            scores.append(logits(model, images))
    assert torch.equal(*scores)


@pytest.mark.parametrize("model_name", ["vit-tiny", "timm-vit-tiny"])
def test_a_bf16_backbone_copies_between_dtypes_a_third_as_often_as_autocast_alone(model_name):
    """What bf16-backbone is for: most copies between float32 and bfloat16 (on a GPU each a kernel that reads and
    writes a whole activation) gone from one forward and backward of clients trained together."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.copy_)
            return func(*args, **(kwargs or {}))

    counts = {}
    for precision in ("bf16", "bf16-backbone"):
        model = store_backbone(build_lora_model(model_name, num_classes=10, rank=2, alpha=4.0, mode=LoRAMode.FFA,
                                                train_head=True), precision)
        with stacked_linears(model, 2), Copies() as copies:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = logits(model, torch.randn(4, 3, 32, 32))
            out.float().sum().backward()
        counts[precision] = copies.count
    assert 0 < counts["bf16-backbone"] <= counts["bf16"] / 3


def test_both_model_families_attend_with_pytorch_sdpa():
    transformers_vit = build_backbone("vit-tiny", num_classes=3)
    assert transformers_vit.config._attn_implementation == "sdpa"
    timm_vit = build_backbone("timm-vit-tiny", num_classes=3)
    assert all(block.attn.fused_attn for block in timm_vit.blocks)


@pytest.mark.parametrize("device", DEVICES)
def test_to_host_copies_tensors_to_the_cpu_in_one_piece_or_one_by_one(device):
    tensors = [torch.randn(3, 4, device=device, requires_grad=True), torch.randn(5, device=device),
               torch.randn(2, 1, 2, device=device)[:, :, 1]]  # a strided view
    host = to_host(tensors)
    assert [t.device.type for t in host] == ["cpu"] * 3 and not any(t.requires_grad for t in host)
    assert all(torch.equal(h, t.detach().cpu()) for h, t in zip(host, tensors))
    host[1].zero_()  # copies, not the originals
    assert tensors[1].abs().sum() > 0
    mixed = to_host([torch.arange(3, device=device), torch.ones(2, dtype=torch.float64, device=device)])
    assert mixed[0].tolist() == [0, 1, 2] and mixed[1].dtype == torch.float64
