// Probe (benchmarks/kernel_boundary_probe.py): what a kernel boundary costs in a decode step's chain of
// short kernels, against a grid-wide barrier inside one persistent kernel, and how long the chain's
// data movement takes without any arithmetic.
//
// A "phase" stands for one decode projection without its products. Its first `ctas` CTAs, in
// row_tiles x token tiles as a projection's tiling has them, each
//   - stream w_words 16-byte words of their row tile's weights (bytes no kernel writes, so they may be
//     read before the phase ahead is done; from DRAM, every phase having its own), and
//   - after the phase ahead is done, stream x_words words of their token tile's activations (a
//     buffer every phase reads, so L2 serves it, as it serves a projection's x);
// then every CTA does the dependent part: one word read from what another CTA wrote in the phase
// ahead, one word written for the phase after.
//
//   chain: a kernel per phase. With PDL each kernel lets the next launch at its start
//          (griddepcontrol.launch_dependents) and waits for the one ahead (griddepcontrol.wait)
//          before its x and its dependent part, as worker/hopper_gemm.cu does; weights_first streams
//          the weights before that wait, else after it.
//   persistent: one kernel, `grid` CTAs (one an SM), walking every phase. A phase's x and dependent
//          part wait on a counter that each CTA raises (release) once its part of the phase ahead is
//          written.
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

struct Phase {  // kernel_boundary_probe.py's PHASE mirrors this
  const uint4* weights;  // [row_tiles * w_words]
  int64_t w_words;       // per CTA
  const uint4* x;        // [ctas / row_tiles * x_words]
  int64_t x_words;       // per CTA
  int64_t ctas;          // the CTAs that stream; the rest do the dependent part only
  int64_t row_tiles;     // CTA c copies row tile c % row_tiles and token tile c / row_tiles
};

namespace {

// The loads' xor is compared with this, so that they stay (a hit would store to a sink, harmlessly).
constexpr uint32_t kNever = 0x9e3779b9u;

__device__ __forceinline__ uint32_t stream_words(const uint4* w, int64_t words) {
  uint32_t acc = 0;
#pragma unroll 4
  for (int64_t i = threadIdx.x; i < words; i += blockDim.x) {
    const uint4 v = __ldcg(w + i);  // through L2 only, as TMA copies go
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  return acc;
}

__device__ __forceinline__ uint32_t phase_weights(const Phase& phase) {
  if (blockIdx.x >= phase.ctas) return 0u;
  return stream_words(phase.weights + (blockIdx.x % phase.row_tiles) * phase.w_words, phase.w_words);
}

// Everything after the wait: the activations, then the one dependent word.
__device__ __forceinline__ void after_wait(const Phase& phase, uint32_t acc, const uint32_t* in, uint32_t* out,
                                           uint32_t* sink) {
  if (blockIdx.x < phase.ctas) {
    acc ^= stream_words(phase.x + (blockIdx.x / phase.row_tiles) * phase.x_words, phase.x_words);
  }
  if (acc == kNever) *sink = acc;
  if (threadIdx.x == 0) {
    const uint32_t v = *reinterpret_cast<const volatile uint32_t*>(in + (blockIdx.x + 1) % gridDim.x);
    out[blockIdx.x] = v + 1;
  }
}

__global__ void chain_phase(Phase phase, const uint32_t* in, uint32_t* out, uint32_t* sink, int weights_first) {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  uint32_t acc = weights_first ? phase_weights(phase) : 0u;
  asm volatile("griddepcontrol.wait;\n" ::: "memory");  // a no-op when launched without PDL
  if (!weights_first) acc = phase_weights(phase);
  after_wait(phase, acc, in, out, sink);
}

__global__ void persistent_phases(const Phase* phases, int num_phases, uint32_t* bufs, unsigned* arrived,
                                  uint32_t* sink, int weights_first) {
  for (int p = 0; p < num_phases; ++p) {
    const Phase phase = phases[p];
    uint32_t acc = weights_first ? phase_weights(phase) : 0u;
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
    if (!weights_first) acc = phase_weights(phase);
    after_wait(phase, acc, bufs + size_t(p) * gridDim.x, bufs + size_t(p + 1) * gridDim.x, sink);
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

// phases: [num_phases] in host memory. bufs: [num_phases + 1, grid].
extern "C" int probe_chain(const Phase* phases, int num_phases, uint32_t* bufs, uint32_t* sink, int grid,
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
    cudaError_t err = cudaLaunchKernelEx(&config, chain_phase, phases[p], bufs + size_t(p) * grid,
                                         bufs + size_t(p + 1) * grid, sink, weights_first);
    if (report(err, "chain launch", error, error_len)) return 1;
  }
  return 0;
}

// phases: the same in device memory. arrived: one unsigned, zeroed here before the launch.
extern "C" int probe_persistent(const Phase* phases, int num_phases, uint32_t* bufs, unsigned* arrived,
                                uint32_t* sink, int grid, int threads, int smem, int weights_first, void* stream,
                                char* error, int error_len) {
  if (allow_smem(persistent_phases, smem, error, error_len)) return 1;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (report(cudaMemsetAsync(arrived, 0, sizeof(unsigned), s), "memset", error, error_len)) return 1;
  persistent_phases<<<grid, threads, smem, s>>>(phases, num_phases, bufs, arrived, sink, weights_first);
  return report(cudaGetLastError(), "persistent launch", error, error_len);
}
