"""``python -m xpkernels check``: every primitive on every available backend vs float64.

For each primitive x available target (backend x array namespace x device)
the check runs the primitive's ``quick`` cases -- the very cases the
conformance suite declares in :mod:`xpkernels.testing.specs` -- in float32:
the in-place forward (with checkpoints) and the in-place backward (into
NaN-filled shadows, so an element left unwritten shows up as an infinite
error), compared with the naive float64 references of
:mod:`xpkernels.testing.references` on the same float32-rounded inputs.
Errors are ``max|actual - reference| / max(max|reference|, 1)``; each result
is allowed the tolerance of :func:`xpkernels.testing.tolerances.allowed`
(the conformance suite's rule). The full suite, with every case and dtype,
is ``pytest conformance``.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field

from ..registry import OPS, BackendError, resolve
from ..testing import harness, tolerances
from ..testing.harness import TARGETS, Case, OpSpec, Target, max_error

DTYPE = "float32"


@dataclass
class Row:
    """One line of the table: a primitive's quick case on a target, or what went wrong.

    ``forward`` / ``backward`` hold ``(error, tolerance)`` of the result with
    the largest error-to-tolerance ratio in that pass (outputs and
    checkpoints count as the forward); None when the pass did not run.
    """

    op: str
    case: str
    target: Target
    forward: tuple[float, float] | None = None
    backward: tuple[float, float] | None = None
    error: str | None = None
    details: str | None = None
    skipped: str | None = None
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        if self.error is not None or self.forward is None:
            return False
        return not self.failures


def _worst(results: list[tuple[float, float]]) -> tuple[float, float]:
    return max(results, key=lambda r: r[0] / r[1])


def check_one(spec: OpSpec, case: Case, target: Target) -> Row:
    """Run ``case`` of ``spec`` on ``target`` in float32; any exception becomes the row's error."""
    row = Row(spec.name, case.id, target)
    try:
        rng, arrays, exact = harness.setup(spec, case, target, DTYPE)
        try:
            resolve(spec.name, arrays, backend=target.backend)
        except BackendError as exc:
            row.skipped = str(exc).split(": ", 2)[-1]
            return row
        cot, cot_exact = (
            ({}, {})
            if spec.backward is None
            else harness.cotangents(spec, case, rng, target, DTYPE)
        )
        allowed = tolerances.allowed(spec, case, exact, cot_exact, DTYPE)
        expected = tolerances.references(spec, case, exact, cot_exact)

        outs = spec.allocate_outputs(case, arrays, target, DTYPE)
        ck = harness.nan_checkpoints(spec, case, arrays)
        spec.forward_(case, arrays, outs, ck, target.backend)
        got = {("forward", n): outs[n] for n in spec.outputs}
        got.update({("checkpoints", n): getattr(ck, n) for n in spec.checkpoint_names})
        if spec.backward is not None:
            grads = harness.nan_grads(spec, arrays, target)
            spec.backward.inplace(case, arrays, outs, cot, grads, ck, target.backend)
            got.update({("backward", n): grads[n] for n in grads})
        measured = {
            key: (max_error(target.to_numpy(a), expected[key]), allowed[key])
            for key, a in got.items()
        }
        row.forward = _worst([r for (pass_, _), r in measured.items() if pass_ != "backward"])
        backward = [r for (pass_, _), r in measured.items() if pass_ == "backward"]
        row.backward = _worst(backward) if backward else None
        row.failures = [f"{p} {n}" for (p, n), (err, tol) in measured.items() if not err <= tol]
    except Exception as exc:  # noqa: BLE001 - every failure is reported in the table
        row.error = f"{type(exc).__name__}: {exc}"
        row.details = traceback.format_exc()
    return row


def _fmt(result: tuple[float, float] | None, index: int) -> str:
    return "-" if result is None else f"{result[index]:.1e}"


def run(ops=None, verbose=False) -> int:
    """Print the PASS/FAIL table for ``ops`` (default: all); returns 1 on any FAIL, else 0."""
    specs = {spec.name: spec for spec in harness.load_specs()}
    chosen = [specs[op] for op in OPS if op in specs and (not ops or op in ops)]
    skipped, rows = [], []
    for target in TARGETS:
        if not any(target.dtypes(spec.name) for spec in chosen):
            continue
        reason = target.unavailable()
        if reason:
            skipped.append(f"{target.backend} on {target.label}: {reason}")
            continue
        for spec in chosen:
            if DTYPE not in target.dtypes(spec.name):
                continue
            for case in spec.cases:
                if not case.quick:
                    continue
                with target.context():
                    row = check_one(spec, case, target)
                if row.skipped:
                    skipped.append(
                        f"{target.backend} on {target.label}, {spec.name}: {row.skipped}"
                    )
                else:
                    rows.append(row)

    header = (
        "primitive",
        "case",
        "backend",
        "arrays",
        "forward",
        "backward",
        "tolerance",
        "result",
    )
    table = [header]
    for row in rows:
        tol = _fmt(row.forward, 1) + ("" if row.backward is None else f" / {_fmt(row.backward, 1)}")
        table.append(
            (
                row.op,
                row.case,
                row.target.backend,
                row.target.label,
                _fmt(row.forward, 0),
                _fmt(row.backward, 0),
                tol,
                "PASS" if row.passed else "FAIL",
            )
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    print(
        "float32 inputs; error = max|got - float64 reference| / max(max|reference|, 1); "
        "tolerance = max(floor, 2 x the error of the reference formula run in float32)"
    )
    for line in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
    for row in rows:
        if row.error:
            print(f"\n{row.op} on {row.target.backend} / {row.target.label} raised {row.error}")
            if verbose:
                print(row.details)
        elif row.failures:
            print(
                f"\n{row.op} on {row.target.backend} / {row.target.label}: beyond tolerance: "
                + ", ".join(row.failures)
            )
    if skipped:
        print("\nnot checked here:")
        for reason in skipped:
            print(f"  {reason}")
    failed = sum(not row.passed for row in rows)
    print(f"\n{len(rows) - failed} PASS, {failed} FAIL")
    return 1 if failed else 0
