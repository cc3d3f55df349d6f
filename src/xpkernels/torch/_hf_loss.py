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
  head's weight (and bias) go to :func:`xpkernels.linear_cross_entropy`, with
  the family's ``final_logit_softcapping`` as its ``softcap``, and the output
  carries ``logits=None``. Calls without labels (generation, evaluation of
  logits), with ``logits_to_keep`` or ``return_dict=False`` run the class's
  own forward.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch
from torch import nn

from ..cross_entropy import cross_entropy
from ..linear_cross_entropy import linear_cross_entropy

__all__ = ["causal_lm_loss", "linear_loss_forward", "swap_loss"]

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


def _softcap(model) -> float | None:
    config = model.config.get_text_config()
    cap = getattr(config, "final_logit_softcapping", None)
    return None if cap is None else float(cap)


def linear_loss_forward(
    self,
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

    Without labels (or ``shift_labels``), with ``logits_to_keep`` other than 0
    or with ``return_dict=False``, the class's own forward runs unchanged.
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
    rows = hidden.reshape(-1, hidden.shape[-1])

    def loss_of(reduction):
        return linear_cross_entropy(
            rows,
            head.weight,
            targets,
            head.bias,
            ignore_index=ignore_index,
            softcap=_softcap(self),
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
    if "final_logit_softcapping" not in names and _softcap(model) is not None:
        return None, "its config softcaps the logits but its forward does not read the cap"
    model.loss_function = causal_lm_loss
    model.forward = types.MethodType(linear_loss_forward, model)
    return "linear_cross_entropy", ""
