"""The one front of the attention family, driven by each primitive's declared Signature.

:mod:`~xpkernels.attention`, :mod:`~xpkernels.attention_varlen`,
:mod:`~xpkernels.flex_attention` and :mod:`~xpkernels.flex_attention_varlen`
each declare their arrays and options once (``backends/signatures.py``) and
keep only their math and documented public functions; each function hands
its arguments (``locals()``) to its :class:`AttentionFront`, which does the
rest the same way for all four:

- validation of both passes from the declared shape patterns (one symbol,
  one extent: ``"B H Sq D"`` and ``"B Hkv Sk D"`` share ``B`` and ``D``;
  ``H`` must be a multiple of ``Hkv``), every check before the first write,
  messages naming the function and the argument;
- the options through :class:`~xpkernels._attention_call.AttentionCall`
  (padded or packed, causal or mods);
- the checkpoints (one NamedTuple per layout, shared by attention and
  flex: ``AttentionCheckpoints``, ``AttentionVarlenCheckpoints``) and the
  backward scratch (``<Title>BackwardScratch``), their allocators, the
  allocating forms, routing and the backend calls.

The backward's Duplicated arguments are named after the forward's arrays in
upper case (``Q`` for ``q``); their parts are labelled ``Q.primal``,
``Q.shadow``.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any

from xpkernels.backends.protocol import PRIMITIVES

from . import _autograd
from . import _checks as check
from . import mods as _mods
from ._attention_call import AttentionCall
from .buffers import (
    Checkpoints,
    Duplicated,
    check_forward,
    checkpoints_for,
    empty,
    empty_accumulator,
    empty_float32,
    forget_forward,
    primal,
    record_forward,
    scratchspace_for,
    with_new_shadows,
)
from .registry import resolve

__all__ = ["AttentionFront", "FRONTS"]

#: The arrays of both passes, as the forward names them.
_QKV = ("q", "k", "v")


def _layout(pattern) -> str:
    """``("B", "H", "Sq", "D")`` as ``"(B, H, Sq, D)"``."""
    return f"({', '.join(pattern)})"


def _class(name: str, fields, doc: str, module: str, base=None, defaults=None):
    """A NamedTuple class ``module.name`` of ``fields`` (also a ``base`` when given)."""
    arrays = namedtuple(f"_{name}Arrays", fields, module=module, defaults=defaults)  # type: ignore[misc]
    namespace: dict[str, Any] = {"__doc__": doc, "__module__": module}
    if base is None:
        namespace["__slots__"] = ()
    return type(name, (arrays,) if base is None else (arrays, base), namespace)


#: The checkpoints of each layout, shared by the plain and the flex front of it.
CHECKPOINTS = {
    packed: _class(
        name,
        ("m", "l"),
        f"What ``{forward}`` and ``flex_{forward}`` save for their backward: ``m`` and ``l``, "
        f"{rows} float32 (the row max of the scaled, masked scores, -inf for a row that sees "
        "no key, and ``sum_j exp(s_ij - m_i)``, 0 for such a row); they record the forward's "
        "options, which the backward must repeat.",
        f"xpkernels.{forward[:-1]}",
        base=Checkpoints,
    )
    for packed, name, forward, rows in (
        (False, "AttentionCheckpoints", "attention_", "``(B, H, Sq)``"),
        (True, "AttentionVarlenCheckpoints", "attention_varlen_", "``(H, Tq)``"),
    )
}


#: Every constructed front by primitive name (filled as the front modules load).
FRONTS: dict[str, AttentionFront] = {}


def _shapes(q, k, v) -> dict:
    """What checkpoints record of the inputs' shapes."""
    return {"q": tuple(q.shape), "k": tuple(k.shape), "v": tuple(v.shape)}


