"""Bad input, round three (issue 34), over every primitive and every backend target.

The generic bad calls -- a ``None`` or a list for every array argument of every
public function, an output that overlaps itself or an input, a check after a
write -- are generated from the argument declarations
(:mod:`xpkernels.testing.declared_errors`) and run by the conformance suite
on every target (``conformance/test_templates.py::test_error_inputs_raise``).
The tests here check that the generation covers every argument of every
public function, that its base calls are valid, and the rest of the issue:
NaN in merged statistics reaches exactly its rows (class 4), states no
attention produces and backwards over no rows (class 5), and the self-overlap
test the checks rely on.
"""

from __future__ import annotations

import inspect
import itertools

import numpy as np
import pytest
from xpkernels.backends.protocol import PRIMITIVES

import xpkernels as xk
from xpkernels._memory import self_overlapping
from xpkernels.buffers import Duplicated
from xpkernels.testing import harness
from xpkernels.testing import references as ref
from xpkernels.testing.declared_errors import SENTINEL, valid_call
from xpkernels.testing.declared_fronts import EXTENTS, fronts
from xpkernels.testing.specs.attention_varlen import PREFIX_SUMS
from xpkernels.testing.specs.merge_attention_states import EXTRA as MERGE_EXTRA

harness.select_triton_interpreter()  # before any Triton kernel is defined

#: What the generator needs beyond each Signature (as the specs pass it).
_EXTRA = {"merge_attention_states": MERGE_EXTRA}
_VALUES = {"attention_varlen": PREFIX_SUMS, "flex_attention_varlen": PREFIX_SUMS}
_NUMPY = harness.Target("array_api", "numpy", "cpu")
_SPECS = {spec.name: spec for spec in harness.load_specs()}


def _fronts(primitive):
    return fronts(primitive, _EXTRA.get(primitive))


def _targets(op):
    """Every target that runs ``op`` (emulated ones in the default schedule), skipped with the
    reason where it cannot run here."""
    params = []
    for target in harness.TARGETS:
        if not target.dtypes(op) or target.schedule not in (None, "default"):
            continue
        reason = target.unavailable()
        marks = [pytest.mark.skip(reason=f"{target.id}: {reason}")] if reason else []
        if target.triton_interpreter:
            marks.append(pytest.mark.filterwarnings("ignore::RuntimeWarning"))
        params.append(pytest.param(target, marks=marks, id=target.id))
    return params


# ---- the generated cases cover every array argument of every public function ----------------


def _public_functions(primitive):
    return [
        name
        for name in (primitive, f"{primitive}_", f"{primitive}_backward", f"{primitive}_backward_")
        if name in xk.__all__
    ]


@pytest.mark.parametrize("primitive", list(PRIMITIVES))
def test_every_public_function_has_its_array_arguments_declared(primitive):
    """Each parameter of each public function is an array the generator knows, or an option."""
    sig = PRIMITIVES[primitive].signature
    options = {o.name for o in sig.options} | {"backend", "checkpoints", "scratch"}
    by_name = {f.fn: f for f in _fronts(primitive)}
    assert sorted(by_name) == sorted(_public_functions(primitive))
    for fn, front in by_name.items():
        declared = {p.name for p in front.params}
        for name in inspect.signature(getattr(xk, fn)).parameters:
            assert name in declared or name in options, f"{fn}: {name} is neither"


@pytest.mark.parametrize("primitive", list(PRIMITIVES))
def test_every_array_argument_gets_none_list_and_overlap_cases(primitive):
    """The parameterised cases of issue 34: a None (where not optional) and a list for every
    array argument, a self-overlapping view, a read-only array and an input's memory for every
    array an in-place function writes -- none of them written by hand."""
    ids = {err.id for err in _SPECS[primitive].errors()}
    for front in _fronts(primitive):
        for p in front.params:
            wholes = {p.name} if p.kind in ("duplicated", "checkpoints", "scratch") else set()
            labels = {s.label: s for s in p.slots}
            for label in wholes:
                if not p.optional:
                    assert f"{front.fn}-{label}-none" in ids
            if p.kind == "duplicated":
                assert f"{front.fn}-{p.name}-list" in ids
            for label, slot in labels.items():
                assert f"{front.fn}-{label}-list" in ids
                if not slot.optional and not label.endswith(".shadow"):
                    assert f"{front.fn}-{label}-none" in ids
                if slot.written:
                    # a scalar (a reduced loss) has one element: it cannot overlap itself
                    kinds = ("self-overlapping", "read-only") if slot.axes else ("read-only",)
                    for what in kinds:
                        assert f"{front.fn}-{label}-{what}" in ids
                    overlaps = [f"{front.fn}-{label}-is-", f"{front.fn}-{label}-overlaps-"]
                    assert any(i.startswith(tuple(overlaps)) for i in ids), label


