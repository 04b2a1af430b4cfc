/* One batch-1 decode step of a Llama-family decoder, written for memory bandwidth.
 *
 * At batch 1 a decode step reads every weight once and does two flops with each: its speed is
 * how fast the weights stream from memory. This file does the whole step (embedding row, thirty
 * layers, final norm, output head, argmax) in one call from Python, so nothing runs between the
 * products: no operator dispatch, no graph guards, no temporary tensors. Each product splits its
 * output rows between the threads of PyTorch's own OpenMP pool (the library links the libgomp
 * that PyTorch has already loaded), and each thread streams four weight rows at a time against
 * one read of the input vector.
 *
 * Weights stay where the model keeps them (nn.Linear's [out, in] rows, row-major); the KV cache
 * is the caller's [n_kv_heads, capacity, head_dim] buffer per layer. Weight formats: fp32, bf16 (the
 * upper half of an fp32, widened in registers) and int8 (one fp32 scale per output row, applied to
 * the row's sum); activations and sums are always fp32.
 *
 * The second half of the file is the serving engine's step (infra_native_batch_step): any number
 * of tokens from several sequences at once, their K/V in the engine's paged store, the weights
 * packed in panels (see there).
 *
 * Built by infra_lib.model.native_decode with the system C compiler for this machine's CPU.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#define THREAD_ID() omp_get_thread_num()
#define THREAD_COUNT() omp_get_num_threads()
#else
#define THREAD_ID() 0
#define THREAD_COUNT() 1
#endif

enum { FORMAT_FP32 = 0, FORMAT_BF16 = 1, FORMAT_INT8 = 2, FORMAT_Q4_1 = 3, FORMAT_INT4 = 4, FORMAT_Q8_0 = 5 };

/* per-layer pointers, in this order (the Python side fills them) */
enum {
    P_IN_NORM, P_Q, P_K, P_V, P_QB, P_KB, P_VB, P_O, P_OB, P_POST_NORM, P_GATE, P_UP, P_DOWN,
    P_KEYS, P_VALUES,
    /* int8: one fp32 scale per output row of each projection; Q4_1 and int4: the block scales
     * (NULL for fp32 and bf16) */
    P_Q_SCALE, P_K_SCALE, P_V_SCALE, P_O_SCALE, P_GATE_SCALE, P_UP_SCALE, P_DOWN_SCALE,
    /* Q4_1 only (NULL otherwise): the block minima */
    P_Q_MIN, P_K_MIN, P_V_MIN, P_O_MIN, P_GATE_MIN, P_UP_MIN, P_DOWN_MIN, P_COUNT
};

/* dims[]: model shape and this step */
enum {
    D_HIDDEN, D_HEADS, D_KV_HEADS, D_HEAD_DIM, D_INTER, D_VOCAB, D_LAYERS, D_CAPACITY, D_POS, D_TOKEN,
    D_THREADS, D_FORMAT, D_GROUP, D_HEAD_FORMAT, D_COUNT
};

int infra_native_abi(void) { return 5; }
int infra_native_param_count(void) { return P_COUNT; }
int infra_native_dim_count(void) { return D_COUNT; }
/* 1 when built with OpenMP (products split over the threads), 0 when single-threaded */
int infra_native_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

static inline float bf16_to_float(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

/* Ask for the next group of four rows (up to r1) while this one is summed. Rows of a few hundred
 * weights are too short for the hardware prefetcher to get far ahead of four interleaved streams;
 * measured on a 1.2 GB weight, 2 threads: bf16 16 -> 22 GB/s, fp32 unchanged at about 26. */
static inline void prefetch_next_group(const char *base, long r, long r1, long row_bytes) {
    long first = r + 4, last = r + 8 < r1 ? r + 8 : r1;
    const char *p = base + first * row_bytes, *end = base + last * row_bytes;
    for (; p < end; p += 64) __builtin_prefetch(p, 0, 3);
}

static inline float fp32_to_float(float f) { return f; }
static inline float int8_to_float(int8_t q) { return (float)q; }

/* y[r] = W[r, :] . x for rows r0..r1 of a row-major [rows, n] weight whose elements are TYPE,
 * widened to fp32 by WIDEN: four rows at a time against one read of x, then the rows left over */
#define ROWS_DOT(TYPE, WIDEN)                                                                      \
    do {                                                                                           \
        const TYPE *W = (const TYPE *)weight;                                                      \
        for (; r + 4 <= r1; r += 4) {                                                              \
            prefetch_next_group((const char *)W, r, r1, n * (long)sizeof(TYPE));                   \
            const TYPE *w0 = W + r * n, *w1 = w0 + n, *w2 = w1 + n, *w3 = w2 + n;                 \
            float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;                                          \
            for (long i = 0; i < n; i++) {                                                         \
                float xi = x[i];                                                                   \
                s0 += WIDEN(w0[i]) * xi; s1 += WIDEN(w1[i]) * xi;                                  \
                s2 += WIDEN(w2[i]) * xi; s3 += WIDEN(w3[i]) * xi;                                  \
            }                                                                                      \
            y[r] = s0; y[r + 1] = s1; y[r + 2] = s2; y[r + 3] = s3;                                \
        }                                                                                          \
        for (; r < r1; r++) {                                                                      \
            const TYPE *w0 = W + r * n;                                                            \
            float s0 = 0.f;                                                                        \
            for (long i = 0; i < n; i++) s0 += WIDEN(w0[i]) * x[i];                                \
            y[r] = s0;                                                                             \
        }                                                                                          \
    } while (0)

/* bf16 weights two at a time: a 32-bit load holds weights 2i (low half) and 2i + 1 (high half), and
 * each becomes an fp32 with one shift or one mask, no widening shuffle; x is split into its even and
 * odd elements once per call to match. Measured on a 1.2 GB weight, 2 threads: 19 -> 22 GB/s.
 * (Reading uint16 data through a uint32 pointer is why the library is built with
 * -fno-strict-aliasing.) */
static inline float low_bf16(uint32_t pair) { union { uint32_t u; float f; } v; v.u = pair << 16; return v.f; }
static inline float high_bf16(uint32_t pair) { union { uint32_t u; float f; } v; v.u = pair & 0xffff0000u; return v.f; }
#define MAX_PAIRED_INPUT 16384

static void rows_dot_bf16_pairs(const uint16_t *W, const float *x, float *y, long r, long r1, long n) {
    const long m = n / 2;
    float xe[MAX_PAIRED_INPUT / 2], xo[MAX_PAIRED_INPUT / 2];
    for (long i = 0; i < m; i++) { xe[i] = x[2 * i]; xo[i] = x[2 * i + 1]; }
    for (; r + 4 <= r1; r += 4) {
        prefetch_next_group((const char *)W, r, r1, n * 2);
        const uint32_t *w0 = (const uint32_t *)(W + r * n), *w1 = w0 + m, *w2 = w1 + m, *w3 = w2 + m;
        float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
        for (long i = 0; i < m; i++) {
            float e = xe[i], o = xo[i];
            s0 += low_bf16(w0[i]) * e + high_bf16(w0[i]) * o;
            s1 += low_bf16(w1[i]) * e + high_bf16(w1[i]) * o;
            s2 += low_bf16(w2[i]) * e + high_bf16(w2[i]) * o;
            s3 += low_bf16(w3[i]) * e + high_bf16(w3[i]) * o;
        }
        y[r] = s0; y[r + 1] = s1; y[r + 2] = s2; y[r + 3] = s3;
    }
    for (; r < r1; r++) {
        const uint32_t *w0 = (const uint32_t *)(W + r * n);
        float s0 = 0.f;
        for (long i = 0; i < m; i++) s0 += low_bf16(w0[i]) * xe[i] + high_bf16(w0[i]) * xo[i];
        y[r] = s0;
    }
}

/* y[r] = W[r, :] . x for rows r0..r1, in the step's weight format; int8 rows are then scaled by
 * their row's scale (q * scale is the weight, so the sum of q * x times scale is the product) */
static void rows_dot(const void *weight, const float *scale, int format, const float *x, float *y, long r0,
                     long r1, long n) {
    long r = r0;
    if (format == FORMAT_FP32) ROWS_DOT(float, fp32_to_float);
    else if (format == FORMAT_INT8) {
        ROWS_DOT(int8_t, int8_to_float);
        for (long i = r0; i < r1; i++) y[i] *= scale[i];
    } else if (n % 2 == 0 && n <= MAX_PAIRED_INPUT) rows_dot_bf16_pairs((const uint16_t *)weight, x, y, r0, r1, n);
    else ROWS_DOT(uint16_t, bf16_to_float);  /* an odd row length: one weight at a time */
}

/* ---------------------------------------------------------------------------------------------
 * 4-bit weights (and the 8-bit head beside them), read in their stored blocks of 32 weights.
 *
 * Q4_1 (the GGUF file's own format): per block an fp16 scale d, an fp16 minimum m and 16 bytes of
 * nibbles (the low nibbles are weights 0-15, the high ones 16-31): w = d * q + m, q in 0..15.
 * int4 (chapter 09's group-wise rule): nibbles u = q + 8 (byte j holds weights 2j and 2j + 1),
 * one fp32 scale per `group` blocks: w = scale * (u - 8). Q8_0 (the file's embedding table, which
 * is also its output head): per block an fp16 scale d and 32 int8 values: w = d * q.
 *
 * Turning every nibble into a float and multiplying it costs more instructions than the weight
 * takes to arrive, so these products run on integers, as llama.cpp's do: the activation vector is
 * quantised once per product to int8, per block of 32 (dx = max |x| / 127, qx = round(x / dx)),
 * and each block's integer sum of q * qx (u8 x s8 products, four at a time into int32 lanes: one
 * AVX-512 VNNI instruction per 64 weights) is scaled by d * dx. The minimum's part is
 * m * dx * sum(qx), so a product is exactly the dequantised weights times the rounded activations
 * (with the block's exact sum of x instead, Q4_1's error would be d * sum(q * e), e the rounding
 * errors: q is 0..15, all of one sign, where w = d * q + m is centred). Q8_0's signed weights become
 * unsigned by adding 128 (a flip of each byte's top bit), and int4's nibbles are u = q + 8: the
 * integer sum then starts from -128 (or -8) times the sum of qx, which the quantiser also makes,
 * so the offset cancels exactly in integers (cancelled in floats instead, as d * dx * sum(u * qx)
 * minus 8 * d * dx * sum(qx), it cost a random 2-layer model's logits up to 0.7 in 80).
 * ------------------------------------------------------------------------------------------- */
#define QBLOCK 32
#define MAX_Q_INPUT 16384  /* the longest row a 4-bit product takes (the Python side checks) */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define Q_VNNI 1  /* 512-bit integer products; otherwise the portable loops below */
#else
#define Q_VNNI 0
#endif

/* which 4-bit path this build runs: 512 (AVX-512 VNNI) or 0 (portable C, vectorised as the
 * compiler can) */
int infra_native_q4_path(void) { return Q_VNNI ? 512 : 0; }

static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    union { uint32_t u; float f; } v;
    if (exponent == 0x1f) v.u = sign | 0x7f800000u | (mantissa << 13);
    else if (exponent) v.u = sign | ((exponent + 112) << 23) | (mantissa << 13);
    else { v.f = (float)mantissa * (1.0f / 16777216.0f); v.u |= sign; }  /* zero or subnormal */
    return v.f;
}

