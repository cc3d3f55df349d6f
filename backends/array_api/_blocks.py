"""Row blocks within a fixed budget, NumPy worker threads and ufunc buffer, accumulation dtype.

Every row kernel splits its ``(rows, M)`` views into blocks of at most
``ROW_BLOCK_ELEMENTS`` elements (or its own budget, passed as ``elements``)
and runs a block function over them with
:func:`for_each_block`. The block functions are plain Array API code. A few
NumPy-only measures, each measured at (8192, 4096) float32 where a plain
NumPy loop loses to PyTorch's multi-threaded CPU ops, apply to NumPy arrays
only:

- the blocks are shared among up to ``MAX_WORKERS`` threads (NumPy releases
  the GIL inside its loops; each operation still hands the GIL over, which
  is why blocks are as large as L2 allows);
- NumPy's ufunc buffer is set to the row length for the call. With the
  default (8192 elements) an operation that broadcasts a per-row value over
  rows shorter than the buffer copies the rows through the buffer, which
  makes it about 2.5x slower than the same operation without broadcasting
  (at M = 4096); with a buffer of one row it runs at full speed;
- :class:`ColumnSums` sums products with ``einsum`` passes, and :func:`store`
  writes a kernel's last step straight into its output where that was faster;
- PyTorch CPU tensors that NumPy can hold take the same path through
  zero-copy views (:func:`numpy_views`): on them LayerNorm ran 1.45x / 3.34x
  torch's time (forward / backward) on the Array API path over torch ops and
  0.74x / 0.52x through the views (same bench, 8192x4096 float32).

Each worker holds a few block-sized temporaries at a time, so the extra
memory of a call is bounded by ``workers x`` a few blocks, never by the
number of rows.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import array_api_compat

from xpkernels._memory import torch_numpy_view

__all__ = [
    "BLOCK_ELEMENTS",
    "BlockBuffers",
    "ColumnSums",
    "LOG2E",
    "MAX_WORKERS",
    "MIN_BUFFER_ROW",
    "ROW_BLOCK_ELEMENTS",
    "SAFE_EXPONENT",
    "SUM_CHUNK_ROWS",
    "acc_dtype",
    "apply",
    "blas_threads",
    "block_rows",
    "for_each_block",
    "for_each_item",
    "max_row_norm",
    "numpy_views",
    "ones",
    "path_arrays",
    "path_namespace",
    "reduce_partials",
    "row_blocks",
    "spans",
    "store",
    "tile_workers",
    "tiled",
    "to",
    "workers",
]

#: Elements per temporary of one tile or row block (float32: 1 MiB): the
#: budget the attention kernels size their tiles by.
BLOCK_ELEMENTS = 1 << 18

#: Elements per block of the row kernels (float32: 512 KiB): the largest
#: whose few temporaries stay in a core's L2 cache (2 MiB here); larger
#: blocks mean fewer GIL hand-offs per element (measured best of 2**16..2**18).
ROW_BLOCK_ELEMENTS = 1 << 17

#: Most threads one call uses on NumPy arrays (the caller's thread included).
MAX_WORKERS = 8

#: Shortest row for which a one-row ufunc buffer pays on NumPy; shorter rows
#: are faster through the default buffer.
MIN_BUFFER_ROW = 256

#: Attention scores are exponentiated unshifted while every running row max
#: is within this bound: ``exp(40)`` times any realistic key count stays
#: finite and ``exp(-40)`` is far above the float32 underflow threshold.
SAFE_EXPONENT = 40.0

#: log2(e): base-2 scores (``s * LOG2E``) give ``exp(s)`` as ``exp2``, twice
#: as fast as ``exp`` in NumPy's float32 loops.
LOG2E = 1.4426950408889634

#: Rows per chunk of :class:`ColumnSums`: each chunk's column sums run as one
#: sequence of additions, so no total takes more than this many roundings per level.
SUM_CHUNK_ROWS = 16

_POOL: ThreadPoolExecutor | None = None
_BLAS: tuple | None = None
_BLAS_LOCK = threading.Lock()
_BLAS_USERS = 0
_BLAS_PREVIOUS = 0
_POOL_PID = -1
_POOL_LOCK = threading.Lock()


def row_blocks(rows: int, m: int, elements: int = BLOCK_ELEMENTS) -> list[tuple[int, int]]:
    """``(start, stop)`` ranges over ``rows`` rows of length ``m``, ``elements`` at most each."""
    step = max(1, elements // max(m, 1))
    return [(start, min(rows, start + step)) for start in range(0, rows, step)]


def spans(start: int, stop: int, size: int):
    """``(first, end)`` ranges of at most ``size`` covering ``[start, stop)``."""
    for first in range(start, stop, size):
        yield first, min(stop, first + size)


def block_rows(rows: int, m: int, elements: int | None = None) -> int:
    """Rows in the largest block :func:`for_each_block` makes of ``rows`` rows of length ``m``
    (``elements`` per block at most; ``ROW_BLOCK_ELEMENTS`` when None)."""
    return min(rows, max(1, (elements or ROW_BLOCK_ELEMENTS) // max(m, 1)))


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def workers(xp, rows: int, m: int, elements: int | None = None) -> int:
    """Threads a row kernel over ``rows`` rows of length ``m`` (blocks of ``elements``, as
    :func:`block_rows`) uses: 1 except on NumPy arrays."""
    if not array_api_compat.is_numpy_namespace(xp):
        return 1
    blocks = row_blocks(rows, m, elements or ROW_BLOCK_ELEMENTS)
    return max(1, min(MAX_WORKERS, _cores(), len(blocks)))


def tile_workers(xp, items: int) -> int:
    """Threads a tiled kernel with ``items`` independent work items uses: 1 except on NumPy arrays."""
    if not array_api_compat.is_numpy_namespace(xp):
        return 1
    return max(1, min(MAX_WORKERS, _cores(), items))


def _pool() -> ThreadPoolExecutor:
    """The shared worker threads, recreated in a forked child (threads do not survive a fork)."""
    global _POOL, _POOL_PID
    with _POOL_LOCK:
        if _POOL is None or _POOL_PID != os.getpid():
            _POOL = ThreadPoolExecutor(max_workers=MAX_WORKERS - 1, thread_name_prefix="xpkernels")
            _POOL_PID = os.getpid()
        return _POOL


@contextlib.contextmanager
def _ufunc_buffer(xp, m: int):
    """On NumPy, ufuncs inside use a buffer of one row of length ``m`` (see the module notes).

    NumPy keeps the buffer size per thread (per context), and it is restored
    on exit, so the caller's setting is untouched.
    """
    if not array_api_compat.is_numpy_namespace(xp) or m < MIN_BUFFER_ROW:
        yield
        return
    import numpy

    size = m - m % 16  # NumPy requires a multiple of 16
    if size >= numpy.getbufsize():
        yield
        return
    previous = numpy.setbufsize(size)
    try:
        yield
    finally:
        numpy.setbufsize(previous)


def for_each_block(
    xp, block, rows: int, m: int, n_workers: int = 1, elements: int | None = None
) -> None:
    """Call ``block(worker, start, stop)`` once per row block of ``rows`` rows of length ``m``
    (``elements`` per block at most; ``ROW_BLOCK_ELEMENTS`` when None).

    Worker ``k`` of ``n_workers`` takes blocks ``k, k + n_workers, ...`` in
    order (a fixed split: results do not depend on thread timing); worker 0
    runs on the caller's thread. ``worker`` indexes per-worker accumulators
    such as the rows of ``dw_partial``.
    """
    blocks = row_blocks(rows, m, elements or ROW_BLOCK_ELEMENTS)
    n_workers = max(1, min(n_workers, len(blocks)))

    def run(worker):
        with _ufunc_buffer(xp, m):
            for start, stop in blocks[worker::n_workers]:
                block(worker, start, stop)

    if n_workers == 1:
        run(0)
        return
    futures = [_pool().submit(run, k) for k in range(1, n_workers)]
    try:
        run(0)
    finally:
        for future in futures:
            future.result()


def for_each_item(xp, work, items: list, n_workers: int, costs: list | None = None) -> None:
    """Call ``work(worker, item)`` for every item, shared among up to ``n_workers`` threads.

    Workers take items one at a time from a shared queue -- in order, or
    costliest first with ``costs`` (one estimate per item: causal query
    tiles differ up to Sk-fold) -- and worker 0 runs on the caller's thread.
    A worker whose core another process holds takes fewer items instead of
    a fixed share the others wait for. ``worker`` indexes per-worker scratch
    only: an item's result must not depend on which worker runs it, so
    results do not depend on thread timing. ``n_workers`` is capped by the
    items and, except on NumPy, is 1. While several workers run, NumPy's
    BLAS runs one thread per call (:func:`blas_threads`).
    """
    if not array_api_compat.is_numpy_namespace(xp):
        n_workers = 1
    n_workers = max(1, min(n_workers, len(items)))
    order = list(range(len(items)))
    if costs is not None:
        order.sort(key=lambda i: -costs[i])
    queue, lock = iter(order), threading.Lock()

    def run(worker):
        while True:
            with lock:
                index = next(queue, None)
            if index is None:
                return
            work(worker, items[index])

    if n_workers == 1:
        run(0)
        return
    with blas_threads(1):
        futures = [_pool().submit(run, k) for k in range(1, n_workers)]
        try:
            run(0)
        finally:
            for future in futures:
                future.result()


def _numpy_openblas():
    """``(get, set)`` thread-count functions of the OpenBLAS NumPy bundles, or None.

    Only NumPy's own copy (in ``numpy.libs``, as its wheels ship it) is
    touched, never another library's BLAS; a NumPy built on another BLAS
    keeps its threads.
    """
    global _BLAS
    if _BLAS is None:
        import numpy

        found: tuple = ()
        where = os.path.join(os.path.dirname(os.path.dirname(numpy.__file__)), "numpy.libs")
        for path in sorted(glob.glob(os.path.join(where, "*openblas*"))):
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            for prefix in ("scipy_openblas_", "openblas_"):
                for suffix in ("64_", ""):
                    get = getattr(lib, f"{prefix}get_num_threads{suffix}", None)
                    put = getattr(lib, f"{prefix}set_num_threads{suffix}", None)
                    if get is not None and put is not None and not found:
                        get.restype, put.argtypes = ctypes.c_int, [ctypes.c_int]
                        found = (get, put)
        _BLAS = found
    return _BLAS or None


@contextlib.contextmanager
def blas_threads(n: int):
    """NumPy's OpenBLAS runs ``n`` threads while inside (process-wide; restored on exit).

    Used while our own worker threads share a call's tiles: a BLAS that
    also spreads each product over every core oversubscribes them, and its
    threads then wait on each other whenever a core is busy elsewhere
    (measured on 2 busy cores: the same forward took 0.4 s or 5 s). Nested
    and concurrent uses share one setting; the last to leave restores the
    previous count.
    """
    global _BLAS_USERS, _BLAS_PREVIOUS
    blas = _numpy_openblas()
    if blas is None:
        yield
        return
    get, put = blas
    with _BLAS_LOCK:
        if _BLAS_USERS == 0:
            _BLAS_PREVIOUS = get()
            put(n)
        _BLAS_USERS += 1
    try:
        yield
    finally:
        with _BLAS_LOCK:
            _BLAS_USERS -= 1
            if _BLAS_USERS == 0:
                put(_BLAS_PREVIOUS)


def numpy_views(*arrays):
    """Zero-copy NumPy views of PyTorch CPU tensors (None entries kept), or None when not all
    are plain ``torch.Tensor`` CPU tensors (no subclass) that NumPy holds (float32/float64,
    integer, bool) and none requires grad.

    Kernels run their NumPy path over the views: PyTorch CPU tensors get the
    same speed as NumPy arrays, and their results land in the caller's
    tensors. float16/bfloat16 tensors (bfloat16 has no NumPy dtype) and
    tensors recording autograd keep the PyTorch path.
    """
    views, found = [], False
    for a in arrays:
        if a is None or isinstance(a, (int, float)):
            views.append(a)
            continue
        view = torch_numpy_view(a)  # subclasses (fake, functional, guarded) keep their path
        if view is None:
            return None
        views.append(view)
        found = True
    return tuple(views) if found else None


def path_arrays(*arrays) -> tuple:
    """The arrays a kernel runs on: :func:`numpy_views` of ``arrays`` where it gives them
    (PyTorch CPU tensors run the NumPy path), else ``arrays`` as they are."""
    views = numpy_views(*arrays)
    return arrays if views is None else views


def path_namespace(like):
    """The namespace a kernel runs on for ``like``: NumPy's for a PyTorch CPU tensor that
    :func:`numpy_views` takes, else ``like``'s own."""
    return array_api_compat.array_namespace(*path_arrays(like))


