// y = x W^T for decode-sized batches (2 to 256 rows) on Hopper (sm_90a): TMA + wgmma, by hand.
//
// A decode step's projections are short matrix products whose time cuBLAS spends mostly in fixed
// costs (6-9 us each on an H100 against 1.4-4.2 us for their weights' bytes). This kernel computes
// the product transposed, y^T = W x^T, so the weight rows fill wgmma's 64-row M side and the step's
// tokens its N side (tiles of 16 to 256), and it launches with PDL. Each CTA owns 64 weight rows x
// BT tokens over all of K:
//
//   producer warpgroup: thread 0 copies W's [64 rows x 64 k] chunks (TMA, 128-byte swizzle) into SW
//                       stages at once, before the kernel ahead has finished (weights are no
//                       kernel's output); thread 32 waits for that kernel (griddepcontrol.wait),
//                       then copies x's [BT rows x 64 k] chunks into SX stages.
//   two consumer warpgroups: alternate chunks, 4 wgmma m64nBTk16 each, both operands from shared
//                       memory; their sums are added through shared memory and go out transposed,
//                       in 16-byte stores.
//
// GATED (the MLP's fused gate|up projection, n = 2 x intermediate): a CTA's 64 rows are 32 gate rows
// and the same 32 features' up rows, two TMA boxes a chunk (at row r and at n / 2 + r), so that
// warps 0-1 of a consumer hold gate sums and warps 2-3 the up sums of the same features in the same
// registers. The epilogue returns silu(gate) * up [tokens, n / 2] from the float sums: SiLU-and-mul's
// kernel goes, and so does half of the projection's output.
//
// ROPE (an attention layer's qkv projection, heads of 128): a CTA takes one head's 128 rows whole,
// and the consumers split the rows instead of K: consumer 0 multiplies the head's dims 0-63 over every
// chunk of K, consumer 1 its dims 64-127, from the same x chunk. The epilogue then does what
// ops.norm_rope would do in a kernel of its own after the projection: q and k heads are RMS-normed
// (Qwen3's q/k norm) and rotated by RoPE (a dim's partner, d +- 64, is the other consumer's), k and v
// heads are written to the paged KV cache (bf16, or e4m3 with a scale per token and head), and y gets
// the rotated q and k and the plain v. Two idle producer warps meanwhile copy the tile's positions'
// cos/sin into shared memory, so the epilogue waits for no load but its staged sums; then all 12 warps,
// the producers' too, share the epilogue's tokens.
//
// Built by worker/hopper_gemm.py with nvcc and called through ctypes.

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#include <stdint.h>
#include <stdio.h>

#include "hopper_ptx.cuh"

// ROPE's inputs, a kernel parameter of their own (hopper_gemm.py's RopeParams mirrors this struct).
// Cache strides are in elements of the cache's type (bytes for e4m3), as triton_attention.cache_strides
// gives them. Outside the unnamed namespace: minivllm_hopper_gemm_rope takes a pointer to it, and a
// function of an internal type gets internal linkage, so its symbol would not be exported.
struct RopeParams {
  const int64_t* positions;     // [num_tokens]
  const int64_t* slot_mapping;  // [num_tokens]; -1: a padding row, stored nowhere
  const float* cos_cache;       // [max_position, 64]
  const float* sin_cache;
  const __nv_bfloat16* q_norm;  // [128], or null: no q/k norm
  const __nv_bfloat16* k_norm;
  void* k_cache;                // bf16 or e4m3
  void* v_cache;
  __nv_bfloat16* k_scale;       // e4m3 only
  __nv_bfloat16* v_scale;
  int64_t block_stride, k_slot_stride, k_head_stride, v_slot_stride, v_head_stride;  // (dims: stride 1)
  int64_t scale_block_stride, scale_slot_stride, scale_head_stride;
  float eps;
  int num_q_heads, num_kv_heads, block_size, fp8;
};

namespace {

constexpr int kRows = 64;          // weight rows per CTA (wgmma's M)
constexpr int kChunk = 64;         // k per chunk: one 128-byte swizzle row of bf16
constexpr int kWChunkBytes = kRows * 128;
constexpr int kOutRowBytes = 144;  // a staged output row (64 bf16 + 16 bytes of padding: no bank conflicts)

// D [64 x N] (+)= A [64 x 16] * B [N x 16]^T, both operands from shared memory (K-major, 128-byte
// swizzle), for the token tiles N = 16, 32, ..., 256: one specialization per N, each naming its N / 2
// accumulator registers (an asm statement's operand list cannot be built by a template). They differ
// only in N and in those lists.
template <int N>
__device__ __forceinline__ void wgmma_bf16(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b);

template <>
__device__ __forceinline__ void wgmma_bf16<16>(float (&d)[8], uint64_t desc_a, uint64_t desc_b) {
  asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\nwgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
               : "l"(desc_a), "l"(desc_b));
}

template <>
__device__ __forceinline__ void wgmma_bf16<32>(float (&d)[16], uint64_t desc_a, uint64_t desc_b) {
  asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\nwgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
               : "l"(desc_a), "l"(desc_b));
}

