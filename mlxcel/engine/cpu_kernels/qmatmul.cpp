// mlxcel CPU kernel: x @ dequantize(w).T for MLX's affine-quantized weights (4 or 8 bits).
//
// MLX's CPU backend runs quantized matmuls through a generic loop that is several times
// slower than a float32 GEMV, so on the CPU decoding a quantized model used to need its
// weights dequantized to float32 (4 bytes a weight read per token). This primitive reads the
// packed weights (0.5 or 1 byte a weight plus the group scales and biases) and dequantizes
// them in registers. Each output row is computed with a fixed order of operations that does
// not depend on how many rows are in the batch, so a sequence gets bit-identical logits
// whether it decodes alone, in a batch, or in a speculative verify round.
//
// Built by mlxcel/engine/cpu_kernels/build.py against the installed mlx and nanobind.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>

#include <algorithm>
#include <cmath>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>  // SIMD intrinsics, and _mm_pause for the worker pool's spin
#endif

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;
namespace nb = nanobind;

namespace {

// A hint to bring the cache line holding p into every cache level (never faults).
inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }

// The same for every cache line of the `bytes` bytes from p (p on a line boundary).
inline void prefetch_lines(const void* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) prefetch(static_cast<const char*>(p) + line);
}

// ---------------------------------------------------------------------------------------
// Worker pool: splits the output rows of one matmul across the machine's cores. Tasks are
// tiny (tens of microseconds), so a job is cut into a few chunks per thread that any thread
// claims from one counter: the calling thread starts at once and takes every chunk no
// worker has claimed, so a worker still waking up (a sleeping thread takes tens of
// microseconds to run again) delays nothing; it joins for the chunks left. Workers spin
// briefly for the next job before sleeping.

class RowPool {
 public:
  static constexpr int64_t kMinParallelWork = int64_t{4} << 20;
  // Pauses a worker spins for the next job before it sleeps: a microsecond or two. The jobs
  // of one forward come tens of microseconds apart (the ops between them run on MLX's own
  // thread), and a worker spinning through those gaps takes the core the server's Python
  // threads need while the next step is built: 2000 pauses cost a batch-8 decode of a
  // 4-bit model about 15% of its throughput when served. The caller never waits for a
  // worker to wake (it takes every chunk no worker has claimed).
  static constexpr int kSpins = 100;
  // Chunks per thread a job is cut into.
  static constexpr int64_t kChunksPerThread = 4;

  static RowPool& instance() {
    static RowPool pool;
    return pool;
  }

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  void set_threads(int n) {
    stop();
    n = std::max(1, n);
    stop_flag_ = false;
    for (int i = 1; i < n; ++i) {
      // A new worker starts from the current job: earlier jobs are not its own.
      uint64_t now = counter_.load(std::memory_order_acquire) >> 32;
      workers_.emplace_back([this, now] { loop(now); });
    }
  }

  // Run fn(begin, end) over [0, total) in contiguous chunks (consecutive chunks share their
  // boundaries); `work` (multiply-adds) below `min_work`, or fewer than `min_total` units,
  // runs on the calling thread.
  void run(int64_t total, int64_t work, const std::function<void(int64_t, int64_t)>& fn,
           int64_t min_work = kMinParallelWork, int64_t min_total = 64) {
    // Two MLX CPU streams (two engines) may call in at once: one job at a time.
    std::lock_guard<std::mutex> run_lock(run_mutex_);
    int n = threads();
    if (n == 1 || total < min_total || work < min_work) {
      fn(0, total);
      return;
    }
    const int64_t chunks = std::min<int64_t>(total, n * kChunksPerThread);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &fn;
      total_ = total;
      chunks_.store(chunks, std::memory_order_relaxed);
      done_.store(0, std::memory_order_relaxed);
      const uint64_t job = (counter_.load(std::memory_order_relaxed) >> 32) + 1;
      counter_.store(job << 32, std::memory_order_release);  // chunk 0 of the new job
    }
    cv_.notify_all();
    const uint64_t job = counter_.load(std::memory_order_relaxed) >> 32;
    work_on(job);
    while (done_.load(std::memory_order_acquire) != chunks) {
#if defined(__x86_64__)
      _mm_pause();
#endif
    }
  }

  ~RowPool() { stop(); }

 private:
  RowPool() { set_threads(1); }

  // Claim and run chunks of `job` until none is left (or a newer job has begun).
  void work_on(uint64_t job) {
    while (true) {
      uint64_t seen = counter_.load(std::memory_order_acquire);
      uint64_t index = 0;
      do {
        if ((seen >> 32) != job) return;
        index = seen & 0xFFFFFFFFu;
        if (static_cast<int64_t>(index) >= chunks_.load(std::memory_order_relaxed)) return;
      } while (!counter_.compare_exchange_weak(seen, seen + 1, std::memory_order_acq_rel,
                                               std::memory_order_acquire));
      // A claimed chunk belongs to the job the caller is still waiting on: its fields hold.
      const int64_t i = static_cast<int64_t>(index);
      const int64_t chunks = chunks_.load(std::memory_order_relaxed);
      const int64_t begin = total_ * i / chunks;
      const int64_t end = total_ * (i + 1) / chunks;
      if (begin < end) (*job_)(begin, end);
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  void loop(uint64_t seen) {
    while (true) {
      uint64_t job = seen;
      for (int spin = 0; spin < kSpins; ++spin) {
        job = counter_.load(std::memory_order_acquire) >> 32;
        if (job != seen || stop_flag_) break;
#if defined(__x86_64__)
        _mm_pause();
#endif
      }
      if (job == seen && !stop_flag_) {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] {
          return (counter_.load(std::memory_order_acquire) >> 32) != seen || stop_flag_;
        });
        job = counter_.load(std::memory_order_acquire) >> 32;
      }
      if (stop_flag_) return;
      seen = job;
      work_on(job);
    }
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_flag_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
  }

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::mutex run_mutex_;
  std::condition_variable cv_;
  // The current job (high 32 bits) and its next unclaimed chunk (low 32 bits).
  std::atomic<uint64_t> counter_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<bool> stop_flag_{false};
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t total_ = 0;
  std::atomic<int64_t> chunks_{0};  // read before a claim, so atomic
};

// ---------------------------------------------------------------------------------------
// Kernels. Layout (MLX affine quantization): w is [N, K * bits / 32] uint32 with the values
// of a row packed low bits first; scales and biases are [N, K / group_size] float32;
// w_real = scale * q + bias. x is [M, K] float32 (row-contiguous), out is [M, N].
//
// For 4 bits the kernel multiplies the low nibbles of each byte with the even entries of x
// and the high nibbles with the odd ones, so x is split once per call into
// (even, odd) halves per 32-value block. The bias term uses per-group sums of x.

// Storage on 64-byte boundaries (a cache line, one AVX-512 load) for the prepared x rows
// the kernels load over and over: a load that spans two lines costs two.
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64}));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};

template <typename T>
using LineVector = std::vector<T, CacheLineAllocator<T>>;

struct Prepared {
  LineVector<float> xs;    // [M, K] x reordered per 32-block: 16 even entries, 16 odd
  LineVector<float> xsum;  // [M, K / group_size] sums of x over each group
  // The int8 path (4-bit weights): x quantized per 32-block, in chunks of 4 blocks.
  LineVector<int8_t> xq;   // [M, chunks * 128]: the chunk's 4x16 even entries, then odd
  LineVector<float> dx;    // [M, chunks * 16]: each block's scale, repeated 4 times
  LineVector<float> qsum;  // [M, chunks * 16]: a quarter of each block's rounded-x sum, x4
};

// Whether 4-bit matmuls quantize x to int8 and use integer dot products (set_int8).
std::atomic<bool> g_int8{true};

// Fills `p` (a per-thread buffer: resizing keeps its capacity, so a decode step allocates
// nothing here).
void prepare(Prepared& p, const float* x, int64_t M, int64_t K, int group_size, int bits) {
  p.xs.resize(static_cast<size_t>(M * K));
  int64_t groups = K / group_size;
  p.xsum.resize(static_cast<size_t>(M * groups));
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    float* out = p.xs.data() + m * K;
    if (bits == 4) {
      for (int64_t b = 0; b < K; b += 32) {
        for (int j = 0; j < 16; ++j) {
          out[b + j] = xr[b + 2 * j];
          out[b + 16 + j] = xr[b + 2 * j + 1];
        }
      }
    } else {
      std::memcpy(out, xr, sizeof(float) * K);
    }
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.0f;
      for (int j = 0; j < group_size; ++j) s += xr[g * group_size + j];
      p.xsum[m * groups + g] = s;
    }
  }
}

// Per instruction set: a vector type Vec with zero/fma/set1/hsum, and block4/block8 that
// multiply one 32-value block of a weight row with up to MB rows of x, adding into acc[m].
#if defined(__AVX512F__)
#define MLXCEL_SIMD "avx512"
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vset1(float v) { return _mm512_set1_ps(v); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
constexpr int kWidth = 16;
inline float hsum(Vec v) { return _mm512_reduce_add_ps(v); }

template <int MB>
inline void block4(const uint8_t* wq, const float* xs, int64_t K, Vec* acc) {
  __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wq));
  __m128i mask = _mm_set1_epi8(0x0F);
  __m128i lo = _mm_and_si128(bytes, mask);
  __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  Vec wlo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo));
  Vec whi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
  for (int m = 0; m < MB; ++m) {
    const float* xm = xs + m * K;
    acc[m] = _mm512_fmadd_ps(wlo, _mm512_loadu_ps(xm), acc[m]);
    acc[m] = _mm512_fmadd_ps(whi, _mm512_loadu_ps(xm + 16), acc[m]);
  }
}

template <int MB>
inline void block8(const uint8_t* wq, const float* xs, int64_t K, Vec* acc) {
  Vec w0 = _mm512_cvtepi32_ps(
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wq))));
  Vec w1 = _mm512_cvtepi32_ps(
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wq + 16))));
  for (int m = 0; m < MB; ++m) {
    const float* xm = xs + m * K;
    acc[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xm), acc[m]);
    acc[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xm + 16), acc[m]);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
#define MLXCEL_SIMD "avx2"
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vset1(float v) { return _mm256_set1_ps(v); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
constexpr int kWidth = 8;
inline float hsum(Vec v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 shuf = _mm_movehdup_ps(lo);
  __m128 sums = _mm_add_ps(lo, shuf);
  shuf = _mm_movehl_ps(shuf, sums);
  return _mm_cvtss_f32(_mm_add_ss(sums, shuf));
}

inline Vec bytes8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }

template <int MB>
inline void dot32(Vec w0, Vec w1, Vec w2, Vec w3, const float* xs, int64_t K, Vec* acc) {
  for (int m = 0; m < MB; ++m) {
    const float* xm = xs + m * K;
    acc[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xm), acc[m]);
    acc[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xm + 8), acc[m]);
    acc[m] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xm + 16), acc[m]);
    acc[m] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xm + 24), acc[m]);
  }
}

template <int MB>
inline void block4(const uint8_t* wq, const float* xs, int64_t K, Vec* acc) {
  __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wq));
  __m128i mask = _mm_set1_epi8(0x0F);
  __m128i lo = _mm_and_si128(bytes, mask);
  __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  dot32<MB>(bytes8(lo), bytes8(_mm_srli_si128(lo, 8)), bytes8(hi), bytes8(_mm_srli_si128(hi, 8)),
            xs, K, acc);
}