/* A 4-bit (or Q8_0) weight: `q` its stored values row after row, `a` the scales (fp16 [rows, nb],
 * int4: fp32 [rows, nb / group]), `m` Q4_1's minima (fp16 [rows, nb]). */
typedef struct {
    const uint8_t *q;
    const void *a;
    const uint16_t *m;
    int format;
    long nb, group;
} qweight;

/* An activation vector quantised for these products: `q` the int8 values, `d` each block's scale,
 * `sq` d * the sum of its int8 values; with Q_VNNI, `offset` the integer sums' starting values
 * (-8 or -128 times the sum of each int32 lane's four values; int4 and Q8_0). With Q_VNNI the values of blocks 2p and
 * 2p + 1 sit in one 64-byte row laid out as the weights' bytes unpack (see quantise_x). */
typedef struct {
    int8_t *q;
    float *d, *sq;
    int32_t *offset;
} qvec;

/* bytes and floats one quantised vector of n inputs takes (an odd block count padded to even) */
static inline long qvec_bytes(long n) { return (n / QBLOCK + 1) / 2 * 2 * QBLOCK; }
static inline long qvec_floats(long n) { return (n / QBLOCK + 2) & ~1L; }

static inline qvec qvec_at(char *base, long n) {
    qvec v;
    const long nb = qvec_floats(n);
    v.d = (float *)base; v.sq = v.d + nb;
    v.offset = (int32_t *)(v.sq + nb);
    v.q = (int8_t *)(v.offset + qvec_bytes(n) / 4);
    return v;
}
static inline long qvec_size(long n) { return 2 * qvec_floats(n) * (long)sizeof(float) + 2 * qvec_bytes(n); }

/* where weight i of a block lands in the quantised vector: with Q_VNNI, a pair of blocks (h = 0, 1)
 * fills 64 bytes in the order the weights unpack (the low nibbles of both blocks, then the high
 * ones; Q8_0 plainly); without, every block plainly */
static inline long qx_lane(int format, long b, long i) {
#if Q_VNNI
    const long h = b & 1, base = (b >> 1) * 64;
    if (format == FORMAT_Q8_0) return base + h * 32 + i;
    if (format == FORMAT_Q4_1) return base + (i / 16) * 32 + h * 16 + i % 16;
    return base + (i % 2) * 32 + h * 16 + i / 2;  /* int4: byte j holds weights 2j and 2j + 1 */
#else
    (void)format;
    return b * QBLOCK + i;
#endif
}

static void quantise_x(const float *x, long n, int format, qvec v) {
    const long nb = n / QBLOCK;
    for (long b = 0; b < nb; b++) {
        const float *xb = x + b * QBLOCK;
        float top = 0.f;
        for (int i = 0; i < QBLOCK; i++) top = fmaxf(top, fabsf(xb[i]));
        const float d = top / 127.f, inverse = top > 0.f ? 127.f / top : 0.f;
        int total = 0;
        for (int i = 0; i < QBLOCK; i++) {
            const int q = (int)lrintf(xb[i] * inverse);
            v.q[qx_lane(format, b, i)] = (int8_t)q;
            total += q;
        }
        v.d[b] = d; v.sq[b] = d * (float)total;
    }
    if (nb & 1) {  /* the phantom partner of an odd last block: zeros, which add nothing */
        for (int i = 0; i < QBLOCK; i++) v.q[qx_lane(format, nb, i)] = 0;
        v.d[nb] = v.sq[nb] = 0.f;
    }
#if Q_VNNI
    if (format != FORMAT_Q4_1) {
        const int shift = format == FORMAT_Q8_0 ? 128 : 8;
        for (long lane = 0; lane < (nb + 1) / 2 * 16; lane++) {
            const int8_t *q = v.q + 4 * lane;
            v.offset[lane] = -shift * (q[0] + q[1] + q[2] + q[3]);
        }
    }
#endif
}

