"""PyTorch integration: autograd, ``torch.compile`` and ``nn`` modules over xpkernels' kernels.

Importing this package imports torch (importing :mod:`xpkernels` does not)
and registers every primitive as ``torch.library`` custom ops in the
``xpkernels`` namespace (``torch.ops.xpkernels.rms_norm``...), each
generated from the primitive's declared signature (see
:mod:`xpkernels.torch._declared`). Nothing else is needed to train: the
allocating fronts (``xpkernels.rms_norm(x, w)``, ``xpkernels.attention(q,
k, v)``...) given torch tensors that require grad import it themselves and
record xpkernels' own backward, so ``loss.backward()`` runs xpkernels'
backward kernels and ``torch.compile(fullgraph=True)`` traces the calls as
single ops. (The core never imports this package: importing it, or the
first such call, loads :mod:`xpkernels.torch._fronts`, which files the
recorders :func:`xpkernels._autograd.record` looks up.)

- :mod:`xpkernels.torch.nn`: ``RMSNorm``, ``LayerNorm`` (drop-in for
  ``torch.nn.RMSNorm`` / ``torch.nn.LayerNorm``, same arguments and
  ``state_dict`` keys) and ``Attention`` (q/k/v/o projections, grouped-query
  heads, causal, optional score and mask mods).
- :mod:`xpkernels.torch.distributed`: ``ring_attention`` (context parallelism:
  one sequence sharded over the ranks of a process group) and its sharding
  helpers; imported on its own (``import xpkernels.torch.distributed``).
- :data:`ops`: ``torch.ops.xpkernels``, the op namespace.
"""

from __future__ import annotations

import torch

from . import _declared, _linear_ce, nn
from . import _fronts as _fronts  # files the autograd recorders in xpkernels._autograd

__all__ = ["nn", "ops", "OPS"]

#: The op namespace ``torch.ops.xpkernels``.
ops = torch.ops.xpkernels

#: Every op this package registers, by its name in the namespace (``"rms_norm"``, ``"rms_norm_"``...).
OPS = tuple(sorted((*_declared.OPS, _linear_ce.FUSED)))
