// Decode attention on the CPU, read in place from the paged KV cache (worker/attention/cpu_decode.py
// builds and calls it). A task per sequence: every query head against every key of the sequence, one
// pass over its keys for the scores, a softmax, one pass over its values.
// Nothing is gathered: the SDPA path copies every sequence's K/V out of the blocks each layer and
// runs a flash kernel whose per-(sequence, head) set-up outweighs a single query's work.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <vector>

// Loads as float32. A bfloat16 is the top half of a float32: widening is a shift, which the
// compiler vectorizes.
static inline float widen(const at::BFloat16* p, int64_t d) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[d]) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
static inline float widen(const at::Half* p, int64_t d) { return static_cast<float>(p[d]); }

template <typename scalar_t, int HEAD_DIM>
void paged_decode(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& rows,
                  const at::Tensor& seqs, double scale, at::Tensor& out) {
  const int64_t num_heads = query.size(1);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t n = rows.size(0);
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const scalar_t* k_ptr = key_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = value_cache.data_ptr<scalar_t>();
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* row_ptr = rows.data_ptr<int64_t>();
  const int64_t* seq_ptr = seqs.data_ptr<int64_t>();
  const int64_t bt_stride = block_tables.stride(0);
  const int64_t q_tok = query.stride(0), q_head = query.stride(1);
  const int64_t o_tok = out.stride(0), o_head = out.stride(1);
  const int64_t kc_block = key_cache.stride(0), kc_slot = key_cache.stride(1), kc_head = key_cache.stride(2);
  const int64_t vc_block = value_cache.stride(0), vc_slot = value_cache.stride(1), vc_head = value_cache.stride(2);
  const float fscale = static_cast<float>(scale);
  // One sequence per task, all its heads: a token's keys (and values) for every KV head lie side by
  // side in a block, so the task reads its blocks front to back.
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(num_heads * HEAD_DIM), acc(num_heads * HEAD_DIM), row_f(num_kv_heads * HEAD_DIM), scores;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = row_ptr[i], seq = seq_ptr[i];
      const int64_t len = lens[seq];
      const int32_t* table = bt + seq * bt_stride;
      if (len <= 0) {  // (a decode always has its own key; nothing to attend is zeros)
        for (int64_t h = 0; h < num_heads; ++h) std::fill_n(o_ptr + row * o_tok + h * o_head, HEAD_DIM, scalar_t(0));
        continue;
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        const scalar_t* src = q_ptr + row * q_tok + h * q_head;
        for (int d = 0; d < HEAD_DIM; ++d) q[h * HEAD_DIM + d] = widen(src, d) * fscale;  // scale folded in
      }
      scores.resize(num_heads * len);
      for (int64_t t = 0; t < len; ++t) {  // scores[h, t] = q_h . k_t
        const scalar_t* k = k_ptr + table[t / block_size] * kc_block + (t % block_size) * kc_slot;
        for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh)
          for (int d = 0; d < HEAD_DIM; ++d) row_f[kvh * HEAD_DIM + d] = widen(k + kvh * kc_head, d);
        for (int64_t h = 0; h < num_heads; ++h) {
          const float* qh = q.data() + h * HEAD_DIM;
          const float* kh = row_f.data() + (h / group) * HEAD_DIM;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int d = 0; d < HEAD_DIM; ++d) s += qh[d] * kh[d];
          scores[h * len + t] = s;
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {  // softmax over t
        float* sc = scores.data() + h * len;
        float mx = sc[0];
#pragma omp simd reduction(max : mx)
        for (int64_t t = 1; t < len; ++t) mx = std::max(mx, sc[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
          sc[t] = std::exp(sc[t] - mx);  // (vectorized: built with -ffast-math, glibc's vector expf)
          sum += sc[t];
        }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t t = 0; t < len; ++t) sc[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {  // acc[h] += p[h, t] v_t
        const scalar_t* v = v_ptr + table[t / block_size] * vc_block + (t % block_size) * vc_slot;
        for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh)
          for (int d = 0; d < HEAD_DIM; ++d) row_f[kvh * HEAD_DIM + d] = widen(v + kvh * vc_head, d);
        for (int64_t h = 0; h < num_heads; ++h) {
          const float p = scores[h * len + t];
          const float* vh = row_f.data() + (h / group) * HEAD_DIM;
          float* ah = acc.data() + h * HEAD_DIM;
#pragma omp simd
          for (int d = 0; d < HEAD_DIM; ++d) ah[d] += p * vh[d];
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        scalar_t* o = o_ptr + row * o_tok + h * o_head;
        for (int d = 0; d < HEAD_DIM; ++d) o[d] = static_cast<scalar_t>(acc[h * HEAD_DIM + d]);
      }
    }
  });
}