static inline float q_scale(const qweight *w, long r, long b) {
    if (w->format == FORMAT_INT4) return ((const float *)w->a)[r * (w->nb / w->group) + b / w->group];
    return half_to_float(((const uint16_t *)w->a)[r * w->nb + b]);
}

#if Q_VNNI
/* A (the scale of each of 16 blocks from b0, c of them real) and B (Q4_1's minima) of row r */
static inline __attribute__((always_inline)) void q_scales16(const qweight *w, long r, long b0, long c, __m512i group_index,
                                                             __m512 *A, __m512 *B) {
    const __mmask16 k = (__mmask16)((1u << c) - 1);
    if (w->format == FORMAT_INT4) {
        const long per_row = w->nb / w->group, count = (c + w->group - 1) / w->group;
        const __m512 s = _mm512_maskz_loadu_ps((__mmask16)((1u << count) - 1),
                                               (const float *)w->a + r * per_row + b0 / w->group);
        *A = _mm512_permutexvar_ps(group_index, s);
    } else {
        *A = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, (const uint16_t *)w->a + r * w->nb + b0));
        if (w->format == FORMAT_Q4_1) *B = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, w->m + r * w->nb + b0));
    }
}

/* the 64 unpacked weights of block pair b / 2 of a nibble format's row (a lone last block: zeros beside it) */
static inline __attribute__((always_inline)) __m512i q_unpack_pair(const uint8_t *p, int tail) {
    const __m256i bytes =
        tail ? _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)p)) : _mm256_loadu_si256((const __m256i *)p);
    return _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(bytes), _mm256_srli_epi16(bytes, 4), 1),
                            _mm512_set1_epi8(0x0f));
}

/* y[0..R) = rows r..r+R of w against x: R rows against one read of each 64 inputs. `unpacked`, when
 * not NULL, holds the R rows' nibbles already unpacked (q_unpack_rows), row after row */
static inline __attribute__((always_inline)) void q_dot_rows_from(const qweight *w, const qvec *x, long r, const int R,
                                                                  float *y, const __m512i *unpacked) {
    const long nb = w->nb;
    const int plain = w->format == FORMAT_Q8_0, has_min = w->format == FORMAT_Q4_1;
    const long row_bytes = nb * (plain ? 32 : 16), block_bytes = plain ? 32 : 16;
    __m512 acc[4], acc_min[4];
    for (int i = 0; i < R; i++) acc[i] = acc_min[i] = _mm512_setzero_ps();
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const long pairs = (nb + 1) / 2;
    /* the int32 lanes of a pair's products belong to blocks 2j and 2j + 1 in this pattern */
    const __m512i pattern = plain ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
                                  : _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
    const long g = w->format == FORMAT_INT4 ? w->group : 1;
    const __m512i group_index = _mm512_set_epi32(15 / g, 14 / g, 13 / g, 12 / g, 11 / g, 10 / g, 9 / g, 8 / g, 7 / g,
                                                 6 / g, 5 / g, 4 / g, 3 / g, 2 / g, 1 / g, 0);
    for (long b0 = 0; b0 < nb; b0 += 16) {
        const long c = nb - b0 < 16 ? nb - b0 : 16;
        const __mmask16 k = (__mmask16)((1u << c) - 1);
        const __m512 dx = _mm512_maskz_loadu_ps(k, x->d + b0), sx = _mm512_maskz_loadu_ps(k, x->sq + b0);
        __m512 S[4];
        for (int i = 0; i < R; i++) {
            __m512 A, B = _mm512_setzero_ps();
            q_scales16(w, r + i, b0, c, group_index, &A, &B);
            S[i] = _mm512_mul_ps(A, dx);
            if (has_min) acc_min[i] = _mm512_fmadd_ps(B, sx, acc_min[i]);
        }
        for (long j = 0; 2 * j < c; j++) {
            const long b = b0 + 2 * j;
            const int tail = b + 1 == nb;
            const __m512i xv = _mm512_loadu_si512(x->q + b * QBLOCK);
            const __m512i start = has_min ? _mm512_setzero_si512() : _mm512_loadu_si512(x->offset + b * 8);
            const __m512i index = _mm512_add_epi32(pattern, _mm512_set1_epi32((int)(2 * j)));
            for (int i = 0; i < R; i++) {
                const uint8_t *p = w->q + (r + i) * row_bytes + b * block_bytes;
                __m512i wv;
                if (plain) {
                    wv = tail ? _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)p))
                              : _mm512_loadu_si512(p);
                    wv = _mm512_xor_si512(wv, flip);
                } else if (unpacked)
                    wv = _mm512_load_si512(unpacked + i * pairs + b / 2);
                else
                    wv = q_unpack_pair(p, tail);
                const __m512i dot = _mm512_dpbusd_epi32(start, wv, xv);
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(index, S[i]), acc[i]);
            }
        }
    }
    for (int i = 0; i < R; i++) y[i] = _mm512_reduce_add_ps(acc[i]) + _mm512_reduce_add_ps(acc_min[i]);
}

static inline __attribute__((always_inline)) void q_dot_rows(const qweight *w, const qvec *x, long r, const int R,
                                                             float *y) {
    q_dot_rows_from(w, x, r, R, y, 0);
}

/* the nibbles of rows r..r+R unpacked once, for the batched step to read against every token: the
 * shifts and masks then cost once per weight, not once per weight and token (a nibble format's rows
 * of up to MAX_Q_INPUT weights) */
static __thread __m512i thread_unpacked[4 * (MAX_Q_INPUT / 64 + 1)];
static const __m512i *q_unpack_rows(const qweight *w, long r, int R) {
    if (w->format == FORMAT_Q8_0) return 0;
    const long nb = w->nb, pairs = (nb + 1) / 2;
    for (int i = 0; i < R; i++)
        for (long j = 0; j < pairs; j++)
            thread_unpacked[i * pairs + j] = q_unpack_pair(w->q + ((r + i) * nb + 2 * j) * 16, 2 * j + 1 == nb);
    return thread_unpacked;
}
#define Q_UNPACKS 1
#else
static inline void q_dot_rows(const qweight *w, const qvec *x, long r, const int R, float *y) {
    const long nb = w->nb;
    for (int i = 0; i < R; i++) {
        float acc = 0.f, acc_min = 0.f;
        for (long b = 0; b < nb; b++) {
            const int8_t *xq = x->q + b * QBLOCK;
            int sum = 0;
            const float a = q_scale(w, r + i, b);
            if (w->format == FORMAT_Q8_0) {
                const int8_t *q = (const int8_t *)w->q + ((r + i) * nb + b) * QBLOCK;
                for (int k = 0; k < QBLOCK; k++) sum += q[k] * xq[k];
            } else {
                const uint8_t *q = w->q + ((r + i) * nb + b) * 16;
                if (w->format == FORMAT_Q4_1)
                    for (int k = 0; k < 16; k++) sum += (q[k] & 15) * xq[k] + (q[k] >> 4) * xq[k + 16];
                else
                    for (int k = 0; k < 16; k++) sum += ((q[k] & 15) - 8) * xq[2 * k] + ((q[k] >> 4) - 8) * xq[2 * k + 1];
                if (w->format == FORMAT_Q4_1) acc_min += half_to_float(w->m[(r + i) * nb + b]) * x->sq[b];
            }
            acc += a * x->d[b] * (float)sum;
        }
        y[i] = acc + acc_min;
    }
}
#endif

