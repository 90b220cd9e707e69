"""Build libonnxcnn_ops.so, the ai.onnxcnn custom-operator library for ONNX Runtime (sources in kernels/src).

    python -m kernels.build                  # CUDA + CPU kernels with nvcc: sm_90 code + compute_90 PTX
    python -m kernels.build --archs 80,90    # more GPU targets (PTX of the newest one is embedded too)
    python -m kernels.build --cpu-only       # CPU kernels only, with g++ (no CUDA toolkit needed)
    python -m kernels.build --selftest       # also onnxcnn_selftest: the CUDA kernels alone (no ORT)

nvcc is ``--nvcc``, else ``$NVCC``, else ``nvcc`` on PATH (the GPU machine's CUDA 13.0), else
``$CUDA_HOME/bin/nvcc``, else the one of PyPI's ``nvidia-cuda-nvcc`` wheel (``pip install '.[kernels]'``:
nvcc, the CUDA runtime headers and its static library, pinned to CUDA 13.0, which onnxruntime-gpu 1.31
links). The CUDA runtime is linked statically, so the library needs only the driver at run time, and it
loads (CPU kernels usable) on machines without one. ONNX Runtime's headers: see kernels/ort_headers.py.

Outputs in kernels/build/ (ignored by git): ``libonnxcnn_ops.so`` (CUDA build) or ``libonnxcnn_ops_cpu.so``,
and ``onnxcnn_selftest`` (src/selftest.cu: the CUDA kernels against the CPU ones, in a CUDA graph, timed;
needs no ONNX Runtime), each with a ``.json`` stamp (hash of the sources, compiler and command); an
unchanged build is not redone.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make ``kernels`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import ort_headers

KERNELS_DIR = Path(__file__).resolve().parent
SRC_DIR = KERNELS_DIR / "src"
BUILD_DIR = KERNELS_DIR / "build"
HEADERS_DIR = BUILD_DIR / "ort-include"
CUDA_LIBRARY = "libonnxcnn_ops.so"
CPU_LIBRARY = "libonnxcnn_ops_cpu.so"
SELFTEST = "onnxcnn_selftest"
DEFAULT_ARCHS = (90,)
HOST_SOURCES = ("onnxcnn_ops.cc", "cpu_kernels.cc")
CUDA_SOURCES = ("dwconv_act.cu", "se_block.cu")
HEADERS = ("onnxcnn_ops.h",)
SELFTEST_SOURCES = ("selftest.cu", "cpu_kernels.cc", *CUDA_SOURCES)
PIP_NVCC = ("cu13", "bin", "nvcc")  # under the ``nvidia`` namespace package of the nvidia-cuda-nvcc wheel


class BuildError(RuntimeError):
    """The library could not be built; the message names the failing step."""


@dataclasses.dataclass(frozen=True)
class BuildResult:
    path: Path
    command: list[str]
    rebuilt: bool
    header_api: int
    cuda: bool


def find_nvcc(
    explicit: str | None = None,
    environ: Mapping[str, str] | None = None,
    which: Callable[[str], str | None] = shutil.which,
) -> Path | None:
    """The nvcc to use (see the module docstring for the order), or None."""
    if explicit:
        if not (Path(explicit).is_file() and os.access(explicit, os.X_OK)):
            raise BuildError(f"--nvcc {explicit} is not an executable file")
        return Path(explicit)
    environ = os.environ if environ is None else environ
    candidates = [environ.get("NVCC"), which("nvcc")]
    if environ.get("CUDA_HOME"):
        candidates.append(str(Path(environ["CUDA_HOME"]) / "bin" / "nvcc"))
    candidates.append(_pip_nvcc())
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def _pip_nvcc() -> str | None:
    spec = importlib.util.find_spec("nvidia")
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location).joinpath(*PIP_NVCC)
        if path.is_file():
            return str(path)
    return None


def gencode_flags(archs: Sequence[int]) -> list[str]:
    """SASS for every arch in ``archs`` and PTX of the newest (which the driver compiles for newer GPUs)."""
    if not archs or any(a < 50 for a in archs):
        raise BuildError(f"GPU architectures must be compute capabilities like 90, not {list(archs)}")
    ordered = sorted(set(archs))
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ordered]
    return [*flags, f"-gencode=arch=compute_{ordered[-1]},code=compute_{ordered[-1]}"]


def cuda_library_dirs(nvcc: Path) -> list[Path]:
    """Folders holding ``libcudart_static.a`` next to nvcc (the pip wheel has lib/, where nvcc looks in lib64/)."""
    root = nvcc.resolve().parent.parent
    return [d for d in (root / "lib", root / "lib64") if (d / "libcudart_static.a").is_file()]


def nvcc_command(nvcc: Path, include: Path, output: Path, archs: Sequence[int]) -> list[str]:
    sources = [str(SRC_DIR / name) for name in (*HOST_SOURCES, *CUDA_SOURCES)]
    libraries = [f"-L{d}" for d in cuda_library_dirs(nvcc)]
    return [
        str(nvcc), "-std=c++17", "-O3", "-lineinfo", "-shared", "-cudart=static",
        "-Xcompiler=-fPIC,-fvisibility=hidden,-Wall", "-DONNXCNN_WITH_CUDA",
        *gencode_flags(archs), f"-I{include}", *libraries, *sources, "-o", str(output),
    ]  # fmt: skip


def selftest_command(nvcc: Path, output: Path, archs: Sequence[int]) -> list[str]:
    sources = [str(SRC_DIR / name) for name in SELFTEST_SOURCES]
    libraries = [f"-L{d}" for d in cuda_library_dirs(nvcc)]
    return [str(nvcc), "-std=c++17", "-O3", "-lineinfo", "-cudart=static", "-Xcompiler=-Wall", "-DONNXCNN_WITH_CUDA",
            *gencode_flags(archs), *libraries, *sources, "-o", str(output)]  # fmt: skip


def cpu_command(compiler: str, include: Path, output: Path) -> list[str]:
    sources = [str(SRC_DIR / name) for name in HOST_SOURCES]
    return [compiler, "-std=c++17", "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall", "-Wextra",
            f"-I{include}", *sources, "-o", str(output)]  # fmt: skip


def stamp_of(command: Sequence[str], compiler_version: str) -> str:
    """A hash of everything the output depends on: sources, headers' API version, compiler and command."""
    digest = hashlib.sha256()
    for name in (*HEADERS, *HOST_SOURCES, *CUDA_SOURCES, "selftest.cu"):
        digest.update(name.encode() + b"\0" + (SRC_DIR / name).read_bytes())
    digest.update("\0".join(command).encode() + b"\0" + compiler_version.encode())
    return digest.hexdigest()


