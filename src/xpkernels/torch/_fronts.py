"""The allocating fronts on torch tensors that need gradients, filed for the core.

:func:`xpkernels._autograd.record` hands a call here when autograd must see
it (or ``torch.compile`` traces it): :data:`FRONTS` maps each primitive to
the autograd front :mod:`~xpkernels.torch._declared` generates from its
signature, which checks the call's options, fixes its backend choice and
calls the primitive's functional op (linear cross-entropy's reduced losses
take :mod:`~xpkernels.torch._linear_ce`'s op, which forms the gradients in
the forward).

Importing this module files :data:`FRONTS` in :data:`xpkernels._autograd.RECORDERS`
(the core looks its recorders up there and never imports the torch layer).
"""

from __future__ import annotations

from .. import _autograd
from . import _declared, _linear_ce

__all__ = ["FRONTS"]

#: Primitive -> autograd front: the generated ones, linear cross-entropy's choosing its fused
#: op for reduced losses (:mod:`._linear_ce`).
FRONTS = {**_declared.FRONTS, "linear_cross_entropy": _linear_ce.record}

# The core's autograd hook (xpkernels._autograd.record) finds the fronts here: it never imports
# this layer itself; xpkernels._torch_plugin loads this module by name on the first recorded call.
_autograd.register_recorders(FRONTS)
