// Probe (benchmarks/kernel_boundary_probe.py): what a kernel boundary costs in a decode step's chain of
// short kernels, against a grid-wide barrier inside one persistent kernel.
//
// A "phase" stands for one decode projection without its arithmetic: every CTA streams its share of
// the phase's weights (bytes no kernel writes, so they may be read before the phase ahead is done),
// then does the dependent part, a read of what another CTA wrote in the phase ahead and a write for
// the phase after. The dependent part is a few words, so a chain of phases measures what ordering
// costs, and (with the projections' weight sizes) how near a chain of pure weight streams comes to
// the bytes' time.
//
//   chain: a kernel per phase. With PDL each kernel lets the next launch at its start
//          (griddepcontrol.launch_dependents) and waits for the one ahead (griddepcontrol.wait)
//          before the dependent part, as worker/hopper_gemm.cu does; weights_first streams its
//          weights before that wait.
//   persistent: one kernel, one CTA per SM, walking every phase. A phase's dependent part waits
//          on a counter that each CTA raises (release) when its part of the phase ahead is written.
//
// smem: dynamic shared memory each CTA asks for and leaves unused, so that as few CTAs fit an SM as
// fit beside the Hopper GEMM's (~200 KB a CTA): with none, a chain's next kernel can start on every SM
// while the one ahead still runs, which the GEMM's CTAs cannot.
//
// Each phase p writes bufs[p + 1][b] = bufs[p][(b + 1) % grid] + 1, so after P phases every word of
// bufs[P] is P if and only if no CTA read a word before it was written (the driver zeroes bufs first).

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

namespace {

// The loads' xor is compared with this, so that they stay (a hit would store to a sink, harmlessly).
constexpr uint32_t kNever = 0x9e3779b9u;

__device__ __forceinline__ uint32_t stream_weights(const uint4* w, int64_t words) {
  uint32_t acc = 0;
#pragma unroll 4
  for (int64_t i = threadIdx.x; i < words; i += blockDim.x) {
    const uint4 v = __ldcs(w + i);  // streamed: read once, not kept in L1
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  return acc;
}

__device__ __forceinline__ void dependent_part(const uint32_t* in, uint32_t* out) {
  if (threadIdx.x == 0) {
    const uint32_t v = *reinterpret_cast<const volatile uint32_t*>(in + (blockIdx.x + 1) % gridDim.x);
    out[blockIdx.x] = v + 1;
  }
}

__global__ void chain_phase(const uint4* weights, int64_t words_per_cta, const uint32_t* in, uint32_t* out,
                            uint32_t* sink, int weights_first) {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  const uint4* mine = weights + blockIdx.x * words_per_cta;
  uint32_t acc = weights_first ? stream_weights(mine, words_per_cta) : 0u;
  asm volatile("griddepcontrol.wait;\n" ::: "memory");  // a no-op when launched without PDL
  if (!weights_first) acc = stream_weights(mine, words_per_cta);
  if (acc == kNever) *sink = acc;  // keeps the loads
  dependent_part(in, out);
}

struct Phase {
  const uint4* weights;
  int64_t words_per_cta;
};

__global__ void persistent_phases(const Phase* phases, int num_phases, uint32_t* bufs, unsigned* arrived,
                                  uint32_t* sink, int weights_first) {
  for (int p = 0; p < num_phases; ++p) {
    const uint4* mine = phases[p].weights + blockIdx.x * phases[p].words_per_cta;
    uint32_t acc = weights_first ? stream_weights(mine, phases[p].words_per_cta) : 0u;
    if (p > 0) {  // every CTA's part of phase p - 1 written
      if (threadIdx.x == 0) {
        const unsigned target = unsigned(p) * gridDim.x;
        unsigned seen;
        do {
          asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(seen) : "l"(arrived) : "memory");
        } while (seen < target);
      }
      __syncthreads();
    }
    if (!weights_first) acc = stream_weights(mine, phases[p].words_per_cta);
    if (acc == kNever) *sink = acc;
    dependent_part(bufs + size_t(p) * gridDim.x, bufs + size_t(p + 1) * gridDim.x);
    __syncthreads();
    if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(arrived) : "memory");
  }
}

int report(cudaError_t err, const char* what, char* error, int error_len) {
  if (err == cudaSuccess) return 0;
  snprintf(error, error_len, "%s: %s", what, cudaGetErrorString(err));
  return 1;
}

template <typename Kernel>
int allow_smem(Kernel kernel, int smem, char* error, int error_len) {
  return report(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), "smem attribute",
                error, error_len);
}

}  // namespace

// phases: [num_phases] x (weights pointer, words per CTA), host memory. bufs: [num_phases + 1, grid].
extern "C" int probe_chain(const int64_t* phases, int num_phases, uint32_t* bufs, uint32_t* sink, int grid,
                           int threads, int smem, int pdl, int weights_first, void* stream, char* error,
                           int error_len) {
  if (allow_smem(chain_phase, smem, error, error_len)) return 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl ? 1 : 0;
  for (int p = 0; p < num_phases; ++p) {
    const uint4* weights = reinterpret_cast<const uint4*>(phases[2 * p]);
    cudaError_t err = cudaLaunchKernelEx(&config, chain_phase, weights, phases[2 * p + 1], bufs + size_t(p) * grid,
                                         bufs + size_t(p + 1) * grid, sink, weights_first);
    if (report(err, "chain launch", error, error_len)) return 1;
  }
  return 0;
}

// phases: the same pairs in device memory. arrived: one unsigned, zeroed here before the launch.
extern "C" int probe_persistent(const int64_t* phases, int num_phases, uint32_t* bufs, unsigned* arrived,
                                uint32_t* sink, int grid, int threads, int smem, int weights_first, void* stream,
                                char* error, int error_len) {
  if (allow_smem(persistent_phases, smem, error, error_len)) return 1;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (report(cudaMemsetAsync(arrived, 0, sizeof(unsigned), s), "memset", error, error_len)) return 1;
  persistent_phases<<<grid, threads, smem, s>>>(reinterpret_cast<const Phase*>(phases), num_phases, bufs, arrived,
                                               sink, weights_first);
  return report(cudaGetLastError(), "persistent launch", error, error_len);
}