def compiler_version(compiler: str) -> str:
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"{compiler} --version failed: {exc}") from exc
    return (out.stdout or out.stderr).strip()


def build(
    *,
    cpu_only: bool = False,
    nvcc: str | None = None,
    headers: Path | None = None,
    archs: Sequence[int] = DEFAULT_ARCHS,
    out_dir: Path = BUILD_DIR,
    force: bool = False,
    fetch: bool = True,
    runtime_version: str | None = None,
) -> BuildResult:
    """Build (or reuse an up-to-date) library; returns where it is. Raises BuildError or HeaderError."""
    out_dir.mkdir(parents=True, exist_ok=True)
    include = ort_headers.resolve(headers, HEADERS_DIR, allow_fetch=fetch)
    header_api = ort_headers.api_version(include)
    if runtime_version is not None:
        ort_headers.check_api_version(header_api, runtime_version)
    if cpu_only:
        compiler = shutil.which("g++") or shutil.which("c++")
        if compiler is None:
            raise BuildError("no C++ compiler (g++) on PATH")
        output = out_dir / CPU_LIBRARY
        command = cpu_command(compiler, include, output)
    else:
        found = find_nvcc(nvcc)
        if found is None:
            raise BuildError("nvcc not found: put CUDA 13's nvcc on PATH, set $NVCC, or pip install '.[kernels]'")
        compiler = str(found)
        output = out_dir / CUDA_LIBRARY
        command = nvcc_command(found, include, output, archs)
    rebuilt = _compile(command, output, compiler, force, {"header_api": header_api})
    return BuildResult(output, command, rebuilt, header_api, not cpu_only)


