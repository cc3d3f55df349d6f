"""Hugging Face transformers models on xpkernels (``xpkernels.torch.transformers``), against their eager code.

Tiny random-weight models are built from configs (nothing is downloaded):
Llama, Qwen3, Mistral (sliding window), Gemma 2 (softcap, sliding window,
``1 + weight`` norms) and Gemma 3 (sliding and full layers); the SiLU MLPs
run on ``swiglu``, Gemma's ``gelu_pytorch_tanh`` ones on ``geglu``. Each runs
twice, once as transformers' ``attn_implementation="eager"`` and once after
``apply_xpkernels``, from the same weights; the array_api backend serves the
CPU tensors, the Triton interpreter one smallest case.
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import types
import warnings

import pytest

from xpkernels.testing import harness

harness.select_triton_interpreter()  # before any Triton kernel is defined

torch = pytest.importorskip("torch", reason="the transformers integration needs torch")
tf = pytest.importorskip("transformers", reason="transformers is not installed")

import xpkernels as xk
from xpkernels.torch import _hf_attention, _hf_loss, _hf_rope
from xpkernels.torch import nn as xnn
from xpkernels.torch import transformers as xt

SOURCE = os.path.dirname(os.path.dirname(os.path.abspath(xk.__file__)))

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    attn_implementation="eager",
)
_GEMMA = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=6)
FAMILIES = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(head_dim=16)),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, dict(sliding_window=6)),
    "gemma2": (
        tf.Gemma2Config,
        tf.Gemma2ForCausalLM,
        dict(_GEMMA, attn_logit_softcapping=5.0, final_logit_softcapping=30.0),
    ),
    "gemma3": (
        tf.Gemma3TextConfig,
        tf.Gemma3ForCausalLM,
        dict(_GEMMA, layer_types=["sliding_attention", "full_attention"]),
    ),
}
SEQ = 16
#: Each family's gated MLP activation as apply_xpkernels fuses it: swiglu, or geglu's approximate.
FUSED = {"llama": "silu", "qwen3": "silu", "mistral": "silu", "gemma2": "tanh", "gemma3": "tanh"}
MLPS = ["model.layers.0.mlp", "model.layers.1.mlp"]
ATTENTIONS = ["model.layers.0.self_attn", "model.layers.1.self_attn"]


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One intra-op thread: the models' products are tiny, and two threads per pytest-xdist
    worker on a shared two-core machine spin against each other (measured: a 64 x 64 matmul
    took 11.7 ms with two threads under load, 9 us with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _models(family, dtype=torch.float32, **config):
    """(eager reference, the same weights after apply_xpkernels), in train mode."""
    config_class, model_class, extra = FAMILIES[family]
    torch.manual_seed(0)
    ref = model_class(config_class(**{**_COMMON, **extra, **config}))
    with torch.no_grad():
        for p in ref.parameters():  # Gemma's norms start at 0: perturb every weight
            p.add_(0.05 * torch.randn_like(p))
    ref = ref.to(dtype)
    return ref, xt.apply_xpkernels(copy.deepcopy(ref))


#: apply_xpkernels' swaps, each of which the single-swap tests turn off but one.
_SWAPS = ("rms_norm", "layer_norm", "mlp", "attention", "rope", "loss")


def _swapped_only(model, swap, **options):
    """``apply_xpkernels`` on a copy of ``model`` with ``swap`` alone on (and ``options``)."""
    off = {name: False for name in _SWAPS if name != swap}
    return xt.apply_xpkernels(copy.deepcopy(model), **off, **options)


def _same_loss_and_gradients(ref, ours, ids, mask, labels):
    """Both models' outputs on the batch; loss and every parameter's gradient equal to 1e-10
    (float64 models)."""
    outputs = [model(ids, attention_mask=mask, labels=labels) for model in (ref, ours)]
    assert _rel(outputs[1].loss.detach(), outputs[0].loss.detach()) <= 1e-10
    for output in outputs:
        output.loss.backward()
    ours_params = dict(ours.named_parameters())
    for name, p in ref.named_parameters():
        assert _rel(ours_params[name].grad, p.grad) <= 1e-10, name
    return outputs


def _batch(padding, batch=3, seed=0):
    """Token ids and a 0/1 attention mask: no padding, left, right, or mixed (holes included)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (batch, SEQ), generator=g)
    mask = torch.ones(batch, SEQ, dtype=torch.long)
    if padding == "left":
        mask[1, :5] = mask[2, :2] = 0
    elif padding == "right":
        mask[1, 11:] = mask[2, 14:] = 0
    elif padding == "mixed":
        mask[1, :5] = mask[2, 12:] = 0
        mask[0, 6:8] = 0
    return ids, (None if padding == "none" else mask)


def _rel(got, want):
    return float((got - want).abs().max() / want.abs().max())


def _float64_softmax(monkeypatch):
    """Eager attention takes its softmax in float32 whatever the dtype: in float64 the
    reference runs it in float64, the accuracy 1e-10 asks of it."""
    softmax = torch.nn.functional.softmax
    monkeypatch.setattr(
        torch.nn.functional,
        "softmax",
        lambda x, dim, dtype=None: softmax(
            x, dim, dtype=x.dtype if x.dtype == torch.float64 else dtype
        ),
    )