template <>
__device__ __forceinline__ void wgmma_bf16<48>(float (&d)[24], uint64_t desc_a, uint64_t desc_b) {
  asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\nwgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23}, %24, %25, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
               : "l"(desc_a), "l"(desc_b));
}

template <>
__device__ __forceinline__ void wgmma_bf16<64>(float (&d)[32], uint64_t desc_a, uint64_t desc_b) {
  asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\nwgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
               : "l"(desc_a), "l"(desc_b));
}

template <>
__device__ __forceinline__ void wgmma_bf16<80>(float (&d)[40], uint64_t desc_a, uint64_t desc_b) {
  asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\nwgmma.mma_async.sync.aligned.m64n80k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39}, %40, %41, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
               : "l"(desc_a), "l"(desc_b));
}

template <>
__device__ __forceinline__ void wgmma_bf16<96>(float (&d)[48], uint64_t desc_a, uint64_t desc_b) {
  asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\nwgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47}, %48, %49, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
               : "l"(desc_a), "l"(desc_b));
}

template <>
__device__ __forceinline__ void wgmma_bf16<112>(float (&d)[56], uint64_t desc_a, uint64_t desc_b) {
  asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\nwgmma.mma_async.sync.aligned.m64n112k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55}, %56, %57, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55])
               : "l"(desc_a), "l"(desc_b));
}

template <>
__device__ __forceinline__ void wgmma_bf16<128>(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
  asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\nwgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
               : "l"(desc_a), "l"(desc_b));
}

template <>
__device__ __forceinline__ void wgmma_bf16<144>(float (&d)[72], uint64_t desc_a, uint64_t desc_b) {
  asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\nwgmma.mma_async.sync.aligned.m64n144k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71}, %72, %73, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71])
               : "l"(desc_a), "l"(desc_b));
}

template <>
__device__ __forceinline__ void wgmma_bf16<160>(float (&d)[80], uint64_t desc_a, uint64_t desc_b) {
  asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\nwgmma.mma_async.sync.aligned.m64n160k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79}, %80, %81, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79])
               : "l"(desc_a), "l"(desc_b));
}

template <>
__device__ __forceinline__ void wgmma_bf16<176>(float (&d)[88], uint64_t desc_a, uint64_t desc_b) {
  asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\nwgmma.mma_async.sync.aligned.m64n176k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87}, %88, %89, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87])
               : "l"(desc_a), "l"(desc_b));
}

template <>
__device__ __forceinline__ void wgmma_bf16<192>(float (&d)[96], uint64_t desc_a, uint64_t desc_b) {
  asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\nwgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95}, %96, %97, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
               : "l"(desc_a), "l"(desc_b));
}

template <>
__device__ __forceinline__ void wgmma_bf16<208>(float (&d)[104], uint64_t desc_a, uint64_t desc_b) {
  asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\nwgmma.mma_async.sync.aligned.m64n208k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103}, %104, %105, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103])
               : "l"(desc_a), "l"(desc_b));
}

template <>
__device__ __forceinline__ void wgmma_bf16<224>(float (&d)[112], uint64_t desc_a, uint64_t desc_b) {
  asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\nwgmma.mma_async.sync.aligned.m64n224k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111}, %112, %113, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111])
               : "l"(desc_a), "l"(desc_b));
}

template <>
__device__ __forceinline__ void wgmma_bf16<240>(float (&d)[120], uint64_t desc_a, uint64_t desc_b) {
  asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\nwgmma.mma_async.sync.aligned.m64n240k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119}, %120, %121, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119])
               : "l"(desc_a), "l"(desc_b));
}

template <>
__device__ __forceinline__ void wgmma_bf16<256>(float (&d)[128], uint64_t desc_a, uint64_t desc_b) {
  asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\nwgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, %128, %129, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
               : "l"(desc_a), "l"(desc_b));
}

struct Params {
  __nv_bfloat16* y;
  int64_t y_stride;  // elements between rows of y
  int num_tokens;
  int num_chunks;    // K / 64
  int num_token_tiles;
  int up_row0;       // GATED: the first up row (n / 2)
};

constexpr int kThreads = 384;          // a producer warpgroup and two consumer warpgroups
constexpr int kSharedLimit = 227 * 1024;
constexpr int kFewStages = 8;

// Shared memory for token tile BT and SW weight stages: the weight ring, the activation ring (SX
// stages), then the barriers.
constexpr int kRopeRowFloats = 132;  // a staged ROPE token row: 128 dims + 4 of padding (no bank conflicts)

