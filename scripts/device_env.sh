# Copied from the team's device notes; sourced on the GPU machine by scripts/gpu_bench.sh.
# Source this on the GPU machine before running a Tessera binary built here.
# It points the dynamic loader at the CUDA 13 runtime libraries (cuBLAS, NVRTC, NCCL) that the
# machine's Python environment carries, and keeps NVLink multicast off, as that machine requires.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null)
for d in "$SP"/nvidia/*/lib; do [ -d "$d" ] && LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"; done
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:/usr/local/cuda/lib64:/usr/local/nvidia/lib64"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}   # headers for NVRTC, if a kernel needs them
