"""The backend contract: what a backend declares, and what each of its op modules provides.

A backend is a package ``xpkernels.backends.<name>`` whose ``__init__``
defines ``BACKEND``, a :class:`Backend` declaration, and imports nothing
heavy (routing reads it without importing torch, triton or cupy). Beside it,
one module ``<name>/<op>.py`` per op it declares, providing:

- ``forward`` and, where the primitive has one, ``backward``, with the
  parameters :meth:`Primitive.functions` gives (derived from the op's
  declared :class:`Signature`, or its Protocol class for the three irregular
  ops, :class:`DecodeAttentionModule`, :class:`MergeAttentionStatesModule`,
  :class:`RopeModule` and :class:`CrossEntropyModule`);
- any of the op's optional hooks (:data:`PRIMITIVES`), each declared in the
  backend's :class:`Capability` ``hooks``; an undeclared hook is replaced by
  the default defined here, whose signature is the hook's contract;
- nothing else is called by the fronts. Which optional scratch fields its
  passes use is declared in ``Capability.scratch`` (attention's ``dq_accum``
  is one: Triton computes dQ in its own pass); the fronts allocate only the
  fields used, a scratch NamedTuple holds None for the others, and a
  caller's scratch is accepted when every field the backend uses is present.

Routing asks the declaration, never names a backend: :meth:`Backend.supports`
answers a :class:`Call` (namespace, device, dtypes, head dim, the per-call
features of :data:`FEATURES` it asks for) with a
:class:`Support` and its reason, from the declared namespaces, devices,
requirements and capabilities, then the backend's own ``device_problem``
(for example "set TRITON_INTERPRET=1" for triton on CPU tensors).
``tests/test_protocol.py`` walks every declared backend and op against this
contract.

A new backend (cupy, say) writes ``backends/cupy/__init__.py`` with
``BACKEND = Backend(name="cupy", namespaces=("cupy",), devices=("cuda",),
module="xpkernels.backends.cupy", requires=("cupy",), ops={...},
device_problem=...)``, one module per op with ``forward``/``backward`` and
the hooks it declares, and adds its package to ``registry.BACKEND_PACKAGES``.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "ANY",
    "FEATURES",
    "FLOAT_DTYPES",
    "GELU_APPROXIMATIONS",
    "REDUCTIONS",
    "OPS",
    "PRIMITIVES",
    "Backend",
    "Call",
    "Capability",
    "Arg",
    "Option",
    "Primitive",
    "Signature",
    "Support",
    "DecodeAttentionModule",
    "MergeAttentionStatesModule",
    "RopeModule",
    "CrossEntropyModule",
    "default_splits",
    "module_functions",
    "default_tiles",
    "partials",
    "reduce_partials",
]

#: Floating dtype names a capability may list.
FLOAT_DTYPES = ("float64", "float32", "float16", "bfloat16")
#: ``namespaces`` / ``devices`` value of a backend that serves any.
ANY = ("*",)


@dataclass(frozen=True)
class Support:
    """A backend's answer to "can you serve this call?": truthy when it can, else the reason."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


@dataclass(frozen=True)
class Call:
    """What a backend is told about a call when asked whether it supports it.

    Attributes
    ----------
    namespace : str
        The arrays' namespace (``registry.namespace_name``: numpy, torch, cupy...).
    device : str
        The arrays' device kind (``registry.device_kind``: cpu, cuda...).
    dtypes : tuple of str
        The floating dtypes among the call's arrays.
    head_dim : int or None
        Largest attention head dim (D or Dv) of the call; None for other ops.
    features : tuple of str
        What the call asks beyond its arrays (names from :data:`FEATURES`).
    """

    namespace: str
    device: str
    dtypes: tuple[str, ...] = ()
    head_dim: int | None = None
    features: tuple[str, ...] = ()


#: Per-call features a backend's op may lack (``Capability.lacks``), with what each asks.
FEATURES = {
    "deterministic_score_mod_grad": (
        "bit-identical score-mod gradients (deterministic=True with score_mod_grad)"
    ),
}


# -- What each primitive's backend module provides -------------------------------------------
# Array arguments arrive validated (shapes, dtypes, a contiguous last axis);
# outputs and shadows are overwritten in full. Checkpoint arguments are None
# for inference. The row primitives and the attention family take the
# parameters their Signature implies (:func:`module_functions`); the three
# irregular ones are written out as Protocol classes below.


