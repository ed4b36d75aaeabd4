"""The chunked loss equals the plain fp32 loss, in value and gradients, without N x V tensors."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.loss.loss_utils import ForCausalLMLoss

from finetune.modeling import chunked_loss
from finetune.modeling.chunked_loss import chunked_causal_lm_loss, chunked_linear_cross_entropy

N, H, V = 50, 16, 97  # rows, hidden size, vocabulary


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def make_inputs(dtype=torch.float32, weight_grad=True, bias=False, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=generator).to(dtype).requires_grad_(True)
    weight = (torch.randn(V, H, generator=generator) * 0.5).to(dtype).requires_grad_(weight_grad)
    lm_bias = torch.randn(V, generator=generator).to(dtype).requires_grad_(True) if bias else None
    targets = torch.randint(0, V, (N,), generator=generator)
    targets[3:11] = -100
    targets[-1] = -100
    return hidden, weight, lm_bias, targets


def plain_loss(hidden, weight, targets, bias=None, reduction="mean", num_items_in_batch=None):
    """The reference: full logits, upcast, cross-entropy with ignore_index (transformers' recipe)."""
    logits = F.linear(hidden, weight, bias).float()
    if num_items_in_batch is not None:
        return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum") / num_items_in_batch
    return F.cross_entropy(logits, targets, ignore_index=-100, reduction=reduction)


def loss_and_grads(loss_fn, tensors):
    loss = loss_fn()
    wanted = [t for t in tensors if t is not None and t.requires_grad]
    return loss.detach(), torch.autograd.grad(loss, wanted)


REDUCTIONS = [
    pytest.param({"reduction": "mean"}, id="mean"),
    pytest.param({"reduction": "sum"}, id="sum"),
    pytest.param({"num_items_in_batch": 37}, id="num_items"),
    pytest.param({"num_items_in_batch": torch.tensor(37)}, id="num_items_tensor"),
]


@pytest.mark.parametrize(
    "chunk_size", [10, 7, 1, 1000], ids=["divides", "does_not_divide", "one_row", "one_chunk"]
)
@pytest.mark.parametrize("kwargs", REDUCTIONS)
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_matches_plain_loss_fp32(chunk_size, kwargs, bias):
    hidden, weight, lm_bias, targets = make_inputs(bias=bias)
    tensors = (hidden, weight, lm_bias)
    expected, expected_grads = loss_and_grads(
        lambda: plain_loss(hidden, weight, targets, lm_bias, **kwargs), tensors
    )
    actual, actual_grads = loss_and_grads(
        lambda: chunked_linear_cross_entropy(
            hidden, weight, targets, bias=lm_bias, chunk_size=chunk_size, **kwargs
        ),
        tensors,
    )
    assert actual.dtype == torch.float32
    assert rel_err(actual, expected) <= 1e-5
    assert len(actual_grads) == len(expected_grads) == (3 if bias else 2)
    for got, want in zip(actual_grads, expected_grads, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("num_items_in_batch", [None, 41])
def test_causal_lm_loss_matches_transformers(num_items_in_batch):
    generator = torch.Generator().manual_seed(1)
    hidden_states = torch.randn(3, 17, H, generator=generator, requires_grad=True)
    weight = torch.randn(V, H, generator=generator, requires_grad=True)
    labels = torch.randint(0, V, (3, 17), generator=generator)
    labels[0, :6] = -100  # a masked prompt
    labels[2, 10:] = -100  # padding

    expected = ForCausalLMLoss(hidden_states @ weight.t(), labels, V, num_items_in_batch=num_items_in_batch)
    expected_grads = torch.autograd.grad(expected, (hidden_states, weight))
    actual = chunked_causal_lm_loss(
        hidden_states, weight, labels, chunk_size=8, num_items_in_batch=num_items_in_batch
    )
    actual_grads = torch.autograd.grad(actual, (hidden_states, weight))

    assert rel_err(actual, expected) <= 1e-5
    for got, want in zip(actual_grads, expected_grads, strict=True):
        assert rel_err(got, want) <= 1e-5


def test_causal_lm_loss_accepts_shift_labels():
    generator = torch.Generator().manual_seed(2)
    hidden_states = torch.randn(2, 9, H, generator=generator)
    weight = torch.randn(V, H, generator=generator)
    bias = torch.randn(V, generator=generator)
    shift_labels = torch.randint(0, V, (2, 9), generator=generator)
    shift_labels[:, -1] = -100

    expected = ForCausalLMLoss(F.linear(hidden_states, weight, bias), None, V, shift_labels=shift_labels)
    actual = chunked_causal_lm_loss(
        hidden_states, weight, None, shift_labels=shift_labels, lm_head_bias=bias, chunk_size=4
    )
    assert rel_err(actual, expected) <= 1e-5


def test_frozen_head_gets_no_gradient():
    hidden, weight, _, targets = make_inputs(weight_grad=False)
    chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=8).backward()
    assert weight.grad is None
    assert hidden.grad is not None


def test_gradient_is_scaled_by_upstream_gradient():
    """Trainer divides the loss by the accumulation steps; the stored gradients must follow."""
    hidden, weight, _, targets = make_inputs()
    (plain_loss(hidden, weight, targets) / 4).backward()
    expected = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    (chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=8) / 4).backward()
    assert rel_err(hidden.grad, expected[0]) <= 1e-5
    assert rel_err(weight.grad, expected[1]) <= 1e-5


