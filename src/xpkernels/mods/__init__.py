r"""Mask and score mods for flex attention: written once in Python, traced, run on any backend.

A **mask mod** decides which (query, key) pairs attend; a **score mod**
rewrites each scaled score ``s = scale * q . k`` before the softmax::

    keep = mask_mod(b, h, q_idx, kv_idx)                # a condition
    s    = score_mod(s, b, h, q_idx, kv_idx)            # a number

``b`` is the batch index, ``h`` the query head, ``q_idx`` the query's
absolute position (``input_pos + row``) and ``kv_idx`` the key's position,
all 0-based. A mod may also take a keyword-only ``q_row``: the query's row in
this call (``q_idx - input_pos``), for tables laid out per call.

A mod is an ordinary Python function written with Python operators
(``+ - * / // % **``, comparisons, ``&`` ``|`` ``~`` on conditions) and the
helpers of this module (:func:`exp`, :func:`exp2`, :func:`log`, :func:`sqrt`,
:func:`sin`, :func:`cos`, :func:`tan`, :func:`tanh`, :func:`sigmoid`,
:func:`abs`, :func:`floor`, :func:`minimum`, :func:`maximum`, :func:`where`,
:func:`logical_and`, :func:`logical_or`, :func:`logical_not`). The NumPy
functions of the same names trace too (``np.exp``, ``np.exp2``, ``np.log``,
``np.sqrt``, ``np.sin``, ``np.cos``, ``np.tan``, ``np.tanh``, ``np.abs``,
``np.floor``, ``np.minimum``, ``np.maximum``, ``np.where``,
``np.logical_and/or/not``, and the ufuncs behind the operators, such as
``np.add`` and ``np.power``), as does ``math.floor``. :func:`floor` is the one
way from a float to an integer: its result can index a captured array, which
writes a T5-style log-bucket relative bias directly::

    def t5_bias(score, b, h, q_idx, kv_idx, *, table):   # table (H, 32)
        rel = abs(q_idx - kv_idx)                          # exact buckets below 8,
        far = maximum(floor(8 + log(maximum(rel, 1) / 8) / log(16) * 24), 8)
        return score + table[h, minimum(where(rel < 8, rel, far), 31)]  # log ones to 128

Exponents may be traced (``2.0 ** x``, ``x ** table[h]``); an integer power
with a traced exponent is a float. Arrays it reads
are passed by keyword and indexed with one integer expression per axis::

    def relative_bias(score, b, h, q_idx, kv_idx, *, table):
        return score + table[h, minimum(q_idx - kv_idx, 127)]

    mod = ScoreMod(relative_bias, table=table)          # table (H, 128)

xpkernels calls the function ONCE with symbolic arguments and records a
small expression graph (:class:`Graph`); an operation it cannot record raises
:class:`TraceError` right there, naming it. Kernels evaluate the graph
vectorised over tiles of (query, key) pairs on any Array API namespace, and
its reverse mode gives d(score out)/d(score in) and the gradients of every
captured float array, accumulated into ``grad_shadow(mod)``
(:class:`ScoreModGrad`). Every built-in mod is defined the same way.

Band masks (:class:`FullMask`, :class:`CausalMask`,
:class:`SlidingWindowMask`, :class:`PrefixMask` and their ``&`` / ``|``
compositions) also declare, per query, the range of keys they can keep and
the range they surely keep, so kernels skip tiles that are provably empty and
skip evaluating the mask on tiles that are provably full. Any other mask gets
the same benefit from a :class:`BlockMask` (:func:`build_block_mask`).
"""

# Names outside __all__ are imported as ``name as name``: the rest of xpkernels uses them.
from .bands import FULL as FULL
from .bands import PARTIAL as PARTIAL
from .bands import SKIP as SKIP
from .bands import TilePlan as TilePlan
from .bands import band_states as band_states
from .bands import plan_tiles as plan_tiles
from .block_mask import BlockMask, build_block_mask
from .block_mask import positions_of as positions_of
from .host import mask_value, score_grad, score_value
from .interpret import BoundGraph as BoundGraph
from .interpret import Grid as Grid
from .interpret import scatter_add as scatter_add
from .interpret import tile_grid as tile_grid
from .ir import BOOL as BOOL
from .ir import FLOAT as FLOAT
from .ir import INPUTS as INPUTS
from .ir import INT as INT
from .ir import INT64_MAX as INT64_MAX
from .ir import INT64_MIN as INT64_MIN
from .ir import Graph
from .ir import Node as Node
from .ir import Slot as Slot
from .ir import is_host_array as is_host_array
from .library import (
    AliBiScore,
    BiasScore,
    CausalMask,
    DocumentMask,
    FullMask,
    MaskMod,
    NoOpScore,
    PairFeatureScore,
    PrefixMask,
    ScoreMod,
    ScoreModGrad,
    SlidingWindowMask,
    SoftCapScore,
    prefix_lm,
)
from .library import AndMask as AndMask
from .library import CallShape as CallShape
from .library import OrMask as OrMask
from .library import ScoreChain as ScoreChain
from .library import as_mask_mod as as_mask_mod
from .library import as_score_mod as as_score_mod
from .trace import CapturedArray as CapturedArray
from .trace import Sym as Sym
from .trace import (
    TraceError,
    abs,
    cos,
    exp,
    exp2,
    floor,
    log,
    logical_and,
    logical_not,
    logical_or,
    maximum,
    minimum,
    sigmoid,
    sin,
    sqrt,
    tan,
    tanh,
    where,
)
from .trace import _scalar as _scalar

__all__ = [
    "TraceError",
    "exp",
    "exp2",
    "log",
    "tanh",
    "sqrt",
    "sin",
    "cos",
    "tan",
    "sigmoid",
    "abs",
    "floor",
    "minimum",
    "maximum",
    "where",
    "logical_and",
    "logical_or",
    "logical_not",
    "Graph",
    "MaskMod",
    "ScoreMod",
    "ScoreModGrad",
    "FullMask",
    "CausalMask",
    "SlidingWindowMask",
    "PrefixMask",
    "DocumentMask",
    "prefix_lm",
    "NoOpScore",
    "SoftCapScore",
    "AliBiScore",
    "BiasScore",
    "PairFeatureScore",
    "BlockMask",
    "build_block_mask",
    "mask_value",
    "score_value",
    "score_grad",
]
