r"""FlexAttention over packed variable-length sequences.

The packing of :mod:`xpkernels.attention_varlen` (``q (Tq, H, D)``, ``k (Tk,
Hkv, D)``, ``v (Tk, Hkv, Dv)``, int32 prefix sums ``cu_seqlens_q`` /
``cu_seqlens_k``) with the mods of :mod:`xpkernels.flex_attention`: sequence
``b`` is exactly ``flex_attention`` of its own queries over its own keys, the
mods seeing

- ``b``: the sequence index (``0 <= b < B``);
- ``q_idx = input_pos[b] + i`` for its query ``i`` (counted from the
  sequence's first query) and ``q_row = i``;
- ``kv_idx = j`` for its key ``j`` (counted from the sequence's first key);
- ``h``: the query head.

So ``CausalMask()`` with the default ``input_pos = 0`` aligns the STARTS of
each sequence's queries and keys (top-left), and ``input_pos[b] = Sk_b -
Sq_b`` (a ``(B,)`` array) aligns their ends (flash-attn's bottom-right), as
``attention_varlen(causal=True)``. No query sees another sequence's keys:
there is no document mask to write.

Mods are checked against ``B`` batches (sequences), ``H`` heads,
``max_seqlen_q`` queries and ``max_seqlen_k`` keys: an array a mod indexes
by ``b`` has ``B`` entries, one indexed by ``kv_idx`` at least
``max_seqlen_k``. Band masks (causal, sliding windows, prefixes) skip whole
tiles per sequence, at the sequence's own length and position. There is no
``block_mask``: a :class:`~xpkernels.mods.BlockMask` is built for one pair of
lengths, which packed sequences do not share.

The checkpoints ``(m, l)`` are ``(H, Tq)`` float32 in natural-log units
(:class:`~xpkernels.attention_varlen.AttentionVarlenCheckpoints`), equal to
flex's checkpoints of each sequence run alone. A row that keeps no key has
``o = 0``, ``m = -inf``, ``l = 0`` and zero gradients; keys of a sequence
without queries get zero ``dk``, ``dv``. Prefix sums, ``max_seqlen`` and
``input_pos`` follow :mod:`xpkernels.attention_varlen` (values checked on
host arrays and in debug mode). The backward ADDS the score mod's array
gradients, summed over every sequence, into ``score_mod_grad``.
"""

from __future__ import annotations

from typing import NamedTuple

from . import _autograd
from . import _checks as check
from .attention_varlen import (
    AttentionVarlenCheckpoints,
    _allocate_scratch,
    _checkpoint_arrays,
    _head_dim,
    _packing,
    _validate_qkv,
)
from .buffers import (
    Duplicated,
    check_forward,
    checkpoints_for,
    empty,
    empty_float32,
    forget_forward,
    primal,
    record_forward,
    scratchspace_for,
    with_new_shadows,
)
from .flex_attention import (
    _Call,
    _features,
    _mod_grads,
    _score_mod_workspace,
    _scratch,
    _slots,
)
from .registry import resolve

__all__ = [
    "FlexAttentionVarlenBackwardScratch",
    "flex_attention_varlen_",
    "flex_attention_varlen",
    "flex_attention_varlen_backward_",
    "flex_attention_varlen_backward",
]


class FlexAttentionVarlenBackwardScratch(NamedTuple):
    """Transient workspace of ``flex_attention_varlen_backward_`` (as
    :class:`~xpkernels.flex_attention.FlexAttentionBackwardScratch`, packed).

    A field the routed backend (or, for the workspace, the call) does not use is None.
    """

    delta: object  #: ``(H, Tq)``, ``rowsum(do * o)`` (float32; float64 for float64 inputs)
    dq_accum: object  #: ``(Tq, H, D)``, ``dq / scale`` summed over key tiles, or None
    #: ``(N,)`` float32, the score-mod gradients' partial sums, reused by every sequence
    score_mod_workspace: object = None


_ALLOCATOR = "allocate_scratchspace(flex_attention_varlen_backward_, O, Q, K, V, ...)"


