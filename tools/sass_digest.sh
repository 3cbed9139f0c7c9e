#!/usr/bin/env bash
# Per-kernel digests of the machine code (SASS) of the default build, from the compiler alone (no GPU):
# compiles src/cuda/verify_launch.cu as CMakeLists.txt does (both default architectures, sm_120a and sm_90a, in one
# nvcc call), disassembles it and prints one line per kernel and architecture: arch, md5 of its instructions
# (addresses and encodings stripped), instruction count, mangled name. Two trees whose lines agree run the same
# kernels: the check for a refactor that must not change what runs (compare with `diff`).
#   bash tools/sass_digest.sh [extra nvcc flags...] > digests.txt
# Needs cuobjdump: the CUDA toolkit's, or the copy that the triton / nvidia-cuda-cuobjdump wheels carry.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cuobjdump=$(command -v cuobjdump || true)
if [ -z "$cuobjdump" ]; then
  cuobjdump=$(python3 - <<'PY' 2>/dev/null || true
import glob, os, site, sys
roots = site.getsitepackages() + [site.getusersitepackages()]
for pat in ("triton/backends/nvidia/bin/cuobjdump", "nvidia/cu*/bin/cuobjdump", "nvidia/cuda_cuobjdump/bin/cuobjdump"):
    for root in roots:
        for hit in sorted(glob.glob(os.path.join(root, pat))):
            if os.access(hit, os.X_OK):
                print(hit); sys.exit(0)
PY
)
fi
if [ -z "$cuobjdump" ]; then
  echo "sass_digest.sh: no cuobjdump on PATH or in this Python's site-packages (pip install triton)" >&2
  exit 1
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
nvcc -DKDTREE_CUDA_ARCHS_STR='"90,120"' -DKDTREE_HAVE_SM90A=1 -Isrc/cuda -O3 -DNDEBUG \
     --generate-code=arch=compute_120a,code=sm_120a --generate-code=arch=compute_90a,code=sm_90a \
     -Xcompiler=-fPIC -Xcompiler=-fvisibility=hidden -lineinfo --expt-relaxed-constexpr -std=c++17 "$@" \
     -x cu -c src/cuda/verify_launch.cu -o "$tmp/v.o"
"$cuobjdump" -sass "$tmp/v.o" > "$tmp/sass.txt"
python3 - "$tmp/sass.txt" <<'PY'
import hashlib, re, sys
arch, name, funcs = None, None, {}
for line in open(sys.argv[1]):
    m = re.match(r"\s*arch = (sm_\w+)", line)
    if m:
        arch = m.group(1)
        continue
    m = re.match(r"\s+Function : (\S+)", line)
    if m:
        name = (arch, m.group(1))
        funcs[name] = []
        continue
    if name is None or not re.match(r"\s*/\*[0-9a-f]{4,}\*/", line):   # instruction lines only
        continue
    ins = re.sub(r"/\*[0-9a-f]{4,}\*/|/\* 0x[0-9a-f]+ \*/", "", line).strip()
    if ins:
        funcs[name].append(ins)
for (arch, fn), ins in sorted(funcs.items()):
    print(arch, hashlib.md5("\n".join(ins).encode()).hexdigest(), len(ins), fn)
PY
