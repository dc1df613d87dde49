// Prefill attention for Hopper (sm_90a): the FlashAttention-3 schedule, by hand.
//
// One program per (128 query rows of one sequence, one query head), 3 warpgroups:
//   - a producer warpgroup that fills a 2-stage ring of shared-memory buffers with 128-key tiles
//     of keys and values from the paged cache, each buffer completing on an mbarrier. A tile whose
//     cache blocks are a run of consecutive ids goes by TMA (two 128-row boxes per tensor, one
//     thread issues them); any other goes by a TMA box per block where blocks hold 64 slots or
//     more, and is gathered with cp.async by all 128 threads where they are smaller. The queries
//     come by TMA once.
//   - two consumer warpgroups, 64 query rows each, that compute S = Q K^T with wgmma (both operands
//     in shared memory), the online softmax in registers, and O += P V with wgmma (P straight from
//     registers: the accumulator layout of S is the register layout of wgmma's A operand). Tile
//     t's scores are computed while tile t - 1's values are accumulated, and the two warpgroups
//     take turns at the tensor cores (named barriers), so one's softmax runs during the other's
//     products. O is rescaled only when a row's running maximum grows by a factor over 2^8.
// The producer gives registers to the consumers (setmaxnreg), which hold S, O and P at once.
// Shared memory is laid out as TMA writes it with its 128-byte swizzle (the gather writes the
// same), which is the layout wgmma's descriptors name: Q and K are read K-major, V MN-major
// (transposed by the tensor cores, so values need no transposing copy).
//
// Causal with a cached prefix: query row r of a chunk sits at position context_len + r and sees
// keys 0..position. Tiles every row sees whole run unmasked.
//
// Built by worker/attention/hopper_prefill.py with nvcc (-gencode arch=compute_90a,code=sm_90a)
// and called through ctypes: plain pointers and the stream come from torch.

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#include <stdint.h>
#include <stdio.h>

#include "../hopper_ptx.cuh"

