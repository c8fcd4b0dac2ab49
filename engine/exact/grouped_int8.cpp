// engine.exact.grouped_int8's kernel: y = x @ W.T (+ bias) for
//   W[n, k] = scale[n, g] * code[n, k] + low[n, g]      g = k / 32, code in 0..120 (at most 127: see maddubs below)
//   x[r, k] ~ xscale[r, g] * xq[r, k]                   xq in -127..127, xscale = max |x[r, group g]| / 127
// so y[r, n] = sum over g of  int(code . xq) * (scale[n, g] * xscale[r, g])  +  low[n, g] * (xscale[r, g] * sum xq)
// (+ bias[n]), the group's dot product an integer, the rest float32, summed over g in order.
//
// Layout: outputs in blocks of 16, one 32-bit lane each. For block b and group g, 512 bytes hold
// code[16 b + j, 32 g + 4 q + t] at [q][j][t]: one vector of 16 lanes x 4 codes per q, against 4 activations
// broadcast to every lane, so a block's 16 dot products grow side by side and no sum runs across lanes
// (how llama.cpp and oneDNN lay out int8 weights). scale and low: [block][group][16].
//
// 4-bit codes ("int4" layers, code in 0..15: a GGUF Q4_K group's own codes) take half the bytes: for block b and group
// g, 256 bytes hold at [p][j][t] (p in 0..3) code[16 b + j, 32 g + 8 p + t] in the low nibble and
// code[16 b + j, 32 g + 8 p + 4 + t] in the high one. Unpacked, each nibble is the vector the 8-bit layout has for
// q = 2 p or 2 p + 1, and the arithmetic is the same.
//
// The Q4_K form (int4 layers from a GGUF Q4_K tensor) keeps the file's scale terms instead of float32 scale and low:
// per block, super-block s of 8 groups and lane j, fp16 d and -dmin at [s][0][j] and [s][1][j]; per group g, 6-bit
// sc and m as bytes at [g][0][j] and [g][1][j]. The kernel computes scale = float(d) * sc and low = float(-dmin) * m
// in float32 (bitwise -(float(dmin) * m): rounding is symmetric in sign), as engine.loading.gguf_dequant's
// four_bit_groups does, then the same steps as with stored ones: the same bits from 18.5 bytes per 32 weights
// instead of 24 (a decoding step reads every weight once).
//
// The Q6_K form (int6 layers: a GGUF Q6_K tensor's own codes and scales) has w = s * (q - 32), q in 0..63, with one
// scale s = float(d) * sc per 16 weights (fp16 d per super-block of 256, int8 sc). A block and group hold 384 bytes,
// per half of the group (quads 4 half .. 4 half + 3, 16 weights) three vectors [k][j][t] (k in 0..2) whose byte holds
// the code of quad 4 half + k in its low 6 bits and bits 2 k, 2 k + 1 of the code of quad 4 half + 3 in its top 2:
// three codes come out with one mask each, the fourth from the three top pairs. Each half has its own integer sum, of
// (q - 32) * xq: the sum of q * xq less 32 times the activations' sum over those 16 (computed with the activations).
// Scales: d at [s][j], sc at [2 g + half][j]. 26.25 bytes per 32 weights, as in the file, against the 8-bit layout's 40.
//
// Each output element comes from its own input row by one fixed sequence of operations, whatever the number of
// rows in the pass or which rows share a call: a row gets the same bits in a pass of 1 row or of 300
// (tests/test_int8_target.py). Built with -ffp-contract=off, so the compiler fuses no multiply-add of its own.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>

