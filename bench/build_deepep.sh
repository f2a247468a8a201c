#!/usr/bin/env bash
# Build and install DeepEP (the `deep_ep` package behind d9d's `deep_ep` expert-dispatch backend) on a GPU machine
# that has nvcc but no network. Run from the repository root with the project's Python first on PATH:
#
#     bash bench/build_deepep.sh            # sources from .whl/ (carried to the GPU machine), ~5-15 min
#
# Sources (downloaded on a machine with network into .whl/, see docs/testing.md):
#   .whl/deep_ep-1.0.0.tar.gz          the PyPI source distribution (the only release on PyPI)
#   .whl/deep_ep-src-567632d.tar.gz    DeepEP v1.2.1 (GitHub commit 567632d, the last before the EPv2 rewrite)
#
# Attempt 1 builds the PyPI sdist. DeepEP 1.0.0 has no intranode-only switch: it always compiles the internode
# and low-latency kernels and links `-l:libnvshmem.a`, a static library the NVSHMEM pip wheel does not ship, so the
# link flags are rewritten to what the wheel has (libnvshmem_host.so.N + libnvshmem_device.a). 1.0.0 was written
# against a patched NVSHMEM 3.1, so this may still fail to compile; the log says where.
# Attempt 2 builds v1.2.1 intranode-only (`-DDISABLE_NVSHMEM`, no NVSHMEM at all), which is what one host with
# NVLink needs for normal-mode training; low-latency mode then raises inside DeepEP.
# Set DEEP_EP_ATTEMPTS="2" to skip the first attempt. TORCH_CUDA_ARCH_LIST defaults to 9.0 (Hopper).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
WHL=${WHL_DIR:-$ROOT/.whl}
PYTHON=${PYTHON:-python}
ATTEMPTS=${DEEP_EP_ATTEMPTS:-"1 2"}
WORK=$(mktemp -d)
LOG_DIR=${DEEP_EP_LOG_DIR:-$WORK}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}

echo "DeepEP build in $WORK (logs in $LOG_DIR); CUDA_HOME=$CUDA_HOME, arch $TORCH_CUDA_ARCH_LIST"
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

nvshmem_wheel_dir() {
    "$PYTHON" -c "import importlib.util as u; s = u.find_spec('nvidia.nvshmem'); print(s.submodule_search_locations[0])"
}

install_and_check() {
    local source_dir=$1 log=$2
    (cd "$source_dir" && "$PYTHON" -m pip wheel --no-deps --no-build-isolation -w "$WORK/dist" . >"$log" 2>&1)
    "$PYTHON" -m pip install --no-deps --force-reinstall "$WORK"/dist/deep_ep-*.whl >>"$log" 2>&1
    "$PYTHON" -c "import deep_ep; print('deep_ep imported from', deep_ep.__file__)"
}

attempt_pypi_sdist() {
    local sdist=$WHL/deep_ep-1.0.0.tar.gz nvshmem lib_dir host_lib
    [[ -f $sdist ]] || { echo "attempt 1: $sdist not found"; return 1; }
    nvshmem=$(nvshmem_wheel_dir) || { echo "attempt 1: no nvidia.nvshmem wheel (DeepEP 1.0.0 needs NVSHMEM)"; return 1; }
    lib_dir=$nvshmem/lib
    host_lib=$(basename "$(ls "$lib_dir"/libnvshmem_host.so* | head -1)")
    [[ -f $lib_dir/libnvshmem_device.a ]] || { echo "attempt 1: $lib_dir has no libnvshmem_device.a"; return 1; }
    local bootstrap
    bootstrap=$(basename "$(ls "$lib_dir"/nvshmem_bootstrap_uid.so* | head -1)")
    tar -xzf "$sdist" -C "$WORK"
    local src=$WORK/deep_ep-1.0.0
    # Link what the wheel ships instead of the static libnvshmem.a of a source install.
    sed -i \
        -e "s|'-lnvshmem'\]|'-lnvshmem_device']|" \
        -e "s|'-l:libnvshmem.a'|'-l:$host_lib', '-l:libnvshmem_device.a'|" \
        -e "s|'-l:nvshmem_bootstrap_uid.so'|'-l:$bootstrap'|" \
        "$src/setup.py"
    echo "attempt 1: PyPI deep_ep 1.0.0 against the NVSHMEM wheel at $nvshmem"
    NVSHMEM_DIR=$nvshmem install_and_check "$src" "$LOG_DIR/attempt1.log"
}

