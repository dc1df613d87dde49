// Hopper (sm_90a) helpers shared by the hand-written kernels: shared-memory addresses, mbarriers,
// wgmma's fences and descriptors, and (on the host) the driver's tensor-map encoder and the GEMM's
// 2-D maps. Included by worker/hopper_gemm.cu, worker/attention/hopper_prefill.cu and
// benchmarks/multicast_copy_probe.cu (cuda_build.py fingerprints it with each source).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#include <stdint.h>
#include <stdio.h>

namespace {  // (each kernel's source includes this once)

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// A wgmma shared-memory descriptor for a 128-byte-swizzled operand: lbo / sbo in bytes (the
// stride between 64-element column groups of an MN-major operand / between groups of 8 rows).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// A box of the 2-D tensor map at (c0, c1) into shared memory at dst, completing on the mbarrier bar
// (encode_bf16_rows_map's maps).
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

// Keeps the compiler from moving reads or writes of wgmma's registers across the async product
// (and from reusing an operand's registers before the product has read them).
template <int N>
__device__ __forceinline__ void fence_registers(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_registers(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// cuTensorMapEncodeTiled from the driver (looked up once), or nullptr with the reason in error.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder(char* error, int error_len) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (encode == nullptr) {
    cudaDriverEntryPointQueryResult found;
    void* fn = nullptr;
    cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) {
      snprintf(error, error_len, "cuTensorMapEncodeTiled not found: %s", cudaGetErrorString(err));
      return nullptr;
    }
    encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }
  return encode;
}

// A 2-D map over a row-major bf16 matrix [rows, cols] (rows `stride` elements apart), read in boxes of
// box_rows rows x 64 columns (one 128-byte swizzle row each), rows past the end read as zeros: how
// worker/hopper_gemm.cu copies its weight and activation chunks. false, with the reason in error,
// where the driver refuses it.
bool encode_bf16_rows_map(CUtensorMap* map, const void* data, uint64_t rows, uint64_t cols, int64_t stride,
                          uint32_t box_rows, char* error, int error_len) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder(error, error_len);
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(stride) * 2};
  const cuuint32_t box[2] = {64, box_rows};
  const cuuint32_t element_strides[2] = {1, 1};
  CUresult res = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(data), dims, strides, box,
                        element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (res != CUDA_SUCCESS) {
    snprintf(error, error_len, "cuTensorMapEncodeTiled failed (%d): rows %llu cols %llu stride %lld box rows %u",
             int(res), (unsigned long long)rows, (unsigned long long)cols, (long long)stride, box_rows);
    return false;
  }
  return true;
}

}  // namespace
