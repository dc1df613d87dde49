// Decode attention over an FP8 (e4m3) paged KV cache, for head_dim 128 and blocks of 16 slots
// (fp8_decode.py builds and launches it; kv_cache.py has the format).
//
// One CTA per (KV head, sequence, split); its four warps take the split's cache blocks in turn, one
// block (16 keys) per step, each with its own online softmax, merged through shared memory at the
// end. A warp's step is two tensor-core products in mma.sync.m16n8k16 (f16 in, f32 out), with the
// GQA group's queries (at most 8) as the narrow dimension:
//   S^T [16 keys x 8 queries]  = K [16 x 128] . Q^T [128 x 8]      (8 MMAs along head_dim)
//   O^T [128 dims x 8 queries] += V^T [128 x 16] . P^T [16 x 8]    (8 MMAs, one per 16 dims)
// Keys are the product's tall side, so nothing is padded but the queries (to 8).
//
// Each warp keeps a ring of kStages shared-memory stages, one cache block each (its K, V and
// scales for this KV head), filled by cp.async kStages - 1 blocks ahead of the math: with only the
// next block in flight (operands loaded straight into registers) the kernel waited on its loads and
// read the cache no faster than Triton's. From its stage a lane reads the operands in an order the
// MMA can take with no shuffle, because the order of the head dims inside S's sum, the order of
// the keys inside O's, and which of O^T's rows holds which dim are all free:
//  - a lane owns 32 bytes of each of its two keys' rows (bytes 16t..16t+15 and 64+16t..64+16t+15,
//    t = lane % 4), two 16-byte loads per key, and feeds them to the K-steps of S in that order;
//    the queries are loaded in the same order;
//  - the 16 keys of a block are taken in an order where a lane's four keys of P^T are 4
//    consecutive slots (4t..4t+3), and its rows of V^T (g and g + 8 of each MMA's 16) are dims
//    16g .. 16g + 15: so it loads those 4 keys' values of its 16 dims (a head's block stores each
//    key's values as a row, as its keys: kv_cache.py) as four 16-byte pieces, and byte permutes turn
//    them into one 32-bit word per dim, of the 4 keys' values (value_words).
// S^T's accumulator holds each lane's scores as [key][query pair]; movmatrix transposes it into
// P^T's operand, so the probabilities never leave the registers.
//
// Each key's scale multiplies its scores; each value's scale its probabilities, relative to the
// largest value scale seen so far (`ref`: an f16 product of a probability and a raw scale could
// underflow), and the accumulator is rescaled when ref or a query's running max moves (rarely, after
// the first blocks). Softmax in base 2: scores are taken times scale * log2(e).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