template <int MB>
inline void block8(const uint8_t* wq, const float* xs, int64_t K, Vec* acc) {
  __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wq));
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wq + 16));
  dot32<MB>(bytes8(a), bytes8(_mm_srli_si128(a, 8)), bytes8(b), bytes8(_mm_srli_si128(b, 8)),
            xs, K, acc);
}
#else
// Portable fallback: scalar, with the same per-row order of operations.
#define MLXCEL_SIMD "scalar"
using Vec = float;
inline Vec vzero() { return 0.0f; }
inline Vec vfma(Vec a, Vec b, Vec c) { return a * b + c; }
inline Vec vset1(float v) { return v; }
inline Vec vload(const float* p) { return *p; }
constexpr int kWidth = 1;
inline float hsum(Vec v) { return v; }

template <int MB, int BITS>
inline void block(const uint8_t* wq, const float* xs, int64_t K, Vec* acc) {
  for (int m = 0; m < MB; ++m) {
    const float* xm = xs + m * K;
    float sum = acc[m];
    for (int j = 0; j < 16; ++j) {
      float lo = BITS == 4 ? static_cast<float>(wq[j] & 0x0F) : static_cast<float>(wq[j]);
      float hi = BITS == 4 ? static_cast<float>(wq[j] >> 4) : static_cast<float>(wq[16 + j]);
      sum += lo * xm[j] + hi * xm[16 + j];
    }
    acc[m] = sum;
  }
}

template <int MB>
inline void block4(const uint8_t* wq, const float* xs, int64_t K, Vec* acc) {
  block<MB, 4>(wq, xs, K, acc);
}

template <int MB>
inline void block8(const uint8_t* wq, const float* xs, int64_t K, Vec* acc) {
  block<MB, 8>(wq, xs, K, acc);
}
#endif

// MB rows of x (starting at m0) against weight rows [n_begin, n_end).
template <int MB, int BITS>
void rows_kernel(
    const uint8_t* w, const float* scales, const float* biases, const Prepared& p,
    int64_t m0, int64_t K, int64_t N, int group_size, float* out, int64_t n_begin,
    int64_t n_end) {
  const int64_t groups = K / group_size;
  const int64_t row_bytes = K * BITS / 8;
  const int blocks = group_size / 32;
  const float* xs = p.xs.data() + m0 * K;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    const float* sr = scales + n * groups;
    const float* br = biases + n * groups;
    Vec total[MB];
    for (int m = 0; m < MB; ++m) total[m] = vzero();
    for (int64_t g = 0; g < groups; ++g) {
      Vec gacc[MB];
      for (int m = 0; m < MB; ++m) gacc[m] = vzero();
      for (int b = 0; b < blocks; ++b) {
        int64_t k = g * group_size + b * 32;
        if (BITS == 4) {
          block4<MB>(wr + k / 2, xs + k, K, gacc);
        } else {
          block8<MB>(wr + k, xs + k, K, gacc);
        }
      }
      Vec s = vset1(sr[g]);
      for (int m = 0; m < MB; ++m) total[m] = vfma(s, gacc[m], total[m]);
    }
    for (int m = 0; m < MB; ++m) {
      const float* xsum = p.xsum.data() + (m0 + m) * groups;
      float bias = 0.0f;
      for (int64_t g = 0; g < groups; ++g) bias += br[g] * xsum[g];
      out[(m0 + m) * N + n] = hsum(total[m]) + bias;
    }
  }
}

// ---------------------------------------------------------------------------------------
// The int8 path for 4-bit weights (AVX-512 VNNI), as llama.cpp does with its Q8 activations:
// each 32-value block of x is quantized to int8 with its own scale (max |x| / 127, round to
// nearest), and a block's dot product with the weights' 4-bit values is an exact integer
// sum (vpdpbusd: unsigned weight nibbles times signed x bytes), scaled once by
// weight scale * x scale; the bias term uses the sums of the rounded x. The error against
// float32 is that of rounding x to 8 bits (tests/test_cpu_kernels.py bounds it). Each row
// is quantized and reduced on its own, so rows stay bit-identical alone or batched.

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define MLXCEL_INT8 "avx512-vnni"

inline int64_t int8_chunks(int64_t K) { return (K / 32 + 3) / 4; }

// One 32-value block of x rounded to int8 with the scale max|x| / 127 (to nearest, ties to
// even: the default mode, what lrintf does): its values as int32 lanes in qa (the first 16)
// and qc (the last 16), and the scale.
inline float round_block(const float* x, __m512i& qa, __m512i& qc) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const __m512 a = _mm512_loadu_ps(x);
  const __m512 c = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(
      _mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, c)));
  const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));
  qc = _mm512_cvtps_epi32(_mm512_mul_ps(c, inv));
  return amax / 127.0f;
}

void prepare_int8(Prepared& p, const float* x, int64_t M, int64_t K, int group_size) {
  (void)group_size;
  const int64_t chunks = int8_chunks(K);
  const int64_t blocks = K / 32;
  // Resizing keeps the buffers' capacity; only a padded last chunk needs zeros.
  p.xq.resize(static_cast<size_t>(M * chunks * 128));
  p.dx.resize(static_cast<size_t>(M * chunks * 16));
  p.qsum.resize(static_cast<size_t>(M * chunks * 16));
  // x[2j] and x[2j + 1] of a block's 32 values, as 16 int32 lanes each.
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    int8_t* q = p.xq.data() + m * chunks * 128;
    float* d = p.dx.data() + m * chunks * 16;
    float* qs = p.qsum.data() + m * chunks * 16;
    if (blocks % 4 != 0) {
      const int64_t tail = (blocks / 4) * 128;
      std::memset(q + tail, 0, 128);
      std::memset(d + (blocks / 4) * 16, 0, 16 * sizeof(float));
      std::memset(qs + (blocks / 4) * 16, 0, 16 * sizeof(float));
    }
    for (int64_t b = 0; b < blocks; ++b) {
      __m512i qa, qc;
      const float scale = round_block(xr + b * 32, qa, qc);
      const __m512i lo = _mm512_permutex2var_epi32(qa, even, qc);
      const __m512i hi = _mm512_permutex2var_epi32(qa, odd, qc);
      int8_t* at = q + (b / 4) * 128 + (b % 4) * 16;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(at), _mm512_cvtsepi32_epi8(lo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(at + 64), _mm512_cvtsepi32_epi8(hi));
      const int32_t qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(lo, hi));
      // The bias term uses the sum of the rounded x too (as llama.cpp's Q8_1 does): the
      // result is then exactly the dot product of the rounded x with the weights, whose
      // error is (x - rounded x) . w, not (x - rounded x) . (scale * q), many times larger.
      // Spread over the block's 4 lanes, it meets the group's bias in the same step.
      const int64_t lane = (b / 4) * 16 + (b % 4) * 4;
      for (int j = 0; j < 4; ++j) {
        d[lane + j] = scale;
        qs[lane + j] = 0.25f * scale * static_cast<float>(qsum);
      }
    }
  }
}

// What every step of the int8 kernel shares: shapes and the lane-to-scale map.
struct Int8Shape {
  int64_t groups, row_bytes, blocks, chunks;
  int per_group, scales_per_step;
  __m512i index;

  Int8Shape(int64_t K, int group_size)
      : groups(K / group_size), row_bytes(K / 2), blocks(K / 32), chunks(int8_chunks(K)),
        per_group(group_size / 32), scales_per_step(per_group >= 4 ? 1 : 4 / per_group) {
    // Lane l of a step belongs to block l / 4, whose scale is entry (l / 4) / per_group.
    alignas(64) int32_t lane_group[16];
    for (int l = 0; l < 16; ++l) lane_group[l] = (l / 4) / per_group;
    index = _mm512_load_si512(lane_group);
  }
};

// MB rows of x (starting at m0) against the NR 4-bit weight rows from n, 4 blocks
// (128 values, 64 weight bytes) per step. Several weight rows per pass share the loads of
// x; each (x row, weight row) pair gets the same operations in the same order whatever
// MB and NR are.
template <int MB, int NR>
inline void int8_tile(
    const uint8_t* w, const float* scales, const float* biases, const Prepared& p,
    const Int8Shape& sh, int64_t m0, int64_t N, float* out, int64_t n) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const int64_t chunks = sh.chunks;
  const int8_t* xq = p.xq.data() + m0 * chunks * 128;
  const float* dx = p.dx.data() + m0 * chunks * 16;
  const float* qsum = p.qsum.data() + m0 * chunks * 16;
  __m512 total[NR][MB];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m) total[r][m] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t in_step = std::min<int64_t>(4, sh.blocks - 4 * c);
    const __mmask64 wmask = in_step == 4 ? ~__mmask64{0} : (__mmask64{1} << (16 * in_step)) - 1;
    const int64_t g0 = (4 * c) / sh.per_group;
    const int64_t n_scales = std::min<int64_t>(sh.scales_per_step, sh.groups - g0);
    const __mmask8 smask = static_cast<__mmask8>((1u << n_scales) - 1);
    __m512i lo[NR], hi[NR];
    __m512 s[NR], bias[NR];
    for (int r = 0; r < NR; ++r) {
      const uint8_t* wr = w + (n + r) * sh.row_bytes + 64 * c;
      prefetch(wr + NR * sh.row_bytes);  // the next tile's rows, one tile ahead
      __m512i wq = _mm512_maskz_loadu_epi8(wmask, wr);
      lo[r] = _mm512_and_si512(wq, nibble);
      hi[r] = _mm512_and_si512(_mm512_srli_epi16(wq, 4), nibble);
      const float* sr = scales + (n + r) * sh.groups + g0;
      const float* br = biases + (n + r) * sh.groups + g0;
      s[r] = _mm512_permutexvar_ps(sh.index,
                                   _mm512_castps128_ps512(_mm_maskz_loadu_ps(smask, sr)));
      bias[r] = _mm512_permutexvar_ps(sh.index,
                                      _mm512_castps128_ps512(_mm_maskz_loadu_ps(smask, br)));
    }
    for (int m = 0; m < MB; ++m) {
      const int8_t* xm = xq + m * chunks * 128 + c * 128;
      const int64_t at = m * chunks * 16 + c * 16;
      const __m512i xlo = _mm512_loadu_si512(xm);
      const __m512i xhi = _mm512_loadu_si512(xm + 64);
      const __m512 d = _mm512_loadu_ps(dx + at);
      const __m512 q = _mm512_loadu_ps(qsum + at);
      for (int r = 0; r < NR; ++r) {
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[r], xlo);
        dot = _mm512_dpbusd_epi32(dot, hi[r], xhi);
        total[r][m] = _mm512_fmadd_ps(bias[r], q, total[r][m]);
        total[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s[r], d),
                                      total[r][m]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m) out[(m0 + m) * N + n + r] = _mm512_reduce_add_ps(total[r][m]);
}

template <int MB>
void rows_int8(
    const uint8_t* w, const float* scales, const float* biases, const Prepared& p,
    int64_t m0, int64_t K, int64_t N, int group_size, float* out, int64_t n_begin,
    int64_t n_end) {
  const Int8Shape sh(K, group_size);
  constexpr int NR = MB == 1 ? 4 : (MB == 2 ? 2 : 1);
  int64_t n = n_begin;
  for (; n + NR <= n_end; n += NR) {
    int8_tile<MB, NR>(w, scales, biases, p, sh, m0, N, out, n);
  }
  for (; n < n_end; ++n) int8_tile<MB, 1>(w, scales, biases, p, sh, m0, N, out, n);
}

void run_rows_int8(
    const uint8_t* w, const float* scales, const float* biases, const Prepared& p,
    int64_t M, int64_t K, int64_t N, int group_size, float* out, int64_t n_begin,
    int64_t n_end) {
  int64_t m0 = 0;
  for (; m0 + 4 <= M; m0 += 4) {
    rows_int8<4>(w, scales, biases, p, m0, K, N, group_size, out, n_begin, n_end);
  }
  switch (M - m0) {
    case 3:
      rows_int8<3>(w, scales, biases, p, m0, K, N, group_size, out, n_begin, n_end);
      break;
    case 2:
      rows_int8<2>(w, scales, biases, p, m0, K, N, group_size, out, n_begin, n_end);
      break;
    case 1:
      rows_int8<1>(w, scales, biases, p, m0, K, N, group_size, out, n_begin, n_end);
      break;
    default:
      break;
  }
}

