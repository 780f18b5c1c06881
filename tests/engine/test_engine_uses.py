"""Every use of a parameter reaches the norms exactly once (DESIGN §18-19), against the float64 per-example oracle.

- A module that uses a tensor it also returns (an MoE router routing with the logits it returns, eager attention
  applying the weights it returns) must not have that internal use counted twice.
- A caller that writes a hooked output in place (`h /= 2`, `h[:, 0] = 0`) must not lose the layer.
- A refusal leaves `p.grad` as it was.
- MoE models of transformers (routers, fused and eager experts, shared experts) are exact per parameter.
"""

import copy

import pytest
import torch
from helpers.models import causal_batches, causal_loss, gpt2, padded_ids
from helpers.oracle import check_clipper, oracle_clipped
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, T5Config, T5ForConditionalGeneration

from hf_dp import BookKeepingClipper
from hf_dp.engine import SelfCheckError
from hf_dp.layers import UnsupportedModuleError

MODES = ["bk", "bk-mixopt", "per-sample", "ghost"]


def _loss(model, batch):
    y = model(batch["x"])
    dims = tuple(range(1, y.dim()))
    return (y**2).sum(dims) + y.sum(dims)


def _batches():
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(3, 5, 4, generator=g, dtype=torch.float64)}]


class OwnWeightRouter(nn.Module):
    """Returns its logits and the routing weights it computes from them (the torch.func fallback covers it)."""

    def __init__(self, d: int, experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, d))

    def forward(self, h):
        logits = h @ self.weight.T
        return logits, logits.sigmoid()


class LinearRouter(nn.Module):
    def __init__(self, d: int, experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d, experts)

    def forward(self, h):
        logits = self.gate(h)
        return logits, logits.softmax(-1)


class Routed(nn.Module):
    def __init__(self, router: type, use_logits: bool) -> None:
        super().__init__()
        self.inp, self.router, self.out = nn.Linear(4, 6), router(6, 3), nn.Linear(3, 2)
        self.use_logits = use_logits

    def forward(self, x):
        logits, weights = self.router(self.inp(x))
        return self.out(weights + logits.tanh() if self.use_logits else weights)


