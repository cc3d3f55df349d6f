"""Backend implementations, one subpackage per backend and one module per primitive.

Backends receive validated arrays from the front files in ``xpkernels`` and
never allocate what the caller can own. ``protocol`` is the contract: what a
backend declares (``BACKEND`` in its package: namespaces, devices,
requirements, per-op capabilities, hooks and scratch, its device check) and
what each of its op modules provides. ``xpkernels.registry`` lists the
backend packages and routes calls by asking their declarations.

The package is also callable: ``xpkernels.backends()`` lists every declared
backend, whether it is available here and why not (``registry.backends``).
"""

import sys
import types


class _BackendsPackage(types.ModuleType):
    def __call__(self):
        """Every declared backend, whether it is available here, and why not."""
        from xpkernels.registry import backends

        return backends()


sys.modules[__name__].__class__ = _BackendsPackage