// ---------------------------------------------------------------------------------------
// Packed 4-, 5- and 8-bit weights for the int8 path (layers.pack_int8 builds them once at
// load): 16 weight rows a tile, stored block by block (32 values of K). A 4-bit block holds 4 groups of 64 bytes: for each of the 16 rows, 4 bytes
// whose low nibbles are values k..k+3 and high nibbles k+4..k+7 of that group's 8; a
// 5-bit block holds its codes' low 4 bits the same way, then their fifth bits as 8 masks
// of 64 bits (per group, one for the low nibbles' values and one for the high nibbles',
// bit i for byte i of the group); an 8-bit block holds 8 groups of 64 bytes (16 rows x 4
// values). Then the 16 rows' block scales and biases as float16: 320 bytes a 4-bit block,
// 384 a 5-bit one, 576 an 8-bit one. Symmetric tiles (SYM: every bias is -2^(BITS-1) times
// its scale, as in GGUF's Q4_0, Q5_0 and Q8_0) hold the scales only (288, 352 or 544 bytes)
// and take each bias as scale * -2^(BITS-1), exact in float32, so they give the same
// results as the full tiles bit for bit. One integer
// dot product instruction multiplies 4 values of all 16 rows with the same 4 values of one
// x row (broadcast), so its 16 lanes are the 16 rows' partial dots: a block's integer dot
// per row is exact, then scaled once per block, and the tile's output row comes out of the
// lanes with no horizontal sums. Each (x row, weight row) pair gets the same operations in
// the same order whatever the number of x rows.

constexpr int64_t kRowTile = 16;
// How many blocks ahead the tile kernel prefetches (the stream continues into the next tile).
constexpr int64_t kTileAhead = 4;

template <int BITS, bool SYM>
constexpr int64_t row_block_bytes() {
  // 320 (4-bit), 384 (5-bit) or 576; 32 less for symmetric tiles (no biases)
  return kRowTile * 32 * BITS / 8 + (SYM ? 2 : 4) * kRowTile;
}

struct RowPrepared {
  LineVector<int8_t> xq;  // [M, K] x rounded to int8 per 32-block, natural order
  LineVector<float> dx;   // [M, K / 32] each block's scale
  LineVector<float> qs;   // [M, K / 32] each block's scale times its rounded sum
};

void prepare_rows(RowPrepared& p, const float* x, int64_t M, int64_t K) {
  const int64_t blocks = K / 32;
  p.xq.resize(static_cast<size_t>(M * K));
  p.dx.resize(static_cast<size_t>(M * blocks));
  p.qs.resize(static_cast<size_t>(M * blocks));
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    int8_t* q = p.xq.data() + m * K;
    for (int64_t b = 0; b < blocks; ++b) {
      __m512i qa, qc;
      const float scale = round_block(xr + b * 32, qa, qc);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * 32), _mm512_cvtsepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * 32 + 16), _mm512_cvtsepi32_epi8(qc));
      const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qc));
      p.dx[m * blocks + b] = scale;
      p.qs[m * blocks + b] = scale * static_cast<float>(sum);
    }
  }
}

inline __m512i bcast4(const int8_t* at) {
  int32_t v;
  std::memcpy(&v, at, sizeof(v));
  return _mm512_set1_epi32(v);
}

// One tile (16 weight rows from n) against MB rows of x from m0.
template <int BITS, int MB, bool SYM>
inline void row_tile(const uint8_t* tile, const RowPrepared& p, int64_t K, int64_t m0,
                     int64_t N, float* out, int64_t n) {
  const int64_t blocks = K / 32;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 total[MB];
  for (int m = 0; m < MB; ++m) total[m] = _mm512_setzero_ps();
  const int8_t* xq = p.xq.data() + m0 * K;
  const float* dx = p.dx.data() + m0 * blocks;
  const float* qs = p.qs.data() + m0 * blocks;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* at = tile + b * row_block_bytes<BITS, SYM>();
    // Every row count prefetches: a 1-row 262k x 640 8-bit LM head (Gemma 3, read from
    // memory) took 8.4-12.8 ms without, 6.4-7.6 with (paired runs, 2 threads).
    constexpr int64_t block_bytes = row_block_bytes<BITS, SYM>();
    prefetch_lines(at + kTileAhead * block_bytes, block_bytes);
    // With few x rows, the block's 8 dot-product instructions per row would form one
    // dependency chain (5 cycles each): split them over CH accumulators and add those
    // after. Integer sums are exact, so the result is the same bit for bit.
    constexpr int CH = MB == 1 ? 4 : (MB == 2 ? 2 : 1);
    __m512i part[MB][CH];
    for (int m = 0; m < MB; ++m)
      for (int c = 0; c < CH; ++c) part[m][c] = _mm512_setzero_si512();
    if constexpr (BITS == 4 || BITS == 5) {
      for (int g = 0; g < 4; ++g) {
        const __m512i w = _mm512_loadu_si512(at + 64 * g);
        __m512i lo = _mm512_and_si512(w, nibble);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);
        if constexpr (BITS == 5) {  // + 16 where the code's fifth bit is set
          uint64_t fifth[2];
          std::memcpy(fifth, at + 256 + 16 * g, sizeof(fifth));
          const __m512i sixteen = _mm512_set1_epi8(16);
          lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(fifth[0]), lo, sixteen);
          hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(fifth[1]), hi, sixteen);
        }
        for (int m = 0; m < MB; ++m) {
          const int8_t* xm = xq + m * K + b * 32 + 8 * g;
          __m512i& c0 = part[m][(2 * g) % CH];
          c0 = _mm512_dpbusd_epi32(c0, lo, bcast4(xm));
          __m512i& c1 = part[m][(2 * g + 1) % CH];
          c1 = _mm512_dpbusd_epi32(c1, hi, bcast4(xm + 4));
        }
      }
    } else {
      for (int g = 0; g < 8; ++g) {
        const __m512i w = _mm512_loadu_si512(at + 64 * g);
        for (int m = 0; m < MB; ++m) {
          __m512i& c = part[m][g % CH];
          c = _mm512_dpbusd_epi32(c, w, bcast4(xq + m * K + b * 32 + 4 * g));
        }
      }
    }
    __m512i dot[MB];
    for (int m = 0; m < MB; ++m) {
      dot[m] = part[m][0];
      for (int c = 1; c < CH; ++c) dot[m] = _mm512_add_epi32(dot[m], part[m][c]);
    }
    const uint8_t* sc = at + kRowTile * 32 * BITS / 8;
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc)));
    const __m512 bias =
        SYM ? _mm512_mul_ps(s, _mm512_set1_ps(-static_cast<float>(1 << (BITS - 1))))
            : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 32)));
    for (int m = 0; m < MB; ++m) {
      const __m512 d = _mm512_set1_ps(dx[m * blocks + b]);
      total[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m]), _mm512_mul_ps(s, d), total[m]);
      total[m] = _mm512_fmadd_ps(bias, _mm512_set1_ps(qs[m * blocks + b]), total[m]);
    }
  }
  const int64_t rows = std::min<int64_t>(kRowTile, N - n);
  const __mmask16 keep = rows >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << rows) - 1);
  for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(out + (m0 + m) * N + n, keep, total[m]);
}

template <int BITS, bool SYM>
void row_tiles(const uint8_t* packed, const RowPrepared& p, int64_t M, int64_t K, int64_t N,
               float* out, int64_t t_begin, int64_t t_end) {
  const int64_t tile_bytes = (K / 32) * row_block_bytes<BITS, SYM>();
  for (int64_t t = t_begin; t < t_end; ++t) {
    const uint8_t* tile = packed + t * tile_bytes;
    const int64_t n = t * kRowTile;
    int64_t m0 = 0;
    for (; m0 + 8 <= M; m0 += 8) row_tile<BITS, 8, SYM>(tile, p, K, m0, N, out, n);
    switch (M - m0) {
      case 7: row_tile<BITS, 7, SYM>(tile, p, K, m0, N, out, n); break;
      case 6: row_tile<BITS, 6, SYM>(tile, p, K, m0, N, out, n); break;
      case 5: row_tile<BITS, 5, SYM>(tile, p, K, m0, N, out, n); break;
      case 4: row_tile<BITS, 4, SYM>(tile, p, K, m0, N, out, n); break;
      case 3: row_tile<BITS, 3, SYM>(tile, p, K, m0, N, out, n); break;
      case 2: row_tile<BITS, 2, SYM>(tile, p, K, m0, N, out, n); break;
      case 1: row_tile<BITS, 1, SYM>(tile, p, K, m0, N, out, n); break;
      default: break;
    }
  }
}

template <bool SYM>
void packed_tiles(const uint8_t* packed, const RowPrepared& p, int64_t M, int64_t K, int64_t N,
                  float* out, int bits, int64_t t_begin, int64_t t_end) {
  if (bits == 4) {
    row_tiles<4, SYM>(packed, p, M, K, N, out, t_begin, t_end);
  } else if (bits == 5) {
    row_tiles<5, SYM>(packed, p, M, K, N, out, t_begin, t_end);
  } else {
    row_tiles<8, SYM>(packed, p, M, K, N, out, t_begin, t_end);
  }
}

void packed_matmul_rows(const float* x, const uint8_t* packed, float* out, int64_t M,
                        int64_t K, int64_t N, int bits, bool symmetric) {
  thread_local RowPrepared buffer;
  prepare_rows(buffer, x, M, K);
  const RowPrepared& p = buffer;
  const int64_t tiles = (N + kRowTile - 1) / kRowTile;
  RowPool::instance().run(tiles * kRowTile, M * N * K, [&](int64_t begin, int64_t end) {
    if (symmetric) {
      packed_tiles<true>(packed, p, M, K, N, out, bits, begin / kRowTile, end / kRowTile);
    } else {
      packed_tiles<false>(packed, p, M, K, N, out, bits, begin / kRowTile, end / kRowTile);
    }
  });
}
#define MLXCEL_PACKED 1
#else
#define MLXCEL_INT8 ""
#define MLXCEL_PACKED 0
#endif

template <int BITS>
void run_rows(
    const uint8_t* w, const float* scales, const float* biases, const Prepared& p,
    int64_t M, int64_t K, int64_t N, int group_size, float* out, int64_t n_begin,
    int64_t n_end) {
  int64_t m0 = 0;
  for (; m0 + 4 <= M; m0 += 4) {
    rows_kernel<4, BITS>(w, scales, biases, p, m0, K, N, group_size, out, n_begin, n_end);
  }
  switch (M - m0) {
    case 3:
      rows_kernel<3, BITS>(w, scales, biases, p, m0, K, N, group_size, out, n_begin, n_end);
      break;
    case 2:
      rows_kernel<2, BITS>(w, scales, biases, p, m0, K, N, group_size, out, n_begin, n_end);
      break;
    case 1:
      rows_kernel<1, BITS>(w, scales, biases, p, m0, K, N, group_size, out, n_begin, n_end);
      break;
    default:
      break;
  }
}