namespace {

constexpr int kHeadDim = 128;
constexpr int kBlockSize = 16;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
// (4 CTAs of 3 stages against 3 of 4 or 4 of 2: benchmarks/results/2026-11-26-fp8-decode-cuda/)
constexpr int kMinBlocks = 4;  // CTAs an SM keeps (caps the registers)
constexpr int kStages = 3;  // cache blocks in each warp's ring (kStages - 1 in flight)
// A stage: the block's keys [16 slots][128 bytes] (swizzled), values [128 dims][16 slots], then the
// keys' and the values' 16 scales (bfloat16: 32 bytes each).
constexpr int kKeyBytes = kBlockSize * kHeadDim;
constexpr int kScaleBytes = kBlockSize * 2;
constexpr int kStageBytes = 2 * kKeyBytes + 2 * kScaleBytes;
constexpr int kSharedBytes = kWarps * kStages * kStageBytes;
static_assert(kStages >= 2, "a ring needs a stage in flight");
static_assert(kThreads == kHeadDim, "the merge gives each thread one dim of the output");
constexpr int kMaxGroup = 8;  // queries per KV head: the MMA's narrow side
// The first wave's stagger. Inside a decode step the first wave's 528 CTAs all start as the qkv
// GEMM's CTAs leave and run in step, and that wave took ~4 us longer than in a chain of decode
// kernels (whose first wave starts a CTA at a time as the kernel before drains). Delaying head h's
// loop by h us (of 8) made the step's kernel 1-2.6 us a layer faster, and the 256-request FP8
// workload ~0.5% (H100; benchmarks/results/2026-11-28-qkv-overlap/). Walking each head's blocks
// from its own offset instead, to keep the heads apart without idling, was slower. Staggering by
// sequence (a sequence's heads together) gains as much (2026-11-28-rope-passes/): what costs is the
// whole wave running in step, not a sequence's heads reading the same blocks at once.
constexpr int kStaggerSpanNs = 8000;
static_assert(kWarps * kMaxGroup * (kHeadDim + 2) * 4 <= kSharedBytes, "the merge reuses the rings' memory");

struct Params {
  void* out;
  int64_t out_stride_token, out_stride_head;  // elements
  const void* query;
  int64_t query_stride_token, query_stride_head;  // elements
  const uint8_t* key_cache;  // e4m3, a head's block as [slot][dim] (any slot and head strides)
  const uint8_t* value_cache;  // e4m3, a head's block as [slot][dim], one run
  const __nv_bfloat16* key_scale;  // [block, head, slot]
  const __nv_bfloat16* value_scale;
  int64_t stride_block, stride_key_slot, stride_key_head;  // bytes
  int64_t stride_value_head;  // bytes (a slot's row is kHeadDim bytes)
  int64_t stride_scale_block, stride_scale_head;  // scales (slots are consecutive)
  const int* block_tables;
  int64_t block_table_stride;
  const int* seq_lens;
  const int* seq_order;  // nullptr: program y is sequence y
  // nullptr: sequence s's query and output are row s (a decode-only step). Else a mixed step's: row
  // query_start_loc[s], and only one-token sequences are attended (the prefill kernel takes the rest).
  const int* query_start_loc;
  int group;  // query heads per KV head
  float scale_log2;
  int num_splits;
  float* partial_out;  // [seq, head, split, 128] with num_splits > 1
  float* partial_max;  // [seq, head, split]
  float* partial_sum;
  int stagger_ns;  // the first wave's KV head h starts its loop h x stagger_ns / num_kv_heads late (0: none)
  int first_wave;  // CTAs resident at once (kMinBlocks an SM)
};

// The low (HIGH false) or high two e4m3 bytes of a word as two float16.
template <bool HIGH>
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t four_bytes) {
  uint32_t out;
  if (HIGH)
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, hi;\n}" : "=r"(out) : "r"(four_bytes));
  else
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n}" : "=r"(out) : "r"(four_bytes));
  return out;
}

__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t transpose_8x8(uint32_t x) {
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ void cp_async_16(uint32_t shared, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared), "l"(global));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Programmatic dependent launch: wait until the kernel before this one has finished and its writes
// are visible (a no-op when the launch did not allow an early start).
__device__ __forceinline__ void wait_for_previous_kernel() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

__device__ __forceinline__ unsigned long long global_time_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Where 16-byte chunk `chunk` (0-7) of key slot `slot`'s row sits in a stage: odd slots swap the
// row's halves, so that the 8 lanes of a quarter-warp (slots 2i, 2i + 1, chunks t or 4 + t) read
// 8 different bank groups.
__device__ __forceinline__ int key_chunk_offset(int slot, int chunk) {
  return slot * kHeadDim + ((chunk ^ ((slot & 1) << 2)) << 4);
}

// Where 16-byte chunk `chunk` (0-7: dims 16 chunk .. 16 chunk + 15) of value slot `slot`'s row sits in a
// stage: slots 4i .. 4i + 3 move their chunks by 2i, so that the 8 lanes of a quarter-warp (lane
// groups g = 2j, 2j + 1, each with slots 4t + i, t = 0-3) read 8 different bank groups.
__device__ __forceinline__ int value_chunk_offset(int slot, int chunk) {
  return kKeyBytes + slot * kHeadDim + ((chunk ^ (2 * (slot / 4))) << 4);
}