class _Calls:
    """Counts the xpkernels entry points the integration calls."""

    NAMES = (
        "attention",
        "attention_varlen",
        "decode_attention",
        "flex_attention",
        "flex_attention_varlen",
    )

    def __init__(self, monkeypatch):
        self.seen: list[str] = []
        for name in self.NAMES:
            monkeypatch.setattr(_hf_attention, name, self._spy(name, getattr(_hf_attention, name)))

    def _spy(self, name, fn):
        def spy(*args, **kwargs):
            self.seen.append(name)
            return fn(*args, **kwargs)

        return spy


@pytest.mark.parametrize("padding", ["none", "left", "right", "mixed"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.float64, 1e-10)])
def test_logits_match_eager(family, padding, dtype, tolerance, monkeypatch):
    ref, ours = _models(family, dtype)
    ids, mask = _batch(padding)
    with torch.no_grad():
        got = ours(ids, attention_mask=mask).logits
        _float64_softmax(monkeypatch)
        want = ref(ids, attention_mask=mask).logits
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    assert _rel(got[real], want[real]) <= tolerance


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_error_at_most_twice_eagers_own(family):
    ref32, _ = _models(family)
    ref16, ours16 = _models(family, torch.bfloat16)
    ids, mask = _batch("left")
    real = mask.bool()
    with torch.no_grad():
        exact = ref32(ids, attention_mask=mask).logits[real]
        eager_error = (ref16(ids, attention_mask=mask).logits[real].float() - exact).abs().max()
        our_error = (ours16(ids, attention_mask=mask).logits[real].float() - exact).abs().max()
    assert our_error <= 2 * eager_error


def _labels(ids, mask):
    """Next-token labels; -100 at padding and at each row's first real token (a padded row's
    last pad predicts it, from an output eager and xpkernels define differently)."""
    if mask is None:
        return ids
    first = torch.nn.functional.pad(mask[:, :-1], (1, 0)) == 0
    return ids.masked_fill((mask == 0) | first, -100)


@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_gradient_matches_eager(family, padding):
    ref, ours = _models(family)
    ids, mask = _batch(padding)
    for model in (ref, ours):
        model(ids, attention_mask=mask, labels=_labels(ids, mask)).loss.backward()
    ours_params = dict(ours.named_parameters())
    for name, p in ref.named_parameters():
        assert ours_params[name].grad is not None, name
        assert _rel(ours_params[name].grad, p.grad) <= 1e-4, name


@pytest.mark.parametrize("family", FAMILIES)
def test_adamw_loss_curves_agree(family):
    ref, ours = _models(family)
    curves = []
    for model in (ref, ours):
        g = torch.Generator().manual_seed(1)
        optimiser = torch.optim.AdamW(model.parameters(), lr=1e-3)
        curve = []
        for _ in range(30):
            ids = torch.randint(0, 128, (2, SEQ), generator=g)
            loss = model(ids, labels=ids).loss
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            curve.append(loss.item())
        curves.append(torch.tensor(curve))
    assert _rel(curves[1], curves[0]) <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_gives_eagers_tokens(family, monkeypatch):
    ref, ours = _models(family)
    ref.eval(), ours.eval()
    ids, mask = _batch("left")
    options = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    want = ref.generate(ids, **options)
    calls = _Calls(monkeypatch)
    got = ours.generate(ids, **options)
    assert torch.equal(got, want)
    unpadded = ours.generate(ids[:1], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(unpadded, ref.generate(ids[:1], max_new_tokens=4, do_sample=False))
    assert "decode_attention" in calls.seen  # the unpadded one-token steps


@pytest.mark.parametrize(
    "family, padding, expected",
    [
        ("llama", "none", {"attention"}),
        ("llama", "left", {"attention"}),
        ("llama", "right", {"attention"}),
        ("llama", "mixed", {"attention"}),
        ("mistral", "none", {"flex_attention"}),
        ("gemma2", "left", {"flex_attention"}),
    ],
)
def test_each_mask_takes_its_path(family, padding, expected, monkeypatch):
    """Padding alone stays on attention's lengths (no mask mod); windows and softcaps use flex."""
    _, ours = _models(family)
    ids, mask = _batch(padding)
    calls = _Calls(monkeypatch)
    with torch.no_grad():
        ours(ids, attention_mask=mask)
    assert set(calls.seen) == expected


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_packed_sequences_run_varlen(family, monkeypatch):
    """position_ids restarts (and the cu_seq_lens kwargs of padding-free training) split the row."""
    ref, ours = _models(family, use_cache=False)
    ids = torch.randint(1, 128, (1, 20), generator=torch.Generator().manual_seed(2))
    position_ids = torch.tensor([[*range(7), *range(9), *range(4)]])
    cu = torch.tensor([0, 7, 16, 20], dtype=torch.int32)
    flash_kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9, max_length_k=9)
    calls = _Calls(monkeypatch)
    with torch.no_grad():
        want = ref(ids, position_ids=position_ids).logits
        assert _rel(ours(ids, position_ids=position_ids).logits, want) <= 1e-4
        assert _rel(ours(ids, position_ids=position_ids, **flash_kwargs).logits, want) <= 1e-4
    varlen = "attention_varlen" if family == "llama" else "flex_attention_varlen"
    assert set(calls.seen) == {varlen}


