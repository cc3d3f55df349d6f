"""The causal-LM loss of transformers models on xpkernels' cross-entropy.

Two swaps, per model instance, for the families whose ``loss_type`` is
transformers' ``ForCausalLM`` (Llama, Qwen2/3, Mistral, Gemma 2/3, ...):

- :func:`causal_lm_loss` replaces ``model.loss_function`` (transformers'
  ``ForCausalLMLoss``): the same shift of the labels, ``ignore_index``,
  ``num_items_in_batch`` and ``shift_labels``, on
  :func:`xpkernels.cross_entropy`. It reads the logits in their own dtype
  (transformers first copies them to float32: ``N x V x 4`` bytes more) and
  its backward writes one ``N x V`` gradient.
- :func:`linear_loss_forward` replaces the instance's ``forward`` so that a
  call with labels never forms the logits: the last hidden states and the LM
  head's weight (and bias) go to :func:`xpkernels.linear_cross_entropy`, and
  the output carries ``logits=None``. What the class's forward does to the
  logits between its base model and its loss is read from its source
  (:func:`logit_steps`) and reproduced exactly: a scale of the logits (Cohere's
  ``logit_scale``, Granite's ``logits_scaling``) scales the hidden states and
  the bias, and a final softcap (Gemma 2's ``final_logit_softcapping``) is
  ``linear_cross_entropy``'s ``softcap``; a forward doing anything else keeps
  its own code. Calls without labels (generation, evaluation of logits), with
  ``logits_to_keep`` or ``return_dict=False`` run the class's own forward.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Any

import torch
from torch import nn

from ..cross_entropy import cross_entropy
from ..linear_cross_entropy import linear_cross_entropy

__all__ = ["causal_lm_loss", "linear_loss_forward", "logit_steps", "swap_loss"]

#: The loss transformers' causal-LM families compute, by its LOSS_MAPPING name.
CAUSAL_LM = "ForCausalLM"


def _targets(labels, shift_labels, ignore_index: int) -> torch.Tensor:
    """The next-token targets, flattened: ``shift_labels``, else ``labels`` shifted left by one
    with ``ignore_index`` at each sequence's end (transformers' shift)."""
    if shift_labels is None:
        padded = nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = padded[..., 1:]
    return shift_labels.reshape(-1)


def _reduced(loss_of, num_items_in_batch, device) -> torch.Tensor:
    """``loss_of(reduction)``: the mean, or the sum over ``num_items_in_batch`` when given."""
    if num_items_in_batch is None:
        return loss_of("mean")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(device)
    return loss_of("sum") / num_items_in_batch


def causal_lm_loss(
    logits,
    labels,
    vocab_size: int,
    num_items_in_batch=None,
    ignore_index: int = -100,
    shift_labels=None,
    **kwargs,
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` on :func:`xpkernels.cross_entropy` (float32 loss).

    Parameters
    ----------
    logits : torch.Tensor
        ``(B, S, V)`` (any float dtype; not copied to float32).
    labels : torch.Tensor
        ``(B, S)`` token ids, ``ignore_index`` where nothing is predicted.
    vocab_size : int
        ``V``.
    num_items_in_batch : int or torch.Tensor, optional
        Divide the summed loss by it (gradient accumulation) instead of
        taking the mean over the targets not ignored.
    ignore_index : int
        The label that counts for nothing.
    shift_labels : torch.Tensor, optional
        Targets already shifted (sequence parallelism); ``labels`` unused then.
    """
    targets = _targets(labels, shift_labels, ignore_index).to(logits.device)
    rows = logits.reshape(-1, vocab_size)

    def loss_of(reduction):
        return cross_entropy(rows, targets, ignore_index=ignore_index, reduction=reduction)

    return _reduced(loss_of, num_items_in_batch, logits.device)


_GEMMA_SOFTCAP = """if {cap} is not None:
    logits = logits{upcast} / {cap}
    logits = torch.tanh(logits)
    logits = logits * {cap}"""
_HEAD = (("head", ""),)

