// kernels_impl.h — the body of every CPU kernel (reduce, scale, axpy, norm2, copy), written once
// and compiled once per instruction set by kernels_scalar.cc, kernels_avx2.cc, kernels_avx512.cc.
//
// The including file first includes <cstddef>, <cstdint>, <cstring>, <immintrin.h> and
// kernels_table.h, then sets its `#pragma GCC target`, then defines MLF_ISA_NS (namespace name),
// MLF_ISA_NAME and MLF_ISA_LEVEL (0 baseline x86-64, 1 AVX2+FMA+F16C, 2 AVX-512F/BW). Level 0 is
// also the build for CPUs other than x86 (<immintrin.h> not included): there MLF_X86 is 0 and the
// streaming stores are plain copies. Everything
// here has internal linkage except table(), and nothing instantiates std:: templates: the same
// inline code built for different targets must never be merged by the linker (an AVX-512 copy
// chosen for the scalar path would crash older CPUs).
//
// Shape of the kernels: data moves in chunks of kChunk elements held in small local arrays; the
// per-element loops over a chunk are fixed-length, so gcc keeps a chunk in vector registers and
// each source is read exactly once (float16/bfloat16 are widened to float32 in registers, reduced,
// and rounded once on the way out). Outputs of kStreamBytes or more are written with non-temporal
// stores, so a reduce moves the bytes a copy moves instead of also pulling dst into the cache. More
// than kGroup sources are combined in groups through an L1 accumulator tile, to keep the number of
// concurrent memory streams within what the prefetchers follow. No FMA contraction (see below)
// and a fixed order of operations: every ISA returns bit-identical results, so ranks on different
// CPUs agree.

// gcc contracts a*b+c into FMA whenever the target has it (avx512f implies it), even in ISO mode;
// that would make axpy and norm2 round differently per ISA. The kernels are memory-bound, so FMA
// buys nothing here. no-trapping-math lets gcc turn the branch-free float16 conversions below
// into vector selects (nothing here reads floating-point exception flags).
#pragma GCC optimize("fp-contract=off", "no-trapping-math")