def test_norms_are_replaced_with_their_weights_and_gemma_offset():
    _, ours = _models("gemma2")
    report = ours.xpkernels_report
    norms = [m for m in ours.modules() if isinstance(m, xnn.RMSNorm)]
    assert len(report.rms_norm) == len(norms) == 9 and report.attention == "xpkernels"
    assert all(m.offset == 1.0 for m in norms) and report.rope == ATTENTIONS
    _, llama = _models("llama")
    assert all(m.offset == 0.0 for m in llama.modules() if isinstance(m, xnn.RMSNorm))
    assert ours.config._attn_implementation == "xpkernels"


@pytest.mark.parametrize(
    "family, config, fused",
    [(family, {}, FUSED[family]) for family in FAMILIES]
    + [
        ("llama", dict(hidden_act="gelu"), "none"),
        ("gemma2", dict(hidden_activation="gelu"), "none"),
    ],
    ids=[*FAMILIES, "llama-gelu", "gemma2-gelu"],
)
def test_gated_mlps_run_fused_with_their_weights(family, config, fused, monkeypatch):
    """Each MLP's forward runs swiglu or geglu (the config's GELU form) through xpkernels'
    backward, its class, weights and state_dict keys unchanged. Everything else left eager,
    float64 logits and every gradient are eager's to 1e-10 (the model-wide tests above check
    mlp=True beside xpkernels' norms and attention)."""
    ref, _ = _models(family, torch.float64, **config)
    ours = _swapped_only(ref, "mlp")
    report = ours.xpkernels_report
    assert report.mlp == MLPS and not report.skipped and "2 gated MLP fused" in str(report)
    for name in MLPS:
        module = ours.get_submodule(name)
        assert type(module) is type(ref.get_submodule(name))
        assert module.xpkernels_activation == fused
    assert list(ours.state_dict()) == list(ref.state_dict())
    assert all(torch.equal(ours.state_dict()[k], v) for k, v in ref.state_dict().items())
    kernel = "swiglu" if fused == "silu" else "geglu"
    options, backward = [], []
    front = getattr(xt, kernel)
    monkeypatch.setattr(xt, kernel, lambda a, b, **kw: options.append(kw) or front(a, b, **kw))
    for name in MLPS:
        ours.get_submodule(name).down_proj.register_forward_pre_hook(
            lambda _, args: backward.append(type(args[0].grad_fn).__name__)
        )
    _float64_softmax(monkeypatch)  # else eager's float32 softmax gives padded rows NaN
    ids, mask = _batch("left")
    real, labels = mask.bool(), _labels(ids, mask)
    outputs = [model(ids, attention_mask=mask, labels=labels) for model in (ref, ours)]
    got, want = (output.logits.detach()[real] for output in outputs[::-1])
    assert _rel(got, want) <= 1e-10
    assert options == [{} if fused == "silu" else {"approximate": fused}] * 2
    assert len(backward) == 2 and all(f"xpkernels_{kernel}" in b for b in backward)
    for output in outputs:
        output.loss.backward()
    ours_params = dict(ours.named_parameters())
    for name, p in ref.named_parameters():
        assert _rel(ours_params[name].grad, p.grad) <= 1e-10, name


def _float64_causal_loss(logits, labels, vocab_size, num_items_in_batch=None, **kwargs):
    """transformers' ForCausalLMLoss without its float32 copy of the logits (the float64
    reference the loss swap is held to)."""
    targets = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
    rows = logits.reshape(-1, vocab_size)
    if num_items_in_batch is None:
        return torch.nn.functional.cross_entropy(rows, targets)
    return torch.nn.functional.cross_entropy(rows, targets, reduction="sum") / num_items_in_batch


@pytest.mark.parametrize("logits", [True, False], ids=["loss-function", "logits-free"])
@pytest.mark.parametrize("family", FAMILIES)
def test_loss_runs_xpkernels_to_float64(family, logits, monkeypatch):
    """The causal-LM loss on xpkernels.cross_entropy (logits kept), or logits-free on
    linear_cross_entropy from the hidden states and the LM head (Gemma 2's final softcap
    included): float64 loss, with and without num_items_in_batch, and every gradient equal
    eager's to 1e-10, left padding in the labels; logits-free outputs carry no logits with
    labels and logits without them."""
    ref, _ = _models(family, torch.float64)
    ours = _swapped_only(ref, "loss", logits=logits)
    kernel = "cross_entropy" if logits else "linear_cross_entropy"
    assert ours.xpkernels_report.loss == kernel and not ours.xpkernels_report.skipped
    calls = []
    front = getattr(_hf_loss, kernel)
    monkeypatch.setattr(_hf_loss, kernel, lambda *a, **kw: calls.append(kw) or front(*a, **kw))
    ref.loss_function = _float64_causal_loss
    _float64_softmax(monkeypatch)
    ids, mask = _batch("left")
    labels = _labels(ids, mask)
    outputs = _same_loss_and_gradients(ref, ours, ids, mask, labels)
    assert (outputs[1].logits is None) == (not logits) and len(calls) == 1
    items = torch.tensor(7)
    with torch.no_grad():
        got, want = (
            model(ids, attention_mask=mask, labels=labels, num_items_in_batch=items).loss
            for model in (ours, ref)
        )
        assert _rel(got, want) <= 1e-10
        assert calls[-1]["reduction"] == "sum"
        assert ours(ids, attention_mask=mask).logits.shape == (3, SEQ, 128)