#: What each statement a causal LM's forward may run between its base model's call and its
#: loss does to the logits, by its source (``ast.unparse``: no comments): ``()`` nothing here
#: (slicing by ``logits_to_keep``, which is 0 where the loss is taken from the hidden states),
#: ``("head", "")`` the LM head on the hidden states (the loss is float32 whether or not the
#: logits are upcast), ``("multiply" or "divide", path)`` a scale of the logits and
#: ``("softcap", path)`` ``cap * tanh(logits / cap)``, ``path`` the model attribute holding
#: the value (dotted; none when it is None). Found in the installed transformers' families:
#: Cohere's ``logit_scale``, Granite's and Granite MoE's ``logits_scaling`` (a division),
#: HyperCLOVA X's (a product), Falcon-H1's ``lm_head_multiplier``, Gemma 2/3's softcap.
_LOGIT_STEPS: dict[str, tuple[tuple[str, str], ...]] = {
    "hidden_states = outputs.last_hidden_state": (),
    "hidden_states = outputs[0]": (),
    "hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)": (),
    "if hidden_states.shape[1] == (input_ids if input_ids is not None else inputs_embeds)"
    ".shape[1]:\n    hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)": (),
    "slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) "
    "else logits_to_keep": (),
    "logits = self.lm_head(hidden_states)": _HEAD,
    "logits = self.lm_head(hidden_states).float()": _HEAD,
    "logits = self.lm_head(hidden_states[:, slice_indices, :])": _HEAD,
    "logits = logits * self.logit_scale": (("multiply", "logit_scale"),),
    "if self.logit_scale is not None:\n    logits = logits * self.logit_scale": (
        ("multiply", "logit_scale"),
    ),
    "logits = logits / self.config.logits_scaling": (("divide", "config.logits_scaling"),),
    "logits = logits / self.config.text_config.logits_scaling": (
        ("divide", "config.text_config.logits_scaling"),
    ),
    "logits = self.lm_head(hidden_states) * self.config.logits_scaling": (
        *_HEAD,
        ("multiply", "config.logits_scaling"),
    ),
    "logits = self.lm_head(hidden_states) * self.config.text_config.logits_scaling": (
        *_HEAD,
        ("multiply", "config.text_config.logits_scaling"),
    ),
    "logits = self.lm_head(hidden_states) * self.model.lm_head_multiplier": (
        *_HEAD,
        ("multiply", "model.lm_head_multiplier"),
    ),
    _GEMMA_SOFTCAP.format(cap="self.config.final_logit_softcapping", upcast=""): (
        ("softcap", "config.final_logit_softcapping"),
    ),
    _GEMMA_SOFTCAP.format(cap="self.config.final_logit_softcapping", upcast=".float()"): (
        ("softcap", "config.final_logit_softcapping"),
    ),
}


def logit_steps(model: Any) -> tuple[tuple[tuple[str, str], ...], str]:
    """``(steps, "")``: what ``model``'s class forward does to the LM head's output before its
    loss (:data:`_LOGIT_STEPS`, the head itself left out), or ``((), why not)``.

    The statements between the forward's ``self.model(...)`` call and its loss must all be
    known, the LM head applied once, first, and a softcap, if any, last: scales before it
    are scales of the hidden states and the bias.
    """
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(type(model).forward)))
        function = ast.parse(source).body[0]
    except (OSError, TypeError, SyntaxError):
        return (), "the source of its forward is not available to check its logits"
    if not isinstance(function, ast.FunctionDef):
        return (), "the source of its forward is not available to check its logits"
    nodes = [
        statement
        for statement in function.body
        if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant))
    ]
    statements = [ast.unparse(statement) for statement in nodes]
    start = next((i for i, s in enumerate(statements) if "self.model(" in s), None)
    end = next(
        (i for i, s in enumerate(statements) if s == "loss = None" or "self.loss_function" in s),
        None,
    )
    if start is None or end is None or end < start:
        return (), "its forward does not call self.model before computing its loss"
    steps: list[tuple[str, str]] = []
    for statement in statements[start + 1 : end]:
        known = _LOGIT_STEPS.get(statement)
        if known is None:
            return (), (
                f"its forward computes the logits with {statement!r}, which xpkernels does not "
                "reproduce from the hidden states"
            )
        steps += known
    ops = [op for op, _ in steps]
    if ops[:1] != ["head"] or "head" in ops[1:] or "softcap" in ops[1:-1]:
        return (), "its forward does not apply the LM head once, then scales, then a softcap"
    for node, statement in zip(nodes[end:], statements[end:]):
        if not _plain_loss_statement(node, statement):
            return (), (
                f"its forward continues after its loss_function with {statement!r} (a router "
                "auxiliary loss, a z-loss...), which xpkernels does not reproduce"
            )
    return tuple(steps[1:]), ""


def _plain_loss_statement(node: ast.stmt, statement: str) -> bool:
    """Whether a statement from a forward's loss on is one :func:`linear_loss_forward` does
    too: ``loss = None``, ``loss = self.loss_function(...)`` when there are labels, the
    ``return_dict=False`` tuple (that call runs the class's forward) or the return."""
    if isinstance(node, ast.Return) or statement == "loss = None":
        return True
    if not isinstance(node, ast.If) or node.orelse:
        return False
    test = ast.unparse(node.test)
    if test == "not return_dict":
        return True
    only = node.body[0] if len(node.body) == 1 else None
    return (
        test == "labels is not None"
        and isinstance(only, ast.Assign)
        and ast.unparse(only.targets[0]) == "loss"
        and ast.unparse(only.value).startswith("self.loss_function(")
    )


