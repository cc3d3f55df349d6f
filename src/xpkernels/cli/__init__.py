"""Command line: ``python -m xpkernels info | check | bench | demo`` (also the ``xpkernels`` script).

- ``info``   versions of xpkernels and the array libraries, and every backend
  with whether it can run here and why not;
- ``check``  each primitive x available backend x array namespace against a
  small float64 reference: a PASS/FAIL table, exit status 1 on any FAIL;
- ``bench``  median times, GB/s or TFLOP/s (formulas printed) and ratios to
  PyTorch's own CPU ops;
- ``demo``   trains a tiny causal transformer language model with the in-place
  primitives (the README's main job).

Only what a command needs is imported: ``info`` imports no array library
beyond what :func:`xpkernels.backends` needs to answer.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
import sys

#: Import name -> distribution name of the libraries ``info`` reports.
_LIBRARIES = (
    ("numpy", "numpy"),
    ("array_api_compat", "array-api-compat"),
    ("array_api_strict", "array-api-strict"),
    ("torch", "torch"),
    ("triton", "triton"),
    ("cupy", "cupy"),
    ("tqdm", "tqdm"),
)

#: How to install the optional torch dependency the torch paths need.
_INSTALL_TORCH = "pip install '.[torch]'"


def _installed_version(module: str, distribution: str) -> str | None:
    """Version of an importable module from its package metadata, without importing it."""
    if importlib.util.find_spec(module) is None:
        return None
    names = importlib.metadata.packages_distributions().get(module, [distribution])
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "installed (version unknown)"


def _int_at_least(text: str, minimum: int) -> int:
    """``text`` as an integer of at least ``minimum``, or an argparse usage error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value


def _positive_int(text: str) -> int:
    """Argument type of a count that must be at least 1 (steps, timed runs)."""
    return _int_at_least(text, 1)


def _non_negative_int(text: str) -> int:
    """Argument type of a count or seed that may be 0 but not negative."""
    return _int_at_least(text, 0)


def _writable_path(text: str) -> str:
    """Argument type of a file to write: its directory exists and the file can be written there.

    Checked when the arguments are parsed, so that a bad path fails before a
    long run rather than after it.
    """
    directory = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a directory")
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"directory {directory} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK) or (
        os.path.exists(text) and not os.access(text, os.W_OK)
    ):
        raise argparse.ArgumentTypeError(f"cannot write {text}: permission denied")
    return text


def _torch_flag(args) -> str | None:
    """The flag that makes the parsed command run on torch, or None."""
    if args.command == "demo" and args.torch:
        return "--torch"
    if args.command in ("demo", "bench") and args.array == "torch":
        return "--array torch"
    return None


def _torch_usage_error(flag: str, device: str) -> str | None:
    """Why ``flag`` cannot run on torch ``device`` here, or None when it can.

    Parameters
    ----------
    flag : str
        The command line flag that asked for torch, named in the message.
    device : str
        The torch device the command would use.

    Returns
    -------
    str or None
        One line for the usage error: torch missing (with how to install it),
        or ``device`` unknown to torch or not usable by this build of it.
    """
    from .bench_cases import torch_missing

    missing = torch_missing()
    if missing is not None:
        return f"{flag} needs torch, but {missing} (install it with {_INSTALL_TORCH})"
    import torch

    try:
        kind = torch.device(device).type
    except RuntimeError as exc:
        return f"--device {device} is not a torch device ({exc})"
    if kind == "meta":
        return "--device meta holds no data to compute on: choose cpu or an accelerator"
    is_available = getattr(getattr(torch, kind, None), "is_available", None)
    if callable(is_available) and not is_available():
        return f"--device {device}: torch here has no {kind} device (torch.{kind}.is_available())"
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as exc:  # torch raises both for unusable devices
        reason = str(exc).strip().splitlines()[0].split(". ")[0]
        return f"--device {device} cannot be used by torch here: {reason}"
    return None


def _info(args) -> int:
    from .. import __version__
    from ..registry import backends

    rows = [
        ("xpkernels", __version__),
        ("python", f"{platform.python_version()} ({sys.executable})"),
    ]
    for module, distribution in _LIBRARIES:
        rows.append((distribution, _installed_version(module, distribution) or "not installed"))
    width = max(len(name) for name, _ in rows)
    print("versions")
    for name, version in rows:
        print(f"  {name:<{width}}  {version}")
    print("backends")
    infos = backends()
    width = max(len(b.name) for b in infos)
    for b in infos:
        state = "available" if b.available else f"unavailable: {b.reason}"
        print(f"  {b.name:<{width}}  {state}")
        namespaces = "any" if b.namespaces == ("*",) else ", ".join(b.namespaces)
        devices = "any device" if b.devices == ("*",) else ", ".join(b.devices)
        print(f"  {'':<{width}}  arrays: {namespaces} on {devices}; ops: {', '.join(b.ops)}")
    return 0