def test_bf16_is_close_to_plain():
    hidden, weight, _, targets = make_inputs(dtype=torch.bfloat16)
    tensors = (hidden, weight)
    expected, expected_grads = loss_and_grads(lambda: plain_loss(hidden, weight, targets), tensors)
    actual, actual_grads = loss_and_grads(
        lambda: chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=7), tensors
    )
    assert actual.dtype == torch.float32
    assert rel_err(actual, expected) <= 1e-3
    for got, want in zip(actual_grads, expected_grads, strict=True):
        assert got.dtype == torch.bfloat16
        assert rel_err(got, want) <= 2e-2


def test_fully_ignored_chunk():
    hidden, weight, _, targets = make_inputs()
    targets[10:20] = -100  # with chunk 10, the second chunk of rows has no label at all
    tensors = (hidden, weight)
    expected, expected_grads = loss_and_grads(lambda: plain_loss(hidden, weight, targets), tensors)
    actual, actual_grads = loss_and_grads(
        lambda: chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=10), tensors
    )
    assert rel_err(actual, expected) <= 1e-5
    for got, want in zip(actual_grads, expected_grads, strict=True):
        assert rel_err(got, want) <= 1e-5
    assert torch.all(actual_grads[0][10:20] == 0)


def test_all_tokens_ignored():
    hidden, weight, _, targets = make_inputs()
    targets[:] = -100
    loss = chunked_linear_cross_entropy(hidden, weight, targets, reduction="sum", chunk_size=8)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.all(hidden.grad == 0) and torch.all(weight.grad == 0)
    assert chunked_linear_cross_entropy(hidden, weight, targets, num_items_in_batch=5).item() == 0.0
    # A mean over no tokens is nan, as in F.cross_entropy.
    assert torch.isnan(plain_loss(hidden, weight, targets))
    assert torch.isnan(chunked_linear_cross_entropy(hidden, weight, targets))


def test_gradcheck_float64():
    """Analytical gradients of the fused function against central differences, in float64."""
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(6, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(9, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    bias = torch.randn(9, dtype=torch.float64, generator=generator, requires_grad=True)
    targets = torch.tensor([0, 8, -100, 3, 3, 5])

    def loss_fn() -> torch.Tensor:
        return chunked_linear_cross_entropy(hidden, weight, targets, bias=bias, chunk_size=4)

    # torch.autograd.gradcheck backpropagates twice through one graph, which this
    # Function refuses (its gradients are handed over, not kept), so difference by hand.
    analytical = torch.autograd.grad(loss_fn(), (hidden, weight, bias))
    eps = 1e-6
    with torch.no_grad():
        for tensor, grad in zip((hidden, weight, bias), analytical, strict=True):
            numerical = torch.zeros_like(tensor)
            flat, flat_numerical = tensor.view(-1), numerical.view(-1)
            for i in range(flat.numel()):
                original = flat[i].item()
                flat[i] = original + eps
                up = loss_fn()
                flat[i] = original - eps
                down = loss_fn()
                flat[i] = original
                flat_numerical[i] = (up - down) / (2 * eps)
            torch.testing.assert_close(grad, numerical, rtol=1e-6, atol=1e-8)


def test_second_backward_through_one_graph_raises():
    hidden, weight, _, targets = make_inputs()
    loss = chunked_linear_cross_entropy(hidden, weight, targets)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


class _LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an aten op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


def test_no_tensor_larger_than_a_chunk_of_logits():
    rows, hidden_size, vocab, chunk_size = 256, 8, 2_000, 32  # V x h < chunk x V < N x V
    hidden = torch.randn(rows, hidden_size, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,))
    targets[::5] = -100

    with _LargestTensor() as chunked:
        chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=chunk_size).backward()
    with _LargestTensor() as plain:
        plain_loss(hidden, weight, targets).backward()

    assert chunked.largest == chunk_size * vocab
    assert plain.largest == rows * vocab  # the check does see full logits