namespace mlf {
namespace MLF_ISA_NS {
namespace {

constexpr size_t kChunk = 32;   // elements per chunk: 2-4 vector registers per source
constexpr size_t kTile = 1024;  // elements per accumulator tile (4-8 KiB, stays in L1)
constexpr int kGroup = 8;       // sources combined per pass over memory
// Outputs at least this big are streamed past the cache. Below it the output is likely read soon
// (the next step of a collective) and fits the cache.
constexpr size_t kStreamBytes = size_t(4) << 20;
constexpr size_t kLine = 64;
static_assert(kChunk * 2 % kLine == 0, "a chunk of any dtype must be whole cache lines");

inline size_t min_size(size_t a, size_t b) { return a < b ? a : b; }

// ---------------------------------------------------------------- non-temporal stores

#if defined(__x86_64__) || defined(__i386__)
#define MLF_X86 1
#else
#define MLF_X86 0
#endif
#if !MLF_X86 && MLF_ISA_LEVEL > 0
#error "the AVX2 and AVX-512 kernels are built for x86 only"
#endif

// Stores one 64-byte cache line (p 64-byte aligned) bypassing the cache.
inline void stream_line(void* p, const void* v) {
#if MLF_ISA_LEVEL >= 2
  _mm512_stream_si512(static_cast<__m512i*>(p), _mm512_loadu_si512(v));
#elif MLF_ISA_LEVEL >= 1
  for (int h = 0; h < 2; ++h)
    _mm256_stream_si256(static_cast<__m256i*>(p) + h,
                        _mm256_loadu_si256(static_cast<const __m256i*>(v) + h));
#elif MLF_X86
  for (int h = 0; h < 4; ++h)
    _mm_stream_si128(static_cast<__m128i*>(p) + h,
                     _mm_loadu_si128(static_cast<const __m128i*>(v) + h));
#else
  memcpy(p, v, kLine);
#endif
}

// memcpy with streaming stores for the 64-byte-aligned middle; the caller fences once at the end.
inline void stream_bytes(void* dst, const void* src, size_t bytes) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  size_t head = min_size((kLine - reinterpret_cast<uintptr_t>(d) % kLine) % kLine, bytes);
  memcpy(d, s, head);
  d += head, s += head, bytes -= head;
  for (; bytes >= kLine; d += kLine, s += kLine, bytes -= kLine) stream_line(d, s);
  memcpy(d, s, bytes);
}

#if MLF_X86
inline void stream_fence() { _mm_sfence(); }

// One vector to memory: streamed (p aligned to the vector) or through the cache.
inline void put_vec(void* p, __m128i v, bool nt) {
  if (nt)
    _mm_stream_si128(static_cast<__m128i*>(p), v);
  else
    _mm_storeu_si128(static_cast<__m128i*>(p), v);
}
#else
inline void stream_fence() {}  // the stores above were ordinary ones
#endif
#if MLF_ISA_LEVEL >= 1
inline void put_vec(void* p, __m256i v, bool nt) {
  if (nt)
    _mm256_stream_si256(static_cast<__m256i*>(p), v);
  else
    _mm256_storeu_si256(static_cast<__m256i*>(p), v);
}
#endif
#if MLF_ISA_LEVEL >= 2
inline void put_vec(void* p, __m512i v, bool nt) {
  if (nt)
    _mm512_stream_si512(static_cast<__m512i*>(p), v);
  else
    _mm512_storeu_si512(p, v);
}
#endif

// ---------------------------------------------------------------- element kinds

// Each kind has a storage type S and an accumulator type A, and moves a chunk between them.
struct F16 { using S = uint16_t; using A = float; };
struct BF16 { using S = uint16_t; using A = float; };
template <class T>
struct Native { using S = T; using A = T; };

inline float bits_f32(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
inline uint32_t f32_bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return u;
}

// float16 in software, bit-exact with F16C (round to nearest even; NaN payload kept and quietened),
// written without branches so the baseline build vectorises it. Subnormals go through integer
// conversion rather than denormal float arithmetic, so flush-to-zero modes do not change results.
// Comparisons are on int32_t (the values are below 2**31): SSE2 has no unsigned compare.
inline float f16_to_f32(uint16_t h) {
  int32_t em = h & 0x7fff;
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t normal = (uint32_t(em) << 13) + (uint32_t(127 - 15) << 23);
  uint32_t special = (uint32_t(em) << 13) | 0x7f800000u;  // inf / NaN
  uint32_t sub = f32_bits(float(em) * 0x1p-24f);
  uint32_t mag = em >= 0x7c00 ? special : (em < 0x0400 ? sub : normal);
  return bits_f32(mag | sign);
}
inline uint16_t f32_to_f16(float f) {
  uint32_t u = f32_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t x = u & 0x7fffffffu;
  int32_t xs = int32_t(x);
  uint32_t normal = (x + (uint32_t(15 - 127) << 23) + 0xfffu + ((x >> 13) & 1u)) >> 13;
  uint32_t sub = f32_bits(bits_f32(x) + 0.5f) - 0x3f000000u;  // add aligns the 10 bits, RNE
  uint32_t special = xs > 0x7f800000 ? (0x7e00u | ((x >> 13) & 0x3ffu)) : 0x7c00u;
  uint32_t mag = xs >= 0x47800000 ? special : (xs < 0x38800000 ? sub : normal);
  return uint16_t(mag | sign);
}
inline float bf16_to_f32(uint16_t h) { return bits_f32(uint32_t(h) << 16); }
// Round to nearest even on the dropped 16 bits; NaNs stay NaN (quietened, sign and top payload
// kept) instead of rounding into infinity.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uint32_t quiet_nan = (u >> 16) | 0x40u;
  return uint16_t((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

// Copies a chunk's bytes in whole vector registers. Plain loops here become memcpy-like block
// moves of another width, and the mismatched store/load sizes then defeat store forwarding; with
// same-width moves gcc keeps the local chunk arrays in registers.
template <size_t Bytes>
inline void move_chunk(void* d, const void* s, bool nt = false) {
  char* dc = static_cast<char*>(d);
  const char* sc = static_cast<const char*>(s);
#if MLF_ISA_LEVEL >= 2
  for (size_t b = 0; b < Bytes; b += 64) put_vec(dc + b, _mm512_loadu_si512(sc + b), nt);
#elif MLF_ISA_LEVEL >= 1
  for (size_t b = 0; b < Bytes; b += 32)
    put_vec(dc + b, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + b)), nt);
#elif MLF_X86
  for (size_t b = 0; b < Bytes; b += 16)
    put_vec(dc + b, _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + b)), nt);
#else
  (void)nt;
  memcpy(dc, sc, Bytes);
#endif
}