/* y[r] = W[r, :] . x for rows r0..r1 of a 4-bit or Q8_0 weight, four rows at a time */
static void q_rows_dot(const qweight *w, const qvec *x, float *y, long r0, long r1) {
    const long row_bytes = w->nb * (w->format == FORMAT_Q8_0 ? 32 : 16);
    long r = r0;
    for (; r + 4 <= r1; r += 4) {
        prefetch_next_group((const char *)w->q, r, r1, row_bytes);
        q_dot_rows(w, x, r, 4, y + r);
    }
    for (; r < r1; r++) q_dot_rows(w, x, r, 1, y + r);
}

static inline int is_quantised(int format) { return format >= FORMAT_Q4_1; }

/* each thread's own quantised copy of the vector its next products read (the batch-1 step) */
static __thread char thread_qvec[2 * (MAX_Q_INPUT / QBLOCK + 2) * sizeof(float) + 2 * (MAX_Q_INPUT + 64)]
    __attribute__((aligned(64)));

/* y[r] for rows r0..r1 in any format: quantised formats read `qx`, the others `x` */
static void rows_dot_any(const void *weight, const void *scale, const void *min, int format, long group, const float *x,
                         const qvec *qx, float *y, long r0, long r1, long n) {
    if (is_quantised(format)) {
        const qweight w = {(const uint8_t *)weight, scale, (const uint16_t *)min, format, n / QBLOCK, group};
        q_rows_dot(&w, qx, y, r0, r1);
    } else
        rows_dot(weight, (const float *)scale, format, x, y, r0, r1, n);
}

/* Where the batch-1 step's time goes, in a build with -DINFRA_PROFILE (benchmarks/decode_profile.py
 * makes one): thread 0's wall time between marks, added up by phase, read (and reset) by
 * infra_native_profile. A product's phase ends after the barrier that follows it, so it holds the
 * wait for the slower thread; fork/join is entering and leaving a parallel region. The plain build
 * has no marks. */
enum { PROF_SERIAL, PROF_FORK_JOIN, PROF_QUANTISE, PROF_PRODUCTS, PROF_ATTENTION, PROF_HEAD, PROF_ARGMAX, PROF_COUNT };
#if defined(INFRA_PROFILE) && defined(_OPENMP)
static double profile_seconds[PROF_COUNT], profile_last;
#define MARK_START() (profile_last = omp_get_wtime())
#define MARK(phase)                                                                                \
    do {                                                                                           \
        if (omp_get_thread_num() == 0) {                                                           \
            const double now_ = omp_get_wtime();                                                   \
            profile_seconds[phase] += now_ - profile_last;                                         \
            profile_last = now_;                                                                   \
        }                                                                                          \
    } while (0)
#define PROFILE_BARRIER() _Pragma("omp barrier")
int infra_native_profile(double *out) {
    for (int i = 0; i < PROF_COUNT; i++) { out[i] = profile_seconds[i]; profile_seconds[i] = 0.0; }
    return PROF_COUNT;
}
#else
#define MARK_START() ((void)0)
#define MARK(phase) ((void)0)
#define PROFILE_BARRIER()
int infra_native_profile(double *out) { (void)out; return 0; }  /* not a profiling build */
#endif

/* rows in blocks of 16 (four groups of four), dealt out evenly to the threads */
#define ROW_BLOCK 16

/* this thread's share [*r0, *r1) of `rows` rows */
static void my_rows(long rows, long *r0, long *r1, int thread, int threads) {
    long blocks = (rows + ROW_BLOCK - 1) / ROW_BLOCK;
    long b0 = blocks * thread / threads, b1 = blocks * (thread + 1) / threads;
    *r0 = b0 * ROW_BLOCK;
    *r1 = b1 * ROW_BLOCK < rows ? b1 * ROW_BLOCK : rows;
}

static void rmsnorm(const float *x, const float *weight, float *out, int n, float eps) {
    double ss = 0.0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float scale = 1.0f / sqrtf((float)(ss / n) + eps);
    for (int i = 0; i < n; i++) out[i] = weight[i] * (x[i] * scale);
}

/* rotate-half RoPE of one head vector in place: pairs (j, j + half) */
static void rope(float *v, const float *cos_row, const float *sin_row, int head_dim) {
    int half = head_dim / 2;
    for (int j = 0; j < half; j++) {
        float a = v[j], b = v[j + half];
        v[j] = a * cos_row[j] - b * sin_row[j];
        v[j + half] = b * cos_row[j + half] + a * sin_row[j + half];
    }
}

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

/* One query head over positions 0..pos: softmax(q . k_j * scale) . v_j into out[hd]. Key j is at
 * K + slot(j) * stride (V alike), slot(j) = j for a contiguous cache, or through a block table,
 * table[j / block_size] * block_size + j % block_size. `s` holds pos + 1 scores. */
static void attend(const float *q, const float *K, const float *V, const long *table, long block_size, long stride,
                   long pos, long hd, float scale, float *s, float *out) {
    float top = -INFINITY;
    for (long j = 0; j <= pos; j++) {
        const long slot = table ? table[j / block_size] * block_size + j % block_size : j;
        const float *k = K + slot * stride;
        float dot = 0.f;
        for (long i = 0; i < hd; i++) dot += q[i] * k[i];
        s[j] = dot * scale;
        if (s[j] > top) top = s[j];
    }
    float total = 0.f;
    for (long j = 0; j <= pos; j++) { s[j] = expf(s[j] - top); total += s[j]; }
    for (long i = 0; i < hd; i++) out[i] = 0.f;
    for (long j = 0; j <= pos; j++) {
        const long slot = table ? table[j / block_size] * block_size + j % block_size : j;
        const float *v = V + slot * stride;
        const float w = s[j] / total;
        for (long i = 0; i < hd; i++) out[i] += w * v[i];
    }
}

/* The step. `params` holds P_COUNT pointers per layer; `scratch` holds at least
 * 3 * hidden + (2 * heads + 2 * kv_heads) * head_dim + 2 * inter + heads * capacity floats
 * (infra_native_scratch_floats). `embed` is the fp32 embedding table; the projections and
 * `lm_head` are in the step's format (int8: with `lm_head_scale` and the layers' scales), except
 * that 4-bit steps read a Q8_0 head (dims[D_HEAD_FORMAT]; int4 scales cover dims[D_GROUP] blocks).
 * Writes the logits [vocab] and returns their argmax. */
long infra_native_scratch_floats(const long *dims) {
    return 3 * dims[D_HIDDEN] + (2 * dims[D_HEADS] + 2 * dims[D_KV_HEADS]) * dims[D_HEAD_DIM]
           + 2 * dims[D_INTER] + dims[D_HEADS] * dims[D_CAPACITY];
}