void qmatmul(
    const float* x, const uint32_t* w, const float* scales, const float* biases, float* out,
    int64_t M, int64_t K, int64_t N, int group_size, int bits) {
  // Per calling thread; `p` (a reference, unlike the thread_local itself) is what the
  // pool's workers read.
  thread_local Prepared buffer;
  Prepared& p = buffer;
  const uint8_t* wb = reinterpret_cast<const uint8_t*>(w);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  // 8-bit weights stay on the float path: an int8 version (two 64-byte dot products per
  // step) measured slower on SmolLM2's 8-bit LM head (5.7 vs 3.8 ms a token, one thread).
  if (bits == 4 && g_int8.load(std::memory_order_relaxed)) {
    prepare_int8(p, x, M, K, group_size);
    RowPool::instance().run(N, M * N * K, [&](int64_t begin, int64_t end) {
      run_rows_int8(wb, scales, biases, p, M, K, N, group_size, out, begin, end);
    });
    return;
  }
#endif
  prepare(p, x, M, K, group_size, bits);
  RowPool::instance().run(N, M * N * K, [&](int64_t begin, int64_t end) {
    if (bits == 4) {
      run_rows<4>(wb, scales, biases, p, M, K, N, group_size, out, begin, end);
    } else {
      run_rows<8>(wb, scales, biases, p, M, K, N, group_size, out, begin, end);
    }
  });
}

// ---------------------------------------------------------------------------------------
// Float32 weights, few rows (batched decode of a float model). A BLAS GEMM packs the whole
// weight matrix on every call, which for a handful of rows costs more than the arithmetic;
// here each weight row is read once per call and multiplied with every row of x. K must be a
// multiple of kWidth. Every (x row, weight row) pair is summed in the same order whatever
// the number of rows, as in the quantized kernels.

// x rows at a 64-byte boundary: MLX's buffers start 8 bytes past one, so each 64-byte
// load of an x row, repeated for every weight row, would span two cache lines.
const float* line_aligned(const float* x, int64_t n, LineVector<float>& copy) {
  if (reinterpret_cast<uintptr_t>(x) % 64 == 0) return x;
  copy.assign(x, x + n);
  return copy.data();
}

template <int MB, int NR>
inline void f32_tile(const float* w, const float* x, int64_t m0, int64_t K, int64_t N,
                     float* out, int64_t n) {
  Vec acc[NR][MB];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = vzero();
  for (int64_t k = 0; k < K; k += kWidth) {
    Vec wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = vload(w + (n + r) * K + k);
    // The next tile's rows, one tile ahead: a few interleaved streams the hardware
    // prefetcher alone keeps poorly fed once several x rows share each weight load.
    for (int r = 0; r < NR; ++r) prefetch(w + (n + NR + r) * K + k);
    for (int m = 0; m < MB; ++m) {
      const Vec xv = vload(x + (m0 + m) * K + k);
      for (int r = 0; r < NR; ++r) acc[r][m] = vfma(wv[r], xv, acc[r][m]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m) out[(m0 + m) * N + n + r] = hsum(acc[r][m]);
}

template <int MB>
void f32_rows(const float* w, const float* x, int64_t m0, int64_t K, int64_t N, float* out,
              int64_t n_begin, int64_t n_end) {
  // About 24 accumulators (of 32 AVX-512 registers): fewer loads per multiply-add.
  constexpr int NR = MB <= 2 ? 8 : (MB <= 4 ? 6 : (MB <= 6 ? 4 : 3));
  int64_t n = n_begin;
  for (; n + NR <= n_end; n += NR) f32_tile<MB, NR>(w, x, m0, K, N, out, n);
  for (; n < n_end; ++n) f32_tile<MB, 1>(w, x, m0, K, N, out, n);
}

void f32_matmul(const float* x, const float* w, float* out, int64_t M, int64_t K, int64_t N) {
  thread_local LineVector<float> x_copy;
  x = line_aligned(x, M * K, x_copy);
  RowPool::instance().run(N, M * N * K, [&](int64_t begin, int64_t end) {
    int64_t m0 = 0;
    for (; m0 + 8 <= M; m0 += 8) f32_rows<8>(w, x, m0, K, N, out, begin, end);
    switch (M - m0) {
      case 7: f32_rows<7>(w, x, m0, K, N, out, begin, end); break;
      case 6: f32_rows<6>(w, x, m0, K, N, out, begin, end); break;
      case 5: f32_rows<5>(w, x, m0, K, N, out, begin, end); break;
      case 4: f32_rows<4>(w, x, m0, K, N, out, begin, end); break;
      case 3: f32_rows<3>(w, x, m0, K, N, out, begin, end); break;
      case 2: f32_rows<2>(w, x, m0, K, N, out, begin, end); break;
      case 1: f32_rows<1>(w, x, m0, K, N, out, begin, end); break;
      default: break;
    }
  });
}

// ---------------------------------------------------------------------------------------
// The MLX primitive and op.

// A 4-byte-element input as the dispatched task sees it: its data pointer, and its shape
// and strides when it is not row-contiguous.
struct Operand {
  const uint32_t* data;
  bool row_contiguous;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;

  static Operand of(const mx::array& a) {
    Operand o{a.data<uint32_t>(), a.flags().row_contiguous, {}, {}};
    if (!o.row_contiguous) {
      for (int d = 0; d < a.ndim(); ++d) {
        o.shape.push_back(a.shape(d));
        o.strides.push_back(a.strides()[d]);
      }
    }
    return o;
  }

  const void* contiguous(std::vector<uint32_t>& tmp) const {
    if (row_contiguous) return data;
    int64_t size = 1;
    for (auto d : shape) size *= d;
    tmp.resize(static_cast<size_t>(size));
    const int64_t nd = static_cast<int64_t>(shape.size());
    if (nd == 0) {
      tmp[0] = data[0];
      return tmp.data();
    }
    // Row by row along the last axis (one memcpy where it is contiguous, as a transposed
    // [B, L, H, D] -> [B, H, L, D] view is): element by element cost a sixth of Gemma 3's
    // prefill in the norms of its q and k heads.
    const int64_t inner = shape[static_cast<size_t>(nd - 1)];
    const int64_t step = strides[static_cast<size_t>(nd - 1)];
    std::vector<int64_t> index(static_cast<size_t>(nd), 0);
    for (int64_t i = 0; i < size; i += inner) {
      int64_t offset = 0;
      for (int64_t d = 0; d + 1 < nd; ++d) offset += index[d] * strides[d];
      uint32_t* dst = tmp.data() + i;
      const uint32_t* src = data + offset;
      if (step == 1) {
        std::memcpy(dst, src, static_cast<size_t>(inner) * sizeof(uint32_t));
      } else {
        for (int64_t j = 0; j < inner; ++j) dst[j] = src[j * step];
      }
      for (int64_t d = nd - 2; d >= 0; --d) {
        if (++index[d] < shape[d]) break;
        index[d] = 0;
      }
    }
    return tmp.data();
  }
};

class CpuQuantizedMatmul : public mx::Primitive {
 public:
  CpuQuantizedMatmul(mx::Stream stream, int group_size, int bits)
      : mx::Primitive(stream), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    const mx::array& x = inputs[0];
    int64_t K = x.shape(-1);
    int64_t M = K == 0 ? 0 : static_cast<int64_t>(x.size()) / K;
    int64_t N = out.shape(-1);
    std::array<Operand, 4> ops;
    for (size_t i = 0; i < ops.size(); ++i) {
      encoder.set_input_array(inputs[i]);
      ops[i] = Operand::of(inputs[i]);
    }
    encoder.set_output_array(out);
    encoder.dispatch([ops = std::move(ops), op = out.data<float>(), M, K, N,
                      gs = group_size_, bits = bits_]() {
      // Inputs are usually row-contiguous (x: the previous op's output; weights: packed
      // at load); any that is not is gathered into a temporary first.
      std::vector<uint32_t> tmp[4];
      const void* p[4];
      for (int i = 0; i < 4; ++i) p[i] = ops[i].contiguous(tmp[i]);
      qmatmul(static_cast<const float*>(p[0]), static_cast<const uint32_t*>(p[1]),
              static_cast<const float*>(p[2]), static_cast<const float*>(p[3]), op, M, K, N,
              gs, bits);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlxcel's quantized matmul kernel runs on the CPU only");
  }

  const char* name() const override { return "MlxcelCpuQuantizedMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const CpuQuantizedMatmul*>(&other);
    return o != nullptr && o->group_size_ == group_size_ && o->bits_ == bits_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

 private:
  int group_size_;
  int bits_;
};

class CpuDenseMatmul : public mx::Primitive {
 public:
  explicit CpuDenseMatmul(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    int64_t K = inputs[0].shape(-1);
    int64_t M = K == 0 ? 0 : static_cast<int64_t>(inputs[0].size()) / K;
    int64_t N = out.shape(-1);
    std::array<Operand, 2> ops;
    for (size_t i = 0; i < ops.size(); ++i) {
      encoder.set_input_array(inputs[i]);
      ops[i] = Operand::of(inputs[i]);
    }
    encoder.set_output_array(out);
    encoder.dispatch([ops = std::move(ops), op = out.data<float>(), M, K, N]() {
      std::vector<uint32_t> tmp[2];
      const void* x = ops[0].contiguous(tmp[0]);
      const void* w = ops[1].contiguous(tmp[1]);
      f32_matmul(static_cast<const float*>(x), static_cast<const float*>(w), op, M, K, N);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlxcel's float32 matmul kernel runs on the CPU only");
  }

  const char* name() const override { return "MlxcelCpuDenseMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return dynamic_cast<const CpuDenseMatmul*>(&other) != nullptr;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }
};

mx::array dense_matmul(const mx::array& x, const mx::array& w) {
  if (x.ndim() < 1 || w.ndim() != 2) throw std::invalid_argument("expected x [..., K], w [N, K]");
  if (x.dtype() != mx::float32 || w.dtype() != mx::float32) {
    throw std::invalid_argument("expected float32 x and w");
  }
  if (x.shape(-1) != w.shape(1) || w.shape(1) % kWidth != 0) {
    throw std::invalid_argument("x and w must share K, a multiple of the SIMD width");
  }
  auto stream = mx::default_stream(mx::Device(mx::Device::cpu));
  mx::Shape shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(shape, mx::float32, std::make_shared<CpuDenseMatmul>(stream), {x, w});
}

// ---------------------------------------------------------------------------------------
// Rotary position embedding (nn.RoPE's rotation, as mx.fast.rope computes it), one op.
// MLX's CPU rope builds its angles with scalar cos/sin over every element of every call,
// about 0.1 ms a call for a small decode step; here each (batch, position) computes its
// dims/2 angles once and rotates every head with them. x is [B, H, L, D] with any strides
// (the last one 1); positions are offset[b] + l, offset a scalar or one per batch row.

struct RopeParams {
  int dims;
  bool traditional;
  float base;
  float scale;
};

void rope_rows(const float* x, const int64_t* xs, const int32_t* offset, bool per_row,
               float* out, int64_t B, int64_t H, int64_t L, int64_t D, const RopeParams& rp) {
  const int half = rp.dims / 2;
  std::vector<float> cosv(static_cast<size_t>(half)), sinv(static_cast<size_t>(half));
  std::vector<float> inv(static_cast<size_t>(half));
  const float step = -std::log(rp.base) / static_cast<float>(half);
  for (int d = 0; d < half; ++d) inv[d] = std::exp(static_cast<float>(d) * step);
  for (int64_t b = 0; b < B; ++b) {
    const int32_t start = offset[per_row ? b : 0];
    for (int64_t l = 0; l < L; ++l) {
      const float pos = static_cast<float>(start + l) * rp.scale;
      for (int d = 0; d < half; ++d) {
        const float theta = pos * inv[d];
        cosv[d] = std::cos(theta);
        sinv[d] = std::sin(theta);
      }
      for (int64_t h = 0; h < H; ++h) {
        const float* xr = x + b * xs[0] + h * xs[1] + l * xs[2];
        float* o = out + ((b * H + h) * L + l) * D;
        if (rp.traditional) {
          for (int d = 0; d < half; ++d) {
            const float a = xr[2 * d], c = xr[2 * d + 1];
            o[2 * d] = a * cosv[d] - c * sinv[d];
            o[2 * d + 1] = a * sinv[d] + c * cosv[d];
          }
        } else {
          for (int d = 0; d < half; ++d) {
            const float a = xr[d], c = xr[d + half];
            o[d] = a * cosv[d] - c * sinv[d];
            o[d + half] = a * sinv[d] + c * cosv[d];
          }
        }
        for (int64_t d = rp.dims; d < D; ++d) o[d] = xr[d];
      }
    }
  }
}

class CpuRope : public mx::Primitive {
 public:
  CpuRope(mx::Stream stream, RopeParams params) : mx::Primitive(stream), p_(params) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    const mx::array& x = inputs[0];
    const mx::array& offset = inputs[1];
    encoder.set_input_array(x);
    encoder.set_input_array(offset);
    encoder.set_output_array(out);
    Operand xo = Operand::of(x);
    std::array<int64_t, 3> strides{};
    bool strided = x.strides()[3] == 1;
    if (strided) {
      for (int d = 0; d < 3; ++d) strides[d] = static_cast<int64_t>(x.strides()[d]);
    }
    const int64_t B = x.shape(0), H = x.shape(1), L = x.shape(2), D = x.shape(3);
    encoder.dispatch([xo = std::move(xo), strided, strides, xp = x.data<float>(),
                      off = offset.data<int32_t>(), per_row = offset.size() > 1,
                      op = out.data<float>(), B, H, L, D, rp = p_]() {
      if (strided) {
        rope_rows(xp, strides.data(), off, per_row, op, B, H, L, D, rp);
        return;
      }
      std::vector<uint32_t> tmp;
      const float* dense = static_cast<const float*>(xo.contiguous(tmp));
      const std::array<int64_t, 3> rows{H * L * D, L * D, D};
      rope_rows(dense, rows.data(), off, per_row, op, B, H, L, D, rp);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlxcel's rope kernel runs on the CPU only");
  }

  const char* name() const override { return "MlxcelCpuRope"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const CpuRope*>(&other);
    return o != nullptr && o->p_.dims == p_.dims && o->p_.traditional == p_.traditional &&
           o->p_.base == p_.base && o->p_.scale == p_.scale;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  RopeParams p_;
};

mx::array rope(const mx::array& x, int dims, bool traditional, float base, float scale,
               const mx::array& offset) {
  if (x.ndim() != 4 || x.dtype() != mx::float32) {
    throw std::invalid_argument("expected float32 x [B, H, L, D]");
  }
  if (dims < 2 || dims % 2 != 0 || dims > x.shape(3)) {
    throw std::invalid_argument("dims must be even and at most the last axis");
  }
  if (offset.size() != 1 && (offset.ndim() != 1 || offset.shape(0) != x.shape(0))) {
    throw std::invalid_argument("offset must be a scalar or one per batch row");
  }
  auto stream = mx::default_stream(mx::Device(mx::Device::cpu));
  auto offsets = mx::astype(mx::reshape(offset, {-1}), mx::int32, stream);
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<CpuRope>(stream, RopeParams{dims, traditional, base, scale}),
                   {x, offsets});
}

// exp for 16 floats: 2^n * e^r with |r| <= ln2 / 2 and a degree-7 Taylor polynomial
// (relative error under 1e-8 before rounding); exactly 0 below -87 (and for -inf), where
// float32's exp is at most 1.6e-38.
#if defined(__AVX512F__)
inline __m512 exp_ps(__m512 x) {
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~underflow), _mm512_scalef_ps(p, n));
}

// e^(x[i] - top) in place for n values (a masked last step: every value takes the same path).
inline void exp_shifted(float* x, int64_t n, float top) {
  const __m512 t = _mm512_set1_ps(top);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? static_cast<__mmask16>(0xFFFF)
                                    : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
    _mm512_mask_storeu_ps(x + i, m, exp_ps(_mm512_sub_ps(v, t)));
  }
}
#else
inline void exp_shifted(float* x, int64_t n, float top) {
  for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i] - top);
}
#endif

// ---------------------------------------------------------------------------------------
// Attention for any number of query rows (decode steps, verify rounds, prefill chunks), one
// op: softmax(scale * q k^T + mask) v with grouped-query heads. MLX's CPU
// scaled_dot_product_attention is a chain of about ten ops (85 us a call for one decode
// row of a small model); a decode step runs one per layer. q is float32 [B, Hq, L, D], k and
// v [B, Hkv, S, D] with any strides (the last one 1: a KV cache's slice), mask none, causal,
// or additive float32 / boolean [B, Hq, L, S] (broadcast: zero strides). Each query row
// is reduced over S in order, so padding keys a mask removes change nothing.
//
// The KV cache is read in its own type (`-ctk/-ctv`): float32, float16 or bfloat16 rows, or
// MLX's affine 8- and 4-bit rows with float16 scales and biases per group of 32 or 64
// values, each converted in registers as it is loaded (no float32 copy of the cache).

enum KvKind { kKvF32 = 0, kKvF16 = 1, kKvBF16 = 2, kKvQ8 = 3, kKvQ4 = 4 };

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
  if (exp == 0x1Fu) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exp = 113;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// One (batch, key head)'s key or value rows: row s starts at rows + s * stride bytes; the
// quantized kinds' group scales and biases (float16) at scales / biases + s * sstride / bstride.
struct KvHead {
  const uint8_t* rows;
  int64_t stride;
  const uint16_t* scales;
  int64_t sstride;
  const uint16_t* biases;
  int64_t bstride;
  int group_size;
};

template <int KIND>
constexpr int64_t kv_row_bytes(int64_t D) {
  return KIND == kKvF32 ? D * 4 : KIND == kKvQ8 ? D : KIND == kKvQ4 ? D / 2 : D * 2;
}

template <int KIND>
inline const uint8_t* kv_row(const KvHead& h, int64_t s) {
  return h.rows + s * h.stride;
}

// Value d of row s, as float32.
template <int KIND>
inline float kv_value(const KvHead& h, int64_t s, int64_t d) {
  const uint8_t* r = kv_row<KIND>(h, s);
  if constexpr (KIND == kKvF32) {
    return reinterpret_cast<const float*>(r)[d];
  } else if constexpr (KIND == kKvF16) {
    return half_to_float(reinterpret_cast<const uint16_t*>(r)[d]);
  } else if constexpr (KIND == kKvBF16) {
    return bf16_to_float(reinterpret_cast<const uint16_t*>(r)[d]);
  } else {
    const int64_t g = d / h.group_size;
    const float code = KIND == kKvQ8 ? static_cast<float>(r[d])
                                     : static_cast<float>((r[d / 2] >> (4 * (d % 2))) & 0xF);
    return code * half_to_float(h.scales[s * h.sstride + g]) +
           half_to_float(h.biases[s * h.bstride + g]);
  }
}

// Values [j * kWidth, (j + 1) * kWidth) of row s as one vector.
template <int KIND>
inline Vec kv_load(const KvHead& h, int64_t s, int j) {
#if defined(__AVX512F__)
  const uint8_t* r = kv_row<KIND>(h, s);
  if constexpr (KIND == kKvF32) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(r) + j * 16);
  } else if constexpr (KIND == kKvF16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r) + j));
  } else if constexpr (KIND == kKvBF16) {
    const __m512i wide =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r) + j));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  } else {
    __m128i codes;
    if constexpr (KIND == kKvQ8) {
      codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + j * 16));
    } else {  // 8 bytes, low nibble first
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + j * 8));
      const __m128i nib = _mm_set1_epi8(0x0F);
      codes = _mm_unpacklo_epi8(_mm_and_si128(b, nib), _mm_and_si128(_mm_srli_epi16(b, 4), nib));
    }
    const int64_t g = j * 16 / h.group_size;
    const Vec q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes));
    return _mm512_fmadd_ps(q, _mm512_set1_ps(_cvtsh_ss(h.scales[s * h.sstride + g])),
                           _mm512_set1_ps(_cvtsh_ss(h.biases[s * h.bstride + g])));
  }