class BlockBuffers:
    """Per-worker NumPy buffers of one row block each: a kernel's block temporaries, reused.

    A fresh block-sized temporary (512 KiB in float32) is mapped and faulted
    in page by page on every allocation: at (32, 4096) float32, ``x - mean``
    into a new array took 220 us and into a reused one 20 us (measured).
    ``get(worker)`` returns ``count`` arrays of ``(block rows, M)`` in
    ``dtype`` on NumPy (blocks of ``elements``, as :func:`block_rows`), and
    ``count`` Nones elsewhere (those namespaces allocate as before; see
    :func:`apply`).
    """

    def __init__(
        self, xp, n_workers: int, count: int, rows: int, m: int, dtype, elements: int | None = None
    ):
        self._numpy = array_api_compat.is_numpy_namespace(xp)
        self._count = count
        self._shape = (block_rows(rows, m, elements), m)
        self._dtype = dtype
        self._buffers: list = [None] * n_workers

    def get(self, worker: int) -> list:
        """Worker ``worker``'s buffers (made on first use, by that worker)."""
        if not self._numpy:
            return [None] * self._count
        if self._buffers[worker] is None:
            import numpy

            self._buffers[worker] = [
                numpy.empty(self._shape, dtype=self._dtype) for _ in range(self._count)
            ]
        return self._buffers[worker]