class _Packed:
    """A validated packed flex call: the flex ``_Call`` of its mods and the packing."""

    def __init__(
        self,
        fn,
        xp,
        q,
        k,
        cu_seqlens_q,
        cu_seqlens_k,
        *,
        max_seqlen_q,
        max_seqlen_k,
        score_mod,
        mask_mod,
        block_sparse,
        scale,
        input_pos,
    ):
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            check.namespace(fn, name, cu)
        check.same_namespace(fn, xp, {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k})
        batch, self.max_seqlen_q, self.max_seqlen_k = _packing(
            fn, xp, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
        )
        self.cu_seqlens_q, self.cu_seqlens_k = cu_seqlens_q, cu_seqlens_k
        _, heads, d = q.shape
        dims = (batch, heads, k.shape[1], self.max_seqlen_q, self.max_seqlen_k, d)
        self.call = _Call(
            fn,
            xp,
            dims,
            score_mod=score_mod,
            mask_mod=mask_mod,
            block_mask=None,
            block_sparse=block_sparse,
            scale=scale,
            input_pos=input_pos,
        )

    def recorded(self) -> dict:
        """The options of the forward that its backward must repeat."""
        return {
            **self.call.recorded(),
            "cu_seqlens_q": self.cu_seqlens_q,
            "cu_seqlens_k": self.cu_seqlens_k,
        }

    def read(self) -> dict:
        """Every array of the options that kernels read (for the overlap check)."""
        return {
            **self.call.read(),
            "cu_seqlens_q": self.cu_seqlens_q,
            "cu_seqlens_k": self.cu_seqlens_k,
        }

    def options(self, route) -> dict:
        """Keyword options of the backend's forward/backward."""
        call = self.call
        return {
            "cu_seqlens_q": self.cu_seqlens_q,
            "cu_seqlens_k": self.cu_seqlens_k,
            "max_seqlen_q": self.max_seqlen_q,
            "max_seqlen_k": self.max_seqlen_k,
            "scale": call.scale,
            "input_pos": call.positions,
            "score_mod": call.score_graph,
            "mask_mod": call.mask_graph,
            "planner": call.planner(route),
        }

    def workspace_need(self, fn, route, q, k, v, options, grads, deterministic) -> int:
        """Float32 elements of the score-mod workspace (the backend's hook; 0 without gradients)."""
        if all(g is None for g in grads):
            return 0
        try:
            return route.hook("score_mod_workspace")(
                q,
                k,
                v,
                options["score_mod"],
                options["planner"],
                self.cu_seqlens_q,
                self.cu_seqlens_k,
                options["input_pos"],
                grads,
                deterministic,
            )
        except ValueError as error:
            raise ValueError(f"{fn}: {error}") from None