template <typename scalar_t>
void dispatch_dim(const at::Tensor& query, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bt,
                  const at::Tensor& lens, const at::Tensor& rows, const at::Tensor& seqs, double scale,
                  at::Tensor& out) {
  switch (query.size(2)) {
    case 64: paged_decode<scalar_t, 64>(query, k, v, bt, lens, rows, seqs, scale, out); break;
    case 128: paged_decode<scalar_t, 128>(query, k, v, bt, lens, rows, seqs, scale, out); break;
    default: TORCH_CHECK(false, "paged_decode_attention: head_dim 64 or 128, not ", query.size(2));
  }
}

// Every index the tasks will follow, checked before any runs: a bad one is an error, not a crash.
static void check_indices(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& block_tables,
                          const at::Tensor& seq_lens, const at::Tensor& rows, const at::Tensor& seqs) {
  const int64_t* row_ptr = rows.data_ptr<int64_t>();
  const int64_t* seq_ptr = seqs.data_ptr<int64_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t block_size = key_cache.size(1), num_blocks = key_cache.size(0);
  for (int64_t i = 0; i < rows.numel(); ++i) {
    TORCH_CHECK(row_ptr[i] >= 0 && row_ptr[i] < query.size(0), "decode row ", row_ptr[i], " outside the query");
    TORCH_CHECK(seq_ptr[i] >= 0 && seq_ptr[i] < seq_lens.numel() && seq_ptr[i] < block_tables.size(0),
                "sequence ", seq_ptr[i], " outside seq_lens / block_tables");
    const int64_t len = lens[seq_ptr[i]];
    TORCH_CHECK(len <= block_tables.size(1) * block_size, "sequence ", seq_ptr[i], " has ", len,
                " keys, more than its block table holds");
    const int32_t* table = block_tables.data_ptr<int32_t>() + seq_ptr[i] * block_tables.stride(0);
    for (int64_t j = 0; j * block_size < len; ++j)
      TORCH_CHECK(table[j] >= 0 && table[j] < num_blocks, "block id ", table[j], " outside the cache");
  }
}

void paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& rows,
                            const at::Tensor& seqs, double scale, at::Tensor& out) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4 && out.sizes() == query.sizes(),
              "query and out [tokens, heads, dim], caches [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() && key_cache.size(3) == query.size(2),
              "keys and values of one shape, with the query's head_dim");
  TORCH_CHECK(key_cache.scalar_type() == query.scalar_type() && value_cache.scalar_type() == query.scalar_type() &&
              out.scalar_type() == query.scalar_type(), "query, caches and out share one dtype");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
              "head_dim must be contiguous");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "query heads must be a multiple of the KV heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1 &&
              seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(),
              "block_tables and seq_lens: int32, rows contiguous");
  TORCH_CHECK(rows.scalar_type() == at::kLong && seqs.scalar_type() == at::kLong && rows.is_contiguous() &&
              seqs.is_contiguous() && rows.numel() == seqs.numel(), "rows and seqs: int64, one per decode");
  check_indices(query, key_cache, block_tables, seq_lens, rows, seqs);
  const auto& k = key_cache;
  const auto& v = value_cache;
  switch (query.scalar_type()) {
    case at::kBFloat16: dispatch_dim<at::BFloat16>(query, k, v, block_tables, seq_lens, rows, seqs, scale, out); break;
    case at::kHalf: dispatch_dim<at::Half>(query, k, v, block_tables, seq_lens, rows, seqs, scale, out); break;
    default: TORCH_CHECK(false, "paged_decode_attention: bfloat16 or float16, not ", query.scalar_type());
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention);
}