def test_loss_swap_reports_other_losses_and_a_replaced_forward():
    """A classification head's loss is not the causal LM's: reported, left alone; a forward
    already replaced on the instance keeps it (logits-free asked), reported."""
    config = tf.LlamaConfig(**_COMMON, num_labels=3)
    classifier = xt.apply_xpkernels(tf.LlamaForSequenceClassification(config), attention=False)
    assert classifier.xpkernels_report.loss is None
    assert ("loss", "its loss_type is 'ForSequenceClassification', not 'ForCausalLM'") in (
        classifier.xpkernels_report.skipped
    )
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**_COMMON))
    hooked = model.forward
    model.forward = hooked
    xt.apply_xpkernels(model, attention=False, logits=False)
    assert model.xpkernels_report.loss is None and model.forward == hooked
    assert ("loss", "its forward is already replaced on the instance") in (
        model.xpkernels_report.skipped
    )


def test_logits_free_training_compiles_without_graph_break():
    """torch.compile(fullgraph=True) of a logits-free Llama: the loss and gradients of the
    eager model in float32."""
    ref, _ = _models("llama", use_cache=False)
    ours = xt.apply_xpkernels(copy.deepcopy(ref), logits=False)
    assert ours.xpkernels_report.loss == "linear_cross_entropy"
    ids, _ = _batch("none", batch=2)
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    loss = compiled(ids, labels=ids).loss
    loss.backward()
    want = ref(ids, labels=ids).loss
    want.backward()
    assert _rel(loss.detach(), want.detach()) <= 1e-5
    ours_params = dict(ours.named_parameters())
    for name, p in ref.named_parameters():
        assert _rel(ours_params[name].grad, p.grad) <= 1e-4, name


#: Families whose forward scales the logits: Cohere by ``logit_scale``, Granite by
#: ``1 / logits_scaling``.
SCALED = {
    "cohere": (tf.CohereConfig, tf.CohereForCausalLM, dict(logit_scale=0.0625)),
    "granite": (tf.GraniteConfig, tf.GraniteForCausalLM, dict(logits_scaling=4.0)),
}


@pytest.mark.parametrize("family", SCALED)
def test_logits_free_loss_keeps_the_logit_scale(family, monkeypatch):
    """Logits-free, a family's scale of its logits (Cohere's logit_scale, Granite's
    logits_scaling) reaches linear_cross_entropy: float64 loss and every gradient equal
    eager's to 1e-10, with and without num_items_in_batch."""
    config_class, model_class, extra = SCALED[family]
    torch.manual_seed(0)
    ref = model_class(config_class(**{**_COMMON, **extra, "eos_token_id": 2})).to(torch.float64)
    ours = _swapped_only(ref, "loss", logits=False)
    assert ours.xpkernels_report.loss == "linear_cross_entropy"
    assert not ours.xpkernels_report.skipped
    ref.loss_function = _float64_causal_loss
    _float64_softmax(monkeypatch)
    ids, mask = _batch("left")
    labels = _labels(ids, mask)
    outputs = _same_loss_and_gradients(ref, ours, ids, mask, labels)
    assert outputs[1].logits is None
    with torch.no_grad():
        got, want = (
            model(ids, attention_mask=mask, labels=labels, num_items_in_batch=7).loss
            for model in (ours, ref)
        )
    assert _rel(got, want) <= 1e-10


def test_logits_free_loss_leaves_a_router_auxiliary_loss_to_the_model():
    """Mixtral adds its router's load-balancing loss after loss_function: logits-free would
    drop it, so the forward stays the model's (reported) and the loss with router logits on
    equals eager's."""
    config = tf.MixtralConfig(
        **_COMMON, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True
    )
    torch.manual_seed(0)
    ref = tf.MixtralForCausalLM(config)
    ours = xt.apply_xpkernels(copy.deepcopy(ref), attention=False, logits=False)
    assert "forward" not in vars(ours)
    assert any(
        what == "loss" and "continues after its loss_function with 'aux_loss = None'" in why
        for what, why in ours.xpkernels_report.skipped
    )
    ids, _ = _batch("none")
    want, got = (model(ids, labels=ids) for model in (ref, ours))
    assert got.aux_loss is not None
    assert _rel(got.loss.detach(), want.loss.detach()) <= 1e-5


