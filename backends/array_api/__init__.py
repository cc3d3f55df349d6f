"""The portable fallback, written against the Array API standard.

Runs unchanged on NumPy, PyTorch (any device), CuPy and array_api_strict
arrays. Rows and attention tiles are processed in blocks so the extra memory
of a call is bounded by ``_blocks.BLOCK_ELEMENTS``, not by the input size.
"""

from xpkernels.backends.protocol import ANY, FLOAT_DTYPES, Backend, Capability

_NORM = Capability(dtypes=FLOAT_DTYPES, hooks=("partials", "reduce_partials"))

#: The declaration routing reads (``xpkernels.backends.protocol``).
BACKEND = Backend(
    name="array_api",
    namespaces=ANY,
    devices=ANY,
    module=__name__,
    ops={
        "rms_norm": _NORM,
        "layer_norm": _NORM,
        "softmax": Capability(dtypes=FLOAT_DTYPES),
        "swiglu": Capability(dtypes=FLOAT_DTYPES),
        "geglu": Capability(dtypes=FLOAT_DTYPES),
        "rope": Capability(dtypes=FLOAT_DTYPES),
        "cross_entropy": Capability(dtypes=FLOAT_DTYPES),
        "attention": Capability(dtypes=FLOAT_DTYPES),
        "attention_varlen": Capability(dtypes=FLOAT_DTYPES),
        "decode_attention": Capability(dtypes=FLOAT_DTYPES, hooks=("default_splits",)),
        "flex_attention": Capability(dtypes=FLOAT_DTYPES, hooks=("default_tiles",)),
        "flex_attention_varlen": Capability(dtypes=FLOAT_DTYPES, hooks=("default_tiles",)),
        "merge_attention_states": Capability(dtypes=FLOAT_DTYPES),
    },
)