def apply(xp, op: str, a, b, out, dtype=None):
    """``op(a, b)`` (an Array API elementwise function) into the first rows of ``out`` when it is
    not None (NumPy buffers of :class:`BlockBuffers`), else into a new array; computed in
    ``dtype`` when given."""
    if out is None:
        if dtype is not None:
            a = to(xp, a, dtype) if hasattr(a, "dtype") else a
            b = to(xp, b, dtype) if hasattr(b, "dtype") else b
        return getattr(xp, op)(a, b)
    import numpy

    return getattr(numpy, op)(a, b, out=out[: a.shape[0]], dtype=dtype)


def _carry(levels: list, value) -> None:
    """Add ``value`` to the binary cascade ``levels``: level ``i`` holds the sum of ``2**i``
    values or None, as the bits of the number of values added, so every value is added
    pairwise and the cascade holds at most ``log2(values)`` sums."""
    for level, pending in enumerate(levels):
        if pending is None:
            levels[level] = value
            return
        pending += value
        value = pending
        levels[level] = None
    levels.append(value)


class ColumnSums:
    """Per-worker column sums of one call's row blocks, written into the rows of a partial-sum
    buffer at the end; their rounding error grows with the logarithm of the rows, not the rows.

    A running sum (one ``+=`` per row, as NumPy reduces ``axis=0`` of a C-ordered
    array, ``einsum`` and BLAS ``ones @ a`` included) adds every row into an ever larger
    total, so its error grows about as the number of rows: at (1536, 128) float32,
    LayerNorm's ``dw`` was 1.6x as far from the float64 result as PyTorch's. Here:

    - a block's rows are summed in chunks of ``SUM_CHUNK_ROWS`` in the accumulation
      dtype: one ``einsum`` or ``matmul`` over the block seen as ``(chunks,
      SUM_CHUNK_ROWS, M)`` gives its ``(chunks, M)`` chunk sums, about as fast as
      the running sum it replaces;
    - a worker's full blocks' chunk sums are added pairwise, in a binary cascade
      of ``(chunks, M)`` arrays (:func:`_carry`: at most ``log2(blocks)`` of them,
      a sixteenth of a block each); the sums of the rows outside full chunks (a
      block's last ``rows % SUM_CHUNK_ROWS``) go to a cascade of ``(M,)`` sums, and
      the chunk sums of the call's one shorter, last block are kept as they are;
    - :meth:`write` sums the rows of those arrays in float64 on NumPy, and
      elsewhere by a tree of width ``SUM_CHUNK_ROWS`` in the accumulation dtype.

    Each worker adds only to its own cascades, so no locking is needed.
    """

    def __init__(self, xp, n_workers: int, dtype, like, rows_per_block: int):
        self._xp = xp
        self._numpy = array_api_compat.is_numpy_namespace(xp)
        if self._numpy:
            import numpy

            self._ones = numpy.ones(SUM_CHUNK_ROWS, dtype=dtype)
        else:
            self._ones = ones(xp, SUM_CHUNK_ROWS, dtype, like)
        self._chunks_per_block = rows_per_block // SUM_CHUNK_ROWS
        self._chunk_sums: list[list] = [[] for _ in range(n_workers)]
        self._short_chunk_sums: list[list] = [[] for _ in range(n_workers)]
        self._rest_sums: list[list] = [[] for _ in range(n_workers)]

    def add_sum(self, worker: int, a) -> None:
        """Add ``sum(a, axis=0)`` of the ``(n, M)`` block ``a`` to worker ``worker``'s sum."""
        n, m = a.shape
        full = n - n % SUM_CHUNK_ROWS
        chunk_sums = rest = None
        if full > 0:
            chunks = (full // SUM_CHUNK_ROWS, SUM_CHUNK_ROWS, m)
            chunk_sums = self._ones @ self._xp.reshape(a[:full, :], chunks)
        if full < n:
            rest = self._ones[: n - full] @ a[full:, :]
        self._add(worker, chunk_sums, rest)

    def add_dot(self, worker: int, a, b) -> None:
        """Add ``sum(a * b, axis=0)`` of two ``(n, M)`` blocks to worker ``worker``'s sum.

        On NumPy ``einsum`` sums the products without a temporary (about twice as
        fast as the product and a ``matmul``).
        """
        if not self._numpy:
            self.add_sum(worker, a * b)
            return
        import numpy

        n, m = a.shape
        full = n - n % SUM_CHUNK_ROWS
        chunk_sums = rest = None
        if full > 0:
            chunks = (full // SUM_CHUNK_ROWS, SUM_CHUNK_ROWS, m)
            chunk_sums = numpy.einsum(
                "kij,kij->kj", a[:full, :].reshape(chunks), b[:full, :].reshape(chunks)
            )
        if full < n:
            rest = numpy.einsum("ij,ij->j", a[full:, :], b[full:, :])
        self._add(worker, chunk_sums, rest)

    def _add(self, worker: int, chunk_sums, rest) -> None:
        """File a block's ``(chunks, M)`` chunk sums and the ``(M,)`` sum of its other rows
        (either may be None) in worker ``worker``'s cascades."""
        if chunk_sums is not None and chunk_sums.shape[0] == self._chunks_per_block:
            _carry(self._chunk_sums[worker], chunk_sums)
        elif chunk_sums is not None:
            self._short_chunk_sums[worker].append(chunk_sums)
        if rest is not None:
            _carry(self._rest_sums[worker], rest)

    def _sum_rows(self, a):
        """``sum(a, axis=0)`` of the ``(n, M)`` array ``a``: in float64 on NumPy, elsewhere by
        a tree of width ``SUM_CHUNK_ROWS`` in ``a``'s dtype."""
        xp = self._xp
        if self._numpy:
            import numpy

            return numpy.add.reduce(a, axis=0, dtype=numpy.float64)
        total = xp.zeros((a.shape[1],), dtype=a.dtype, device=array_api_compat.device(a))
        while a.shape[0] > 0:
            n, m = a.shape
            full = n - n % SUM_CHUNK_ROWS
            if full < n:
                total = total + self._ones[: n - full] @ a[full:, :]
            a = self._ones @ xp.reshape(a[:full, :], (full // SUM_CHUNK_ROWS, SUM_CHUNK_ROWS, m))
        return total

    def write(self, partial, accumulate: bool) -> None:
        """Worker ``k``'s sum into ``partial[k]``: overwriting every row, or adding when ``accumulate``."""
        if not accumulate:
            partial[...] = 0.0
        for worker, chunk_levels in enumerate(self._chunk_sums):
            sums = [self._sum_rows(level) for level in chunk_levels if level is not None]
            sums += [self._sum_rows(chunk_sums) for chunk_sums in self._short_chunk_sums[worker]]
            sums += [level for level in self._rest_sums[worker] if level is not None]
            if not sums:
                continue
            total = sums[0]
            for value in sums[1:]:
                total = total + value
            partial[worker, :] += to(self._xp, total, partial.dtype)


def tiled(xp, v, rows: int, m: int, elements: int | None = None):
    """``v`` (``(M,)``) repeated over the rows of one row block: ``(min(rows, block rows), M)``
    (blocks of ``elements``, as :func:`block_rows`).

    Multiplying a block by a same-shaped array is about twice as fast in
    NumPy as broadcasting a ``(M,)`` vector over it; one tile serves every
    block of a call.
    """
    out = xp.empty(
        (block_rows(rows, m, elements), m), dtype=v.dtype, device=array_api_compat.device(v)
    )
    out[...] = v
    return out


def ones(xp, n: int, dtype, like):
    """A length-``n`` vector of ones on ``like``'s device.

    Sums go through ``matmul`` with it: ``a @ ones`` sums the rows of a block
    and ``ones @ a`` its columns, about twice as fast on NumPy (BLAS) as
    ``sum(a, axis=...)``.
    """
    return xp.ones((n,), dtype=dtype, device=array_api_compat.device(like))


def store(xp, out, r0: int, r1: int, op: str, a, b) -> None:
    """``out[r0:r1, :] = op(a, b)`` in ``out``'s dtype, for the Array API elementwise function ``op``.

    On NumPy the ufunc writes straight into the output rows (``out=``),
    saving a pass over the block and a temporary; elsewhere the result is
    computed, then assigned. Measured per kernel: it pays for LayerNorm's
    backward (about 8% at (8192, 4096) float32) and not for the kernels
    whose last step is cheaper in cache followed by a copy.
    """
    if array_api_compat.is_numpy_namespace(xp):
        import numpy

        getattr(numpy, op)(a, b, out=out[r0:r1, :])
    else:
        out[r0:r1, :] = to(xp, getattr(xp, op)(a, b), out.dtype)


def acc_dtype(xp, dtype):
    """Accumulation dtype: float64 for float64 inputs, else float32."""
    return xp.float64 if dtype == xp.float64 else xp.float32


def to(xp, a, dtype):
    """``a`` as ``dtype`` without a copy when it already is."""
    return a if a.dtype == dtype else xp.astype(a, dtype)


def max_row_norm(xp, a) -> float:
    """Largest Euclidean norm of the rows of the 2-D array ``a`` (0 for no rows), in row blocks.

    NaN when any entry is NaN, inf when one is infinite (or its square
    overflows): a bound built on it is then never finite.
    """
    acc = acc_dtype(xp, a.dtype)
    largest = 0.0
    for r0, r1 in row_blocks(a.shape[0], a.shape[1]):
        block = to(xp, a[r0:r1, :], acc)
        value = float(xp.max(xp.vecdot(block, block)))
        if math.isnan(value):
            return math.nan
        largest = max(largest, value)
    return math.sqrt(largest)


def reduce_partials(partial, out) -> None:
    """``out[...] = sum(partial, axis=0)``, cast only where the dtypes differ: the hook
    :func:`xpkernels.backends.protocol.reduce_partials`."""
    xp = array_api_compat.array_namespace(partial, out)
    out[...] = to(xp, xp.sum(partial, axis=0), out.dtype)