namespace {

constexpr int G = 32;        // weights and activations sharing one scale
constexpr int LANES = 16;    // outputs in a block
constexpr int BLOCK = G * LANES;  // bytes of codes per block and group
constexpr int SUPER = 8;     // groups per Q4_K super-block
// Codes are asked for this many bytes ahead of the group being summed. With several rows a cache line takes long
// enough to compute that the hardware prefetcher alone leaves memory idle between lines: the default target's Linears
// over 5 rows took 1.73 times 1 row's time without, 1.36 with (a 2-core AMD EPYC Zen 4; 2 and 8 KB did as well).
constexpr int AHEAD = 4096;

// ask for the BYTES bytes AHEAD bytes past `c` (a prefetch never faults: past the codes' end it does nothing)
template <int BYTES>
inline void fetch_ahead(const uint8_t* c) {
  for (int l = 0; l < BYTES; l += 64) _mm_prefetch(reinterpret_cast<const char*>(c + AHEAD + l), _MM_HINT_T0);
}

// 8-bit codes, 4-bit codes, 4-bit codes with the Q4_K form's scales, 6-bit codes with the Q6_K form's
enum Form { INT8, INT4, INT4_K, INT6_K };

// bytes of codes per block and group
template <Form F>
constexpr int group_bytes() { return F == INT8 ? BLOCK : F == INT6_K ? BLOCK * 3 / 4 : BLOCK / 2; }
// integer sums (and scales) per group: a Q6_K group has a scale per 16 weights
template <Form F>
constexpr int halves() { return F == INT6_K ? 2 : 1; }

inline int32_t quad(const int8_t* p) {  // 4 activations as one 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// 8 bytes, or 8 float16 (F16C's conversion: every CPU with AVX2 and FMA has it), as float32
inline __m256 floats8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 floats8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 floats8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// a Q6_K half's four quads of codes from its three vectors v0, v1, v2 (see the layout above); shifts of 16-bit lanes,
// whose bits that cross into the neighbouring byte the masks drop
inline void six_bit_codes(__m256i v0, __m256i v1, __m256i v2, __m256i* c) {
  const __m256i low6 = _mm256_set1_epi8(0x3F);
  c[0] = _mm256_and_si256(v0, low6);
  c[1] = _mm256_and_si256(v1, low6);
  c[2] = _mm256_and_si256(v2, low6);
  c[3] = _mm256_or_si256(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v0, 6), _mm256_set1_epi8(0x03)),
                                         _mm256_and_si256(_mm256_srli_epi16(v1, 4), _mm256_set1_epi8(0x0C))),
                         _mm256_and_si256(_mm256_srli_epi16(v2, 2), _mm256_set1_epi8(0x30)));
}

// group g's scale and low in lanes 8 h .. 8 h + 7 (INT6_K: the scale of half `half`; no low)
template <Form F>
inline void scales_avx2(const void* scale, const void* low, int64_t g, int half, int h, __m256& s, __m256& lo) {
  if constexpr (F == INT6_K) {
    const uint16_t* d = static_cast<const uint16_t*>(scale) + g / SUPER * LANES + 8 * h;
    const int8_t* sc = static_cast<const int8_t*>(low) + (2 * g + half) * LANES + 8 * h;
    s = _mm256_mul_ps(floats8(d), floats8(sc));
    lo = _mm256_setzero_ps();
  } else if constexpr (F == INT4_K) {
    const uint16_t* dm = static_cast<const uint16_t*>(scale) + g / SUPER * 2 * LANES + 8 * h;
    const uint8_t* sm = static_cast<const uint8_t*>(low) + g * 2 * LANES + 8 * h;
    s = _mm256_mul_ps(floats8(dm), floats8(sm));
    lo = _mm256_mul_ps(floats8(dm + LANES), floats8(sm + LANES));
  } else {
    s = _mm256_loadu_ps(static_cast<const float*>(scale) + g * LANES + 8 * h);
    lo = _mm256_loadu_ps(static_cast<const float*>(low) + g * LANES + 8 * h);
  }
}

