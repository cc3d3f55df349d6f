"""The backend contract: what a backend declares, and what each of its op modules provides.

A backend is a package ``xpkernels.backends.<name>`` whose ``__init__``
defines ``BACKEND``, a :class:`Backend` declaration, and imports nothing
heavy (routing reads it without importing torch, triton or cupy). Beside it,
one module ``<name>/<op>.py`` per op it declares, providing:

- ``forward`` and, where the primitive has one, ``backward``, with the
  parameters :meth:`Primitive.functions` gives (derived from the op's
  declared :class:`Signature` (:mod:`xpkernels.backends.signatures`), or its
  Protocol class for the irregular ops, :class:`DecodeAttentionModule`,
  :class:`MergeAttentionStatesModule`, :class:`RopeModule` and
  :class:`CrossEntropyModule`);
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

from xpkernels.backends.signatures import (
    GELU_APPROXIMATIONS,
    REDUCTIONS,
    ROWS,
    SIGNATURES,
    Arg,
    Option,
    Signature,
)

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
    "ROWS",
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
    """Split-KV decode attention (forward only): one query per head attends to a cache.

    ``o`` ``(B, H, Dv)`` is overwritten, 0 where ``lengths[b] == 0``; ``q``
    ``(B, H, D)`` sits at position ``lengths[b] - 1``; ``k``, ``v`` are
    ``(B, Hkv, Smax, D)`` and ``(B, Hkv, Smax, Dv)`` caches of which keys
    ``[0, lengths[b])`` are attended, or with ``block_table`` ``(B, max_pages)``
    int32 the pages ``(num_pages, Hkv, page_size, D/Dv)``, key ``j`` being slot
    ``j % page_size`` of page ``block_table[b, j // page_size]`` (entries
    clamped to ``[0, num_pages)``; ``Smax = max_pages * page_size``).
    ``lengths`` ``(B,)`` integers of any width are clamped to ``[0, Smax]``.
    ``o_partial`` ``(B, H, S, Dv)``, ``m_partial`` and ``l_partial`` ``(B, H,
    S)`` are the split scratch (``S = n_splits``) in the accumulation dtype,
    overwritten for every batch with keys. ``scale`` multiplies ``q k^T``;
    ``softcap`` (a float or None) caps each scaled score ``s`` to ``softcap *
    tanh(s / softcap)``; ``window`` (an int or None) keeps keys ``j >=
    lengths[b] - window``. Every float array's last axis has stride 1.
    """

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
    """The exact merge of two attention states ``(o, m, l)`` over disjoint key sets: the
    ``(B, H, S, D)`` outputs with their ``(B, H, S)`` states ``m``, ``l`` (and ``dlse``) in the
    accumulation dtype (float32; float64 with float64 outputs), ``o_b`` of ``o_a``'s dtype."""

    def forward(self, o, m, l, o_a, m_a, l_a, o_b, m_b, l_b) -> None:
        """An output may be the very same array as the same-named input of either side."""

    def backward(
        self, do, dlse, o, m, l, o_a, m_a, l_a, o_b, m_b, l_b, do_a, dlse_a, do_b, dlse_b
    ) -> None:
        """``dlse`` None means zero; ``do_a``/``do_b`` may be ``do``, ``dlse_a``/``dlse_b`` ``dlse``."""


class RopeModule(Protocol):
    """Rotary position embeddings of one ``(B, H, S, D)`` array (the front calls it for ``q``,
    then for ``k``), with the tables ``cos``, ``sin`` as ``(B, P, R2)`` views of any float dtype
    (a broadcast table has batch stride 0; ``2 R2 <= D``, the rest of each head passes through)
    and ``position_ids`` None (query ``s`` takes table row ``s``, ``P >= S``) or ``(B, S)``
    integers in ``[0, P)``. Pair ``i`` is ``(x[2i], x[2i+1])`` when ``interleaved`` (GPT-J),
    else ``(x[i], x[i + R2])`` (Hugging Face's half rotation)."""

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
        ``grad`` may have stride 0 (one weight for all rows); ``dlogits``, of any float dtype,
        may be the very same array as ``logits`` (the gradient replaces the logits)."""


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
        The declared arguments (``SIGNATURES[name]``).
    """

    name: str
    hooks: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    scratch: tuple[str, ...] = ()
    optional_scratch: tuple[str, ...] = ()
    module: type | None = None
    rows_of: str | None = None
    signature: Signature = field(init=False)

    def __post_init__(self):
        signature = SIGNATURES[self.name]
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
    backward options, accumulate)`` over ``(rows, M)`` views. A None
    partial-sum array is a gradient not wanted; ``accumulate=False`` (the first
    row group of a call) overwrites every one of its ``P`` rows, since
    ``reduce_partials`` sums them all, and ``True`` (later groups) adds.

    Attention: ``forward(o, q, k, v, m, l, *, kernel options)`` and
    ``backward(do, q, k, v, o, m, l, dq, dk, dv, delta, dq_accum, *, kernel
    options)``, the kernel options being the prefix sums (packed) and the
    forward's options, with ``scale`` a float (None resolved to ``1/sqrt(D)``),
    flex's ``input_pos`` (the position of query row 0) a tuple of ints (one,
    or one per batch) or the caller's ``(B,)`` device array, never read on the
    host, its mods :class:`xpkernels.mods.Graph` or None, their
    ``block_mask``/``block_sparse`` planned into ``plan`` (a
    :class:`xpkernels.mods.TilePlan`; ``planner(b, n_q, n_kv)``, the plan of
    sequence ``b``, when packed), and the flex backward's ``score_mod_grads``
    (one accumulator or None per captured array, ADDED to), ``deterministic``
    and ``score_mod_workspace`` (1-D float32, at least the
    ``score_mod_workspace`` hook's elements, or None when that is 0). The
    checkpoints are backend-neutral (a forward on one backend feeds a backward
    on another): ``m`` the row max of ``s = scale * q k^T`` over the keys a row
    sees and ``l = sum exp(s - m)``, natural-log units (``-inf`` and 0 on rows
    that see none). Scratch fields a backend does not use arrive as None.
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