def test_logits_free_loss_refuses_unknown_logit_code():
    """A forward doing to the logits what xpkernels does not reproduce from the hidden states
    keeps its own forward, reported (the loss function alone is not swapped either); the
    known steps are read from the families' source."""

    class Shifted(tf.LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            outputs = self.model(input_ids=input_ids, **kwargs)
            hidden_states = outputs.last_hidden_state
            logits = self.lm_head(hidden_states)
            logits = logits + 1.0
            loss = None
            if labels is not None:
                loss = self.loss_function(logits, labels, self.config.vocab_size)
            return tf.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)

    model = xt.apply_xpkernels(Shifted(tf.LlamaConfig(**_COMMON)), attention=False, logits=False)
    assert model.xpkernels_report.loss is None and "forward" not in vars(model)
    assert (
        "loss",
        "its forward computes the logits with 'logits = logits + 1.0', which xpkernels does not "
        "reproduce from the hidden states",
    ) in model.xpkernels_report.skipped
    assert _hf_loss.logit_steps(tf.GraniteForCausalLM(tf.GraniteConfig(**_COMMON))) == (
        (("divide", "config.logits_scaling"),),
        "",
    )
    gemma = FAMILIES["gemma2"]
    assert _hf_loss.logit_steps(gemma[1](gemma[0](**_COMMON))) == (
        (("softcap", "config.final_logit_softcapping"),),
        "",
    )


@pytest.mark.parametrize("load", ["to_empty", "assign"])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_model_built_on_meta_is_swapped_then_loaded(family, load):
    """A model built on the meta device (no kernel runs on its weights) gets the swaps the
    same model gets on the CPU; loaded afterwards (to_empty and load_state_dict, or
    load_state_dict(assign=True)), its logits, loss and every gradient are eager's."""
    config_class, model_class, extra = FAMILIES[family]
    ref, _ = _models(family)
    with torch.device("meta"):
        ours = model_class(config_class(**{**_COMMON, **extra}))
    xt.apply_xpkernels(ours, logits=False)
    want = xt.apply_xpkernels(copy.deepcopy(ref), logits=False).xpkernels_report
    assert ours.xpkernels_report == want and not want.skipped
    if load == "to_empty":
        ours.to_empty(device="cpu")
        ours.load_state_dict(ref.state_dict())
    else:
        ours.load_state_dict(copy.deepcopy(ref.state_dict()), assign=True)
    ours.tie_weights()  # both untie Gemma's embeddings and LM head: from_pretrained ties them
    for name, buffer in ref.named_buffers():  # not in the state dict: from_pretrained sets them
        parent, _, leaf = name.rpartition(".")
        setattr(ours.get_submodule(parent), leaf, buffer.clone())
    ids, mask = _batch("left")
    labels = _labels(ids, mask)
    assert _rel(ours(ids).logits.detach(), ref(ids).logits.detach()) <= 1e-4
    outputs = [model(ids, attention_mask=mask, labels=labels) for model in (ref, ours)]
    assert _rel(outputs[1].loss.detach(), outputs[0].loss.detach()) <= 1e-5
    for output in outputs:
        output.loss.backward()
    ours_params = dict(ours.named_parameters())
    for name, p in ref.named_parameters():
        assert _rel(ours_params[name].grad, p.grad) <= 1e-4, name


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_swapped_model_round_trips_pickle(how, monkeypatch):
    """A swapped model (fused MLPs, RoPE, logits-free loss) pickles and unpickles, also where
    the process has no RoPE replacement yet (as a new one): the copy's forwards are still
    xpkernels' (MLP, RoPE, loss, each bound to the copy's own modules) and give the original's
    loss and gradients."""
    ref, _ = _models("llama")
    ours = xt.apply_xpkernels(copy.deepcopy(ref), logits=False)
    if how == "pickle":
        blob = pickle.dumps(ours)
    else:
        buffer = io.BytesIO()
        torch.save(ours, buffer)
    module = __import__(type(ref).__module__, fromlist=["_"])
    monkeypatch.delattr(module, "_xpkernels_apply_rotary_pos_emb")
    if how == "pickle":
        loaded = pickle.loads(blob)
    else:
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
    assert loaded.xpkernels_report == ours.xpkernels_report
    assert module._xpkernels_apply_rotary_pos_emb.xpkernels_original is module.apply_rotary_pos_emb
    assert loaded.forward.func is _hf_loss.linear_loss_forward and loaded.forward.args[0] is loaded
    for name in MLPS:
        mlp = loaded.get_submodule(name)
        assert mlp.forward.func is xt._gated_mlp_forward and mlp.forward.args[0] is mlp
    for name in ATTENTIONS:
        attn = loaded.get_submodule(name)
        assert attn.forward.func.xpkernels_rope is type(attn).forward
        assert attn.forward.args[0] is attn
    calls = _RopeCalls(monkeypatch)
    ids, mask = _batch("left")
    labels = _labels(ids, mask)
    got = loaded(ids, attention_mask=mask, labels=labels)
    assert got.logits is None and len(calls.backward) == 4
    want = ours(ids, attention_mask=mask, labels=labels)
    assert _rel(got.loss.detach(), want.loss.detach()) <= 1e-6
    for output in (got, want):
        output.loss.backward()
    ours_params = dict(ours.named_parameters())
    for name, p in loaded.named_parameters():
        assert _rel(p.grad, ours_params[name].grad) <= 1e-6, name


