# Sourced by the GPU scripts (scripts/gpu_verify.sh, gpu_elastic.sh) on the GPU machine, from the
# repository root: the CUDA libraries (device_env.sh), $OUT, the kernel cache, the carried
# binaries in place ($T is `tessera`; the test binaries find this tree where they were built).
source scripts/device_env.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export TESSERA_KERNEL_CACHE=/tmp/tessera-kernels
built_at=$(cat .device-bin/built_at)
mkdir -p "$(dirname "$built_at")" && ln -sfn "$PWD" "$built_at"
mkdir -p target/release && cp .device-bin/tessera target/release/tessera
T=$PWD/target/release/tessera
echo "== $(nvidia-smi -L | head -1); $(date -u)"