def build_selftest(*, nvcc: str | None = None, archs: Sequence[int] = DEFAULT_ARCHS, out_dir: Path = BUILD_DIR,
                   force: bool = False) -> Path:
    """Build onnxcnn_selftest (needs nvcc, not ONNX Runtime's headers); returns its path."""
    found = find_nvcc(nvcc)
    if found is None:
        raise BuildError("nvcc not found: put CUDA 13's nvcc on PATH, set $NVCC, or pip install '.[kernels]'")
    out_dir.mkdir(parents=True, exist_ok=True)
    output = out_dir / SELFTEST
    _compile(selftest_command(found, output, archs), output, str(found), force, {})
    return output


def _compile(command: list[str], output: Path, compiler: str, force: bool, extra: dict) -> bool:
    """Run ``command`` unless ``output``'s stamp says it is up to date; True when it ran."""
    stamp = stamp_of(command, compiler_version(compiler))
    stamp_file = output.with_suffix(output.suffix + ".json")
    if not force and output.is_file() and _read_stamp(stamp_file) == stamp:
        return False
    output.unlink(missing_ok=True)
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0 or not output.is_file():
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-25:])
        raise BuildError(f"{Path(command[0]).name} failed ({result.returncode}):\n{tail}")
    stamp_file.write_text(json.dumps({"stamp": stamp, "command": command, **extra}, indent=1) + "\n")
    return True


def _read_stamp(path: Path) -> str | None:
    try:
        return json.loads(path.read_text()).get("stamp")
    except (OSError, ValueError, AttributeError):
        return None


def _installed_ort_version() -> str | None:
    try:
        import onnxruntime
    except ImportError:
        return None
    return onnxruntime.__version__


def parse_archs(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--archs takes numbers like 90 or 80,90, not {text!r}") from exc


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kernels.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-only", action="store_true", help="build the CPU kernels only, with g++")
    parser.add_argument("--nvcc", help="the nvcc to use")
    parser.add_argument("--headers", type=Path, help="ONNX Runtime's include folder (default: fetched)")
    parser.add_argument("--no-fetch", action="store_true", help="never download the headers")
    parser.add_argument("--archs", type=parse_archs, default=DEFAULT_ARCHS, help="compute capabilities (90)")
    parser.add_argument("--out-dir", type=Path, default=BUILD_DIR)
    parser.add_argument("--force", action="store_true", help="rebuild even when the stamp matches")
    parser.add_argument("--selftest", action="store_true", help="also build onnxcnn_selftest (CUDA only)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = build(cpu_only=args.cpu_only, nvcc=args.nvcc, headers=args.headers, archs=args.archs,
                       out_dir=args.out_dir, force=args.force, fetch=not args.no_fetch,
                       runtime_version=_installed_ort_version())
    except (BuildError, ort_headers.HeaderError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    state = "built" if result.rebuilt else "up to date"
    print(f"{state}: {result.path} (ORT C API {result.header_api}, {'CUDA + CPU' if result.cuda else 'CPU only'})")
    if args.selftest and not args.cpu_only:
        try:
            selftest = build_selftest(nvcc=args.nvcc, archs=args.archs, out_dir=args.out_dir, force=args.force)
            print(f"selftest: {selftest}")
        except BuildError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