// The warp copies cache block `block_id` of kv_head into the stage at `stage` (a shared address):
// each lane 4 chunks of the keys, 4 of the values and, lanes 0-3, one of the scales.
__device__ __forceinline__ void copy_block(uint32_t stage, const Params& p, int64_t block_id, int kv_head, int lane) {
  const uint8_t* keys = p.key_cache + block_id * p.stride_block + kv_head * p.stride_key_head;
  const uint8_t* values = p.value_cache + block_id * p.stride_block + kv_head * p.stride_value_head;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int chunk = lane + 32 * i, slot = chunk / 8;
    cp_async_16(stage + key_chunk_offset(slot, chunk % 8), keys + slot * p.stride_key_slot + (chunk % 8) * 16);
    cp_async_16(stage + value_chunk_offset(slot, chunk % 8), values + chunk * 16);  // a head's values: one 2 KiB run
  }
  if (lane < 4) {
    const __nv_bfloat16* scales = (lane < 2 ? p.key_scale : p.value_scale) + block_id * p.stride_scale_block +
                                  kv_head * p.stride_scale_head;
    cp_async_16(stage + 2 * kKeyBytes + lane * 16, scales + (lane % 2) * 8);
  }
}

// Lane (g, t)'s values of one block as MMA operands: word k holds dim 16g + k of slots 4t .. 4t + 3 (a
// byte each, slot 4t first). Its four slots' 16-byte pieces of dims 16g .. 16g + 15 are a 4 x 4 grid
// of words (slot x 4 dims); byte permutes transpose each word column into 4 words (dim x 4 slots).
__device__ __forceinline__ void value_words(uint32_t (&out)[16], const uint8_t* stage, int g, int t) {
  uint4 rows[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    rows[i] = *reinterpret_cast<const uint4*>(stage + value_chunk_offset(4 * t + i, g));
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const uint32_t a = word(rows[0], w), b = word(rows[1], w), c = word(rows[2], w), d = word(rows[3], w);
    const uint32_t ab_lo = __byte_perm(a, b, 0x5140), ab_hi = __byte_perm(a, b, 0x7362);  // a0 b0 a1 b1, a2 b2 a3 b3
    const uint32_t cd_lo = __byte_perm(c, d, 0x5140), cd_hi = __byte_perm(c, d, 0x7362);
    out[4 * w] = __byte_perm(ab_lo, cd_lo, 0x5410);  // a0 b0 c0 d0: dim 16g + 4w of the 4 slots
    out[4 * w + 1] = __byte_perm(ab_lo, cd_lo, 0x7632);
    out[4 * w + 2] = __byte_perm(ab_hi, cd_hi, 0x5410);
    out[4 * w + 3] = __byte_perm(ab_hi, cd_hi, 0x7632);
  }
}

// A lane's operands of one block, read from its stage: its two keys' 32 owned bytes, its 16 words of
// values (word k: dim 16g + k, slots 4t..4t+3; MMA j's rows g and g + 8 are words 2j and 2j + 1), the
// two keys' scales.
struct Tile {
  uint4 key0[2], key1[2];
  uint32_t value[16];
  float key_scale[2], value_scale[2];
};

__device__ __forceinline__ void read_tile(Tile& tile, const uint8_t* stage, int g, int t, int slot0, int slot1) {
  tile.key0[0] = *reinterpret_cast<const uint4*>(stage + key_chunk_offset(slot0, t));
  tile.key0[1] = *reinterpret_cast<const uint4*>(stage + key_chunk_offset(slot0, 4 + t));
  tile.key1[0] = *reinterpret_cast<const uint4*>(stage + key_chunk_offset(slot1, t));
  tile.key1[1] = *reinterpret_cast<const uint4*>(stage + key_chunk_offset(slot1, 4 + t));
  value_words(tile.value, stage, g, t);
  const __nv_bfloat16* scales = reinterpret_cast<const __nv_bfloat16*>(stage + 2 * kKeyBytes);
  tile.key_scale[0] = __bfloat162float(scales[slot0]);
  tile.key_scale[1] = __bfloat162float(scales[slot1]);
  tile.value_scale[0] = __bfloat162float(scales[kBlockSize + slot0]);
  tile.value_scale[1] = __bfloat162float(scales[kBlockSize + slot1]);
}