class DecodeAttentionModule(Protocol):
    """Split-KV decode attention (forward only)."""

    def forward(
        self,
        o,
        q,
        k,
        v,
        lengths,
        o_partial,
        m_partial,
        l_partial,
        *,
        scale,
        softcap,
        window,
        block_table,
    ) -> None: ...


class MergeAttentionStatesModule(Protocol):
    """The exact merge of two attention states ``(o, m, l)`` over disjoint key sets."""

    def forward(self, o, m, l, o_a, m_a, l_a, o_b, m_b, l_b) -> None:
        """An output may be the very same array as the same-named input of either side."""

    def backward(
        self, do, dlse, o, m, l, o_a, m_a, l_a, o_b, m_b, l_b, do_a, dlse_a, do_b, dlse_b
    ) -> None:
        """``dlse`` None means zero; ``do_a``/``do_b`` may be ``do``, ``dlse_a``/``dlse_b`` ``dlse``."""


class RopeModule(Protocol):
    """Rotary position embeddings of one ``(B, H, S, D)`` array (the front calls it for ``q``,
    then for ``k``), with the tables ``cos``, ``sin`` as ``(B, P, R2)`` views (a broadcast
    table has batch stride 0) and ``position_ids`` None or ``(B, S)`` integers in ``[0, P)``."""

    def forward(self, out, x, cos, sin, position_ids, *, interleaved) -> None:
        """``out`` may be the very same array as ``x``."""

    def backward(self, dx, dout, cos, sin, position_ids, *, interleaved) -> None:
        """The inverse rotation of ``dout``; ``dx`` may be the very same array as ``dout``."""


class CrossEntropyModule(Protocol):
    """Cross-entropy of ``(N, V)`` logit rows against ``(N,)`` integer targets, row by row.

    Row ``r`` with target ``t`` (an int32 or int64 array, any stride) sees the
    logits ``z = softcap * tanh(x / softcap)`` (``z = x`` when ``softcap`` is
    None) and loses ``(1 - eps) (lse - z[t]) + eps (lse - mean(z)) + z_loss *
    lse**2``, ``lse = log(sum(exp(z)))``, ``eps = label_smoothing``; a row whose
    target is ``ignore_index`` loses 0 and gets a zero gradient. A target
    outside ``[0, V)`` that is not ``ignore_index`` gives that row a NaN loss
    and NaN gradient (the fronts refuse such targets first where their values
    are on the host). ``loss``, ``lse`` and ``grad`` are ``(N,)`` float32
    (float64 for float64 logits); computation in the same dtype.
    """

    def forward(
        self, loss, lse, logits, targets, *, ignore_index, label_smoothing, softcap, z_loss
    ) -> None:
        """Each row's loss and ``lse`` (written on ignored rows too)."""

    def backward(
        self, dlogits, logits, targets, lse, grad, *, ignore_index, label_smoothing, softcap, z_loss
    ) -> None:
        """``dlogits[r] = grad[r] * d loss[r] / d logits[r]`` from the forward's ``lse``;
        ``grad`` may have stride 0 (one weight for all rows); ``dlogits`` may be the very
        same array as ``logits`` (the gradient replaces the logits)."""


# -- Optional hooks: each default below is also the hook's signature -------------------------


def partials(rows: int, m: int, like) -> int:
    """Rows ``P`` of a norm backward's ``(P, M)`` partial sums of dw / db. Default: 1."""
    return 1


def reduce_partials(partial, out) -> None:
    """``out[...] = sum(partial, axis=0)`` in ``out``'s dtype. ``partial`` is scratch: a
    backend may overwrite it (triton does, for 16-bit ``out``). Default: the Array API sum."""
    import array_api_compat

    xp = array_api_compat.array_namespace(partial, out)
    out[...] = xp.astype(xp.sum(partial, axis=0), out.dtype)


def default_splits(batch: int, kv_heads: int, max_len: int, like) -> int:
    """Decode splits for a cache of ``max_len`` keys when the caller gives none. Default: 1."""
    return 1


#: Queries and keys per tile of :func:`default_tiles`.
DEFAULT_TILE = 128


def default_tiles(n_q: int, n_kv: int, group: int, masked: bool) -> tuple[int, int]:
    """``(tile_m, tile_n)`` of a flex plan when no BlockMask fixes them. Default: 128 x 128 (clipped)."""
    return max(1, min(n_q, DEFAULT_TILE)), max(1, min(n_kv, DEFAULT_TILE))