int infra_native_decode_step(const long *dims, float eps, void *const *params, const float *embed,
                             const float *final_norm, const void *lm_head, const float *lm_head_scale, const float *cos_row,
                             const float *sin_row, float *scratch, float *logits) {
    const long d = dims[D_HIDDEN], H = dims[D_HEADS], KV = dims[D_KV_HEADS], hd = dims[D_HEAD_DIM];
    const long inter = dims[D_INTER], vocab = dims[D_VOCAB], layers = dims[D_LAYERS];
    const long capacity = dims[D_CAPACITY], pos = dims[D_POS], token = dims[D_TOKEN];
    const int threads = (int)dims[D_THREADS], format = (int)dims[D_FORMAT], head_format = (int)dims[D_HEAD_FORMAT];
    const long q_rows = H * hd, kv_rows = KV * hd, qkv_rows = q_rows + 2 * kv_rows;
    const long group = H / KV, qgroup = dims[D_GROUP];
    const int quantised = is_quantised(format);
    const long widest = d > inter ? (d > q_rows ? d : q_rows) : (inter > q_rows ? inter : q_rows);
    const float attn_scale = 1.0f / sqrtf((float)hd);

    float *x = scratch;                 /* residual stream [d] */
    float *h = x + d;                   /* normed input [d] */
    float *qkv = h + d;                 /* [q | k | v] */
    float *attn = qkv + qkv_rows;       /* attention output [H * hd] */
    float *act = attn + q_rows;         /* silu(gate) * up [inter] */
    float *up = act + inter;            /* up [inter] */
    float *tmp = up + inter;            /* o_proj / down_proj output [d] */
    float *scores = tmp + d;            /* [H, capacity] */

    MARK_START();
    memcpy(x, embed + token * d, d * sizeof(float));

    for (long l = 0; l < layers; l++) {
        void *const *p = params + l * P_COUNT;
        float *keys = (float *)p[P_KEYS], *values = (float *)p[P_VALUES];
        rmsnorm(x, (const float *)p[P_IN_NORM], h, (int)d, eps);
        MARK(PROF_SERIAL);
        #pragma omp parallel num_threads(threads)
        {
            const int t = THREAD_ID(), nt = THREAD_COUNT();
            long r0, r1;
            MARK(PROF_FORK_JOIN);
            qvec qx = qvec_at(thread_qvec, quantised ? widest : 0);
            if (quantised) quantise_x(h, d, format, qx);
            MARK(PROF_QUANTISE);
            /* q, k and v: one range of rows over the three weights */
            my_rows(qkv_rows, &r0, &r1, t, nt);
            long a = r0 < q_rows ? r0 : q_rows, b = r1 < q_rows ? r1 : q_rows;
            if (a < b) rows_dot_any(p[P_Q], p[P_Q_SCALE], p[P_Q_MIN], format, qgroup, h, &qx, qkv, a, b, d);
            a = r0 > q_rows ? r0 : q_rows; b = r1 < q_rows + kv_rows ? r1 : q_rows + kv_rows;
            if (a < b)
                rows_dot_any(p[P_K], p[P_K_SCALE], p[P_K_MIN], format, qgroup, h, &qx, qkv + q_rows, a - q_rows,
                             b - q_rows, d);
            a = r0 > q_rows + kv_rows ? r0 : q_rows + kv_rows; b = r1;
            if (a < b)
                rows_dot_any(p[P_V], p[P_V_SCALE], p[P_V_MIN], format, qgroup, h, &qx, qkv + q_rows + kv_rows,
                             a - q_rows - kv_rows, b - q_rows - kv_rows, d);
            #pragma omp barrier
            MARK(PROF_PRODUCTS);
            #pragma omp single
            {
                if (p[P_QB]) for (long i = 0; i < q_rows; i++) qkv[i] += ((const float *)p[P_QB])[i];
                if (p[P_KB]) for (long i = 0; i < kv_rows; i++) qkv[q_rows + i] += ((const float *)p[P_KB])[i];
                if (p[P_VB]) for (long i = 0; i < kv_rows; i++) qkv[q_rows + kv_rows + i] += ((const float *)p[P_VB])[i];
                for (long g = 0; g < H; g++) rope(qkv + g * hd, cos_row, sin_row, (int)hd);
                for (long g = 0; g < KV; g++) {
                    float *k = qkv + q_rows + g * hd, *v = qkv + q_rows + kv_rows + g * hd;
                    rope(k, cos_row, sin_row, (int)hd);
                    memcpy(keys + (g * capacity + pos) * hd, k, hd * sizeof(float));
                    memcpy(values + (g * capacity + pos) * hd, v, hd * sizeof(float));
                }
            }
            MARK(PROF_SERIAL);
            /* attention: query heads dealt out to the threads; each reads its K/V head's cache */
            for (long g = t; g < H; g += nt) {
                const float *q = qkv + g * hd;
                const float *K = keys + (g / group) * capacity * hd, *V = values + (g / group) * capacity * hd;
                attend(q, K, V, 0, 1, hd, pos, hd, attn_scale, scores + g * capacity, attn + g * hd);
            }
            #pragma omp barrier
            MARK(PROF_ATTENTION);
            my_rows(d, &r0, &r1, t, nt);
            if (quantised) quantise_x(attn, q_rows, format, qx);
            MARK(PROF_QUANTISE);
            rows_dot_any(p[P_O], p[P_O_SCALE], p[P_O_MIN], format, qgroup, attn, &qx, tmp, r0, r1, q_rows);
            #pragma omp barrier
            MARK(PROF_PRODUCTS);
            #pragma omp single
            {
                for (long i = 0; i < d; i++) x[i] += tmp[i] + (p[P_OB] ? ((const float *)p[P_OB])[i] : 0.f);
                rmsnorm(x, (const float *)p[P_POST_NORM], h, (int)d, eps);
            }
            MARK(PROF_SERIAL);
            /* gate and up: the same rows of both, combined as they are made */
            my_rows(inter, &r0, &r1, t, nt);
            if (quantised) quantise_x(h, d, format, qx);
            MARK(PROF_QUANTISE);
            rows_dot_any(p[P_GATE], p[P_GATE_SCALE], p[P_GATE_MIN], format, qgroup, h, &qx, act, r0, r1, d);
            rows_dot_any(p[P_UP], p[P_UP_SCALE], p[P_UP_MIN], format, qgroup, h, &qx, up, r0, r1, d);
            for (long i = r0; i < r1; i++) act[i] = silu(act[i]) * up[i];
            #pragma omp barrier
            MARK(PROF_PRODUCTS);
            my_rows(d, &r0, &r1, t, nt);
            if (quantised) quantise_x(act, inter, format, qx);
            MARK(PROF_QUANTISE);
            rows_dot_any(p[P_DOWN], p[P_DOWN_SCALE], p[P_DOWN_MIN], format, qgroup, act, &qx, tmp, r0, r1, inter);
            PROFILE_BARRIER();
            MARK(PROF_PRODUCTS);
        }
        MARK(PROF_FORK_JOIN);
        for (long i = 0; i < d; i++) x[i] += tmp[i];
    }

    rmsnorm(x, final_norm, h, (int)d, eps);
    MARK(PROF_SERIAL);
    #pragma omp parallel num_threads(threads)
    {
        const int t = THREAD_ID(), nt = THREAD_COUNT();
        long r0, r1;
        MARK(PROF_FORK_JOIN);
        my_rows(vocab, &r0, &r1, t, nt);
        qvec qx = qvec_at(thread_qvec, d);
        if (is_quantised(head_format)) quantise_x(h, d, head_format, qx);
        MARK(PROF_QUANTISE);
        rows_dot_any(lm_head, lm_head_scale, 0, head_format, 1, h, &qx, logits, r0, r1, d);
        PROFILE_BARRIER();
        MARK(PROF_HEAD);
    }
    MARK(PROF_FORK_JOIN);
    long best = 0;
    for (long i = 1; i < vocab; i++) if (logits[i] > logits[best]) best = i;
    MARK(PROF_ARGMAX);
    return (int)best;
}

/* ---------------------------------------------------------------------------------------------
 * The batched step: T tokens of a continuous-batching engine step (decodes and short prefill
 * chunks of several sequences, flattened), their K/V in the serving engine's paged store.
 *
 * At batch 8 a decode step still reads every weight once, but does 16 flops with each, not 2: the
 * products sit between bandwidth-bound and compute-bound, and the row-at-a-time dot products of
 * the batch-1 step (a horizontal sum per row and token) run out of arithmetic. So the batched
 * step reads its weights in **panels**: PANEL output rows stored input-major, [n][PANEL], one
 * panel after another (infra_lib.serving.native_runner packs them once, at load time). A panel
 * streams from memory once, contiguously, and every TILE tokens' sums for its PANEL rows stay in
 * vector registers: each weight vector loaded is multiplied by TILE broadcast inputs, and no
 * horizontal sum is left at the end (the classic GEMM micro-kernel, with the weights streaming).
 * ------------------------------------------------------------------------------------------- */