def _attribute(model: Any, path: str) -> Any:
    value = model
    for name in path.split("."):
        value = getattr(value, name)
    return value


def _scale_and_softcap(model: Any, steps) -> tuple[float, float | None]:
    """The product of ``steps``' scales and their softcap (None: none), read from ``model``."""
    scale, softcap = 1.0, None
    for op, path in steps:
        value = _attribute(model, path)
        if value is None:
            continue
        if op == "multiply":
            scale *= float(value)
        elif op == "divide":
            scale /= float(value)
        else:
            softcap = float(value)
    return scale, softcap


def linear_loss_forward(
    self,
    steps,
    input_ids=None,
    attention_mask=None,
    position_ids=None,
    past_key_values=None,
    inputs_embeds=None,
    labels=None,
    use_cache=None,
    logits_to_keep=0,
    **kwargs,
):
    """The causal LM's forward with the loss from the hidden states: no logits with labels.

    ``steps`` (:func:`logit_steps`) are what the class's forward does to the LM
    head's output: ``logits * s`` runs as the LM head on ``s * hidden`` with the
    bias times ``s``, a final softcap as ``linear_cross_entropy``'s. Without
    labels (or ``shift_labels``), with ``logits_to_keep`` other than 0 or with
    ``return_dict=False``, the class's own forward runs unchanged.
    """
    shift_labels = kwargs.get("shift_labels")
    inputs = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        **kwargs,
    )
    plain = isinstance(logits_to_keep, int) and logits_to_keep == 0
    if (labels is None and shift_labels is None) or not plain or kwargs.get("return_dict") is False:
        return type(self).forward(self, labels=labels, logits_to_keep=logits_to_keep, **inputs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    outputs = self.model(**inputs)
    hidden = outputs.last_hidden_state
    ignore_index = kwargs.get("ignore_index", -100)
    targets = _targets(labels, shift_labels, ignore_index).to(hidden.device)
    head = self.lm_head
    rows, bias = hidden.reshape(-1, hidden.shape[-1]), head.bias
    scale, softcap = _scale_and_softcap(self, steps)
    if scale != 1.0:
        rows = rows * scale
        bias = None if bias is None else bias * scale

    def loss_of(reduction):
        return linear_cross_entropy(
            rows,
            head.weight,
            targets,
            bias,
            ignore_index=ignore_index,
            softcap=softcap,
            reduction=reduction,
        )

    loss = _reduced(loss_of, kwargs.get("num_items_in_batch"), hidden.device)
    return CausalLMOutputWithPast(
        loss=loss,
        logits=None,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )


def _forward_names(model) -> set[str]:
    """The global and attribute names the class's forward (under its decorators) reads."""
    code = getattr(inspect.unwrap(type(model).forward), "__code__", None)
    return set() if code is None else set(code.co_names)


def swap_loss(model: Any, linear: bool) -> tuple[str | None, str]:
    """Put ``model``'s causal-LM loss on xpkernels: ``("cross_entropy" or
    "linear_cross_entropy", "")``, or ``(None, why not)`` (``(None, "")`` for a model that
    computes no loss: not a transformers model, or one whose forward has no loss_function).

    transformers gives a causal LM the loss ``ForCausalLMLoss`` when its
    ``loss_type`` is ``"ForCausalLM"``, or None (GPT-2's: the default).
    """
    if not isinstance(getattr(type(model), "loss_function", None), property):
        return None, ""
    names = _forward_names(model)
    loss_type = getattr(model, "loss_type", None)
    if "loss_function" not in names:
        return None, ""
    if "_loss_function" in vars(model):
        return None, "its loss_function is already replaced"
    if loss_type not in (None, CAUSAL_LM):
        return None, f"its loss_type is {loss_type!r}, not {CAUSAL_LM!r}"
    if not linear:
        model.loss_function = causal_lm_loss
        return "cross_entropy", ""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear) or not isinstance(getattr(model, "model", None), nn.Module):
        return None, "no nn.Linear lm_head and base model: cannot form the loss from hidden states"
    if not {"model", "lm_head", "loss_function"} <= names:
        return None, "its forward does not call self.model, self.lm_head and self.loss_function"
    if "forward" in vars(model):
        return None, "its forward is already replaced on the instance"
    steps, why = logit_steps(model)
    if why:
        return None, why
    model.loss_function = causal_lm_loss
    model.forward = functools.partial(linear_loss_forward, model, steps)
    return "linear_cross_entropy", ""