#else
  if constexpr (KIND == kKvF32) {
    return vload(reinterpret_cast<const float*>(kv_row<KIND>(h, s)) + j * kWidth);
  } else {
    alignas(64) float buf[kWidth];
    for (int i = 0; i < kWidth; ++i) buf[i] = kv_value<KIND>(h, s, j * kWidth + i);
    return vload(buf);
  }
#endif
}

struct AttnView {
  const float* data;
  std::array<int64_t, 3> strides;  // batch, head, row; the last dimension is contiguous
};

// k or v as the kernel reads it: rows (strides in bytes), and for the quantized kinds the
// scales and biases (strides in float16 elements).
struct KvView {
  const uint8_t* rows;
  std::array<int64_t, 3> strides;
  const uint16_t* scales;
  std::array<int64_t, 3> sstrides;
  const uint16_t* biases;
  std::array<int64_t, 3> bstrides;

  KvHead head(int64_t b, int64_t h, int group_size) const {
    return {rows + b * strides[0] + h * strides[1], strides[2],
            scales ? scales + b * sstrides[0] + h * sstrides[1] : nullptr, sstrides[2],
            biases ? biases + b * bstrides[0] + h * bstrides[1] : nullptr, bstrides[2],
            group_size};
  }
};

struct AttnShape {
  int64_t B, Hq, Hkv, L, S, D;
  float scale;
  int mask_kind;  // 0 none, 1 causal, 2 additive float32, 3 boolean
  std::array<int64_t, 4> mask_strides;
  int kv_kind;
  int group_size;
};

// Up to kAttnRows query rows sharing one key head, against its keys: each key and value
// row is loaded once for all of them. D = kWidth * NV.
constexpr int kAttnRows = 4;
// How many key (value) rows ahead the attention prefetches.
constexpr int64_t kAttnAhead = 16;

struct AttnRow {
  const float* q;
  int64_t visible;  // keys it may see (causal)
  int64_t mask_row; // offset of its mask row
  float* out;
};

