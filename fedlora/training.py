"""Local training and evaluation of a LoRA model, free of Flower: K local steps on a partition, accuracy on a split."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from fedlora.data import DeviceImages
from fedlora.models import logits


def select_device() -> torch.device:
    """CUDA when present, CPU otherwise."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` on the CPU, detached: in one copy where they share a dtype, since from a GPU each tensor
    copied alone makes the host wait for the device once more (a group of clients' messages is hundreds of them)."""
    tensors = [t.detach() for t in tensors]
    if len({t.dtype for t in tensors}) != 1:
        return [t.to("cpu", copy=True) for t in tensors]
    flat = torch.cat([t.reshape(-1) for t in tensors]).cpu()
    return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


LOCAL_OPTIMIZERS = ("sgd", "adam")
PRECISIONS = ("auto", "bf16", "bf16-backbone", "fp32")


def resolved_precision(precision: str, device: torch.device) -> str:
    """What ``precision`` runs as on ``device``: "auto" is "bf16-backbone" on a GPU that supports bfloat16 (the
    fastest there: 3,428 images a second against bf16 autocast's 2,644 on an H200, ViT-B/16 clients 16 at a time,
    benchmarks/results/client_throughput.md) and "fp32" elsewhere (on a CPU bf16 changes every result); the others
    are themselves."""
    if precision not in PRECISIONS:
        raise ValueError(f"Unknown precision '{precision}'; choose one of: {', '.join(PRECISIONS)}.")
    if precision != "auto":
        return precision
    return "bf16-backbone" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype of the forward and backward's products on ``device``: bfloat16 unless ``precision`` runs as fp32
    there (``resolved_precision``)."""
    return torch.float32 if resolved_precision(precision, device) == "fp32" else torch.bfloat16


def store_backbone(model: nn.Module, precision: str) -> nn.Module:
    """A LoRA model (fedlora.lora), on its device, as ``precision`` stores it there: where it runs as
    "bf16-backbone" (``resolved_precision``), its frozen backbone (every
    parameter but the LoRA factors and the head's trained copy) in bfloat16 and its layer norms computed in their
    input's dtype, so that its activations, the residual stream, stay bfloat16; otherwise as it is.

    Under autocast alone the residual stream is float32: a copy to bfloat16 before each matrix product, and every
    add and norm reads and writes float32. The matrix products see the same bfloat16 weights either way (autocast
    rounds them the same way on each use); what this changes is that the residual stream and the norms' and
    embeddings' parameters are rounded to bfloat16 (the norms still accumulate in float32 inside the kernel). The
    trained parameters, their gradients, the loss and everything privatized stay float32. The model runs under
    autocast only (``autocast``), as local_train, local_train_clients and evaluate run it."""
    if resolved_precision(precision, next(model.parameters()).device) != "bf16-backbone":
        return model
    from fedlora.lora import is_backbone  # here: the config imports this module, and must not load PEFT

    for name, param in model.named_parameters():
        if is_backbone(name):
            param.data = param.data.to(torch.bfloat16)
    for name, module in model.named_modules():
        if isinstance(module, nn.LayerNorm) and all(is_backbone(f"{name}.{p}") for p, _ in module.named_parameters()):
            module.forward = partial(_norm_in_input_dtype, module)  # a partial pickles, a bound method not
        if hasattr(module, "cast_input_dtype_enabled"):  # a PEFT LoRA layer: it would copy its bfloat16 input to
            module.cast_input_dtype_enabled = False  # its factors' float32, and autocast copy that back: same values
    return model


def _norm_in_input_dtype(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    # autocast would compute it in float32 and return float32; the kernel accumulates in float32 anyway
    with torch.autocast(x.device.type, enabled=False):
        return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


def clients_at_once(client_batch: int, device: torch.device) -> int:
    """client-batch resolved on ``device``: 0 is 16 on a GPU, where one forward and backward of many clients keeps
    it busy (benchmarks/results/client_throughput.md), and 1 on a CPU, where it is no faster."""
    return client_batch or (16 if device.type == "cuda" else 1)


def autocast(device: torch.device, dtype: torch.dtype):
    """Autocast to ``dtype`` (off for float32): parameters, their gradients and the loss stay float32, so what is
    clipped, sketched and noised afterwards is float32 as before."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def local_train(model: nn.Module, dataset, *, steps: int, batch_size: int, lr: float, generator: torch.Generator,
                optimizer: str = "sgd", precision: str = "fp32", task=None) -> float:
    """``steps`` optimizer steps on mini-batches drawn (with replacement) from ``dataset``; returns the mean loss.

    ``optimizer`` is fresh each call (no state crosses rounds, so a client's reply depends on its data and the
    global model only): "sgd", or "adam", whose steps do not scale with the gradient, so that one lr serves a
    head whose gradients are large (wide features) and adapters whose gradients are small. ``precision``: see
    ``compute_dtype``.
    ``dataset`` yields a batch for a list of indices, which ``task`` (fedlora.tasks; default: image classification,
    {"pixel_values", "labels"} from ``fedlora.data.to_torch``) turns into a loss.
    """
    if len(dataset) == 0:
        raise ValueError("Cannot train on an empty partition.")
    if optimizer not in LOCAL_OPTIMIZERS:
        raise ValueError(f"Unknown local optimizer '{optimizer}'; choose one of: {', '.join(LOCAL_OPTIMIZERS)}.")
    task = task or _image_task()
    device = next(model.parameters()).device
    dtype = compute_dtype(precision, device)
    params = [p for p in model.parameters() if p.requires_grad]
    step = torch.optim.Adam(params, lr=lr) if optimizer == "adam" else torch.optim.SGD(params, lr=lr)
    model.train()
    total = torch.zeros((), dtype=torch.float64, device=device)
    for _ in range(steps):
        indices = torch.randint(len(dataset), (batch_size,), generator=generator).tolist()
        batch = {name: value.to(device) for name, value in dataset[indices].items()}
        with autocast(device, dtype):  # the task's loss is float32 (what autocast does to a loss anyway)
            loss = task.loss(model, batch)
        step.zero_grad(set_to_none=True)
        loss.backward()
        step.step()
        total += loss.detach()  # no .item(): the device is not waited for every step
    return total.item() / steps


def local_train_clients(model: nn.Module, datasets: Sequence[DeviceImages], *, steps: int, batch_size: int, lr: float,
                        generators: Sequence[torch.Generator], augment_seeds: Sequence[int],
                        optimizer: str = "sgd", precision: str = "fp32",
                        task=None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """``local_train`` of M clients at once, all starting from the model's current trainable parameters: each step
    one forward and backward of the M clients' batches concatenated (their draws joined on the device as one batch,
    as ``fedlora.data.batch_of`` transforms images), through the frozen backbone shared and each client's own copy of every trainable
    linear (LoRA factors, head: StackedLinear). Returns the clients' trained parameters, by name, stacked (M, ...)
    in client order, and each client's mean loss; the model's own parameters are left as they were.

    Each client computes what ``local_train`` computes alone, up to floating-point summation order: its batches
    come from its own ``generators[m]`` and its augmentation from the global generator seeded with
    ``augment_seeds[m]`` (saved and restored around its draws), the loss summed over clients gives each client's
    copy its own gradient, and SGD and Adam act elementwise, so one optimizer over the stacked copies is M
    independent ones. The backbone must be deterministic in training (no dropout).
    """
    clients = len(datasets)
    if not clients or len(generators) != clients or len(augment_seeds) != clients:
        raise ValueError("local_train_clients needs one dataset, generator and augmentation seed per client.")
    if any(len(d) == 0 for d in datasets):
        raise ValueError("Cannot train on an empty partition.")
    if optimizer not in LOCAL_OPTIMIZERS:
        raise ValueError(f"Unknown local optimizer '{optimizer}'; choose one of: {', '.join(LOCAL_OPTIMIZERS)}.")
    task = task or _image_task()
    device = next(model.parameters()).device
    dtype = compute_dtype(precision, device)
    kept = torch.get_rng_state()
    streams = []
    for seed in augment_seeds:
        torch.manual_seed(seed)
        streams.append(torch.get_rng_state())
    with stacked_linears(model, clients) as stacked:
        params = list(stacked.values())
        step = torch.optim.Adam(params, lr=lr) if optimizer == "adam" else torch.optim.SGD(params, lr=lr)
        model.train()
        total = torch.zeros(clients, dtype=torch.float64, device=device)
        for _ in range(steps):
            draws = []
            for m, dataset in enumerate(datasets):
                indices = torch.randint(len(dataset), (batch_size,), generator=generators[m])
                torch.set_rng_state(streams[m])
                draws.append(dataset.draw(indices))
                streams[m] = torch.get_rng_state()
            batch = draws[0].join(draws)
            with autocast(device, dtype):
                losses = task.example_losses(model, batch).view(clients, -1).mean(1)
            step.zero_grad(set_to_none=True)
            losses.sum().backward()
            step.step()
            total += losses.detach().double()
        trained = {name: p.detach() for name, p in stacked.items()}
    torch.set_rng_state(kept)
    return trained, (total / steps).cpu().tolist()


def _image_task():
    from fedlora.tasks import task_named

    return task_named("image-classification")


class StackedLinear(nn.Module):
    """M copies of a linear layer, one per client, over an input whose first dimension is the M clients' examples
    in client order: client m's examples meet copy m only."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight, self.bias = weight, bias  # (M, out, in) and (M, out): leaves the optimizer updates

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        clients, (out_features, in_features) = self.weight.shape[0], self.weight.shape[1:]
        grouped = x.reshape(clients, -1, in_features)  # (M, examples x tokens, in)
        y = torch.bmm(grouped, self.weight.transpose(1, 2))
        if self.bias is not None:
            y = y + self.bias.unsqueeze(1)
        return y.reshape(*x.shape[:-1], out_features)


@contextmanager
def stacked_linears(model: nn.Module, clients: int) -> Iterator[dict[str, torch.Tensor]]:
    """Every linear with a trainable parameter replaced, while inside, by a StackedLinear of ``clients`` copies of
    it (each starting from its values); yields the stacked tensors by the model's parameter names."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    swapped, stacked = [], {}
    for name, module in list(model.named_modules()):
        own = {f"{name}.{p}" if name else p for p, param in module.named_parameters(recurse=False)
               if param.requires_grad}
        if not own & trainable:
            continue
        if type(module) is not nn.Linear:
            raise ValueError(f"Clients train together only through linear layers; '{name}' is a "
                             f"{type(module).__name__} with trainable parameters.")
        weight = module.weight.detach().unsqueeze(0).repeat(clients, 1, 1).requires_grad_(module.weight.requires_grad)
        bias = (module.bias.detach().unsqueeze(0).repeat(clients, 1).requires_grad_(module.bias.requires_grad)
                if module.bias is not None else None)
        stacked.update({f"{name}.weight": weight, **({f"{name}.bias": bias} if bias is not None else {})})
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        swapped.append((parent, child, module))
        parent._modules[child] = StackedLinear(weight, bias)
    try:
        yield {n: t for n, t in stacked.items() if t.requires_grad}
    finally:
        for parent, child, module in swapped:
            parent._modules[child] = module


@torch.no_grad()
def evaluate(model: nn.Module, dataset, *, batch_size: int = 256, precision: str = "fp32") -> tuple[float, float]:
    """(accuracy, mean cross-entropy loss) on ``dataset``."""
    device = next(model.parameters()).device
    dtype = compute_dtype(precision, device)
    model.eval()
    correct = torch.zeros((), dtype=torch.int64, device=device)
    loss = torch.zeros((), dtype=torch.float64, device=device)
    for start in range(0, len(dataset), batch_size):
        batch = dataset[list(range(start, min(start + batch_size, len(dataset))))]
        labels = batch["labels"].to(device)
        with autocast(device, dtype):
            out = logits(model, batch["pixel_values"].to(device)).float()
        loss += F.cross_entropy(out, labels, reduction="sum")
        correct += (out.argmax(dim=1) == labels).sum()
    return correct.item() / len(dataset), loss.item() / len(dataset)