def score_mod_workspace(q, k, v, score_mod, plan, score_mod_grads, deterministic) -> int:
    """Float32 elements of ``scratch.score_mod_workspace`` that a flex backward over these
    arrays, score mod graph, tile plan and ``score_mod_grads`` (one accumulator or None per
    captured array) needs; 0 for none. It may raise ValueError for a call it refuses (too
    much memory); the fronts ask it before any write. Default: 0."""
    return 0


def varlen_score_mod_workspace(
    q,
    k,
    v,
    score_mod,
    planner,
    cu_seqlens_q,
    cu_seqlens_k,
    input_pos,
    score_mod_grads,
    deterministic,
) -> int:
    """:func:`score_mod_workspace` of a packed flex backward (the most any one sequence's
    pass needs when the passes reuse one workspace). Default: 0."""
    return 0


# -- Declared signatures ---------------------------------------------------------------------


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

_SIGNATURES = {
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
        inputs=(Arg("a", ROWS, aliases=("y",)), Arg("b", ROWS)),
        outputs=(Arg("y", ROWS, aliases=("a", "b")),),
        reads=("a", "b"),
    ),
    "geglu": Signature(
        title="GeGLU",
        inputs=(Arg("a", ROWS, aliases=("y",)), Arg("b", ROWS)),
        outputs=(Arg("y", ROWS, aliases=("a", "b")),),
        options=(Option("approximate", "tanh", "gelu_approximate", backward=True),),
        reads=("a", "b"),
    ),
}

