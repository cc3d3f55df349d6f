"""The rows of xpkernels' CPU benchmark: :class:`Row`, :class:`Bench` and :func:`compare`.

A :class:`Bench` pairs a :class:`Row` (what is timed, its work and formula,
the row its ratio compares with) with a ``setup()`` that allocates every
input, output, checkpoint and scratch buffer and returns the call to time;
:func:`compare` builds the two sides of one ratio. :mod:`.bench_cases` and
:mod:`.bench_loss` declare the rows, :mod:`.bench` times them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Bench", "Row", "Setup", "compare", "torch_setup", "xpk_setup"]


@dataclass
class Row:
    """One timed (primitive, pass, implementation) and what it implies.

    ``work`` is the bytes moved (``unit`` GB/s) or the FLOPs done
    (``unit`` TFLOP/s) by one run, per ``formula``; ``baseline`` names the
    row ``ratio = median_s / baseline's median_s`` compares with.
    ``times_s`` are the timed runs the statistics come from (those of the
    re-timing when ``retimed``); ``spread = (max_s - min_s) / median_s``;
    ``flagged`` says the final timing's spread exceeds :data:`.bench.SPREAD_LIMIT`;
    ``first_spread`` is the spread of the first timing of a re-timed row.
    """

    op: str
    pass_: str
    impl: str
    shape: str
    unit: str
    work: float
    formula: str
    baseline: str | None = None
    dtype: str = "float32"
    times_s: list = field(default_factory=list)
    repeats: int = 0
    min_s: float | None = None
    median_s: float | None = None
    max_s: float | None = None
    spread: float | None = None
    flagged: bool = False
    retimed: bool = False
    first_spread: float | None = None
    rate: float | None = None
    ratio: float | None = None
    error: str | None = None

    @property
    def key(self) -> str:
        return f"{self.op}/{self.pass_}/{self.impl}"

    def measured(self) -> tuple[float, float, float, float]:
        """``(min_s, median_s, max_s, spread)`` of a row that was timed (not an error row)."""
        if self.min_s is None or self.median_s is None or self.max_s is None or self.spread is None:
            raise ValueError(f"bench: {self.key} has no timings ({self.error or 'not run'})")
        return self.min_s, self.median_s, self.max_s, self.spread


@dataclass
class Bench:
    """A row to measure: ``setup()`` allocates everything and returns the callable to time."""

    row: Row
    setup: Callable[[], Callable[[], object]]
    repeats: int


Setup = Callable[[], Callable[[], object]]


def compare(
    op: str,
    pass_: str,
    shape: str,
    unit: str,
    work: tuple[float, str],
    repeats: int,
    ours: tuple[str, Setup],
    theirs: tuple[str, Setup] | None = None,
) -> list[Bench]:
    """The benches of one comparison: ``ours`` timed against ``theirs`` in the same run.

    Parameters
    ----------
    op, pass_, shape, unit
        What both rows measure (see :class:`Row`).
    work : tuple of (float, str)
        The work of one run and its formula (see :class:`Row`).
    repeats : int
        Timed runs of each side.
    ours, theirs : tuple of (str, callable)
        ``(impl, setup)`` of each side; ``setup()`` allocates everything and
        returns the callable to time. ``theirs=None`` (its library is missing):
        ``ours`` alone, without a ratio.

    Returns
    -------
    list of Bench
        ``ours`` (its ratio is its median over that of ``theirs``), then ``theirs``.
    """
    baseline = None if theirs is None else f"{op}/{pass_}/{theirs[0]}"
    benches = [Bench(Row(op, pass_, ours[0], shape, unit, *work, baseline), ours[1], repeats)]
    if theirs is not None:
        benches.append(Bench(Row(op, pass_, theirs[0], shape, unit, *work), theirs[1], repeats))
    return benches


def xpk_setup(pass_: str, make_calls, *args):
    """The setup of one pass of xpkernels' calls: ``make_calls(*args)`` (a ``Calls``, its
    buffers allocated) then its forward or backward to time."""

    def setup():
        calls = make_calls(*args)
        return calls.forward if pass_ == "forward" else calls.backward

    return setup


def torch_setup(pass_: str, make) -> Setup:
    """The setup of one pass of a PyTorch composition: ``make(grad)`` builds its tensors (the
    leaves requiring grad when ``grad``) and returns ``(call, leaves, cotangents)``; the
    forward times ``call()`` under ``torch.no_grad()``, the backward autograd's gradients of
    ``call()``'s output (computed once, in the setup) to ``leaves``."""

    def setup():
        import torch

        grad = pass_ == "backward"
        call, leaves, cotangents = make(grad)
        if not grad:

            def forward():
                with torch.no_grad():
                    return call()

            return forward
        out = call()
        return lambda: torch.autograd.grad(out, leaves, cotangents, retain_graph=True)

    return setup