/* The sums are GCC/Clang vector types (vector_size), which the compiler maps onto the CPU's
 * widest registers: it keeps TILE x PANEL_VECS of them in registers and fuses each multiply-add.
 * (Left to the auto-vectoriser, the same loops came out scalar for AVX2: 6 GFLOP/s against 95.) */
#if defined(__AVX512F__)
#define VLANES 16 /* fp32 lanes of one 512-bit register */
#define TILE 8    /* tokens at a time: 16 accumulators of the 32 registers */
#elif defined(__AVX__)
#define VLANES 8  /* 256-bit */
#define TILE 6    /* 12 accumulators of 16 */
#else
#define VLANES 4  /* 128-bit (SSE2, NEON) */
#define TILE 6
#endif
#define PANEL_VECS 2                   /* vectors of weights per panel row */
#define PANEL (VLANES * PANEL_VECS)    /* output rows per panel */
typedef float vfloat __attribute__((vector_size(VLANES * 4)));
typedef uint16_t vhalf __attribute__((vector_size(VLANES * 2)));
typedef uint32_t vword __attribute__((vector_size(VLANES * 4)));
typedef int8_t vbyte __attribute__((vector_size(VLANES)));

/* VLANES consecutive weights as fp32 lanes (unaligned loads) */
static inline vfloat panel_fp32(const float *p) { vfloat v; memcpy(&v, p, sizeof v); return v; }
static inline vfloat panel_bf16(const uint16_t *p) {
    vhalf h; memcpy(&h, p, sizeof h);
    vword u = __builtin_convertvector(h, vword) << 16;  /* bf16 is the upper half of an fp32 */
    vfloat v; memcpy(&v, &u, sizeof v); return v;
}
static inline vfloat panel_int8(const int8_t *p) { vbyte q; memcpy(&q, p, sizeof q); return __builtin_convertvector(q, vfloat); }

/* how far ahead of the weights being multiplied to ask for the panel's next bytes; measured on
 * thirty [1536, 576] fp32 weights at 8 tokens, 2 threads, best of 7: none 22 GB/s, 1 KB 20,
 * 2 KB 39, 4 KB 42 (2 and 4 KB alike from run to run) */
#define PANEL_PREFETCH_BYTES 2048

int infra_native_panel_width(void) { return PANEL; }

/* dims[] of the batched step */
enum {
    B_HIDDEN, B_HEADS, B_KV_HEADS, B_HEAD_DIM, B_INTER, B_VOCAB, B_LAYERS, B_MAX_CONTEXT, B_ROWS, B_SAMPLES,
    B_TABLE_WIDTH, B_BLOCK_SIZE, B_THREADS, B_FORMAT, B_GROUP, B_HEAD_FORMAT, B_COUNT
};
/* per-layer pointers of the batched step; every projection in fp32, bf16 or int8 is packed in panels
 * ([rows / PANEL panels, rounded up][n][PANEL], the last panel zero-padded); 4-bit ones stay in
 * their rows of blocks, as the batch-1 step reads them (the *_MIN pointers: Q4_1's minima); q, k
 * and v as one weight */
enum {
    BP_IN_NORM, BP_QKV, BP_QKV_SCALE, BP_QB, BP_KB, BP_VB, BP_O, BP_O_SCALE, BP_OB, BP_POST_NORM, BP_GATE,
    BP_GATE_SCALE, BP_UP, BP_UP_SCALE, BP_DOWN, BP_DOWN_SCALE, BP_KEYS, BP_VALUES,
    BP_QKV_MIN, BP_O_MIN, BP_GATE_MIN, BP_UP_MIN, BP_DOWN_MIN, BP_COUNT
};
/* each token's row of `rows` [T, ROW_FIELDS] */
enum { R_TOKEN, R_POSITION, R_SLOT, R_SEQUENCE, ROW_FIELDS };

int infra_native_batch_dim_count(void) { return B_COUNT; }
int infra_native_batch_param_count(void) { return BP_COUNT; }
int infra_native_row_fields(void) { return ROW_FIELDS; }

/* One panel against TT tokens: acc[a] = sum_i P[i][:] * X[a * ldx + i], then the sums of rows
 * j < valid stored to Y[a * ldy + j], times scale[j] when there is a scale (int8). */
#define PANEL_TILE(NAME, TYPE, LOAD, TT)                                                           \
    static inline void NAME(const TYPE *P, const float *scale, const float *X, long ldx, float *Y,  \
                            long ldy, long n, long valid) {                                        \
        vfloat acc[TT][PANEL_VECS];                                                                \
        for (int a = 0; a < TT; a++)                                                               \
            for (int v = 0; v < PANEL_VECS; v++) acc[a][v] = (vfloat){0};                          \
        for (long i = 0; i < n; i++) {                                                             \
            const TYPE *w = P + i * PANEL;                                                         \
            for (int b = 0; b < PANEL * (int)sizeof(TYPE); b += 64)                                \
                __builtin_prefetch((const char *)w + PANEL_PREFETCH_BYTES + b, 0, 3);              \
            vfloat wv[PANEL_VECS];                                                                 \
            for (int v = 0; v < PANEL_VECS; v++) wv[v] = LOAD(w + v * VLANES);                     \
            for (int a = 0; a < TT; a++) {                                                         \
                const vfloat xv = (vfloat){0} + X[a * ldx + i];                                    \
                for (int v = 0; v < PANEL_VECS; v++) acc[a][v] += xv * wv[v];                      \
            }                                                                                      \
        }                                                                                          \
        for (int a = 0; a < TT; a++) {                                                             \
            float sums[PANEL];                                                                     \
            memcpy(sums, acc[a], sizeof sums);                                                     \
            for (long j = 0; j < valid; j++) Y[a * ldy + j] = scale ? sums[j] * scale[j] : sums[j]; \
        }                                                                                          \
    }

/* Panels p0..p1 of a packed weight with `rows` real rows against T tokens: TILE tokens at a time,
 * then the rest in one tile of their own size (a tile of one token would hold two accumulators
 * and wait on each multiply-add's latency) */