class _RopeCalls:
    """The backward each output of the integration's ``xpkernels.rope`` calls records (two
    entries a call: q and k)."""

    def __init__(self, monkeypatch):
        self.backward: list[str] = []
        front = _hf_rope.rope

        def spy(*args, **kwargs):
            out = front(*args, **kwargs)
            self.backward += [type(o.grad_fn).__name__ for o in out]
            return out

        monkeypatch.setattr(_hf_rope, "rope", spy)


@pytest.mark.parametrize("family", FAMILIES)
def test_rope_runs_xpkernels_and_leaves_other_models_eager(family, monkeypatch):
    """With rope alone, each attention module's apply_rotary_pos_emb call runs xpkernels.rope
    (its backward too): float64 logits and every gradient are eager's to 1e-10. The eager
    model of the same family, in the same process, still runs transformers' function (no
    call reaches xpkernels.rope), and nothing of the modeling module is rebound."""
    ref, _ = _models(family, torch.float64)
    module = __import__(type(ref).__module__, fromlist=["_"])
    original = module.apply_rotary_pos_emb
    ours = _swapped_only(ref, "rope")
    report = ours.xpkernels_report
    assert report.rope == ATTENTIONS and not report.skipped
    assert "RoPE on xpkernels in 2 attention modules" in str(report)
    assert module.apply_rotary_pos_emb is original
    assert module._xpkernels_apply_rotary_pos_emb.xpkernels_original is original
    for name in ATTENTIONS:
        attn, eager_attn = ours.get_submodule(name), ref.get_submodule(name)
        assert type(attn) is type(eager_attn) and "forward" not in vars(eager_attn)
        assert attn.forward.func.xpkernels_rope is type(attn).forward
    assert list(ours.state_dict()) == list(ref.state_dict())
    calls = _RopeCalls(monkeypatch)
    _float64_softmax(monkeypatch)
    ids, mask = _batch("left")
    real, labels = mask.bool(), _labels(ids, mask)
    want = ref(ids, attention_mask=mask, labels=labels)
    assert calls.backward == []
    got = ours(ids, attention_mask=mask, labels=labels)
    assert len(calls.backward) == 4 and all("xpkernels_rope" in b for b in calls.backward)
    assert _rel(got.logits.detach()[real], want.logits.detach()[real]) <= 1e-10
    for output in (want, got):
        output.loss.backward()
    ours_params = dict(ours.named_parameters())
    for name, p in ref.named_parameters():
        assert _rel(ours_params[name].grad, p.grad) <= 1e-10, name


def test_rope_replacement_falls_back_where_it_cannot_express(monkeypatch):
    """Calls xpkernels.rope cannot express exactly run transformers' own function: the
    (B, S, H, D) layout with unsqueeze_dim=2, mixed dtypes, a rotary width under D (which
    transformers' Llama rejects as it would); an expressible call with a table broadcast
    over the batch runs xpkernels."""
    from transformers.models.llama import modeling_llama as ml

    _models("llama")  # adds the replacement beside the original
    patched, original = ml._xpkernels_apply_rotary_pos_emb, ml.apply_rotary_pos_emb
    calls = _RopeCalls(monkeypatch)
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(2, 5, 4, 8, generator=g), torch.randn(2, 5, 2, 8, generator=g)
    angles = torch.randn(1, 5, 4, generator=g)
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1) for f in (torch.cos, torch.sin))
    for got, want in zip(patched(q, k, cos, sin, 2), original(q, k, cos, sin, 2)):
        assert torch.equal(got, want)
    qt, kt = q.transpose(1, 2).double(), k.transpose(1, 2).double()
    for got, want in zip(patched(qt, kt, cos, sin), original(qt, kt, cos, sin)):
        assert torch.equal(got, want) and got.dtype == torch.float64
    assert calls.backward == []
    with pytest.raises(RuntimeError):
        patched(qt, kt, cos[..., :4].double(), sin[..., :4].double())
    assert calls.backward == []
    qt, kt = q.transpose(1, 2), k.transpose(1, 2)
    for got, want in zip(patched(qt, kt, cos, sin), original(qt, kt, cos, sin)):
        assert _rel(got, want) <= 1e-6
    assert len(calls.backward) == 2


def _toy_attention(apply_source):
    """An attention class defined in its own module namespace, calling that namespace's
    ``apply_rotary_pos_emb`` (given as source) as a transformers family does."""
    namespace = {"__name__": "toy_rope_family", "torch": torch}
    exec(
        apply_source
        + """
class ToyAttention(torch.nn.Module):
    def forward(self, q, k, cos, sin):
        return apply_rotary_pos_emb(q, k, cos, sin)
""",
        namespace,
    )
    return namespace["ToyAttention"]