template <int BT, int SW, bool GATED = false, bool ROPE = false>
struct Layout {
  // x's chunks are small in narrow tiles (2 KB at 16 tokens), and each refill waits a round trip
  // after the chunk before it in that stage is consumed: more of them in flight there.
  static constexpr int SX = BT <= 32 ? 16 : BT <= 64 ? 8 : 4;
  // Both rings have an even number of stages, so each stage is always the same consumer's (chunk i
  // is consumer i % 2's). With a stage shared, a consumer could wait for a stage's next fill while
  // its previous one was still in flight, on a barrier then a phase behind: the wait's parity
  // matches the phase before, and it passes early.
  static_assert(SW % 2 == 0 && SX % 2 == 0, "each stage belongs to one consumer");
  static constexpr int kXChunkBytes = BT * 128;
  static constexpr int kW = 0;
  static constexpr int kX = SW * kWChunkBytes;
  // ROPE: the tile's cos and sin rows (fp32 [token][128]), then its slots and positions, filled
  // during the main loop.
  static constexpr int kCosSin = kX + SX * kXChunkBytes;
  static constexpr int kSlots = kCosSin + (ROPE ? BT * 512 : 0);
  static constexpr int kPositions = kSlots + (ROPE ? BT * 8 : 0);
  static constexpr int kBars = kPositions + (ROPE ? BT * 8 : 0);
  static constexpr int kBytes = kBars + 16 * (SW + SX) + 1024;  // + alignment slack
  static_assert(kBytes <= kSharedLimit, "shared memory");
  static_assert(BT * kOutRowBytes <= SW * kWChunkBytes, "the output is staged in the weight stages");
  static_assert(BT * 256 <= SX * kXChunkBytes, "consumer 1's sums wait in the activation stages");
  static constexpr int kGatedOutRowBytes = 80;  // 32 bf16 + 16 bytes of padding
  static_assert(!GATED || BT * 256 <= SW * kWChunkBytes, "consumer 0's sums wait in the weight stages");
  static_assert(!GATED || BT * (256 + kGatedOutRowBytes) <= SX * kXChunkBytes,
                "the gated output is staged in the activation stages, after consumer 1's sums");
  static_assert(!ROPE || (!GATED && BT * kRopeRowFloats * 4 <= kCosSin), "ROPE stages its sums in both rings");
};

// The most weight stages (an even number) that fit beside token tile BT's activation ring (at most 24).
template <int BT, bool ROPE = false>
constexpr int max_stages() {
  int stages = 24;
  while (Layout<BT, 8, false, ROPE>::kBytes + (stages - 8) * (kWChunkBytes + 16) > kSharedLimit) stages -= 2;
  return stages;
}

// The 256 consumer threads store a staged tile ([token][COLS bf16], ROW_BYTES apart) into y's rows
// from first_token on, in 16-byte pieces; tokens past num_tokens are skipped.
template <int BT, int COLS, int ROW_BYTES>
__device__ __forceinline__ void store_tile(const uint8_t* stage, __nv_bfloat16* y, const Params& p, int first_token) {
  constexpr int kPieces = COLS / 8;
#pragma unroll
  for (int i = threadIdx.x - 128; i < BT * kPieces; i += 256) {
    const int t = i / kPieces, piece = i % kPieces;
    if (first_token + t < p.num_tokens) {
      const uint4 v = *reinterpret_cast<const uint4*>(stage + t * ROW_BYTES + piece * 16);
      *reinterpret_cast<uint4*>(y + static_cast<int64_t>(first_token + t) * p.y_stride + piece * 8) = v;
    }
  }
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int m = 16; m > 0; m /= 2) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int m = 16; m > 0; m /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, m));
  return x;
}

// A warp's head vector (lane l: dims 4 l .. 4 l + 3) as e4m3 with one scale, as kv_cache.quantize
// does it: NaN as 0, clamped to +-3e38, scale = max(amax / 448, 1e-12) rounded up to a bfloat16
// value (the cache stores it as one).
__device__ __forceinline__ uint32_t quantize_e4m3(const float (&x)[4], float& scale) {
  float v[4], amax = 0.f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    v[k] = x[k] == x[k] ? fminf(fmaxf(x[k], -3.0e38f), 3.0e38f) : 0.f;  // (kv_cache.FINITE_MAX)
    amax = fmaxf(amax, fabsf(v[k]));
  }
  scale = fmaxf(__fdiv_rn(warp_max(amax), 448.f), 1e-12f);
  scale = __uint_as_float((__float_as_uint(scale) + 0xFFFFu) & 0xFFFF0000u);
  const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(make_float2(__fdiv_rn(v[0], scale), __fdiv_rn(v[1], scale)),
                                                          __NV_SATFINITE, __NV_E4M3);
  const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(make_float2(__fdiv_rn(v[2], scale), __fdiv_rn(v[3], scale)),
                                                          __NV_SATFINITE, __NV_E4M3);
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

// ROPE's producer warps 2-3 (64 threads), during the main loop: the tile's slots and positions, then
// the cos and sin rows (fp32) at each token's position, copied into shared memory with cp.async. A
// thread's copies are all in flight at once: loaded into registers one after another, the rows took
// a memory round trip each, longer than the main loop at every tile.
template <int BT>
__device__ __forceinline__ void stage_cos_sin(float* smem_cos_sin, int2* smem_slots, int64_t* smem_positions,
                                              const Params& p, const RopeParams& r, int first_token) {
  const int t64 = threadIdx.x - 64;
  for (int t = t64; t < BT; t += 64) {
    const bool valid = first_token + t < p.num_tokens;
    const int64_t slot = valid ? r.slot_mapping[first_token + t] : -1;
    // (block, offset): divided here, off the epilogue's path
    smem_slots[t] = slot < 0 ? make_int2(-1, 0) : make_int2(static_cast<int>(slot / r.block_size),
                                                             static_cast<int>(slot % r.block_size));
    smem_positions[t] = valid ? r.positions[first_token + t] : 0;  // (a padding token's rows: position 0's)
  }
  asm volatile("bar.sync 3, 64;\n" ::: "memory");
  // [token][cos 64 | sin 64] floats, in 16-byte pieces
  for (int i = t64; i < BT * 32; i += 64) {
    const int t = i / 32, piece = i % 32;
    const float* row = (piece < 16 ? r.cos_cache : r.sin_cache) + smem_positions[t] * 64 + 4 * (piece % 16);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(smem_cos_sin + t * 128 + 4 * piece)),
                 "l"(row)
                 : "memory");
  }
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}