// AVX2: a block as two halves of 8 lanes; maddubs + madd give each lane its 4 products' sum (code * xq <= 127 * 127,
// a pair fits int16). R rows at a time.
template <int R, Form F>
void block_avx2(const uint8_t* code, const void* scale, const void* low, int64_t groups, const int8_t* const* xq,
                const float* const* xs, const float* const* xl, const int32_t* const* xoff, float* const* y) {
  constexpr int QUADS = G / 4 / halves<F>();  // quads under one scale
  const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(0x0F);
  __m256 acc[R][2], first[R][2];  // first: a Q6_K group's first half, scaled
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* c = code + g * group_bytes<F>();
    fetch_ahead<group_bytes<F>()>(c);
    for (int half = 0; half < halves<F>(); ++half) {
      __m256i six[2][4];  // INT6_K: the half's four quads of codes, [half of the lanes][quad]
      if constexpr (F == INT6_K) {
        for (int h = 0; h < 2; ++h) {
          const uint8_t* v = c + half * 3 * 64 + 32 * h;
          six_bit_codes(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v)),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 64)),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 128)), six[h]);
        }
      }
      __m256i dot[R][2];
      for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
      for (int q = half * QUADS; q < (half + 1) * QUADS; q += 2) {
        __m256i cq[2][2];  // the codes of quads q and q + 1, [quad][half of the lanes]
        for (int h = 0; h < 2; ++h) {
          if constexpr (F == INT8) {
            cq[0][h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + q * 64 + 32 * h));
            cq[1][h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + q * 64 + 64 + 32 * h));
          } else if constexpr (F == INT6_K) {
            cq[0][h] = six[h][q % 4];
            cq[1][h] = six[h][q % 4 + 1];
          } else {
            const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + q * 32 + 32 * h));
            cq[0][h] = _mm256_and_si256(b, nibble);
            cq[1][h] = _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble);
          }
        }
        for (int r = 0; r < R; ++r) {
          for (int e = 0; e < 2; ++e) {
            const __m256i a = _mm256_set1_epi32(quad(xq[r] + g * G + (q + e) * 4));
            for (int h = 0; h < 2; ++h)
              dot[r][h] = _mm256_add_epi32(dot[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(cq[e][h], a), ones));
          }
        }
      }
      for (int h = 0; h < 2; ++h) {
        __m256 s, lo;
        scales_avx2<F>(scale, low, g, half, h, s, lo);
        for (int r = 0; r < R; ++r) {
          if constexpr (F == INT6_K) {  // the sum of (q - 32) * xq, an integer, times s; the group's two, times xs
            const __m256 sum = _mm256_cvtepi32_ps(_mm256_sub_epi32(dot[r][h], _mm256_set1_epi32(xoff[r][2 * g + half])));
            if (half == 0) {
              first[r][h] = _mm256_mul_ps(sum, s);
            } else {
              acc[r][h] = _mm256_fmadd_ps(_mm256_fmadd_ps(sum, s, first[r][h]), _mm256_set1_ps(xs[r][g]), acc[r][h]);
            }
          } else {
            acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), _mm256_mul_ps(s, _mm256_set1_ps(xs[r][g])),
                                        acc[r][h]);
            acc[r][h] = _mm256_fmadd_ps(lo, _mm256_set1_ps(xl[r][g]), acc[r][h]);
          }
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y[r], acc[r][0]);
    _mm256_storeu_ps(y[r] + 8, acc[r][1]);
  }
}

// AVX-512 VNNI: dpbusd does maddubs + madd + add in one instruction, 16 lanes at once. Its sums are the same
// integers and the float steps the same operations lane by lane: both kernels give the same bits.
#define VNNI __attribute__((target("avx512f,avx512vl,avx512bw,avx512vnni")))

VNNI inline __m512 floats16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
VNNI inline __m512 floats16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
VNNI inline __m512 floats16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
VNNI inline void six_bit_codes(__m512i v0, __m512i v1, __m512i v2, __m512i* c) {
  const __m512i low6 = _mm512_set1_epi8(0x3F);
  c[0] = _mm512_and_si512(v0, low6);
  c[1] = _mm512_and_si512(v1, low6);
  c[2] = _mm512_and_si512(v2, low6);
  c[3] = _mm512_or_si512(_mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v0, 6), _mm512_set1_epi8(0x03)),
                                         _mm512_and_si512(_mm512_srli_epi16(v1, 4), _mm512_set1_epi8(0x0C))),
                         _mm512_and_si512(_mm512_srli_epi16(v2, 2), _mm512_set1_epi8(0x30)));
}

template <Form F>
VNNI inline void scales_vnni(const void* scale, const void* low, int64_t g, int half, __m512& s, __m512& lo) {
  if constexpr (F == INT6_K) {
    s = _mm512_mul_ps(floats16(static_cast<const uint16_t*>(scale) + g / SUPER * LANES),
                      floats16(static_cast<const int8_t*>(low) + (2 * g + half) * LANES));
    lo = _mm512_setzero_ps();
  } else if constexpr (F == INT4_K) {
    const uint16_t* dm = static_cast<const uint16_t*>(scale) + g / SUPER * 2 * LANES;
    const uint8_t* sm = static_cast<const uint8_t*>(low) + g * 2 * LANES;
    s = _mm512_mul_ps(floats16(dm), floats16(sm));
    lo = _mm512_mul_ps(floats16(dm + LANES), floats16(sm + LANES));
  } else {
    s = _mm512_loadu_ps(static_cast<const float*>(scale) + g * LANES);
    lo = _mm512_loadu_ps(static_cast<const float*>(low) + g * LANES);
  }
}

