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

enum { FORMAT_FP32 = 0, FORMAT_BF16 = 1, FORMAT_INT8 = 2 };

/* per-layer pointers, in this order (the Python side fills them) */
enum {
    P_IN_NORM, P_Q, P_K, P_V, P_QB, P_KB, P_VB, P_O, P_OB, P_POST_NORM, P_GATE, P_UP, P_DOWN,
    P_KEYS, P_VALUES,
    /* int8 only (NULL otherwise): one fp32 scale per output row of each projection */
    P_Q_SCALE, P_K_SCALE, P_V_SCALE, P_O_SCALE, P_GATE_SCALE, P_UP_SCALE, P_DOWN_SCALE, P_COUNT
};

/* dims[]: model shape and this step */
enum {
    D_HIDDEN, D_HEADS, D_KV_HEADS, D_HEAD_DIM, D_INTER, D_VOCAB, D_LAYERS, D_CAPACITY, D_POS, D_TOKEN,
    D_THREADS, D_FORMAT, D_COUNT
};

int infra_native_abi(void) { return 3; }
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

/* The step. `params` holds P_COUNT pointers per layer; `scratch` holds at least
 * 3 * hidden + (2 * heads + 2 * kv_heads) * head_dim + 2 * inter + heads * capacity floats
 * (infra_native_scratch_floats). `embed` is the fp32 embedding table; the projections and
 * `lm_head` are in the step's format (int8: with `lm_head_scale` and the layers' scales).
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
    const int threads = (int)dims[D_THREADS], format = (int)dims[D_FORMAT];
    const long q_rows = H * hd, kv_rows = KV * hd, qkv_rows = q_rows + 2 * kv_rows;
    const long group = H / KV;
    const float attn_scale = 1.0f / sqrtf((float)hd);

    float *x = scratch;                 /* residual stream [d] */
    float *h = x + d;                   /* normed input [d] */
    float *qkv = h + d;                 /* [q | k | v] */
    float *attn = qkv + qkv_rows;       /* attention output [H * hd] */
    float *act = attn + q_rows;         /* silu(gate) * up [inter] */
    float *up = act + inter;            /* up [inter] */
    float *tmp = up + inter;            /* o_proj / down_proj output [d] */
    float *scores = tmp + d;            /* [H, capacity] */

    memcpy(x, embed + token * d, d * sizeof(float));

    for (long l = 0; l < layers; l++) {
        void *const *p = params + l * P_COUNT;
        float *keys = (float *)p[P_KEYS], *values = (float *)p[P_VALUES];
        rmsnorm(x, (const float *)p[P_IN_NORM], h, (int)d, eps);
        #pragma omp parallel num_threads(threads)
        {
            const int t = THREAD_ID(), nt = THREAD_COUNT();
            long r0, r1;
            /* q, k and v: one range of rows over the three weights */
            my_rows(qkv_rows, &r0, &r1, t, nt);
            long a = r0 < q_rows ? r0 : q_rows, b = r1 < q_rows ? r1 : q_rows;
            if (a < b) rows_dot(p[P_Q], p[P_Q_SCALE], format, h, qkv, a, b, d);
            a = r0 > q_rows ? r0 : q_rows; b = r1 < q_rows + kv_rows ? r1 : q_rows + kv_rows;
            if (a < b) rows_dot(p[P_K], p[P_K_SCALE], format, h, qkv + q_rows, a - q_rows, b - q_rows, d);
            a = r0 > q_rows + kv_rows ? r0 : q_rows + kv_rows; b = r1;
            if (a < b) rows_dot(p[P_V], p[P_V_SCALE], format, h, qkv + q_rows + kv_rows, a - q_rows - kv_rows,
                                b - q_rows - kv_rows, d);
            #pragma omp barrier
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
            /* attention: query heads dealt out to the threads; each reads its K/V head's cache */
            for (long g = t; g < H; g += nt) {
                const float *q = qkv + g * hd;
                const float *K = keys + (g / group) * capacity * hd, *V = values + (g / group) * capacity * hd;
                float *s = scores + g * capacity, *out = attn + g * hd;
                float top = -INFINITY;
                for (long j = 0; j <= pos; j++) {
                    float dot = 0.f;
                    for (long i = 0; i < hd; i++) dot += q[i] * K[j * hd + i];
                    s[j] = dot * attn_scale;
                    if (s[j] > top) top = s[j];
                }
                float total = 0.f;
                for (long j = 0; j <= pos; j++) { s[j] = expf(s[j] - top); total += s[j]; }
                for (long i = 0; i < hd; i++) out[i] = 0.f;
                for (long j = 0; j <= pos; j++) {
                    float w = s[j] / total;
                    for (long i = 0; i < hd; i++) out[i] += w * V[j * hd + i];
                }
            }
            #pragma omp barrier
            my_rows(d, &r0, &r1, t, nt);
            rows_dot(p[P_O], p[P_O_SCALE], format, attn, tmp, r0, r1, q_rows);
            #pragma omp barrier
            #pragma omp single
            {
                for (long i = 0; i < d; i++) x[i] += tmp[i] + (p[P_OB] ? ((const float *)p[P_OB])[i] : 0.f);
                rmsnorm(x, (const float *)p[P_POST_NORM], h, (int)d, eps);
            }
            /* gate and up: the same rows of both, combined as they are made */
            my_rows(inter, &r0, &r1, t, nt);
            rows_dot(p[P_GATE], p[P_GATE_SCALE], format, h, act, r0, r1, d);
            rows_dot(p[P_UP], p[P_UP_SCALE], format, h, up, r0, r1, d);
            for (long i = r0; i < r1; i++) act[i] = silu(act[i]) * up[i];
            #pragma omp barrier
            my_rows(d, &r0, &r1, t, nt);
            rows_dot(p[P_DOWN], p[P_DOWN_SCALE], format, act, tmp, r0, r1, inter);
        }
        for (long i = 0; i < d; i++) x[i] += tmp[i];
    }

    rmsnorm(x, final_norm, h, (int)d, eps);
    #pragma omp parallel num_threads(threads)
    {
        const int t = THREAD_ID(), nt = THREAD_COUNT();
        long r0, r1;
        my_rows(vocab, &r0, &r1, t, nt);
        rows_dot(lm_head, lm_head_scale, format, h, logits, r0, r1, d);
    }
    long best = 0;
    for (long i = 1; i < vocab; i++) if (logits[i] > logits[best]) best = i;
    return (int)best;
}