struct SoftmaxState {
  float acc[8][4];  // O^T in units of 1/ref: [dims 16g + 2j, 16g + 2j + 1] x [queries 2t, 2t + 1]
  float max[2];  // running max of queries 2t, 2t + 1 (base-2 units), the same in every lane
  float sum[2];  // this lane's share of their sums of probabilities
  float ref;  // the largest value scale so far
};

// One block's step of the online softmax. valid_keys: how many of the block's slots hold keys.
__device__ __forceinline__ void attend_tile(SoftmaxState& st, const Tile& tile, const uint32_t (&query)[8][2],
                                            int slot0, int slot1, int valid_keys, float scale_log2) {
  float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int step = 0; step < 8; ++step) {
    const uint32_t w0 = word(tile.key0[step / 4], step % 4), w1 = word(tile.key1[step / 4], step % 4);
    mma_16816(s, e4m3x2_to_f16x2<false>(w0), e4m3x2_to_f16x2<false>(w1), e4m3x2_to_f16x2<true>(w0),
              e4m3x2_to_f16x2<true>(w1), query[step][0], query[step][1]);
  }
  const bool valid0 = slot0 < valid_keys, valid1 = slot1 < valid_keys;
  const float k0 = tile.key_scale[0] * scale_log2, k1 = tile.key_scale[1] * scale_log2;
  s[0] = valid0 ? s[0] * k0 : -INFINITY;
  s[1] = valid0 ? s[1] * k0 : -INFINITY;
  s[2] = valid1 ? s[2] * k1 : -INFINITY;
  s[3] = valid1 ? s[3] * k1 : -INFINITY;
  float tile_max0 = fmaxf(s[0], s[2]), tile_max1 = fmaxf(s[1], s[3]);
  const float v0 = valid0 ? tile.value_scale[0] : 0.f, v1 = valid1 ? tile.value_scale[1] : 0.f;
  float value_max = fmaxf(v0, v1);
#pragma unroll
  for (int lane_mask = 4; lane_mask < 32; lane_mask <<= 1) {  // over the lanes of other keys
    tile_max0 = fmaxf(tile_max0, __shfl_xor_sync(0xffffffffu, tile_max0, lane_mask));
    tile_max1 = fmaxf(tile_max1, __shfl_xor_sync(0xffffffffu, tile_max1, lane_mask));
    value_max = fmaxf(value_max, __shfl_xor_sync(0xffffffffu, value_max, lane_mask));
  }
  const float max0 = fmaxf(st.max[0], tile_max0), max1 = fmaxf(st.max[1], tile_max1);
  const float alpha0 = fast_exp2(st.max[0] - max0), alpha1 = fast_exp2(st.max[1] - max1);
  const float ref = fmaxf(st.ref, value_max);
  const float ref_ratio = __fdividef(st.ref, ref);
  st.max[0] = max0;
  st.max[1] = max1;
  st.ref = ref;
  const float p0 = fast_exp2(s[0] - max0), p1 = fast_exp2(s[1] - max1);
  const float p2 = fast_exp2(s[2] - max0), p3 = fast_exp2(s[3] - max1);
  st.sum[0] = st.sum[0] * alpha0 + p0 + p2;
  st.sum[1] = st.sum[1] * alpha1 + p1 + p3;
  const float rescale0 = alpha0 * ref_ratio, rescale1 = alpha1 * ref_ratio;
  if (__any_sync(0xffffffffu, rescale0 != 1.f || rescale1 != 1.f)) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      st.acc[j][0] *= rescale0;
      st.acc[j][1] *= rescale1;
      st.acc[j][2] *= rescale0;
      st.acc[j][3] *= rescale1;
    }
  }
  const float w0 = __fdividef(v0, ref), w1 = __fdividef(v1, ref);
  const uint32_t probs0 = transpose_8x8(pack_f16x2(p0 * w0, p1 * w0));  // keys 0-7 of the product
  const uint32_t probs1 = transpose_8x8(pack_f16x2(p2 * w1, p3 * w1));  // keys 8-15
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint32_t x0 = tile.value[2 * j], x1 = tile.value[2 * j + 1];
    mma_16816(st.acc[j], e4m3x2_to_f16x2<false>(x0), e4m3x2_to_f16x2<false>(x1), e4m3x2_to_f16x2<true>(x0),
              e4m3x2_to_f16x2<true>(x1), probs0, probs1);
  }
}