def flex_attention_varlen_(
    o,
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    max_seqlen_q=None,
    max_seqlen_k=None,
    score_mod=None,
    mask_mod=None,
    block_sparse=True,
    scale=None,
    input_pos=0,
    checkpoints=None,
    backend=None,
) -> None:
    """Packed variable-length FlexAttention forward, in place; see the module docstring.

    Parameters
    ----------
    o : array
        Output, written in full (zeros on rows that keep no key).
    q, k, v : array or Duplicated
        Packed queries, keys and values, one float dtype.
    cu_seqlens_q, cu_seqlens_k : array
        ``(B + 1,)`` int32 prefix sums, as :func:`~xpkernels.attention_varlen_`.
    max_seqlen_q, max_seqlen_k : int, optional
        At least the longest query / key sequence; None derives them from
        the prefix sums on the host. The mods are checked against them.
    score_mod : ScoreMod or callable, optional
        ``(score, b, h, q_idx, kv_idx) -> score``, ``b`` the sequence index.
    mask_mod : MaskMod or callable, optional
        ``(b, h, q_idx, kv_idx) -> keep``.
    block_sparse : bool
        True skips the tiles a band mask proves empty, per sequence; False
        visits every tile (same results).
    scale : float, optional
        Score scale, finite and > 0; None gives ``1/sqrt(D)``.
    input_pos : int, list of B ints or (B,) integer array
        Position of each sequence's first query (``q_idx = input_pos[b] +
        i``); negative allowed. Host values drive band skipping; a device
        array is not read on the host outside debug mode.
    checkpoints : AttentionVarlenCheckpoints, optional
        From ``allocate_checkpoints(flex_attention_varlen_, q, k, v)``;
        receives ``(m, l)`` and records the mods and options the backward
        must repeat. None saves nothing (inference).
    backend : str, optional
        Explicit backend; see :mod:`xpkernels.registry`.

    Raises
    ------
    TypeError, ValueError
        Bad arrays, prefix sums, mods or options (named in the message), a
        read-only output, an output sharing memory with an input. Nothing
        is written when a check fails.

    Shapes
    ------
    q ``(Tq, H, D)``, k ``(Tk, Hkv, D)``, v ``(Tk, Hkv, Dv)``, o ``(Tq, H,
    Dv)``, cu_seqlens ``(B + 1,)``, with ``H % Hkv == 0``. Last axes
    contiguous, other strides free. Arrays captured by the mods live with q.

    Checkpoints
    -----------
    m, l : ``(H, Tq)`` float32, the row max of the modified, masked, scaled
    scores and ``sum_j exp(s_ij - m_i)`` (``-inf`` and 0 for a row that keeps
    no key).
    """
    fn = "flex_attention_varlen_"
    _autograd.check_inplace(fn, {"q": q, "k": k, "v": v, "o": o}, score_mod)
    q, k, v = primal(q), primal(k), primal(v)
    xp = _validate_qkv(fn, q, k, v)
    check.same_namespace(fn, xp, {"q": q, "k": k, "v": v, "o": o})
    check.floating(fn, "o", xp, o)
    check.shape(fn, "o", o, (q.shape[0], q.shape[1], v.shape[2]))
    check.last_axis_contiguous(fn, "o", o)
    packed = _Packed(
        fn,
        xp,
        q,
        k,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        score_mod=score_mod,
        mask_mod=mask_mod,
        block_sparse=block_sparse,
        scale=scale,
        input_pos=input_pos,
    )
    m = lse_sum = None
    if checkpoints is not None:
        m, lse_sum = _checkpoint_arrays(fn, xp, checkpoints, q, forward=fn)
    outputs = {"o": o, "checkpoints.m": m, "checkpoints.l": lse_sum}
    check.writable(fn, outputs)
    check.no_overlap(fn, outputs, {"q": q, "k": k, "v": v, **packed.read()})
    arrays = {
        "o": o,
        "q": q,
        "k": k,
        "v": v,
        "checkpoints.m": m,
        "checkpoints.l": lse_sum,
        **packed.call.captured(),
    }
    route = resolve("flex_attention_varlen", arrays, backend=backend, head_dim=_head_dim(q, v))
    if checkpoints is not None:
        forget_forward(checkpoints)
    route.impl.forward(o, q, k, v, m, lse_sum, **packed.options(route))
    if checkpoints is not None:
        record_forward(checkpoints, fn, packed.recorded())


@checkpoints_for(flex_attention_varlen_)
def allocate_flex_attention_varlen_checkpoints(
    q, k=None, v=None, *args, **options
) -> AttentionVarlenCheckpoints:
    """Allocate ``flex_attention_varlen_``'s checkpoints for packed ``q`` ``(Tq, H, D)``: ``m, l (H, Tq)``."""
    q = primal(q)
    fn = "allocate_checkpoints(flex_attention_varlen_)"
    check.namespace(fn, "q", q)
    check.rank(fn, "q", q, 3, "(Tq, H, D)")
    rows = (q.shape[1], q.shape[0])
    return AttentionVarlenCheckpoints(m=empty_float32(q, rows), l=empty_float32(q, rows))