template <int KIND, int NV, int R>
void attention_group(const AttnRow* rows, const KvHead& kh, const KvHead& vh, const void* mask,
                     const AttnShape& sh, float* scores) {
  Vec qv[R][NV];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) qv[i][j] = vload(rows[i].q + j * kWidth);
  int64_t keys = 0;
  for (int i = 0; i < R; ++i) keys = std::max(keys, rows[i].visible);
  float top[R];
  for (int i = 0; i < R; ++i) top[i] = -INFINITY;
  const int64_t row_bytes = kv_row_bytes<KIND>(sh.D);
  for (int64_t s = 0; s < keys; ++s) {
    // Rows a few keys ahead (the cache is read once, from memory more often than not);
    // the values' first rows while the keys' last ones are read.
    const uint8_t* ahead = s + kAttnAhead < keys ? kv_row<KIND>(kh, s + kAttnAhead)
                                                 : kv_row<KIND>(vh, s + kAttnAhead - keys);
    prefetch_lines(ahead, row_bytes);
    Vec kv[NV];
    for (int j = 0; j < NV; ++j) kv[j] = kv_load<KIND>(kh, s, j);
    for (int i = 0; i < R; ++i) {
      Vec dot = vzero();
      for (int j = 0; j < NV; ++j) dot = vfma(qv[i][j], kv[j], dot);
      float score = hsum(dot) * sh.scale;
      if (s >= rows[i].visible) {
        score = -INFINITY;
      } else if (sh.mask_kind == 2) {
        score += static_cast<const float*>(mask)[rows[i].mask_row + s * sh.mask_strides[3]];
      } else if (sh.mask_kind == 3 &&
                 !static_cast<const bool*>(mask)[rows[i].mask_row + s * sh.mask_strides[3]]) {
        score = -INFINITY;
      }
      scores[i * sh.S + s] = score;
      top[i] = std::max(top[i], score);
    }
  }
  float total[R];
  for (int i = 0; i < R; ++i) {
    total[i] = 0.0f;
    if (top[i] > -INFINITY) {
      exp_shifted(scores + i * sh.S, keys, top[i]);
    } else {
      std::fill(scores + i * sh.S, scores + i * sh.S + keys, 0.0f);
    }
  }
  Vec acc[R][NV];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = vzero();
  for (int64_t s = 0; s < keys; ++s) {
    prefetch_lines(kv_row<KIND>(vh, s + kAttnAhead), row_bytes);
    Vec vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = kv_load<KIND>(vh, s, j);
    for (int i = 0; i < R; ++i) {
      const float p = scores[i * sh.S + s];
      total[i] += p;
      const Vec pv = vset1(p);
      for (int j = 0; j < NV; ++j) acc[i][j] = vfma(pv, vv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < R; ++i) {
    const Vec inv = vset1(total[i] > 0.0f ? 1.0f / total[i] : 0.0f);
    for (int j = 0; j < NV; ++j) {
      const Vec o = acc[i][j] * inv;
      std::memcpy(rows[i].out + j * kWidth, &o, sizeof(Vec));
    }
  }
}

// Any D: one row at a time, the same operations in the same order per row.
template <int KIND>
void attention_row_any(const AttnRow& row, const KvHead& kh, const KvHead& vh, const void* mask,
                       const AttnShape& sh, float* scores, std::vector<float>& acc) {
  float top = -INFINITY;
  for (int64_t s = 0; s < row.visible; ++s) {
    float score = 0.0f;
    for (int64_t d = 0; d < sh.D; ++d) score += row.q[d] * kv_value<KIND>(kh, s, d);
    score *= sh.scale;
    if (sh.mask_kind == 2) {
      score += static_cast<const float*>(mask)[row.mask_row + s * sh.mask_strides[3]];
    } else if (sh.mask_kind == 3 &&
               !static_cast<const bool*>(mask)[row.mask_row + s * sh.mask_strides[3]]) {
      score = -INFINITY;
    }
    scores[s] = score;
    top = std::max(top, score);
  }
  std::fill(acc.begin(), acc.end(), 0.0f);
  float total = 0.0f;
  if (top > -INFINITY) {
    exp_shifted(scores, row.visible, top);
    for (int64_t s = 0; s < row.visible; ++s) {
      const float p = scores[s];
      total += p;
      for (int64_t d = 0; d < sh.D; ++d) acc[static_cast<size_t>(d)] += p * kv_value<KIND>(vh, s, d);
    }
  }
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  for (int64_t d = 0; d < sh.D; ++d) row.out[d] = acc[static_cast<size_t>(d)] * inv;
}

template <int KIND, int NV>
void attention_groups(const std::vector<AttnRow>& rows, const KvHead& kh, const KvHead& vh,
                      const void* mask, const AttnShape& sh, float* scores) {
  // q rows and accumulators stay in registers (D = 256: two rows, q partly from L1)
  constexpr int R = NV <= 4 ? kAttnRows : 2;
  size_t i = 0;
  for (; i + R <= rows.size(); i += R) {
    attention_group<KIND, NV, R>(rows.data() + i, kh, vh, mask, sh, scores);
  }
  if (R > 2 && i + 2 <= rows.size()) {
    attention_group<KIND, NV, 2>(rows.data() + i, kh, vh, mask, sh, scores);
    i += 2;
  }
  for (; i < rows.size(); ++i) {
    attention_group<KIND, NV, 1>(rows.data() + i, kh, vh, mask, sh, scores);
  }
}

// Attention work (query rows x keys x head size) from which the (batch, key head) units are
// split across the pool: a batched decode step at a few dozen keys, one sequence at several
// hundred. Smaller calls (tens of microseconds) run on the calling thread.
constexpr int64_t kAttnMinParallelWork = int64_t{128} << 10;

// Query rows (of one key head's heads x L) a unit of work holds: a prefill's rows of one
// key head are split across the threads (Gemma 3 has one key head), a multiple of the rows
// a group shares; a row is computed the same way whichever unit holds it.
constexpr int64_t kAttnUnitRows = 16 * kAttnRows;

// Query rows [first, first + kAttnUnitRows) of batch b's heads that share key head kh
// (rows ordered head by head, then l), against that head's keys and values.
template <int KIND>
void attention_unit(const AttnView& q, const KvView& k, const KvView& v, const void* mask,
                    const AttnShape& sh, float* out, int64_t b, int64_t kh, int64_t first,
                    bool vectors, std::vector<AttnRow>& rows, std::vector<float>& scores,
                    std::vector<float>& acc) {
  const int64_t group = sh.Hq / sh.Hkv;
  const KvHead kr = k.head(b, kh, sh.group_size), vr = v.head(b, kh, sh.group_size);
  rows.clear();
  const int64_t last = std::min(first + kAttnUnitRows, group * sh.L);
  for (int64_t r = first; r < last; ++r) {
    const int64_t h = kh * group + r / sh.L, l = r % sh.L;
    const int64_t visible = sh.mask_kind == 1 ? std::min(sh.S, sh.S - sh.L + l + 1) : sh.S;
    const int64_t mrow = b * sh.mask_strides[0] + h * sh.mask_strides[1] + l * sh.mask_strides[2];
    rows.push_back({q.data + b * q.strides[0] + h * q.strides[1] + l * q.strides[2],
                    std::max<int64_t>(visible, 0), mrow,
                    out + ((b * sh.Hq + h) * sh.L + l) * sh.D});
  }
  if (!vectors) {
    for (const AttnRow& row : rows) {
      attention_row_any<KIND>(row, kr, vr, mask, sh, scores.data(), acc);
    }
    return;
  }
  switch (sh.D / kWidth) {
    case 2: attention_groups<KIND, 2>(rows, kr, vr, mask, sh, scores.data()); break;
    case 4: attention_groups<KIND, 4>(rows, kr, vr, mask, sh, scores.data()); break;
    case 8: attention_groups<KIND, 8>(rows, kr, vr, mask, sh, scores.data()); break;
    default: attention_groups<KIND, 16>(rows, kr, vr, mask, sh, scores.data()); break;
  }
}

// Every (batch, key head) unit is independent and computed the same way on any thread, so
// the result does not depend on how the units are split.
template <int KIND>
void attention_rows(const AttnView& q, const KvView& k, const KvView& v, const void* mask,
                    const AttnShape& sh, float* out) {
  // The quantized kinds' vectors must not straddle a group (kWidth divides 32 and 64).
  const bool vectors = kWidth > 1 && sh.D % kWidth == 0 &&
                       (sh.D / kWidth == 2 || sh.D / kWidth == 4 || sh.D / kWidth == 8 ||
                        sh.D / kWidth == 16);
  const int64_t pieces = (sh.Hq / sh.Hkv * sh.L + kAttnUnitRows - 1) / kAttnUnitRows;
  const int64_t units = sh.B * sh.Hkv * pieces;
  const int64_t work = sh.B * sh.Hq * sh.L * sh.S * sh.D;
  RowPool::instance().run(
      units, work,
      [&](int64_t begin, int64_t end) {
        thread_local std::vector<float> scores, acc;
        thread_local std::vector<AttnRow> rows;
        scores.resize(static_cast<size_t>(kAttnRows * sh.S));
        acc.resize(static_cast<size_t>(sh.D));
        for (int64_t u = begin; u < end; ++u) {
          const int64_t bh = u / pieces;
          attention_unit<KIND>(q, k, v, mask, sh, out, bh / sh.Hkv, bh % sh.Hkv,
                               u % pieces * kAttnUnitRows, vectors, rows, scores, acc);
        }
      },
      kAttnMinParallelWork, 2);
}

// An input of any element size as the dispatched task sees it: its data and, when its last
// axis is not contiguous, its shape and strides for a row-contiguous copy.
struct RawOperand {
  const uint8_t* data;
  size_t elem;
  bool direct;  // the last axis is contiguous: read in place with the array's strides
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // elements

  static RawOperand of(const mx::array& a) {
    RawOperand o{a.data<uint8_t>(), a.itemsize(), a.strides().back() == 1 || a.shape().back() == 1,
                 {}, {}};
    for (int d = 0; d < a.ndim(); ++d) {
      o.shape.push_back(a.shape(d));
      o.strides.push_back(a.strides()[d]);
    }
    return o;
  }

  // Byte strides of axes 0..2, reading in place or from `tmp` (a row-contiguous copy).
  const uint8_t* view(std::vector<uint8_t>& tmp, std::array<int64_t, 3>& out) const {
    if (direct) {
      for (int d = 0; d < 3; ++d) out[d] = strides[d] * static_cast<int64_t>(elem);
      return data;
    }
    const int64_t inner = shape[3], step = strides[3];
    const int64_t n = shape[0] * shape[1] * shape[2];
    tmp.resize(static_cast<size_t>(n * inner) * elem);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t a = i / (shape[1] * shape[2]), b = i / shape[2] % shape[1], c = i % shape[2];
      const uint8_t* src = data + (a * strides[0] + b * strides[1] + c * strides[2]) * elem;
      uint8_t* dst = tmp.data() + i * inner * elem;
      for (int64_t j = 0; j < inner; ++j) std::memcpy(dst + j * elem, src + j * step * elem, elem);
    }
    out = {shape[1] * shape[2] * inner * static_cast<int64_t>(elem),
           shape[2] * inner * static_cast<int64_t>(elem), inner * static_cast<int64_t>(elem)};
    return tmp.data();
  }
};

