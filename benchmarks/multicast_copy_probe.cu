// Probe (benchmarks/multicast_copy_probe.py): a decode projection's copies alone, as the Hopper GEMM
// (worker/hopper_gemm.cu) makes them, and the same copies with the activations multicast within
// clusters of CTAs.
//
// A CTA stands for one of the GEMM's: row tile row_tile (64 weight rows) x token tile (token_tile
// activation rows), walking K in chunks of 64 columns. For each chunk one producer thread copies the
// weight box [64 rows x 64] and the activation box [token_tile x 64] by TMA into a stage of a ring
// in shared memory; a consumer warpgroup waits for the stage, reads a word of it and releases it
// (lane 0 of each of its 4 warps arrives on the stage's empty barrier). No products.
//
// In a cluster of `cluster` CTAs of consecutive row tiles and one token tile, each CTA copies its own
// weight box and 1 / cluster of the activation box's rows into the same stage of every CTA of the
// cluster (cp.async.bulk.tensor ... .multicast::cluster), so that L2 serves each activation chunk
// once per cluster instead of once per CTA. With share_w, the cluster's CTAs are consecutive token
// tiles of one row tile instead, and they share the weight box the same way. A stage is then
// refilled only once every CTA of the cluster has released it, as a multicast GEMM must. Two ways:
//   - each consumer warp arrives on its own CTA's empty barrier and on the others' (mapa +
//     mbarrier.arrive.shared::cluster);
//   - lean: the consumer warpgroup first meets at a named barrier, then warp r's lane 0 arrives on
//     CTA r's barrier: one arrival per CTA and stage, spread over the warps (as CUTLASS's pipelines
//     release a multicast stage).
//
// no_chunks launches the same grid and clusters with nothing to copy: the launches' own cost.

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#include <stdint.h>
#include <stdio.h>

#include "../worker/hopper_ptx.cuh"

namespace {

constexpr int kRows = 64;         // weight rows a CTA
constexpr int kChunk = 64;        // K columns a chunk (128 bytes of bf16: one swizzle row)
constexpr int kWBoxBytes = kRows * kChunk * 2;
constexpr int kThreads = 256;     // a producer warpgroup, a consumer warpgroup
constexpr int kMaxStages = 8;

struct Params {
  int row_tiles;   // CTA c: row tile c % row_tiles, token tile c / row_tiles (share_w: the other way round)
  int token_tiles;
  int share_w;     // a cluster shares weight boxes (else activation boxes)
  int lean;        // one arrival per CTA and stage (else one per warp)
  int row_base;    // the layer's first weight row
  int token_tile;  // activation rows a CTA
  int num_chunks;  // K / 64 (0: nothing copied)
  int stages;
};

// The same box into the same shared-memory offset (and barrier offset) of every CTA in `ctas`.
__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                                      uint32_t bar, uint16_t ctas) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar), "h"(ctas)
      : "memory");
}

