"""Each primitive's arguments, declared once: :class:`Arg`, :class:`Option`, :class:`Signature`
and :data:`SIGNATURES`, the record of every primitive.

:mod:`xpkernels.backends.protocol` builds its :class:`~xpkernels.backends.protocol.Primitive`
entries on these; everything that restates a primitive's arguments (fronts, torch ops,
backend parameters, generated error cases) reads them from there. Imports no array library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "GELU_APPROXIMATIONS",
    "REDUCTIONS",
    "ROWS",
    "SIGNATURES",
    "Arg",
    "Option",
    "Signature",
]


@dataclass(frozen=True)
class Arg:
    """One array argument of a primitive, as its :class:`Signature` declares it.

    Attributes
    ----------
    name : str
        The argument's name in the forward (``x``, ``w``, ``y``...); its
        Duplicated in the backward is the upper-case name (``X``, ``W``, ``Y``).
    shape : str
        Its shape pattern: ``"... M"`` (any leading axes, then the row
        length), ``"M"``, ``"rows"`` (one per row of the ``... M`` arrays),
        ``"P M"`` (any ``P >= 1`` rows of partial sums), or symbols one per
        axis (see :class:`Signature`).
    optional : bool
        None is accepted (an input the call does without: no weight).
    aliases : tuple of str
        For an output: the inputs it may be the very same array as. For an
        input: the outputs whose shadow its shadow may be, in the backward,
        or its own name: its shadow may be its primal (the gradient written
        over the input, as cross-entropy's over its logits).
    recorded : str or None
        For an optional input: the key under which checkpoints record whether
        the forward had it (a backward must match).
    of : str or None
        For a scratch array: the input whose gradient it holds partial sums of.
    dtype : str
        ``"float"`` (any float dtype of the backend), ``"int32"`` (prefix
        sums) or ``"index"`` (int32 or int64: lengths, page tables).
    grad : bool
        For an input: the backward takes it as a Duplicated and writes its
        gradient into the shadow (False for integer arrays).
    """

    name: str
    shape: str
    optional: bool = False
    aliases: tuple[str, ...] = ()
    recorded: str | None = None
    of: str | None = None
    dtype: str = "float"
    grad: bool = True


@dataclass(frozen=True)
class Option:
    """One keyword option of a primitive's forward.

    Attributes
    ----------
    name : str
        The keyword.
    default : object
        Its default in the fronts.
    rule : str
        What values it takes, checked by the fronts and typed in the torch
        ops' schemas by this one name: ``"positive_finite"`` (a float, finite
        and > 0), ``"finite"`` (a float), ``"bool"``, ``"scale"`` (None, meaning
        ``1/sqrt(D)``, or positive_finite), ``"position"`` (an int, or a
        ``(B,)`` integer array; flex also takes a list of B ints),
        ``"lengths"`` (None or a ``(B,)`` integer array), ``"int_or_none"``,
        ``"float_or_none"``, ``"gelu_approximate"`` (one of
        :data:`GELU_APPROXIMATIONS`), ``"page_table"`` (None or a ``(B, pages)`` integer
        array), ``"score_mod"``, ``"mask_mod"``, ``"block_mask"``
        (mod objects, :mod:`xpkernels.mods`), ``"score_mod_grad"`` (a
        ScoreModGrad the backward adds into).
    backward : bool
        The backward takes it too.
    applies_to : str or None
        An optional input without which the option must keep its default.
    forward : bool
        The forward takes it (False: a backward-only option, such as
        ``deterministic``).
    recorded : bool
        For an option both passes take: checkpoints record its forward
        value, and a backward given another raises.
    """

    name: str
    default: Any
    rule: str
    backward: bool = False
    applies_to: str | None = None
    forward: bool = True
    recorded: bool = True


@dataclass(frozen=True)
class Signature:
    """A primitive's arguments, declared once.

    Everything that restates them is driven by this record: the fronts'
    validation, labelled arrays and allocators (``xpkernels._declared`` for
    the row primitives, ``xpkernels._attention_front`` for the attention
    family), the torch.library schemas, fakes and autograd
    (``xpkernels.torch``), the conformance suite's generic error cases
    (``xpkernels.testing``), the tolerance table and the benchmark lists.

    Shape patterns name each axis by a symbol; one symbol is one extent
    across every array of the call: ``"B H Sq D"`` and ``"B Hkv Sk D"``
    share ``B`` and ``D``. ``"... M"`` is any leading axes then the row
    length (the row primitives), ``"rows"`` one entry per row of those,
    ``"P M"`` any ``P >= 1`` rows of partial sums, ``"B+1"`` the prefix
    sums of ``B`` sequences, ``"N"`` a 1-D workspace of any length. RoPE's
    tables ``"Pmax R2"`` hold ``R2`` rotated pairs at each of ``Pmax``
    positions (its front also takes them per batch, ``(B, Pmax, R2)``).

    For the row primitives the backend modules receive, in this order:
    forward ``(outputs, inputs, checkpoints, **options)``; backward
    ``(read outputs, output cotangents, read inputs, checkpoints, input
    gradients, **backward options)``, where an input of shape ``"M"`` has
    its gradient as partial sums in scratch (``accumulate=`` then says
    whether to add to them). The attention family's take ``(o, q, k, v, m,
    l, **kernel options)`` and ``(do, q, k, v, o, m, l, dq, dk, dv, delta,
    dq_accum, **kernel options)``; :func:`module_functions` spells both out.

    Attributes
    ----------
    title : str
        The primitive's name in prose and in its generated classes (``RMSNorm``
        gives ``RMSNormCheckpoints`` and ``RMSNormBackwardScratch``).
    inputs, outputs : tuple of Arg
        The forward's arrays, in their positional order; the first input is
        the lead (its shape and dtype make the allocating forward's outputs).
    checkpoints : tuple of Arg
        What the forward saves for the backward (float32).
    scratch : tuple of Arg
        The backward's scratch (the accumulation dtype); for a forward-only
        primitive, the forward's.
    options : tuple of Option
        Keyword options.
    reads : tuple of str
        The primals the backward reads (inputs or outputs).
    kind : str
        ``"rows"`` (``... M`` arrays, fronts driven by ``xpkernels._declared``),
        ``"attention"`` (the attention family's front core), ``"decode"``,
        ``"merge"`` or ``"rope"`` (fronts written out, declaration used by the
        torch layer and the conformance suite).
    """

    title: str
    inputs: tuple[Arg, ...]
    outputs: tuple[Arg, ...]
    checkpoints: tuple[Arg, ...] = ()
    scratch: tuple[Arg, ...] = ()
    options: tuple[Option, ...] = ()
    reads: tuple[str, ...] = ()
    kind: str = "rows"

    def option(self, name: str) -> Option:
        """The declared option ``name``."""
        return next(o for o in self.options if o.name == name)


#: Row length and leading axes of the row primitives' arrays.
ROWS = "... M"

SIGNATURES = {
    "rms_norm": Signature(
        title="RMSNorm",
        inputs=(Arg("x", ROWS, aliases=("y",)), Arg("w", "M", optional=True, recorded="weight")),
        outputs=(Arg("y", ROWS, aliases=("x",)),),
        checkpoints=(Arg("rstd", "rows"),),
        scratch=(Arg("dw_partial", "P M", of="w"),),
        options=(
            Option("eps", 1e-6, "positive_finite"),
            Option("offset", 0.0, "finite", backward=True, applies_to="w"),
        ),
        reads=("x", "w"),
    ),
    "layer_norm": Signature(
        title="LayerNorm",
        inputs=(
            Arg("x", ROWS, aliases=("y",)),
            Arg("w", "M", optional=True, recorded="weight"),
            Arg("b", "M", optional=True),
        ),
        outputs=(Arg("y", ROWS, aliases=("x",)),),
        checkpoints=(Arg("mean", "rows"), Arg("rstd", "rows")),
        scratch=(Arg("dw_partial", "P M", of="w"), Arg("db_partial", "P M", of="b")),
        options=(Option("eps", 1e-5, "positive_finite"),),
        reads=("x", "w"),
    ),
    "softmax": Signature(
        title="Softmax",
        inputs=(Arg("x", ROWS, aliases=("y",)),),
        outputs=(Arg("y", ROWS, aliases=("x",)),),
        reads=("y",),
    ),
    "swiglu": Signature(
        title="SwiGLU",
        inputs=(Arg("a", ROWS, aliases=("y",)), Arg("b", ROWS, aliases=("y",))),
        outputs=(Arg("y", ROWS, aliases=("a", "b")),),
        reads=("a", "b"),
    ),
    "geglu": Signature(
        title="GeGLU",
        inputs=(Arg("a", ROWS, aliases=("y",)), Arg("b", ROWS, aliases=("y",))),
        outputs=(Arg("y", ROWS, aliases=("a", "b")),),
        options=(Option("approximate", "tanh", "gelu_approximate", backward=True),),
        reads=("a", "b"),
    ),
}

SIGNATURES["rope"] = Signature(
    title="RoPE",
    inputs=(
        Arg("q", "B H S D", aliases=("q_out",)),
        Arg("k", "B Hkv S D", aliases=("k_out",)),
        Arg("cos", "Pmax R2", grad=False),
        Arg("sin", "Pmax R2", grad=False),
        Arg("position_ids", "B S", optional=True, dtype="index", grad=False),
    ),
    outputs=(Arg("q_out", "B H S D", aliases=("q",)), Arg("k_out", "B Hkv S D", aliases=("k",))),
    options=(Option("interleaved", False, "bool", backward=True),),
    reads=("cos", "sin"),
    kind="rope",
)

SIGNATURES["cross_entropy"] = Signature(
    title="CrossEntropy",
    inputs=(
        Arg("logits", "T V", aliases=("logits",)),
        Arg("targets", "T", dtype="index", grad=False),
    ),
    outputs=(Arg("loss", ""),),
    checkpoints=(Arg("lse", "T"),),
    options=(
        Option("ignore_index", -100, "int", backward=True),
        Option("label_smoothing", 0.0, "probability", backward=True),
        Option("softcap", None, "positive_or_none", backward=True),
        Option("reduction", "mean", "reduction", backward=True),
        Option("z_loss", 0.0, "non_negative", backward=True),
    ),
    reads=("logits", "targets"),
    kind="cross_entropy",
)

SIGNATURES["linear_cross_entropy"] = Signature(
    title="LinearCrossEntropy",
    inputs=(
        Arg("x", "T H"),
        Arg("weight", "V H"),
        Arg("targets", "T", dtype="index", grad=False),
        Arg("bias", "V", optional=True, recorded="bias"),
    ),
    outputs=(Arg("loss", ""),),
    checkpoints=(Arg("lse", "T"),),
    options=SIGNATURES["cross_entropy"].options,
    reads=("x", "weight", "targets", "bias"),
    kind="cross_entropy",
)

#: The values of a ``"reduction"`` option: per row, their sum, or their mean over the rows
#: not ignored, as ``torch.nn.functional.cross_entropy``'s ``reduction``.
REDUCTIONS = ("mean", "sum", "none")

#: The values of a ``"gelu_approximate"`` option: GELU exactly (``"none"``, through erf) or
#: its tanh form (``"tanh"``), as ``torch.nn.functional.gelu``'s ``approximate``.
GELU_APPROXIMATIONS = ("none", "tanh")

#: The attention family's arrays: padded ``(B, H, S, D)`` and packed ``(T, H, D)`` layouts.
_PADDED = (Arg("q", "B H Sq D"), Arg("k", "B Hkv Sk D"), Arg("v", "B Hkv Sk Dv"))
_PACKED = (
    Arg("q", "Tq H D"),
    Arg("k", "Tk Hkv D"),
    Arg("v", "Tk Hkv Dv"),
    Arg("cu_seqlens_q", "B+1", dtype="int32", grad=False),
    Arg("cu_seqlens_k", "B+1", dtype="int32", grad=False),
)


def _attention(title, packed: bool, options, flex: bool) -> Signature:
    rows = "H Tq" if packed else "B H Sq"
    workspace = (Arg("score_mod_workspace", "N", optional=True),) if flex else ()
    return Signature(
        title=title,
        inputs=_PACKED if packed else _PADDED,
        outputs=(Arg("o", "Tq H Dv" if packed else "B H Sq Dv"),),
        checkpoints=(Arg("m", rows), Arg("l", rows)),
        scratch=(
            Arg("delta", rows),
            Arg("dq_accum", "Tq H D" if packed else "B H Sq D", optional=True),
            *workspace,
        ),
        options=options,
        reads=("q", "k", "v", "o"),
        kind="attention",
    )


_SCALE = Option("scale", None, "scale", backward=True)
_POSITION = Option("input_pos", 0, "position", backward=True)
_MAX_SEQLENS = (
    Option("max_seqlen_q", None, "int_or_none", backward=True, recorded=False),
    Option("max_seqlen_k", None, "int_or_none", backward=True, recorded=False),
)
_CAUSAL = Option("causal", False, "bool", backward=True)
_MODS = (
    Option("score_mod", None, "score_mod", backward=True),
    Option("mask_mod", None, "mask_mod", backward=True),
)
_MOD_BACKWARD = (
    Option("score_mod_grad", None, "score_mod_grad", backward=True, forward=False),
    Option("deterministic", True, "bool", backward=True, forward=False),
)
_SPARSE = Option("block_sparse", True, "bool", backward=True, recorded=False)

SIGNATURES.update(
    attention=_attention(
        "Attention",
        packed=False,
        options=(
            _CAUSAL,
            _SCALE,
            _POSITION,
            Option("q_lengths", None, "lengths", backward=True),
            Option("k_lengths", None, "lengths", backward=True),
        ),
        flex=False,
    ),
    attention_varlen=_attention(
        "AttentionVarlen",
        packed=True,
        options=(*_MAX_SEQLENS, _CAUSAL, _SCALE, _POSITION),
        flex=False,
    ),
    flex_attention=_attention(
        "FlexAttention",
        packed=False,
        options=(
            *_MODS,
            Option("block_mask", None, "block_mask", backward=True),
            _SPARSE,
            _SCALE,
            _POSITION,
            *_MOD_BACKWARD,
        ),
        flex=True,
    ),
    flex_attention_varlen=_attention(
        "FlexAttentionVarlen",
        packed=True,
        options=(*_MAX_SEQLENS, *_MODS, _SPARSE, _SCALE, _POSITION, *_MOD_BACKWARD),
        flex=True,
    ),
    decode_attention=Signature(
        title="DecodeAttention",
        inputs=(
            Arg("q", "B H D"),
            Arg("k_cache", "B Hkv Smax D"),
            Arg("v_cache", "B Hkv Smax Dv"),
            Arg("lengths", "B", dtype="index", grad=False),
        ),
        outputs=(Arg("o", "B H Dv"),),
        scratch=(
            Arg("o_partial", "B H N Dv"),
            Arg("m_partial", "B H N"),
            Arg("l_partial", "B H N"),
        ),
        options=(
            Option("block_table", None, "page_table"),
            _SCALE,
            Option("softcap", None, "float_or_none"),
            Option("window", None, "int_or_none"),
            Option("n_splits", None, "int_or_none"),
        ),
        kind="decode",
    ),
    merge_attention_states=Signature(
        title="MergeAttentionStates",
        inputs=(
            Arg("o_a", "B H S Dv", aliases=("o",)),
            Arg("m_a", "B H S", aliases=("m",)),
            Arg("l_a", "B H S", aliases=("l",)),
            Arg("o_b", "B H S Dv", aliases=("o",)),
            Arg("m_b", "B H S", aliases=("m",)),
            Arg("l_b", "B H S", aliases=("l",)),
        ),
        outputs=(
            Arg("o", "B H S Dv", aliases=("o_a", "o_b")),
            Arg("m", "B H S", aliases=("m_a", "m_b")),
            Arg("l", "B H S", aliases=("l_a", "l_b")),
        ),
        reads=("o", "m", "l", "o_a", "m_a", "l_a", "o_b", "m_b", "l_b"),
        kind="merge",
    ),
)