// ROPE's epilogue, first part: consumer c holds head dims 64 c + [0, 64) for the tile's tokens
// (wgmma's layout); both stage their float sums [token][dim] for rope_tokens.
template <int BT>
__device__ __forceinline__ void stage_rope_sums(const float (&d)[BT / 2], float* tile, int consumer, int tid) {
  const int warp = tid / 32, lane = tid % 32;
  const int r0 = consumer * 64 + warp * 16 + lane / 4, c0 = 2 * (lane % 4);
#pragma unroll
  for (int j = 0; j < BT / 8; ++j) {
    const int t = 8 * j + c0;
    tile[t * kRopeRowFloats + r0] = d[4 * j];
    tile[(t + 1) * kRopeRowFloats + r0] = d[4 * j + 1];
    tile[t * kRopeRowFloats + r0 + 8] = d[4 * j + 2];
    tile[(t + 1) * kRopeRowFloats + r0 + 8] = d[4 * j + 3];
  }
}

__device__ __forceinline__ uint32_t bits(__nv_bfloat162 x) { return *reinterpret_cast<uint32_t*>(&x); }
__device__ __forceinline__ __nv_bfloat162 bf16x2(uint32_t x) { return *reinterpret_cast<__nv_bfloat162*>(&x); }

// ROPE's epilogue, second part, once the sums, cos/sin and slots are staged: all 12 warps of the CTA
// (the producers' too: at one CTA an SM, more warps hide more of its latencies) take every 12th token. Lane l
// holds dims 4 l .. 4 l + 3, whose RoPE partners are lane l ^ 16's. The arithmetic is ops.norm_rope's
// (Triton's), in bf16 pairs from the projection's rounding on: x = bf16(sum); normed = bf16(bf16(x
// rstd) w); with c, s = bf16(cos), bf16(sin), q/k = fma(x, c, -+bf16(x' s)) rounded once to bf16.
template <int BT>
__device__ __forceinline__ void rope_tokens(const float* tile, const float* smem_cos_sin, const int2* smem_slots,
                                            const Params& p, const RopeParams& r, int head, int first_token) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool is_q = head < r.num_q_heads, is_k = !is_q && head < r.num_q_heads + r.num_kv_heads;
  const int kv_head = is_k ? head - r.num_q_heads : head - r.num_q_heads - r.num_kv_heads;
  const __nv_bfloat16* norm = is_q ? r.q_norm : r.k_norm;
  uint2 weight = make_uint2(0, 0);
  if (norm != nullptr && (is_q || is_k)) weight = reinterpret_cast<const uint2*>(norm)[lane];
  const int rot = 4 * (lane % 16);  // the angle index of this lane's first dim (dims d and d + 64 share it)
  const __nv_bfloat162 sign = __floats2bfloat162_rn(lane < 16 ? -1.f : 1.f, lane < 16 ? -1.f : 1.f);
  for (int t = warp; t < BT; t += kThreads / 32) {
    const int token = first_token + t;
    if (token >= p.num_tokens) break;
    const float4 sums = *reinterpret_cast<const float4*>(tile + t * kRopeRowFloats + 4 * lane);
    __nv_bfloat162 x01 = __floats2bfloat162_rn(sums.x, sums.y), x23 = __floats2bfloat162_rn(sums.z, sums.w);
    if (is_q || is_k) {
      if (norm != nullptr) {
        const float2 f01 = __bfloat1622float2(x01), f23 = __bfloat1622float2(x23);
        const float rstd =
            rsqrtf(warp_sum(f01.x * f01.x + f01.y * f01.y + f23.x * f23.x + f23.y * f23.y) / 128.f + r.eps);
        x01 = __hmul2(__floats2bfloat162_rn(f01.x * rstd, f01.y * rstd), bf16x2(weight.x));
        x23 = __hmul2(__floats2bfloat162_rn(f23.x * rstd, f23.y * rstd), bf16x2(weight.y));
      }
      const float4 cos4 = *reinterpret_cast<const float4*>(smem_cos_sin + t * 128 + rot);
      const float4 sin4 = *reinterpret_cast<const float4*>(smem_cos_sin + t * 128 + 64 + rot);
      const __nv_bfloat162 p01 = bf16x2(__shfl_xor_sync(0xffffffffu, bits(x01), 16));
      const __nv_bfloat162 p23 = bf16x2(__shfl_xor_sync(0xffffffffu, bits(x23), 16));
      // first half: x1 cos - x2 sin; second: x2 cos + x1 sin (the sign exact in bf16)
      const __nv_bfloat162 ps01 = __hmul2(__hmul2(p01, __floats2bfloat162_rn(sin4.x, sin4.y)), sign);
      const __nv_bfloat162 ps23 = __hmul2(__hmul2(p23, __floats2bfloat162_rn(sin4.z, sin4.w)), sign);
      x01 = __hfma2(x01, __floats2bfloat162_rn(cos4.x, cos4.y), ps01);
      x23 = __hfma2(x23, __floats2bfloat162_rn(cos4.z, cos4.w), ps23);
    }
    const uint2 packed = make_uint2(bits(x01), bits(x23));
    *reinterpret_cast<uint2*>(p.y + static_cast<int64_t>(token) * p.y_stride + head * 128 + 4 * lane) = packed;
    const int2 slot = smem_slots[t];  // (block, offset in it); block -1: stored nowhere
    if (is_q || slot.x < 0) continue;
    const int64_t block = slot.x, offset = slot.y;
    // A key's and a value's vectors are each one row of the block (kv_cache.py); in the cache's elements:
    const int64_t row = block * r.block_stride + offset * (is_k ? r.k_slot_stride : r.v_slot_stride) +
                        kv_head * (is_k ? r.k_head_stride : r.v_head_stride);
    if (r.fp8) {
      const float2 f01 = __bfloat1622float2(x01), f23 = __bfloat1622float2(x23);
      const float x[4] = {f01.x, f01.y, f23.x, f23.y};
      float scale;
      const uint32_t e4m3 = quantize_e4m3(x, scale);
      reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(is_k ? r.k_cache : r.v_cache) + row)[lane] = e4m3;
      if (lane == 0) {
        (is_k ? r.k_scale : r.v_scale)[block * r.scale_block_stride + offset * r.scale_slot_stride +
                                       kv_head * r.scale_head_stride] = __float2bfloat16_rn(scale);  // (exact)
      }
    } else {
      reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(is_k ? r.k_cache : r.v_cache) + row)[lane] = packed;
    }
  }
}