__device__ __forceinline__ uint32_t cluster_reg(int which) {
  uint32_t v;
  if (which == 0) asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(v));
  else asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(v));
  return v;
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// Arrive on the barrier at `bar`'s offset in the cluster's CTA `rank`.
__device__ __forceinline__ void mbar_arrive_in(uint32_t bar, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(bar), "r"(rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
}

__global__ void __launch_bounds__(kThreads, 1)
    copy_kernel(const __grid_constant__ CUtensorMap w_map, const __grid_constant__ CUtensorMap x_map, const Params p,
                uint32_t* sink) {
  extern __shared__ uint8_t shared_raw[];
  const uint32_t base = (smem_u32(shared_raw) + 1023) & ~1023u;
  const uint8_t* aligned = shared_raw + (base - smem_u32(shared_raw));  // the same bytes, generically addressed
  const int x_box_bytes = p.token_tile * kChunk * 2;
  const int stage_bytes = kWBoxBytes + x_box_bytes;  // a multiple of 1024: token tiles are multiples of 8
  const uint32_t bars = base + p.stages * stage_bytes;
  auto full = [&](int s) { return bars + 8 * s; };
  auto empty = [&](int s) { return bars + 8 * kMaxStages + 8 * s; };
  const uint32_t rank = cluster_reg(0), cluster = cluster_reg(1);
  const int row_tile = p.share_w ? blockIdx.x / p.token_tiles : blockIdx.x % p.row_tiles;
  const int token_tile = p.share_w ? blockIdx.x % p.token_tiles : blockIdx.x / p.row_tiles;

  if (threadIdx.x == 0) {
    for (int s = 0; s < p.stages; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), p.lean ? cluster : 4 * cluster);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if (cluster > 1) cluster_sync();  // every CTA's barriers exist before any copy or arrival reaches them
  else __syncthreads();

  if (threadIdx.x < 128) {  // the producer
    if (threadIdx.x == 0) {
      const int slice = (p.share_w ? kRows : p.token_tile) / cluster;  // rows this CTA copies for the cluster
      const uint16_t everyone = static_cast<uint16_t>((1u << cluster) - 1);
      for (int i = 0; i < p.num_chunks; ++i) {
        const int s = i % p.stages;
        if (i >= p.stages) mbar_wait(empty(s), ((i / p.stages) - 1) & 1);
        const uint32_t w_dst = base + s * stage_bytes, x_dst = w_dst + kWBoxBytes;
        mbar_expect_tx(full(s), stage_bytes);
        if (cluster > 1 && p.share_w)
          tma_load_2d_multicast(w_dst + rank * slice * 128, &w_map, i * kChunk,
                                p.row_base + row_tile * kRows + rank * slice, full(s), everyone);
        else
          tma_load_2d(w_dst, &w_map, i * kChunk, p.row_base + row_tile * kRows, full(s));
        if (cluster > 1 && !p.share_w)
          tma_load_2d_multicast(x_dst + rank * slice * 128, &x_map, i * kChunk,
                                token_tile * p.token_tile + rank * slice, full(s), everyone);
        else
          tma_load_2d(x_dst, &x_map, i * kChunk, token_tile * p.token_tile, full(s));
      }
    }
  } else {  // the consumers
    const int lane = threadIdx.x % 32;
    uint32_t acc = 0;
    for (int i = 0; i < p.num_chunks; ++i) {
      const int s = i % p.stages;
      mbar_wait(full(s), (i / p.stages) & 1);
      acc ^= *reinterpret_cast<const volatile uint32_t*>(aligned + s * stage_bytes + 4 * lane);
      __syncwarp();
      if (p.lean) {
        asm volatile("bar.sync 1, 128;\n" ::: "memory");  // the whole warpgroup is done with the stage
        const uint32_t warp = (threadIdx.x - 128) / 32;
        if (lane == 0 && warp < cluster) mbar_arrive_in(empty(s), warp);
      } else if (lane == 0) {
        if (cluster == 1) mbar_arrive(empty(s));
        else
          for (uint32_t r = 0; r < cluster; ++r) mbar_arrive_in(empty(s), r);
      }
    }
    if (acc == 0x9e3779b9u) *sink = acc;  // keeps the reads
  }
  if (cluster > 1) cluster_sync();  // no CTA exits while another may still arrive on its barriers
}

}  // namespace

// One launch per layer: weights [layers * n, k] (layer l's rows from l * n), x [num_tokens, k], bf16.
// A projection's CTAs: n / 64 row tiles x num_tokens / token_tile token tiles, in clusters of `cluster`
// row tiles sharing activation boxes (share_w: of `cluster` token tiles sharing weight boxes; 1, 2 or 4).
// lean: one release arrival per CTA and stage. no_chunks: the same launches with nothing copied.
// Returns 0, or 1 with a message.
extern "C" int probe_copies(const void* weights, int layers, int n, int k, const void* x, int num_tokens,
                            int token_tile, int cluster, int share_w, int lean, int stages, int no_chunks,
                            uint32_t* sink, void* stream, char* error, int error_len) {
  const int row_tiles = n / kRows, token_tiles = num_tokens / token_tile;
  const bool shares_x = cluster > 1 && !share_w;
  if (n % kRows || k % kChunk || num_tokens % token_tile || token_tile % 8 || token_tile > 256 ||
      (shares_x && (token_tile % (8 * cluster) || row_tiles % cluster)) ||
      (share_w && (kRows % (8 * cluster) || token_tiles % cluster)) || stages < 1 || stages > kMaxStages) {
    snprintf(error, error_len, "unsupported: n %d k %d tokens %d token_tile %d cluster %d stages %d", n, k, num_tokens,
             token_tile, cluster, stages);
    return 1;
  }
  CUtensorMap w_map, x_map;
  if (!encode_bf16_rows_map(&w_map, weights, uint64_t(layers) * n, k, k, share_w ? kRows / cluster : kRows, error,
                            error_len) ||
      !encode_bf16_rows_map(&x_map, x, num_tokens, k, k, shares_x ? token_tile / cluster : token_tile, error,
                            error_len))
    return 1;
  const int smem = stages * (kWBoxBytes + token_tile * kChunk * 2) + 16 * kMaxStages + 1024;
  cudaError_t err = cudaFuncSetAttribute(copy_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) {
    snprintf(error, error_len, "smem attribute (%d bytes): %s", smem, cudaGetErrorString(err));
    return 1;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(row_tiles * token_tiles);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = cluster;
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  for (int layer = 0; layer < layers; ++layer) {
    const Params p{row_tiles, token_tiles, share_w, lean, layer * n, token_tile, no_chunks ? 0 : k / kChunk, stages};
    err = cudaLaunchKernelEx(&config, copy_kernel, w_map, x_map, p, sink);
    if (err != cudaSuccess) {
      snprintf(error, error_len, "launch: %s", cudaGetErrorString(err));
      return 1;
    }
  }
  return 0;
}