template <class T>
inline void load(Native<T>, const T* p, T* a) { move_chunk<kChunk * sizeof(T)>(a, p); }
// store(kind, p, a, nt): nt streams past the cache (p then 64-byte aligned, chunks whole stores).
template <class T>
inline void store(Native<T>, T* p, const T* a, bool nt) {
  move_chunk<kChunk * sizeof(T)>(p, a, nt);
}

#if MLF_ISA_LEVEL == 0
// Software rounding of a chunk to 16 bits, then one (possibly streamed) move.
inline void store_soft(uint16_t* p, const float* a, bool nt, uint16_t (*round)(float)) {
  alignas(64) uint16_t tmp[kChunk];
  for (size_t l = 0; l < kChunk; ++l) tmp[l] = round(a[l]);
  move_chunk<sizeof tmp>(p, tmp, nt);
}
#endif

// bfloat16 -> float32 is a shift; float32 -> bfloat16 rounds as f32_to_bf16 does, lane by lane.
inline void load(BF16, const uint16_t* p, float* a) {
#if MLF_ISA_LEVEL >= 2
  for (size_t l = 0; l < kChunk; l += 16) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + l)));
    _mm512_storeu_ps(a + l, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
  }
#elif MLF_ISA_LEVEL >= 1
  for (size_t l = 0; l < kChunk; l += 8) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + l)));
    _mm256_storeu_ps(a + l, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
#else
  for (size_t l = 0; l < kChunk; ++l) a[l] = bf16_to_f32(p[l]);
#endif
}
inline void store(BF16, uint16_t* p, const float* a, bool nt) {
#if MLF_ISA_LEVEL >= 2
  // Round in place in the 32-bit lanes (NaN: set the quiet bit instead), then one word permute
  // gathers the high halves of 32 lanes.
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff);
  const __m512i quiet = _mm512_set1_epi32(0x00400000);
  alignas(64) static constexpr uint16_t kOddWords[32] = {
      1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
      33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
  const __m512i odd = _mm512_load_si512(kOddWords);
  static_assert(kChunk % 32 == 0, "whole 64-byte outputs");
  for (size_t l = 0; l < kChunk; l += 32) {
    __m512i r[2];
    for (int h = 0; h < 2; ++h) {
      __m512 f = _mm512_loadu_ps(a + l + 16 * h);
      __m512i u = _mm512_castps_si512(f);
      __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
      r[h] = _mm512_add_epi32(_mm512_add_epi32(u, bias), lsb);
      r[h] = _mm512_mask_or_epi32(r[h], _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), u, quiet);
    }
    put_vec(p + l, _mm512_permutex2var_epi16(r[0], odd, r[1]), nt);
  }
#elif MLF_ISA_LEVEL >= 1
  const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff);
  const __m256i quiet = _mm256_set1_epi32(0x40);
  for (size_t l = 0; l < kChunk; l += 16) {
    __m256i r2[2];
    for (int h = 0; h < 2; ++h) {
      __m256 f = _mm256_loadu_ps(a + l + 8 * h);
      __m256i u = _mm256_castps_si256(f);
      __m256i hi = _mm256_srli_epi32(u, 16);
      __m256i r = _mm256_srli_epi32(
          _mm256_add_epi32(_mm256_add_epi32(u, bias), _mm256_and_si256(hi, one)), 16);
      __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
      __m256 qnan = _mm256_castsi256_ps(_mm256_or_si256(hi, quiet));
      r2[h] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), qnan, nan));
    }
    // packus works within 128-bit lanes; the permute puts the four quarters back in order.
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r2[0], r2[1]), 0xd8);
    put_vec(p + l, packed, nt);
  }