@pytest.mark.parametrize(
    "primitive,fn",
    [(p, f.fn) for p in PRIMITIVES for f in _fronts(p)],
)
def test_the_generated_base_calls_succeed(primitive, fn):
    """Every generated case changes one thing of a valid call: that call must succeed."""
    front = next(f for f in _fronts(primitive) if f.fn == fn)
    valid_call(front, _NUMPY, _VALUES.get(primitive)).run()


# ---- class 4: NaN in merged statistics reaches exactly its rows -------------------------------

_SHAPE = (2, 3, 5, 4)


def _merge_states(seed):
    rng = np.random.default_rng(seed)
    states = []
    for _ in range(2):
        states += [
            rng.standard_normal(_SHAPE),
            rng.standard_normal(_SHAPE[:3]) * 2,
            1 + rng.random(_SHAPE[:3]) * 10,
        ]
    return [a.astype(np.float32) for a in states]


#: Rows of the (2, 3, 5) statistics and what they get: NaN in each statistic of each side,
#: and the states no attention produces (``m = +inf``, a negative ``l``, ``l = +inf``).
_BAD_ROWS = {
    (0, 0, 1): ("l_a", np.nan),
    (0, 1, 2): ("l_b", np.nan),
    (0, 2, 3): ("m_a", np.nan),
    (1, 0, 4): ("m_b", np.nan),
    (1, 1, 0): ("m_a", np.inf),
    (1, 2, 2): ("l_b", -1.0),
    (1, 2, 4): ("l_a", np.inf),
}
_NAMES = ("o_a", "m_a", "l_a", "o_b", "m_b", "l_b")


def _run_merge(target, states, do, dlse):
    arrays = [target.asarray(a, "float32") for a in states]
    o, m, lse_sum = xk.merge_attention_states(*arrays, backend=target.backend)
    grads = xk.merge_attention_states_backward(
        target.asarray(do, "float32"),
        o,
        m,
        lse_sum,
        *arrays,
        dlse=target.asarray(dlse, "float32"),
        backend=target.backend,
    )
    return [target.to_numpy(a) for a in (o, m, lse_sum, *grads)]


@pytest.mark.parametrize("target", _targets("merge_attention_states"))
def test_nan_in_merged_statistics_reaches_exactly_its_rows(target):
    """A NaN (or a state no attention produces) in ``m_a``, ``l_a``, ``m_b`` or ``l_b`` makes
    that row's ``o`` and ``l`` NaN (``m`` where it is in an ``m``), and that row's ``do_a``,
    ``do_b``, ``dlse_a``, ``dlse_b``; every other row is what it is without it, bit for bit."""
    with target.context():
        clean = _merge_states(seed=1)
        bad = [a.copy() for a in clean]
        for row, (name, value) in _BAD_ROWS.items():
            bad[_NAMES.index(name)][row] = value
        rng = np.random.default_rng(2)
        do, dlse = rng.standard_normal(_SHAPE), rng.standard_normal(_SHAPE[:3])
        with np.errstate(invalid="ignore"):  # inf - inf in the NumPy kernels: the NaN we want
            got = _run_merge(target, bad, do, dlse)
        want = _run_merge(target, clean, do, dlse)
    rows = np.zeros(_SHAPE[:3], dtype=bool)
    for row in _BAD_ROWS:
        rows[row] = True
    m_nan = np.isnan(bad[1]) | np.isnan(bad[4])
    o, m, lse_sum, do_a, do_b, dlse_a, dlse_b = got
    for name, a in (("o", o), ("do_a", do_a), ("do_b", do_b)):
        np.testing.assert_array_equal(np.isnan(a).all(-1), rows, err_msg=name)
        np.testing.assert_array_equal(np.isnan(a).any(-1), rows, err_msg=name)
    for name, a in (("l", lse_sum), ("dlse_a", dlse_a), ("dlse_b", dlse_b)):
        np.testing.assert_array_equal(np.isnan(a), rows, err_msg=name)
    np.testing.assert_array_equal(np.isnan(m), m_nan, err_msg="m")
    for name, g, w in zip(("o", "m", "l", "do_a", "do_b", "dlse_a", "dlse_b"), got, want):
        np.testing.assert_array_equal(g[~rows], w[~rows], err_msg=name)
    with np.errstate(invalid="ignore", divide="ignore"):
        ref_o, _, _ = ref.merge_attention_states(*[a.astype(np.float64) for a in bad])
    np.testing.assert_array_equal(np.isnan(ref_o).all(-1), rows, err_msg="reference o")


# ---- class 5: states no attention produces, backwards over no rows ---------------------------