_HALF = """
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    r = cos.shape[-1]
    def rotate(x):
        x1, x2, rest = x[..., : r // 2], x[..., r // 2 : r], x[..., r:]
        rot = torch.cat((-x2, x1), dim=-1)
        c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return torch.cat((x[..., :r] * c + rot * s, rest), dim=-1)
    return rotate(q), rotate(k)
"""
_INTERLEAVED = """
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    def rotate(x):
        c = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, -1).unsqueeze(unsqueeze_dim)
        s = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, -1).unsqueeze(unsqueeze_dim)
        rot = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
        return x * c + rot * s
    return rotate(q), rotate(k)
"""


def test_rope_families_are_probed_and_unsupported_ones_reported(monkeypatch):
    """A family whose apply_rotary_pos_emb rotates the first R < D features runs partial
    rotary on xpkernels; an interleaved one, and attention with no RoPE (GPT-2), are reported
    and keep their code. Applying twice changes nothing."""
    model = torch.nn.ModuleDict(
        {"partial": _toy_attention(_HALF)(), "interleaved": _toy_attention(_INTERLEAVED)()}
    )
    xt.apply_xpkernels(model, attention=False)
    report = model.xpkernels_report
    assert report.rope == ["partial"] and [name for name, _ in report.skipped] == ["interleaved"]
    assert "not the half rotation" in report.skipped[0][1]
    assert "forward" not in vars(model["interleaved"])
    calls = _RopeCalls(monkeypatch)
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 4, 3, 8, generator=g), torch.randn(2, 2, 3, 8, generator=g)
    angles = torch.randn(2, 3, 2, generator=g)
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1) for f in (torch.cos, torch.sin))
    reference = type(model["partial"])()
    for got, want in zip(model["partial"](q, k, cos, sin), reference(q, k, cos, sin)):
        assert _rel(got, want) <= 1e-6
    assert len(calls.backward) == 2  # one call: q and k
    forward = model["partial"].forward
    xt.apply_xpkernels(model, attention=False)
    assert model["partial"].forward == forward and model.xpkernels_report.rope == []
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128))
    xt.apply_xpkernels(gpt2, rms_norm=False, layer_norm=False, mlp=False, attention=False)
    assert gpt2.xpkernels_report.rope == []
    assert gpt2.xpkernels_report.skipped == [
        ("transformer.h.0.attn", "its forward calls no module-level apply_rotary_pos_emb")
    ]


def test_unsupported_activations_keep_eagers_mlp():
    """A ReLU-gated Llama keeps its MLPs, reported; mlp=False leaves them unreported."""
    ref, ours = _models("llama", hidden_act="relu")
    report = ours.xpkernels_report
    assert report.mlp == [] and [name for name, _ in report.skipped] == MLPS
    assert all("'relu'" in why for _, why in report.skipped)
    assert f"skipped {MLPS[0]}: activation 'relu'" in str(report)
    for name in MLPS:
        assert "forward" not in vars(ours.get_submodule(name))
    ids, mask = _batch("left")
    with torch.no_grad():
        got, want = (m(ids, attention_mask=mask).logits for m in (ours, ref))
    assert _rel(got[mask.bool()], want[mask.bool()]) <= 1e-4
    kept = xt.apply_xpkernels(copy.deepcopy(ref), mlp=False).xpkernels_report
    assert kept.mlp == [] and kept.skipped == [] and len(kept.rms_norm) == 5


def test_gated_mlp_is_found_by_structure_not_class():
    """Any class with the four attributes is fused when its config and probes agree; another
    forward, or an act_fn its config does not name, is left alone and reported."""

    class Gated(torch.nn.Module):
        def __init__(self, act, act_fn):
            super().__init__()
            self.config = types.SimpleNamespace(hidden_act=act)
            self.gate_proj, self.up_proj = torch.nn.Linear(8, 16), torch.nn.Linear(8, 16)
            self.down_proj, self.act_fn = torch.nn.Linear(16, 8), act_fn

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    class ActAfterProduct(Gated):
        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x) * self.up_proj(x)))

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        Gated("silu", torch.nn.SiLU()),
        ActAfterProduct("silu", torch.nn.SiLU()),
        Gated("gelu_pytorch_tanh", torch.nn.GELU()),  # exact GELU, though the config says tanh
    ).eval()
    ref = copy.deepcopy(model)
    xt.apply_xpkernels(model, attention=False)
    report = model.xpkernels_report
    assert report.mlp == ["0"] and [name for name, _ in report.skipped] == ["1", "2"]
    assert "down_proj(act_fn(gate_proj(x)) * up_proj(x))" in report.skipped[0][1]
    assert "act_fn does not compute" in report.skipped[1][1]
    assert not any(m.training for m in model.modules())  # the probe's train mode undone
    x = torch.randn(3, 8)
    got, want = (m(x) for m in (model, ref))
    assert _rel(got.detach(), want.detach()) <= 1e-6
    for y in (got, want):
        y.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert _rel(p.grad, q.grad) <= 1e-6, name


def test_layer_norms_shared_and_unknown_norms_reported():
    class OddRMSNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8))
            self.eps = 1e-6

        def forward(self, x):
            return x * self.weight

    model = torch.nn.Sequential(torch.nn.LayerNorm(8), OddRMSNorm())
    weight = model[0].weight
    xt.apply_xpkernels(model, attention=False)
    assert type(model[0]) is xnn.LayerNorm and model[0].weight is weight
    assert model.xpkernels_report.layer_norm == ["0"]
    assert [name for name, _ in model.xpkernels_report.skipped] == ["1"]
    assert isinstance(model[1], OddRMSNorm)