class CpuAttention : public mx::Primitive {
 public:
  CpuAttention(mx::Stream stream, float scale, int mask_kind, int kv_kind, int group_size)
      : mx::Primitive(stream),
        scale_(scale),
        mask_kind_(mask_kind),
        kv_kind_(kv_kind),
        group_size_(group_size) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    const bool quantized = kv_kind_ >= kKvQ8;
    const size_t parts = quantized ? 3 : 1;  // rows (codes), scales, biases
    // q as the kernel reads it: a view when its last axis is contiguous, else a copy made
    // in the task; k and v the same, in their own element types.
    const mx::array& q = inputs[0];
    const bool q_direct = q.strides()[3] == 1;
    Operand q_op = q_direct ? Operand{nullptr, true, {}, {}} : Operand::of(q);
    AttnView q_view = q_direct ? AttnView{q.data<float>(),
                                          {static_cast<int64_t>(q.strides()[0]),
                                           static_cast<int64_t>(q.strides()[1]),
                                           static_cast<int64_t>(q.strides()[2])}}
                               : AttnView{nullptr,
                                          {q.shape(1) * q.shape(2) * q.shape(3),
                                           q.shape(2) * q.shape(3), q.shape(3)}};
    std::vector<RawOperand> kv;
    for (size_t i = 0; i < 2 * parts; ++i) kv.push_back(RawOperand::of(inputs[1 + i]));
    const mx::array& k = inputs[1];
    AttnShape sh{q.shape(0), q.shape(1), k.shape(1), q.shape(2), k.shape(2), q.shape(3),
                 scale_, mask_kind_, {0, 0, 0, 0}, kv_kind_, group_size_};
    const void* mask = nullptr;
    if (mask_kind_ >= 2) {
      const mx::array& m = inputs[1 + 2 * parts];
      for (int d = 0; d < 4; ++d) sh.mask_strides[d] = static_cast<int64_t>(m.strides()[d]);
      mask = mask_kind_ == 2 ? static_cast<const void*>(m.data<float>())
                             : static_cast<const void*>(m.data<bool>());
    }
    encoder.dispatch([q_op = std::move(q_op), q_view, kv = std::move(kv), parts, mask, sh,
                      op = out.data<float>()]() mutable {
      std::vector<uint32_t> q_tmp;
      if (q_view.data == nullptr) q_view.data = static_cast<const float*>(q_op.contiguous(q_tmp));
      std::vector<uint8_t> tmp[6];
      KvView views[2];
      for (size_t t = 0; t < 2; ++t) {
        KvView& w = views[t];
        w.rows = kv[t * parts].view(tmp[t * parts], w.strides);
        w.scales = w.biases = nullptr;
        w.sstrides = w.bstrides = {0, 0, 0};
        if (parts == 3) {
          w.scales = reinterpret_cast<const uint16_t*>(kv[t * 3 + 1].view(tmp[t * 3 + 1], w.sstrides));
          w.biases = reinterpret_cast<const uint16_t*>(kv[t * 3 + 2].view(tmp[t * 3 + 2], w.bstrides));
          for (int d = 0; d < 3; ++d) {
            w.sstrides[d] /= 2;
            w.bstrides[d] /= 2;
          }
        }
      }
      switch (sh.kv_kind) {
        case kKvF16: attention_rows<kKvF16>(q_view, views[0], views[1], mask, sh, op); break;
        case kKvBF16: attention_rows<kKvBF16>(q_view, views[0], views[1], mask, sh, op); break;
        case kKvQ8: attention_rows<kKvQ8>(q_view, views[0], views[1], mask, sh, op); break;
        case kKvQ4: attention_rows<kKvQ4>(q_view, views[0], views[1], mask, sh, op); break;
        default: attention_rows<kKvF32>(q_view, views[0], views[1], mask, sh, op); break;
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlxcel's attention kernel runs on the CPU only");
  }

  const char* name() const override { return "MlxcelCpuAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const CpuAttention*>(&other);
    return o != nullptr && o->scale_ == scale_ && o->mask_kind_ == mask_kind_ &&
           o->kv_kind_ == kv_kind_ && o->group_size_ == group_size_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float scale_;
  int mask_kind_;
  int kv_kind_;
  int group_size_;
};

// The checks and the op shared by `attention` and `quantized_attention`: `kv` holds k's parts
// then v's (1 each for the float kinds, codes / scales / biases for the quantized ones).
mx::array attention_op(const mx::array& q, const std::vector<mx::array>& kv, float scale,
                       int mask_kind, const std::optional<mx::array>& mask, int kv_kind,
                       int group_size, int64_t S) {
  std::vector<mx::array> inputs{q};
  inputs.insert(inputs.end(), kv.begin(), kv.end());
  if (mask_kind >= 2) {
    if (!mask || mask->ndim() != 4 || mask->shape(0) != q.shape(0) ||
        mask->shape(1) != q.shape(1) || mask->shape(2) != q.shape(2) || mask->shape(3) != S ||
        mask->dtype() != (mask_kind == 2 ? mx::float32 : mx::bool_)) {
      throw std::invalid_argument("mask must be [B, Hq, L, S], float32 (additive) or bool");
    }
    inputs.push_back(*mask);
  } else if (mask_kind != 0 && mask_kind != 1) {
    throw std::invalid_argument("mask_kind must be 0, 1, 2 or 3");
  }
  auto stream = mx::default_stream(mx::Device(mx::Device::cpu));
  return mx::array(q.shape(), mx::float32,
                   std::make_shared<CpuAttention>(stream, scale, mask_kind, kv_kind, group_size),
                   inputs);
}

// mask_kind: 0 none, 1 causal, 2 additive float32 mask, 3 boolean mask (mask [B, Hq, L, S]).
// k and v: float32, float16 or bfloat16, the same type.
mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                    int mask_kind, const std::optional<mx::array>& mask) {
  if (q.ndim() != 4 || q.dtype() != mx::float32 || k.ndim() != 4 || v.ndim() != 4 ||
      k.dtype() != v.dtype()) {
    throw std::invalid_argument("expected float32 q and k, v of one type, [B, H, L, D]");
  }
  const int kind = k.dtype() == mx::float32   ? kKvF32
                   : k.dtype() == mx::float16 ? kKvF16
                   : k.dtype() == mx::bfloat16 ? kKvBF16
                                              : -1;
  if (kind < 0) throw std::invalid_argument("k and v must be float32, float16 or bfloat16");
  if (k.shape() != v.shape() || k.shape(0) != q.shape(0) || k.shape(3) != q.shape(3) ||
      k.shape(1) == 0 || q.shape(1) % k.shape(1) != 0) {
    throw std::invalid_argument("q, k and v shapes do not match");
  }
  return attention_op(q, {k, v}, scale, mask_kind, mask, kind, 0, k.shape(2));
}

// The same over MLX's affine-quantized k and v (codes uint32 [B, Hkv, S, D * bits / 32],
// float16 scales and biases [B, Hkv, S, D / group_size]), 8 or 4 bits, groups of 32 or 64.
mx::array quantized_attention(const mx::array& q, const mx::array& kw, const mx::array& ks,
                              const mx::array& kb, const mx::array& vw, const mx::array& vs,
                              const mx::array& vb, float scale, int mask_kind,
                              const std::optional<mx::array>& mask, int bits, int group_size) {
  if ((bits != 8 && bits != 4) || (group_size != 32 && group_size != 64)) {
    throw std::invalid_argument("quantized attention takes 8 or 4 bits in groups of 32 or 64");
  }
  if (q.ndim() != 4 || q.dtype() != mx::float32) throw std::invalid_argument("expected float32 q");
  const int64_t D = q.shape(3);
  for (const mx::array* a : {&kw, &ks, &kb, &vw, &vs, &vb}) {
    if (a->ndim() != 4 || a->shape(0) != q.shape(0) || a->shape(1) != kw.shape(1) ||
        a->shape(2) != kw.shape(2)) {
      throw std::invalid_argument("q, k and v shapes do not match");
    }
  }
  if (kw.dtype() != mx::uint32 || vw.dtype() != mx::uint32 || kw.shape(3) * 32 / bits != D ||
      vw.shape(3) != kw.shape(3) || D % group_size != 0 || ks.shape(3) != D / group_size ||
      kb.shape(3) != ks.shape(3) || vs.shape(3) != ks.shape(3) || vb.shape(3) != ks.shape(3) ||
      kw.shape(1) == 0 || q.shape(1) % kw.shape(1) != 0) {
    throw std::invalid_argument("q, k and v shapes do not match");
  }
  for (const mx::array* a : {&ks, &kb, &vs, &vb}) {
    if (a->dtype() != mx::float16) throw std::invalid_argument("scales and biases must be float16");
  }
  return attention_op(q, {kw, ks, kb, vw, vs, vb}, scale, mask_kind, mask,
                      bits == 8 ? kKvQ8 : kKvQ4, group_size, kw.shape(2));
}

// ---------------------------------------------------------------------------------------
// SiLU (x * sigmoid(x), nn.silu), one vectorized op. MLX's CPU build computes exp per
// element with a libm fma call (its JIT kernels are compiled for baseline x86-64): about
// 24 ns an element, 2.5 ms for one 63-row SwiGLU of a 135M model, a third of its prefill.
// exp here: 2^n * e^r with |r| <= ln2 / 2 and a degree-7 Taylor polynomial (relative error
// under 1e-8 before rounding), so results agree with MLX's within a few float32 ulps.


void silu_rows(const float* x, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), v));
    _mm512_storeu_ps(out + i, _mm512_div_ps(v, _mm512_add_ps(one, e)));
  }
#endif
  for (; i < n; ++i) out[i] = x[i] / (1.0f + std::exp(-x[i]));
}

// GELU, tanh approximation (nn.gelu_approx: Gemma's MLPs): 0.5 x (1 + tanh(u)) with
// u = sqrt(2 / pi) (x + 0.044715 x^3) is x / (1 + e^(-2u)), the SiLU form above. MLX's CPU
// build runs it as a compiled chain with a libm powf and tanhf per element (a third of
// Gemma 3 270M's prefill).
constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluA = 0.044715f;

void gelu_approx_rows(const float* x, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 minus_2c = _mm512_set1_ps(-2.0f * kGeluC);
  const __m512 a = _mm512_set1_ps(kGeluA);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m512 inner = _mm512_fmadd_ps(_mm512_mul_ps(a, v), _mm512_mul_ps(v, v), v);
    const __m512 e = exp_ps(_mm512_mul_ps(minus_2c, inner));
    _mm512_storeu_ps(out + i, _mm512_div_ps(v, _mm512_add_ps(one, e)));
  }
#endif
  for (; i < n; ++i) {
    const float v = x[i];
    out[i] = v / (1.0f + std::exp(-2.0f * kGeluC * (v + kGeluA * v * v * v)));
  }
}

// An element-wise activation of float32 x, one op: SiLU or the tanh-approximate GELU.
enum class Activation { kSilu = 0, kGeluApprox = 1 };