@pytest.mark.parametrize(
    "name,value", [("m_a", np.inf), ("m_b", np.inf), ("l_a", -1.0), ("l_b", np.inf)]
)
def test_debug_mode_refuses_states_no_attention_produces(name, value):
    """``m = +inf``, a negative or infinite ``l``: refused in debug mode, naming the argument,
    before anything is written (outside it the row merges into NaN, as tested above)."""
    states = _merge_states(seed=3)
    states[_NAMES.index(name)][0, 1, 2] = value
    outs = [np.full_like(states[i], SENTINEL) for i in range(3)]
    with xk.debug(), pytest.raises(ValueError, match=rf"merge_attention_states_: {name} holds"):
        xk.merge_attention_states_(*outs, *states)
    assert all((a == SENTINEL).all() for a in outs)
    clean = _merge_states(seed=3)
    o, m, lse_sum = xk.merge_attention_states(*clean)
    do_a, dlse_a = np.full_like(o, SENTINEL), np.full_like(m, SENTINEL)
    merged = {"m": m, "l": lse_sum}
    merged.update({n: a for n, a in zip(_NAMES, states)})
    with xk.debug(), pytest.raises(ValueError, match=rf"merge_attention_states_backward_: {name}"):
        xk.merge_attention_states_backward_(
            Duplicated(o, np.ones_like(o)),
            merged["m"],
            merged["l"],
            Duplicated(merged["o_a"], do_a),
            merged["m_a"],
            merged["l_a"],
            Duplicated(merged["o_b"], np.empty_like(o)),
            merged["m_b"],
            merged["l_b"],
            dlse_a=dlse_a,
            dlse_b=np.empty_like(m),
        )
    assert (do_a == SENTINEL).all() and (dlse_a == SENTINEL).all()


_ROWS = [p for p in PRIMITIVES if PRIMITIVES[p].signature.kind == "rows"]


@pytest.mark.parametrize(
    "primitive,target",
    [
        pytest.param(p, *t.values, marks=t.marks, id=f"{p}-{t.id}")
        for p in _ROWS
        for t in _targets(p)
    ],
)
@pytest.mark.parametrize("leading", [(0,), (3, 0)], ids=["0xM", "3x0xM"])
def test_row_primitives_over_no_rows(primitive, target, leading):
    """Arrays of shape ``(0, M)`` or ``(3, 0, M)``: the forward writes nothing, the backward
    succeeds with the gradients of the ``(M,)`` inputs (weights, biases) zeroed."""
    with target.context():
        for front in _fronts(primitive):
            call = valid_call(front, target, extents={**EXTENTS, "R": 0})
            for slot in front.slots:
                if slot.axes == ("R", "M") and call.arrays[slot.label] is not None:
                    fill = SENTINEL if slot.written else 0.5
                    shape = (*leading, EXTENTS["M"])
                    call.arrays[slot.label] = target.full(shape, fill, "float32")
            call.run()
            for slot in front.slots:
                if slot.written and slot.axes == ("M",):
                    got = target.to_numpy(call.arrays[slot.label])
                    np.testing.assert_array_equal(got, 0.0, err_msg=f"{front.fn}: {slot.label}")


# ---- the self-overlap test ------------------------------------------------------------------


def test_self_overlapping_matches_enumerating_addresses():
    """Exact on every small layout: zero, negative, repeated and interleaved strides."""
    buffer = np.zeros(4096, np.float32)
    rng = np.random.default_rng(0)
    for _ in range(2000):
        ndim = int(rng.integers(1, 4))
        shape = tuple(int(n) for n in rng.integers(1, 5, ndim))
        steps = tuple(int(s) for s in rng.integers(-6, 7, ndim))
        view = np.lib.stride_tricks.as_strided(
            buffer[2048:], shape, tuple(4 * s for s in steps), writeable=False
        )
        addresses = [
            sum(i * s for i, s in zip(index, steps))
            for index in itertools.product(*map(range, shape))
        ]
        overlaps = len(set(addresses)) < len(addresses)
        assert self_overlapping(view) == overlaps, (shape, steps)


def test_self_overlapping_on_torch_views():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    assert self_overlapping(torch.zeros(8).expand(4, 8))
    assert not self_overlapping(torch.zeros(4, 2, 8)[:, 0])
    assert not self_overlapping(torch.zeros(0, 3).expand(5, 0, 3))
    assert self_overlapping(torch.zeros(64).as_strided((4, 8), (4, 1)))


def test_a_duplicated_of_non_arrays_is_refused_by_the_function_naming_the_field():
    x = np.ones((3, 8), np.float32)
    with pytest.raises(TypeError, match=r"softmax_backward_: X\.primal must be an array"):
        xk.softmax_backward_(Duplicated(x, x.copy()), Duplicated(None, x.copy()))
    with pytest.raises(TypeError, match=r"softmax_backward_: Y\.shadow must be an array"):
        xk.softmax_backward_(Duplicated(x, [1.0] * 8), Duplicated(x))
