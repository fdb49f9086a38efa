"""Builds libjaxserve_cuda.so with nvcc (the CUDA handlers, ``csrc/*.cu``) and libjaxserve_cpu.so with the C++
compiler (the CPU handlers, ``csrc/*.cc``): on first use for pip installs, and for Bazel's genrule.

Each library is cached under ``$JAXSERVE_CACHE_DIR`` (default ``~/.cache/jaxserve``) in
``custom_calls/<key>/``, the key hashing the sources, the flags, the compiler's version and
the jax version (the FFI headers come from ``jax.ffi.include_dir()``). Only the standard
library is imported at module level so Bazel can run this file as a script.
"""
import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SOURCE_DIR = Path(__file__).absolute().parent / "csrc"  # not resolved: stays inside Bazel's sandbox
LIBRARY_NAME = "libjaxserve_cuda.so"
# Hopper gets its own SASS (sm_90a); Ampere SASS plus compute_80 PTX covers the rest by JIT.
ARCHS = ("sm_90a", "sm_80")
FLAGS = ("-std=c++17", "-O3", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC", "-shared", "--threads", "0")
CPU_LIBRARY_NAME = "libjaxserve_cpu.so"
# AVX2, FMA and F16C: x86-64 CPUs since Haswell and Zen (custom_calls.gguf_matmul checks the CPU before loading it);
# a product and a sum fused into one FMA only where the code asks for it
CPU_FLAGS = ("-std=c++17", "-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fPIC", "-shared")


class BuildError(RuntimeError):
    """nvcc is missing or failed; the message says which."""


def find_nvcc() -> str:
    """nvcc from $NVCC, $CUDA_HOME/bin, PATH or /usr/local/cuda/bin, in that order."""
    candidates = [os.environ.get("NVCC"), os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "nvcc"),
                  shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise BuildError("no nvcc (set NVCC or CUDA_HOME, or put nvcc on PATH)")


def gencode_flags(archs) -> list[str]:
    flags = []
    for arch in archs:
        compute = arch.replace("sm_", "compute_")
        codes = f"[{arch},{compute}]" if arch == "sm_80" else arch
        flags.append(f"-gencode=arch={compute},code={codes}")
    return flags


def sources() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.cu"))


def cpu_sources() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.cc"))


def find_cxx() -> str:
    """The C++ compiler from $CXX, or c++ / g++ / clang++ on PATH."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and (path := shutil.which(name)):
            return path
    raise BuildError("no C++ compiler (set CXX, or install g++)")


def find_cublaslt() -> Path | None:
    """The CUDA directory holding include/cublasLt.h and lib/libcublasLt.so*: CUDA_HOME's, or the NVIDIA wheels'
    (nvidia/cu13 or nvidia/cublas, as jax's CUDA plugin and torch install them), which XLA itself loads. None: the
    library is built without the cuBLASLt GEMM (fp8_w8a8.cu)."""
    roots = [Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))]
    for entry in sys.path:
        roots += [Path(entry) / "nvidia" / "cu13", Path(entry) / "nvidia" / "cublas"]
    for root in roots:
        lib = root / "lib64" if (root / "lib64").is_dir() else root / "lib"
        if (root / "include" / "cublasLt.h").is_file() and any(lib.glob("libcublasLt.so*")):
            return root
    return None


def cublaslt_flags() -> list[str]:
    """Include, link and run-path flags for cuBLASLt, or none without it."""
    if (root := find_cublaslt()) is None:
        return []
    lib = root / "lib64" if (root / "lib64").is_dir() else root / "lib"
    name = "cublasLt" if (lib / "libcublasLt.so").exists() else f":{sorted(lib.glob('libcublasLt.so.*'))[0].name}"
    # searched after the toolkit's own headers: the wheels also carry a CUDA runtime's, maybe not nvcc's version
    return [f"-Xcompiler=-idirafter,{root / 'include'}", f"-L{lib}", f"-l{name}", f"-Xlinker=-rpath={lib}"]


def nvcc_object_command(nvcc: str, include_dir: str, source: Path, archs=ARCHS) -> list[str]:
    """One source's compile to an object, without its output path (its last argument)."""
    flags = [flag for flag in FLAGS if flag != "-shared"]
    return [nvcc, *flags, *gencode_flags(archs), f"-I{include_dir}", f"-I{SOURCE_DIR}", *cublaslt_flags(), "-c",
            str(source), "-o"]


def cache_key(compiler: str, files, flags, jax_version: str) -> str:
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(path.name.encode() + path.read_bytes())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest.update("\0".join([*flags, version, jax_version]).encode())
    return digest.hexdigest()[:16]


def compile_to(command, out: Path) -> None:
    """Runs command (a compiler writing its last argument) into a temporary file beside ``out`` and renames it:
    concurrent builds are safe."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        partial = os.path.join(tmp, out.name)
        result = subprocess.run([*command, partial], capture_output=True, text=True)
        if result.returncode != 0:
            raise BuildError(f"{Path(command[0]).name} failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
        os.replace(partial, out)


def compile_library(nvcc: str, include_dir: str, out: Path, archs=ARCHS) -> None:
    """Each source compiled to an object on a thread of its own (one nvcc over them all compiles them in turn;
    paged_attention.cu alone is half of that), then linked into out."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objects = {source: Path(tmp) / f"{source.stem}.o" for source in sources()}
        with ThreadPoolExecutor(min(len(objects), os.cpu_count() or 1)) as pool:
            list(pool.map(lambda item: compile_to(nvcc_object_command(nvcc, include_dir, item[0], archs), item[1]),
                          objects.items()))
        compile_to([nvcc, "-shared", *gencode_flags(archs), *map(str, objects.values()), *cublaslt_flags(), "-o"],
                   out)


def local_archs() -> tuple[str, ...]:
    """What a build on first use targets: Hopper's own SASS on a Hopper (one target builds faster than ARCHS), else
    ARCHS."""
    import jax
    try:
        return ("sm_90a",) if jax.devices("cuda")[0].compute_capability == "9.0" else ARCHS
    except RuntimeError:   # no CUDA device here: build for every target
        return ARCHS


def build_library(archs=None) -> Path:
    """Path of the cached library for these sources (archs: default local_archs()), compiling it on first use."""
    import jax  # deferred: the Bazel genrule path runs without jax

    nvcc, archs = find_nvcc(), archs or local_archs()
    files = [*sources(), *SOURCE_DIR.glob("*.h")]
    flags = [*FLAGS, *gencode_flags(archs), *cublaslt_flags()]
    out = cache_root() / cache_key(nvcc, files, flags, jax.__version__) / LIBRARY_NAME
    if not out.exists():   # tens of seconds: say so (scripts/setup.sh builds it at install on a GPU machine)
        print(f"jaxserve: building the CUDA custom calls for {','.join(archs)} with nvcc, once per machine "
              f"(cached in {out.parent})", file=sys.stderr, flush=True)
        compile_library(nvcc, jax.ffi.include_dir(), out, archs)
    return out


def build_cpu_library() -> Path:
    """Path of the cached CPU library for these sources, compiling it on first use (seconds)."""
    import jax

    cxx = find_cxx()
    files = [*cpu_sources(), *SOURCE_DIR.glob("*.h")]
    out = cache_root() / cache_key(cxx, files, CPU_FLAGS, jax.__version__) / CPU_LIBRARY_NAME
    if not out.exists():
        print(f"jaxserve: building the CPU custom calls with {cxx}, once per machine (cached in {out.parent})",
              file=sys.stderr, flush=True)
        compile_to(cxx_command(cxx, jax.ffi.include_dir()), out)
    return out


def cxx_command(cxx: str, include_dir: str) -> list[str]:
    """The CPU library's command without its output path (its last argument)."""
    return [cxx, *CPU_FLAGS, f"-I{include_dir}", *map(str, cpu_sources()), "-o"]


def cache_root() -> Path:
    return Path(os.environ.get("JAXSERVE_CACHE_DIR", Path.home() / ".cache" / "jaxserve")) / "custom_calls"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="path of the shared library to write")
    parser.add_argument("--include-dir", required=True, help="jax.ffi.include_dir() of the target jax")
    parser.add_argument("--archs", default=",".join(ARCHS), help="comma-separated SASS targets, e.g. sm_90a,sm_80")
    parser.add_argument("--cpu", action="store_true", help="the CPU library (the C++ compiler), not the CUDA one")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    if args.cpu:
        compile_to(cxx_command(find_cxx(), args.include_dir), out)
    else:
        compile_library(find_nvcc(), args.include_dir, out, tuple(args.archs.split(",")))


if __name__ == "__main__":
    main()