class Passthrough(nn.Module):
    """Returns its input beside its own output; the caller uses the input again (a residual)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(6))

    def forward(self, h):
        return h, h * self.scale


class WithPassthrough(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(4, 6), Passthrough(), nn.Linear(6, 2)

    def forward(self, x):
        h = self.inp(x)
        _, y = self.mid(h)
        return self.out(h + y)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("router", [OwnWeightRouter, LinearRouter])
@pytest.mark.parametrize("use_logits", [False, True])
def test_module_that_uses_an_output_it_returns(float64, mode, router, use_logits):
    torch.manual_seed(0)
    check_clipper(Routed(router, use_logits), _batches(), _loss, mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_an_output_that_is_the_input(float64, mode):
    torch.manual_seed(0)
    check_clipper(WithPassthrough(), _batches(), _loss, mode=mode)


class WrittenInPlace(nn.Module):
    """A trainable layer before the written one, so that the written output carries a graph of its own."""

    def __init__(self, write: str) -> None:
        super().__init__()
        self.inp, self.lin, self.out = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 2)
        self.write = write

    def forward(self, x):
        h = self.lin(self.inp(x))  # [B, T, d] input: F.linear returns a view of its [B*T, d] result
        if self.write == "divide":
            h /= 2.0
        elif self.write == "masked":
            h[:, 0] = 0.0
        elif self.write == "view":
            h[..., :3].mul_(3.0)
        return self.out(h)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("write", ["divide", "masked", "view"])
def test_caller_writes_a_closed_form_output_in_place(float64, mode, write):
    torch.manual_seed(0)
    clipper = check_clipper(WrittenInPlace(write), _batches(), _loss, mode=mode)
    assert "lin" in clipper.rules_used


class RouterWrittenInPlace(Routed):
    def forward(self, x):
        logits, weights = self.router(self.inp(x))
        logits *= 2.0  # the fallback's aliased output, written in place
        return self.out(weights + logits)


@pytest.mark.parametrize("mode", MODES)
def test_caller_writes_a_fallback_output_in_place(float64, mode):
    """The fallback's output is a copy of its own: its hook survives the write (Falcon adds the attention output into
    the MLP's in place), and the module's own use of the tensor is still counted once."""
    torch.manual_seed(0)
    check_clipper(RouterWrittenInPlace(OwnWeightRouter, False), _batches(), _loss, mode=mode)


class NoGradBranch(nn.Module):
    """A trainable layer called under `torch.no_grad()` (DeepSeek-V3.2's indexer scores top-k tokens this way)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.scorer, self.out = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, x):
        h = self.inp(x)
        with torch.no_grad():
            weights = self.scorer(h).softmax(-1)
        return self.out(h * weights)


@pytest.mark.parametrize("mode", MODES)
def test_a_call_under_no_grad_gets_no_gradient_like_autograd(float64, mode):
    torch.manual_seed(0)
    model = NoGradBranch().double()
    batches = _batches()
    names, norms, expected, c = oracle_clipped(model, batches, _loss, None)
    clipper = BookKeepingClipper(model, max_grad_norm=c, mode=mode)
    clipper.backward(_loss(model, batches[0]))
    torch.testing.assert_close(clipper.per_example_norms, norms[0], rtol=1e-6, atol=0)
    for name, p in model.named_parameters():
        if name.startswith("scorer."):
            assert expected[name].abs().max() == 0 and (p.grad is None or p.grad.abs().max() == 0), name
        else:
            torch.testing.assert_close(p.grad, expected[name], rtol=1e-6, atol=1e-12, msg=name)
    clipper.remove()


class UnknownCheckpoint(NoGradBranch):
    """A checkpoint function of its own: the forward without gradients, the call recomputed in the backward."""

    def forward(self, x):
        block = self.scorer

        class Recompute(torch.autograd.Function):
            @staticmethod
            def forward(ctx, h):
                ctx.save_for_backward(h)
                return block(h)

            @staticmethod
            def backward(ctx, grad):
                (h,) = ctx.saved_tensors
                with torch.enable_grad():
                    h = h.detach().requires_grad_()
                    torch.autograd.backward(block(h), grad)
                return h.grad

        return self.out(Recompute.apply(self.inp(x)))


@pytest.mark.parametrize("mode", MODES)
def test_a_checkpoint_function_hf_dp_does_not_know_is_refused(float64, mode):
    """Its recomputation gives the parameters an autograd gradient outside the hooks: refused, never a silent 0."""
    torch.manual_seed(0)
    model = UnknownCheckpoint().double()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0, mode=mode)
    with pytest.raises(UnsupportedModuleError, match="checkpoint function hf_dp does not know"):
        clipper.backward(_loss(model, _batches()[0]))
    assert model.scorer.weight.grad is None
    clipper.remove()