#else
  store_soft(p, a, nt, f32_to_bf16);
#endif
}
// float16 uses F16C explicitly where available: gcc 12 converts _Float16 one element at a time.
inline void load(F16, const uint16_t* p, float* a) {
#if MLF_ISA_LEVEL >= 2
  for (size_t l = 0; l < kChunk; l += 16)
    _mm512_storeu_ps(a + l,
                     _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + l))));
#elif MLF_ISA_LEVEL >= 1
  for (size_t l = 0; l < kChunk; l += 8)
    _mm256_storeu_ps(a + l,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + l))));
#else
  for (size_t l = 0; l < kChunk; ++l) a[l] = f16_to_f32(p[l]);
#endif
}
inline void store(F16, uint16_t* p, const float* a, bool nt) {
#if MLF_ISA_LEVEL >= 1
  constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;  // whatever MXCSR says
#endif
#if MLF_ISA_LEVEL >= 2
  for (size_t l = 0; l < kChunk; l += 16)
    put_vec(p + l, _mm512_cvtps_ph(_mm512_loadu_ps(a + l), kRne), nt);
#elif MLF_ISA_LEVEL >= 1
  for (size_t l = 0; l < kChunk; l += 8)
    put_vec(p + l, _mm256_cvtps_ph(_mm256_loadu_ps(a + l), kRne), nt);
#else
  store_soft(p, a, nt, f32_to_f16);
#endif
}

// ---------------------------------------------------------------- reduction operators

// Integer sum/prod wrap around like MPI's: computed unsigned (defined overflow), cast back.
template <class A> struct WrapAs { using U = A; };
template <> struct WrapAs<int32_t> { using U = uint32_t; };
template <> struct WrapAs<int64_t> { using U = uint64_t; };

struct Sum {
  template <class A>
  static A f(A a, A b) {
    using U = typename WrapAs<A>::U;
    return A(U(a) + U(b));
  }
};
struct Prod {
  template <class A>
  static A f(A a, A b) {
    using U = typename WrapAs<A>::U;
    return A(U(a) * U(b));
  }
};
// min/max propagate NaN like numpy.minimum/maximum (`a != a` folds away for integers).
struct Min {
  template <class A>
  static A f(A a, A b) { return (a < b || a != a) ? a : b; }
};
struct Max {
  template <class A>
  static A f(A a, A b) { return (a > b || a != a) ? a : b; }
};

template <class Fn>
inline void with_op(RedOp op, Fn fn) {
  switch (op) {
    case RedOp::sum: fn(Sum{}); break;
    case RedOp::prod: fn(Prod{}); break;
    case RedOp::min: fn(Min{}); break;
    case RedOp::max: fn(Max{}); break;
  }
}

// ---------------------------------------------------------------- reduce

// Sources j0 <= j < j1 combined into the chunk at element i, starting from `in` (a chunk of the
// accumulator tile) or, when in is null, from source j0 itself.
template <class Op, class K>
inline void combine_chunk(K kind, const typename K::A* in, const typename K::S* const* src, int j0,
                          int j1, size_t i, typename K::A* a) {
  using A = typename K::A;
  if (in) {
    move_chunk<sizeof(A) * kChunk>(a, in);
  } else {
    load(kind, src[j0++] + i, a);
  }
  for (int j = j0; j < j1; ++j) {
    A b[kChunk];
    load(kind, src[j] + i, b);
    for (size_t l = 0; l < kChunk; ++l) a[l] = Op::f(a[l], b[l]);
  }
}

template <class A>
inline void scale_chunk(A* a, A s) {
  for (size_t l = 0; l < kChunk; ++l) a[l] = a[l] * s;
}

