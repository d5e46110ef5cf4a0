"""clusterft.modeling.cpu_matmul: which CPU kernel computes float32 linears, and that the
oneDNN path computes what torch's own does (to float rounding), falls back where it must,
and is deterministic."""

from __future__ import annotations

import pytest
import torch

from clusterft.modeling import cpu_matmul
from clusterft.pipeline.errors import InputError


def onednn_calls(fn) -> int:
    """How many oneDNN linears ``fn()`` ran (torch's profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if "_linear_pointwise" in e.key)


needs_onednn = pytest.mark.skipif(not cpu_matmul.onednn_available(),
                                  reason="this torch build has no oneDNN linear")


@pytest.fixture(autouse=True)
def _restore():
    yield
    cpu_matmul.uninstall()


def test_auto_takes_onednn_on_amd_x86_only() -> None:
    assert cpu_matmul.choose("auto", "AuthenticAMD", "x86_64", True) == "onednn"
    assert cpu_matmul.choose("auto", "GenuineIntel", "x86_64", True) == "aten"
    assert cpu_matmul.choose("auto", "AuthenticAMD", "aarch64", True) == "aten"
    assert cpu_matmul.choose("auto", "", "aarch64", True) == "aten"
    assert cpu_matmul.choose("auto", "AuthenticAMD", "x86_64", False) == "aten"
    assert cpu_matmul.choose("aten", "AuthenticAMD", "x86_64", True) == "aten"
    assert cpu_matmul.choose("onednn", "GenuineIntel", "x86_64", True) == "onednn"


def test_bad_choices_name_the_field() -> None:
    with pytest.raises(InputError, match="cpu_matmul.*fast|fast.*auto"):
        cpu_matmul.choose("fast")
    with pytest.raises(InputError, match="no oneDNN"):
        cpu_matmul.choose("onednn", available=False)


def test_the_environment_variable_picks_and_a_bad_value_names_it(monkeypatch) -> None:
    monkeypatch.setenv(cpu_matmul.ENV, "aten")
    assert cpu_matmul.from_env() == "aten" and cpu_matmul.active() == "aten"
    monkeypatch.setenv(cpu_matmul.ENV, "blas")
    with pytest.raises(InputError) as e:
        cpu_matmul.from_env()
    assert cpu_matmul.ENV in str(e.value)


def test_install_switches_and_uninstall_restores() -> None:
    original = torch.nn.Linear.forward
    assert cpu_matmul.install("aten") == "aten"
    assert torch.nn.Linear.forward is original
    if cpu_matmul.onednn_available():
        assert cpu_matmul.install("onednn") == "onednn"
        assert torch.nn.Linear.forward is not original
        assert cpu_matmul.install("aten") == "aten" and torch.nn.Linear.forward is original
    cpu_matmul.install("auto")
    cpu_matmul.uninstall()
    assert torch.nn.Linear.forward is original and cpu_matmul.active() == "aten"


def _grads(layer, x):
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = layer(x)
    (y * torch.linspace(-1, 1, y.shape[-1])).square().sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in layer.parameters()]


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7, 48), (3, 29, 48), (2, 5, 11, 48)])
def test_onednn_linear_matches_torch_forward_and_backward(bias, shape) -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 80, bias=bias)
    x = torch.randn(*shape)
    ref = _grads(layer, x)
    assert cpu_matmul.install("onednn") == "onednn"
    got = _grads(layer, x)
    for a, b in zip(ref, got):
        assert a.shape == b.shape
        assert float((a - b).abs().max()) <= 1e-5 * float(a.abs().max()) + 1e-6


@needs_onednn
def test_onednn_takes_non_contiguous_inputs() -> None:
    torch.manual_seed(1)
    layer = torch.nn.Linear(32, 16)
    x = torch.randn(12, 32, 6).transpose(1, 2)  # [12, 6, 32], not contiguous
    ref = layer(x)
    cpu_matmul.install("onednn")
    assert torch.allclose(layer(x), ref, atol=1e-5)


@needs_onednn
def test_onednn_is_deterministic_and_row_independent() -> None:
    """The same operands give the same bits, and a row's result is the same whatever rows
    come with it (what keeps score's shards equal to a one-job run)."""
    torch.manual_seed(2)
    layer = torch.nn.Linear(64, 96)
    x = torch.randn(150, 64)
    cpu_matmul.install("onednn")
    with torch.no_grad():
        a, b, part = layer(x), layer(x.clone()), layer(x[:37].clone())
    assert torch.equal(a, b)
    assert torch.equal(a[:37], part)


@needs_onednn
def test_falls_back_to_torch_where_onednn_does_not_apply() -> None:
    """bf16 autocast, float64, and torch.func transforms take torch's own path: the same
    bits as without the switch."""
    torch.manual_seed(3)
    layer = torch.nn.Linear(24, 8)
    x = torch.randn(5, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto_ref = layer(x)
    f64 = layer.double()
    x64 = x.double()
    ref64 = f64(x64)
    layer = layer.float()
    params = dict(layer.named_parameters())

    def loss(p, row):
        return torch.func.functional_call(layer, p, (row[None],)).square().sum()

    vmapped_ref = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    cpu_matmul.install("onednn")
    assert onednn_calls(lambda: layer(x)) == 1

    def autocast_run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return layer(x)

    assert onednn_calls(autocast_run) == 0
    assert torch.equal(autocast_run(), auto_ref)
    assert torch.equal(layer.double()(x64), ref64)
    layer = layer.float()
    vmapped = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    assert all(torch.equal(vmapped[k], vmapped_ref[k]) for k in vmapped_ref)


@needs_onednn
def test_a_llama_trains_the_same_to_float_rounding() -> None:
    """A small Llama's loss and every parameter's gradient under oneDNN against torch's own
    kernels (both float32): relative differences at float rounding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(4)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         max_position_embeddings=64))
    ids = torch.randint(0, 97, (3, 20))

    def run():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return float(out.loss.detach()), [p.grad.clone() for p in model.parameters()]

    loss_ref, grads_ref = run()
    assert onednn_calls(run) == 0
    cpu_matmul.install("onednn")
    loss, grads = run()
    # 2 layers x 7 projections + the head, forward and two backward products each
    assert onednn_calls(run) == 3 * (2 * 7 + 1)
    assert abs(loss - loss_ref) <= 1e-5 * abs(loss_ref)
    for a, b in zip(grads_ref, grads):
        assert float((a - b).abs().max()) <= 1e-4 * float(a.abs().max()) + 1e-7