// A lane's 32 dims of a head row: lo = dims 16t..16t+15, hi = 64+16t..64+16t+15.
template <typename T>
__device__ __forceinline__ void load_head_dims(const T* row, int t, float (&lo)[16], float (&hi)[16]) {
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    lo[k] = static_cast<float>(row[16 * t + k]);
    hi[k] = static_cast<float>(row[64 + 16 * t + k]);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, kMinBlocks) fp8_decode_kernel(const Params p) {
  extern __shared__ __align__(16) uint8_t shared[];

  // The kernel after this one (o_proj's, the split merge) may launch as this grid's last CTAs start,
  // and load what no kernel writes (its weights) on the SMs they leave; it waits for the whole grid
  // (griddepcontrol.wait) before it reads the output. Without this it launched only once every CTA
  // had exited.
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  const int kv_head = blockIdx.x;
  const int seq = p.seq_order != nullptr ? p.seq_order[blockIdx.y] : blockIdx.y;
  const int split = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;

  int row = seq;
  if (p.query_start_loc != nullptr) {
    row = p.query_start_loc[seq];
    if (p.query_start_loc[seq + 1] - row != 1) return;  // a prefill chunk (or an empty padding sequence)
  }
  const int seq_len = p.seq_lens[seq];
  const int num_blocks = (seq_len + kBlockSize - 1) / kBlockSize;
  const int blocks_per_split = (num_blocks + p.num_splits - 1) / p.num_splits;
  const int block_lo = split * blocks_per_split;
  const int block_hi = min(num_blocks, block_lo + blocks_per_split);

  // The warp's blocks are block_lo + warp + kWarps * m, m = 0 .. my_blocks - 1. Their ids are read
  // 32 at a time, one per lane, and passed round by shuffles.
  const int* table = p.block_tables + seq * p.block_table_stride;
  const int first = block_lo + warp;
  const int my_blocks = first < block_hi ? (block_hi - first + kWarps - 1) / kWarps : 0;
  uint8_t* ring = shared + warp * kStages * kStageBytes;
  const uint32_t ring_address = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  int ids = 0;
  auto copy = [&](int m) {  // block m into stage m % kStages, always a commit group (maybe empty)
    if (m < my_blocks) {
      if (m % 32 == 0) ids = m + lane < my_blocks ? table[first + kWarps * (m + lane)] : 0;
      copy_block(ring_address + (m % kStages) * kStageBytes, p, __shfl_sync(0xffffffffu, ids, m % 32), kv_head,
                 lane);
    }
    cp_async_commit();
  };
  // PDL (worker/pdl.py): the kernel before this one (ops.norm_rope, or the K/V store) writes the
  // query and each sequence's newest key and value, which sit in its last block; the lengths, block
  // tables, order and query_start_loc are step inputs. So the ring's first copies go out before waiting for that
  // kernel, unless they are of the last block.
  int staged = 0;
  for (; staged < kStages - 1 && (staged >= my_blocks || first + kWarps * staged < num_blocks - 1); ++staged)
    copy(staged);
  wait_for_previous_kernel();
  for (; staged < kStages - 1; ++staged) copy(staged);
  if (p.stagger_ns > 0 && blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z) < p.first_wave) {
    const unsigned long long delay_ns = static_cast<unsigned long long>(kv_head) * p.stagger_ns / gridDim.x;
    const unsigned long long until = global_time_ns() + delay_ns;
    while (global_time_ns() < until) {
    }
  }

  // The lane's query row g, in the order its key bytes feed the K-steps (0 for padding rows).
  uint32_t query[8][2];
  {
    float lo[16], hi[16];
    const int head = kv_head * p.group + min(g, p.group - 1);  // (padding rows: a real row, zeroed below)
    load_head_dims(static_cast<const T*>(p.query) + row * p.query_stride_token + head * p.query_stride_head, t, lo,
                   hi);
#pragma unroll
    for (int step = 0; step < 8; ++step) {
      const float* x = step < 4 ? lo + 4 * step : hi + 4 * (step - 4);
      const bool real = g < p.group;
      query[step][0] = real ? pack_f16x2(x[0], x[1]) : 0u;
      query[step][1] = real ? pack_f16x2(x[2], x[3]) : 0u;
    }
  }
  // The block's keys in the order of P^T's operand: S^T's rows g and g + 8 are slots slot0, slot1.
  const int slot0 = 4 * (g / 2) + g % 2, slot1 = slot0 + 2;

  SoftmaxState st;