_SIGNATURES["rope"] = Signature(
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

_SIGNATURES["cross_entropy"] = Signature(
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

_SIGNATURES["linear_cross_entropy"] = Signature(
    title="LinearCrossEntropy",
    inputs=(
        Arg("x", "T H"),
        Arg("weight", "V H"),
        Arg("targets", "T", dtype="index", grad=False),
        Arg("bias", "V", optional=True, recorded="bias"),
    ),
    outputs=(Arg("loss", ""),),
    checkpoints=(Arg("lse", "T"),),
    options=_SIGNATURES["cross_entropy"].options,
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

_SIGNATURES.update(
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


@dataclass(frozen=True)
class Primitive:
    """What the protocol declares for one op.

    Attributes
    ----------
    name : str
        The op (``"rms_norm"``...), also the backend module's name.
    hooks : mapping of str to callable
        Optional hooks, each with its default (used when a backend does not declare it).
    scratch : tuple of str
        The fields of the op's scratch (the front's Scratch NamedTuple).
    optional_scratch : tuple of str
        The scratch fields a backend may do without (its ``Capability.scratch``
        says which it uses). The others carry results between passes (the
        norms' partial sums, decode's split results) and every backend uses them.
    module : type or None
        For an op whose backend functions do not follow from its Signature,
        the Protocol class they satisfy.
    rows_of : str or None
        The op whose backend modules run this one's kernels, for a primitive
        the fronts compose from another's (linear cross-entropy: the products
        on the arrays' library, the rows on ``cross_entropy``); None: its own.
    signature : Signature
        The declared arguments (``_SIGNATURES[name]``).
    """

    name: str
    hooks: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    scratch: tuple[str, ...] = ()
    optional_scratch: tuple[str, ...] = ()
    module: type | None = None
    rows_of: str | None = None
    signature: Signature = field(init=False)

    def __post_init__(self):
        signature = _SIGNATURES[self.name]
        object.__setattr__(self, "signature", signature)
        if not self.scratch and signature.kind == "rows":
            object.__setattr__(self, "scratch", tuple(a.name for a in signature.scratch))

    def functions(self) -> dict[str, inspect.Signature]:
        """The functions a backend module provides for this op, with their parameters."""
        if self.module is None:
            return module_functions(self.signature)
        return {
            name: inspect.Signature(list(inspect.signature(fn).parameters.values())[1:])
            for name, fn in vars(self.module).items()
            if inspect.isfunction(fn) and not name.startswith("_")
        }


def _parameters(positional, keywords) -> inspect.Signature:
    p = inspect.Parameter
    params = [p(n, p.POSITIONAL_OR_KEYWORD) for n in positional]
    return inspect.Signature(params + [p(n, p.KEYWORD_ONLY) for n in keywords])


def module_functions(sig: Signature) -> dict[str, inspect.Signature]:
    """``forward`` and ``backward`` of a backend module for a row or attention-family op.

    Rows: ``forward(outputs, inputs, checkpoints, *, forward options)``;
    ``backward(read outputs, d<output>..., read inputs, checkpoints,
    d<input>... (the partial sums in scratch for an ``"M"`` input), *,
    backward options, accumulate)`` over ``(rows, M)`` views. Attention:
    ``forward(o, q, k, v, m, l, *, kernel options)`` and ``backward(do, q, k,
    v, o, m, l, dq, dk, dv, delta, dq_accum, *, kernel options)``, the kernel
    options being the prefix sums (packed) and the forward's options, with
    the flex mods' ``block_mask``/``block_sparse`` planned into ``plan``
    (``planner(b, n_q, n_kv)``, the plan of sequence ``b``, when packed), and
    the flex backward's ``score_mod_grads`` (one accumulator or None per
    captured array, ADDED to), ``deterministic`` and ``score_mod_workspace``
    (1-D float32, at least the ``score_mod_workspace`` hook's elements, or
    None when that is 0). Scratch fields a backend does not use arrive as None.
    """
    ins, outs = [a.name for a in sig.inputs], [a.name for a in sig.outputs]
    checkpoints = [c.name for c in sig.checkpoints]
    if sig.kind == "rows":
        partial = {s.of: s.name for s in sig.scratch}
        grads = [partial.get(a.name, f"d{a.name}") for a in sig.inputs]
        read = [n for n in (*outs, *ins) if n in sig.reads]
        accumulate = ["accumulate"] if sig.scratch else []
        backward = [o.name for o in sig.options if o.backward] + accumulate
        return {
            "forward": _parameters(
                [*outs, *ins, *checkpoints], [o.name for o in sig.options if o.forward]
            ),
            "backward": _parameters(
                [
                    *(n for n in read if n in outs),
                    *(f"d{n}" for n in outs),
                    *(n for n in read if n in ins),
                    *checkpoints,
                    *grads,
                ],
                backward,
            ),
        }
    flex = any(o.rule == "score_mod" for o in sig.options)
    planned = ("block_mask", "block_sparse")
    kernel = [a.name for a in sig.inputs if not a.grad]
    kernel += [o.name for o in sig.options if o.forward and o.name not in planned]
    if flex:
        kernel.append("planner" if "cu_seqlens_q" in kernel else "plan")
    grads = ["score_mod_grads", "deterministic", "score_mod_workspace"] if flex else []
    scratch = [a.name for a in sig.scratch if a.shape != "N"]
    qkv = ins[:3]
    return {
        "forward": _parameters([*outs, *qkv, *checkpoints], kernel),
        "backward": _parameters(
            ["do", *qkv, *outs, *checkpoints, *(f"d{n}" for n in qkv), *scratch], kernel + grads
        ),
    }


_PARTIAL_HOOKS: Mapping[str, Callable[..., Any]] = {
    "partials": partials,
    "reduce_partials": reduce_partials,
}

PRIMITIVES: Mapping[str, Primitive] = {
    p.name: p
    for p in (
        Primitive("rms_norm", _PARTIAL_HOOKS),
        Primitive("layer_norm", _PARTIAL_HOOKS),
        Primitive("softmax"),
        Primitive("swiglu"),
        Primitive("geglu"),
        Primitive("rope", module=RopeModule),
        Primitive("cross_entropy", module=CrossEntropyModule),
        # Products on the arrays' own library, the rows on the backends' cross_entropy.
        Primitive("linear_cross_entropy", module=CrossEntropyModule, rows_of="cross_entropy"),
        Primitive("attention", {}, ("delta", "dq_accum"), ("delta", "dq_accum")),
        Primitive("attention_varlen", {}, ("delta", "dq_accum"), ("delta", "dq_accum")),
        Primitive(
            "decode_attention",
            {"default_splits": default_splits},
            ("o_partial", "m_partial", "l_partial"),
            module=DecodeAttentionModule,
        ),
        Primitive(
            "flex_attention",
            {"default_tiles": default_tiles, "score_mod_workspace": score_mod_workspace},
            ("delta", "dq_accum"),
            ("delta", "dq_accum"),
        ),
        Primitive(
            "flex_attention_varlen",
            {"default_tiles": default_tiles, "score_mod_workspace": varlen_score_mod_workspace},
            ("delta", "dq_accum"),
            ("delta", "dq_accum"),
        ),
        Primitive("merge_attention_states", module=MergeAttentionStatesModule),
    )
}
OPS = tuple(PRIMITIVES)


@dataclass(frozen=True)
class Capability:
    """What one backend's module for one op accepts and provides.

    Attributes
    ----------
    dtypes : tuple of str
        Input dtypes it computes in (names from ``FLOAT_DTYPES``).
    max_head_dim : int or None
        Largest attention head dim (D and Dv) it supports; None for no limit.
    hooks : tuple of str
        The op's optional hooks its module provides (the rest take the protocol's defaults).
    scratch : tuple of str or None
        Which of the op's optional scratch fields (``Primitive.optional_scratch``)
        its passes use; None for all of them. The fronts allocate only the
        fields used and pass None for the others.
    lacks : tuple of str
        Per-call features (:data:`FEATURES`) it cannot honour: a call asking
        for one is not served (routing falls back, an explicit choice raises).
    """

    dtypes: tuple[str, ...]
    max_head_dim: int | None = None
    hooks: tuple[str, ...] = ()
    scratch: tuple[str, ...] | None = None
    lacks: tuple[str, ...] = ()

    def hook(self, module, op: str, name: str) -> Callable[..., Any]:
        """``module``'s hook ``name`` when declared, else the protocol's default for ``op``."""
        default = PRIMITIVES[op].hooks[name]
        return getattr(module, name) if name in self.hooks else default

    def scratch_fields(self, op: str) -> tuple[str, ...]:
        """The scratch fields of ``op`` this backend uses, in the scratch's field order."""
        primitive = PRIMITIVES[op]
        return tuple(
            name
            for name in primitive.scratch
            if name not in primitive.optional_scratch
            or self.scratch is None
            or name in self.scratch
        )


@dataclass(frozen=True)
class Backend:
    """A backend's declaration (``BACKEND`` in its package's ``__init__``).

    Attributes
    ----------
    name : str
        Routing name (``backend="..."``).
    namespaces : tuple of str
        Array namespaces it serves (``registry.namespace_name``); ``ANY`` for any.
    devices : tuple of str
        Device kinds it serves (``registry.device_kind``); ``ANY`` for any.
    module : str
        Package holding one module per op (``<module>.<op>``).
    requires : tuple of str
        Importable modules it needs; checked with ``find_spec``, not imported.
    ops : mapping of str to Capability
        The ops it implements and what each accepts and provides.
    device_problem : callable or None
        ``device_problem(device_kind) -> str | None``: why the backend cannot
        run on that kind of device here (None: it can). Called only once the
        requirements are found and the call's namespace is served, so it may
        import them.
    """

    name: str
    namespaces: tuple[str, ...]
    devices: tuple[str, ...]
    module: str
    requires: tuple[str, ...] = ()
    ops: Mapping[str, Capability] = field(default_factory=dict)
    device_problem: Callable[[str], str | None] | None = None

    def missing_requirement(self) -> str | None:
        """Why a required module cannot be imported here, or None."""
        for module in self.requires:
            if module not in sys.modules and importlib.util.find_spec(module) is None:
                return f"{module} is not installed"
        return None

    def supports(self, op: str, call: Call) -> Support:
        """Whether this backend can serve ``op`` for ``call``, and if not, why."""
        missing = self.missing_requirement()
        if missing:
            return Support(False, missing)
        if self.namespaces != ANY and call.namespace not in self.namespaces:
            return Support(
                False, f"it serves {', '.join(self.namespaces)} arrays, not {call.namespace}"
            )
        if self.devices != ANY and call.device not in self.devices:
            return Support(False, f"it serves {', '.join(self.devices)} devices, not {call.device}")
        capability = self.ops.get(op)
        if capability is None:
            return Support(False, f"it has no {op} kernel")
        for dt in call.dtypes:
            if dt not in capability.dtypes:
                return Support(False, f"its {op} supports {', '.join(capability.dtypes)}, not {dt}")
        limit = capability.max_head_dim
        if call.head_dim is not None and limit is not None and call.head_dim > limit:
            return Support(False, f"its {op} supports head dims up to {limit}, not {call.head_dim}")
        for feature in call.features:
            if feature in capability.lacks:
                return Support(False, f"its {op} cannot give {FEATURES[feature]}")
        problem = None if self.device_problem is None else self.device_problem(call.device)
        return Support(False, problem) if problem else Support(True)

    def availability(self) -> Support:
        """Whether the backend can run anything here: requirements found and some device usable."""
        missing = self.missing_requirement()
        if missing:
            return Support(False, missing)
        if self.device_problem is None or self.devices == ANY:
            return Support(True)
        problems = [self.device_problem(device) for device in self.devices]
        if all(problems):
            return Support(False, "; ".join(p for p in problems if p))
        return Support(True)