// Elements [begin, begin + nchunks * kChunk): whole chunks, dst 64-byte aligned when nt.
template <class Op, class K>
void reduce_chunks(K kind, typename K::S* dst, const typename K::S* const* src, int k, size_t begin,
                   size_t nchunks, bool scaled, typename K::A s, bool nt) {
  using A = typename K::A;
  if (k <= kGroup) {  // every source in one pass, nothing but registers in between
    for (size_t c = 0; c < nchunks; ++c) {
      size_t i = begin + c * kChunk;
      A a[kChunk];
      combine_chunk<Op>(kind, nullptr, src, 0, k, i, a);
      if (scaled) scale_chunk(a, s);
      store(kind, dst + i, a, nt);
    }
    return;
  }
  alignas(64) A acc[kTile];
  constexpr size_t kTileChunks = kTile / kChunk;
  for (size_t t = 0; t < nchunks; t += kTileChunks) {
    size_t tn = min_size(kTileChunks, nchunks - t);
    for (int j0 = 0; j0 < k;) {
      int j1 = j0 == 0 ? kGroup : (j0 + kGroup - 1 < k ? j0 + kGroup - 1 : k);
      bool last = j1 == k;
      for (size_t c = 0; c < tn; ++c) {
        size_t i = begin + (t + c) * kChunk;
        A* slot = acc + c * kChunk;
        A a[kChunk];
        combine_chunk<Op>(kind, j0 == 0 ? nullptr : slot, src, j0, j1, i, a);
        if (!last) {
          move_chunk<sizeof(A) * kChunk>(slot, a);
        } else {
          if (scaled) scale_chunk(a, s);
          store(kind, dst + i, a, nt);
        }
      }
      j0 = j1;
    }
  }
}

// Fewer than kChunk elements: through zero-padded chunk buffers, the same arithmetic.
template <class Op, class K>
void reduce_short(K kind, typename K::S* dst, const typename K::S* const* src, int k, size_t i,
                  size_t m, bool scaled, typename K::A s) {
  using S = typename K::S;
  using A = typename K::A;
  if (m == 0) return;
  S pad[kChunk] = {};
  A a[kChunk];
  memcpy(pad, src[0] + i, m * sizeof(S));
  load(kind, pad, a);
  for (int j = 1; j < k; ++j) {
    A b[kChunk];
    memcpy(pad, src[j] + i, m * sizeof(S));
    load(kind, pad, b);
    for (size_t l = 0; l < kChunk; ++l) a[l] = Op::f(a[l], b[l]);
  }
  if (scaled) scale_chunk(a, s);
  store(kind, pad, a, false);
  memcpy(dst + i, pad, m * sizeof(S));
}

template <class Op, class K>
void reduce_kind(K kind, typename K::S* dst, const typename K::S* const* src, int k, size_t n,
                 bool scaled, typename K::A s) {
  using S = typename K::S;
  uintptr_t addr = reinterpret_cast<uintptr_t>(dst);
  bool nt = n * sizeof(S) >= kStreamBytes && addr % sizeof(S) == 0;
  if (k == 1 && !scaled) {  // a copy: bit-exact, NaN payloads included
    if (dst == src[0]) return;
    if (nt) {
      stream_bytes(dst, src[0], n * sizeof(S));
      stream_fence();
    } else {
      memcpy(dst, src[0], n * sizeof(S));
    }
    return;
  }
  size_t head = nt ? min_size(n, (kLine - addr % kLine) % kLine / sizeof(S)) : 0;
  reduce_short<Op>(kind, dst, src, k, 0, head, scaled, s);  // up to dst's first cache line
  size_t nchunks = (n - head) / kChunk;
  reduce_chunks<Op>(kind, dst, src, k, head, nchunks, scaled, s, nt);
  size_t done = head + nchunks * kChunk;
  reduce_short<Op>(kind, dst, src, k, done, n - done, scaled, s);
  if (nt) stream_fence();
}

// Native dtypes whose output stays in cache (the shared-memory engine's blocks): plain loops, one
// pass per source over an L1-sized block, which gcc turns into full-width vector loads and stores
// with no staging through chunk buffers (about twice the chunked path's speed in L1/L2). The
// order of operations is the chunked path's: ((s0 op s1) op s2) ..., then the scale.
template <class Op, class T>
void reduce_cached(T* dst, const T* const* src, int k, size_t n, bool scaled, T s) {
  constexpr size_t kBlock = 2048;
  for (size_t b = 0; b < n; b += kBlock) {
    const size_t m = min_size(kBlock, n - b);
    T* d = dst + b;
    const T* s0 = src[0] + b;
    const T* s1 = src[1] + b;
    for (size_t i = 0; i < m; ++i) d[i] = Op::f(s0[i], s1[i]);
    for (int j = 2; j < k; ++j) {
      const T* sj = src[j] + b;
      for (size_t i = 0; i < m; ++i) d[i] = Op::f(d[i], sj[i]);
    }
    if (scaled)
      for (size_t i = 0; i < m; ++i) d[i] = d[i] * s;
  }
}