class CpuActivation : public mx::Primitive {
 public:
  CpuActivation(mx::Stream stream, Activation kind) : mx::Primitive(stream), kind_(kind) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    encoder.set_input_array(inputs[0]);
    encoder.set_output_array(out);
    Operand xo = Operand::of(inputs[0]);
    encoder.dispatch([xo = std::move(xo), op = out.data<float>(),
                      n = static_cast<int64_t>(out.size()), kind = kind_]() {
      std::vector<uint32_t> tmp;
      const float* x = static_cast<const float*>(xo.contiguous(tmp));
      if (kind == Activation::kSilu) {
        silu_rows(x, op, n);
      } else {
        gelu_approx_rows(x, op, n);
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlxcel's activation kernels run on the CPU only");
  }

  const char* name() const override {
    return kind_ == Activation::kSilu ? "MlxcelCpuSilu" : "MlxcelCpuGeluApprox";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const CpuActivation*>(&other);
    return o != nullptr && o->kind_ == kind_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  Activation kind_;
};

mx::array activation(const mx::array& x, Activation kind) {
  if (x.dtype() != mx::float32) throw std::invalid_argument("expected float32 x");
  auto stream = mx::default_stream(mx::Device(mx::Device::cpu));
  return mx::array(x.shape(), mx::float32, std::make_shared<CpuActivation>(stream, kind), {x});
}

mx::array silu(const mx::array& x) { return activation(x, Activation::kSilu); }

mx::array gelu_approx(const mx::array& x) { return activation(x, Activation::kGeluApprox); }

// ---------------------------------------------------------------------------------------
// RMS norm (nn.RMSNorm: x * rsqrt(mean(x^2) + eps) * w), one op. MLX's CPU rms_norm is
// several ops (about 23 us for a decode step's 576 values, against 4 us for one
// elementwise op); a decode step runs two per layer. Each row is summed in a fixed order.

void rms_rows(const float* x, const float* w, float* out, int64_t rows, int64_t D, float eps) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* xr = x + i * D;
    float* o = out + i * D;
    int64_t j = 0;
    Vec acc = vzero();
    for (; j + kWidth <= D; j += kWidth) {
      const Vec v = vload(xr + j);
      acc = vfma(v, v, acc);
    }
    float ss = hsum(acc);
    for (; j < D; ++j) ss += xr[j] * xr[j];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
    for (j = 0; j < D; ++j) o[j] = xr[j] * r * w[j];
  }
}

class CpuRmsNorm : public mx::Primitive {
 public:
  CpuRmsNorm(mx::Stream stream, float eps) : mx::Primitive(stream), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    encoder.set_input_array(inputs[0]);
    encoder.set_input_array(inputs[1]);
    encoder.set_output_array(out);
    Operand xo = Operand::of(inputs[0]);
    Operand wo = Operand::of(inputs[1]);
    const int64_t D = inputs[0].shape(-1);
    encoder.dispatch([xo = std::move(xo), wo = std::move(wo), op = out.data<float>(), D,
                      n = static_cast<int64_t>(out.size()), eps = eps_]() {
      std::vector<uint32_t> tmp[2];
      const float* x = static_cast<const float*>(xo.contiguous(tmp[0]));
      const float* w = static_cast<const float*>(wo.contiguous(tmp[1]));
      rms_rows(x, w, op, D == 0 ? 0 : n / D, D, eps);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlxcel's rms norm kernel runs on the CPU only");
  }

  const char* name() const override { return "MlxcelCpuRmsNorm"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const CpuRmsNorm*>(&other);
    return o != nullptr && o->eps_ == eps_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float eps_;
};

mx::array rms_norm(const mx::array& x, const mx::array& w, float eps) {
  if (x.ndim() < 1 || x.dtype() != mx::float32 || w.dtype() != mx::float32 || w.ndim() != 1 ||
      w.shape(0) != x.shape(-1)) {
    throw std::invalid_argument("expected float32 x [..., D] and w [D]");
  }
  auto stream = mx::default_stream(mx::Device(mx::Device::cpu));
  return mx::array(x.shape(), mx::float32, std::make_shared<CpuRmsNorm>(stream, eps), {x, w});
}

// ---------------------------------------------------------------------------------------
// x rounded as the int8 path rounds it (each 32 values to int8 steps of max|x| / 127, round
// half to even), back in float32: what the float32 copy of a 4-bit layer is fed during
// prefill, so those rows get the numbers the kernel gives (one op instead of about ten).

void round_rows_int8(const float* x, float* out, int64_t blocks) {
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * 32;
    float* ob = out + b * 32;
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float scale = amax / 127.0f;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int j = 0; j < 32; ++j) ob[j] = static_cast<float>(std::lrintf(xb[j] * inv)) * scale;
  }
}

class CpuRoundInt8 : public mx::Primitive {
 public:
  explicit CpuRoundInt8(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    encoder.set_input_array(inputs[0]);
    encoder.set_output_array(out);
    Operand xo = Operand::of(inputs[0]);
    encoder.dispatch([xo = std::move(xo), op = out.data<float>(), n = out.size()]() {
      std::vector<uint32_t> tmp;
      const float* x = static_cast<const float*>(xo.contiguous(tmp));
      round_rows_int8(x, op, static_cast<int64_t>(n) / 32);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlxcel's int8 rounding runs on the CPU only");
  }

  const char* name() const override { return "MlxcelCpuRoundInt8"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return dynamic_cast<const CpuRoundInt8*>(&other) != nullptr;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
};

mx::array round_int8(const mx::array& x) {
  if (x.ndim() < 1 || x.dtype() != mx::float32 || x.shape(-1) % 32 != 0) {
    throw std::invalid_argument("expected float32 x [..., K], K a multiple of 32");
  }
  auto stream = mx::default_stream(mx::Device(mx::Device::cpu));
  return mx::array(x.shape(), mx::float32, std::make_shared<CpuRoundInt8>(stream), {x});
}

// x [..., K] @ a 4-, 5- or 8-bit weight in row tiles [ceil(N / 16), K / 32, block bytes]
// (symmetric ones without biases).
class CpuPackedMatmul : public mx::Primitive {
 public:
  CpuPackedMatmul(mx::Stream stream, int64_t n, int bits, bool symmetric)
      : mx::Primitive(stream), n_(n), bits_(bits), symmetric_(symmetric) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    const mx::array& packed = inputs[1];
    if (!packed.flags().row_contiguous) {
      throw std::invalid_argument("the packed weight must be row-contiguous");
    }
    int64_t K = inputs[0].shape(-1);
    int64_t M = K == 0 ? 0 : static_cast<int64_t>(inputs[0].size()) / K;
    encoder.set_input_array(inputs[0]);
    encoder.set_input_array(packed);
    encoder.set_output_array(out);
    Operand xo = Operand::of(inputs[0]);
    encoder.dispatch([xo = std::move(xo), w = packed.data<uint8_t>(), op = out.data<float>(), M,
                      K, N = n_, bits = bits_, symmetric = symmetric_]() {
      std::vector<uint32_t> tmp;
      const float* x = static_cast<const float*>(xo.contiguous(tmp));
#if MLXCEL_PACKED
      packed_matmul_rows(x, w, op, M, K, N, bits, symmetric);
#else
      (void)x, (void)w, (void)op, (void)M, (void)K, (void)N, (void)bits, (void)symmetric;
      throw std::runtime_error("packed 4-bit weights need AVX-512 VNNI");
#endif
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlxcel's packed matmul kernel runs on the CPU only");
  }

  const char* name() const override { return "MlxcelCpuPackedMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const CpuPackedMatmul*>(&other);
    return o != nullptr && o->n_ == n_ && o->bits_ == bits_ && o->symmetric_ == symmetric_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.back() = static_cast<int>(n_);
    return {shape};
  }

 private:
  int64_t n_;
  int bits_;
  bool symmetric_;
};

mx::array packed_matmul(const mx::array& x, const mx::array& packed, int64_t n, int bits,
                        bool symmetric) {
  if (x.ndim() < 1 || x.dtype() != mx::float32 || x.shape(-1) % 32 != 0) {
    throw std::invalid_argument("expected float32 x [..., K], K a multiple of 32");
  }
  if (bits != 4 && bits != 5 && bits != 8) throw std::invalid_argument("bits must be 4, 5 or 8");
  const int64_t blocks = x.shape(-1) / 32;
  const int64_t bytes = 16 * 32 * bits / 8 + (symmetric ? 32 : 64);
  if (packed.dtype() != mx::uint8 || packed.ndim() != 3 || packed.shape(1) != blocks ||
      packed.shape(2) != bytes || packed.shape(0) * 16 < n || packed.shape(0) * 16 >= n + 16) {
    throw std::invalid_argument(
        "packed weight [ceil(N / 16), K / 32, 320, 384 (5-bit) or 576 (8-bit), 32 less if "
        "symmetric] uint8 expected");
  }
  auto stream = mx::default_stream(mx::Device(mx::Device::cpu));
  mx::Shape shape = x.shape();
  shape.back() = static_cast<int>(n);
  return mx::array(shape, mx::float32, std::make_shared<CpuPackedMatmul>(stream, n, bits, symmetric),
                   {x, packed});
}

mx::array quantized_matmul(
    const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
    int group_size, int bits) {
  if (bits != 4 && bits != 8) throw std::invalid_argument("bits must be 4 or 8");
  if (group_size < 32 || group_size % 32 != 0) {
    throw std::invalid_argument("group_size must be a positive multiple of 32");
  }
  if (x.ndim() < 1 || w.ndim() != 2 || scales.ndim() != 2 || biases.ndim() != 2) {
    throw std::invalid_argument("expected x [..., K], w/scales/biases [N, ...]");
  }
  if (w.dtype() != mx::uint32 || scales.dtype() != mx::float32 ||
      biases.dtype() != mx::float32 || x.dtype() != mx::float32) {
    throw std::invalid_argument("expected float32 x/scales/biases and uint32 w");
  }
  int64_t K = x.shape(-1);
  int64_t N = w.shape(0);
  if (K % group_size != 0 || w.shape(1) * 32 / bits != K ||
      scales.shape(0) != N || scales.shape(1) != K / group_size ||
      biases.shape(0) != N || biases.shape(1) != K / group_size) {
    throw std::invalid_argument("shapes of x, w, scales and biases do not match");
  }
  auto stream = mx::default_stream(mx::Device(mx::Device::cpu));
  mx::Shape shape = x.shape();
  shape.back() = static_cast<int>(N);
  return mx::array(
      shape, mx::float32, std::make_shared<CpuQuantizedMatmul>(stream, group_size, bits),
      {x, w, scales, biases});
}

}  // namespace

NB_MODULE(_mlxcel_cpu_kernels, m) {
  nb::module_::import_("mlx.core");
  m.doc() = "mlxcel's CPU kernels for MLX (quantized matmul).";
  m.def("quantized_matmul", &quantized_matmul, nb::arg("x"), nb::arg("w"), nb::arg("scales"),
        nb::arg("biases"), nb::arg("group_size"), nb::arg("bits"),
        "x @ dequantize(w, scales, biases).T on the CPU (float32 x; 4- or 8-bit affine w).");
  m.def("packed_matmul", &packed_matmul, nb::arg("x"), nb::arg("packed"), nb::arg("n"),
        nb::arg("bits") = 4, nb::arg("symmetric") = false,
        "x @ W.T for a 4-, 5- or 8-bit weight in int8 row tiles (layers.pack_int8), N rows, "
        "int8 x; symmetric tiles hold no biases (each is -2^(bits-1) times its scale).");
  m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("w"), nb::arg("eps"),
        "nn.RMSNorm on the CPU: float32 x [..., D] * rsqrt(mean(x^2) + eps) * w [D].");
  m.def("attention", &attention, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("scale"),
        nb::arg("mask_kind"), nb::arg("mask").none(),
        "softmax(scale * q k^T + mask) v on the CPU for float32 q [B, Hq, L, D], k and v "
        "[B, Hkv, S, D] (float32, float16 or bfloat16); mask_kind 0 none, 1 causal, 2 additive, "
        "3 boolean ([B, Hq, L, S]).");
  m.def("quantized_attention", &quantized_attention, nb::arg("q"), nb::arg("k_codes"),
        nb::arg("k_scales"), nb::arg("k_biases"), nb::arg("v_codes"), nb::arg("v_scales"),
        nb::arg("v_biases"), nb::arg("scale"), nb::arg("mask_kind"), nb::arg("mask").none(),
        nb::arg("bits"), nb::arg("group_size"),
        "attention over MLX's affine 8- or 4-bit k and v (float16 scales and biases, groups of "
        "32 or 64), read in place.");
  m.def("silu", &silu, nb::arg("x"), "nn.silu (x * sigmoid(x)) of float32 x on the CPU.");
  m.def("gelu_approx", &gelu_approx, nb::arg("x"),
        "nn.gelu_approx (tanh-approximate GELU) of float32 x on the CPU.");
  m.def("round_int8", &round_int8, nb::arg("x"),
        "float32 x [..., K] rounded per 32 values as the int8 path rounds it, in float32.");
  m.def("rope", &rope, nb::arg("x"), nb::arg("dims"), nb::arg("traditional"), nb::arg("base"),
        nb::arg("scale"), nb::arg("offset"),
        "nn.RoPE's rotation of float32 x [B, H, L, D] at positions offset + l on the CPU.");
  m.def("dense_matmul", &dense_matmul, nb::arg("x"), nb::arg("w"),
        "x @ w.T on the CPU for float32 x [..., K] and w [N, K] (K a multiple of simd_width).");
  m.attr("simd_width") = kWidth;
  m.def("set_threads", [](int n) { RowPool::instance().set_threads(n); }, nb::arg("n"),
        "Threads the kernel splits output rows across.");
  m.def("threads", [] { return RowPool::instance().threads(); });
  m.attr("simd") = MLXCEL_SIMD;
  // "" when this CPU has no integer dot-product path; set_int8(False) turns it off.
  m.attr("int8_simd") = MLXCEL_INT8;
  m.def("set_int8", [](bool on) { g_int8.store(on); }, nb::arg("on"),
        "Whether 4-bit matmuls quantize x to int8 and use integer dot products.");
  m.def("int8", [] { return std::string(MLXCEL_INT8).size() > 0 && g_int8.load(); });
}