#pragma unroll
  for (int j = 0; j < 8; ++j) st.acc[j][0] = st.acc[j][1] = st.acc[j][2] = st.acc[j][3] = 0.f;
  st.max[0] = st.max[1] = -INFINITY;
  st.sum[0] = st.sum[1] = 0.f;
  st.ref = 0.f;

  for (int m = 0; m < my_blocks; ++m) {
    cp_async_wait<kStages - 2>();  // block m has landed (this lane's copies)
    __syncwarp();  // ... and every lane's; and all are done reading block m - 1's stage
    copy(m + kStages - 1);  // into that stage
    Tile tile;
    read_tile(tile, ring + (m % kStages) * kStageBytes, g, t, slot0, slot1);
    attend_tile(st, tile, query, slot0, slot1, seq_len - (first + kWarps * m) * kBlockSize, p.scale_log2);
  }
  cp_async_wait<0>();
  __syncthreads();  // the rings are free: the merge below reuses their memory

  // Merge the warps: each writes its state, then thread d combines dim d for every query.
  auto shared_acc = reinterpret_cast<float(*)[kMaxGroup][kHeadDim]>(shared);  // [warp][query][dim]
  auto shared_max = reinterpret_cast<float(*)[kMaxGroup]>(shared + kWarps * kMaxGroup * kHeadDim * 4);
  auto shared_sum = shared_max + kWarps;
#pragma unroll
  for (int mask = 4; mask < 32; mask <<= 1) {
    st.sum[0] += __shfl_xor_sync(0xffffffffu, st.sum[0], mask);
    st.sum[1] += __shfl_xor_sync(0xffffffffu, st.sum[1], mask);
  }
  if (g == 0) {
    shared_max[warp][2 * t] = st.max[0];
    shared_max[warp][2 * t + 1] = st.max[1];
    shared_sum[warp][2 * t] = st.sum[0];
    shared_sum[warp][2 * t + 1] = st.sum[1];
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    shared_acc[warp][2 * t][16 * g + 2 * j] = st.acc[j][0] * st.ref;
    shared_acc[warp][2 * t + 1][16 * g + 2 * j] = st.acc[j][1] * st.ref;
    shared_acc[warp][2 * t][16 * g + 2 * j + 1] = st.acc[j][2] * st.ref;
    shared_acc[warp][2 * t + 1][16 * g + 2 * j + 1] = st.acc[j][3] * st.ref;
  }
  __syncthreads();
  const int dim = threadIdx.x;
  for (int q = 0; q < p.group; ++q) {
    float max_all = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) max_all = fmaxf(max_all, shared_max[w][q]);
    float sum = 0.f, acc = 0.f;
    if (max_all != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float weight = fast_exp2(shared_max[w][q] - max_all);  // 0 for a warp that saw no key
        sum += shared_sum[w][q] * weight;
        acc += shared_acc[w][q][dim] * weight;
      }
    }
    const int head = kv_head * p.group + q;
    if (p.num_splits == 1) {
      T* out = static_cast<T*>(p.out) + row * p.out_stride_token + head * p.out_stride_head;
      out[dim] = T(sum > 0.f ? acc / sum : 0.f);
    } else {  // the partial state _combine_splits_kernel merges; an empty split: max -inf, sum 0
      const int64_t state = (static_cast<int64_t>(seq) * gridDim.x * p.group + head) * p.num_splits + split;
      p.partial_out[state * kHeadDim + dim] = acc;
      if (dim == 0) {
        p.partial_max[state] = max_all;
        p.partial_sum[state] = sum;
      }
    }
  }
}

}  // namespace

