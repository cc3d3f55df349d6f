"""The allocating fronts on torch tensors that need gradients, filed for the core.

:func:`xpkernels._autograd.record` hands a call here when autograd must see
it (or ``torch.compile`` traces it): :data:`FRONTS` maps each primitive to
the autograd front :mod:`~xpkernels.torch._declared` generates from its
signature, which checks the call's options, fixes its backend choice and
calls the primitive's functional op.

Importing this module files :data:`FRONTS` in :data:`xpkernels._autograd.RECORDERS`
(the core looks its recorders up there and never imports the torch layer).
"""

from __future__ import annotations

from .. import _autograd
from ._declared import FRONTS

__all__ = ["FRONTS"]

# The core's autograd hook (xpkernels._autograd.record) finds the fronts here: it never imports
# this layer itself; xpkernels._torch_plugin loads this module by name on the first recorded call.
_autograd.register_recorders(FRONTS)