#define PANELS_DOT(NAME, TYPE, LOAD)                                                               \
    PANEL_TILE(NAME##_1, TYPE, LOAD, 1)                                                           \
    PANEL_TILE(NAME##_2, TYPE, LOAD, 2)                                                           \
    PANEL_TILE(NAME##_3, TYPE, LOAD, 3)                                                           \
    PANEL_TILE(NAME##_4, TYPE, LOAD, 4)                                                           \
    PANEL_TILE(NAME##_5, TYPE, LOAD, 5)                                                           \
    PANEL_TILE(NAME##_6, TYPE, LOAD, 6)                                                           \
    PANEL_TILE(NAME##_7, TYPE, LOAD, 7)                                                           \
    PANEL_TILE(NAME##_8, TYPE, LOAD, 8)                                                           \
    static void NAME(const TYPE *W, const float *scale, const float *X, long ldx, long T, float *Y, long ldy, \
                     long p0, long p1, long rows, long n) {                                        \
        for (long p = p0; p < p1; p++) {                                                           \
            const TYPE *P = W + p * n * PANEL;                                                     \
            const long r = p * PANEL, valid = rows - r < PANEL ? rows - r : PANEL;                 \
            const float *sc = scale ? scale + r : 0;                                               \
            for (long t = 0; t < T; t += TILE) {                                                   \
                const float *x = X + t * ldx;                                                      \
                float *y = Y + t * ldy + r;                                                        \
                switch (T - t < TILE ? T - t : TILE) {                                             \
                case 1: NAME##_1(P, sc, x, ldx, y, ldy, n, valid); break;                          \
                case 2: NAME##_2(P, sc, x, ldx, y, ldy, n, valid); break;                          \
                case 3: NAME##_3(P, sc, x, ldx, y, ldy, n, valid); break;                          \
                case 4: NAME##_4(P, sc, x, ldx, y, ldy, n, valid); break;                          \
                case 5: NAME##_5(P, sc, x, ldx, y, ldy, n, valid); break;                          \
                case 6: NAME##_6(P, sc, x, ldx, y, ldy, n, valid); break;                          \
                case 7: NAME##_7(P, sc, x, ldx, y, ldy, n, valid); break;                          \
                default: NAME##_8(P, sc, x, ldx, y, ldy, n, valid); break;                         \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }

PANELS_DOT(panels_fp32, float, panel_fp32)
PANELS_DOT(panels_bf16, uint16_t, panel_bf16)
PANELS_DOT(panels_int8, int8_t, panel_int8)

/* Y[t, r] = W[r, :] . X[t, :] (times scale[r] for int8) for the rows of this thread's panels */
static void panels_dot(const void *W, const float *scale, int format, const float *X, long ldx, long T, float *Y,
                       long ldy, long rows, long n, int thread, int threads) {
    const long panels = (rows + PANEL - 1) / PANEL;
    const long p0 = panels * thread / threads, p1 = panels * (thread + 1) / threads;
    if (format == FORMAT_FP32) panels_fp32((const float *)W, 0, X, ldx, T, Y, ldy, p0, p1, rows, n);
    else if (format == FORMAT_BF16) panels_bf16((const uint16_t *)W, 0, X, ldx, T, Y, ldy, p0, p1, rows, n);
    else panels_int8((const int8_t *)W, scale, X, ldx, T, Y, ldy, p0, p1, rows, n);
}

/* the batched step's 4-bit products: this thread's panels' worth of rows (as panels_dot splits
 * them), four rows at a time, each group against every token's quantised input in turn (the
 * group's bytes stay in the first-level cache meanwhile); token t's input is the qvec at
 * qx + t * qx_size */
static void q_rows_dot_tokens(const qweight *w, char *qx, long qx_size, long input, long T, float *Y, long ldy,
                              long rows, int thread, int threads) {
    const long panels = (rows + PANEL - 1) / PANEL;
    const long r0 = panels * thread / threads * PANEL, r1e = panels * (thread + 1) / threads * PANEL;
    const long r1 = r1e < rows ? r1e : rows;
    const long row_bytes = w->nb * (w->format == FORMAT_Q8_0 ? 32 : 16);
    long r = r0;
    for (; r + 4 <= r1; r += 4) {
        prefetch_next_group((const char *)w->q, r, r1, row_bytes);
#ifdef Q_UNPACKS
        const __m512i *unpacked = T > 1 ? q_unpack_rows(w, r, 4) : 0;
        for (long t = 0; t < T; t++) {
            const qvec x = qvec_at(qx + t * qx_size, input);
            if (unpacked) q_dot_rows_from(w, &x, r, 4, Y + t * ldy + r, unpacked);
            else q_dot_rows(w, &x, r, 4, Y + t * ldy + r);
        }
#else
        for (long t = 0; t < T; t++) {
            const qvec x = qvec_at(qx + t * qx_size, input);
            q_dot_rows(w, &x, r, 4, Y + t * ldy + r);
        }
#endif
    }
    for (; r < r1; r++)
        for (long t = 0; t < T; t++) {
            const qvec x = qvec_at(qx + t * qx_size, input);
            q_dot_rows(w, &x, r, 1, Y + t * ldy + r);
        }
}

/* the widest input any product of the batched step takes */
static long batch_widest(const long *dims) {
    const long d = dims[B_HIDDEN], inter = dims[B_INTER], q_rows = dims[B_HEADS] * dims[B_HEAD_DIM];
    return d > inter ? (d > q_rows ? d : q_rows) : (inter > q_rows ? inter : q_rows);
}

/* Y[t, r] = W[r, :] . X[t, :] in any format: panels for fp32, bf16 and int8; 4-bit weights and the
 * Q8_0 head against the tokens' quantised inputs (qx, made beforehand) */
static void batch_dot(const void *W, const void *scale, const void *min, int format, long group, const float *X,
                      long ldx, long T, float *Y, long ldy, long rows, long n, char *qx, long qx_size, long widest,
                      int thread, int threads) {
    if (is_quantised(format)) {
        const qweight w = {(const uint8_t *)W, scale, (const uint16_t *)min, format, n / QBLOCK, group};
        q_rows_dot_tokens(&w, qx, qx_size, widest, T, Y, ldy, rows, thread, threads);
    } else
        panels_dot(W, (const float *)scale, format, X, ldx, T, Y, ldy, rows, n, thread, threads);
}

/* Scratch floats the batched step needs for dims[B_ROWS] tokens and dims[B_THREADS] threads:
 * per token 3 * hidden + (2 * heads + 2 * kv_heads) * head_dim + 2 * inter, and per thread one
 * row of attention scores as long as the longest context; with 4-bit weights, per token one
 * quantised input as wide as the widest product's */
long infra_native_batch_scratch_floats(const long *dims) {
    const long quantised = is_quantised((int)dims[B_FORMAT]) || is_quantised((int)dims[B_HEAD_FORMAT]);
    return dims[B_ROWS] * (3 * dims[B_HIDDEN] + (2 * dims[B_HEADS] + 2 * dims[B_KV_HEADS]) * dims[B_HEAD_DIM]
                           + 2 * dims[B_INTER])
           + dims[B_THREADS] * dims[B_MAX_CONTEXT]
           + (quantised ? dims[B_ROWS] * (qvec_size(batch_widest(dims)) / 4 + 16) + 16 : 0);
}

/* One engine step over T tokens. `rows` [T, ROW_FIELDS]: each token's id, position, KV slot and
 * sequence (an index into `tables`, [sequences, table_width] block ids). Each layer writes every
 * token's K/V into its slot of that layer's paged store (BP_KEYS / BP_VALUES point at its
 * [blocks, block_size, kv_heads, head_dim] tensors) before any token attends, so a prefill chunk's
 * tokens see each other: the token at position p attends to positions 0..p of its sequence.
 * `cos`/`sin` are the full rope tables [max_position, head_dim]; `lm_head` is packed in panels like
 * the projections. Writes the logits of the B_SAMPLES tokens listed in `samples` to `logits`
 * [B_SAMPLES, vocab]. Returns 0, or -1 when a position lies outside 0..B_MAX_CONTEXT - 1. */
int infra_native_batch_step(const long *dims, float eps, void *const *params, const float *embed,
                            const float *final_norm, const void *lm_head, const float *lm_head_scale,
                            const float *cos, const float *sin, const long *rows, const long *tables,
                            const long *samples, float *scratch, float *logits) {
    const long d = dims[B_HIDDEN], H = dims[B_HEADS], KV = dims[B_KV_HEADS], hd = dims[B_HEAD_DIM];
    const long inter = dims[B_INTER], vocab = dims[B_VOCAB], layers = dims[B_LAYERS];
    const long max_context = dims[B_MAX_CONTEXT], T = dims[B_ROWS], S = dims[B_SAMPLES];
    const long width = dims[B_TABLE_WIDTH], block_size = dims[B_BLOCK_SIZE];
    const int threads = (int)dims[B_THREADS], format = (int)dims[B_FORMAT], head_format = (int)dims[B_HEAD_FORMAT];
    const long q_rows = H * hd, kv_rows = KV * hd, qkv_rows = q_rows + 2 * kv_rows;
    const long group = H / KV, qgroup = dims[B_GROUP];
    const int quantised = is_quantised(format);
    const float attn_scale = 1.0f / sqrtf((float)hd);
    const long widest = batch_widest(dims), qx_size = (qvec_size(widest) + 63) / 64 * 64;
    for (long t = 0; t < T; t++)
        if (rows[t * ROW_FIELDS + R_POSITION] >= max_context || rows[t * ROW_FIELDS + R_POSITION] < 0) return -1;

    float *x = scratch;                 /* residual stream [T, d] */
    float *h = x + T * d;               /* normed input [T, d] */
    float *qkv = h + T * d;             /* [T, q | k | v] */
    float *attn = qkv + T * qkv_rows;   /* attention output [T, H * hd] */
    float *act = attn + T * q_rows;     /* silu(gate) * up [T, inter] */
    float *up = act + T * inter;        /* up [T, inter] */
    float *tmp = up + T * inter;        /* o_proj / down_proj output [T, d] */
    float *scores = tmp + T * d;        /* [threads, max_context] */
    /* the tokens' quantised inputs of the next 4-bit product [T][qx_size bytes], 64-byte aligned */
    char *qx = (char *)(((uintptr_t)(scores + threads * max_context) + 63) & ~(uintptr_t)63);

    for (long t = 0; t < T; t++) memcpy(x + t * d, embed + rows[t * ROW_FIELDS + R_TOKEN] * d, d * sizeof(float));

    #pragma omp parallel num_threads(threads)
    {
        const int tid = THREAD_ID(), nt = THREAD_COUNT();
        float *s = scores + tid * max_context;
        const long t0 = T * tid / nt, t1 = T * (tid + 1) / nt;  /* this thread's tokens, for per-token work */
        for (long l = 0; l < layers; l++) {
            void *const *p = params + l * BP_COUNT;
            float *keys = (float *)p[BP_KEYS], *values = (float *)p[BP_VALUES];
            for (long t = t0; t < t1; t++) {
                rmsnorm(x + t * d, (const float *)p[BP_IN_NORM], h + t * d, (int)d, eps);
                if (quantised) quantise_x(h + t * d, d, format, qvec_at(qx + t * qx_size, widest));
            }
            #pragma omp barrier
            batch_dot(p[BP_QKV], p[BP_QKV_SCALE], p[BP_QKV_MIN], format, qgroup, h, d, T, qkv, qkv_rows, qkv_rows, d,
                      qx, qx_size, widest, tid, nt);
            #pragma omp barrier
            /* biases, RoPE at each token's position, and every token's K/V into its slot */
            for (long t = t0; t < t1; t++) {
                float *row = qkv + t * qkv_rows;
                const long pos = rows[t * ROW_FIELDS + R_POSITION], slot = rows[t * ROW_FIELDS + R_SLOT];
                if (p[BP_QB]) for (long i = 0; i < q_rows; i++) row[i] += ((const float *)p[BP_QB])[i];
                if (p[BP_KB]) for (long i = 0; i < kv_rows; i++) row[q_rows + i] += ((const float *)p[BP_KB])[i];
                if (p[BP_VB]) for (long i = 0; i < kv_rows; i++) row[q_rows + kv_rows + i] += ((const float *)p[BP_VB])[i];
                for (long g = 0; g < H; g++) rope(row + g * hd, cos + pos * hd, sin + pos * hd, (int)hd);
                for (long g = 0; g < KV; g++) rope(row + q_rows + g * hd, cos + pos * hd, sin + pos * hd, (int)hd);
                memcpy(keys + slot * kv_rows, row + q_rows, kv_rows * sizeof(float));
                memcpy(values + slot * kv_rows, row + q_rows + kv_rows, kv_rows * sizeof(float));
            }
            #pragma omp barrier
            /* attention: (token, query head) pairs dealt out to the threads; each reads its
             * sequence's keys and values through the block table */
            for (long pair = tid; pair < T * H; pair += nt) {
                const long t = pair / H, g = pair % H, kvh = g / group;
                const long pos = rows[t * ROW_FIELDS + R_POSITION];
                const long *table = tables + rows[t * ROW_FIELDS + R_SEQUENCE] * width;
                const float *q = qkv + t * qkv_rows + g * hd;
                attend(q, keys + kvh * hd, values + kvh * hd, table, block_size, kv_rows, pos, hd, attn_scale, s,
                       attn + t * q_rows + g * hd);
            }
            #pragma omp barrier
            if (quantised) {
                for (long t = t0; t < t1; t++)
                    quantise_x(attn + t * q_rows, q_rows, format, qvec_at(qx + t * qx_size, widest));
                #pragma omp barrier
            }
            batch_dot(p[BP_O], p[BP_O_SCALE], p[BP_O_MIN], format, qgroup, attn, q_rows, T, tmp, d, d, q_rows, qx,
                      qx_size, widest, tid, nt);
            #pragma omp barrier
            for (long t = t0; t < t1; t++) {
                float *xt = x + t * d, *ot = tmp + t * d;
                for (long i = 0; i < d; i++) xt[i] += ot[i] + (p[BP_OB] ? ((const float *)p[BP_OB])[i] : 0.f);
                rmsnorm(xt, (const float *)p[BP_POST_NORM], h + t * d, (int)d, eps);
                if (quantised) quantise_x(h + t * d, d, format, qvec_at(qx + t * qx_size, widest));
            }
            #pragma omp barrier
            /* gate and up: the same panels of both, combined as they are made */
            batch_dot(p[BP_GATE], p[BP_GATE_SCALE], p[BP_GATE_MIN], format, qgroup, h, d, T, act, inter, inter, d, qx,
                      qx_size, widest, tid, nt);
            batch_dot(p[BP_UP], p[BP_UP_SCALE], p[BP_UP_MIN], format, qgroup, h, d, T, up, inter, inter, d, qx,
                      qx_size, widest, tid, nt);
            {
                const long panels = (inter + PANEL - 1) / PANEL;
                const long r0 = panels * tid / nt * PANEL, r1e = panels * (tid + 1) / nt * PANEL;
                const long r1 = r1e < inter ? r1e : inter;
                for (long t = 0; t < T; t++)
                    for (long i = r0; i < r1; i++) act[t * inter + i] = silu(act[t * inter + i]) * up[t * inter + i];
            }
            #pragma omp barrier
            if (quantised) {
                for (long t = t0; t < t1; t++)
                    quantise_x(act + t * inter, inter, format, qvec_at(qx + t * qx_size, widest));
                #pragma omp barrier
            }
            batch_dot(p[BP_DOWN], p[BP_DOWN_SCALE], p[BP_DOWN_MIN], format, qgroup, act, inter, T, tmp, d, d, inter,
                      qx, qx_size, widest, tid, nt);
            #pragma omp barrier
            for (long t = t0; t < t1; t++)
                for (long i = 0; i < d; i++) x[t * d + i] += tmp[t * d + i];
            #pragma omp barrier
        }
        /* the final norm of the tokens that sample, packed into h, then the head over them */
        for (long k = tid; k < S; k += nt) {
            rmsnorm(x + samples[k] * d, final_norm, h + k * d, (int)d, eps);
            if (is_quantised(head_format)) quantise_x(h + k * d, d, head_format, qvec_at(qx + k * qx_size, widest));
        }
        #pragma omp barrier
        batch_dot(lm_head, lm_head_scale, 0, head_format, 1, h, d, S, logits, vocab, vocab, d, qx, qx_size, widest, tid,
                  nt);
    }
    return 0;
}