template <int R, Form F>
VNNI void block_vnni(const uint8_t* code, const void* scale, const void* low, int64_t groups,
                     const int8_t* const* xq, const float* const* xs, const float* const* xl,
                     const int32_t* const* xoff, float* const* y) {
  constexpr int QUADS = G / 4 / halves<F>();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[R], first[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* c = code + g * group_bytes<F>();
    fetch_ahead<group_bytes<F>()>(c);
    for (int half = 0; half < halves<F>(); ++half) {
      __m512i six[4];
      if constexpr (F == INT6_K) {
        const uint8_t* v = c + half * 3 * 64;
        six_bit_codes(_mm512_loadu_si512(v), _mm512_loadu_si512(v + 64), _mm512_loadu_si512(v + 128), six);
      }
      // integer sums (exact, so in any order): for 1 or 2 rows two chains a row, so that dpbusd's latency overlaps;
      // from 3 rows one a row, which leaves registers for 8 rows
      constexpr bool TWO = R < 3;
      __m512i dot[R], odd[R];
      for (int r = 0; r < R; ++r) dot[r] = odd[r] = _mm512_setzero_si512();
      for (int q = half * QUADS; q < (half + 1) * QUADS; q += 2) {
        __m512i c0, c1;  // the codes of quads q and q + 1
        if constexpr (F == INT8) {
          c0 = _mm512_loadu_si512(c + q * 64);
          c1 = _mm512_loadu_si512(c + q * 64 + 64);
        } else if constexpr (F == INT6_K) {
          c0 = six[q % 4];
          c1 = six[q % 4 + 1];
        } else {
          const __m512i b = _mm512_loadu_si512(c + q * 32);
          c0 = _mm512_and_si512(b, nibble);
          c1 = _mm512_and_si512(_mm512_srli_epi16(b, 4), nibble);
        }
        for (int r = 0; r < R; ++r) {
          const __m512i a0 = _mm512_set1_epi32(quad(xq[r] + g * G + q * 4));
          const __m512i a1 = _mm512_set1_epi32(quad(xq[r] + g * G + q * 4 + 4));
          if constexpr (TWO) {
            dot[r] = _mm512_dpbusd_epi32(dot[r], c0, a0);
            odd[r] = _mm512_dpbusd_epi32(odd[r], c1, a1);
          } else {
            dot[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot[r], c0, a0), c1, a1);
          }
        }
      }
      if constexpr (TWO) for (int r = 0; r < R; ++r) dot[r] = _mm512_add_epi32(dot[r], odd[r]);
      __m512 s, lo;
      scales_vnni<F>(scale, low, g, half, s, lo);
      for (int r = 0; r < R; ++r) {
        if constexpr (F == INT6_K) {  // as block_avx2, lane by lane
          const __m512 sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot[r], _mm512_set1_epi32(xoff[r][2 * g + half])));
          if (half == 0) {
            first[r] = _mm512_mul_ps(sum, s);
          } else {
            acc[r] = _mm512_fmadd_ps(_mm512_fmadd_ps(sum, s, first[r]), _mm512_set1_ps(xs[r][g]), acc[r]);
          }
        } else {
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(s, _mm512_set1_ps(xs[r][g])), acc[r]);
          acc[r] = _mm512_fmadd_ps(lo, _mm512_set1_ps(xl[r][g]), acc[r]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y[r], acc[r]);
}

constexpr int AVX2_ROWS = 4;  // rows a block call takes at most (AVX2 has 16 vector registers, AVX-512 32)
constexpr int VNNI_ROWS = 8;
constexpr int64_t ROWS_IN_CACHE = 64;  // rows whose activations stay in cache while every block passes

using BlockFn = void (*)(const uint8_t*, const void*, const void*, int64_t, const int8_t* const*,
                         const float* const*, const float* const*, const int32_t* const*, float* const*);