template <class K>
void reduce_as(K kind, void* dst, const void* const* srcs, int k, size_t n, RedOp op, bool scaled,
               typename K::A s) {
  using S = typename K::S;
  with_op(op, [&](auto o) {
    reduce_kind<decltype(o)>(kind, static_cast<S*>(dst), reinterpret_cast<const S* const*>(srcs),
                             k, n, scaled, s);
  });
}

template <class T>
void reduce_as(Native<T> kind, void* dst, const void* const* srcs, int k, size_t n, RedOp op,
               bool scaled, T s) {
  T* d = static_cast<T*>(dst);
  auto src = reinterpret_cast<const T* const*>(srcs);
  // The cached path needs dst to alias no source it reads after the first pass.
  bool cached = k >= 2 && k <= kGroup && n * sizeof(T) < kStreamBytes;
  for (int j = 2; cached && j < k; ++j) cached = src[j] != d;
  with_op(op, [&](auto o) {
    if (cached) {
      reduce_cached<decltype(o)>(d, src, k, n, scaled, s);
    } else {
      reduce_kind<decltype(o)>(kind, d, src, k, n, scaled, s);
    }
  });
}

void reduce(void* dst, const void* const* srcs, int k, size_t n, DType t, RedOp op, double scale) {
  if (n == 0 || k < 1) return;
  bool scaled = scale != 1.0;
  switch (t) {
    case DType::f32: return reduce_as(Native<float>{}, dst, srcs, k, n, op, scaled, float(scale));
    case DType::f64: return reduce_as(Native<double>{}, dst, srcs, k, n, op, scaled, scale);
    case DType::f16: return reduce_as(F16{}, dst, srcs, k, n, op, scaled, float(scale));
    case DType::bf16: return reduce_as(BF16{}, dst, srcs, k, n, op, scaled, float(scale));
    // Integers ignore scale: the contract has callers reject scale != 1 for them.
    case DType::i32: return reduce_as(Native<int32_t>{}, dst, srcs, k, n, op, false, 1);
    case DType::i64: return reduce_as(Native<int64_t>{}, dst, srcs, k, n, op, false, 1);
  }
}

// ---------------------------------------------------------------- scale, axpy

// y = a*y + b*x over one chunk (b == 0: scale only; x unused).
template <class K>
inline void axpby_chunk(K kind, typename K::S* y, const typename K::S* x, typename K::A a,
                        typename K::A b) {
  using A = typename K::A;
  A ya[kChunk];
  load(kind, y, ya);
  if (x) {
    A xa[kChunk];
    load(kind, x, xa);
    for (size_t l = 0; l < kChunk; ++l) ya[l] = ya[l] + b * xa[l];
  } else {
    for (size_t l = 0; l < kChunk; ++l) ya[l] = ya[l] * a;
  }
  store(kind, y, ya, false);
}

// scale (x null) or axpy over n elements; the short tail goes through padded chunks.
template <class K>
void axpby(K kind, typename K::S* y, const typename K::S* x, size_t n, typename K::A a,
           typename K::A b) {
  using S = typename K::S;
  size_t i = 0;
  for (; i + kChunk <= n; i += kChunk) axpby_chunk(kind, y + i, x ? x + i : nullptr, a, b);
  if (i == n) return;
  S ypad[kChunk] = {}, xpad[kChunk] = {};
  memcpy(ypad, y + i, (n - i) * sizeof(S));
  if (x) memcpy(xpad, x + i, (n - i) * sizeof(S));
  axpby_chunk(kind, ypad, x ? xpad : nullptr, a, b);
  memcpy(y + i, ypad, (n - i) * sizeof(S));
}