def _check(args) -> int:
    from .check import run

    return run(ops=args.op, verbose=args.verbose)


def _bench(args) -> int:
    from .bench import run

    return run(
        quick=args.quick, json_path=args.json, ops=args.op, array=args.array, repeats=args.repeats
    )


def _demo(args) -> int:
    # The demo's matrices are tiny (at most 1024 x 256), too small to gain from BLAS
    # threads, and on a busy machine OpenBLAS threads waiting for a core made them 16x
    # slower (measured). Unless the caller chose, one thread; NumPy is not imported yet.
    for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(variable, "1")
    if args.torch:
        from .demo_torch import run as run_torch

        return run_torch(args.steps, args.device, args.backend, args.seed, args.sample)
    from .demo import run

    return run(
        steps=args.steps,
        array=args.array,
        device=args.device,
        backend=args.backend,
        seed=args.seed,
        sample=args.sample,
    )


def _parser() -> argparse.ArgumentParser:
    from ..registry import OPS

    parser = argparse.ArgumentParser(
        prog="python -m xpkernels", description=__doc__.split("\n\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    op = {"action": "append", "choices": OPS, "help": "only this primitive (repeatable)"}

    info = commands.add_parser("info", help="versions and backends")
    info.set_defaults(run=_info)

    check = commands.add_parser(
        "check",
        help="every primitive on every available backend vs a float64 reference",
        description="Each primitive x available backend x array namespace (numpy, torch CPU, "
        "array_api_strict; triton on CPU only when TRITON_INTERPRET=1, on CUDA when present): "
        "max error of the forward and backward against a naive float64 reference. "
        "Exit status 1 when any row FAILs.",
    )
    check.add_argument("--op", **op)
    check.add_argument(
        "-v", "--verbose", action="store_true", help="print the traceback of every error"
    )
    check.set_defaults(run=_check)

    bench = commands.add_parser(
        "bench",
        help="time every primitive and compare with PyTorch's CPU ops",
        description="Median time of each primitive x backend x pass, GB/s or TFLOP/s with the "
        "formula printed, and the ratio to PyTorch's own CPU op measured in the same run.",
    )
    bench.add_argument("--quick", action="store_true", help="small shapes: finishes in seconds")
    bench.add_argument(
        "--json",
        metavar="PATH",
        type=_writable_path,
        help="also write every row as JSON to PATH (its directory must exist)",
    )
    bench.add_argument("--op", **op)
    bench.add_argument(
        "--array",
        default="numpy",
        choices=("numpy", "torch"),
        help="array library xpkernels runs on (default numpy)",
    )
    bench.add_argument(
        "--repeats",
        type=_positive_int,
        default=None,
        help="timed runs per row (default 5, 3 for attention)",
    )
    bench.set_defaults(run=_bench)

    demo = commands.add_parser(
        "demo",
        help="train a tiny causal transformer language model",
        description="Train a tiny causal transformer LM on a text shipped with xpkernels, every "
        "kernel buffer allocated once, the gradient checked against finite differences at step 0.",
    )
    demo.add_argument(
        "--steps", type=_positive_int, default=300, help="training steps (default 300)"
    )
    demo.add_argument(
        "--array",
        default="numpy",
        choices=("numpy", "torch", "array_api_strict"),
        help="array library the model runs on (default numpy)",
    )
    demo.add_argument(
        "--torch",
        action="store_true",
        help="the same model as torch.nn modules over xpkernels, trained with loss.backward() "
        "and torch.optim",
    )
    demo.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default cpu)")
    demo.add_argument(
        "--backend", default=None, help="explicit xpkernels backend (default: automatic routing)"
    )
    demo.add_argument(
        "--seed", type=_non_negative_int, default=0, help="random seed, >= 0 (default 0)"
    )
    demo.add_argument(
        "--sample",
        type=_non_negative_int,
        default=120,
        help="characters to generate after training (default 120)",
    )
    demo.set_defaults(run=_demo)
    return parser


def main(argv=None) -> int:
    """Run one command; returns the process exit status."""
    from ..registry import BackendError

    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "demo" and args.device != "cpu" and args.array != "torch" and not args.torch:
        parser.error(
            f"demo: --device {args.device} needs --array torch ({args.array} runs on the CPU)"
        )
    flag = _torch_flag(args)
    if flag is not None:
        problem = _torch_usage_error(flag, getattr(args, "device", "cpu"))
        if problem is not None:
            parser.error(f"{args.command}: {problem}")
    try:
        return args.run(args)
    except BackendError as exc:
        print(f"python -m xpkernels {args.command}: {exc}", file=sys.stderr)
        return 1