def flex_attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    max_seqlen_q=None,
    max_seqlen_k=None,
    score_mod=None,
    mask_mod=None,
    block_sparse=True,
    scale=None,
    input_pos=0,
    checkpoints=None,
    backend=None,
):
    """Packed FlexAttention forward into a new ``(Tq, H, Dv)`` array; see :func:`flex_attention_varlen_`.

    Returns
    -------
    o : array
        Of ``q``'s dtype. On torch tensors, when q, k, v or an array the
        score mod captures requires grad (grad mode on), autograd records
        xpkernels' backward, score-mod gradients included (:mod:`xpkernels.torch`).
    """
    fn = "flex_attention_varlen"
    options = {
        "cu_seqlens_q": cu_seqlens_q,
        "cu_seqlens_k": cu_seqlens_k,
        "max_seqlen_q": max_seqlen_q,
        "max_seqlen_k": max_seqlen_k,
        "score_mod": score_mod,
        "mask_mod": mask_mod,
        "block_sparse": block_sparse,
        "scale": scale,
        "input_pos": input_pos,
        "checkpoints": checkpoints,
        "backend": backend,
    }
    if (o := _autograd.record(fn, {"q": q, "k": k, "v": v}, options)) is not _autograd.NOT_RECORDED:
        return o
    q, v = primal(q), primal(v)
    check.namespace(fn, "q", q)
    check.rank(fn, "q", q, 3, "(Tq, H, D)")
    check.namespace(fn, "v", v)
    check.rank(fn, "v", v, 3, "(Tk, Hkv, Dv)")
    o = empty(q, (q.shape[0], q.shape[1], v.shape[2]), q.dtype)
    flex_attention_varlen_(o, q, k, v, **options)
    return o