// Returns 0, or 1 with a message in error. query_dtype: 0 float16, 1 bfloat16 (out has the same).
extern "C" int minivllm_fp8_decode(
    void* out, int64_t out_stride_token, int64_t out_stride_head, const void* query, int64_t query_stride_token,
    int64_t query_stride_head, int query_dtype, int num_seqs, int num_kv_heads, int group, const void* key_cache,
    const void* value_cache, const void* key_scale, const void* value_scale, int64_t stride_block,
    int64_t stride_key_slot, int64_t stride_key_head, int64_t stride_value_head, int64_t stride_scale_block,
    int64_t stride_scale_head, const int* block_tables, int64_t block_table_stride, const int* seq_lens,
    const int* seq_order, const int* query_start_loc, float scale_log2, int num_splits, void* partial_out,
    void* partial_max, void* partial_sum, int stagger, int pdl, void* stream, char* error, int error_len) {
  if (group < 1 || group > kMaxGroup) {
    snprintf(error, error_len, "query heads per KV head must be 1 to %d, got %d", kMaxGroup, group);
    return 1;
  }
  if (num_splits < 1 || num_splits > 65535 || num_seqs > 65535) {
    snprintf(error, error_len, "num_splits (%d) and num_seqs (%d) must be 1 to 65535", num_splits, num_seqs);
    return 1;
  }
  if (query_start_loc != nullptr && num_splits != 1) {
    snprintf(error, error_len, "a mixed step's decodes (query_start_loc) take one split, got %d", num_splits);
    return 1;
  }
  if (num_seqs == 0) return 0;
  int device = 0, num_sms = 0;  // (the current device's: a process may drive more than one GPU)
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    snprintf(error, error_len, "could not read the multiprocessor count");
    return 1;
  }
  Params p{out, out_stride_token, out_stride_head, query, query_stride_token, query_stride_head,
           static_cast<const uint8_t*>(key_cache), static_cast<const uint8_t*>(value_cache),
           static_cast<const __nv_bfloat16*>(key_scale), static_cast<const __nv_bfloat16*>(value_scale), stride_block,
           stride_key_slot, stride_key_head, stride_value_head, stride_scale_block, stride_scale_head, block_tables,
           block_table_stride, seq_lens, seq_order, query_start_loc, group, scale_log2, num_splits,
           static_cast<float*>(partial_out), static_cast<float*>(partial_max), static_cast<float*>(partial_sum),
           stagger ? kStaggerSpanNs : 0, num_sms * kMinBlocks};
  static bool configured = false;
  if (!configured) {
    for (auto kernel : {fp8_decode_kernel<__half>, fp8_decode_kernel<__nv_bfloat16>}) {
      cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes);
      if (err != cudaSuccess) {
        snprintf(error, error_len, "cudaFuncSetAttribute: %s", cudaGetErrorString(err));
        return 1;
      }
    }
    configured = true;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(num_kv_heads, num_seqs, num_splits);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = kSharedBytes;
  config.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute early_start;  // pdl: the CTAs may start while the kernel before runs
  early_start.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  early_start.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &early_start;
  config.numAttrs = pdl ? 1 : 0;
  cudaError_t err = query_dtype == 1 ? cudaLaunchKernelEx(&config, fp8_decode_kernel<__nv_bfloat16>, p)
                                     : cudaLaunchKernelEx(&config, fp8_decode_kernel<__half>, p);
  if (err != cudaSuccess) {
    snprintf(error, error_len, "launch: %s", cudaGetErrorString(err));
    return 1;
  }
  return 0;
}