def test_what_xpkernels_cannot_express_runs_sdpa_with_one_warning():
    """A 4-D mask from the caller goes to SDPA (warned once); the answer stays eager's."""
    ref, ours = _models("llama")
    ids, mask = _batch("left")
    keep = mask.bool()[:, None, None, :] & torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    mask4 = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    _hf_attention._WARNED.clear()
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = ours(ids, attention_mask=mask4).logits
        ours(ids, attention_mask=mask4)
        want = ref(ids, attention_mask=mask4).logits
    sdpa = [w for w in caught if "SDPA" in str(w.message)]
    assert len(sdpa) == 1
    assert _rel(got[mask.bool()], want[mask.bool()]) <= 1e-4


def test_custom_and_static_cache_recipes_get_sdpas_mask():
    from transformers import masking_utils as mu

    def odd(b, h, q_idx, kv_idx):
        return kv_idx % 2 == 0

    _hf_attention._WARNED.clear()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        custom = xt.mask_function(2, 4, 4, mask_function=mu.and_masks(odd), use_vmap=True)
        static = xt.mask_function(2, 1, 8, q_offset=3, mask_function=mu.causal_mask_function)
    assert custom.shape == (2, 1, 4, 4) and static.shape == (2, 1, 1, 8)
    assert static[0, 0, 0].tolist() == [True] * 4 + [False] * 4


def test_dropout_is_refused():
    _, ours = _models("llama", attention_dropout=0.1)
    ids, _ = _batch("none")
    with pytest.raises(ValueError, match="dropout"):
        ours(ids)


def test_register_makes_the_name_loadable():
    xt.register()
    config_class, model_class, extra = FAMILIES["llama"]
    config = config_class(**{**_COMMON, **extra, "attn_implementation": xt.NAME})
    model = model_class(config)
    assert model.config._attn_implementation == "xpkernels"
    model(torch.randint(0, 128, (1, 8))).logits.sum().backward()


def test_compile_forward_backward_has_no_graph_break():
    ref, ours = _models("llama", use_cache=False)
    assert ours.xpkernels_report.mlp == MLPS  # swiglu inside the graph too
    assert ours.xpkernels_report.rope == ATTENTIONS  # and rope
    ids, _ = _batch("none", batch=2)
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")  # inductor adds 40 s
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = compiled(ids, labels=ids).loss
        loss.backward()
    assert not [w for w in caught if os.path.abspath(w.filename).startswith(SOURCE)]
    want = ref(ids, labels=ids).loss
    want.backward()
    assert _rel(loss.detach(), want.detach()) <= 1e-5
    ours_params = dict(ours.named_parameters())
    for name, p in ref.named_parameters():
        assert _rel(ours_params[name].grad, p.grad) <= 1e-4, name


@pytest.mark.parametrize(
    "family, config", [("gemma2", {}), ("llama", dict(hidden_act="gelu"))], ids=["tanh", "exact"]
)
def test_compiled_geglu_mlp_has_no_graph_break(family, config):
    """geglu in a compiled MLP (the full-model compile test covers swiglu): one graph, eager's
    output and gradients."""
    ref, ours = (m.model.layers[0].mlp for m in _models(family, **config))
    x = torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(3))
    xs = [x.clone().requires_grad_() for _ in range(2)]
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = compiled(xs[1])
        got.sum().backward()
    assert not [w for w in caught if os.path.abspath(w.filename).startswith(SOURCE)]
    want = ref(xs[0])
    want.sum().backward()
    assert _rel(got.detach(), want.detach()) <= 1e-5
    assert _rel(xs[1].grad, xs[0].grad) <= 1e-5
    ours_params = dict(ours.named_parameters())
    for name, p in ref.named_parameters():
        assert _rel(ours_params[name].grad, p.grad) <= 1e-5, name


def test_triton_interpreter_serves_the_smallest_model():
    pytest.importorskip("triton", reason="triton is not installed")
    ref, ours = _models("llama", num_hidden_layers=1)
    ids, mask = _batch("left")
    labels = _labels(ids, mask)
    ref(ids, attention_mask=mask, labels=labels).loss.backward()
    with xk.use_backend("triton"):
        loss = ours(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
    ours_params = dict(ours.named_parameters())
    for name, p in ref.named_parameters():
        assert _rel(ours_params[name].grad, p.grad) <= 1e-4, name


def test_example_trains_both_models_alike(capsys):
    """examples/hf_train.py, three steps: both curves printed, equal to float32 rounding."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "examples", "hf_train.py")
    spec = importlib.util.spec_from_file_location("hf_train", os.path.normpath(path))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    eager, ours = example.main(steps=3)
    assert len(eager) == len(ours) == 3
    assert _rel(torch.tensor(ours), torch.tensor(eager)) <= 1e-5
    assert "xpkernels" in capsys.readouterr().out