def flex_attention_varlen_backward_(
    O,
    Q,
    K,
    V,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    checkpoints,
    scratch=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    score_mod=None,
    score_mod_grad=None,
    mask_mod=None,
    block_sparse=True,
    scale=None,
    input_pos=0,
    deterministic=True,
    backend=None,
) -> None:
    """Packed FlexAttention backward, in place: overwrites the shadows; ADDS the mod's gradients.

    Parameters
    ----------
    O : Duplicated
        The forward's output (primal, read) and its cotangent ``do`` (shadow, read).
    Q, K, V : Duplicated
        The forward's inputs; their shadows receive ``dq``, ``dk``, ``dv`` in
        full (zeros where nothing is kept), ``dk``, ``dv`` summed over each
        kv head's query heads.
    cu_seqlens_q, cu_seqlens_k : array
        The forward's prefix sums.
    checkpoints : AttentionVarlenCheckpoints
        Filled by ``flex_attention_varlen_`` with the same mods, prefix sums
        and options; others raise a ValueError naming the option.
    scratch : FlexAttentionVarlenBackwardScratch, optional
        From ``allocate_scratchspace(flex_attention_varlen_backward_, O, Q,
        K, V, cu_seqlens_q, cu_seqlens_k, **options)`` with this call's
        options (``backend``; with ``score_mod_grad``, the mods, ``input_pos``
        and ``deterministic`` that size its ``score_mod_workspace``); None
        allocates it for this call.
    score_mod_grad : ScoreModGrad, optional
        From ``grad_shadow(score_mod)``: the gradients of the score mod's
        captured float arrays, summed over the sequences, are ADDED into it.
    deterministic : bool, default True
        As in :func:`~xpkernels.flex_attention.flex_attention_backward_`.
    max_seqlen_q, max_seqlen_k, score_mod, mask_mod, block_sparse, scale, input_pos, backend
        As in the forward :func:`flex_attention_varlen_`.

    Raises
    ------
    TypeError, ValueError
        As the forward, for read-only shadows or scratch, outputs sharing
        memory with an input or each other, and options differing from the
        forward's. Nothing is written when a check fails.

    Shapes
    ------
    As :func:`flex_attention_varlen_`; shadows share their primal's shape.

    Scratch
    -------
    delta : ``(H, Tq)``, ``rowsum(do * o)``; dq_accum : ``(Tq, H, D)``.
    Float32 (float64 for float64 inputs). score_mod_workspace : ``(N,)``
    float32, as flex's, serving each sequence's pass in turn.
    """
    fn = "flex_attention_varlen_backward_"
    if not isinstance(deterministic, bool):
        raise TypeError(f"{fn}: deterministic must be a bool, got {deterministic!r}")
    _autograd.check_inplace(fn, {"O": O, "Q": Q, "K": K, "V": V}, score_mod)
    Ds = {
        name: check.duplicated(fn, name, d) for name, d in (("O", O), ("Q", Q), ("K", K), ("V", V))
    }
    q, k, v, o = Q.primal, K.primal, V.primal, O.primal
    xp = _validate_qkv(fn, q, k, v, names=("Q.primal", "K.primal", "V.primal"))
    named = {
        f"{n}.{part}": getattr(d, part) for n, d in Ds.items() for part in ("primal", "shadow")
    }
    check.same_namespace(fn, xp, named, "Q.primal")
    for name, a in named.items():
        check.floating(fn, name, xp, a)
        check.last_axis_contiguous(fn, name, a)
    for name in ("O.primal", "O.shadow"):
        check.shape(fn, name, named[name], (q.shape[0], q.shape[1], v.shape[2]))
    for name in ("Q", "K", "V"):
        check.shape(fn, f"{name}.shadow", named[f"{name}.shadow"], tuple(Ds[name].primal.shape))
    packed = _Packed(
        fn,
        xp,
        q,
        k,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        score_mod=score_mod,
        mask_mod=mask_mod,
        block_sparse=block_sparse,
        scale=scale,
        input_pos=input_pos,
    )
    if checkpoints is None:
        raise ValueError(
            f"{fn}: checkpoints are required: pass the AttentionVarlenCheckpoints that "
            "flex_attention_varlen_ filled in the forward "
            "(allocate_checkpoints(flex_attention_varlen_, q, k, v))"
        )
    m, lse_sum = _checkpoint_arrays(
        fn, xp, checkpoints, q, reference="Q.primal", forward="flex_attention_varlen_"
    )
    delta = dq_accum = workspace = None
    if scratch is not None:
        delta, dq_accum, workspace = _scratch(
            fn,
            xp,
            scratch,
            q,
            ((q.shape[1], q.shape[0]), tuple(q.shape)),
            FlexAttentionVarlenBackwardScratch,
            _ALLOCATOR,
        )
    grads = _mod_grads(fn, xp, packed.call, score_mod_grad)
    outputs = {
        "Q.shadow": Q.shadow,
        "K.shadow": K.shadow,
        "V.shadow": V.shadow,
        "scratch.delta": delta,
        "scratch.dq_accum": dq_accum,
        "scratch.score_mod_workspace": workspace,
        **{f"score_mod_grad for {s.label}": g for s, g in zip(_slots(packed.call), grads)},
    }
    check.writable(fn, outputs)
    inputs = {
        "Q.primal": q,
        "K.primal": k,
        "V.primal": v,
        "O.primal": o,
        "O.shadow": O.shadow,
        "checkpoints.m": m,
        "checkpoints.l": lse_sum,
        **packed.read(),
    }
    check.no_overlap(fn, outputs, inputs)
    check_forward(fn, checkpoints, "flex_attention_varlen_", packed.recorded())
    arrays = {
        **named,
        "checkpoints.m": m,
        "checkpoints.l": lse_sum,
        "scratch.delta": delta,
        "scratch.dq_accum": dq_accum,
        "scratch.score_mod_workspace": workspace,
        **packed.call.captured(),
        **{f"score_mod_grad {i}": g for i, g in enumerate(grads)},
    }
    route = resolve(
        "flex_attention_varlen",
        arrays,
        backend=backend,
        head_dim=_head_dim(q, v),
        features=_features(deterministic, any(g is not None for g in grads)),
    )
    options = packed.options(route)
    need = packed.workspace_need(fn, route, q, k, v, options, grads, deterministic)
    if scratch is None:
        delta, dq_accum = _allocate_scratch(route, q)
    else:
        route.require_scratch(fn, scratch)
    workspace = _score_mod_workspace(fn, route, need, scratch, workspace, q, _ALLOCATOR)
    route.impl.backward(
        O.shadow,
        q,
        k,
        v,
        o,
        m,
        lse_sum,
        Q.shadow,
        K.shadow,
        V.shadow,
        delta,
        dq_accum,
        score_mod_grads=grads,
        deterministic=deterministic,
        score_mod_workspace=workspace,
        **options,
    )