class BatchSizedTable(nn.Module):
    """Takes the batch size, not a batched tensor (Perceiver's trainable positions, ProphetNet's positions)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(5, 4))

    def forward(self, batch_size: int):
        return self.table.expand(batch_size, -1, -1)


class WithBatchSizedTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.positions, self.inp, self.out = BatchSizedTable(), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x) + self.positions(x.shape[0])))


@pytest.mark.parametrize("mode", MODES)
def test_a_module_given_the_batch_size_builds_each_examples_rows(float64, mode):
    """Its re-run (inputs shared) returns the whole batch's rows; each example's gradient is that of its own rows."""
    torch.manual_seed(0)
    check_clipper(WithBatchSizedTable(), _batches() + _batches(), _loss, mode=mode)


class WindowBias(nn.Module):
    """A bias shared by every window of every example (Swin's relative position bias): ``[1, w, w]``, no input."""

    def __init__(self, w: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(1, w, w))

    def forward(self):
        return self.table * 1.0


class WindowAttention(nn.Module):
    def __init__(self, d: int, w: int) -> None:
        super().__init__()
        self.bias, self.proj = WindowBias(w), nn.Linear(d, d)

    def forward(self, h):  # [B * windows, w, d]
        scores = h @ h.transpose(1, 2) + self.bias()
        return self.proj(scores.softmax(-1) @ h)


class Windowed(nn.Module):
    """Two stages with 4 and 2 windows per example: each bias is expanded to its own stage's rows per example."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.first, self.second = nn.Linear(4, 4), WindowAttention(4, 2), WindowAttention(4, 4)

    def forward(self, x):  # [B, 8, 4]
        b = x.shape[0]
        h = self.first(self.inp(x).reshape(b * 4, 2, 4)).reshape(b, 8, 4)
        return self.second(h.reshape(b * 2, 4, 4)).reshape(b, 8, 4)


@pytest.mark.parametrize("mode", MODES)
def test_shared_biases_over_a_different_number_of_rows_per_stage(float64, mode):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(3, 8, 4, generator=g, dtype=torch.float64)} for _ in range(2)]
    check_clipper(Windowed(), batches, _loss, mode=mode)


class LossUsesAWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(4, 6), nn.Linear(6, 2)

    def forward(self, x):
        return self.out(self.lin(x))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("had_grad", [False, True])
def test_a_refused_bypass_leaves_no_unclipped_gradient(float64, mode, had_grad):
    """A parameter used in the loss, outside the forward pass: refused; in ghost mode every p.grad is restored, in
    the one-backward modes a p.grad that was empty is empty again (autograd's sum never stays)."""
    torch.manual_seed(0)
    model = LossUsesAWeight().double()
    if had_grad:
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.5)
    before = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    clipper = BookKeepingClipper(model, max_grad_norm=1.0, mode=mode)
    batch = _batches()[0]
    with pytest.raises(UnsupportedModuleError, match="outside the model's forward pass|no hooked module accounts"):
        clipper.backward(_loss(model, batch) + (model.out.weight**2).sum())
    for n, p in model.named_parameters():
        if before[n] is None:
            assert p.grad is None, n
        elif mode == "ghost" or n != "out.weight":
            torch.testing.assert_close(p.grad, before[n], rtol=0, atol=0, msg=n)
    clipper.remove()


def test_self_check_fails_a_small_doubled_parameter_in_float32():
    """A parameter whose norm is far below the total's float32 tolerance, doubled: a check of the total (or of
    errors relative to the total) passes; the per-parameter check fails it, and passes the engine as it is."""
    torch.manual_seed(0)
    model = gpt2().float()
    batch = causal_batches()[0]
    clipper = BookKeepingClipper(model, max_grad_norm=1.0, mode="bk-mixopt")
    assert clipper.self_check(batch, causal_loss) < 1e-3  # the engine as it is passes
    true_norms = clipper._parameter_norms(batch, causal_loss)
    total = torch.sqrt(sum(n.double() ** 2 for n in true_norms.values()))
    share = {q: float((n.double() / total).max()) for q, n in true_norms.items()}
    small = min((q for q in share if share[q] > 1e-4), key=share.get)
    assert share[small] < 1e-3, "the doubled parameter must hide under the total's tolerance"
    honest = clipper._parameter_norms

    def doubled(inputs, loss_fn):
        norms = honest(inputs, loss_fn)
        norms[small] = 2 * norms[small]
        return norms

    clipper._parameter_norms = doubled
    name = next(n for n, p in model.named_parameters() if p is small)
    with pytest.raises(SelfCheckError, match=name.replace(".", r"\.")):
        clipper.self_check(batch, causal_loss)
    clipper.remove()


# ---------------------------------------------------------------------------------------------- transformers models
def _lm_batch():
    ids, mask = padded_ids([6, 4, 6], 6, seed=3)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _moe(model_type: str, experts_implementation: str | None):
    cfg = AutoConfig.for_model(
        model_type,
        vocab_size=23,
        hidden_size=16,
        intermediate_size=24,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_local_experts=4,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
        pad_token_id=0,
    )
    kwargs = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, **kwargs)