template <int BT, int SW, bool GATED, bool ROPE>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_kernel(const __grid_constant__ CUtensorMap w_map, const __grid_constant__ CUtensorMap x_map, const Params p,
                const __grid_constant__ RopeParams rope) {
  using L = Layout<BT, SW, GATED, ROPE>;
  constexpr int SX = L::SX;
  // The weight ring's chunks are [64 rows x 64 k]; a ROPE CTA's chunk of K is two of them (2 i: the
  // head's dims 0-63, 2 i + 1: dims 64-127), so that consumer c still takes the ring's chunks c, c + 2, ...
  const int w_chunks = ROPE ? 2 * p.num_chunks : p.num_chunks;
  // Consecutive CTAs share a weight tile (its token tiles), so its rows come from DRAM once.
  const int row_tile = blockIdx.x / p.num_token_tiles;
  const int token_tile = blockIdx.x % p.num_token_tiles;
  extern __shared__ uint8_t shared_raw[];
  const uint32_t base = (smem_u32(shared_raw) + 1023) & ~1023u;  // swizzle atoms are 1024-byte aligned
  const uint32_t bars = base + L::kBars;
  auto w_full = [&](int s) { return bars + 8 * s; };
  auto w_empty = [&](int s) { return bars + 8 * SW + 8 * s; };
  auto x_full = [&](int s) { return bars + 16 * SW + 8 * s; };
  auto x_empty = [&](int s) { return bars + 16 * SW + 8 * SX + 8 * s; };
  auto w_smem = [&](int s) { return base + L::kW + s * kWChunkBytes; };
  auto x_smem = [&](int s) { return base + L::kX + s * L::kXChunkBytes; };

  if (threadIdx.x == 0) {
    for (int s = 0; s < SW; ++s) {
      mbar_init(w_full(s), 1);
      mbar_init(w_empty(s), 4);  // lane 0 of each warp of the consumer that took the chunk
    }
    for (int s = 0; s < SX; ++s) {
      mbar_init(x_full(s), 1);
      mbar_init(x_empty(s), ROPE ? 8 : 4);  // a ROPE CTA's x chunks go to both consumers
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  }
  __syncthreads();
  // The next kernel may launch now: it waits for this one (griddepcontrol.wait) before it reads y.
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

  if (threadIdx.x < 128) {  // the producer warpgroup: two threads issue the copies
    if (threadIdx.x == 0) {
      // Weights first, without waiting for the kernel ahead: they are no kernel's output.
      for (int i = 0; i < w_chunks; ++i) {
        const int s = i % SW;
        mbar_wait(w_empty(s), ((i / SW) & 1) ^ 1);  // a fresh barrier counts as released
        mbar_expect_tx(w_full(s), kWChunkBytes);
        if (ROPE) {
          tma_load_2d(w_smem(s), &w_map, (i / 2) * kChunk, row_tile * 2 * kRows + (i % 2) * kRows, w_full(s));
        } else if (GATED) {  // 32-row boxes: the swizzle follows the address, so two make one 64-row tile
          tma_load_2d(w_smem(s), &w_map, i * kChunk, row_tile * (kRows / 2), w_full(s));
          tma_load_2d(w_smem(s) + kWChunkBytes / 2, &w_map, i * kChunk, p.up_row0 + row_tile * (kRows / 2), w_full(s));
        } else {
          tma_load_2d(w_smem(s), &w_map, i * kChunk, row_tile * kRows, w_full(s));
        }
      }
    } else if (threadIdx.x == 32) {
      // x is the kernel ahead's output. Every write of this kernel follows this wait (the consumers
      // write after consuming x), so it also orders y after whatever the kernel ahead read.
      asm volatile("griddepcontrol.wait;\n" ::: "memory");
      for (int i = 0; i < p.num_chunks; ++i) {
        const int s = i % SX;
        mbar_wait(x_empty(s), ((i / SX) & 1) ^ 1);
        mbar_expect_tx(x_full(s), L::kXChunkBytes);
        tma_load_2d(x_smem(s), &x_map, i * kChunk, token_tile * BT, x_full(s));
      }
    } else if (ROPE && threadIdx.x >= 64) {
      // Step inputs, not the kernel ahead's output: read without waiting for it.
      uint8_t* smem = shared_raw + (base - smem_u32(shared_raw));
      stage_cos_sin<BT>(reinterpret_cast<float*>(smem + L::kCosSin), reinterpret_cast<int2*>(smem + L::kSlots),
                        reinterpret_cast<int64_t*>(smem + L::kPositions), p, rope, token_tile * BT);
    }
    if constexpr (ROPE) {
      // Every producer thread joins the epilogue once its copies are issued and the consumers' sums staged.
      __syncwarp();
      asm volatile("bar.sync 2, 384;\n" ::: "memory");
      uint8_t* smem = shared_raw + (base - smem_u32(shared_raw));
      rope_tokens<BT>(reinterpret_cast<const float*>(smem + L::kW), reinterpret_cast<const float*>(smem + L::kCosSin),
                      reinterpret_cast<const int2*>(smem + L::kSlots), p, rope, row_tile, token_tile * BT);
    }
    return;
  }

  // The two consumer warpgroups: each holds D [64 weight rows x BT tokens] of its chunks (consumer
  // c takes chunks c, c + 2, ...), so one's products run while the other waits for its own. Thread
  // rows r0 and r0 + 8, and in each group j of 8 columns, columns 8 j + 2 (lane % 4) + {0, 1}
  // (wgmma's accumulator layout).
  const int consumer = threadIdx.x / 128 - 1;
  const int tid = threadIdx.x % 128;
  const int warp = tid / 32, lane = tid % 32;
  float d[BT / 2];
#pragma unroll
  for (int i = 0; i < BT / 2; ++i) d[i] = 0.f;
  // Both operands K-major with the 128-byte swizzle: 8-row groups 1024 bytes apart.
  const uint64_t w_desc0 = smem_desc(w_smem(0), 16, 1024);
  const uint64_t x_desc0 = smem_desc(x_smem(0), 16, 1024);
  // Each chunk's products are waited for before the next chunk's are issued: with a chunk still in
  // flight across the loop's back edge, ptxas serializes every wgmma (warning C7514). The other
  // consumer's products fill that wait.
  for (int w = consumer; w < w_chunks; w += 2) {
    const int i = ROPE ? w / 2 : w;  // the chunk of K
    const int ws = w % SW, xs = i % SX;
    mbar_wait(w_full(ws), (w / SW) & 1);
    mbar_wait(x_full(xs), (i / SX) & 1);
    wgmma_fence();
    const uint64_t w_desc = w_desc0 + ws * (kWChunkBytes >> 4);
    const uint64_t x_desc = x_desc0 + xs * (L::kXChunkBytes >> 4);
#pragma unroll
    for (int k = 0; k < kChunk / 16; ++k) wgmma_bf16<BT>(d, w_desc + 2 * k, x_desc + 2 * k);  // 32 bytes of K a step
    wgmma_commit();
    wgmma_wait<0>();
    if (lane == 0) {  // the chunk's stages go back to the producers
      mbar_arrive(w_empty(ws));
      mbar_arrive(x_empty(xs));
    }
  }
  fence_registers(d);

  // Once both are done, every stage is free: consumer 1 leaves its sums in the activation ring (in
  // its own register order), consumer 0 adds them to its own and stages the tile transposed,
  // [token][row], in the weight ring; then both store it in 16-byte pieces along y's rows.
  uint8_t* smem = shared_raw + (base - smem_u32(shared_raw));
  float* partial = reinterpret_cast<float*>(smem + L::kX);
  uint8_t* out_stage = smem + L::kW;
  asm volatile("bar.sync 1, 256;\n" ::: "memory");
  if constexpr (ROPE) {
    stage_rope_sums<BT>(d, reinterpret_cast<float*>(smem + L::kW), consumer, tid);
    asm volatile("bar.sync 2, 384;\n" ::: "memory");  // with the producers: sums, cos/sin and slots staged
    rope_tokens<BT>(reinterpret_cast<const float*>(smem + L::kW), reinterpret_cast<const float*>(smem + L::kCosSin),
                    reinterpret_cast<const int2*>(smem + L::kSlots), p, rope, row_tile, token_tile * BT);
    return;
  }
  if (consumer == 1) {
#pragma unroll
    for (int j = 0; j < BT / 2; ++j) partial[j * 128 + tid] = d[j];
  }
  asm volatile("bar.sync 1, 256;\n" ::: "memory");
  const int first_token = token_tile * BT;
  if (GATED) {
    // Warp w + 2 holds, register for register, the up sums of the features whose gate sums warp w
    // holds. Consumer 0 leaves its sums beside consumer 1's (weight ring, activation ring), and all
    // 256 threads take the pairs in turn: silu(gate) * up, staged [token][feature] after consumer
    // 1's sums. (Two warps alone, each with its own pairs, made the epilogue the kernel's longest part.)
    float* own = reinterpret_cast<float*>(out_stage);
    uint8_t* gated_stage = smem + L::kX + BT * 256;
    if (consumer == 0) {
#pragma unroll
      for (int j = 0; j < BT / 2; ++j) own[j * 128 + tid] = d[j];
    }
    asm volatile("bar.sync 1, 256;\n" ::: "memory");
#pragma unroll 4
    for (int q = threadIdx.x - 128; q < BT * 32; q += 256) {
      const int j = q / 64, gate_tid = q % 64;  // a gate sum: register j of consumer thread gate_tid
      const int at = j * 128 + gate_tid;
      const float gate = own[at] + partial[at], up = own[at + 64] + partial[at + 64];
      const int gate_lane = gate_tid % 32;
      const int col = 8 * (j / 4) + 2 * (gate_lane % 4) + j % 2;
      const int row = (gate_tid / 32) * 16 + gate_lane / 4 + 8 * ((j / 2) % 2);
      reinterpret_cast<__nv_bfloat16*>(gated_stage + col * L::kGatedOutRowBytes)[row] =
          __float2bfloat16_rn(__fdividef(gate, 1.f + __expf(-gate)) * up);
    }
    asm volatile("bar.sync 1, 256;\n" ::: "memory");
    store_tile<BT, kRows / 2, L::kGatedOutRowBytes>(gated_stage, p.y + row_tile * (kRows / 2), p, first_token);
    return;
  }
  if (consumer == 0) {
#pragma unroll
    for (int j = 0; j < BT / 2; ++j) d[j] += partial[j * 128 + tid];
    const int r0 = warp * 16 + lane / 4;
    const int c0 = 2 * (lane % 4);
#pragma unroll
    for (int j = 0; j < BT / 8; ++j) {
      __nv_bfloat16* col = reinterpret_cast<__nv_bfloat16*>(out_stage + (8 * j + c0) * kOutRowBytes);
      __nv_bfloat16* next_col = reinterpret_cast<__nv_bfloat16*>(out_stage + (8 * j + c0 + 1) * kOutRowBytes);
      col[r0] = __float2bfloat16_rn(d[4 * j]);
      next_col[r0] = __float2bfloat16_rn(d[4 * j + 1]);
      col[r0 + 8] = __float2bfloat16_rn(d[4 * j + 2]);
      next_col[r0 + 8] = __float2bfloat16_rn(d[4 * j + 3]);
    }
  }
  asm volatile("bar.sync 1, 256;\n" ::: "memory");
  store_tile<BT, kRows, kOutRowBytes>(out_stage, p.y + row_tile * kRows, p, first_token);
}

template <int BT, int SW, bool GATED, bool ROPE = false>
int launch(const CUtensorMap& w_map, const CUtensorMap& x_map, const Params& p, int grid, bool pdl, cudaStream_t stream,
           char* error, int error_len, const RopeParams& rope = RopeParams{}) {
  using L = Layout<BT, SW, GATED, ROPE>;
  static bool configured = false;
  if (!configured) {
    cudaError_t err =
        cudaFuncSetAttribute(gemm_kernel<BT, SW, GATED, ROPE>, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kBytes);
    if (err != cudaSuccess) {
      snprintf(error, error_len, "cudaFuncSetAttribute: %s", cudaGetErrorString(err));
      return 1;
    }
    configured = true;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = L::kBytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl ? 1 : 0;
  cudaError_t err = cudaLaunchKernelEx(&config, gemm_kernel<BT, SW, GATED, ROPE>, w_map, x_map, p, rope);
  if (err != cudaSuccess) {
    snprintf(error, error_len, "launch: %s", cudaGetErrorString(err));
    return 1;
  }
  return 0;
}

}  // namespace

// y [num_tokens, n] = x [num_tokens, k] w [n, k]^T, bf16, unit stride along each row, strides in
// elements (rows 16-byte aligned); n and k multiples of 64, token_tile a multiple of 16 from 16 to
// 256; with many_stages, as many weight stages as fit (else 8). silu_mul: w is gate | up (n / 2
// rows each) and y [num_tokens, n / 2] = silu(x gate^T) * (x up^T). pdl: launched as a programmatic
// dependent of the kernel ahead. Returns 0, or 1 with a message in error.
extern "C" int minivllm_hopper_gemm(void* y, int64_t y_stride, const void* x, int64_t x_stride, const void* w,
                                    int64_t w_stride, int num_tokens, int n, int k, int token_tile, int many_stages,
                                    int silu_mul, int pdl, void* stream, char* error, int error_len) {
  if (n % kRows != 0 || k % kChunk != 0 || num_tokens < 1) {
    snprintf(error, error_len, "n and k must be multiples of 64 and num_tokens positive, got n %d k %d tokens %d", n, k,
             num_tokens);
    return 1;
  }
  if (token_tile % 16 != 0 || token_tile < 16 || token_tile > 256) {
    snprintf(error, error_len, "token_tile must be a multiple of 16 from 16 to 256, got %d", token_tile);
    return 1;
  }
  CUtensorMap w_map, x_map;
  if (!encode_bf16_rows_map(&w_map, w, n, k, w_stride, silu_mul ? kRows / 2 : kRows, error, error_len) ||
      !encode_bf16_rows_map(&x_map, x, num_tokens, k, x_stride, token_tile, error, error_len))
    return 1;
  const int num_token_tiles = (num_tokens + token_tile - 1) / token_tile;
  const Params p{static_cast<__nv_bfloat16*>(y), y_stride, num_tokens, k / kChunk, num_token_tiles, n / 2};
  const int grid = (n / kRows) * num_token_tiles;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
#define MINIVLLM_LAUNCH(BT, SW)                                                              \
  (silu_mul ? launch<BT, SW, true>(w_map, x_map, p, grid, pdl, s, error, error_len) \
            : launch<BT, SW, false>(w_map, x_map, p, grid, pdl, s, error, error_len))
#define MINIVLLM_TOKEN_TILE(BT) \
  case BT:                      \
    return many_stages ? MINIVLLM_LAUNCH(BT, max_stages<BT>()) : MINIVLLM_LAUNCH(BT, kFewStages);
  switch (token_tile) {
    MINIVLLM_TOKEN_TILE(16) MINIVLLM_TOKEN_TILE(32) MINIVLLM_TOKEN_TILE(48) MINIVLLM_TOKEN_TILE(64)
    MINIVLLM_TOKEN_TILE(80) MINIVLLM_TOKEN_TILE(96) MINIVLLM_TOKEN_TILE(112) MINIVLLM_TOKEN_TILE(128)
    MINIVLLM_TOKEN_TILE(144) MINIVLLM_TOKEN_TILE(160) MINIVLLM_TOKEN_TILE(176) MINIVLLM_TOKEN_TILE(192)
    MINIVLLM_TOKEN_TILE(208) MINIVLLM_TOKEN_TILE(224) MINIVLLM_TOKEN_TILE(240) MINIVLLM_TOKEN_TILE(256)
  }
#undef MINIVLLM_TOKEN_TILE
#undef MINIVLLM_LAUNCH
  return 1;  // (unreachable: the tile was checked)
}

constexpr int kMaxRopeTile = 128;  // (wider tiles' cos/sin leave too little shared memory for the rings)

// An attention layer's qkv projection with its epilogue (ROPE above): y [num_tokens, n] = x w^T with
// n = (num_q_heads + 2 num_kv_heads) x 128, q and k normed and rotated in y, k and v stored in the
// cache (rope's pointers and strides). token_tile: a multiple of 16 up to kMaxRopeTile; as many weight
// stages as fit. Returns 0, or 1 with a message in error.
extern "C" int minivllm_hopper_gemm_rope(void* y, int64_t y_stride, const void* x, int64_t x_stride, const void* w,
                                         int64_t w_stride, int num_tokens, int n, int k, int token_tile,
                                         const RopeParams* rope, int pdl, void* stream, char* error, int error_len) {
  if (k % kChunk != 0 || num_tokens < 1 || n != (rope->num_q_heads + 2 * rope->num_kv_heads) * 2 * kRows) {
    snprintf(error, error_len, "k must be a multiple of 64, num_tokens positive and n (%d) (q heads + 2 kv heads) x 128 "
             "(%d q, %d kv heads), got k %d tokens %d", n, rope->num_q_heads, rope->num_kv_heads, k, num_tokens);
    return 1;
  }
  if (token_tile % 16 != 0 || token_tile < 16 || token_tile > kMaxRopeTile) {
    snprintf(error, error_len, "token_tile must be a multiple of 16 from 16 to %d, got %d", kMaxRopeTile, token_tile);
    return 1;
  }
  CUtensorMap w_map, x_map;
  if (!encode_bf16_rows_map(&w_map, w, n, k, w_stride, kRows, error, error_len) ||
      !encode_bf16_rows_map(&x_map, x, num_tokens, k, x_stride, token_tile, error, error_len))
    return 1;
  const int num_token_tiles = (num_tokens + token_tile - 1) / token_tile;
  const Params p{static_cast<__nv_bfloat16*>(y), y_stride, num_tokens, k / kChunk, num_token_tiles, 0};
  const int grid = (n / (2 * kRows)) * num_token_tiles;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
#define MINIVLLM_TOKEN_TILE(BT) \
  case BT:                      \
    return launch<BT, max_stages<BT, true>(), false, true>(w_map, x_map, p, grid, pdl, s, error, error_len, *rope);
  switch (token_tile) {
    MINIVLLM_TOKEN_TILE(16) MINIVLLM_TOKEN_TILE(32) MINIVLLM_TOKEN_TILE(48) MINIVLLM_TOKEN_TILE(64)
    MINIVLLM_TOKEN_TILE(80) MINIVLLM_TOKEN_TILE(96) MINIVLLM_TOKEN_TILE(112) MINIVLLM_TOKEN_TILE(128)
  }
#undef MINIVLLM_TOKEN_TILE
  return 1;  // (unreachable: the tile was checked)
}