@scratchspace_for(flex_attention_varlen_backward_)
def allocate_flex_attention_varlen_backward_scratch(
    O,
    Q,
    K=None,
    V=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    *,
    backend=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    score_mod=None,
    score_mod_grad=None,
    mask_mod=None,
    block_sparse=True,
    scale=None,
    input_pos=0,
    deterministic=True,
    **options,
) -> FlexAttentionVarlenBackwardScratch:
    """Allocate ``flex_attention_varlen_backward_``'s scratch from packed ``Q`` ``(Tq, H, D)``.

    Returns ``delta (H, Tq)`` and ``dq_accum (Tq, H, D)``, float32 (float64
    when ``Q`` is float64), for the backend the call routes to; a field that
    backend does not use is None. With ``score_mod_grad`` (and ``K``, ``V``
    and the prefix sums), also the ``score_mod_workspace`` the backward with
    these options needs (None when it needs none); the other options are the
    backward's, ignored here.

    Raises
    ------
    ValueError
        As the backward, for deterministic score-mod partial rows too large.
    """
    fn = "allocate_scratchspace(flex_attention_varlen_backward_)"
    if not isinstance(deterministic, bool):
        raise TypeError(f"{fn}: deterministic must be a bool, got {deterministic!r}")
    q = primal(Q)
    xp = check.namespace(fn, "Q", q)
    check.rank(fn, "Q", q, 3, "(Tq, H, D)")
    check.floating(fn, "Q", xp, q)
    arrays = {"Q": q, "O": primal(O), "K": primal(K), "V": primal(V)}
    head_dim = max(a.shape[-1] for a in arrays.values() if a is not None)
    features = _features(deterministic, score_mod_grad is not None)
    route = resolve(
        "flex_attention_varlen", arrays, backend=backend, head_dim=head_dim, features=features
    )
    delta, dq_accum = _allocate_scratch(route, q)
    workspace = None
    if score_mod_grad is not None:
        if K is None or V is None or cu_seqlens_q is None or cu_seqlens_k is None:
            raise TypeError(
                f"{fn}: K, V, cu_seqlens_q and cu_seqlens_k are needed to size the workspace "
                "of score_mod_grad"
            )
        k, v = primal(K), primal(V)
        _validate_qkv(fn, q, k, v, names=("Q", "K", "V"))
        packed = _Packed(
            fn,
            xp,
            q,
            k,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            score_mod=score_mod,
            mask_mod=mask_mod,
            block_sparse=block_sparse,
            scale=scale,
            input_pos=input_pos,
        )
        grads = _mod_grads(fn, xp, packed.call, score_mod_grad)
        call_options = packed.options(route)
        need = packed.workspace_need(fn, route, q, k, v, call_options, grads, deterministic)
        workspace = empty_float32(q, (need,)) if need else None
    return FlexAttentionVarlenBackwardScratch(delta, dq_accum, workspace)


def flex_attention_varlen_backward(
    do,
    q,
    k,
    v,
    o,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    checkpoints,
    max_seqlen_q=None,
    max_seqlen_k=None,
    score_mod=None,
    score_mod_grad=None,
    mask_mod=None,
    block_sparse=True,
    scale=None,
    input_pos=0,
    deterministic=True,
    backend=None,
):
    """Packed FlexAttention backward into new arrays; see :func:`flex_attention_varlen_backward_`.

    Parameters
    ----------
    do : array
        Cotangent of the forward's output ``o``.
    q, k, v, o : array or Duplicated
        The forward's inputs and output.
    score_mod_grad : ScoreModGrad, optional
        Receives (ADDS) the score mod's array gradients.
    deterministic : bool, default True
        As in :func:`flex_attention_varlen_backward_`.

    Returns
    -------
    dq, dk, dv : arrays shaped and typed like ``q``, ``k``, ``v``.
    """
    fn = "flex_attention_varlen_backward"
    shadows = with_new_shadows(fn, {"q": q, "k": k, "v": v})
    o = primal(o)
    flex_attention_varlen_backward_(
        Duplicated(o, do),
        shadows["q"],
        shadows["k"],
        shadows["v"],
        cu_seqlens_q,
        cu_seqlens_k,
        checkpoints=checkpoints,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        score_mod=score_mod,
        score_mod_grad=score_mod_grad,
        mask_mod=mask_mod,
        block_sparse=block_sparse,
        scale=scale,
        input_pos=input_pos,
        deterministic=deterministic,
        backend=backend,
    )
    return shadows["q"].shadow, shadows["k"].shadow, shadows["v"].shadow