def _exact_per_parameter(model, batches, loss_fn, mode, rel):
    """Every parameter's clipped sum and every example's norm against the oracle in the model's own dtype."""
    names, norms, expected, c = oracle_clipped(model, batches, loss_fn, None)
    clipper = BookKeepingClipper(model, max_grad_norm=c, mode=mode)
    for batch, norm in zip(batches, norms, strict=True):
        clipper.backward(loss_fn(model, batch))
        torch.testing.assert_close(clipper.per_example_norms, norm, rtol=rel, atol=0)
    params = dict(model.named_parameters())
    for name in names:
        err = float((params[name].grad - expected[name]).norm())
        assert err <= rel * float(expected[name].norm()) + 1e-12, f"{name}: relative error {err:.2e}"
    clipper.remove()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_moe_with_fused_experts_float32(mode, model_type):
    """transformers' default grouped_mm experts run in float32 only: routers and experts exact per parameter."""
    model = _moe(model_type, None).float()
    _exact_per_parameter(model, [_lm_batch()], causal_loss, mode, rel=2e-4)


@pytest.mark.parametrize("mode", ["bk", "bk-mixopt", "per-sample", "ghost"])
@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_moe_with_eager_experts_float64(float64, mode, model_type):
    """The eager experts loop over the experts the batch hits (data-dependent): matched on the modules with
    parameters, exact in float64."""
    model = _moe(model_type, "eager").double()
    check_clipper(model, [_lm_batch(), _lm_batch()], causal_loss, mode=mode)


def _t5_eager():
    cfg = T5Config(
        vocab_size=23, d_model=16, d_kv=8, d_ff=24, num_layers=1, num_heads=2, dropout_rate=0.0, pad_token_id=0
    )
    cfg.decoder_start_token_id = 0
    torch.manual_seed(0)
    return T5ForConditionalGeneration(cfg).train()


def _t5_loss(model, batch):
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    logp = out.logits.log_softmax(-1)
    labels = batch["labels"]
    picked = logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    return -(picked * (labels != -100)).sum(1)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_t5_attention_weights_returned_and_applied(float64, mode, attn):
    """T5's attention (a fallback for its relative bias) returns the weights it applies under eager attention."""
    model = _t5_eager()
    model.config._attn_implementation = attn
    for module in model.modules():
        if hasattr(module, "config") and module is not model:
            module.config._attn_implementation = attn
    ids, mask = padded_ids([6, 4, 5], 6, seed=1)
    labels, label_mask = padded_ids([3, 2, 3], 3, seed=2)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels.masked_fill(label_mask == 0, -100)}
    check_clipper(copy.deepcopy(model), [batch], _t5_loss, mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_lora_on_moe_routers_and_experts(float64, mode):
    """peft's `all-linear` wraps the router and each 3-D expert tensor in a `ParamWrapper` (the experts' two
    wrappers nested): the inner wrapper's re-run alone would miss the outer's patch, so the outer one covers both."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        _moe("mixtral", "eager").double(), LoraConfig(r=2, lora_alpha=4, target_modules="all-linear")
    )
    wrapped = {type(m).__name__ for m in model.modules()}
    assert "ParamWrapper" in wrapped
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if p.requires_grad and "lora_B" in name:
            nn.init.normal_(p, std=0.1)  # peft starts B at 0: the A gradients would vanish
    check_clipper(model, [_lm_batch(), _lm_batch()], causal_loss, mode=mode)