// the kernel for R rows at [form][R - 1]
#define ROWS_1_TO_4(f, F) {f<1, F>, f<2, F>, f<3, F>, f<4, F>}
#define ROWS_1_TO_8(f, F) {f<1, F>, f<2, F>, f<3, F>, f<4, F>, f<5, F>, f<6, F>, f<7, F>, f<8, F>}
constexpr BlockFn AVX2_BLOCK[4][AVX2_ROWS] = {ROWS_1_TO_4(block_avx2, INT8), ROWS_1_TO_4(block_avx2, INT4),
                                       ROWS_1_TO_4(block_avx2, INT4_K), ROWS_1_TO_4(block_avx2, INT6_K)};
constexpr BlockFn VNNI_BLOCK[4][VNNI_ROWS] = {ROWS_1_TO_8(block_vnni, INT8), ROWS_1_TO_8(block_vnni, INT4),
                                              ROWS_1_TO_8(block_vnni, INT4_K), ROWS_1_TO_8(block_vnni, INT6_K)};

// x rows [M, K] float32 -> xq [M, K] int8, xscale [M, groups], xlow [M, groups] = xscale * the group's sum of xq,
// and xoff [M, 2 groups] int32: 32 times the sum of xq over each 16 (the Q6_K form's offset: w = s * (q - 32))
std::vector<torch::Tensor> quantize_rows(const torch::Tensor& x, int64_t groups) {
  const int64_t M = x.size(0), K = x.size(1);
  auto xq = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto sc = torch::empty({M, groups}, x.options());
  auto lo = torch::empty({M, groups}, x.options());
  auto sums = torch::empty({M, 2 * groups}, x.options().dtype(torch::kInt32));
  const float* X = x.data_ptr<float>();
  int8_t* Q = xq.data_ptr<int8_t>();
  float* S = sc.data_ptr<float>();
  float* L = lo.data_ptr<float>();
  int32_t* H = sums.data_ptr<int32_t>();
  at::parallel_for(0, M * groups, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {  // group i of the flat [M * groups]: rows are contiguous
      const float* v = X + i * G;
      float amax = 0.f;
      for (int k = 0; k < G; ++k) amax = std::max(amax, std::fabs(v[k]));
      const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
      int half[2] = {0, 0};
      for (int k = 0; k < G; ++k) {
        const int q = static_cast<int>(std::nearbyint(v[k] * inv));
        Q[i * G + k] = static_cast<int8_t>(q);
        half[k / (G / 2)] += q;
      }
      S[i] = d;
      L[i] = d * static_cast<float>(half[0] + half[1]);
      H[2 * i] = 32 * half[0];
      H[2 * i + 1] = 32 * half[1];
    }
  });
  return {xq, sc, lo, sums};
}

}  // namespace

bool vnni_supported() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
}