namespace {

constexpr int kHeadDim = 128;
constexpr int kBlockM = 128;  // query rows per program: two consumer warpgroups of 64
constexpr int kBlockN = 128;  // keys per tile
constexpr int kStages = 2;  // (3 fit in shared memory; measured no faster, up to 6% slower)
// Blocks of at least this many slots are copied by TMA one box per block wherever a tile is not
// one run: a box of 64 rows moves about as fast as one of 128 (H100, scattered blocks of 64: 559
// TFLOP/s against the gather's 405); boxes of 16 rows run at half speed, below the gather.
constexpr int kBlockBoxMinSlots = 64;
constexpr int kThreads = 384;
constexpr int kHalfBytes = 128 * 128;      // a 64-dim half of a 128-row tile: 128 rows of 128 bytes
constexpr int kTileBytes = 2 * kHalfBytes;  // a whole 128 x 128 bf16 tile
constexpr int kQOffset = 0;
constexpr int kKOffset = kTileBytes;
constexpr int kVOffset = kKOffset + kStages * kTileBytes;
constexpr int kBarrierOffset = kVOffset + kStages * kTileBytes;
constexpr int kSharedBytes = kBarrierOffset + 8 + 32 * kStages + 1024;  // + barriers, + alignment slack
constexpr int kConsumerWarps = 8;
constexpr int kProducerThreads = 128;

struct Params {
  __nv_bfloat16* out;
  const __nv_bfloat16* key_cache;  // [slot, kv_head, dim] rows
  const __nv_bfloat16* value_cache;
  int64_t cache_stride_slot;
  int64_t cache_stride_head;
  int64_t out_stride_token;
  int64_t out_stride_head;
  const int* block_tables;
  int64_t block_table_stride;
  const int* seq_lens;
  const int* query_start_loc;
  int num_seqs;
  int num_heads;
  int heads_per_kv;
  int block_size_log2;
  int block_boxes;  // blocks are copied by a box each where a tile is not one run (kBlockBoxMinSlots)
  float scale_log2;
  int skip_decodes;  // one-token sequences are the decode kernel's
};

// A box of the tensor map at (c0, c1, c2) into shared memory, completing on bar.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// 16 bytes from global to shared memory, L2 only; zeros where !valid (nothing is read).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

// Arrives on bar once this thread's cp.async copies so far have landed (the barrier counts it
// among those it was initialized to wait for).
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// Named barriers 1 and 2 (0 is __syncthreads'), each between the two consumer warpgroups (256 threads).
__device__ __forceinline__ void named_barrier_sync(int id) { asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void named_barrier_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// A 64 x 128 float accumulator's 64 registers per thread, as wgmma names them (operands %0-%63)
// and binds them (read and written) to d[0..63].
#define WGMMA_ACCUMULATOR_REGISTERS                                                  \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"           \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"  \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"  \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
#define WGMMA_ACCUMULATOR_OPERANDS(d)                                                                    \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),         \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
      "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
      "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
      "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
      "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// S (+)= A * B, A and B from shared memory (both K-major, 128-byte swizzle), D [64 x 128] float.
__device__ __forceinline__ void wgmma_ss_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      WGMMA_ACCUMULATOR_REGISTERS
      "%64, %65, p, 1, 1, 0, 0;\n}\n"
      : WGMMA_ACCUMULATOR_OPERANDS(d)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// O += P * V, P from registers (bf16 pairs, the accumulator layout of S), V from shared memory
// (MN-major: transposed, 128-byte swizzle), D [64 x 128] float.
__device__ __forceinline__ void wgmma_rs_m64n128k16(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.eq.u32 p, 1, 1;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      WGMMA_ACCUMULATOR_REGISTERS
      "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : WGMMA_ACCUMULATOR_OPERANDS(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

__global__ void __launch_bounds__(kThreads, 1)
    prefill_kernel(const __grid_constant__ CUtensorMap query_map, const __grid_constant__ CUtensorMap key_map,
                   const __grid_constant__ CUtensorMap value_map, const __grid_constant__ CUtensorMap key_block_map,
                   const __grid_constant__ CUtensorMap value_block_map, const Params p) {
  // The last tiles (the longest, causally) go first, every head's; short ones fill the tail.
  const int head = blockIdx.x % p.num_heads;
  const int num_tiles = gridDim.x / p.num_heads;
  const int tile = num_tiles - 1 - static_cast<int>(blockIdx.x) / p.num_heads;
  // Sequence s owns tiles from query_start_loc[s] / kBlockM + s on: the last whose first is <= tile.
  int lo = 0, hi = p.num_seqs;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (p.query_start_loc[mid] / kBlockM + mid <= tile) lo = mid + 1;
    else hi = mid;
  }
  const int seq = lo - 1;
  const int q_start = p.query_start_loc[seq];
  const int q_len = p.query_start_loc[seq + 1] - q_start;
  const int first_row = (tile - (q_start / kBlockM + seq)) * kBlockM;
  if (first_row >= q_len || (p.skip_decodes && q_len == 1)) return;
  const int seq_len = p.seq_lens[seq];
  const int first_pos = seq_len - q_len + first_row;  // the tile's first query's position
  const int num_rows = min(kBlockM, q_len - first_row);
  const int last_pos = first_pos + num_rows - 1;
  if (last_pos < 0) {
    // A CUDA graph's padding tokens form a sequence of length 0 (negative positions): they see no
    // key and come out zero, as in the Triton kernel, with nothing loaded (and no pipeline to run).
    for (int i = threadIdx.x; i < num_rows * (kHeadDim / 2); i += kThreads) {
      const int64_t token = q_start + first_row + i / (kHeadDim / 2);
      reinterpret_cast<uint32_t*>(p.out + token * p.out_stride_token + head * p.out_stride_head)[i % (kHeadDim / 2)] = 0;
    }
    return;
  }
  const int num_key_tiles = last_pos / kBlockN + 1;
  // Key tiles every row of the tile sees whole (none when the first position is negative).
  const int num_unmasked = first_pos >= 0 ? (first_pos + 1) / kBlockN : 0;

  extern __shared__ uint8_t shared_raw[];
  const uint32_t base = (smem_u32(shared_raw) + 1023) & ~1023u;  // swizzle atoms are 1024-byte aligned
  const uint32_t q_smem = base + kQOffset;
  const uint32_t bars = base + kBarrierOffset;
  const uint32_t q_full = bars;
  auto k_full = [&](int s) { return bars + 8 + 8 * s; };
  auto v_full = [&](int s) { return bars + 8 + 8 * kStages + 8 * s; };
  auto k_empty = [&](int s) { return bars + 8 + 16 * kStages + 8 * s; };
  auto v_empty = [&](int s) { return bars + 8 + 24 * kStages + 8 * s; };
  auto k_smem = [&](int s) { return base + kKOffset + s * kTileBytes; };
  auto v_smem = [&](int s) { return base + kVOffset + s * kTileBytes; };

  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    mbar_init(q_full, 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(k_full(s), kProducerThreads);  // every producer thread arrives (a gather's copies, or itself)
      mbar_init(v_full(s), kProducerThreads);
      mbar_init(k_empty(s), kConsumerWarps);
      mbar_init(v_empty(s), kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  }
  __syncthreads();

  if (warpgroup == 0) {  // the producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 88;\n");
    const int kv_head = head / p.heads_per_kv;
    const int* block_table = p.block_tables + static_cast<int64_t>(seq) * p.block_table_stride;
    if (threadIdx.x == 0) {
      const int token = q_start + first_row;
      mbar_expect_tx(q_full, kTileBytes);
      tma_load_3d(q_smem, &query_map, 0, head, token, q_full);
      tma_load_3d(q_smem + kHalfBytes, &query_map, 64, head, token, q_full);
    }
    // A tile whose cache blocks are the ids lowest .. lowest + n - 1 holds 128 consecutive cache rows,
    // copied with TMA (two 128-row boxes per tensor): in order, or in any order where every query row
    // sees the whole tile, since the softmax and P V do not care in which order keys come, only the
    // causal mask does. A fresh engine hands out a long prompt's blocks in order; a recycled pool in
    // runs of descending ids (a finished request's blocks are freed last first). Any other tile
    // goes by a TMA box per block, each at its place, where blocks hold at least kBlockBoxMinSlots
    // slots; with smaller blocks it is gathered with cp.async, row by row (boxes of one 16-slot
    // block, 2 KB per 64-dim half, ran at half the speed of 128-row ones). Every producer thread
    // reads the tile's few block ids itself (the same words, from L1), so all take the same path
    // without voting.
    // For cp.async, thread i copies 16-byte chunk i % 16 of rows i / 16 + 8 j (j < 16), so that 16
    // threads read a row's 256 contiguous bytes; the chunk lands where the 128-byte swizzle puts
    // it (chunk index XOR the row's place among 8, here i / 16 for every row of the thread).
    const int chunk = threadIdx.x % 16;
    const int row_in_step = threadIdx.x / 16;
    const uint32_t chunk_smem = (chunk / 8) * kHalfBytes + row_in_step * 128 + (((chunk % 8) ^ row_in_step) * 16);
    const __nv_bfloat16* key_rows = p.key_cache + kv_head * p.cache_stride_head + chunk * 8;
    const __nv_bfloat16* value_rows = p.value_cache + kv_head * p.cache_stride_head + chunk * 8;
    const int block_shift = p.block_size_log2;
    const int slot_mask = (1 << block_shift) - 1;
    const int blocks_per_tile = kBlockN >> block_shift;  // 1 to 16
    // The tile's first cache block where TMA copies it in one box; -2 where a box per block, -1
    // where it is gathered.
    auto tile_source = [&](int t) {
      if ((t + 1) * kBlockN > seq_len) return -1;  // a tile running off the sequence is gathered (zeros past it)
      const int* tile_blocks = block_table + t * blocks_per_tile;
      const int first = tile_blocks[0];
      int low = first, high = first;
      bool in_order = true;
#pragma unroll
      for (int i = 1; i < 16; ++i) {
        if (i < blocks_per_tile) {
          const int block = tile_blocks[i];
          in_order &= block == first + i;
          low = min(low, block);
          high = max(high, block);
        }
      }
      if (in_order) return first;
      const int not_a_run = p.block_boxes ? -2 : -1;
      if (t >= num_unmasked || high - low != blocks_per_tile - 1) return not_a_run;
      uint32_t seen = 0;  // each id of the run exactly once (a table never repeats a block, but a
                          // wrong box would be silent)
#pragma unroll
      for (int i = 0; i < 16; ++i)
        if (i < blocks_per_tile) seen |= 1u << (tile_blocks[i] - low);
      return seen == (1u << blocks_per_tile) - 1 ? low : not_a_run;
    };
    auto copy_tile = [&](int t, int lowest, uint32_t bar, uint32_t smem, const CUtensorMap* map,
                         const CUtensorMap* block_map, const __nv_bfloat16* rows) {
      if (lowest != -1) {
        if (threadIdx.x == 0) {
          mbar_expect_tx(bar, kTileBytes);
          if (lowest >= 0) {
            tma_load_3d(smem, map, 0, kv_head, lowest << block_shift, bar);
            tma_load_3d(smem + kHalfBytes, map, 64, kv_head, lowest << block_shift, bar);
          } else {
            // Block i's rows land at rows i * block_size of the tile: whole 1024-byte swizzle atoms
            // (8 rows of 128 bytes), so each box swizzles as the one 128-row box would.
            const int* tile_blocks = block_table + t * blocks_per_tile;
#pragma unroll 1  // (unrolled, the producer's code doubles and the whole kernel slows down)
            for (int i = 0; i < blocks_per_tile; ++i) {
              const int first_slot = tile_blocks[i] << block_shift;
              const uint32_t at = smem + ((i << block_shift) * 128);
              tma_load_3d(at, block_map, 0, kv_head, first_slot, bar);
              tma_load_3d(at + kHalfBytes, block_map, 64, kv_head, first_slot, bar);
            }
          }
        } else {
          mbar_arrive(bar);
        }
        return;
      }
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
        const int position = t * kBlockN + 8 * j + row_in_step;  // rows past the sequence read as zeros
        const int slot = position < seq_len ? (block_table[position >> block_shift] << block_shift) | (position & slot_mask) : 0;
        cp_async_16(smem + chunk_smem + j * 8 * 128, rows + static_cast<int64_t>(slot) * p.cache_stride_slot,
                    position < seq_len);
      }
      cp_async_arrive(bar);
    };
    // Keys run a tile ahead of values: a key buffer is released (after Q K^T) a tile before the
    // value buffer beside it (after P V), and the next scores need keys first.
    int source = tile_source(0);
    mbar_wait(k_empty(0), 1);  // a fresh barrier counts as released
    copy_tile(0, source, k_full(0), k_smem(0), &key_map, &key_block_map, key_rows);
    for (int t = 0; t < num_key_tiles; ++t) {
      const int s = t % kStages;
      const int next_source = t + 1 < num_key_tiles ? tile_source(t + 1) : -1;
      if (t + 1 < num_key_tiles) {
        const int n = (t + 1) % kStages;
        mbar_wait(k_empty(n), (((t + 1) / kStages) & 1) ^ 1);
        copy_tile(t + 1, next_source, k_full(n), k_smem(n), &key_map, &key_block_map, key_rows);
      }
      mbar_wait(v_empty(s), ((t / kStages) & 1) ^ 1);
      copy_tile(t, source, v_full(s), v_smem(s), &value_map, &value_block_map, value_rows);
      source = next_source;
    }
    return;
  }

  // A consumer: rows [64 * wg, 64 * wg + 64) of the tile. Thread rows row0 and row0 + 8, and in
  // each group j of 8 columns, columns 8 j + 2 (lane % 4) + {0, 1} (wgmma's accumulator layout).
  asm volatile("setmaxnreg.inc.sync.aligned.u32 208;\n");
  const int wg = warpgroup - 1;
  const int lane = threadIdx.x % 32;
  const int row0 = wg * 64 + (threadIdx.x / 32 % 4) * 16 + lane / 4;
  const int col0 = 2 * (lane % 4);
  const int pos0 = first_pos + row0;
  const int pos1 = pos0 + 8;

  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  float s[64];
  uint32_t probs[32];  // P in bf16, as wgmma's A fragments: keys [16 c, 16 c + 16) in probs[4 c .. 4 c + 4)
  float max0 = -INFINITY, max1 = -INFINITY;  // running maxima, in log2 units (scaled)
  float sum0 = 0.f, sum1 = 0.f;  // this thread's share of the running sums
  // The operands' descriptors are made once; each product step moves one by a constant (the
  // address field counts 16-byte units and cannot carry: shared memory addresses stay under 2^18).
  // Made per step instead, ptxas may build them in vector registers, adding work to every step.
  const uint64_t q_desc = smem_desc(q_smem + wg * 64 * 128, 16, 1024);
  const uint64_t k_desc0 = smem_desc(k_smem(0), 16, 1024);
  const uint64_t v_desc0 = smem_desc(v_smem(0), kHalfBytes, 1024);

  auto issue_scores = [&](int stage) {  // S = Q K^T
    const uint64_t k_desc = k_desc0 + stage * (kTileBytes >> 4);
#pragma unroll
    for (int k = 0; k < kHeadDim / 16; ++k) {
      const uint32_t step = ((k / 4) * kHalfBytes + (k % 4) * 32) >> 4;
      wgmma_ss_m64n128k16(s, q_desc + step, k_desc + step, k > 0);
    }
    wgmma_commit();
  };
  auto issue_values = [&](int stage) {  // O += P V
    const uint64_t v_desc = v_desc0 + stage * (kTileBytes >> 4);
#pragma unroll
    for (int k = 0; k < kBlockN / 16; ++k) {
      const uint32_t a[4] = {probs[4 * k], probs[4 * k + 1], probs[4 * k + 2], probs[4 * k + 3]};
      wgmma_rs_m64n128k16(o, a, v_desc + ((k * 16 * 128) >> 4));
    }
    wgmma_commit();
  };
  // The online softmax of tile t's scores, in place (s becomes P, unnormalized): sets the rows'
  // rescale factors for what was accumulated before, and returns whether O needs them.
  auto softmax = [&](int t, float& alpha0, float& alpha1) -> bool {
    if (t >= num_unmasked) {  // the causal diagonal: a key after the query's position is hidden
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int key = t * kBlockN + 8 * j + col0;
        if (key > pos0) s[4 * j] = -INFINITY;
        if (key + 1 > pos0) s[4 * j + 1] = -INFINITY;
        if (key > pos1) s[4 * j + 2] = -INFINITY;
        if (key + 1 > pos1) s[4 * j + 3] = -INFINITY;
      }
    }
    float tile_max0 = -INFINITY, tile_max1 = -INFINITY;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      tile_max0 = fmaxf(tile_max0, fmaxf(s[4 * j], s[4 * j + 1]));
      tile_max1 = fmaxf(tile_max1, fmaxf(s[4 * j + 2], s[4 * j + 3]));
    }
    float new_max0 = fmaxf(max0, quad_max(tile_max0) * p.scale_log2);
    float new_max1 = fmaxf(max1, quad_max(tile_max1) * p.scale_log2);
    // A row that has seen no key yet (a position before 0: padding) keeps weights of 0, not NaN.
    new_max0 = new_max0 == -INFINITY ? 0.f : new_max0;
    new_max1 = new_max1 == -INFINITY ? 0.f : new_max1;
    // O is rescaled (64 multiplies) only once a row's maximum has grown by more than 8 (in log2
    // units), decided per warp: below that the stale maximum leaves weights of at most 2^8, well
    // within bf16 and float, and the final division by the sum is the same either way.
    const bool rescale = __any_sync(0xffffffff, new_max0 > max0 + 8.f || new_max1 > max1 + 8.f);
    alpha0 = alpha1 = 1.f;
    if (rescale) {
      alpha0 = fast_exp2(max0 - new_max0);
      alpha1 = fast_exp2(max1 - new_max1);
      max0 = new_max0;
      max1 = new_max1;
    }
    float tile_sum0 = 0.f, tile_sum1 = 0.f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      s[4 * j] = fast_exp2(fmaf(s[4 * j], p.scale_log2, -max0));
      s[4 * j + 1] = fast_exp2(fmaf(s[4 * j + 1], p.scale_log2, -max0));
      s[4 * j + 2] = fast_exp2(fmaf(s[4 * j + 2], p.scale_log2, -max1));
      s[4 * j + 3] = fast_exp2(fmaf(s[4 * j + 3], p.scale_log2, -max1));
      tile_sum0 += s[4 * j] + s[4 * j + 1];
      tile_sum1 += s[4 * j + 2] + s[4 * j + 3];
    }
    sum0 = sum0 * alpha0 + tile_sum0;
    sum1 = sum1 * alpha1 + tile_sum1;
    return rescale;
  };
  auto to_probs = [&]() {
#pragma unroll
    for (int i = 0; i < 32; ++i) probs[i] = pack_bf16(s[2 * i], s[2 * i + 1]);
  };
  auto release = [&](uint32_t bar) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar);
  };

  // The two consumer warpgroups take turns issuing their products (named barriers 1 + wg): while
  // one runs its softmax, the tensor cores serve the other (FlashAttention-3's ping-pong). Within
  // a warpgroup, tile t's scores are computed while tile t - 1's values are accumulated, and the
  // softmax of t runs while that product is still going.
  if (wg == 1) named_barrier_arrive(1);
  mbar_wait(q_full, 0);
  float alpha0, alpha1;
  mbar_wait(k_full(0), 0);
  named_barrier_sync(1 + wg);
  wgmma_fence();
  issue_scores(0);
  named_barrier_arrive(2 - wg);
  wgmma_wait<0>();
  fence_registers(s);
  release(k_empty(0));
  softmax(0, alpha0, alpha1);
  to_probs();
  for (int t = 1; t < num_key_tiles; ++t) {
    const int stage = t % kStages, previous = (t - 1) % kStages;
    mbar_wait(k_full(stage), (t / kStages) & 1);
    named_barrier_sync(1 + wg);
    wgmma_fence();
    issue_scores(stage);
    mbar_wait(v_full(previous), ((t - 1) / kStages) & 1);
    issue_values(previous);
    named_barrier_arrive(2 - wg);
    wgmma_wait<1>();
    fence_registers(s);
    release(k_empty(stage));
    const bool rescale = softmax(t, alpha0, alpha1);
    wgmma_wait<0>();
    fence_registers(o);
    fence_registers(probs);
    release(v_empty(previous));
    if (rescale) {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        o[4 * j] *= alpha0;
        o[4 * j + 1] *= alpha0;
        o[4 * j + 2] *= alpha1;
        o[4 * j + 3] *= alpha1;
      }
    }
    to_probs();
  }
  const int last = (num_key_tiles - 1) % kStages;
  mbar_wait(v_full(last), ((num_key_tiles - 1) / kStages) & 1);
  wgmma_fence();
  issue_values(last);
  wgmma_wait<0>();
  fence_registers(o);
  release(v_empty(last));
  if (wg == 0) named_barrier_sync(1);  // the other's last turn signal, so no barrier is left half-arrived

  const float total0 = quad_sum(sum0), total1 = quad_sum(sum1);
  const float inv0 = total0 > 0.f ? 1.f / total0 : 0.f;
  const float inv1 = total1 > 0.f ? 1.f / total1 : 0.f;
  const int64_t token0 = q_start + first_row + row0;
  __nv_bfloat16* out0 = p.out + token0 * p.out_stride_token + head * p.out_stride_head + col0;
  __nv_bfloat16* out1 = out0 + 8 * p.out_stride_token;
  const bool valid0 = row0 < num_rows, valid1 = row0 + 8 < num_rows;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    if (valid0) *reinterpret_cast<uint32_t*>(out0 + 8 * j) = pack_bf16(o[4 * j] * inv0, o[4 * j + 1] * inv0);
    if (valid1) *reinterpret_cast<uint32_t*>(out1 + 8 * j) = pack_bf16(o[4 * j + 2] * inv1, o[4 * j + 3] * inv1);
  }
}