guard_mask_buffer_calls() {  # wrap each `internode_ll::*_mask_buffer(...);` statement in #ifndef DISABLE_NVSHMEM
    "$PYTHON" - "$1" <<'PATCH'
import re, sys
path = sys.argv[1]
text = open(path).read()
call = re.compile(r"^([ \t]*)(internode_ll::(?:update|query|clean)_mask_buffer\(.*?\);)", re.M | re.S)
guarded, count = call.subn(
    lambda m: f"#ifndef DISABLE_NVSHMEM\n{m.group(1)}{m.group(2)}\n#else\n{m.group(1)}"
    'EP_HOST_ASSERT(false and "NVSHMEM is disabled during compilation");\n#endif',
    text,
)
if count != 3:
    sys.exit(f"expected 3 mask-buffer calls in {path}, found {count}")
open(path, "w").write(guarded)
PATCH
}

attempt_v1_intranode_only() {
    local archive=$WHL/deep_ep-src-567632d.tar.gz
    [[ -f $archive ]] || { echo "attempt 2: $archive not found"; return 1; }
    tar -xzf "$archive" -C "$WORK"
    local src=$WORK/deep_ep-567632d
    # Intranode only: never pick up the NVSHMEM wheel (its static device library is what full builds miss).
    sed -i 's|nvshmem_dir = importlib.util.find_spec("nvidia.nvshmem").submodule_search_locations\[0\]|raise ModuleNotFoundError("intranode-only build")|' \
        "$src/setup.py"
    grep -q 'intranode-only build' "$src/setup.py" || { echo "attempt 2: setup.py patch did not apply"; return 1; }
    # v1.2.1's shrink-mode mask functions call low-latency kernels without the DISABLE_NVSHMEM guard every other
    # low-latency entry point has, so an intranode-only extension fails to import (undefined symbol
    # deep_ep::internode_ll::update_mask_buffer). Guard those calls the same way.
    guard_mask_buffer_calls "$src/csrc/deep_ep.cpp" || { echo "attempt 2: mask-buffer guard did not apply"; return 1; }
    # Its kernels compile with -rdc=true, whose device code needs a device-link step; setup.py adds one only with
    # NVSHMEM, so the extension failed to import (undefined __cudaRegisterLinkedBinary_..._intranode_cu). Ask for it.
    sed -i "s|nvcc_dlink = \[\]|nvcc_dlink = ['-dlink']|" "$src/setup.py"
    grep -q "nvcc_dlink = \['-dlink'\]" "$src/setup.py" || { echo "attempt 2: device-link patch did not apply"; return 1; }
    echo "attempt 2: DeepEP v1.2.1 (567632d), intranode only (-DDISABLE_NVSHMEM)"
    (unset NVSHMEM_DIR; install_and_check "$src" "$LOG_DIR/attempt2.log")
}

for attempt in $ATTEMPTS; do
    case $attempt in
        1) if attempt_pypi_sdist; then echo "DeepEP built from the PyPI sdist"; exit 0; fi ;;
        2) if attempt_v1_intranode_only; then echo "DeepEP built intranode-only from v1.2.1"; exit 0; fi ;;
        *) echo "unknown attempt $attempt (valid: 1, 2)"; exit 2 ;;
    esac
    echo "attempt $attempt failed; last lines of its log:"
    tail -n 30 "$LOG_DIR/attempt$attempt.log" 2>/dev/null || true
done
echo "DeepEP could not be built; the all-to-all expert dispatch stays the default." >&2
exit 1
