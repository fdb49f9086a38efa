"""Builds libjaxserve_cuda.so with nvcc: on first use for pip installs, and for Bazel's genrule.

The library is cached under ``$JAXSERVE_CACHE_DIR`` (default ``~/.cache/jaxserve``) in
``custom_calls/<key>/``, the key hashing the sources, the flags, the nvcc version and
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
from pathlib import Path

SOURCE_DIR = Path(__file__).absolute().parent / "csrc"  # not resolved: stays inside Bazel's sandbox
LIBRARY_NAME = "libjaxserve_cuda.so"
# Hopper gets its own SASS (sm_90a); Ampere SASS plus compute_80 PTX covers the rest by JIT.
ARCHS = ("sm_90a", "sm_80")
FLAGS = ("-std=c++17", "-O3", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC", "-shared", "--threads", "0")


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


def nvcc_command(nvcc: str, include_dir: str, out: str, archs=ARCHS) -> list[str]:
    return [nvcc, *FLAGS, *gencode_flags(archs), f"-I{include_dir}", f"-I{SOURCE_DIR}",
            *map(str, sources()), "-o", out]


def cache_key(nvcc: str, jax_version: str, archs=ARCHS) -> str:
    digest = hashlib.sha256()
    for path in sorted(SOURCE_DIR.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    digest.update("\0".join([*FLAGS, *gencode_flags(archs), version, jax_version]).encode())
    return digest.hexdigest()[:16]


def compile_library(nvcc: str, include_dir: str, out: Path, archs=ARCHS) -> None:
    """Compiles to a temporary file beside ``out`` and renames it: concurrent builds are safe."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        partial = os.path.join(tmp, LIBRARY_NAME)
        result = subprocess.run(nvcc_command(nvcc, include_dir, partial, archs), capture_output=True, text=True)
        if result.returncode != 0:
            raise BuildError(f"nvcc failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
        os.replace(partial, out)


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
    cache_root = Path(os.environ.get("JAXSERVE_CACHE_DIR", Path.home() / ".cache" / "jaxserve"))
    out = cache_root / "custom_calls" / cache_key(nvcc, jax.__version__, archs) / LIBRARY_NAME
    if not out.exists():   # tens of seconds: say so (scripts/setup.sh builds it at install on a GPU machine)
        print(f"jaxserve: building the CUDA custom calls for {','.join(archs)} with nvcc, once per machine "
              f"(cached in {out.parent})", file=sys.stderr, flush=True)
        compile_library(nvcc, jax.ffi.include_dir(), out, archs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="path of the shared library to write")
    parser.add_argument("--include-dir", required=True, help="jax.ffi.include_dir() of the target jax")
    parser.add_argument("--archs", default=",".join(ARCHS), help="comma-separated SASS targets, e.g. sm_90a,sm_80")
    args = parser.parse_args()
    compile_library(find_nvcc(), args.include_dir, Path(args.out).resolve(), tuple(args.archs.split(",")))


if __name__ == "__main__":
    main()