class AttentionFront:
    """The fronts of one declared attention-family primitive.

    Parameters
    ----------
    name : str
        The primitive (a key of ``protocol.PRIMITIVES`` of kind ``"attention"``).
    module : str
        The front module exporting :attr:`Scratch` (its ``__module__``, so it pickles).

    Attributes
    ----------
    Checkpoints : type
        The layout's checkpoints NamedTuple (:data:`CHECKPOINTS`).
    Scratch : type
        ``<Title>BackwardScratch``, the backward's scratch NamedTuple; its
        optional fields default to None.
    """

    def __init__(self, name: str, module: str):
        sig = PRIMITIVES[name].signature
        if sig.kind != "attention":
            raise ValueError(f"{name} is not of the attention family")
        self.name, self.sig = name, sig
        self.forward_name, self.backward_name = f"{name}_", f"{name}_backward_"
        self.packed = any(a.name == "cu_seqlens_q" for a in sig.inputs)
        self.flex = any(o.rule == "score_mod" for o in sig.options)
        self.extra = tuple(a.name for a in sig.inputs if not a.grad)
        arrays = (*sig.inputs, *sig.outputs, *sig.checkpoints, *sig.scratch)
        self.pattern = {a.name: tuple(a.shape.split()) for a in arrays}
        self.Checkpoints = CHECKPOINTS[self.packed]
        FRONTS[name] = self
        fields = tuple(a.name for a in sig.scratch)
        trailing = 0
        for a in reversed(sig.scratch):
            if not a.optional:
                break
            trailing += 1
        self.Scratch = _class(
            f"{sig.title}BackwardScratch",
            fields,
            f"Transient workspace of ``{self.backward_name}``: "
            + ", ".join(f"``{a.name}`` {_layout(self.pattern[a.name])}" for a in sig.scratch)
            + ", float32 (float64 for float64 inputs; the workspace float32). A field the "
            "routed backend (or the call) does not use is None.",
            module,
            defaults=(None,) * trailing,
        )

    # -- shapes ------------------------------------------------------------------------------

    def validate_qkv(self, fn, q, k, v, names=_QKV):
        """Ranks, shapes, head grouping, dtypes and layout of q, k, v: ``(xp, dims)``."""
        nq, nk, nv = names
        pq, pk, pv = (self.pattern[n] for n in _QKV)
        xp = check.namespace(fn, nq, q)
        for name, a, pattern in ((nq, q, pq), (nk, k, pk), (nv, v, pv)):
            check.namespace(fn, name, a)
            check.rank(fn, name, a, len(pattern), _layout(pattern))
        check.same_namespace(fn, xp, dict(zip(names, (q, k, v))))
        dims = dict(zip(pq, q.shape))
        if dims["D"] < 1:
            raise ValueError(f"{fn}: {nq} must have head dim D >= 1, got shape {tuple(q.shape)}")
        check.shape(fn, nk, k, self._bind(pk, dims, k))
        if dims["Hkv"] < 1 or dims["H"] % dims["Hkv"] != 0:
            raise ValueError(
                f"{fn}: the H={dims['H']} query heads of {nq} must be a multiple of the "
                f"Hkv={dims['Hkv']} kv heads of {nk} (grouped-query attention), got {nq} "
                f"{tuple(q.shape)} and {nk} {tuple(k.shape)}"
            )
        if v.shape[-1] < 1:
            raise ValueError(f"{fn}: {nv} must have head dim Dv >= 1, got shape {tuple(v.shape)}")
        check.shape(fn, nv, v, self._bind(pv, dims, v))
        check.floating(fn, nq, xp, q)
        for name, a in ((nk, k), (nv, v)):
            if a.dtype != q.dtype:
                raise TypeError(f"{fn}: {name} must have {nq}'s dtype {q.dtype}, got {a.dtype}")
        for name, a in zip(names, (q, k, v)):
            check.last_axis_contiguous(fn, name, a)
        return xp, dims

    @staticmethod
    def _bind(pattern, dims: dict, a) -> tuple:
        """The shape ``a`` must have: bound symbols' extents, ``a``'s own for the others (bound now)."""
        expected = tuple(dims.get(sym, n) for sym, n in zip(pattern, a.shape))
        dims.update({sym: n for sym, n in zip(pattern, expected)})
        return expected

    def _shape(self, name: str, dims: dict) -> tuple:
        return tuple(dims[sym] for sym in self.pattern[name])

    def _output(self, fn, xp, label, a, dims) -> None:
        check.floating(fn, label, xp, a)
        check.shape(fn, label, a, self._shape("o", dims))
        check.last_axis_contiguous(fn, label, a)

    # -- options, checkpoints, scratch -------------------------------------------------------

    def _call(self, fn, xp, q, k, args, reference) -> AttentionCall:
        options = {o.name: args[o.name] for o in self.sig.options if o.name in args}
        options.update({name: args[name] for name in self.extra})
        return AttentionCall(
            fn, xp, q, k, options, packed=self.packed, flex=self.flex, reference=reference
        )

    def _checkpoint_arrays(self, fn, xp, checkpoints, dims, reference) -> dict:
        if not isinstance(checkpoints, self.Checkpoints):
            raise TypeError(
                f"{fn}: checkpoints must be the {self.Checkpoints.__name__} from "
                f"allocate_checkpoints({self.forward_name}, q, k, v), "
                f"got {type(checkpoints).__name__}"
            )
        arrays = {f"checkpoints.{n}": a for n, a in checkpoints._asdict().items()}
        check.same_namespace(fn, xp, arrays, reference)
        for name, a in arrays.items():
            check.shape(fn, name, a, self._shape(name.split(".")[1], dims))
            check.float32(fn, name, xp, a)
        return arrays

    def _allocator_call(self, named: str) -> str:
        options = ", **options" if self.flex else ""
        return f"allocate_scratchspace({self.backward_name}, {named}{options})"

    def _scratch_arrays(self, fn, xp, scratch, q, dims) -> dict:
        """The caller's scratch by label, checked (fields the backend does not use may be None)."""
        if not isinstance(scratch, self.Scratch):
            raise TypeError(
                f"{fn}: scratch must be the {self.Scratch.__name__} from "
                f"{self._allocator_call('O, Q, K, V')}, got {type(scratch).__name__}"
            )
        arrays = {f"scratch.{n}": a for n, a in scratch._asdict().items()}
        check.same_namespace(fn, xp, arrays, reference="Q.primal")
        for label, a in arrays.items():
            name = label.split(".")[1]
            if a is None:  # a field the backend does not use; the route checks those it needs
                continue
            if self.pattern[name] == ("N",):
                check.rank(fn, label, a, 1, "(N,)")
                check.float32(fn, label, xp, a)
                check.last_axis_contiguous(fn, label, a)
                continue
            check.shape(fn, label, a, self._shape(name, dims))
            check.accumulator(fn, label, xp, a, q.dtype)
            check.last_axis_contiguous(fn, label, a)
        return arrays

    def _allocate_scratch(self, route, q, dims, workspace=None):
        """The scratch fields ``route``'s backend uses, allocated for ``q``; None for the others."""
        fields = {}
        for a in self.sig.scratch:
            if self.pattern[a.name] != ("N",):
                needed = route.needs(a.name)
                shape = self._shape(a.name, dims)
                fields[a.name] = empty_accumulator(q, shape) if needed else None
        if self.flex:
            fields["score_mod_workspace"] = workspace
        return self.Scratch(**fields)

    @staticmethod
    def _features(deterministic: bool, mod_grads: bool) -> tuple[str, ...]:
        """The per-call routing features of a backward (``protocol.FEATURES``)."""
        return ("deterministic_score_mod_grad",) if deterministic and mod_grads else ()

    def _mod_grads(self, fn, xp, call, score_mod_grad) -> tuple:
        """One accumulator (or None) per captured array of the score graph, checked against it."""
        slots = call.slots
        if score_mod_grad is None:
            return (None,) * len(slots)
        if not isinstance(score_mod_grad, _mods.ScoreModGrad) or call.score is None:
            raise TypeError(
                f"{fn}: score_mod_grad must be the ScoreModGrad from grad_shadow(score_mod) of the "
                f"call's score mod, got {type(score_mod_grad).__name__}"
                + ("" if call.score is not None else " (and the call has no score_mod)")
            )
        if not score_mod_grad.made_for(call.score):
            raise TypeError(
                f"{fn}: score_mod_grad does not match score_mod {call.score.label}: it was made "
                f"by grad_shadow of another score mod ({score_mod_grad._label}, or one capturing "
                "other arrays); make it with grad_shadow(score_mod)"
            )
        grads = []
        for slot in slots:
            acc = score_mod_grad.lookup(slot.path, slot.field)
            if acc is not None:
                name = f"score_mod_grad for {slot.label}"
                check.namespace(fn, name, acc)
                check.shape(fn, name, acc, tuple(slot.array.shape))
                check.accumulator(fn, name, xp, acc, slot.array.dtype)
            grads.append(acc)
        return tuple(grads)

    def _workspace_need(self, fn, route, q, k, v, call, options, grads, deterministic) -> int:
        """Float32 elements of the score-mod workspace (the backend's hook; 0 without gradients)."""
        if all(g is None for g in grads):
            return 0
        hook = route.hook("score_mod_workspace")
        score, positions = options["score_mod"], options["input_pos"]
        try:
            if self.packed:
                cu = (options["cu_seqlens_q"], options["cu_seqlens_k"])
                planner = options["planner"]
                return hook(q, k, v, score, planner, *cu, positions, grads, deterministic)
            return hook(q, k, v, score, options["plan"], grads, deterministic)
        except ValueError as error:
            raise ValueError(f"{fn}: {error}") from None

    def _deterministic(self, fn, args) -> bool:
        return check.boolean(fn, "deterministic", args.get("deterministic", True))

    # -- forward -----------------------------------------------------------------------------

    def forward_(self, args: dict) -> None:
        """The in-place forward over the public function's arguments (its ``locals()``)."""
        fn = self.forward_name
        o = args["o"]
        q, k, v = (args[n] for n in _QKV)
        _autograd.check_inplace(fn, {"q": q, "k": k, "v": v, "o": o}, args.get("score_mod"))
        q, k, v = primal(q), primal(k), primal(v)
        xp, dims = self.validate_qkv(fn, q, k, v)
        check.same_namespace(fn, xp, {"q": q, "k": k, "v": v, "o": o})
        self._output(fn, xp, "o", o, dims)
        call = self._call(fn, xp, q, k, args, "q")
        checkpoints = args["checkpoints"]
        ck = {}
        if checkpoints is not None:
            ck = self._checkpoint_arrays(fn, xp, checkpoints, dims, "q")
        outputs = {"o": o, **ck}
        check.writable(fn, outputs)
        check.no_overlap(fn, outputs, {"q": q, "k": k, "v": v, **call.read()})
        route = resolve(
            self.name,
            {**outputs, "q": q, "k": k, "v": v, **call.read()},
            backend=args["backend"],
            head_dim=max(q.shape[-1], v.shape[-1]),
        )
        if checkpoints is not None:
            forget_forward(checkpoints)
        m, lse_sum = (ck.get(f"checkpoints.{n}") for n in ("m", "l"))
        route.impl.forward(o, q, k, v, m, lse_sum, **call.kernel_options(route))
        if checkpoints is not None:
            record_forward(checkpoints, fn, call.recorded(), _shapes(q, k, v))

    def forward(self, args: dict):
        """The allocating forward (autograd on torch tensors that require grad)."""
        fn = self.name
        options = {n: a for n, a in args.items() if n not in _QKV}
        recorded = _autograd.record(fn, {n: args[n] for n in _QKV}, options)
        if recorded is not _autograd.NOT_RECORDED:
            return recorded
        q, v = primal(args["q"]), primal(args["v"])
        for name, a in (("q", q), ("v", v)):
            check.namespace(fn, name, a)
            check.rank(fn, name, a, len(self.pattern[name]), _layout(self.pattern[name]))
        dims = {**dict(zip(self.pattern["q"], q.shape)), "Dv": v.shape[-1]}
        o = empty(q, self._shape("o", dims), q.dtype)
        self.forward_({**args, "o": o})
        return o

    def allocate_checkpoints(self, q, k=None, v=None, *args, **options):
        """``allocate_checkpoints(<name>_, q, k, v, ...)``: ``m, l`` float32 over q's rows."""
        fn = f"allocate_checkpoints({self.forward_name})"
        q = primal(q)
        check.namespace(fn, "q", q)
        check.rank(fn, "q", q, len(self.pattern["q"]), _layout(self.pattern["q"]))
        dims = dict(zip(self.pattern["q"], q.shape))
        rows = self._shape("m", dims)
        return self.Checkpoints(m=empty_float32(q, rows), l=empty_float32(q, rows))

    # -- backward ----------------------------------------------------------------------------

    def backward_(self, args: dict) -> None:
        """The in-place backward over the public function's arguments (its ``locals()``)."""
        fn = self.backward_name
        deterministic = self._deterministic(fn, args) if self.flex else True
        Ds = {n: args[n] for n in ("O", "Q", "K", "V")}
        _autograd.check_inplace(fn, Ds, args.get("score_mod"))
        Ds = {n: check.duplicated(fn, n, d) for n, d in Ds.items()}
        named = {
            f"{n}.{part}": getattr(d, part) for n, d in Ds.items() for part in ("primal", "shadow")
        }
        for label, a in named.items():
            check.namespace(fn, label, a)
        q, k, v, o = (Ds[n].primal for n in ("Q", "K", "V", "O"))
        xp, dims = self.validate_qkv(fn, q, k, v, names=("Q.primal", "K.primal", "V.primal"))
        check.same_namespace(fn, xp, named, "Q.primal")
        for label in ("O.primal", "O.shadow"):
            self._output(fn, xp, label, named[label], dims)
        for n in ("Q", "K", "V"):
            label = f"{n}.shadow"
            check.floating(fn, label, xp, named[label])
            check.shape(fn, label, named[label], tuple(Ds[n].primal.shape))
            check.last_axis_contiguous(fn, label, named[label])
        call = self._call(fn, xp, q, k, args, "Q.primal")
        checkpoints, scratch = args["checkpoints"], args["scratch"]
        if checkpoints is None:
            raise ValueError(
                f"{fn}: checkpoints are required: pass the {self.Checkpoints.__name__} that "
                f"{self.forward_name} filled in the forward "
                f"(allocate_checkpoints({self.forward_name}, q, k, v))"
            )
        ck = self._checkpoint_arrays(fn, xp, checkpoints, dims, "Q.primal")
        given = {} if scratch is None else self._scratch_arrays(fn, xp, scratch, q, dims)
        grads = self._mod_grads(fn, xp, call, args.get("score_mod_grad")) if self.flex else ()
        outputs = {
            **{f"{n}.shadow": Ds[n].shadow for n in ("Q", "K", "V")},
            **given,
            **{f"score_mod_grad for {s.label}": g for s, g in zip(call.slots, grads)},
        }
        check.writable(fn, outputs)
        reads = {"Q.primal": q, "K.primal": k, "V.primal": v, "O.primal": o}
        reads.update({"O.shadow": Ds["O"].shadow, **ck, **call.read()})
        check.no_overlap(fn, outputs, reads)
        check_forward(fn, checkpoints, self.forward_name, call.recorded(), _shapes(q, k, v))
        route = resolve(
            self.name,
            {
                **named,
                **ck,
                **given,
                **call.read(),
                **{f"score_mod_grad {i}": g for i, g in enumerate(grads)},
            },
            backend=args["backend"],
            head_dim=max(q.shape[-1], v.shape[-1]),
            features=self._features(deterministic, any(g is not None for g in grads)),
        )
        options = call.kernel_options(route)
        if scratch is None:
            held = self._allocate_scratch(route, q, dims)
        else:
            route.require_scratch(fn, scratch)
            held = scratch
        if self.flex:
            need = self._workspace_need(fn, route, q, k, v, call, options, grads, deterministic)
            options.update(
                score_mod_grads=grads,
                deterministic=deterministic,
                score_mod_workspace=self._workspace(fn, route, need, scratch, q),
            )
        route.impl.backward(
            Ds["O"].shadow,
            q,
            k,
            v,
            o,
            ck["checkpoints.m"],
            ck["checkpoints.l"],
            Ds["Q"].shadow,
            Ds["K"].shadow,
            Ds["V"].shadow,
            held.delta,
            held.dq_accum,
            **options,
        )

    def _workspace(self, fn, route, need: int, scratch, like):
        """The score-mod workspace a backward passes its backend: None when ``need`` (the
        backend hook's float32 elements) is 0, a new array when the caller gave no scratch,
        else the caller's, which must hold ``need`` elements."""
        if need == 0:
            return None
        if scratch is None:
            return empty_float32(like, (need,))
        workspace = scratch.score_mod_workspace
        held = 0 if workspace is None else workspace.shape[0]
        if held < need:
            raise ValueError(
                f"{fn}: scratch.score_mod_workspace holds {held} float32 elements but this "
                f"call's score-mod gradients need {need} on backend {route.backend!r}; allocate "
                f"the scratch with {self._allocator_call('O, Q, K, V')} passing the call's "
                "score_mod, score_mod_grad, mask and tile options and deterministic"
            )
        return workspace

    def backward(self, args: dict):
        """The allocating backward: ``(dq, dk, dv)`` in new arrays."""
        fn = f"{self.name}_backward"
        shadows = with_new_shadows(fn, {n: args[n] for n in _QKV})
        o, do = primal(args["o"]), args["do"]
        check.namespace(fn, "o", o)
        check.rank(fn, "o", o, len(self.pattern["o"]), _layout(self.pattern["o"]))
        check.namespace(fn, "do", do)
        check.shape(fn, "do", do, tuple(o.shape))
        O = Duplicated(o, do)
        rest = {n: a for n, a in args.items() if n not in (*_QKV, "o", "do")}
        upper = {"Q": shadows["q"], "K": shadows["k"], "V": shadows["v"]}
        self.backward_({**rest, **upper, "O": O, "scratch": None})
        return tuple(shadows[n].shadow for n in _QKV)

    def allocate_scratch(self, O, Q, K=None, V=None, *args, backend=None, **options):
        """``allocate_scratchspace(<name>_backward_, O, Q, K, V, ...)`` for the routed backend."""
        fn = f"allocate_scratchspace({self.backward_name})"
        deterministic = self._deterministic(fn, options) if self.flex else True
        q = primal(Q)
        xp = check.namespace(fn, "Q", q)
        pattern = self.pattern["q"]
        check.rank(fn, "Q", q, len(pattern), _layout(pattern))
        check.floating(fn, "Q", xp, q)
        dims = dict(zip(pattern, q.shape))
        arrays = {"Q": q, "O": primal(O), "K": primal(K), "V": primal(V)}
        head_dim = max(a.shape[-1] for a in arrays.values() if a is not None)
        score_mod_grad = options.get("score_mod_grad")
        features = self._features(deterministic, score_mod_grad is not None)
        route = resolve(self.name, arrays, backend=backend, head_dim=head_dim, features=features)
        workspace = None
        if self.flex and score_mod_grad is not None:
            extra = dict(zip(self.extra, args))
            extra.update({n: options[n] for n in self.extra if n in options})
            if K is None or V is None or any(extra.get(n) is None for n in self.extra):
                needed = ", ".join(("K", "V", *self.extra))
                raise TypeError(
                    f"{fn}: {needed} are needed to size the workspace of score_mod_grad"
                )
            k, v = primal(K), primal(V)
            xp, dims = self.validate_qkv(fn, q, k, v, names=("Q", "K", "V"))
            defaults = {o.name: o.default for o in self.sig.options}
            call = self._call(fn, xp, q, k, {**defaults, **options, **extra}, "Q")
            grads = self._mod_grads(fn, xp, call, score_mod_grad)
            kernel = call.kernel_options(route)
            need = self._workspace_need(fn, route, q, k, v, call, kernel, grads, deterministic)
            workspace = empty_float32(q, (need,)) if need else None
        return self._allocate_scratch(route, q, dims, workspace)

    def register(self, forward_, backward_) -> None:
        """File the allocators under the public in-place functions."""
        checkpoints_for(forward_)(self.allocate_checkpoints)
        scratchspace_for(backward_)(self.allocate_scratch)