def test_invalid_arguments():
    hidden, weight, _, targets = make_inputs()
    with pytest.raises(ValueError, match="reduction"):
        chunked_linear_cross_entropy(hidden, weight, targets, reduction="none")
    with pytest.raises(ValueError, match="targets"):
        chunked_linear_cross_entropy(hidden, weight, targets[:-1])
    with pytest.raises(ValueError, match=r"hidden \[N, h\]"):
        chunked_linear_cross_entropy(hidden.unsqueeze(0), weight, targets)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=0)


def test_liger_is_used_only_when_asked_and_on_cuda(monkeypatch):
    """With Liger installed, CPU tensors still take the chunked path, and so does a call without
    `use_liger` (train.liger off); CUDA ones with it would take Liger's."""
    calls = []

    class FakeLigerLoss:
        def __init__(self, ignore_index, reduction):
            self.ignore_index, self.reduction = ignore_index, reduction

        def __call__(self, lin_weight, _input, target, bias=None):
            calls.append(self.reduction)
            return plain_loss(_input, lin_weight, target, bias, reduction=self.reduction)

    fake = types.ModuleType("liger_kernel.transformers")
    fake.LigerFusedLinearCrossEntropyLoss = FakeLigerLoss
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    monkeypatch.setattr(chunked_loss, "liger_available", lambda: True)

    hidden, weight, _, targets = make_inputs()
    chunked_loss.linear_cross_entropy(hidden, weight, targets, use_liger=True)
    assert calls == []  # CPU: ours
    with monkeypatch.context() as cuda:
        cuda.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        chunked_loss.linear_cross_entropy(hidden, weight, targets)
        assert calls == []  # "CUDA", but train.liger off: ours
        chunked_loss.linear_cross_entropy(hidden, weight, targets, use_liger=True)
        assert calls == ["mean"]  # "CUDA" and asked: Liger's
    calls.clear()

    # The wiring Liger gets on CUDA: argument order, and the num_items_in_batch denominator.
    expected = plain_loss(hidden, weight, targets, num_items_in_batch=37)
    actual = chunked_loss._liger_linear_cross_entropy(hidden, weight, targets, num_items_in_batch=37)
    assert calls == ["sum"]
    assert rel_err(actual, expected) <= 1e-6


def test_under_autocast_matches_the_plain_loss_in_the_autocast_dtype():
    """A caller may run the loss inside autocast (transformers 5's Trainer autocasts only the model's forward)."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 16, 32, requires_grad=True)
    weight = torch.randn(100, 32, requires_grad=True)
    labels = torch.randint(0, 100, (2, 16))
    labels[:, :3] = -100
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_causal_lm_loss(hidden, weight, labels, chunk_size=8)
    loss.backward()
    assert hidden.grad is not None and hidden.grad.dtype == torch.float32
    assert weight.grad is not None and weight.grad.dtype == torch.float32
    ref_h = hidden.detach().to(torch.bfloat16).float().requires_grad_()
    ref_w = weight.detach().to(torch.bfloat16).float().requires_grad_()
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    logits = (ref_h.reshape(-1, 32).bfloat16() @ ref_w.bfloat16().T).float()
    ref = torch.nn.functional.cross_entropy(logits, shift.reshape(-1), ignore_index=-100)
    assert loss.item() == pytest.approx(ref.item(), rel=2e-2)