// x [..., K] float32; code [N16 / 16, K / 32, 512] uint8 (or 256: 4-bit codes); scale, low [N16 / 16, K / 32, 16]
// float32, or the Q4_K form's (4-bit codes): scale = d and -dmin [N16 / 16, K / 256, 2, 16] float16, low = sc and m
// [N16 / 16, K / 32, 2, 16] uint8, or the Q6_K form's (code [N16 / 16, K / 32, 384]): scale = d [N16 / 16, K / 256, 16]
// float16, low = sc [N16 / 16, K / 16, 16] int8; bias [N] or None -> y [..., N] (N <= N16 = N rounded up to 16)
torch::Tensor linear(torch::Tensor x, torch::Tensor code, torch::Tensor scale, torch::Tensor low,
                     c10::optional<torch::Tensor> bias, int64_t N, bool vnni) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && code.dtype() == torch::kUInt8, "float32 x and uint8 codes");
  TORCH_CHECK(code.is_contiguous() && scale.is_contiguous() && low.is_contiguous(), "contiguous weights");
  TORCH_CHECK(!vnni || vnni_supported(), "this CPU has no AVX-512 VNNI");
  const int64_t blocks = code.size(0), groups = code.size(1), K = groups * G, N16 = blocks * LANES;
  const int64_t width = code.size(2);
  TORCH_CHECK(width == BLOCK || width == BLOCK / 2 || width == BLOCK * 3 / 4,
              "a block holds 512 codes, 256 bytes of 4-bit ones or 384 of 6-bit ones");
  const Form form = width == BLOCK ? INT8 : width == BLOCK * 3 / 4 ? INT6_K
                    : scale.dtype() == torch::kFloat16 ? INT4_K : INT4;
  if (form == INT6_K) {
    TORCH_CHECK(groups % SUPER == 0 && scale.dtype() == torch::kFloat16 && low.dtype() == torch::kInt8,
                "the Q6_K form: float16 d, int8 sc");
    TORCH_CHECK(scale.numel() == blocks * groups / SUPER * LANES && low.numel() == blocks * groups * 2 * LANES,
                "the Q6_K form's scales: [N16 / 16, K / 256, 16] and [N16 / 16, K / 16, 16]");
  } else if (form == INT4_K) {
    TORCH_CHECK(groups % SUPER == 0 && low.dtype() == torch::kUInt8, "the Q4_K form: float16 d, -dmin; uint8 sc, m");
    TORCH_CHECK(scale.numel() == blocks * groups / SUPER * 2 * LANES && low.numel() == blocks * groups * 2 * LANES,
                "the Q4_K form's scales: [N16 / 16, K / 256, 2, 16] and [N16 / 16, K / 32, 2, 16]");
  } else {
    TORCH_CHECK(scale.dtype() == torch::kFloat32 && low.dtype() == torch::kFloat32, "float32 scales and lows");
    TORCH_CHECK(scale.numel() == blocks * groups * LANES && low.numel() == blocks * groups * LANES,
                "scales and lows: [N16 / 16, K / 32, 16]");
  }
  const int64_t block_bytes = groups * code.size(2);
  // a block's scales and lows: bytes from one block's to the next's
  const int64_t scale_bytes = scale.nbytes() / blocks, low_bytes = low.nbytes() / blocks;
  auto shape = x.sizes().vec();
  TORCH_CHECK(shape.back() == K, "the input's width must be the layer's");
  auto rows = x.reshape({-1, K}).contiguous();
  const int64_t M = rows.size(0);
  auto y = torch::empty({M, N16}, x.options());
  auto qx = quantize_rows(rows, groups);
  const int8_t* XQ = qx[0].data_ptr<int8_t>();
  const float* XS = qx[1].data_ptr<float>();
  const float* XL = qx[2].data_ptr<float>();
  const int32_t* XH = qx[3].data_ptr<int32_t>();
  const uint8_t* C = code.data_ptr<uint8_t>();
  const uint8_t* S = static_cast<const uint8_t*>(scale.data_ptr());
  const uint8_t* L = static_cast<const uint8_t*>(low.data_ptr());
  float* Y = y.data_ptr<float>();
  for (int64_t m0 = 0; m0 < M; m0 += ROWS_IN_CACHE) {
    const int64_t m1 = std::min(M, m0 + ROWS_IN_CACHE);
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        // the rows in calls of nearly equal size (5 rows on AVX2 as 3 + 2, not 4 + 1: one row alone waits on latency)
        const int64_t most = vnni ? VNNI_ROWS : AVX2_ROWS, calls = (m1 - m0 + most - 1) / most;
        for (int64_t i = 0, r0 = m0; i < calls; ++i) {
          const int R = static_cast<int>((m1 - m0) * (i + 1) / calls - (m1 - m0) * i / calls);
          const int8_t* xq[VNNI_ROWS];
          const float* xs[VNNI_ROWS];
          const float* xl[VNNI_ROWS];
          const int32_t* xoff[VNNI_ROWS];
          float* out[VNNI_ROWS];
          for (int r = 0; r < R; ++r) {
            xq[r] = XQ + (r0 + r) * K;
            xs[r] = XS + (r0 + r) * groups;
            xl[r] = XL + (r0 + r) * groups;
            xoff[r] = XH + (r0 + r) * 2 * groups;
            out[r] = Y + (r0 + r) * N16 + b * LANES;
          }
          (vnni ? VNNI_BLOCK[form] : AVX2_BLOCK[form])[R - 1](C + b * block_bytes, S + b * scale_bytes,
                                                              L + b * low_bytes, groups, xq, xs, xl, xoff, out);
          r0 += R;
        }
      }
    });
  }
  if (bias.has_value()) y.narrow(1, 0, N).add_(*bias);  // after the sums, as a separate step for every row
  shape.back() = N;
  return N == N16 ? y.view(shape) : y.narrow(1, 0, N).reshape(shape);
}

void register_decoder_layer(pybind11::module_& m);  // decoder_layer.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear);
  m.def("vnni_supported", &vnni_supported);
  register_decoder_layer(m);
}