// A 3-D map over [rows, heads, 128 dims] of bf16 with the given strides (elements), read in boxes
// of box_rows rows x 1 head x 64 dims with the 128-byte swizzle.
bool encode_map(CUtensorMap* map, const void* data, uint64_t rows, uint64_t heads, int64_t stride_row,
                int64_t stride_head, uint32_t box_rows, char* error, int error_len) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder(error, error_len);
  if (encode == nullptr) return false;
  const cuuint64_t dims[3] = {kHeadDim, heads, rows};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(stride_head) * 2, static_cast<cuuint64_t>(stride_row) * 2};
  const cuuint32_t box[3] = {64, 1, box_rows};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  CUresult res = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(data), dims, strides, box,
                        element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (res != CUDA_SUCCESS) {
    snprintf(error, error_len, "cuTensorMapEncodeTiled failed (%d): rows %llu heads %llu strides %lld %lld", int(res),
             (unsigned long long)rows, (unsigned long long)heads, (long long)stride_row, (long long)stride_head);
    return false;
  }
  return true;
}

}  // namespace

// out, query [tokens, heads, 128] and the cache's keys and values [slots, kv_heads, 128] (bf16,
// unit stride along the head dim; slot = block * block_size + offset), strides in elements;
// block_size a power of 2 from 8 to 128. Returns 0, or 1 with a message in error.
extern "C" int minivllm_hopper_prefill(
    void* out, int64_t out_stride_token, int64_t out_stride_head, const void* query, int64_t query_stride_token,
    int64_t query_stride_head, int num_tokens, int num_heads, const void* key_cache, const void* value_cache,
    int64_t num_slots, int64_t cache_stride_slot, int64_t cache_stride_head, int num_kv_heads, int block_size,
    const int* block_tables, int64_t block_table_stride, const int* seq_lens, const int* query_start_loc,
    int num_seqs, float scale_log2, int skip_decodes, void* stream, char* error, int error_len) {
  int block_size_log2 = 0;
  while ((1 << block_size_log2) < block_size) ++block_size_log2;
  if ((1 << block_size_log2) != block_size || block_size < 8 || block_size > kBlockN) {
    snprintf(error, error_len, "block_size must be a power of 2 from 8 to %d, got %d", kBlockN, block_size);
    return 1;
  }
  const bool block_boxes = block_size >= kBlockBoxMinSlots;
  CUtensorMap query_map, key_map, value_map, key_block_map, value_block_map;
  if (!encode_map(&query_map, query, num_tokens, num_heads, query_stride_token, query_stride_head, kBlockM, error,
                  error_len) ||
      !encode_map(&key_map, key_cache, num_slots, num_kv_heads, cache_stride_slot, cache_stride_head, kBlockN, error,
                  error_len) ||
      !encode_map(&value_map, value_cache, num_slots, num_kv_heads, cache_stride_slot, cache_stride_head, kBlockN,
                  error, error_len))
    return 1;
  if (block_boxes) {
    if (!encode_map(&key_block_map, key_cache, num_slots, num_kv_heads, cache_stride_slot, cache_stride_head,
                    block_size, error, error_len) ||
        !encode_map(&value_block_map, value_cache, num_slots, num_kv_heads, cache_stride_slot, cache_stride_head,
                    block_size, error, error_len))
      return 1;
  } else {  // never read
    key_block_map = key_map;
    value_block_map = value_map;
  }
  static bool configured = false;
  if (!configured) {
    cudaError_t err = cudaFuncSetAttribute(prefill_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes);
    if (err != cudaSuccess) {
      snprintf(error, error_len, "cudaFuncSetAttribute: %s", cudaGetErrorString(err));
      return 1;
    }
    configured = true;
  }
  Params p{static_cast<__nv_bfloat16*>(out), static_cast<const __nv_bfloat16*>(key_cache),
           static_cast<const __nv_bfloat16*>(value_cache), cache_stride_slot, cache_stride_head, out_stride_token,
           out_stride_head, block_tables, block_table_stride, seq_lens, query_start_loc, num_seqs, num_heads,
           num_heads / num_kv_heads, block_size_log2, block_boxes, scale_log2, skip_decodes};
  const int grid = (num_tokens / kBlockM + num_seqs) * num_heads;
  prefill_kernel<<<grid, kThreads, kSharedBytes, static_cast<cudaStream_t>(stream)>>>(
      query_map, key_map, value_map, key_block_map, value_block_map, p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    snprintf(error, error_len, "launch: %s", cudaGetErrorString(err));
    return 1;
  }
  return 0;
}