// Integer dtypes are left untouched: the contract allows scale/axpy on floating dtypes only.
void scale(void* x, size_t n, DType t, double alpha) {
  float af = float(alpha);
  switch (t) {
    case DType::f32: return axpby(Native<float>{}, static_cast<float*>(x), nullptr, n, af, 0.f);
    case DType::f64: return axpby(Native<double>{}, static_cast<double*>(x), nullptr, n, alpha, 0.);
    case DType::f16: return axpby(F16{}, static_cast<uint16_t*>(x), nullptr, n, af, 0.f);
    case DType::bf16: return axpby(BF16{}, static_cast<uint16_t*>(x), nullptr, n, af, 0.f);
    default: return;
  }
}

void axpy(void* y, const void* x, size_t n, DType t, double alpha) {
  float af = float(alpha);
  using U16 = uint16_t;
  switch (t) {
    case DType::f32:
      return axpby(Native<float>{}, static_cast<float*>(y), static_cast<const float*>(x), n, 1.f,
                   af);
    case DType::f64:
      return axpby(Native<double>{}, static_cast<double*>(y), static_cast<const double*>(x), n, 1.,
                   alpha);
    case DType::f16:
      return axpby(F16{}, static_cast<U16*>(y), static_cast<const U16*>(x), n, 1.f, af);
    case DType::bf16:
      return axpby(BF16{}, static_cast<U16*>(y), static_cast<const U16*>(x), n, 1.f, af);
    default: return;
  }
}

// ---------------------------------------------------------------- norm2

// 16 float64 partial sums, element i always feeding acc[i % 16] (chunks are multiples of 16): the
// compiler keeps them in vector registers, and the summation order is the same on every ISA.
constexpr size_t kLanes = 16;
static_assert(kChunk % kLanes == 0, "lanes must not shift between chunks");

template <class K>
double norm2_as(K kind, const typename K::S* x, size_t n) {
  using S = typename K::S;
  using A = typename K::A;
  double acc[kLanes] = {};
  auto add_chunk = [&acc](const A* a) {
    for (size_t l = 0; l < kChunk; l += kLanes)
      for (size_t j = 0; j < kLanes; ++j) {
        double v = double(a[l + j]);
        acc[j] += v * v;
      }
  };
  size_t i = 0;
  for (; i + kChunk <= n; i += kChunk) {
    A a[kChunk];
    load(kind, x + i, a);
    add_chunk(a);
  }
  if (i < n) {  // zero padding adds exact zeros
    S pad[kChunk] = {};
    A a[kChunk];
    memcpy(pad, x + i, (n - i) * sizeof(S));
    load(kind, pad, a);
    add_chunk(a);
  }
  for (size_t w = kLanes / 2; w >= 1; w /= 2)
    for (size_t j = 0; j < w; ++j) acc[j] += acc[j + w];
  return __builtin_sqrt(acc[0]);
}

double norm2(const void* x, size_t n, DType t) {
  using U16 = uint16_t;
  switch (t) {
    case DType::f32: return norm2_as(Native<float>{}, static_cast<const float*>(x), n);
    case DType::f64: return norm2_as(Native<double>{}, static_cast<const double*>(x), n);
    case DType::f16: return norm2_as(F16{}, static_cast<const U16*>(x), n);
    case DType::bf16: return norm2_as(BF16{}, static_cast<const U16*>(x), n);
    case DType::i32: return norm2_as(Native<int32_t>{}, static_cast<const int32_t*>(x), n);
    case DType::i64: return norm2_as(Native<int64_t>{}, static_cast<const int64_t*>(x), n);
  }
  return 0.0;
}

// ---------------------------------------------------------------- copy

// glibc's memcpy for what stays in cache; big copies stream exactly like the reduce kernels'
// output, so copy is the fair ceiling they are measured against.
void copy(void* dst, const void* src, size_t bytes) {
  if (bytes >= kStreamBytes) {
    stream_bytes(dst, src, bytes);
    stream_fence();
  } else {
    memcpy(dst, src, bytes);
  }
}

}  // namespace

const KernelTable& table() {
  static const KernelTable t = {MLF_ISA_NAME, reduce, scale, axpy, norm2, copy};
  return t;
}

}  // namespace MLF_ISA_NS
}  // namespace mlf
